//! `--optimizer sgd` (megatron-core's: torch's SGD with `--sgd-momentum` and L2 weight decay)
//! beside the default Adam: every layout trains the same model as one rank, the momentum
//! buffer is checkpointed and resumes under another layout, and a checkpoint of the other
//! optimizer is refused by name. The update itself is checked against torch's formula in the
//! tensor crate (`backend_cpu_sgd.rs`) and, sharded, in megatron-core.

mod common;

use common::*;
use megatron_training::checkpointing::{load_checkpoint, LoadedCheckpoint, TRACKER};
use megatron_training::{pretrain, TrainSummary};

/// 4 layers so that PP 2 splits them; vocabulary padding 64 at one rank and at TP 2.
const MODEL: &[&str] = &[
    "--num-layers",
    "4",
    "--make-vocab-size-divisible-by",
    "32",
    "--lr",
    "0.05",
];

fn run(dir: &std::path::Path, name: &str, flags: &[&str]) -> (TrainSummary, LoadedCheckpoint) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let v = [MODEL, &["--train-iters", "5", "--save", &s], flags].concat();
    let summary = pretrain(&args(&v)).unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

#[test]
fn sgd_trains_the_same_model_in_every_layout_as_one_rank() {
    let dir = tmpdir("sgd-layouts");
    let sgd = ["--optimizer", "sgd"];
    let serial = run(&dir, "serial", &sgd);
    let adam = run(&dir, "adam", &[]);
    assert_ne!(
        serial.0.losses, adam.0.losses,
        "--optimizer sgd trained Adam"
    );
    let names: Vec<&String> = serial.1.tensors.keys().collect();
    assert!(names
        .iter()
        .any(|n| n.starts_with("optimizer.momentum_buffer.")));
    assert!(!names.iter().any(|n| n.starts_with("optimizer.exp_avg")));
    let n2 = ["--nproc-per-node", "2"];
    for (name, layout) in [
        ("dp2", &n2[..]),
        (
            "dp2-distopt",
            &[&n2[..], &["--use-distributed-optimizer"]].concat()[..],
        ),
        (
            "tp2-sp",
            &[
                &n2[..],
                &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            ]
            .concat()[..],
        ),
        (
            "pp2",
            &[&n2[..], &["--pipeline-model-parallel-size", "2"]].concat()[..],
        ),
    ] {
        let other = run(&dir, name, &[&sgd[..], layout].concat());
        assert_same_training(name, &serial, &other, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_sgd_checkpoint_resumes_its_momentum_under_another_layout() {
    // Saved at DP 2 with the distributed optimizer (the buffer as its shards), resumed at one
    // rank: the uninterrupted run's losses. Without the buffer (restarted momentum) they differ.
    let dir = tmpdir("sgd-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let flags = [MODEL, &["--optimizer", "sgd", "--train-iters", "6"]].concat();
    let full = pretrain(&args(
        &[
            &flags[..],
            &[
                "--save",
                s,
                "--save-interval",
                "3",
                "--nproc-per-node",
                "2",
                "--use-distributed-optimizer",
            ],
        ]
        .concat(),
    ))
    .unwrap();
    std::fs::write(save.join(TRACKER), "3\n").unwrap();
    let resumed = pretrain(&args(&[&flags[..], &["--load", s]].concat())).unwrap();
    assert_eq!(resumed.start_iteration, 3);
    assert_losses_close("resumed", &full.losses[3..], &resumed.losses, 1e-5);
    let restarted = pretrain(&args(
        &[&flags[..], &["--load", s, "--no-load-optim"]].concat(),
    ))
    .unwrap();
    assert!(
        (restarted.losses[1].1 - full.losses[4].1).abs() > 1e-5,
        "the momentum buffer made no difference"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_checkpoint_of_the_other_optimizer_is_refused_unless_its_state_is_dropped() {
    let dir = tmpdir("sgd-vs-adam");
    let save = dir.join("adam");
    let s = save.to_str().unwrap();
    pretrain(&args(
        &[MODEL, &["--train-iters", "3", "--save", s]].concat(),
    ))
    .unwrap();
    let more = [
        "--train-iters",
        "5",
        "--load",
        s,
        "--override-opt_param-scheduler",
    ];
    let e = pretrain(&args(&[MODEL, &more[..], &["--optimizer", "sgd"]].concat()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--optimizer adam")
            && e.contains("--optimizer sgd")
            && e.contains("--no-load-optim"),
        "{e}"
    );
    let ok = pretrain(&args(
        &[MODEL, &more[..], &["--optimizer", "sgd", "--no-load-optim"]].concat(),
    ))
    .unwrap();
    assert_eq!(ok.start_iteration, 3);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sgd_without_momentum_keeps_no_state_and_differs_from_momentum() {
    let dir = tmpdir("sgd-plain");
    let plain = run(
        &dir,
        "plain",
        &["--optimizer", "sgd", "--sgd-momentum", "0"],
    );
    let momentum = run(&dir, "momentum", &["--optimizer", "sgd"]);
    assert!(plain.1.tensors.keys().all(|n| !n.starts_with("optimizer.")));
    assert_eq!(plain.0.losses[0], momentum.0.losses[0]);
    assert_ne!(plain.0.losses[4], momentum.0.losses[4]);
    // A plain-SGD checkpoint resumes (there is nothing to read but the step count).
    let s = dir.join("plain");
    let resumed = pretrain(&args(
        &[
            MODEL,
            &[
                "--optimizer",
                "sgd",
                "--sgd-momentum",
                "0",
                "--train-iters",
                "6",
                "--override-opt_param-scheduler",
                "--load",
                s.to_str().unwrap(),
            ],
        ]
        .concat(),
    ))
    .unwrap();
    assert_eq!(resumed.start_iteration, 5);
    let e = pretrain(&args(&[
        "--train-iters",
        "3",
        "--optimizer",
        "sgd",
        "--sgd-momentum",
        "-0.5",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--sgd-momentum"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `--decoupled-lr` (Megatron's `is_embedding_or_output_parameter` group): the word embedding
/// and the output layer step at their own rate on the shared schedule. At rate 0 they stay at
/// their initial values while the rest trains; at the base rate the run is the plain one.
#[test]
fn decoupled_lr_steps_the_embedding_and_output_layer_at_their_own_rate() {
    let dir = tmpdir("decoupled-lr");
    let untied = ["--untie-embeddings-and-output-weights"];
    let frozen = [
        "--decoupled-lr",
        "0",
        "--untie-embeddings-and-output-weights",
    ];
    let one = run(
        &dir,
        "one",
        &[&frozen[..], &["--train-iters", "3"]].concat(),
    );
    let five = run(&dir, "five", &frozen);
    for name in ["embedding.word_embeddings.weight", "output_layer.weight"] {
        assert_eq!(one.1.tensors[name], five.1.tensors[name], "{name} moved");
    }
    for name in [
        "embedding.position_embeddings.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
    ] {
        assert_ne!(one.1.tensors[name], five.1.tensors[name], "{name} froze");
    }
    // The base rate and floor as the decoupled ones: the plain run, bit for bit.
    let plain = run(&dir, "plain", &untied);
    let same = run(
        &dir,
        "same",
        &[
            &untied[..],
            &["--decoupled-lr", "0.05", "--decoupled-min-lr", "0"],
        ]
        .concat(),
    );
    assert_eq!(plain.0.losses, same.0.losses);
    let e = pretrain(&args(&["--train-iters", "3", "--decoupled-min-lr", "1e-5"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--decoupled-min-lr needs --decoupled-lr"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The decoupled group in every layout: the tied embedding's copy on the last pipeline stage
/// steps at the decoupled rate too, and the distributed optimizer's shards pick each element's
/// rate by its parameter. (Adam at the 0.05 that suits SGD above lets reduction-order rounding
/// flip the sign of near-zero gradients, whose steps are then ±lr apart: the usual 3e-3 here.)
#[test]
fn decoupled_lr_trains_the_same_model_in_every_layout_as_one_rank() {
    let dir = tmpdir("decoupled-layouts");
    let d = [
        "--lr",
        "3e-3",
        "--decoupled-lr",
        "0.01",
        "--decoupled-min-lr",
        "0.001",
    ];
    let serial = run(&dir, "serial", &d);
    let plain = run(&dir, "plain", &["--lr", "3e-3"]);
    assert_ne!(serial.0.losses[4], plain.0.losses[4]);
    let n2 = ["--nproc-per-node", "2"];
    for (name, layout) in [
        (
            "dp2-distopt",
            &[&n2[..], &["--use-distributed-optimizer"]].concat()[..],
        ),
        (
            "tp2",
            &[&n2[..], &["--tensor-model-parallel-size", "2"]].concat()[..],
        ),
        (
            "pp2",
            &[&n2[..], &["--pipeline-model-parallel-size", "2"]].concat()[..],
        ),
    ] {
        let other = run(&dir, name, &[&d[..], layout].concat());
        assert_same_training(name, &serial, &other, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--apply-wd-to-qk-layernorm` (megatron-core's Qwen3-Next rule): the query and key norms decay
/// although they are 1-D. After one AdamW step from weights of 1 the decayed norm is exactly
/// `lr * wd` below the undecayed one and every other tensor is untouched (the norms only change
/// the forward from the second step on); the distributed optimizer's shards decay the same
/// elements; Megatron's deprecated spelling is the same flag; without --qk-layernorm it is refused.
#[test]
fn apply_wd_to_qk_layernorm_decays_exactly_the_query_and_key_norms() {
    let dir = tmpdir("wd-qk-layernorm");
    let base = [
        "--qk-layernorm",
        "--normalization",
        "RMSNorm",
        "--weight-decay",
        "0.5",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "0",
        "--lr-decay-style",
        "constant",
        "--train-iters",
        "1",
    ];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    let with = |extra: &[&'static str]| with(&base, extra);
    let plain = run(&dir, "plain", &base);
    let decayed = run(&dir, "decayed", &with(&["--apply-wd-to-qk-layernorm"]));
    let mut norms = 0;
    for (name, want) in &plain.1.tensors {
        let got = &decayed.1.tensors[name];
        let norm = name.contains("q_layernorm.") || name.contains("k_layernorm.");
        // AdamW's decay is decoupled: the moments (`optimizer.*`) do not see it.
        if norm && !name.starts_with("optimizer.") {
            norms += 1;
            for (g, w) in got.iter().zip(want) {
                let moved = g - w;
                assert!(
                    (moved + 3e-3 * 0.5).abs() < 1e-6,
                    "{name}: decay moved it by {moved}, want -1.5e-3"
                );
            }
        } else {
            assert_eq!(got, want, "{name} changed");
        }
    }
    assert_eq!(norms, 8, "a query and a key norm in each of the 4 layers");
    let deprecated = run(
        &dir,
        "deprecated",
        &with(&["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"]),
    );
    assert_eq!(deprecated.1.tensors, decayed.1.tensors);
    let five = |extra: &[&'static str]| with(&[extra, &["--train-iters", "5"]].concat());
    let serial = run(&dir, "serial", &five(&["--apply-wd-to-qk-layernorm"]));
    let sharded = run(
        &dir,
        "dp2-distopt",
        &five(&[
            "--apply-wd-to-qk-layernorm",
            "--nproc-per-node",
            "2",
            "--use-distributed-optimizer",
        ]),
    );
    assert_same_training("dp2-distopt", &serial, &sharded, 1e-5);
    let e = pretrain(&args(&["--train-iters", "2", "--apply-wd-to-qk-layernorm"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--apply-wd-to-qk-layernorm needs --qk-layernorm"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's precision-aware optimizer with bf16 moments (`--use-precision-aware-optimizer
/// --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`, distributed optimizer): half the bytes of
/// optimizer state, every stored moment a bf16 value, another model than fp32 moments train,
/// the same model in every layout, and a resumed run that continues bit for bit. Megatron's
/// conditions on the flags are enforced by name.
#[test]
fn bf16_moments_halve_the_optimizer_state_and_train_alike_in_every_layout() {
    let dir = tmpdir("bf16-moments");
    let adam = ["--lr", "3e-3", "--use-distributed-optimizer"];
    let bf16 = [
        &adam[..],
        &[
            "--use-precision-aware-optimizer",
            "--exp-avg-dtype",
            "bf16",
            "--exp-avg-sq-dtype",
            "bf16",
        ],
    ]
    .concat();
    let metrics = dir.join("metrics.jsonl");
    let m = metrics.to_str().unwrap();
    let memory = ["--log-memory", "--metrics-file", m];
    let fp32 = run(&dir, "fp32", &[&adam[..], &memory].concat());
    let fp32_state = last_memory_record(&metrics)["optimizer_state"]
        .as_u64()
        .unwrap();
    std::fs::remove_file(&metrics).unwrap();
    let serial = run(&dir, "serial", &[&bf16[..], &memory].concat());
    let bf16_state = last_memory_record(&metrics)["optimizer_state"]
        .as_u64()
        .unwrap();
    assert_eq!(2 * bf16_state, fp32_state, "two bf16 moments per parameter");
    let mut moments = 0;
    for (name, v) in &serial.1.tensors {
        if name.starts_with("optimizer.exp_avg") {
            moments += 1;
            assert!(
                v.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x),
                "{name} holds values bf16 cannot"
            );
        }
    }
    assert!(moments > 0);
    assert_ne!(
        serial.1.tensors, fp32.1.tensors,
        "rounded moments, another model"
    );
    let n2 = ["--nproc-per-node", "2"];
    for (name, layout) in [
        ("dp2", n2.to_vec()),
        (
            "tp2",
            [&n2[..], &["--tensor-model-parallel-size", "2"]].concat(),
        ),
        (
            "pp2",
            [&n2[..], &["--pipeline-model-parallel-size", "2"]].concat(),
        ),
    ] {
        // Moments keep 8 mantissa bits: a gradient one f32 ulp apart (another reduction
        // order) can round a moment the other way, moving that step by up to lr * 2^-8
        // (1.2e-5 here); over five steps the parameters agree within a few of those.
        let other = run(&dir, name, &[&bf16[..], &layout].concat());
        assert_same_training_within(name, &serial, &other, 1e-5, 6e-5);
    }
    // Saved at step 3 and resumed: the uninterrupted run's last two losses, bit for bit.
    let save = dir.join("resumed");
    let s = save.to_str().unwrap();
    let flags = [MODEL, &bf16, &["--train-iters", "5"]].concat();
    let full = pretrain(&args(
        &[&flags[..], &["--save", s, "--save-interval", "3"]].concat(),
    ))
    .unwrap();
    std::fs::write(save.join(TRACKER), "3\n").unwrap();
    let resumed = pretrain(&args(&[&flags[..], &["--load", s]].concat())).unwrap();
    assert_eq!(resumed.start_iteration, 3);
    assert_eq!(resumed.losses[..], full.losses[3..]);
    for (flags, want) in [
        (
            &["--exp-avg-dtype", "bf16"][..],
            "--exp-avg-dtype other than fp32 needs --use-precision-aware-optimizer",
        ),
        (
            &["--use-precision-aware-optimizer"][..],
            "--use-precision-aware-optimizer needs --use-distributed-optimizer",
        ),
        (
            &[
                "--use-precision-aware-optimizer",
                "--use-distributed-optimizer",
                "--exp-avg-sq-dtype",
                "fp8",
            ][..],
            "--exp-avg-sq-dtype Fp8 is not built",
        ),
        (
            &[
                "--use-precision-aware-optimizer",
                "--use-distributed-optimizer",
                "--main-grads-dtype",
                "bf16",
            ][..],
            "--main-grads-dtype Bf16 is not built",
        ),
    ] {
        let e = pretrain(&args(&[&["--train-iters", "2"], flags].concat()))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{flags:?}: {e}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--optimizer lion` (megatron-core's, from emerging-optimizers): every layout trains the
/// one-rank model, its momentum is checkpointed as `optimizer.exp_avg.*` and a resume continues
/// bit for bit, and a checkpoint of another optimizer is refused by name. Lion moves each
/// parameter by lr whatever the gradient's size, so a gradient component near zero whose sign
/// another reduction order flips moves by 2 lr the other way: at lr 1e-4 over five steps the
/// layouts agree within 2 lr per step, 1e-3 (5e-4 seen at TP 2, in a bias; the losses within
/// 1e-5).
#[test]
fn lion_trains_alike_in_every_layout_and_resumes_its_momentum() {
    let dir = tmpdir("lion");
    let lion = [
        "--optimizer",
        "lion",
        "--lr",
        "1e-4",
        "--weight-decay",
        "0.1",
    ];
    let serial = run(&dir, "serial", &lion);
    assert!(serial
        .1
        .tensors
        .keys()
        .any(|k| k.starts_with("optimizer.exp_avg.")));
    assert!(!serial
        .1
        .tensors
        .keys()
        .any(|k| k.starts_with("optimizer.exp_avg_sq.")));
    let adam = run(&dir, "adam", &["--lr", "1e-4", "--weight-decay", "0.1"]);
    assert_ne!(serial.0.losses[4], adam.0.losses[4], "Lion is not Adam");
    let n2 = ["--nproc-per-node", "2"];
    for (name, layout) in [
        (
            "dp2-distopt",
            [&n2[..], &["--use-distributed-optimizer"]].concat(),
        ),
        (
            "tp2",
            [&n2[..], &["--tensor-model-parallel-size", "2"]].concat(),
        ),
        (
            "pp2",
            [&n2[..], &["--pipeline-model-parallel-size", "2"]].concat(),
        ),
    ] {
        let other = run(&dir, name, &[&lion[..], &layout].concat());
        assert_same_training_within(name, &serial, &other, 1e-5, 1e-3);
    }
    let save = dir.join("resumed");
    let s = save.to_str().unwrap();
    let flags = [MODEL, &lion, &["--train-iters", "5"]].concat();
    let full = pretrain(&args(
        &[&flags[..], &["--save", s, "--save-interval", "3"]].concat(),
    ))
    .unwrap();
    std::fs::write(save.join(TRACKER), "3\n").unwrap();
    let resumed = pretrain(&args(&[&flags[..], &["--load", s]].concat())).unwrap();
    assert_eq!(resumed.losses[..], full.losses[3..]);
    // The Adam run's checkpoint under --optimizer lion: refused, naming both.
    let a = dir.join("adam");
    let e = pretrain(&args(
        &[
            MODEL,
            &lion[..],
            &["--train-iters", "6", "--load", a.to_str().unwrap()],
        ]
        .concat(),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--optimizer adam") && e.contains("--optimizer lion"),
        "{e}"
    );
    let e = pretrain(&args(&[
        "--train-iters",
        "2",
        "--optimizer",
        "lion",
        "--lion-beta2",
        "1",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--lion-beta2 must be in [0, 1)"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
