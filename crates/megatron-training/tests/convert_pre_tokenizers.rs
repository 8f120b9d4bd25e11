//! llama.cpp's pre-tokenizer names as tokenizer.json pre-tokenizers: each name round-trips, and
//! the pieces they cut follow llama.cpp's regexes (contractions case-insensitive for Qwen2 and
//! Llama 3, digits one by one for Qwen2 and SmolLM, in threes for Llama 3 and llama.cpp's
//! default, whole for GPT-2). llama.cpp's own 47 test vectors per vocabulary are checked by
//! `bench/gguf_tokenizer_vectors_check.py` (the vocabulary files are megabytes).

use megatron_training::convert::pre_tokenizers::{
    llama_cpp_pre_name, llama_cpp_pre_names, pre_tokenizer_json,
};
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

fn pieces(name: &str, text: &str) -> Vec<String> {
    let (json, _) = pre_tokenizer_json(name).unwrap();
    let pre: tokenizers::PreTokenizerWrapper = serde_json::from_value(json).unwrap();
    let mut s = PreTokenizedString::from(text);
    pre.pre_tokenize(&mut s).unwrap();
    s.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(p, _, _)| p.to_string())
        .collect()
}

#[test]
fn every_llama_cpp_pre_tokenizer_name_round_trips_through_tokenizer_json() {
    let canonical = ["gpt-2", "smollm", "qwen2", "llama-bpe", "default"];
    for name in llama_cpp_pre_names() {
        let (json, ignore_merges) = pre_tokenizer_json(name).unwrap();
        let back = llama_cpp_pre_name(&json, ignore_merges).unwrap();
        assert!(canonical.contains(&back), "{name} -> {back}");
        assert_eq!(pre_tokenizer_json(back).unwrap().0, json, "{name}");
        // Llama 3's BPE takes whole words from the vocabulary first; nothing else does.
        assert_eq!(ignore_merges, back == "llama-bpe", "{name}");
        assert_eq!(llama_cpp_pre_name(&json, !ignore_merges), None, "{name}");
    }
    let e = pre_tokenizer_json("bloom").unwrap_err();
    assert!(e.contains("'bloom'") && e.contains("qwen2"), "{e}");
}

#[test]
fn pre_tokenizers_cut_text_where_llama_cpps_regexes_do() {
    let text = "DON'T 12345";
    for (name, want) in [
        ("gpt-2", &["DON", "'", "T", "Ġ12345"][..]),
        ("qwen2", &["DON", "'T", "Ġ", "1", "2", "3", "4", "5"][..]),
        ("llama-bpe", &["DON", "'T", "Ġ", "123", "45"][..]),
        (
            "smollm",
            &["DON", "'", "T", "Ġ", "1", "2", "3", "4", "5"][..],
        ),
        ("default", &["DON", "'", "T", "Ġ", "123", "45"][..]),
    ] {
        assert_eq!(pieces(name, text), want, "{name}");
    }
}

#[test]
fn a_tokenizer_json_split_llama_cpp_does_not_name_is_not_given_a_name() {
    for pre in [
        serde_json::json!({"type": "Whitespace"}),
        serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            {"type": "Digits", "individual_digits": true}]}),
        serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}{1,4}"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]}),
    ] {
        assert_eq!(llama_cpp_pre_name(&pre, false), None, "{pre}");
    }
}
