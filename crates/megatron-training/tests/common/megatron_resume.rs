//! Megatron-LM runs stopped mid-way (`tests/fixtures/megatron_resume`, written by
//! `bench/make_megatron_optim_fixtures.py`) and the flags and helpers that continue them here.

use super::{parse_train, tmpdir};
use megatron_training::convert::{torch_dist_to_megatron, torch_to_megatron};
use std::path::{Path, PathBuf};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron_resume")
        .join(name)
}

pub const GPT: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
];
pub const LLAMA: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "48",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--norm-epsilon",
    "1e-6",
    "--no-rope-fusion",
];

/// The flags the fixture script gave Megatron-LM (besides the model's and the layout's).
pub const RUN: &[&str] = &[
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
    "--make-vocab-size-divisible-by",
    "32",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--init-method-std",
    "0.2",
    "--seed",
    "5",
    "--split",
    "100,0,0",
    "--eval-iters",
    "0",
    "--train-iters",
    "6",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--adam-beta2",
    "0.95",
    "--no-progress-bar",
    "--num-threads",
    "1",
];

/// Megatron-LM's `(iteration, lm loss, grad norm)` after the save.
pub fn megatron_lm_log(name: &str) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(fixture(name).join("losses.json")).unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    rows.iter()
        .map(|r| {
            (
                r["iteration"].as_u64().unwrap(),
                r["lm_loss"].as_f64().unwrap(),
                r["grad_norm"].as_f64().unwrap(),
            )
        })
        .filter(|r| r.0 > 3)
        .collect()
}

/// The command line of a run on the fixtures' dataset (its index cache under `dir`) with
/// [`RUN`]'s flags and then `extra`.
pub fn fixture_run(dir: &Path, extra: &[&str]) -> Vec<String> {
    let data = fixture("data/tokens_text_document");
    let cache = dir.join("cache");
    let mut v: Vec<String> = vec![
        "megatron".into(),
        "--data-path".into(),
        data.display().to_string(),
        "--data-cache-path".into(),
        cache.display().to_string(),
    ];
    v.extend(RUN.iter().chain(extra).map(|s| s.to_string()));
    v
}

/// `megatron train` on the fixtures' dataset (its index cache under `dir`) with [`RUN`]'s
/// flags, `--load load`, the model's flags and `extra`.
pub fn train(
    dir: &Path,
    load: &Path,
    model: &[&str],
    extra: &[&str],
) -> megatron_training::TrainSummary {
    let load = ["--load", load.to_str().unwrap()];
    let v = fixture_run(dir, &[&load[..], model, extra].concat());
    megatron_training::pretrain(&parse_train(&v)).unwrap()
}

/// Converts the checkpoint `input` to `output` with the converter of its format: the legacy
/// `--ckpt-format torch` for fixtures named `legacy_*`, torch_dist for the rest.
pub fn convert(input: &Path, output: &Path) -> Result<PathBuf, megatron_training::TrainError> {
    let legacy = input
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("legacy_"));
    if legacy {
        torch_to_megatron(input, output)
    } else {
        torch_dist_to_megatron(input, output)
    }
}

/// Converts fixture `name` and trains it to iteration 6 with the model's flags and `extra`
/// (a layout, a precision); the log of iterations 4-6.
pub fn continued(name: &str, test: &str, model: &[&str], extra: &[&str]) -> Vec<(u64, f64, f64)> {
    let dir = tmpdir(&format!("mlm-resume-{name}-{test}"));
    let save = dir.join("converted");
    convert(&fixture(name), &save).unwrap();
    let s = train(&dir, &save, model, extra);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        s.start_iteration, 3,
        "{name}: the run continues at iteration 3"
    );
    s.losses
        .iter()
        .zip(&s.grad_norms)
        .map(|(&(i, l), &(j, g))| {
            assert_eq!(i, j);
            (i, l, g)
        })
        .collect()
}

/// fp32: losses and gradient norms within 2e-6 (relative) of Megatron-LM's.
pub const FP32: (f64, f64) = (2e-6, 2e-6);
/// bf16: the products each engine rounds (PyTorch's CPU bf16 GEMMs against ours) move losses
/// by a few 1e-4 and gradient norms by a few 1e-3, as much as Megatron-LM's own runs at TP 1
/// and TP 2 differ (BENCHMARKS.md).
pub const BF16: (f64, f64) = (1e-3, 1e-2);

/// fp16 (loss scaling at 128): half-precision products round differently too, by less.
pub const FP16: (f64, f64) = (1e-4, 1e-3);

/// Fixture `name` continued here (the model's flags and `extra`) follows Megatron-LM's log
/// within `tol`.
pub fn follows_megatron_lm(
    name: &str,
    test: &str,
    model: &[&str],
    extra: &[&str],
    tol: (f64, f64),
) {
    let want = megatron_lm_log(name);
    let got = continued(name, test, model, extra);
    assert_follows(&format!("{name} ({test})"), &want, &got, tol);
}

/// Ours follows Megatron-LM's log within `tol` (relative: losses, gradient norms).
pub fn assert_follows(
    what: &str,
    want: &[(u64, f64, f64)],
    got: &[(u64, f64, f64)],
    tol: (f64, f64),
) {
    assert_eq!(want.len(), got.len(), "{what}: iterations {got:?}");
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
    let worst = want.iter().zip(got).fold((0.0f64, 0.0f64), |m, (w, g)| {
        (m.0.max(rel(w.1, g.1)), m.1.max(rel(w.2, g.2)))
    });
    eprintln!(
        "{what}: largest relative difference from Megatron-LM's log: loss {:.1e}, grad norm {:.1e}",
        worst.0, worst.1
    );
    for (w, g) in want.iter().zip(got) {
        assert_eq!(w.0, g.0, "{what}");
        let close = |a: f64, b: f64, t: f64| (a - b).abs() <= t * a.abs();
        assert!(
            close(w.1, g.1, tol.0) && close(w.2, g.2, tol.1),
            "{what} iteration {}: Megatron-LM logged loss {} grad norm {}, ours {} and {}",
            w.0,
            w.1,
            w.2,
            g.1,
            g.2
        );
    }
}

/// The fixtures' experts: 4 SwiGLU experts of 16, top 2 (the script's `MOE`).
pub const MOE: &[&str] = &[
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
];

/// Mixtral-style: [`LLAMA`] with [`MOE`].
pub fn mixtral() -> Vec<&'static str> {
    [LLAMA, MOE].concat()
}

/// Every tensor of a checkpoint by name (weights and optimizer state).
pub fn all_tensors(save: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    megatron_training::checkpointing::load_checkpoint(save, None)
        .unwrap()
        .tensors
        .into_iter()
        .collect()
}
