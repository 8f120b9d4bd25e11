//! SentencePiece ("llama") vocabularies through `megatron convert --from gguf` and `--to gguf`
//! (`convert/spm_vocab.rs`), against llama.cpp's own ids: `tiny-llama-spm.gguf` holds a
//! 1,000-piece SentencePiece BPE trained on examples/sotu, and `tiny-llama-spm-vectors.json`
//! what llama.cpp's `llama-tokenize` makes of 53 texts with it (llama.cpp's 47 SPM test inputs,
//! sotu sentences, unicode, special tokens in the text; `bench/make_gguf_spm_fixture.py`).

mod common;

use common::llama_cpp_spm::LlamaCppSpm;
use common::tmpdir;
use megatron_training::convert::gguf::{Gguf, Value};
use megatron_training::convert::gguf_export::{tokenizer_metadata, GgufOutType};
use megatron_training::convert::gguf_writer::MetaValue;
use megatron_training::convert::{gguf_to_megatron, megatron_to_gguf};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/tiny-llama-spm.gguf")
}

/// (text, llama.cpp's ids without BOS).
fn cases() -> Vec<(String, Vec<usize>)> {
    let p = fixture().with_file_name("tiny-llama-spm-vectors.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let cases: Vec<(String, Vec<usize>)> = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["ids"].as_array().unwrap();
            let ids = ids.iter().map(|i| i.as_u64().unwrap() as usize).collect();
            (c["text"].as_str().unwrap().to_string(), ids)
        })
        .collect();
    assert_eq!(cases.len(), 53);
    cases
}

/// A GGUF's vocabulary: tokens, scores, types.
fn vocab(g: &Gguf) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let arr = |k: &str| match g.meta.get(k) {
        Some(Value::Arr(a)) => a.clone(),
        other => panic!("{k}: {other:?}"),
    };
    let tokens = arr("tokenizer.ggml.tokens");
    let tokens = tokens.iter().map(|t| t.as_str().unwrap().to_string());
    let scores = arr("tokenizer.ggml.scores");
    let scores = scores.iter().map(|s| s.as_f64().unwrap() as f32);
    let types = arr("tokenizer.ggml.token_type");
    let types = types.iter().map(|t| match t {
        Value::Int(i) => *i as i32,
        other => panic!("{other:?}"),
    });
    (tokens.collect(), scores.collect(), types.collect())
}

/// The fixture imported into a checkpoint under `dir`; its tokenizer.json.
fn import(dir: &Path) -> (PathBuf, PathBuf) {
    let save = dir.join("imported");
    gguf_to_megatron(&fixture(), &save, 128).unwrap();
    let tok = save.join("tokenizer.json");
    assert!(tok.exists(), "no tokenizer.json written");
    (save, tok)
}

#[test]
fn the_restated_llama_cpp_spm_tokenizer_gives_llama_tokenizes_ids() {
    // The test's own statement of llama.cpp's algorithm, checked against llama.cpp itself, so
    // the export test below can run it on the scores we write.
    let (tokens, scores, types) = vocab(&Gguf::open(&fixture()).unwrap());
    let spm = LlamaCppSpm::new(&tokens, &scores, &types, true);
    for (text, ids) in cases() {
        assert_eq!(spm.tokenize(&text), ids, "{text:?}");
    }
}

