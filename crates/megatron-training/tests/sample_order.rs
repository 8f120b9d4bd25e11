//! `--dataloader-type cyclic` (Megatron's `MegatronPretrainingRandomSampler`, with and without
//! `--no-data-sharding`). Megatron-LM runs that read their batches through Megatron-LM's own
//! cyclic loader (`bench/make_megatron_optim_fixtures.py`, the `cyclic_*` runs), stopped at
//! iteration 3 and continued here, must log what Megatron-LM logged when it went on; and a run
//! resumed here must read what the uninterrupted run read.

mod common;

use common::megatron_resume::*;
use common::tmpdir;
use megatron_training::pretrain;

const CYCLIC: &[&str] = &["--dataloader-type", "cyclic", "--num-workers", "0"];
const DP2: &[&str] = &["--nproc-per-node", "2"];
const TP2_DP2: &[&str] = &["--nproc-per-node", "4", "--tensor-model-parallel-size", "2"];

#[test]
fn a_cyclic_run_continues_with_the_losses_megatron_lm_logs() {
    // Saved at DP 2, where each data-parallel rank shuffles its own half of the dataset: the
    // same buckets at DP 2, with or without tensor parallelism.
    follows_megatron_lm("cyclic_gpt_dp2", "dp2", GPT, &[CYCLIC, DP2].concat(), FP32);
    let tp2 = [CYCLIC, TP2_DP2].concat();
    follows_megatron_lm("cyclic_gpt_dp2", "tp2dp2", GPT, &tp2, FP32);
}

#[test]
fn a_cyclic_run_without_data_sharding_continues_with_the_losses_megatron_lm_logs() {
    // Saved at TP 2 x DP 2; one shuffle of the whole dataset, strided over the DP ranks.
    let flags = [CYCLIC, &["--no-data-sharding"], DP2].concat();
    let name = "cyclic_llama_no_sharding_tp2_dp2";
    follows_megatron_lm(name, "dp2", LLAMA, &flags, FP32);
}

#[test]
fn a_cyclic_run_read_in_another_order_leaves_megatron_lms_log() {
    // The same checkpoint continued with the default sampler, at one data-parallel rank (one
    // bucket, not two), or without data sharding: each reads other samples, and its losses
    // move far past the tolerance of the tests above, which can therefore fail.
    let want = megatron_lm_log("cyclic_gpt_dp2");
    let no_sharding = [CYCLIC, &["--no-data-sharding"], DP2].concat();
    for (test, extra) in [
        ("single", DP2),
        ("dp1", CYCLIC),
        ("no-sharding", &no_sharding[..]),
    ] {
        let got = continued("cyclic_gpt_dp2", test, GPT, extra);
        let worst = want
            .iter()
            .zip(&got)
            .map(|(w, g)| (w.1 - g.1).abs() / w.1)
            .fold(0.0f64, f64::max);
        eprintln!("cyclic_gpt_dp2 continued {test}: losses differ by up to {worst:.1e}");
        assert!(worst > 1e-3, "{test}: {got:?} against {want:?}");
    }
}

/// `megatron train` on the fixtures' dataset with [`RUN`]'s flags and `extra`, from scratch.
fn fresh(dir: &std::path::Path, extra: &[&str]) -> Result<megatron_training::TrainSummary, String> {
    pretrain(&common::parse_train(&fixture_run(dir, extra))).map_err(|e| e.to_string())
}

