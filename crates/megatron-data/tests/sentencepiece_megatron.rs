//! Megatron's `SentencePieceTokenizer` against Megatron-LM's own class: for three models (Llama
//! style BPE without a padding piece; unigram with `<extra_id_0>` as a piece; T5-style unigram
//! with padding at 0 and no BOS), `<model>-megatron.json` holds what `_SentencePieceTokenizer`
//! (run on the sentencepiece library by `bench/make_megatron_sentencepiece_fixture.py`) gives:
//! vocabulary size, appended tokens, named special ids, sentinels, and for 16 texts the ids of
//! `tokenize` and the text of `detokenize`.

use megatron_data::tokenizer::{build_tokenizer_from, SpecialToken, Tokenizer, TokenizerSpec};
use std::path::PathBuf;

mod common;
use common::{check_cases, json_ids};

fn fixture(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sentencepiece")
        .join(file)
}

fn tokenizer(model: &str, vocab_extra_ids: usize) -> Result<Box<dyn Tokenizer>, String> {
    build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "SentencePieceTokenizer".into(),
        tokenizer_model: Some(fixture(model).to_string_lossy().into_owned()),
        vocab_extra_ids,
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

/// Everything the reference recorded for `model`, checked; returns the number of texts.
fn check_against_megatron(model: &str) -> usize {
    let path = fixture(&model.replace(".model", "-megatron.json"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let extra = v["vocab_extra_ids"].as_u64().unwrap() as usize;
    let t = tokenizer(model, extra).unwrap();
    assert_eq!(t.vocab_size() as u64, v["vocab_size"].as_u64().unwrap());
    let appended: Vec<String> = v["appended"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    let first = t.vocab_size() - appended.len();
    for (k, text) in appended.iter().enumerate() {
        assert_eq!(
            t.token_text((first + k) as u32).as_deref(),
            Some(text.as_str())
        );
        assert_eq!(t.token_id(text), Some((first + k) as u32), "{text}");
    }
    assert_eq!(t.eod() as u64, v["eod"].as_u64().unwrap(), "{model}: eod");
    for (which, key) in [
        (SpecialToken::Cls, "cls"),
        (SpecialToken::Sep, "sep"),
        (SpecialToken::Mask, "mask"),
        (SpecialToken::Pad, "pad"),
        (SpecialToken::Bos, "bos"),
        (SpecialToken::Eos, "eos"),
    ] {
        let want = v[key].as_u64().unwrap() as u32;
        assert_eq!(t.special_id(which), Some(want), "{model}: {key}");
    }
    let sentinels: Vec<u32> = (0..extra)
        .map(|k| t.token_id(&format!("<extra_id_{k}>")).unwrap())
        .collect();
    assert_eq!(
        sentinels,
        json_ids(&v["additional_special_tokens_ids"]),
        "{model}"
    );
    check_cases(t.as_ref(), &v["cases"], model)
}

#[test]
fn llama_style_bpe_model_matches_megatron_with_specials_appended() {
    assert_eq!(check_against_megatron("tiny-sotu-bpe.model"), 16);
}

#[test]
fn unigram_model_with_a_sentinel_piece_matches_megatron() {
    assert_eq!(check_against_megatron("tiny-sotu-unigram.model"), 16);
}

#[test]
fn t5_style_model_matches_megatron_with_its_padding_piece_and_100_sentinels() {
    assert_eq!(check_against_megatron("tiny-sotu-t5-unigram.model"), 16);
}

#[test]
fn documents_end_with_the_appended_eod_not_the_models_eos() {
    let t = tokenizer("tiny-sotu-bpe.model", 0).unwrap();
    assert_eq!(t.eod(), t.token_id("<EOD>").unwrap());
    assert_ne!(t.eod(), t.special_id(SpecialToken::Eos).unwrap());
    assert!(t.eod() as usize >= 1000, "appended after the 1,000 pieces");
}

#[test]
fn decode_without_special_drops_the_special_tokens() {
    let t = tokenizer("tiny-sotu-t5-unigram.model", 2).unwrap();
    let ids = t.encode("<CLS>the Congress<extra_id_1> of<SEP>").unwrap();
    assert_eq!(t.decode_without_special(&ids), "the Congress of");
}

#[test]
fn missing_tokenizer_model_names_the_flag() {
    let err = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "SentencePieceTokenizer".into(),
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("--tokenizer-model"), "{err}");
    let err = tokenizer("no-such.model", 0).err().unwrap();
    assert!(err.contains("no-such.model"), "{err}");
}
