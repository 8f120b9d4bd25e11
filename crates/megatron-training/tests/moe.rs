//! A small mixture-of-experts model trains, and data and pipeline parallelism train the same
//! model as one rank (experts are replicated over data-parallel ranks; dropless routing).

mod common;

use common::*;
use megatron_training::pretrain;

fn run(
    dir: &std::path::Path,
    name: &str,
    layout: &[&str],
) -> (
    megatron_training::TrainSummary,
    megatron_training::checkpointing::LoadedCheckpoint,
) {
    train_and_load(dir, name, &[MOE, layout].concat())
}

#[test]
fn moe_data_and_pipeline_parallel_layouts_match_one_rank() {
    let dir = tmpdir("moe-layouts");
    let serial = run(&dir, "serial", &[]);
    for (name, layout) in [
        (
            "dp2 distributed optimizer",
            &["--nproc-per-node", "2", "--use-distributed-optimizer"][..],
        ),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
    ] {
        let r = run(&dir, name, layout);
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Expert parallelism (tokens dispatched to the ranks of their experts, parallel folding over
/// tensor- and data-parallel ranks) trains the one-rank model, with both dispatchers.
#[test]
fn moe_expert_parallel_layouts_match_one_rank() {
    let dir = tmpdir("moe-ep-layouts");
    let serial = run(&dir, "serial", &[]);
    let ep = |n: &'static str, e: &'static str, d: &'static str| -> Vec<&'static str> {
        vec![
            "--nproc-per-node",
            n,
            "--expert-model-parallel-size",
            e,
            "--moe-token-dispatcher-type",
            d,
        ]
    };
    let with = |mut v: Vec<&'static str>, more: &[&'static str]| {
        v.extend_from_slice(more);
        v
    };
    let layouts: Vec<(&str, Vec<&str>)> = vec![
        ("ep2 alltoall", ep("2", "2", "alltoall")),
        ("ep2 allgather", ep("2", "2", "allgather")),
        ("ep4 alltoall", ep("4", "4", "alltoall")),
        (
            "ep2 x tp2 (sp, etp1) alltoall",
            with(
                ep("4", "2", "alltoall"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "1",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp1) allgather",
            with(
                ep("4", "2", "allgather"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "1",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp2) alltoall",
            with(
                ep("4", "2", "alltoall"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "2",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp2) allgather",
            with(
                ep("4", "2", "allgather"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "2",
                ],
            ),
        ),
        (
            "tp2 (sp, etp2, ep1) distributed optimizer",
            vec![
                "--nproc-per-node",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--use-distributed-optimizer",
            ],
        ),
        (
            "etp2 over dp ranks (tp1, ep1)",
            vec![
                "--nproc-per-node",
                "2",
                "--expert-tensor-parallel-size",
                "2",
            ],
        ),
        (
            "ep2 x pp2 alltoall",
            with(
                ep("4", "2", "alltoall"),
                &["--pipeline-model-parallel-size", "2"],
            ),
        ),
        (
            "ep2 x edp2 distributed optimizer",
            with(ep("4", "2", "alltoall"), &["--use-distributed-optimizer"]),
        ),
        (
            "ep2 x edp2 plain optimizer allgather",
            ep("4", "2", "allgather"),
        ),
        (
            "ep2 x edp2 distributed, overlapped dense reduction",
            with(
                ep("4", "2", "alltoall"),
                &[
                    "--use-distributed-optimizer",
                    "--overlap-grad-reduce",
                    "--ddp-bucket-size",
                    "2000",
                ],
            ),
        ),
        (
            "ep2 x edp2 distributed, overlapped reduction and parameter gather",
            with(
                ep("4", "2", "alltoall"),
                &[
                    "--use-distributed-optimizer",
                    "--overlap-grad-reduce",
                    "--overlap-param-gather",
                    "--ddp-bucket-size",
                    "2000",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp1) distributed, overlapped parameter gather",
            with(
                ep("8", "2", "alltoall"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "1",
                    "--use-distributed-optimizer",
                    "--overlap-param-gather",
                    "--ddp-bucket-size",
                    "2000",
                ],
            ),
        ),
    ];
    for (name, layout) in &layouts {
        let r = run(&dir, &name.replace(' ', "_"), layout);
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_moe_model_learns_on_mock_data_and_bad_flags_are_refused() {
    let v = [
        PP_MODEL,
        MOE,
        &[
            "--train-iters",
            "40",
            "--lr",
            "5e-3",
            "--global-batch-size",
            "4",
            "--num-layers",
            "2",
        ],
    ]
    .concat();
    let s = pretrain(&args(&v)).unwrap();
    let (first, last) = (s.losses[0].1, s.losses.last().unwrap().1);
    assert!(last < first - 1.0, "loss {first} -> {last}");
    // The log carries the auxiliary losses and the expert load.
    let m = &s.moe.last().expect("MoE metrics at every log interval").1;
    assert!(m.load_balancing_loss > 0.0 && m.z_loss > 0.0, "{m:?}");
    assert_eq!(m.layers.len(), 2);
    assert!(m
        .layers
        .iter()
        .all(|l| l.max_over_mean >= 1.0 && l.dropped_fraction == 0.0));
    for (extra, flag) in [
        (&["--moe-router-topk", "5"][..], "--moe-router-topk"),
        (
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
            "--tensor-model-parallel-size",
        ),
        (
            &["--nproc-per-node", "2", "--expert-model-parallel-size", "3"][..],
            "--expert-model-parallel-size",
        ),
        (
            &["--moe-router-enable-expert-bias"][..],
            "--moe-router-score-function sigmoid",
        ),
        (
            &["--moe-pad-expert-input-to-capacity"][..],
            "--moe-expert-capacity-factor",
        ),
        (
            &["--moe-shared-expert-gate"][..],
            "--moe-shared-expert-intermediate-size",
        ),
        (&["--moe-ffn-hidden-size", "0"][..], "--moe-ffn-hidden-size"),
        (
            &["--moe-router-dtype", "fp64"][..],
            "--moe-router-dtype fp64",
        ),
    ] {
        let v = [PP_MODEL, MOE, &["--train-iters", "2"], extra].concat();
        let e = pretrain(&args(&v)).unwrap_err().to_string();
        assert!(e.contains(flag), "{e}");
    }
}

/// Shared experts with their gate, the per-sequence load-balancing loss, the z-loss, the
/// expert bias and the grouped expert GEMM train the one-rank model under expert, tensor (experts split or whole) and
/// pipeline parallelism.
#[test]
fn moe_shared_experts_seq_aux_loss_and_expert_bias_match_one_rank_across_layouts() {
    let dir = tmpdir("moe-features");
    let features: &[&str] = &[
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-shared-expert-gate",
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.01",
        "--micro-batch-size",
        "2",
        "--moe-grouped-gemm",
    ];
    let serial = run(&dir, "serial", features);
    for (name, layout) in [
        (
            "ep2 x tp2 (etp2) alltoall",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--moe-token-dispatcher-type",
                "alltoall",
            ][..],
        ),
        (
            "ep2 x tp2 (etp1) allgather",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "1",
            ][..],
        ),
        (
            "ep2 x pp2 distributed optimizer",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--use-distributed-optimizer",
            ][..],
        ),
    ] {
        let r = run(&dir, &name.replace(' ', "_"), &[features, layout].concat());
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn seq_aux_loss_is_the_aux_loss_when_a_micro_batch_is_one_sequence() {
    let dir = tmpdir("moe-seq-aux");
    let aux = run(&dir, "aux", &["--moe-aux-loss-coeff", "0.1"]);
    let seq = run(
        &dir,
        "seq",
        &[
            "--moe-aux-loss-coeff",
            "0.1",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
        ],
    );
    assert_same_training("seq_aux_loss vs aux_loss", &aux, &seq, 0.0);
    // With two sequences per micro-batch they differ (each sequence is balanced on its own).
    let mb2 = ["--micro-batch-size", "2"];
    let aux2 = run(
        &dir,
        "aux2",
        &[&["--moe-aux-loss-coeff", "0.1"][..], &mb2].concat(),
    );
    let seq2 = run(
        &dir,
        "seq2",
        &[
            &[
                "--moe-aux-loss-coeff",
                "0.1",
                "--moe-router-load-balancing-type",
                "seq_aux_loss",
            ][..],
            &mb2,
        ]
        .concat(),
    );
    assert_ne!(aux2.0.losses, seq2.0.losses);
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron decides what to drop on each rank from its own tokens: data and expert
/// parallelism see whole micro-batches and drop exactly what one rank drops; under sequence
/// parallelism each tensor-parallel rank holds part of a micro-batch, so its capacity and its
/// drops differ (more rows are dropped), and such a run is checked for determinism only.
#[test]
fn with_a_capacity_factor_drops_are_counted_and_match_one_rank_where_megatron_decides_alike() {
    let dir = tmpdir("moe-capacity");
    let cap: &[&str] = &[
        "--moe-expert-capacity-factor",
        "1.0",
        "--micro-batch-size",
        "2",
    ];
    let serial = run(&dir, "serial", cap);
    let dropped =
        |s: &megatron_training::TrainSummary| s.moe.last().unwrap().1.layers[0].dropped_fraction;
    assert!(dropped(&serial.0) > 0.0, "capacity 1.0 drops some rows");
    for (name, layout) in [
        (
            "ep2 alltoall, padded to capacity",
            &[
                "--nproc-per-node",
                "2",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "alltoall",
                "--moe-pad-expert-input-to-capacity",
            ][..],
        ),
        (
            "dp2 x pp2 allgather",
            &[
                "--nproc-per-node",
                "4",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
    ] {
        let r = run(
            &dir,
            &name.replace([' ', ','], "_"),
            &[cap, layout].concat(),
        );
        assert_same_training(name, &serial, &r, 1e-5);
        assert_eq!(dropped(&r.0), dropped(&serial.0), "{name}");
    }
    let sp: &[&str] = &[
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    let a = run(&dir, "sp_a", &[cap, sp].concat());
    let b = run(&dir, "sp_b", &[cap, sp].concat());
    assert_eq!(a.0.losses, b.0.losses, "a run with drops is deterministic");
    assert!(
        dropped(&a.0) > dropped(&serial.0),
        "per-rank capacity drops more"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// DeepSeek-V3's aux-loss-free balancing: with the expert bias (and no load-balancing loss)
/// the expert load evens out over training, and ends more even than without it.
#[test]
fn the_expert_bias_evens_out_the_expert_load() {
    let base: &[&str] = &[
        "--num-layers",
        "2",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-aux-loss-coeff",
        "0",
        "--moe-z-loss-coeff",
        "0",
        "--micro-batch-size",
        "4",
        "--train-iters",
        "60",
        "--log-interval",
        "10",
        "--lr",
        "5e-3",
    ];
    let load = |s: &megatron_training::TrainSummary, i: usize| {
        let l = &s.moe[i].1.layers;
        l.iter().map(|x| x.max_over_mean).sum::<f64>() / l.len() as f64
    };
    let plain = pretrain(&args(&[PP_MODEL, MOE, base].concat())).unwrap();
    let biased = pretrain(&args(
        &[
            PP_MODEL,
            MOE,
            base,
            &[
                "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate",
                "0.01",
            ],
        ]
        .concat(),
    ))
    .unwrap();
    let (first, last) = (load(&biased, 0), load(&biased, biased.moe.len() - 1));
    let without = load(&plain, plain.moe.len() - 1);
    assert!(last < first, "load max/mean {first} -> {last}");
    assert!(last + 0.1 < without, "with bias {last}, without {without}");
}

/// `--moe-layer-freq` as a list (Megatron's `"([0]+[1]*3)*2"`: DeepSeek-style dense layers
/// among the MoE ones) puts experts exactly where the list says, trains the one-rank model
/// under pipeline and expert parallelism (stages holding dense and MoE layers alike), and the
/// list spelling of a frequency trains the same model as the number.
#[test]
fn a_moe_layer_list_places_the_experts_and_every_layout_matches_one_rank() {
    let dir = tmpdir("moe-layer-list");
    let pattern = ["--moe-layer-freq", "([0]+[1]*3)*2"];
    let serial = run(&dir, "serial", &pattern);
    for l in 0..8 {
        let router = format!("decoder.layers.{l}.mlp.router.weight");
        let dense = format!("decoder.layers.{l}.mlp.linear_fc1.weight");
        let moe = l % 4 != 0;
        assert_eq!(serial.1.tensors.contains_key(&router), moe, "layer {l}");
        assert_eq!(serial.1.tensors.contains_key(&dense), !moe, "layer {l}");
    }
    let n2 = ["--nproc-per-node", "2"];
    for (name, layout) in [
        (
            "pp2",
            [&n2[..], &["--pipeline-model-parallel-size", "2"]].concat(),
        ),
        (
            "ep2",
            [&n2[..], &["--expert-model-parallel-size", "2"]].concat(),
        ),
    ] {
        let r = run(&dir, name, &[&pattern[..], &layout].concat());
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let every = run(&dir, "every-2", &["--moe-layer-freq", "2"]);
    let listed = run(&dir, "list-2", &["--moe-layer-freq", "[1,0]*4"]);
    assert_eq!(every.0.losses, listed.0.losses);
    assert_ne!(every.0.losses, serial.0.losses);
    for (freq, want) in [
        ("[1,0]*3", "--moe-layer-freq has 6 entries for 8 layers"),
        ("0", "--moe-layer-freq '0'"),
        ("[1,2]*4", "entries are 0 or 1"),
    ] {
        let v = [
            PP_MODEL,
            MOE,
            &["--train-iters", "2", "--moe-layer-freq", freq],
        ]
        .concat();
        let e = pretrain(&args(&v)).unwrap_err().to_string();
        assert!(e.contains(want), "{freq}: {e}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// DeepSeek's group-limited routing (`--moe-router-num-groups 2 --moe-router-group-topk 1`:
/// both of a token's experts from one half, device-limited at EP 2), with the sigmoid router
/// and its expert bias as DeepSeek-V3 uses them: another model than unlimited routing, and
/// expert and pipeline parallelism train the one-rank model. Bad group settings are refused by
/// flag.
#[test]
fn group_limited_routing_matches_one_rank_and_checks_its_flags() {
    let dir = tmpdir("moe-groups");
    let deepseek = [
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.01",
    ];
    let groups = [
        "--moe-router-num-groups",
        "2",
        "--moe-router-group-topk",
        "1",
    ];
    let limited = [&deepseek[..], &groups].concat();
    let serial = run(&dir, "serial", &limited);
    let free = run(&dir, "unlimited", &deepseek);
    assert_ne!(
        serial.0.losses, free.0.losses,
        "the limit changes the routing"
    );
    for (name, layout) in [
        (
            "ep2",
            &["--nproc-per-node", "2", "--expert-model-parallel-size", "2"][..],
        ),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
    ] {
        let r = run(&dir, name, &[&limited[..], layout].concat());
        assert_same_training(name, &serial, &r, 1e-5);
    }
    for (extra, want) in [
        (
            &["--moe-router-num-groups", "2"][..],
            "--moe-router-num-groups needs --moe-router-group-topk",
        ),
        (
            &["--moe-router-group-topk", "1"][..],
            "--moe-router-group-topk needs --moe-router-num-groups",
        ),
        (
            &[
                "--moe-router-num-groups",
                "3",
                "--moe-router-group-topk",
                "1",
            ][..],
            "--moe-router-num-groups (3) must divide --num-experts (4)",
        ),
        (
            &[
                "--moe-router-num-groups",
                "2",
                "--moe-router-group-topk",
                "3",
            ][..],
            "--moe-router-group-topk (3) must be between 1 and --moe-router-num-groups (2)",
        ),
        (
            &[
                "--moe-router-num-groups",
                "4",
                "--moe-router-group-topk",
                "1",
            ][..],
            "must hold --moe-router-topk (2) experts",
        ),
    ] {
        let v = [PP_MODEL, MOE, &["--train-iters", "2"], extra].concat();
        let e = pretrain(&args(&v)).unwrap_err().to_string();
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The engine's activation formula (what `--log-memory` and `megatron plan` predict) counts an
/// MoE layer's kept tensors exactly on one rank, where every routed row is local: router logits,
/// choices and probabilities, the dispatched input, the experts' fc1 output, the rows combine
/// weighs and the shared expert's; with a dense first layer (`--moe-layer-freq`), in f32 and in
/// bf16.
#[test]
fn moe_kept_activations_match_the_engine_formula_on_one_rank() {
    let shared = [
        "--moe-shared-expert-intermediate-size",
        "96",
        "--moe-shared-expert-gate",
    ];
    let dense_first = ["--moe-layer-freq", "[0]+[1]*7"];
    for extra in [
        &[][..],
        &["--bf16"][..],
        &shared[..],
        &[&shared[..], &["--bf16"], &dense_first[..]].concat()[..],
    ] {
        let a = args(&[PP_MODEL, MOE, &["--train-iters", "2"], extra].concat());
        let cfg = a.validate(62).unwrap();
        let s = pretrain(&a).unwrap();
        let half = extra.contains(&"--bf16");
        let f =
            megatron_core::models::gpt::activation_bytes_formula(&cfg.model, 1, 32, 1, false, half);
        assert_eq!(s.peak_activation_bytes, f, "{extra:?}");
    }
}

/// Under `--bf16` the tokens travel to their experts as bf16 (two to an f32 word) and the experts
/// read their 16-bit weights in place: expert parallelism, with either dispatcher and with expert
/// tensor parallelism, trains the one-bf16-rank model (the bf16 layout tolerances).
#[test]
fn moe_bf16_expert_parallel_layouts_match_one_bf16_rank() {
    let dir = tmpdir("moe-bf16-ep-layouts");
    let serial = run(&dir, "serial", &["--bf16"]);
    let layouts: [(&str, &[&str]); 3] = [
        (
            "ep2 alltoall",
            &[
                "--nproc-per-node",
                "2",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "alltoall",
            ],
        ),
        (
            "ep2 allgather",
            &[
                "--nproc-per-node",
                "2",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "allgather",
            ],
        ),
        (
            "ep2 x tp2 (sp, etp2) alltoall",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "alltoall",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "2",
            ],
        ),
    ];
    for (name, layout) in layouts {
        let r = run(&dir, name, &[layout, &["--bf16"]].concat());
        assert_same_training_within(name, &serial, &r, BF16_LOSS_TOL, BF16_PARAM_TOL);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--moe-router-dtype fp32` (Megatron's flag for an fp32 router) is what the router computes
/// in here: the same model, bit for bit, in fp32 and under --bf16.
#[test]
fn moe_router_dtype_fp32_is_the_router_of_this_engine() {
    for precision in [&[][..], &["--bf16"][..]] {
        let base = [PP_MODEL, MOE, &["--train-iters", "2"], precision].concat();
        let plain = pretrain(&args(&base)).unwrap();
        let fp32 = pretrain(&args(
            &[&base[..], &["--moe-router-dtype", "fp32"]].concat(),
        ))
        .unwrap();
        assert_eq!(plain.losses, fp32.losses);
    }
}

/// An MoE checkpoint saved before this engine built megatron-core's router and expert biases
/// (its model records none, it holds no such tensors: made here by taking them out of a new
/// checkpoint's index) resumes under `--use-checkpoint-args` as the model it holds and trains
/// on; with flags that now ask for the biases it is refused by name instead of failing on a
/// missing tensor, and so is its export to Megatron-LM.
#[test]
fn an_moe_checkpoint_saved_before_expert_biases_resumes_as_the_model_it_holds() {
    let dir = tmpdir("moe-before-biases");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let run = |extra: &[&str]| pretrain(&args(&[MOE, &["--train-iters", "6"][..], extra].concat()));
    run(&["--save", s, "--save-interval", "3", "--exit-interval", "3"]).unwrap();
    let meta = save.join("iter_0000003").join("metadata.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
    m["model"]["moe"].as_object_mut().unwrap().remove("biases");
    let tensors = m["tensors"].as_array_mut().unwrap();
    let before = tensors.len();
    tensors.retain(|t| {
        let n = t["name"].as_str().unwrap();
        !(n.ends_with("mlp.router.bias") || (n.contains(".local_experts.") && n.ends_with(".bias")))
    });
    // Per layer: the router's and 4 experts' fc1 and fc2 biases, each with Adam's two moments.
    assert_eq!(before - tensors.len(), 3 * 2 * (1 + 4 * 2));
    std::fs::write(&meta, m.to_string()).unwrap();
    let e = run(&["--load", s]).unwrap_err().to_string();
    assert!(
        e.contains("without biases") && e.contains("--use-checkpoint-args"),
        "{e}"
    );
    // Megatron-LM would build the biases it lacks.
    let e = megatron_training::convert::megatron_to_torch_dist(
        &save,
        &dir.join("mlm"),
        megatron_training::convert::OptimizerExport::default(),
        megatron_training::convert::LayerSpec::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("experts without biases"), "{e}");
    let resumed = run(&["--load", s, "--use-checkpoint-args"]).unwrap();
    assert_eq!(resumed.start_iteration, 3);
    assert_eq!(resumed.losses.len(), 3);
    let its: Vec<u64> = resumed.losses.iter().map(|l| l.0).collect();
    assert_eq!(its, [4, 5, 6]);
    assert!(resumed.losses.iter().all(|l| l.1.is_finite()));
    let _ = std::fs::remove_dir_all(dir);
}