#[test]
fn a_resumed_cyclic_run_trains_and_validates_on_what_the_uninterrupted_run_does() {
    let dir = tmpdir("cyclic-resume");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let eval: &[&str] = &[
        "--split",
        "80,20,0",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
    ];
    let flags = [CYCLIC, DP2, GPT, eval].concat();
    let save = [&flags[..], &["--save", c, "--save-interval", "3"]].concat();
    let straight = fresh(&dir, &save).unwrap();
    assert_eq!(
        straight.val_losses.len(),
        4,
        "after iterations 2, 4, 6 and at the end"
    );
    let resumed = train(&dir, &ckpt, &flags, &["--ckpt-step", "3"]);
    assert_eq!(resumed.start_iteration, 3);
    assert_eq!(resumed.losses, straight.losses[3..]);
    assert_eq!(resumed.val_losses, straight.val_losses[1..]);
    // Training and validation read shuffled samples: not those the default sampler reads.
    let plain = fresh(&dir, &[DP2, GPT, eval].concat()).unwrap();
    assert_ne!(plain.losses[0], straight.losses[0]);
    assert_ne!(plain.val_losses[0], straight.val_losses[0]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_dataset_with_fewer_samples_than_one_micro_batch_per_rank_is_refused_by_flag_and_split() {
    // Raw text of 50 bytes: 3 windows of 16 + 1 tokens, fewer than 2 ranks x 2 samples.
    let dir = tmpdir("cyclic-small");
    let text = dir.join("tiny.txt");
    std::fs::write(&text, "abcdefghij".repeat(5)).unwrap();
    let mut v = vec![
        "megatron",
        "--data-path",
        text.to_str().unwrap(),
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ];
    v.extend_from_slice(&RUN[4..]);
    v.extend_from_slice(&[CYCLIC, DP2, GPT].concat());
    let e = pretrain(&common::parse_train(&v)).unwrap_err().to_string();
    assert!(
        e.contains("--dataloader-type cyclic, Train split")
            && e.contains("3 samples are fewer than one micro-batch"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn inspect_data_under_cyclic_shows_the_dataset_in_torch_randperms_order() {
    // One data-parallel rank with micro-batches of 2 over the fixtures' 51-sample training
    // split: an epoch is 50 samples, epoch e reads them at torch.randperm(50) seeded with e,
    // which torch 2.15 printed as [44, 39, 7, 6, ...] (epoch 0) and [45, 25, 14, 31, ...]
    // (epoch 1); `single` reads the dataset's own order.
    let dir = tmpdir("cyclic-inspect");
    let inspect = |extra: &[&str], start: u64, count: u64| {
        let (s, c) = (start.to_string(), count.to_string());
        let range = ["--start", &s, "--count", &c];
        let v = fixture_run(&dir, &[GPT, extra, &range[..]].concat());
        megatron_training::inspect_data(&common::parse_inspect(&v)).unwrap()
    };
    let single = inspect(&[], 0, 51);
    let first = inspect(CYCLIC, 0, 4);
    let next = inspect(CYCLIC, 50, 4);
    let _ = std::fs::remove_dir_all(dir);
    for (got, want) in first.iter().zip([44, 39, 7, 6]) {
        assert_eq!(got, &single[want]);
    }
    for (got, want) in next.iter().zip([45, 25, 14, 31]) {
        assert_eq!(got, &single[want]);
    }
}

#[test]
fn a_bert_run_reads_through_the_cyclic_sampler_and_resumes_exactly() {
    // The sampler is the family's whatever it is: BERT's samples at DP 2 under `cyclic`, a
    // save at iteration 3 and a resume read what the uninterrupted run read.
    let dir = tmpdir("cyclic-bert");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let run = [CYCLIC, DP2, &["--train-iters", "6"]].concat();
    let straight = pretrain(&common::bert_args(
        &[&run[..], &["--save", c, "--save-interval", "3"]].concat(),
    ))
    .unwrap();
    let resumed = pretrain(&common::bert_args(
        &[&run[..], &["--load", c, "--ckpt-step", "3"]].concat(),
    ))
    .unwrap();
    assert_eq!(resumed.start_iteration, 3);
    assert_eq!(resumed.losses, straight.losses[3..]);
    let plain = pretrain(&common::bert_args(
        &[DP2, &["--train-iters", "6"][..]].concat(),
    ))
    .unwrap();
    assert_ne!(plain.losses[0], straight.losses[0], "the order changed");
    let _ = std::fs::remove_dir_all(dir);
}
