//! `--log-memory`: each log interval the metrics file carries this rank's memory by kind, and
//! the start-up prediction uses the formulas the measurements are checked against.

mod common;

use common::*;
use megatron_training::memory::korthikanti_layer_bytes;
use megatron_training::pretrain;

#[test]
fn log_memory_writes_each_kind_and_activations_match_the_formula() {
    let dir = tmpdir("log-memory");
    let metrics = dir.join("metrics.jsonl");
    let m = metrics.to_str().unwrap();
    let v = [
        PP_MODEL,
        &["--train-iters", "2", "--log-memory", "--metrics-file", m],
    ]
    .concat();
    let s = pretrain(&args(&v)).unwrap();
    let mem = &last_memory_record(&metrics);
    let get = |k: &str| mem[k].as_u64().unwrap_or_else(|| panic!("{k} in {mem}"));
    // fp32 plain Adam on one rank: gradients as large as the parameters, two moments.
    assert!(get("parameters") > 0);
    assert_eq!(get("gradients"), get("parameters"));
    assert_eq!(get("optimizer_state"), 2 * get("parameters"));
    assert_eq!(get("activations"), s.peak_activation_bytes as u64);
    assert!(get("process_peak") >= get("parameters") + get("gradients"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn korthikanti_formula_follows_the_paper_for_each_layout() {
    // s = 32, b = 2, h = 64, a = 4: sbh = 4096; 5as/h = 10.
    let base = [
        PP_MODEL,
        &[
            "--train-iters",
            "3",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
        ][..],
    ]
    .concat();
    let cfg = |more: &[&str]| {
        args(&[&base[..], more].concat())
            .validate(250)
            .expect("valid flags")
    };
    let sbh = 32.0 * 2.0 * 64.0;
    assert_eq!(korthikanti_layer_bytes(&cfg(&[])), sbh * (34.0 + 10.0));
    let tp2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];
    assert_eq!(
        korthikanti_layer_bytes(&cfg(&tp2)),
        sbh * (10.0 + 24.0 / 2.0 + 10.0 / 2.0)
    );
    let tp2sp = [&tp2[..], &["--sequence-parallel"]].concat();
    assert_eq!(korthikanti_layer_bytes(&cfg(&tp2sp)), sbh * 44.0 / 2.0);
    let sel = [&tp2sp[..], &["--recompute-activations"]].concat();
    assert_eq!(korthikanti_layer_bytes(&cfg(&sel)), 34.0 * sbh / 2.0);
    let full = [&tp2sp[..], &["--recompute-granularity", "full"]].concat();
    assert_eq!(korthikanti_layer_bytes(&cfg(&full)), 2.0 * sbh / 2.0);
}
