//! `megatron train --model t5` on the committed sentence-split fixture (span corruption with
//! 100 sentinels): losses fall; TP 2 with and without SP, DP 2 with the distributed optimizer,
//! the encoder/decoder pipeline split and TP 2 + SP x PP 2 x DP 2 train the model one rank
//! trains (fp32, dropout on);
//! checkpoints record the T5 stacks and change layout; what T5 does not support is refused by
//! flag.

mod common;

use common::{
    assert_same_training, bert_args, bert_args_on, parse_generate, sentencepiece_sotu, tmpdir,
};
use megatron_training::checkpointing::{load_checkpoint, LoadedCheckpoint};
use megatron_training::{pretrain, TrainArgs, TrainSummary};

const T5_MODEL: &[&str] = &[
    "--model",
    "t5",
    "--vocab-extra-ids",
    "100",
    "--encoder-num-layers",
    "2",
    "--decoder-num-layers",
    "1",
    "--encoder-seq-length",
    "32",
    "--decoder-seq-length",
    "16",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--relative-attention-num-buckets",
    "8",
    "--relative-attention-max-distance",
    "16",
];

fn t5_args(extra: &[&str]) -> TrainArgs {
    bert_args(&[T5_MODEL, extra].concat())
}

fn t5_run(dir: &std::path::Path, name: &str, layout: &[&str]) -> (TrainSummary, LoadedCheckpoint) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let summary = pretrain(&t5_args(
        &[&["--train-iters", "5", "--save", &s][..], layout].concat(),
    ))
    .unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

#[test]
fn t5_tensor_and_data_parallel_layouts_match_one_rank() {
    let dir = tmpdir("t5-layouts");
    let serial = t5_run(&dir, "serial", &[]);
    let stacks = serial
        .1
        .meta
        .t5
        .expect("a T5 checkpoint records its stacks");
    assert_eq!((stacks.encoder_layers, stacks.decoder_layers), (2, 1));
    assert!(serial
        .1
        .tensors
        .contains_key("decoder.layers.0.cross_attention.linear_kv.weight"));
    for (name, layout) in [
        (
            "tp2",
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
        ),
        (
            "tp2 + sp",
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
        (
            "dp2 + distributed optimizer",
            &["--nproc-per-node", "2", "--use-distributed-optimizer"][..],
        ),
        (
            "pp2 split at the decoder",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-split-rank",
                "1",
            ][..],
        ),
        (
            "pp2 x dp2 + distributed optimizer, overlapped reduction",
            &[
                "--nproc-per-node",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-split-rank",
                "1",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--ddp-bucket-size",
                "20000",
            ][..],
        ),
        (
            "tp2 + sp x (1 encoder + 1 decoder stage) x dp2 + distributed optimizer",
            &[
                "--nproc-per-node",
                "8",
                "--tensor-model-parallel-size",
                "2",
                "--encoder-pipeline-model-parallel-size",
                "1",
                "--use-distributed-optimizer",
                "--sequence-parallel",
            ][..],
        ),
    ] {
        let run = t5_run(&dir, &name.replace(' ', ""), layout);
        assert_same_training(&format!("t5 {name}"), &serial, &run, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn t5_span_corruption_loss_falls() {
    let s = pretrain(&t5_args(&[
        "--train-iters",
        "60",
        "--lr",
        "1e-2",
        "--eval-interval",
        "60",
        "--init-method-std",
        "0.1",
    ]))
    .unwrap();
    let first: f64 = s.losses[..5].iter().map(|l| l.1).sum::<f64>() / 5.0;
    let last: f64 = s.losses[55..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    assert!(last < first - 1.0, "loss {first} -> {last}");
}

#[test]
fn t5_refuses_what_it_does_not_support_by_flag() {
    for (flags, want) in [
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--nproc-per-node",
                "2",
            ][..],
            "needs --pipeline-model-parallel-split-rank",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-split-rank",
                "2",
                "--nproc-per-node",
                "2",
            ][..],
            "--pipeline-model-parallel-split-rank (2)",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "3",
                "--pipeline-model-parallel-split-rank",
                "1",
                "--nproc-per-node",
                "3",
            ][..],
            "the decoder's 1 over its 2",
        ),
        (
            &[
                "--tensor-model-parallel-size",
                "2",
                "--nproc-per-node",
                "2",
                "--sequence-parallel",
                "--micro-batch-size",
                "1",
                "--decoder-seq-length",
                "17",
            ][..],
            "--decoder-seq-length 17) must be divisible",
        ),
        (&["--vocab-extra-ids", "0"][..], "--vocab-extra-ids"),
        (&["--decoder-seq-length", "8"][..], "--decoder-seq-length"),
    ] {
        let e = pretrain(&t5_args(&[&["--train-iters", "3"], flags].concat()))
            .expect_err("refused")
            .to_string();
        assert!(e.contains(want), "{flags:?}: {e}");
    }
}

