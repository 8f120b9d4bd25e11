use megatron_data::train_tokenizer::{train_tokenizer, TrainTokenizerConfig};
use megatron_data::{build_tokenizer_from, TokenizerSpec};

#[test]
fn trained_bpe_loads_both_ways_with_the_same_ids() {
    let dir = std::env::temp_dir().join(format!("mrs-tt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("c.jsonl");
    let lines: String = (0..300).map(|i| format!("{}\n", serde_json::json!({"text": format!("the union of the states number {i}, strong and free")}))).collect();
    std::fs::write(&corpus, lines).unwrap();
    let out = dir.join("tok");
    let cfg = TrainTokenizerConfig {
        input: vec![corpus.display().to_string()],
        json_key: "text".into(),
        vocab_size: 400,
        min_frequency: 2,
        special_tokens: vec!["<|endoftext|>".into()],
        output_dir: out.display().to_string(),
    };
    train_tokenizer(&cfg).unwrap();
    let hf = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "HuggingFaceTokenizer".into(),
        tokenizer_model: Some(out.join("tokenizer.json").display().to_string()),
        ..Default::default()
    })
    .unwrap();
    let gpt2 = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(out.join("vocab.json").display().to_string()),
        merge_file: Some(out.join("merges.txt").display().to_string()),
        ..Default::default()
    })
    .unwrap();
    let text = "the union of the states number 77, strong and free — ünïcode";
    let ids = hf.encode(text).unwrap();
    assert_eq!(ids, gpt2.encode(text).unwrap());
    assert!(
        ids.len() < text.len() / 2,
        "merges were learned: {} ids for {} bytes",
        ids.len(),
        text.len()
    );
    assert_eq!(hf.decode(&ids), text);
    assert_eq!(hf.eod(), gpt2.eod());
    assert!(hf.vocab_size() <= 400 && hf.vocab_size() > 256);
    let tiny = TrainTokenizerConfig {
        vocab_size: 100,
        ..cfg
    };
    assert!(train_tokenizer(&tiny)
        .unwrap_err()
        .to_string()
        .contains("--vocab-size"));
    let _ = std::fs::remove_dir_all(dir);
}
