//! Validation as Megatron's iterators read it: each evaluation takes the next `--eval-iters`
//! global batches of the validation split (the end of training included), a resumed run goes
//! on where the checkpoint's evaluations stopped, and `--start-eval-at-iter` holds
//! validation back.

mod common;

use common::*;
use megatron_training::{pretrain, TrainSummary};

/// A model that does not change (lr 0), so validation losses differ only by their samples.
const FROZEN: &[&str] = &["--lr", "0", "--lr-warmup-iters", "0", "--min-lr", "0"];

fn train(more: &[&str]) -> TrainSummary {
    pretrain(&args(&[FROZEN, more].concat())).unwrap()
}

#[test]
fn each_validation_reads_the_next_global_batches_of_the_split() {
    let every2 = train(&[
        "--train-iters",
        "6",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
    ]);
    // Iterations 2, 4 and 6, then the end of training: four evaluations of 2 batches.
    let at: Vec<u64> = every2.val_losses.iter().map(|v| v.0).collect();
    assert_eq!(at, [2, 4, 6, 6]);
    let losses: Vec<f64> = every2.val_losses.iter().map(|v| v.1).collect();
    for (i, a) in losses.iter().enumerate() {
        for b in &losses[i + 1..] {
            assert_ne!(a, b, "two evaluations read the same samples: {losses:?}");
        }
    }
    // One evaluation of all 8 batches scores the same samples (every token counts the same).
    let once = train(&[
        "--train-iters",
        "6",
        "--eval-interval",
        "100",
        "--eval-iters",
        "8",
    ]);
    assert_eq!(once.val_losses.len(), 1);
    let mean = losses.iter().sum::<f64>() / 4.0;
    assert!(
        (mean - once.val_losses[0].1).abs() < 1e-6,
        "{mean} against {}",
        once.val_losses[0].1
    );
}