#[test]
fn a_sentencepiece_gguf_imports_as_a_tokenizer_json_that_tokenizes_as_llama_cpp() {
    let dir = tmpdir("gguf-spm-import");
    let (_, tok) = import(&dir);
    let t = tokenizers::Tokenizer::from_file(&tok).unwrap();
    for (text, ids) in cases() {
        let got = t.encode(text.as_str(), false).unwrap();
        let got: Vec<usize> = got.get_ids().iter().map(|&i| i as usize).collect();
        assert_eq!(got, ids, "{text:?}");
        // With special tokens: BOS in front, as the GGUF's add_bos_token says.
        let with = t.encode(text.as_str(), true).unwrap();
        assert_eq!(with.get_ids().first(), Some(&1), "{text:?}");
        assert_eq!(with.get_ids().len(), ids.len() + 1, "{text:?}");
        if !text.contains("<s>") {
            let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
            assert_eq!(t.decode(&ids, false).unwrap(), text, "decoding {ids:?}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The `tokenizer.*` keys, scores aside (they are compared by the ids they give).
fn keys_but_scores(g: &Gguf) -> Vec<(String, String)> {
    let mut k: Vec<(String, String)> = g
        .meta
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.") && *k != "tokenizer.ggml.scores")
        .map(|(k, v)| (k.clone(), format!("{v:?}")))
        .collect();
    k.sort();
    k
}

#[test]
fn a_sentencepiece_tokenizer_json_exports_as_the_vocabulary_llama_cpp_ran() {
    let dir = tmpdir("gguf-spm-export");
    let (save, _) = import(&dir);
    let first = dir.join("first.gguf");
    megatron_to_gguf(&save, &first, GgufOutType::F32).unwrap();
    let (orig, ours) = (Gguf::open(&fixture()).unwrap(), Gguf::open(&first).unwrap());
    // Every tokenizer key as the original has it (model, pre, tokens, types, special ids, add
    // flags); SentencePiece's scores become merge ranks, which must merge in the same order.
    assert_eq!(keys_but_scores(&ours), keys_but_scores(&orig));
    let (tokens, scores, types) = vocab(&ours);
    assert_eq!(scores.len(), tokens.len());
    let spm = LlamaCppSpm::new(&tokens, &scores, &types, true);
    for (text, ids) in cases() {
        assert_eq!(spm.tokenize(&text), ids, "{text:?}");
    }
    // The check has teeth: with every score equal (llama.cpp's converter given only a
    // tokenizer.json writes -1000 for all), merges run left to right and ids differ.
    let flat = vec![-1000.0; tokens.len()];
    let flat = LlamaCppSpm::new(&tokens, &flat, &types, true);
    assert!(cases()
        .iter()
        .any(|(text, ids)| flat.tokenize(text) != *ids));
    // Imported again and exported again: the same keys, scores included.
    let back = dir.join("back");
    gguf_to_megatron(&first, &back, 128).unwrap();
    let second = dir.join("second.gguf");
    megatron_to_gguf(&back, &second, GgufOutType::F32).unwrap();
    let again = Gguf::open(&second).unwrap();
    assert_eq!(keys_but_scores(&again), keys_but_scores(&ours));
    assert!(vocab(&again).1 == scores, "scores changed through import");
    let _ = std::fs::remove_dir_all(dir);
}

/// `tokenizer_metadata` on a tokenizer.json edited by `edit`.
fn metadata_of_edited(
    dir: &Path,
    name: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> Result<Vec<(String, MetaValue)>, String> {
    let (_, tok) = import(&dir.join(name));
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok).unwrap()).unwrap();
    edit(&mut t);
    std::fs::write(&tok, t.to_string()).unwrap();
    tokenizer_metadata("HuggingFaceTokenizer", None, None, tok.to_str(), 1024)
}

#[test]
fn hugging_faces_metaspace_form_of_the_vocabulary_exports_the_same_keys() {
    // transformers' Llama converter writes a Metaspace pre-tokenizer (prepend at the start, no
    // split) in place of the normalizer: for text without special tokens, the same ids.
    let dir = tmpdir("gguf-spm-metaspace");
    let plain = metadata_of_edited(&dir, "plain", |_| {}).unwrap();
    let meta = metadata_of_edited(&dir, "metaspace", |t| {
        t["normalizer"] = serde_json::Value::Null;
        t["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
            "prepend_scheme": "first", "split": false});
    })
    .unwrap();
    assert!(plain == meta, "the Metaspace form exported other keys");
    // Padded to the embedding's rows as llama.cpp pads: UNUSED tokens.
    let types = plain.iter().find(|(k, _)| k == "tokenizer.ggml.token_type");
    match types {
        Some((_, MetaValue::I32Array(t))) => assert_eq!((t.len(), t[1023]), (1024, 5)),
        other => panic!("{other:?}"),
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sentencepiece_tokenizers_llama_cpp_would_run_differently_are_refused() {
    let dir = tmpdir("gguf-spm-refusals");
    // A Metaspace that splits on spaces: llama.cpp merges across them.
    let e = metadata_of_edited(&dir, "split", |t| {
        t["normalizer"] = serde_json::Value::Null;
        t["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
            "prepend_scheme": "always", "split": true});
    })
    .unwrap_err();
    assert!(e.contains("Metaspace") && e.contains("splits"), "{e}");
    // A normalizer llama.cpp does not apply.
    let e = metadata_of_edited(&dir, "lowercase", |t| {
        t["normalizer"] = serde_json::json!({"type": "Lowercase"});
    })
    .unwrap_err();
    assert!(
        e.contains("Lowercase") && e.contains("tokenizer.json"),
        "{e}"
    );
    // A merge left out: llama.cpp would still make that token there.
    let e = metadata_of_edited(&dir, "unlisted", |t| {
        let merges = t["model"]["merges"].as_array_mut().unwrap();
        let gone = merges.remove(0);
        assert_eq!(gone, serde_json::json!(["\u{2581}", "t"]));
    })
    .unwrap_err();
    assert!(
        e.contains("(\u{2581}t)") && e.contains("does not list"),
        "{e}"
    );
    // A merge that makes no token.
    let e = metadata_of_edited(&dir, "no-token", |t| {
        let merges = t["model"]["merges"].as_array_mut().unwrap();
        merges.push(serde_json::json!(["q", "z"]));
    })
    .unwrap_err();
    assert!(e.contains("(q z) makes qz, which is no token"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_gguf_with_another_tokenizer_model_is_refused_by_name() {
    // The fixture with tokenizer.ggml.model "bert" (and "default" as "default1", so the header
    // keeps its length and the tensor data its offset).
    let dir = tmpdir("gguf-spm-bert");
    let mut bytes = std::fs::read(fixture()).unwrap();
    let replace = |bytes: &mut Vec<u8>, key: &str, old: &str, new: &str| {
        let mut from = key.len().to_le_bytes().to_vec();
        from.extend(key.as_bytes());
        from.extend(8u32.to_le_bytes());
        let mut to = from.clone();
        from.extend((old.len() as u64).to_le_bytes());
        from.extend(old.as_bytes());
        to.extend((new.len() as u64).to_le_bytes());
        to.extend(new.as_bytes());
        let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
        bytes.splice(at..at + from.len(), to);
    };
    replace(&mut bytes, "tokenizer.ggml.model", "llama", "bert");
    replace(&mut bytes, "tokenizer.ggml.pre", "default", "default1");
    let path = dir.join("bert-vocab.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = gguf_to_megatron(&path, &dir.join("out"), 128)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.model bert") && e.contains("bert-vocab.gguf"),
        "{e}"
    );
    assert!(
        !dir.join("out").exists(),
        "a refused import left its output"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `ours` holds the same value as llama.cpp's file holds as `theirs`.
fn same(ours: &MetaValue, theirs: &Value) -> bool {
    let arr = |a: &Value| match a {
        Value::Arr(a) => a.clone(),
        _ => Vec::new(),
    };
    match ours {
        MetaValue::Str(s) => theirs.as_str() == Some(s.as_str()),
        MetaValue::U32(x) => theirs.as_u64() == Some(*x as u64),
        MetaValue::Bool(b) => matches!(theirs, Value::Bool(t) if t == b),
        MetaValue::StrArray(a) => {
            let t = arr(theirs);
            a.len() == t.len()
                && a.iter()
                    .zip(&t)
                    .all(|(x, y)| y.as_str() == Some(x.as_str()))
        }
        MetaValue::I32Array(a) => {
            let t = arr(theirs);
            a.len() == t.len()
                && a.iter()
                    .zip(&t)
                    .all(|(x, y)| matches!(y, Value::Int(i) if *i == *x as i128))
        }
        MetaValue::F32Array(a) => {
            let t = arr(theirs);
            a.len() == t.len() && a.iter().zip(&t).all(|(x, y)| y.as_f64() == Some(*x as f64))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_sentencepiece_model_exports_as_llama_cpps_converter_writes_it() {
    // The fixture GGUF holds the model's pieces, scores and types as llama.cpp's converter
    // writes a tokenizer.model (`_create_vocab_sentencepiece`, restated by the fixture's
    // script), with BOS added: what Megatron's Llama2Tokenizer does.
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../megatron-data/tests/fixtures/sentencepiece/tiny-sotu-bpe.model");
    let model = model.to_str().unwrap();
    let keys = tokenizer_metadata("Llama2Tokenizer", None, None, Some(model), 1000).unwrap();
    let orig = Gguf::open(&fixture()).unwrap();
    let theirs: Vec<&String> = orig
        .meta
        .keys()
        .filter(|k| k.starts_with("tokenizer."))
        .collect();
    let names: Vec<&String> = keys.iter().map(|k| &k.0).collect();
    assert_eq!(
        keys.len(),
        theirs.len(),
        "ours {names:?}, llama.cpp's {theirs:?}"
    );
    for (k, v) in &keys {
        assert!(same(v, &orig.meta[k]), "{k}");
    }
    // GPTSentencePieceTokenizer adds no BOS.
    let keys =
        tokenizer_metadata("GPTSentencePieceTokenizer", None, None, Some(model), 1000).unwrap();
    let add_bos = keys
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.add_bos_token");
    assert!(
        matches!(add_bos, Some((_, MetaValue::Bool(false)))),
        "{add_bos:?}"
    );
}

#[test]
fn sentencepiece_models_that_normalize_text_are_refused_for_llama_cpp() {
    // llama.cpp keeps every space and applies no normalization rules; these models drop and
    // merge spaces, the second also applies sentencepiece's nmt_nfkc rules, and the third is
    // a unigram model, which llama.cpp's `llama` vocabulary does not run.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../megatron-data/tests/fixtures/sentencepiece");
    for (file, needle) in [
        ("tiny-sotu-bpe-collapsing.model", "remove_extra_whitespaces"),
        (
            "tiny-sotu-bpe-nfkc.model",
            "\"nmt_nfkc\" (precompiled_charsmap)",
        ),
        ("tiny-sotu-unigram.model", "a unigram sentencepiece model"),
    ] {
        let model = dir.join(file);
        let e = tokenizer_metadata("Llama2Tokenizer", None, None, model.to_str(), 600).unwrap_err();
        assert!(e.contains(needle) && e.contains(file), "{e}");
    }
}
