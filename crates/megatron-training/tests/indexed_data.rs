//! Training on Megatron indexed datasets: preprocess, blend, cache, resume, inspect.

mod common;

use clap::Parser;
use megatron_data::{build_tokenizer_from, TokenizerSpec};
use megatron_training::checkpointing::TRACKER;
use megatron_training::{inspect_data, pretrain, InspectArgs, TrainArgs};

#[derive(Parser)]
#[command(args_override_self = true)]
struct Wrap {
    #[command(flatten)]
    args: TrainArgs,
}

#[derive(Parser)]
#[command(args_override_self = true)]
struct InspectWrap {
    #[command(flatten)]
    args: InspectArgs,
}

fn gpt2_dir() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../megatron-data/tests/fixtures/gpt2"
    )
    .to_string()
}

/// Two small corpora preprocessed with the GPT-2 tokenizer; returns their prefixes.
fn corpora(dir: &std::path::Path) -> (String, String) {
    let spec = TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(format!("{}/vocab.json", gpt2_dir())),
        merge_file: Some(format!("{}/merges.txt", gpt2_dir())),
        ..Default::default()
    };
    let tok = build_tokenizer_from(&spec).unwrap();
    let mut prefixes = Vec::new();
    for (name, word) in [("a", "liberty"), ("b", "union")] {
        let texts = (0..120).map(|i| {
            format!(
                "The {word} of the people number {i} is {} today.",
                "strong ".repeat(i % 9)
            )
        });
        prefixes.push(common::preprocess_texts(dir, name, texts, tok.as_ref()));
    }
    (prefixes[0].clone(), prefixes[1].clone())
}

