//! The losses of fixed GPT runs (fp32, several layouts), committed before the engine was made
//! model-generic (issue 13): every restructure since must reproduce them bit for bit on a
//! machine that runs the same kernels. The file was written by the code as it was before the
//! restructure (`MEGATRON_BLESS_GOLDEN=1` rewrites it; do that only when a change is meant to
//! change the numbers, and say so in the commit).

mod common;

use common::{args, tmpdir};
use megatron_training::pretrain;
use serde_json::{json, Value};
use std::path::PathBuf;

const MODEL: &[&str] = &[
    "--num-layers",
    "4",
    "--vocab-size",
    "250",
    "--make-vocab-size-divisible-by",
    "64",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "5",
];

const LAYOUTS: &[(&str, &[&str])] = &[
    ("one-rank", &[]),
    (
        "tp2-sp",
        &[
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
    (
        "pp2-interleaved",
        &[
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
    ),
    (
        "dp2-distributed-optimizer",
        &["--nproc-per-node", "2", "--use-distributed-optimizer"],
    ),
    (
        "tp2-pp2-dp2-distributed-optimizer-overlap",
        &[
            "--nproc-per-node",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "5000",
        ],
    ),
];

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/gpt_losses.json")
}

/// `(iteration, loss)` pairs as JSON: the loss as its f64 bit pattern (exact) and as a number
/// (for people).
fn encode(losses: &[(u64, f64)]) -> Value {
    losses
        .iter()
        .map(|(i, l)| json!([i, format!("{:016x}", l.to_bits()), l]))
        .collect()
}

fn decode(v: &Value) -> Vec<(u64, f64)> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|e| {
            let bits = u64::from_str_radix(e[1].as_str().expect("hex bits"), 16).expect("hex");
            (e[0].as_u64().expect("iteration"), f64::from_bits(bits))
        })
        .collect()
}

#[test]
fn gpt_losses_are_bit_identical_to_the_golden_file_from_before_the_restructure() {
    let dir = tmpdir("golden");
    let mut runs = serde_json::Map::new();
    for (name, layout) in LAYOUTS {
        let mut extra: Vec<&str> = MODEL.to_vec();
        extra.extend_from_slice(layout);
        let s = pretrain(&args(&extra)).unwrap();
        assert_eq!(s.losses.len(), 5, "{name}");
        runs.insert(
            name.to_string(),
            json!({"losses": encode(&s.losses), "val_losses": encode(&s.val_losses)}),
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    let kernels = megatron_tensor::cpu::kernel_fingerprint();
    let path = golden_path();
    if std::env::var_os("MEGATRON_BLESS_GOLDEN").is_some() {
        let doc = json!({"kernels": kernels, "runs": runs});
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
        println!("wrote {}", path.display());
        return;
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (the golden file is committed)", path.display()));
    let golden: Value = serde_json::from_str(&text).unwrap();
    // Another vector level or GEMM sums in another order: there the runs must agree to f32
    // rounding (1e-5 relative) instead of bit for bit.
    let exact = golden["kernels"].as_str() == Some(kernels.as_str());
    if !exact {
        println!(
            "golden file written with kernels {}, this machine runs {kernels}: comparing within 1e-5 relative, not bit for bit",
            golden["kernels"]
        );
    }
    for (name, _) in LAYOUTS {
        for key in ["losses", "val_losses"] {
            let want = decode(&golden["runs"][name][key]);
            let got = decode(&runs[*name][key]);
            assert_eq!(want.len(), got.len(), "{name} {key}: count");
            assert!(!want.is_empty(), "{name} {key}: golden file has no entries");
            for (w, g) in want.iter().zip(&got) {
                assert_eq!(w.0, g.0, "{name} {key}: iterations");
                if exact {
                    assert_eq!(
                        w.1.to_bits(),
                        g.1.to_bits(),
                        "{name} {key} iteration {}: golden {} now {}",
                        w.0,
                        w.1,
                        g.1
                    );
                } else {
                    assert!(
                        (w.1 - g.1).abs() <= 1e-5 * w.1.abs().max(1.0),
                        "{name} {key} iteration {}: golden {} now {}",
                        w.0,
                        w.1,
                        g.1
                    );
                }
            }
        }
    }
}