/// A run of `flags` validating every 2 iterations and saved at iteration 4 is resumed there:
/// the checkpoint must record `consumed` validation samples (`what`), and the resumed run
/// validate on the samples the uninterrupted one does. Returns the checkpoint's directory, the
/// uninterrupted run and the flags, for more resumes; the caller removes `dir`.
fn saved_and_resumed(
    dir: &std::path::Path,
    flags: &[&str],
    (consumed, what): (u64, &str),
) -> (std::path::PathBuf, TrainSummary) {
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let straight = pretrain(&args(
        &[flags, &["--save", c, "--save-interval", "4"]].concat(),
    ))
    .unwrap();
    let meta = ckpt.join("iter_0000004").join("metadata.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
    assert_eq!(v["consumed_valid_samples"], consumed, "{what}");
    let resumed = pretrain(&args(&[flags, &["--load", c, "--ckpt-step", "4"]].concat())).unwrap();
    assert_eq!(resumed.val_losses, straight.val_losses[2..]);
    (ckpt, straight)
}

const RESUMED: &[&str] = &[
    "--train-iters",
    "6",
    "--eval-interval",
    "2",
    "--eval-iters",
    "1",
    "--lr",
    "1e-3",
    "--lr-decay-iters",
    "12",
];

#[test]
fn a_resumed_run_validates_on_the_samples_the_uninterrupted_run_does() {
    let dir = tmpdir("eval-resume");
    let (ckpt, straight) = saved_and_resumed(&dir, RESUMED, (8, "2 evaluations of 1 batch of 4"));
    // A checkpoint that does not record the samples read (an older one): counted from the
    // iteration, as Megatron does.
    let meta = ckpt.join("iter_0000004").join("metadata.json");
    let json = std::fs::read_to_string(&meta).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v.as_object_mut().unwrap().remove("consumed_valid_samples");
    std::fs::write(&meta, serde_json::to_string(&v).unwrap()).unwrap();
    // The manifest's checksums cover the shards, not itself.
    let c = ckpt.to_str().unwrap();
    let older = pretrain(&args(
        &[RESUMED, &["--load", c, "--ckpt-step", "4"]].concat(),
    ))
    .unwrap();
    assert_eq!(older.val_losses, straight.val_losses[2..]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn start_eval_at_iter_holds_validation_back() {
    let s = train(&[
        "--train-iters",
        "6",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--start-eval-at-iter",
        "3",
    ]);
    let at: Vec<u64> = s.val_losses.iter().map(|v| v.0).collect();
    assert_eq!(at, [4, 6, 6]);
}

/// Validation losses of a frozen run of 4 iterations validating every 2 (`more` appended).
fn frozen_validations(more: &[&str]) -> Vec<(u64, f64)> {
    train(&[&["--train-iters", "4", "--eval-interval", "2"][..], more].concat()).val_losses
}

fn assert_close(a: &[(u64, f64)], b: &[(u64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} against {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0, "{what}");
        assert!((x.1 - y.1).abs() < 1e-6, "{what}: {a:?} against {b:?}");
    }
}

#[test]
fn eval_batch_sizes_cut_the_same_validation_samples_into_other_batches() {
    // Training's batches (micro-batch 2, global 4), 2 iterations per evaluation: 8 samples.
    let base = frozen_validations(&["--eval-iters", "2"]);
    assert_eq!(
        base.iter().map(|v| v.0).collect::<Vec<_>>(),
        [2, 4, 4],
        "{base:?}"
    );
    // The same 8 samples in micro-batches of 1 or 4, in one iteration of 8, and over two
    // data-parallel ranks: every token counts the same, so the same losses.
    for (flags, what) in [
        (
            &["--eval-iters", "2", "--eval-micro-batch-size", "1"][..],
            "micro-batches of 1",
        ),
        (
            &["--eval-iters", "2", "--eval-micro-batch-size", "4"][..],
            "micro-batches of 4",
        ),
        (
            &["--eval-iters", "1", "--eval-global-batch-size", "8"][..],
            "one iteration of 8",
        ),
        (
            &[
                "--eval-iters",
                "1",
                "--eval-global-batch-size",
                "8",
                "--eval-micro-batch-size",
                "1",
                "--nproc-per-node",
                "2",
            ][..],
            "DP 2, micro-batches of 1",
        ),
    ] {
        assert_close(&frozen_validations(flags), &base, what);
    }
    // Two evaluation batches of 8: each validation reads the next 16 samples, so the first
    // scores what the first two validations of 8 did.
    let wide = frozen_validations(&["--eval-iters", "2", "--eval-global-batch-size", "8"]);
    let first_two = (base[0].1 + base[1].1) / 2.0;
    assert!(
        (wide[0].1 - first_two).abs() < 1e-6,
        "{wide:?} against {base:?}"
    );
    assert!(
        (wide[1].1 - base[1].1).abs() > 1e-4,
        "{wide:?} against {base:?}"
    );
}

#[test]
fn eval_batch_sizes_that_do_not_divide_over_the_data_parallel_ranks_are_refused_by_name() {
    for flags in [
        &[
            "--eval-global-batch-size",
            "6",
            "--eval-micro-batch-size",
            "4",
        ][..],
        &["--eval-micro-batch-size", "0"][..],
        &[
            "--eval-global-batch-size",
            "3",
            "--nproc-per-node",
            "2",
            "--eval-micro-batch-size",
            "1",
        ][..],
    ] {
        let e = pretrain(&args(&[FROZEN, flags].concat()))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--eval-global-batch-size") && e.contains("--eval-micro-batch-size"),
            "{flags:?}: {e}"
        );
    }
}

#[test]
fn a_checkpoint_records_the_validation_samples_of_the_evaluation_batch_size() {
    let dir = tmpdir("eval-batch-resume");
    let flags = [
        RESUMED,
        &[
            "--eval-global-batch-size",
            "8",
            "--eval-micro-batch-size",
            "4",
        ],
    ]
    .concat();
    saved_and_resumed(&dir, &flags, (16, "2 evaluations of 1 batch of 8"));
    let _ = std::fs::remove_dir_all(dir);
}

/// `--full-validation` against Megatron-LM's own (`bench/make_full_validation_fixture.py`): the
/// `gpt_adam` run's weights scored on one epoch of a 70/30 split's validation part (15 samples)
/// three times in a row, at DP 1 with two micro-batches per evaluation iteration (each pass
/// reads every sample twice: equal losses; also at TP 2 and PP 2), at DP 2 (8 and 7 samples:
/// Megatron's cyclic iterators read one twice, and go on from one validation to the next) and
/// at DP 2 with evaluation batch sizes of their own.
#[test]
fn full_validation_scores_what_megatron_lms_full_validation_scores() {
    use common::megatron_resume::{convert, fixture, train, GPT};
    let text = std::fs::read_to_string(fixture("full_validation.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let dir = tmpdir("full-validation");
    let save = dir.join("gpt_adam");
    convert(&fixture("gpt_adam"), &save).unwrap();
    let one_two = ["--micro-batch-size", "1", "--global-batch-size", "2"];
    let eval_batches = [
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--eval-micro-batch-size",
        "1",
    ];
    let full = |v: &[&'static str]| [&["--full-validation"][..], v].concat();
    let cases: [(&str, &str, Vec<&str>); 6] = [
        ("dp1_two_micro_batches", "1", full(&one_two)),
        // The same data-parallel rank over two tensor-parallel ranks or two pipeline stages.
        (
            "dp1_two_micro_batches",
            "2",
            full(&[&one_two[..], &["--tensor-model-parallel-size", "2"]].concat()),
        ),
        (
            "dp1_two_micro_batches",
            "2",
            full(&[&one_two[..], &["--pipeline-model-parallel-size", "2"]].concat()),
        ),
        ("dp2", "2", full(&one_two)),
        (
            "dp2_eval_batches",
            "2",
            full(&[&eval_batches[..], &["--eval-global-batch-size", "4"]].concat()),
        ),
        // Not full: 2 evaluation batches of 6 per validation, in micro-batches of 1.
        (
            "dp2_eval_batches_not_full",
            "2",
            [
                &eval_batches[..],
                &["--eval-global-batch-size", "6", "--eval-iters", "2"],
            ]
            .concat(),
        ),
    ];
    for (name, world, batches) in cases {
        let flags = [
            &["--nproc-per-node", world, "--split", "70,30,0"][..],
            FROZEN_VALIDATIONS,
            &batches,
        ]
        .concat();
        let s = train(
            &dir.join(format!("{name}-{}", flags.join(""))),
            &save,
            GPT,
            &flags,
        );
        assert_follows_megatron_lm(name, &s.val_losses, &want, 3);
    }
    // --multiple-validation-sets: the two datasets of --valid-data-path scored apart, each
    // with its own iterators, in order, at DP 2.
    let data = |p: &str| fixture(&format!("data/{p}")).display().to_string();
    let (main, other) = (data("tokens_text_document"), data("tokens_b_text_document"));
    let cache = dir.join("sets-cache").display().to_string();
    let run = common::megatron_resume::RUN;
    let at = run.iter().position(|f| *f == "--split").unwrap();
    let mut v: Vec<&str> = vec!["megatron", "--train-data-path", &main, "--valid-data-path"];
    v.extend([main.as_str(), other.as_str(), "--data-cache-path", &cache]);
    v.extend(run[..at].iter().chain(&run[at + 2..]));
    let load = save.display().to_string();
    v.extend(GPT);
    v.extend([
        "--load",
        &load,
        "--nproc-per-node",
        "2",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--multiple-validation-sets",
        "--validation-set-names",
        "main",
        "other",
    ]);
    v.extend(FROZEN_VALIDATIONS);
    v.push("--full-validation");
    let s = pretrain(&parse_train(&v)).unwrap();
    assert_follows_megatron_lm("dp2_two_sets", &s.val_losses, &want, 6);
    let _ = std::fs::remove_dir_all(dir);
}

/// The fixture script's frozen run: the loaded weights (`--finetune`, lr 0) validated after each
/// of 2 iterations and at the end, three validations in a row.
const FROZEN_VALIDATIONS: &[&str] = &[
    "--eval-iters",
    "1",
    "--eval-interval",
    "1",
    "--train-iters",
    "2",
    "--lr",
    "0",
    "--min-lr",
    "0",
    "--finetune",
];

/// Our first `n` validation losses against Megatron-LM's of fixture case `name`.
fn assert_follows_megatron_lm(
    name: &str,
    val_losses: &[(u64, f64)],
    want: &serde_json::Value,
    n: usize,
) {
    {
        let theirs: Vec<f64> = want[name]["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let ours: Vec<f64> = val_losses.iter().take(n).map(|v| v.1).collect();
        eprintln!("{name}: ours {ours:?}, Megatron-LM's {theirs:?}");
        assert_eq!((ours.len(), theirs.len()), (n, n), "{name}: {ours:?}");
        for (a, b) in ours.iter().zip(&theirs) {
            assert!(
                (a - b).abs() <= 2e-6 * b.abs(),
                "{name}: {ours:?} against Megatron-LM's {theirs:?}"
            );
        }
    }
}

#[test]
fn full_validation_is_refused_where_megatron_has_no_epoch_to_score() {
    // Mock data has no end; BERT's datasets are not what Megatron's flag reads.
    let e = pretrain(&args(
        &[FROZEN, &["--full-validation", "--train-iters", "2"][..]].concat(),
    ))
    .map(|_| ())
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--full-validation") && e.contains("mock data"),
        "{e}"
    );
    let e = pretrain(&bert_args(&["--full-validation", "--train-iters", "2"]))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--full-validation") && e.contains("bert"), "{e}");
}
