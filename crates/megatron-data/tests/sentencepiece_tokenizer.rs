//! Megatron's `Llama2Tokenizer` and `GPTSentencePieceTokenizer` against the sentencepiece
//! library itself: `tiny-sotu-bpe.model` is a 1,000-piece BPE model trained on examples/sotu with
//! Llama's options, and `tiny-sotu-bpe-vectors.json` what `SentencePieceProcessor.encode` and
//! `decode` make of 53 texts with it (llama.cpp's SPM test inputs, sotu sentences, unicode,
//! control tokens written in the text; `bench/make_gguf_spm_fixture.py`).

use megatron_data::tokenizer::{build_tokenizer_from, Tokenizer, TokenizerSpec};
use std::path::PathBuf;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sentencepiece/tiny-sotu-bpe.model")
}

struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

/// The first model's vectors.
const VECTORS: &str = "tiny-sotu-bpe-vectors.json";

fn cases() -> Vec<Case> {
    let cases = cases_of(VECTORS);
    assert_eq!(cases.len(), 53);
    cases
}

/// The cases of a vectors file beside the models.
fn cases_of(file: &str) -> Vec<Case> {
    let p = model().with_file_name(file);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let cases: Vec<Case> = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().into(),
            ids: c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect(),
            decoded: c["decoded"].as_str().unwrap().into(),
        })
        .collect();
    cases
}

fn tokenizer(kind: &str, path: &str) -> Result<Box<dyn Tokenizer>, String> {
    build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: kind.into(),
        tokenizer_model: Some(path.into()),
        ..Default::default()
    })
    .map_err(|e| e.to_string())
}

/// `model`'s tokenizer of `kind` encodes each of `vectors`' texts to the library's ids (after
/// BOS for `Llama2Tokenizer`) and decodes them to the library's text; `n` cases.
fn assert_same_as_sentencepiece(kind: &str, model: &str, vectors: &str, n: usize) {
    let path = self::model().with_file_name(model);
    let t = tokenizer(kind, path.to_str().unwrap()).unwrap();
    let cases = cases_of(vectors);
    assert_eq!(cases.len(), n, "{vectors}");
    let bos: &[u32] = if kind == "Llama2Tokenizer" { &[1] } else { &[] };
    for c in cases {
        let got = t.encode(&c.text).unwrap();
        assert_eq!(got, [bos, &c.ids].concat(), "{model}: {:?}", c.text);
        assert_eq!(t.decode(&got), c.decoded, "{model}: {:?}", c.text);
    }
}

#[test]
fn llama2_tokenizer_gives_sentencepieces_ids_after_bos() {
    let t = tokenizer("Llama2Tokenizer", model().to_str().unwrap()).unwrap();
    assert_eq!(
        (t.name(), t.vocab_size(), t.eod()),
        ("Llama2Tokenizer", 1000, 2)
    );
    // Decoding as sentencepiece's decode_ids, which drops BOS/EOS.
    assert_same_as_sentencepiece("Llama2Tokenizer", "tiny-sotu-bpe.model", VECTORS, 53);
}

#[test]
fn gpt_sentencepiece_tokenizer_gives_sentencepieces_ids_and_ends_documents_with_eos() {
    let t = tokenizer("GPTSentencePieceTokenizer", model().to_str().unwrap()).unwrap();
    assert_eq!((t.vocab_size(), t.eod()), (1000, 2));
    let cases = cases();
    // Control tokens written in the text are text to sentencepiece, not BOS and EOS.
    assert!(cases
        .iter()
        .any(|c| c.text.contains("<s>") && !c.ids.contains(&1)));
    assert_same_as_sentencepiece(
        "GPTSentencePieceTokenizer",
        "tiny-sotu-bpe.model",
        VECTORS,
        53,
    );
}