fn base(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "m",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--eval-iters",
        "1",
        "--eval-interval",
        "3",
        "--log-interval",
        "1",
        "--peak-tflops",
        "1",
        "--no-progress-bar",
        "--num-threads",
        "2",
        "--split",
        "90,10,0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push("--vocab-file".into());
    v.push(format!("{}/vocab.json", gpt2_dir()));
    v.push("--merge-file".into());
    v.push(format!("{}/merges.txt", gpt2_dir()));
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[test]
fn trains_on_a_blend_of_indexed_datasets_with_cache_and_exact_resume() {
    let dir = std::env::temp_dir().join(format!("megatron-rs-indexed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = corpora(&dir);
    let cache = dir.join("cache").display().to_string();
    let save = dir.join("ckpt").display().to_string();
    let run = |extra: &[&str]| {
        let mut args = base(&[
            "--data-path",
            "0.3",
            &a,
            "0.7",
            &b,
            "--data-cache-path",
            &cache,
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        pretrain(&Wrap::try_parse_from(args).unwrap().args).unwrap()
    };
    let first = run(&[
        "--train-iters",
        "6",
        "--save",
        &save,
        "--save-interval",
        "3",
    ]);
    let cached: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert!(
        cached
            .iter()
            .any(|f| f.ends_with("-GPTDataset-train-shuffle_index.npy")),
        "{cached:?}"
    );
    assert!(
        cached
            .iter()
            .filter(|f| f.ends_with("description.txt"))
            .count()
            >= 2,
        "one description per dataset and split: {cached:?}"
    );
    let modified: Vec<_> = cached
        .iter()
        .map(|f| {
            std::fs::metadata(dir.join("cache").join(f))
                .unwrap()
                .modified()
                .unwrap()
        })
        .collect();

    // Same description: indices come from the cache, and the run is the same.
    let again = run(&["--train-iters", "6"]);
    assert_eq!(first.losses, again.losses);
    let modified2: Vec<_> = cached
        .iter()
        .map(|f| {
            std::fs::metadata(dir.join("cache").join(f))
                .unwrap()
                .modified()
                .unwrap()
        })
        .collect();
    assert_eq!(modified, modified2, "the cache was reused, not rewritten");

    // Resume from iteration 3: the sampler continues at the consumed-samples count.
    std::fs::write(std::path::Path::new(&save).join(TRACKER), "3\n").unwrap();
    let resumed = run(&["--train-iters", "6", "--load", &save]);
    for (x, y) in first.losses[3..].iter().zip(&resumed.losses) {
        assert_eq!(x.1.to_bits(), y.1.to_bits(), "iteration {}", x.0);
    }

    // Document resets and end-of-document loss masking change what the model sees.
    let no_dropout = [
        "--train-iters",
        "2",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ];
    let documents = [
        &no_dropout[..],
        &[
            "--reset-position-ids",
            "--reset-attention-mask",
            "--eod-mask-loss",
        ],
    ]
    .concat();
    let plain = run(&no_dropout);
    let reset = run(&documents);
    assert!(reset.losses.iter().all(|l| l.1.is_finite()));
    assert_ne!(plain.losses[0].1, reset.losses[0].1);
    // The same documents under context parallelism, both attention layouts: all-to-all hands
    // the kernel whole sequences with the micro-batch's document starts, the ring each block
    // its rows' starts in its keys' positions; each rank's tokens keep their document
    // positions. The one-rank losses either way.
    let cp_matches = |flags: &[&str], serial: &megatron_training::TrainSummary, what: &str| {
        for comm in ["a2a", "p2p"] {
            let cp_flags = [
                "--nproc-per-node",
                "2",
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                comm,
            ];
            let cp = run(&[flags, &cp_flags].concat());
            let what = format!("CP 2 ({comm}) with {what}");
            common::assert_losses_close(&what, &serial.losses, &cp.losses, 1e-5);
        }
    };
    cp_matches(&documents, &reset, "document masks");
    // A sliding window (--window-size) is one more first key per query, merged with the
    // document's: the one-rank losses again under both context-parallel layouts.
    let windowed = [&documents[..], &["--window-size", "(3,0)"]].concat();
    let serial = run(&windowed);
    assert_ne!(serial.losses, reset.losses, "the window changes the model");
    cp_matches(&windowed, &serial, "document masks and a window");

    // One dataset per split instead of --split.
    let mut args = base(&[
        "--train-data-path",
        &a,
        "--valid-data-path",
        &b,
        "--train-iters",
        "3",
    ]);
    args.retain(|x| x != "--split" && x != "90,10,0");
    let per_split = pretrain(&Wrap::try_parse_from(args).unwrap().args).unwrap();
    assert_eq!(per_split.losses.len(), 3);
    assert_eq!(
        per_split.val_losses.len(),
        2,
        "validation ran on the --valid-data-path dataset (at iteration 3 and after training)"
    );

    // A new seed is a new description: new cache entries.
    run(&["--train-iters", "2", "--seed", "99"]);
    let n_after = std::fs::read_dir(&cache).unwrap().count();
    assert!(n_after > cached.len());

    // inspect-data prints the samples training reads: from both datasets, 17 tokens each.
    let mut args = base(&["--data-path", "0.3", &a, "0.7", &b, "--train-iters", "6"]);
    args.extend(
        ["--start", "0", "--count", "10"]
            .iter()
            .map(|s| s.to_string()),
    );
    let rows = inspect_data(&InspectWrap::try_parse_from(args).unwrap().args).unwrap();
    assert_eq!(rows.len(), 10);
    assert!(rows.iter().all(|r| r.len() == 17));
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(format!("{}/vocab.json", gpt2_dir())),
        merge_file: Some(format!("{}/merges.txt", gpt2_dir())),
        ..Default::default()
    })
    .unwrap();
    let text: String = rows.iter().map(|r| tok.decode(r)).collect();
    assert!(text.contains("liberty") && text.contains("union"), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_dataset_of_another_tokenizer_is_refused_naming_the_token_id_on_every_layout() {
    // GPT-2 token ids read under a NullTokenizer of 100 ids: every sample holds ids past the
    // vocabulary. One rank, and two data-parallel ranks (where a rank that fails must not leave
    // its peer waiting in the gradient all-reduce).
    let dir = std::env::temp_dir().join(format!("megatron-rs-oov-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, _) = corpora(&dir);
    for layout in [&["--nproc-per-node", "1"], &["--nproc-per-node", "2"]] {
        let mut args = base(&[
            "--data-path",
            &a,
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
            "--train-iters",
            "2",
        ]);
        args.extend(layout.iter().map(|s| s.to_string()));
        let e = pretrain(&Wrap::try_parse_from(args).unwrap().args)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("--data-path {a}: sample "))
                && e.contains("outside the tokenizer's vocabulary of 101 ids"),
            "{layout:?}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn data_args_files_stand_for_the_data_path_flags_they_hold() {
    // Megatron's --data-args-path and --per-split-data-args-path: long blends read from a file
    // train exactly as the same blend on the command line.
    let dir = std::env::temp_dir().join(format!("megatron-rs-data-args-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = corpora(&dir);
    let train = |extra: &[&str]| {
        let mut args = base(&["--train-iters", "3"]);
        args.extend(extra.iter().map(|s| s.to_string()));
        pretrain(&Wrap::try_parse_from(args).unwrap().args).map_err(|e| e.to_string())
    };
    let blend = dir.join("blend.txt");
    std::fs::write(&blend, format!("0.3 {a}\n0.7 {b}\n")).unwrap();
    let inline = train(&["--data-path", "0.3", &a, "0.7", &b]).unwrap();
    let from_file = train(&["--data-args-path", blend.to_str().unwrap()]).unwrap();
    assert_eq!(inline.losses, from_file.losses);
    assert_eq!(inline.val_losses, from_file.val_losses);
    let per_split = dir.join("splits.json");
    let json = serde_json::json!({ "train": ["0.3", a, "0.7", b], "valid": b, "test": [] });
    std::fs::write(&per_split, json.to_string()).unwrap();
    let inline = train(&[
        "--train-data-path",
        "0.3",
        &a,
        "0.7",
        &b,
        "--valid-data-path",
        &b,
    ])
    .unwrap();
    let from_file = train(&["--per-split-data-args-path", per_split.to_str().unwrap()]).unwrap();
    assert_eq!(inline.losses, from_file.losses);
    assert_eq!(inline.val_losses, from_file.val_losses);
    // Refused by name: both forms at once, a missing file.
    let e = train(&[
        "--data-args-path",
        blend.to_str().unwrap(),
        "--data-path",
        &a,
    ])
    .unwrap_err();
    assert!(e.contains("drop --data-path"), "{e}");
    let missing = dir.join("none.txt");
    let e = train(&["--data-args-path", missing.to_str().unwrap()]).unwrap_err();
    assert!(
        e.contains(&format!("--data-args-path {}", missing.display())),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `--calculate-per-token-loss` under `--eod-mask-loss`, where micro-batches count different
/// numbers of tokens: every token of the global batch weighs the same, so four one-sample
/// micro-batches train exactly the model one four-sample micro-batch trains (whose mean is over
/// all its tokens), while the default (each micro-batch's mean) trains another. The logged loss
/// is Megatron's GPT report, the summed loss over the counted tokens, whatever the split into
/// micro-batches: the same first loss for all three, and the same validation loss where the
/// models agree. Every layout trains the per-token model of one rank.
#[test]
fn per_token_loss_weighs_every_counted_token_alike_in_every_layout() {
    let dir = std::env::temp_dir().join(format!("megatron-rs-per-token-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, _) = corpora(&dir);
    let run = |extra: &[&str]| {
        let mut args = base(&[
            "--data-path",
            &a,
            "--eod-mask-loss",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--train-iters",
            "4",
            "--lr-warmup-iters",
            "0",
            "--eval-interval",
            "2",
            // The padded vocabulary (50304) is the same at TP 1 and 2.
            "--make-vocab-size-divisible-by",
            "64",
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        pretrain(&Wrap::try_parse_from(args).unwrap().args).unwrap()
    };
    let one_micro_batch = run(&["--micro-batch-size", "4"]);
    let per_token = run(&["--micro-batch-size", "1", "--calculate-per-token-loss"]);
    let per_micro_batch = run(&["--micro-batch-size", "1"]);
    common::assert_losses_close(
        "per-token loss over 4 micro-batches vs one micro-batch",
        &one_micro_batch.losses,
        &per_token.losses,
        1e-5,
    );
    common::assert_losses_close(
        "validation",
        &one_micro_batch.val_losses,
        &per_token.val_losses,
        1e-5,
    );
    let first = |s: &megatron_training::TrainSummary| s.losses[0].1;
    let rel = (first(&per_micro_batch) - first(&one_micro_batch)).abs() / first(&one_micro_batch);
    assert!(
        rel < 1e-6,
        "the first report is per token either way: {rel}"
    );
    let last = |s: &megatron_training::TrainSummary| s.losses.last().unwrap().1;
    let rel = (last(&per_micro_batch) - last(&one_micro_batch)).abs() / last(&one_micro_batch);
    assert!(
        rel > 1e-5,
        "micro-batch means weigh tokens differently, so the model differs: {rel}"
    );
    for (name, layout) in [
        ("dp2", &["--nproc-per-node", "2"][..]),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
        (
            "tp2-sp",
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
        (
            "cp2",
            &["--nproc-per-node", "2", "--context-parallel-size", "2"][..],
        ),
    ] {
        let r = run(&[
            &["--micro-batch-size", "1", "--calculate-per-token-loss"][..],
            layout,
        ]
        .concat());
        common::assert_losses_close(name, &per_token.losses, &r.losses, 1e-5);
        common::assert_losses_close(name, &per_token.val_losses, &r.val_losses, 1e-5);
    }
    // Megatron's BERT reports and trains on each micro-batch's mean: refused there.
    let e = pretrain(&common::bert_args(&[
        "--train-iters",
        "3",
        "--calculate-per-token-loss",
    ]))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--model bert: --calculate-per-token-loss"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
