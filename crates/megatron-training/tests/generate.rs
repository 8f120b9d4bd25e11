use clap::Parser;
use megatron_tensor::RngKey;
use megatron_training::generate::{generate, sample_next};
use megatron_training::{pretrain, GenerateArgs, TrainArgs};

#[derive(Parser)]
#[command(args_override_self = true)]
struct Wrap {
    #[command(flatten)]
    args: TrainArgs,
}

#[derive(Parser)]
struct GenWrap {
    #[command(flatten)]
    args: GenerateArgs,
}

/// Trains a tiny model (with `model` flags) on mock data, which are runs of consecutive ids, so
/// it must continue "5 6 7" with 8 9 10 ... when generating greedily from its checkpoint.
fn assert_greedy_generation_continues_the_learned_sequence(name: &str, model: &[&str]) {
    let dir = std::env::temp_dir().join(format!("megatron-rs-gen-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let mut flags = vec![
        "m",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "40",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "8",
        "--train-iters",
        "150",
        "--lr",
        "1e-2",
        "--lr-warmup-iters",
        "10",
        "--min-lr",
        "1e-3",
        "--lr-decay-style",
        "cosine",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--log-interval",
        "50",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "0",
        "--save",
        s,
        "--peak-tflops",
        "1",
        "--no-progress-bar",
        "--num-threads",
        "2",
    ];
    flags.extend_from_slice(model);
    let args = Wrap::try_parse_from(flags).unwrap().args;
    let summary = pretrain(&args).unwrap();
    assert!(
        summary.losses.last().unwrap().1 < 0.5,
        "model learned the sequences: {:?}",
        summary.losses.last()
    );
    let g = GenWrap::try_parse_from([
        "m",
        "--load",
        s,
        "--prompt",
        "5 6 7",
        "--max-new-tokens",
        "5",
        "--greedy",
    ])
    .unwrap()
    .args;
    let text = generate(&g).unwrap();
    assert_eq!(
        text.split_whitespace().collect::<Vec<_>>(),
        ["8", "9", "10", "11", "12"],
        "{name}: generated '{text}'"
    );
    let gen = |extra: &[&str]| {
        let mut flags = vec!["m", "--load", s, "--max-new-tokens", "3"];
        flags.extend_from_slice(extra);
        generate(&GenWrap::try_parse_from(flags).unwrap().args).map_err(|e| e.to_string())
    };
    // An empty text prompt starts from the end-of-document id, which a NullTokenizer places
    // one past --vocab-size (the checkpoint records 40; id 40 is in the model's vocabulary).
    let from_eod = gen(&["--prompt", ""]).unwrap();
    assert_eq!(
        from_eod.split_whitespace().count(),
        3,
        "{name}: '{from_eod}'"
    );
    let e = gen(&["--prompt-ids", ""]).unwrap_err();
    assert!(e.contains("--prompt-ids is empty"), "{e}");
    let e = gen(&["--prompt-ids", "5", "--temperature=-1"]).unwrap_err();
    assert!(
        e.contains("--temperature must be a non-negative number"),
        "{e}"
    );
    let e = gen(&["--prompt-ids", "5", "--top-p", "1.5"]).unwrap_err();
    assert!(e.contains("--top-p must be in [0, 1]"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn greedy_generation_continues_the_learned_sequence() {
    assert_greedy_generation_continues_the_learned_sequence("gpt", &[]);
}

#[test]
fn llama_generation_uses_rope_positions_and_a_grouped_kv_cache() {
    assert_greedy_generation_continues_the_learned_sequence(
        "llama",
        &[
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--position-embedding-type",
            "rope",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ],
    );
}

#[test]
fn sampling_respects_top_k_and_greedy() {
    let logits = [0.0f32, 5.0, 4.9, -3.0, 1.0];
    assert_eq!(sample_next(&logits, 5, 0.0, 0, 1.0, RngKey::new(1), 0), 1);
    for step in 0..200 {
        let t = sample_next(&logits, 5, 1.0, 2, 1.0, RngKey::new(2), step);
        assert!(
            t == 1 || t == 2,
            "top-k 2 only yields the two best, got {t}"
        );
        let p = sample_next(&logits, 5, 1.0, 0, 0.5, RngKey::new(3), step);
        assert_eq!(p, 1, "top-p 0.5 keeps only the most likely token here");
    }
    // top-p 0 filters nothing, as in Megatron (`top_p > 0.0` enables the filter): the second
    // token (logit 4.9 against 5.0) is drawn about half the time.
    let second = (0..200)
        .filter(|&step| sample_next(&logits, 5, 1.0, 0, 0.0, RngKey::new(5), step) == 2)
        .count();
    assert!(
        (50..150).contains(&second),
        "token 2 drawn {second} of 200 times"
    );
    // Padded vocabulary entries beyond the real vocabulary are never sampled.
    let padded = [0.0f32, 0.0, 100.0];
    assert!(sample_next(&padded, 2, 1.0, 0, 1.0, RngKey::new(4), 0) < 2);
}

#[test]
fn a_continuation_reads_as_the_whole_sequence_decoded_after_its_prompt() {
    // A SentencePiece piece's `▁` is a space only after other text: the continuation printed
    // after the prompt must be the whole sequence's text less the prompt's (decoded alone, the
    // first new word would lose its space).
    use megatron_data::{build_tokenizer_from, TokenizerSpec};
    let dir = std::env::temp_dir().join(format!("megatron-rs-gen-spm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../megatron-data/tests/fixtures/sentencepiece/tiny-sotu-bpe.model"
    );
    let flags = [
        "m",
        "--mock-data",
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        model,
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--lr",
        "1e-3",
        "--eval-iters",
        "0",
        "--save",
        s,
        "--no-progress-bar",
        "--num-threads",
        "2",
    ];
    pretrain(&Wrap::try_parse_from(flags).unwrap().args).unwrap();
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "Llama2Tokenizer".into(),
        tokenizer_model: Some(model.into()),
        ..Default::default()
    })
    .unwrap();
    let prompt = "The Congress of the";
    for seed in ["1", "2", "3"] {
        let g = [
            "m",
            "--load",
            s,
            "--prompt",
            prompt,
            "--max-new-tokens",
            "6",
            "--seed",
            seed,
        ];
        let g = [&g[..], &["--print-ids", "--top-k", "50"]].concat();
        let out = generate(&GenWrap::try_parse_from(g).unwrap().args).unwrap();
        let (text, ids) = out.rsplit_once('\n').unwrap();
        let mut all = tok.encode(prompt).unwrap();
        all.extend(ids.split_whitespace().map(|i| i.parse::<u32>().unwrap()));
        assert_eq!(
            format!("{prompt}{text}"),
            tok.decode(&all),
            "seed {seed}: ids {ids}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
