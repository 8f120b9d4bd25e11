//! `--log-straggler`: a rank slowed on purpose (the test hook sleeps before its forward and
//! backward) is named as the straggler in the log's metrics, and only after it has been slow
//! for --straggler-patience intervals.

mod common;

fn run(extra: &[&str], name: &str) -> Vec<serde_json::Value> {
    let dir =
        std::env::temp_dir().join(format!("megatron-straggler-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("m.jsonl").display().to_string();
    let mut flags = vec![
        "--nproc-per-node",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "8",
        "--log-interval",
        "2",
        "--log-straggler",
        "--metrics-file",
        &metrics,
    ];
    flags.extend_from_slice(extra);
    megatron_training::pretrain(&common::args(&flags)).unwrap();
    let rows = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("lm_loss").is_some())
        .collect();
    std::fs::remove_dir_all(&dir).ok();
    rows
}

#[test]
fn a_rank_slowed_on_purpose_is_named_the_straggler() {
    let rows = run(
        &["--inject-slow-rank", "3", "--inject-slow-ms", "40"],
        "slow",
    );
    assert_eq!(rows.len(), 4);
    for (i, r) in rows.iter().enumerate() {
        let t = &r["rank_step_times"];
        assert_eq!(t["max_rank"], 3, "interval {i}: {t}");
        assert!(t["max_ms"].as_f64().unwrap() >= 40.0, "{t}");
        assert!(t["min_ms"].as_f64().unwrap() < 40.0, "{t}");
        // Named from the second slow interval on (patience 2), with the intervals counted.
        match i {
            0 => assert!(t.get("straggler").is_none(), "{t}"),
            _ => assert_eq!(t["straggler"], serde_json::json!([3, i + 1]), "{t}"),
        }
    }
}

#[test]
fn no_rank_is_named_when_none_is_slowed() {
    // A margin far above scheduling noise on a shared 2-core machine.
    let rows = run(&["--straggler-margin", "20"], "even");
    for r in &rows {
        let t = &r["rank_step_times"];
        assert!(t["max_ms"].as_f64().unwrap() >= t["min_ms"].as_f64().unwrap());
        assert!(t.get("straggler").is_none(), "{t}");
    }
}
