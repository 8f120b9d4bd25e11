//! Megatron's `TikTokenizer` against Megatron-LM's own `CustomTikTokenizer` on tiktoken: the
//! vocabulary `o200k-1500.json` (o200k_base's first ranks in Megatron's JSON list) and, for two
//! settings (pattern v2 with 1,000 special tokens; v1 with 8, `<mask>` added), the vocabulary
//! size, BOS/EOS/EOD and the ids and decoded text of 20 texts plus a run of special and byte ids
//! (`bench/make_tiktoken_fixture.py`).

use megatron_data::tiktoken_tokenizer::{TiktokenOptions, TiktokenPattern};
use megatron_data::tokenizer::{build_tokenizer_from, SpecialToken, Tokenizer, TokenizerSpec};
use std::path::PathBuf;

mod common;
use common::check_cases;

fn fixture(file: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiktoken")
        .join(file)
        .to_string_lossy()
        .into_owned()
}

fn tokenizer(
    vocab: &str,
    options: Option<TiktokenOptions>,
    vocab_size: Option<usize>,
) -> Result<Box<dyn Tokenizer>, String> {
    build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "TikTokenizer".into(),
        tokenizer_model: Some(vocab.to_string()),
        vocab_size,
        tiktoken: options,
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

fn options(pattern: TiktokenPattern, n: usize, specials: Option<&[&str]>) -> TiktokenOptions {
    TiktokenOptions {
        pattern,
        num_special_tokens: n,
        special_tokens: specials.map(|s| s.iter().map(|x| x.to_string()).collect()),
    }
}

/// Every case of `file` checked against the tokenizer its header describes; returns the count.
fn check_against_megatron(file: &str) -> usize {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(file)).unwrap()).unwrap();
    let pattern: TiktokenPattern = v["pattern"].as_str().unwrap().parse().unwrap();
    let n = v["num_special_tokens"].as_u64().unwrap() as usize;
    let specials: Option<Vec<String>> =
        serde_json::from_value(v["special_tokens"].clone()).unwrap();
    let opts = TiktokenOptions {
        pattern,
        num_special_tokens: n,
        special_tokens: specials,
    };
    let size = v["vocab_size"].as_u64().unwrap() as usize;
    let t = tokenizer(&fixture("o200k-1500.json"), Some(opts), Some(size)).unwrap();
    assert_eq!(t.vocab_size(), size);
    assert_eq!(t.eod() as u64, v["eod"].as_u64().unwrap());
    assert_eq!(
        t.special_id(SpecialToken::Bos).map(u64::from),
        v["bos"].as_u64()
    );
    assert_eq!(
        t.special_id(SpecialToken::Eos).map(u64::from),
        v["eos"].as_u64()
    );
    check_cases(t.as_ref(), &v["cases"], file)
}

#[test]
fn pattern_v2_with_a_thousand_special_tokens_matches_megatron() {
    assert_eq!(check_against_megatron("o200k-1500-v2-megatron.json"), 21);
}

#[test]
fn pattern_v1_with_added_special_tokens_matches_megatron() {
    assert_eq!(check_against_megatron("o200k-1500-v1-megatron.json"), 21);
}

#[test]
fn special_tokens_take_the_first_ids_and_ranks_follow() {
    let t = tokenizer(
        &fixture("o200k-1500.json"),
        Some(options(
            TiktokenPattern::V2,
            10,
            Some(&["<s>", "</s>", "<unk>", "<pad>"]),
        )),
        Some(1510),
    )
    .unwrap();
    assert_eq!(t.token_id("<s>"), Some(0));
    assert_eq!(t.eod(), 1, "documents end with </s>");
    assert_eq!(t.token_id("<pad>"), Some(3));
    assert_eq!(t.token_id("<SPECIAL_9>"), Some(9));
    assert_eq!(t.token_id("A"), Some(10 + 65), "byte 65 has rank 65");
    assert_eq!(t.token_text(10 + 65).as_deref(), Some("A"));
    assert_eq!(t.decode_without_special(&[0, 10 + 65, 1]), "A");
}

#[test]
fn bad_settings_and_files_are_named() {
    let vocab = fixture("o200k-1500.json");
    let err = |o: Option<TiktokenOptions>, size: Option<usize>, path: &str| {
        tokenizer(path, o, size).err().unwrap()
    };
    let v2 = |n, s: Option<&[&str]>| Some(options(TiktokenPattern::V2, n, s));
    let e = err(None, Some(2500), &vocab);
    assert!(e.contains("--tiktoken-pattern"), "{e}");
    let e = err(v2(1000, Some(&["<s>", "</s>"])), Some(2500), &vocab);
    assert!(e.contains("<unk>"), "{e}");
    let e = err(
        v2(1000, Some(&["<unk>", "<s>", "</s>", "<s>"])),
        Some(2500),
        &vocab,
    );
    assert!(e.contains("twice"), "{e}");
    // The default vocabulary size (131,072) needs 130,072 ranks; the fixture has 1,500.
    let e = err(v2(1000, None), None, &vocab);
    assert!(
        e.contains("1500 tokens") && e.contains("--vocab-size"),
        "{e}"
    );
    let e = err(v2(3000, None), Some(2500), &vocab);
    assert!(e.contains("--tiktoken-num-special-tokens 3000"), "{e}");
    let dir = std::env::temp_dir().join(format!("tiktoken-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    };
    let e = err(v2(3, None), Some(4), &write("map.json", r#"{"a": 1}"#));
    assert!(e.contains("JSON list"), "{e}");
    let e = err(
        v2(3, None),
        Some(4),
        &write(
            "rank.json",
            r#"[{"rank": 5, "token_bytes": "AA==", "token_str": ""}]"#,
        ),
    );
    assert!(e.contains("entry 0 has rank 5"), "{e}");
    let e = err(
        v2(3, None),
        Some(4),
        &write(
            "byte.json",
            r#"[{"rank": 0, "token_bytes": "QQ==", "token_str": "A"}]"#,
        ),
    );
    assert!(e.contains("entry 0 is not the single byte 0"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The fixture's 1,500 ranks hold no token that spans a place where v1 and v2 split differently
/// (both reference files give the same ids), so a vocabulary of the 256 bytes and one merge `oW`
/// shows which split runs: v1 keeps `helloWorld` one word and merges across the case change, v2
/// splits it before `W`.
#[test]
fn pattern_v1_keeps_a_case_change_in_one_word_and_v2_splits_it() {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let entry = |rank: usize, bytes: &[u8]| serde_json::json!({"rank": rank, "token_bytes": b64.encode(bytes), "token_str": ""});
    let mut list: Vec<serde_json::Value> = (0..=255u8).map(|b| entry(b as usize, &[b])).collect();
    list.push(entry(256, b"oW"));
    let path = std::env::temp_dir().join(format!("tiktoken-ow-{}.json", std::process::id()));
    std::fs::write(&path, serde_json::Value::Array(list).to_string()).unwrap();
    let path = path.to_string_lossy().into_owned();
    let encode = |pattern| {
        tokenizer(&path, Some(options(pattern, 3, None)), Some(260))
            .unwrap()
            .encode("helloWorld")
            .unwrap()
    };
    let shifted = |s: &[u8]| s.iter().map(|&b| b as u32 + 3).collect::<Vec<_>>();
    let v1 = [shifted(b"hell"), vec![259], shifted(b"orld")].concat();
    assert_eq!(encode(TiktokenPattern::V1), v1);
    assert_eq!(encode(TiktokenPattern::V2), shifted(b"helloWorld"));
    let _ = std::fs::remove_file(path);
}
