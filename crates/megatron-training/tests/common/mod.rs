//! Helpers shared by the training test files: Megatron-style flags for a tiny mock-data run.
#![allow(dead_code)]

pub mod hf_fixtures;
pub mod llama_cpp_spm;
pub mod megatron_resume;

use clap::Parser;
use megatron_training::checkpointing::LoadedCheckpoint;
use megatron_training::{TrainArgs, TrainSummary};
use std::path::PathBuf;

#[derive(Parser)]
#[command(args_override_self = true)]
struct Wrap {
    #[command(flatten)]
    args: TrainArgs,
}

/// Four rank threads as TP 2 x PP 2, one sample per micro-batch.
#[allow(dead_code)]
pub const TP2_PP2: &[&str] = &[
    "--nproc-per-node",
    "4",
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--micro-batch-size",
    "1",
];

/// The model and schedule of the tiny test runs (2 layers, hidden 32, 4 heads, seq 16, micro
/// batch 2 of 4, lr 3e-3 with 2 warm-up iterations, evaluation every 3), 2 GEMM threads; the
/// data and tokenizer flags come before them.
pub const SMALL_RUN: &[&str] = &[
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
    "--lr-warmup-iters",
    "2",
    "--lr-decay-style",
    "cosine",
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
];

/// A tiny GPT on mock data (vocab 61) with [`SMALL_RUN`]'s model, with `extra` flags appended
/// (later flags override earlier ones).
pub fn args(extra: &[&str]) -> TrainArgs {
    let mut v = vec![
        "megatron",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "61",
    ];
    v.extend_from_slice(SMALL_RUN);
    v.extend_from_slice(extra);
    Wrap::try_parse_from(v).expect("flags parse").args
}

/// `megatron train` flags (the first is the program name) as parsed arguments.
pub fn parse_train<S: AsRef<str>>(v: &[S]) -> TrainArgs {
    Wrap::try_parse_from(v.iter().map(|s| s.as_ref()))
        .expect("flags parse")
        .args
}

#[derive(Parser)]
#[command(args_override_self = true)]
struct InspectWrap {
    #[command(flatten)]
    args: megatron_training::InspectArgs,
}

/// `megatron inspect-data` flags (the first is the program name) as parsed arguments.
pub fn parse_inspect<S: AsRef<str>>(v: &[S]) -> megatron_training::InspectArgs {
    InspectWrap::try_parse_from(v.iter().map(|s| s.as_ref()))
        .expect("flags parse")
        .args
}

#[derive(Parser)]
struct GenerateWrap {
    #[command(flatten)]
    args: megatron_training::GenerateArgs,
}

/// `megatron generate` flags (the first is the program name) as parsed arguments.
pub fn parse_generate<S: AsRef<str>>(v: &[S]) -> megatron_training::GenerateArgs {
    GenerateWrap::try_parse_from(v.iter().map(|s| s.as_ref()))
        .expect("flags parse")
        .args
}

/// A tiny BERT (2 layers, hidden 32, 4 heads, seq 32, binary head) on the committed
/// sentence-split fixture (6 State of the Union speeches, bert-base-uncased WordPiece ids),
/// 2 GEMM threads, with `extra` flags appended.
pub fn bert_args(extra: &[&str]) -> TrainArgs {
    let root = env!("CARGO_MANIFEST_DIR");
    let data = format!("{root}/../megatron-data/tests/fixtures/bert/sotu_sentence");
    let vocab = format!("{root}/../../examples/bert/vocab.txt");
    bert_args_on(
        &data,
        &[
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            &vocab,
        ],
        extra,
    )
}

/// `bert_args` on another sentence-split dataset and tokenizer.
pub fn bert_args_on(data: &str, tokenizer: &[&str], extra: &[&str]) -> TrainArgs {
    let mut v: Vec<String> = [
        "megatron",
        "--model",
        "bert",
        "--data-path",
        data,
        "--split",
        "90,10,0",
    ]
    .iter()
    .chain(tokenizer)
    .map(|s| s.to_string())
    .collect();
    // The unpadded vocabulary (30522) splits over 2 tensor-parallel ranks: every layout then
    // has the same vocabulary rows, as Megatron's padding to 128 x TP would not.
    v.extend([
        "--make-vocab-size-divisible-by".to_string(),
        "1".to_string(),
    ]);
    // SMALL_RUN at BERT's 32 tokens.
    v.extend(SMALL_RUN.iter().map(|f| f.to_string()));
    v.extend(["--seq-length".to_string(), "32".to_string()]);
    v.extend(extra.iter().map(|s| s.to_string()));
    Wrap::try_parse_from(v).expect("flags parse").args
}