#[test]
fn t5_checkpoints_saved_at_tp2_and_pp2_resume_on_other_layouts() {
    let dir = tmpdir("t5-reshard");
    let full = pretrain(&t5_args(&["--train-iters", "6"])).unwrap();
    let pp2: &[&str] = &[
        "--nproc-per-node",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-model-parallel-split-rank",
        "1",
    ];
    for (from, saved_at, name, layout) in [
        (
            "tp2",
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
            "one rank",
            &[][..],
        ),
        (
            "tp2",
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
            "dp2",
            &["--nproc-per-node", "2", "--use-distributed-optimizer"][..],
        ),
        ("pp2", pp2, "one rank", &[][..]),
        (
            "tp2",
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
            "pp2",
            pp2,
        ),
    ] {
        let tp2 = dir.join(from);
        if !tp2.exists() {
            pretrain(&t5_args(
                &[
                    &["--train-iters", "3", "--save", tp2.to_str().unwrap()][..],
                    saved_at,
                ]
                .concat(),
            ))
            .unwrap();
        }
        let name = format!("{from} -> {name}");
        let to = dir.join(name.replace(' ', "").replace("->", "-"));
        let resumed = pretrain(&t5_args(
            &[
                &[
                    "--train-iters",
                    "6",
                    "--override-opt_param-scheduler",
                    "--load",
                    tp2.to_str().unwrap(),
                    "--save",
                    to.to_str().unwrap(),
                ][..],
                layout,
            ]
            .concat(),
        ))
        .unwrap();
        assert_eq!(resumed.start_iteration, 3, "{name}");
        common::assert_losses_close(
            &format!("t5 {name}"),
            &full.losses[3..],
            &resumed.losses,
            1e-5,
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// T5 v1.1's untied output layer (no output rescaling): TP 2 and the pipeline split (the
/// output layer on the last stage only, the word embedding tied between the first two) train
/// the model one rank trains; the checkpoint holds `output_layer.weight`.
#[test]
fn t5_untied_output_layer_at_tp2_and_pp2_matches_one_rank() {
    let dir = tmpdir("t5-untied");
    let untie: &[&str] = &["--untie-embeddings-and-output-weights"];
    let serial = t5_run(&dir, "serial", untie);
    assert!(serial.1.tensors.contains_key("output_layer.weight"));
    assert!(!serial.1.meta.t5.unwrap().scale_decoder_outputs);
    for (name, layout) in [
        (
            "tp2",
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
        ),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-split-rank",
                "1",
            ][..],
        ),
    ] {
        let run = t5_run(&dir, name, &[untie, layout].concat());
        // Untied, the word embedding gets only the input side's gradient; one element's sums
        // to rounding-noise level (~1e-10, its Adam second moment ~1e-20), and Adam divides it by
        // sqrt(v) + 1e-8, so the summation order of TP's all-reduce moves that one element by
        // ~1e-5 (measured: 1 element over 1e-6). Losses stay within 1e-5.
        assert_same_training(&format!("untied t5 {name}"), &serial, &run, 5e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn t5_trains_on_megatrons_sentencepiece_tokenizer_with_its_appended_specials() {
    let dir = tmpdir("t5-sentencepiece");
    let sp = sentencepiece_sotu(&dir, "tiny-sotu-t5-unigram.model", 100);
    // 500 pieces, <CLS> <SEP> <EOD> <MASK> <BOS> and 100 sentinels appended (padding and EOS
    // are the model's own pieces 0 and 1).
    assert_eq!(sp.vocab_size, 605);
    let save = dir.join("ck");
    let s = save.to_str().unwrap();
    let train = [
        "--train-iters",
        "80",
        "--lr",
        "1e-2",
        "--eval-interval",
        "80",
        "--init-method-std",
        "0.1",
        "--save",
        s,
    ];
    let tokenizer: Vec<&str> = sp.flags.iter().map(String::as_str).collect();
    let summary = pretrain(&bert_args_on(
        &sp.data,
        &tokenizer,
        &[T5_MODEL, &train].concat(),
    ))
    .unwrap();
    let first: f64 = summary.losses[..5].iter().map(|l| l.1).sum::<f64>() / 5.0;
    let last: f64 = summary.losses[75..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    assert!(
        (5.0..8.0).contains(&first),
        "an untrained loss is near ln(605) = 6.4: {first}"
    );
    assert!(last < first - 1.0, "loss {first} -> {last}");
    let ck = load_checkpoint(&save, None).unwrap();
    let rows = ck.tensors["embedding.word_embeddings.weight"].len() / 32;
    assert_eq!(
        rows, 605,
        "one embedding row per id, appended specials included"
    );
    assert_eq!(ck.meta.tokenizer_type, "SentencePieceTokenizer");
    assert_eq!(
        ck.meta.vocab_extra_ids, 100,
        "generate rebuilds the sentinels"
    );
    // Decoding from the checkpoint's own tokenizer: the decoder starts from <BOS> (appended,
    // 504) and stops at the model's EOS (1); every id is one of the 605.
    let g = parse_generate(&[
        "m",
        "--load",
        s,
        "--prompt",
        "The Congress of the United States",
        "--greedy",
        "--max-new-tokens",
        "6",
        "--print-ids",
    ]);
    let text = megatron_training::generate::generate(&g).unwrap();
    let ids: Vec<u32> = text
        .lines()
        .last()
        .unwrap()
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(!ids.is_empty() && ids.iter().all(|&i| i < 605), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}