#[test]
fn user_defined_and_unused_pieces_and_unknown_runs_go_as_in_sentencepiece() {
    // A model with user-defined pieces (kept whole wherever they occur, `▁` before them kept
    // apart), three merged pieces made UNUSED (merged into, then split back), and no byte
    // fallback (a run of unknown characters is one unknown id, decoded as " ⁇ ").
    let cases = cases_of("tiny-sotu-bpe-special-vectors.json");
    assert!(
        cases.iter().any(|c| c.ids.contains(&0)),
        "a case with unknown text"
    );
    assert_same_as_sentencepiece(
        "GPTSentencePieceTokenizer",
        "tiny-sotu-bpe-special.model",
        "tiny-sotu-bpe-special-vectors.json",
        12,
    );
}

#[test]
fn whitespace_collapsing_models_drop_and_merge_spaces_as_sentencepiece_does() {
    // sentencepiece's default `remove_extra_whitespaces`: spaces at the ends dropped (a text of
    // spaces is no ids), runs of spaces made one; literal `▁` characters and user-defined
    // pieces with spaces in them as the library treats them.
    assert_same_as_sentencepiece(
        "Llama2Tokenizer",
        "tiny-sotu-bpe-collapsing.model",
        "tiny-sotu-bpe-collapsing-vectors.json",
        14,
    );
}

#[test]
fn a_model_with_sentencepieces_default_nfkc_rules_normalizes_as_the_library_does() {
    // `spm_train --model_type=bpe` with its defaults: the `nmt_nfkc` rules compiled into the
    // model (full-width forms, ligatures, circled digits, compatibility characters, Hangul
    // jamo, zero-width and special spaces) and whitespace collapsed.
    assert_same_as_sentencepiece(
        "GPTSentencePieceTokenizer",
        "tiny-sotu-bpe-nfkc.model",
        "tiny-sotu-bpe-nfkc-vectors.json",
        16,
    );
}

#[test]
fn a_unigram_model_takes_sentencepieces_best_path() {
    // T5's and ALBERT's kind of model: the best-scoring segmentation (user-defined pieces
    // favoured by their bonus, UNUSED pieces never chosen, runs of unknown characters one
    // unknown id), after sentencepiece's whitespace rules.
    assert_same_as_sentencepiece(
        "GPTSentencePieceTokenizer",
        "tiny-sotu-unigram.model",
        "tiny-sotu-unigram-vectors.json",
        11,
    );
}

/// trainer_spec.eos_id = -1: key 42 << 3 (varint 0xd0 0x02), then -1 as a ten-byte varint.
const NO_EOS: [u8; 12] = [
    0xd0, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
];

/// A protobuf field: its key (number, wire type) and bytes.
fn field(number: u32, wire: u32, body: &[u8]) -> Vec<u8> {
    let mut b = vec![(number << 3 | wire) as u8];
    if wire == 2 {
        b.push(body.len() as u8);
    }
    b.extend(body);
    b
}

#[test]
fn sentencepiece_models_these_ids_would_not_reproduce_are_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("megatron-rs-spm-refusals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let original = std::fs::read(model()).unwrap();
    // Protobuf merges a message field written again into the first, so appending one changes a
    // single setting of the fixture.
    for (name, extra, needle) in [
        ("word", field(2, 2, &field(3, 0, &[3])), "type 3"),
        (
            "bad-charsmap",
            field(3, 2, &field(2, 2, b"xy")),
            "precompiled_charsmap",
        ),
        ("no-eos", field(2, 2, &NO_EOS), "EOS"),
    ] {
        let mut bytes = original.clone();
        bytes.extend(extra);
        let p = dir.join(format!("{name}.model"));
        std::fs::write(&p, bytes).unwrap();
        let e = tokenizer("GPTSentencePieceTokenizer", p.to_str().unwrap())
            .err()
            .unwrap();
        assert!(
            e.contains(needle) && e.contains(&format!("{name}.model")),
            "{name}: {e}"
        );
    }
    let p = dir.join("text.model");
    std::fs::write(&p, "not a model\n").unwrap();
    let e = tokenizer("Llama2Tokenizer", p.to_str().unwrap())
        .err()
        .unwrap();
    assert!(e.contains("not a sentencepiece model"), "{e}");
    let e = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "Llama2Tokenizer".into(),
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("--tokenizer-model"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