/// The sotu speeches (examples/sotu), one document each, sentence-split with `tok` into
/// `DIR/NAME_text_sentence` (what BERT and T5 read); returns that prefix.
pub fn sotu_sentences(
    dir: &std::path::Path,
    name: &str,
    tok: &dyn megatron_data::Tokenizer,
) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut files: Vec<_> = std::fs::read_dir(format!("{root}/../../examples/sotu"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    let texts = files
        .into_iter()
        .map(|p| std::fs::read_to_string(p).unwrap());
    preprocess_jsonl(dir, name, texts, tok, Granularity::Sentences)
}

/// The sotu speeches sentence-split with Megatron's `SentencePieceTokenizer` on a committed
/// model of megatron-data's fixtures, with `extra` sentinels.
pub struct SentencePieceSotu {
    pub vocab_size: usize,
    /// The dataset prefix.
    pub data: String,
    /// The flags that select the tokenizer (the sentinels are the model flags' business).
    pub flags: Vec<String>,
}

pub fn sentencepiece_sotu(
    dir: &std::path::Path,
    model_file: &str,
    extra: usize,
) -> SentencePieceSotu {
    let root = env!("CARGO_MANIFEST_DIR");
    let model = format!("{root}/../megatron-data/tests/fixtures/sentencepiece/{model_file}");
    let tok = megatron_data::build_tokenizer_from(&megatron_data::TokenizerSpec {
        tokenizer_type: "SentencePieceTokenizer".into(),
        tokenizer_model: Some(model.clone()),
        vocab_extra_ids: extra,
        ..Default::default()
    })
    .unwrap();
    SentencePieceSotu {
        vocab_size: tok.vocab_size(),
        data: sotu_sentences(dir, "sotu_sp", tok.as_ref()),
        flags: [
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            &model,
        ]
        .map(String::from)
        .to_vec(),
    }
}

/// A tiny tabular model (2 layers, emb 16, 4 heads) on small prior tables (at most 48 context
/// and 16 query rows, 2-6 features), 4 tables a step, with `extra` flags appended.
pub fn tabular_args(extra: &[&str]) -> TrainArgs {
    let mut v = vec![
        "megatron",
        "--model",
        "tabular",
        "--num-layers",
        "2",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "32",
        "--global-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "1",
        "--lr-decay-style",
        "cosine",
        "--train-iters",
        "4",
        "--prior-min-context-rows",
        "16",
        "--prior-max-context-rows",
        "48",
        "--prior-max-query-rows",
        "16",
        "--prior-max-features",
        "6",
        "--tabular-cell-budget",
        "1024",
        "--tabular-hidden-share",
        "0.1",
        "--log-interval",
        "2",
        "--num-threads",
        "2",
    ];
    v.extend_from_slice(extra);
    Wrap::try_parse_from(v).expect("flags parse").args
}

/// A fresh directory under the system temp dir, unique to this process.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megatron-rs-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `got` follows `want` iteration by iteration, each loss within `rel` of it (relative, with a
/// floor of 1 so losses near zero compare absolutely).
pub fn assert_losses_close(what: &str, want: &[(u64, f64)], got: &[(u64, f64)], rel: f64) {
    for (a, b) in want.iter().zip(got) {
        assert_eq!(a.0, b.0, "{what}: iterations");
        assert!(
            (a.1 - b.1).abs() <= rel * a.1.abs().max(1.0),
            "{what} iteration {}: {} vs {}",
            a.0,
            a.1,
            b.1
        );
    }
}

pub fn assert_same_training(
    what: &str,
    one: &(TrainSummary, LoadedCheckpoint),
    other: &(TrainSummary, LoadedCheckpoint),
    param_tol: f32,
) {
    assert_same_training_within(what, one, other, 1e-5, param_tol)
}

/// Under bf16 a different f32 summation order (TP, DP reductions) can flip the rounding of a
/// parameter or operand by one bf16 unit (2^-8 relative), so layouts agree less tightly than
/// in f32: losses within 1e-3 relative. Adam normalizes each update to about ±lr, so a
/// parameter whose gradient is near zero may step differently once such a flip reaches it:
/// the worst parameter is bounded by a few lr (3e-3 here), the mean difference is checked
/// separately.
pub const BF16_LOSS_TOL: f64 = 1e-3;
pub const BF16_PARAM_TOL: f32 = 1e-2;

pub fn assert_same_training_within(
    what: &str,
    (s1, c1): &(TrainSummary, LoadedCheckpoint),
    (sn, cn): &(TrainSummary, LoadedCheckpoint),
    loss_tol: f64,
    param_tol: f32,
) {
    assert_eq!(sn.losses.len(), 5, "{what}");
    assert_losses_close(what, &s1.losses, &sn.losses, loss_tol);
    // Validation uses the same samples in every layout, so its loss matches too.
    assert_eq!(s1.val_losses.len(), sn.val_losses.len(), "{what}");
    assert!(!s1.val_losses.is_empty());
    let validation = format!("{what} validation");
    assert_losses_close(&validation, &s1.val_losses, &sn.val_losses, loss_tol);
    assert_eq!(c1.tensors.len(), cn.tensors.len(), "{what}");
    let (mut pmax, mut mmax) = (0.0f32, 0.0f32);
    let mut worst = String::new();
    for (name, v1) in &c1.tensors {
        let vn = &cn.tensors[name];
        assert_eq!(v1.len(), vn.len(), "{what}: {name}");
        let d = v1
            .iter()
            .zip(vn)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        if name.starts_with("optimizer.") {
            mmax = mmax.max(d);
        } else if d > pmax {
            pmax = d;
            worst = name.clone();
        }
    }
    assert!(
        pmax <= param_tol,
        "{what}: parameters differ by {pmax} (most in {worst})"
    );
    assert!(
        mmax <= param_tol.max(1e-4),
        "{what}: Adam moments differ by {mmax}"
    );
}

pub fn assert_same_norms(what: &str, a: &TrainSummary, b: &TrainSummary) {
    assert_eq!(a.grad_norms.len(), b.grad_norms.len(), "{what}");
    assert!(
        a.grad_norms.iter().any(|n| n.1 > 1.0),
        "clipping must be active"
    );
    for (x, y) in a.grad_norms.iter().zip(&b.grad_norms) {
        assert!(
            (x.1 - y.1).abs() <= 1e-5 * x.1,
            "{what} iteration {}: grad norm {} vs {}",
            x.0,
            x.1,
            y.1
        );
    }
}

/// [`assert_same_training`] for runs where Adam amplifies a few ill-conditioned coordinates:
/// losses within 1e-5 relative; parameters within `max_tol` at worst, and at most one in 10,000
/// further apart than 1e-6. (Measured on the tiny Llama: one word-embedding element whose
/// gradient nearly cancels differs by 3.6e-6 between one rank and plain DP 2, where only the
/// order of the data-parallel sum changes, and by 1.5e-5 at TP 4; all other 180,799 parameters
/// agree within 1e-6.)
pub fn assert_same_training_but_outliers(
    what: &str,
    one: &(TrainSummary, LoadedCheckpoint),
    other: &(TrainSummary, LoadedCheckpoint),
    max_tol: f32,
) {
    assert_same_training_within(what, one, other, 1e-5, max_tol);
    let (mut far, mut total) = (0usize, 0usize);
    for (name, v1) in one
        .1
        .tensors
        .iter()
        .filter(|t| !t.0.starts_with("optimizer."))
    {
        for (x, y) in v1.iter().zip(&other.1.tensors[name]) {
            total += 1;
            far += usize::from((x - y).abs() > 1e-6);
        }
    }
    assert!(
        far * 10_000 <= total,
        "{what}: {far} of {total} parameters differ by more than 1e-6"
    );
}

/// Tiny GPT with 8 layers (hidden 64, 4 heads, vocab 256 after padding, seq 32), a global batch
/// of 8 micro-batches of 1, dropout 0.
pub const PP_MODEL: &[&str] = &[
    "--num-layers",
    "8",
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
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
];

/// DeepSeek-V3's multi-latent attention at toy size on [`PP_MODEL`] (4 heads): query latent
/// 24, key/value latent 16, heads of 16 content + 8 rotary features, values of 12, the latents'
/// norms.
pub const MLA: &[&str] = &[
    "--multi-latent-attention",
    "--q-lora-rank",
    "24",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "16",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "12",
    "--qk-layernorm",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
];

/// A small mixture of experts on top of [`PP_MODEL`]: 4 SwiGLU experts of width 64, top-2,
/// with both auxiliary losses.
#[allow(dead_code)]
pub const MOE: &[&str] = &[
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    "--swiglu",
];

/// gpt-oss at toy size: the fixture script's `GPT_OSS` (bench/make_megatron_optim_fixtures.py):
/// learned sinks, the clamped Quick-GEGLU with its offset, a window on every other layer, YaRN,
/// biases on every linear layer, the router and the experts.
#[allow(dead_code)]
pub const GPT_OSS: &[&str] = &[
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
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    "1.0",
    "--no-bias-gelu-fusion",
    "--softmax-type",
    "learnable",
    "--window-size",
    "3,0",
    "--window-attn-skip-freq",
    "2",
    "--position-embedding-type",
    "yarn",
    "--rotary-base",
    "10000",
    "--rotary-scaling-factor",
    "4",
    "--yarn-original-max-position-embeddings",
    "8",
    "--yarn-beta-fast",
    "32",
    "--yarn-beta-slow",
    "1",
    "--mscale",
    "1.0",
    "--mscale-all-dim",
    "0.0",
    "--no-yarn-correction-range-round-to-int",
    "--untie-embeddings-and-output-weights",
    "--norm-epsilon",
    "1e-5",
    "--no-rope-fusion",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-router-dtype",
    "fp32",
];

/// [`PP_MODEL`] with `flags` trained 5 steps and saved under `dir/name`: the run's summary and
/// its checkpoint read back whole (what the layout-equivalence tests compare).
#[allow(dead_code)]
pub fn train_and_load(
    dir: &std::path::Path,
    name: &str,
    flags: &[&str],
) -> (
    megatron_training::TrainSummary,
    megatron_training::checkpointing::LoadedCheckpoint,
) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let v = [PP_MODEL, &["--train-iters", "5", "--save", &s], flags].concat();
    let summary = megatron_training::pretrain(&args(&v)).unwrap();
    let ck = megatron_training::checkpointing::load_checkpoint(&save, None).unwrap();
    (summary, ck)
}

/// [`train_and_load`] of `flags` on one rank and under each named layout (runs saved under
/// `dir`), each asserted to train the one-rank model (`what` prefixes the failure's name);
/// returns the one-rank run.
#[allow(dead_code)]
pub fn assert_layouts_match_one_rank(
    dir: &std::path::Path,
    what: &str,
    flags: &[&str],
    layouts: &[(&str, &[&str])],
) -> (
    megatron_training::TrainSummary,
    megatron_training::checkpointing::LoadedCheckpoint,
) {
    let serial = train_and_load(dir, &format!("{what}-serial").replace(' ', "_"), flags);
    for (name, layout) in layouts {
        let label = format!("{what} {name}");
        let run = train_and_load(dir, &label.replace(' ', "_"), &[flags, layout].concat());
        assert_same_training(&label, &serial, &run, 1e-5);
    }
    serial
}

/// The records of a `--metrics-file`: the training lines' (with `lm_loss`), then the
/// evaluations'.
pub fn metrics_rows(metrics: &std::path::Path) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .partition(|r| r.get("lm_loss").is_some())
}

/// The `memory` object of the last metrics record that has one (`--log-memory`).
pub fn last_memory_record(metrics: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(metrics).unwrap();
    let rec: serde_json::Value = text
        .lines()
        .rfind(|l| l.contains("\"memory\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .expect("a memory record at the log interval");
    rec["memory"].clone()
}

/// The last `--log-memory` record of `metrics` (returned), whose measured / predicted peak over
/// every rank must lie within `tolerance` of 1 (`what` names the run in the message).
pub fn assert_peak_matches_prediction(
    metrics: &std::path::Path,
    tolerance: f64,
    what: &str,
) -> serde_json::Value {
    let mem = last_memory_record(metrics);
    let (lo, hi) = (
        mem["peak_over_predicted"][0].as_f64().unwrap(),
        mem["peak_over_predicted"][1].as_f64().unwrap(),
    );
    println!("{what}: measured / predicted peak over ranks {lo:.4}-{hi:.4}");
    let within = |r: f64| (1.0 - tolerance..=1.0 + tolerance).contains(&r);
    assert!(
        within(lo) && within(hi),
        "{what}: measured / predicted peak over ranks {lo:.4}-{hi:.4}, beyond {tolerance}"
    );
    mem
}

/// A model whose layers' working set (not the output layer) sets the peak: 2 layers of hidden
/// 256, 4 heads, vocabulary 1000, 2048 tokens per micro-batch (the peak tests add its FFN).
#[allow(dead_code)]
pub const SMALL_VOCAB_LAYERS: &[&str] = &[
    "--vocab-size",
    "1000",
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "512",
    "--micro-batch-size",
    "4",
];

/// Trains `flags` with `--metrics-file` in `dir` (file `name`) and asserts the run's measured
/// peak per rank against the prediction ([`assert_peak_matches_prediction`], `what` naming the
/// run); returns the memory record.
#[allow(dead_code)]
pub fn train_and_assert_peak(
    dir: &std::path::Path,
    name: &str,
    flags: &[&str],
    tolerance: f64,
    what: &str,
) -> serde_json::Value {
    let metrics = dir.join(format!("{name}.jsonl"));
    let v = [flags, &["--metrics-file", metrics.to_str().unwrap()]].concat();
    megatron_training::pretrain(&args(&v)).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_peak_matches_prediction(&metrics, tolerance, what)
}

/// An I64 tensor of a safetensors file (reference fixtures).
pub fn safetensor_i64(r: &safetensors::SafeTensors, name: &str) -> Vec<i64> {
    r.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An F32 tensor of a safetensors file (reference fixtures).
pub fn safetensor_f32(r: &safetensors::SafeTensors, name: &str) -> Vec<f32> {
    r.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A small Llama (SwiGLU, RMSNorm, RoPE, 8 heads in 4 query groups, no biases, untied) on top of
/// a GPT model's flags.
#[allow(dead_code)]
pub const LLAMA: &[&str] = &[
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "4",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
];

/// `texts` as `DIR/NAME.jsonl` preprocessed with `tok` into Megatron's `.bin/.idx` (one document
/// each, end-of-document appended); returns the dataset prefix `DIR/NAME_text_document`.
pub fn preprocess_texts(
    dir: &std::path::Path,
    name: &str,
    texts: impl Iterator<Item = String>,
    tok: &dyn megatron_data::Tokenizer,
) -> String {
    preprocess_jsonl(dir, name, texts, tok, Granularity::Documents)
}

/// How `preprocess_jsonl` writes sequences.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One sequence per document (`NAME_text_document`).
    Documents,
    /// One per sentence, as BERT and T5 read them (`--split-sentences`, `NAME_text_sentence`).
    Sentences,
}

/// `texts` as `DIR/NAME.jsonl` preprocessed with `tok`; returns the dataset prefix.
pub fn preprocess_jsonl(
    dir: &std::path::Path,
    name: &str,
    texts: impl Iterator<Item = String>,
    tok: &dyn megatron_data::Tokenizer,
    granularity: Granularity,
) -> String {
    let input = dir.join(format!("{name}.jsonl"));
    let lines: String = texts
        .map(|t| format!("{}\n", serde_json::json!({ "text": t })))
        .collect();
    std::fs::write(&input, lines).unwrap();
    let out = dir.join(name).display().to_string();
    let split_sentences = granularity == Granularity::Sentences;
    let cfg = megatron_data::preprocess::PreprocessConfig {
        input: vec![input.display().to_string()],
        json_keys: vec!["text".into()],
        output_prefix: out.clone(),
        append_eod: true,
        split_sentences,
        workers: 2,
        skip_bad_lines: false,
        log_interval: 0,
    };
    megatron_data::preprocess::preprocess(&cfg, tok).unwrap();
    match granularity {
        Granularity::Documents => format!("{out}_text_document"),
        Granularity::Sentences => format!("{out}_text_sentence"),
    }
}
