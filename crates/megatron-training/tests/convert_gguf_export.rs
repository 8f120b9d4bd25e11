//! `megatron convert --to gguf` against llama.cpp's own converter: the tiny Hugging Face fixtures
//! converted to megatron-rs and exported must give the tensors (names, ggml types, dims, bytes)
//! and model metadata that llama.cpp's `convert_hf_to_gguf.py` writes for the same fixtures
//! (`bench/make_gguf_export_fixtures.py`), and Megatron's GPT-2 vocabulary must come out as
//! llama.cpp's `ggml-vocab-gpt-2.gguf` holds it.

mod common;

use common::tmpdir;
use megatron_training::convert::gguf::{Gguf, Value};
use megatron_training::convert::gguf_export::{tokenizer_metadata, GgufOutType};
use megatron_training::convert::gguf_writer::MetaValue;
use megatron_training::convert::{gguf_to_megatron, hf_to_megatron, megatron_to_gguf};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn int(g: &Gguf, k: &str) -> i128 {
    match g.meta.get(k) {
        Some(Value::Int(i)) => *i,
        other => panic!("{k}: {other:?}"),
    }
}

/// A key ours writes that llama.cpp's converter leaves to its loader's default: allowed only
/// when it states that default.
fn redundant_key_agrees(ours: &Gguf, k: &str) -> bool {
    let arch = match ours.meta.get("general.architecture") {
        Some(Value::Str(a)) => a.clone(),
        _ => return false,
    };
    let Some(tail) = k.strip_prefix(&format!("{arch}.")) else {
        return k == "general.name" || k == "tokenizer.ggml.model";
    };
    let heads = int(ours, &format!("{arch}.attention.head_count"));
    // llama.cpp's default head size: key_length where written, else embedding / heads.
    let head_dim = match ours.meta.get(&format!("{arch}.attention.key_length")) {
        Some(Value::Int(d)) if !tail.starts_with("attention.") => *d,
        _ => int(ours, &format!("{arch}.embedding_length")) / heads,
    };
    let rows = ours
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .map(|t| t.dims[1] as i128);
    match tail {
        "attention.key_length" | "attention.value_length" | "rope.dimension_count" => {
            int(ours, k) == head_dim
        }
        "attention.head_count_kv" => int(ours, k) == heads,
        "vocab_size" => Some(int(ours, k)) == rows,
        _ => false,
    }
}

fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Float(x), Value::Float(y)) => x == y,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Str(x), Value::Str(y)) => x == y,
        (Value::Arr(x), Value::Arr(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b))
        }
        _ => false,
    }
}

/// Every tensor of `reference` in `ours` with the same type, dims and bytes, nothing more; every
/// metadata key of `reference` (but its naming keys) in `ours` with the same type and value, and
/// no other key unless it states llama.cpp's default.
fn assert_same_gguf(ours: &Path, reference: &Path) {
    let (o, r) = (Gguf::open(ours).unwrap(), Gguf::open(reference).unwrap());
    let case = reference.file_name().unwrap().to_string_lossy();
    let mut names: Vec<&str> = o.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut want: Vec<&str> = r.tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort();
    want.sort();
    assert_eq!(names, want, "{case}: tensor names");
    for rt in &r.tensors {
        let ot = o.tensors.iter().find(|t| t.name == rt.name).unwrap();
        assert_eq!((ot.ty, &ot.dims), (rt.ty, &rt.dims), "{case}: {}", rt.name);
        assert!(
            o.raw(ot).unwrap() == r.raw(rt).unwrap(),
            "{case}: {} bytes differ from llama.cpp's",
            rt.name
        );
    }
    for (k, v) in &r.meta {
        if k == "general.name" || k == "general.size_label" {
            continue;
        }
        let ov = o
            .meta
            .get(k)
            .unwrap_or_else(|| panic!("{case}: {k} missing"));
        assert_eq!(o.meta_types[k], r.meta_types[k], "{case}: type of {k}");
        assert!(same_value(ov, v), "{case}: {k} = {ov:?}, llama.cpp {v:?}");
    }
    for k in o.meta.keys().filter(|k| !r.meta.contains_key(*k)) {
        assert!(
            redundant_key_agrees(&o, k),
            "{case}: extra key {k} = {:?}",
            o.meta[k]
        );
    }
}

#[test]
fn gguf_export_matches_llama_cpps_converter_tensor_for_tensor() {
    let dir = tmpdir("gguf-export");
    let cases = [
        ("llama", "f32"),
        ("llama", "q8_0"),
        ("llama_linear_rope", "f16"),
        ("qwen2", "bf16"),
        ("qwen3_yarn", "q8_0"),
        ("gpt2", "q8_0"),
    ];
    for (fixture, outtype) in cases {
        let save = dir.join(fixture);
        if !save.exists() {
            hf_to_megatron(&fixtures().join("hf").join(fixture), &save, 128).unwrap();
        }
        let out = dir.join(format!("{fixture}-{outtype}.gguf"));
        megatron_to_gguf(&save, &out, outtype.parse().unwrap()).unwrap();
        let reference = fixtures().join(format!("gguf/export/{fixture}-{outtype}.gguf"));
        assert_same_gguf(&out, &reference);
    }
}

#[test]
fn gguf_export_round_trips_through_import_with_rope_freqs_and_tokenizer() {
    // tiny-llama3_rope.gguf (Llama 3.1 rope_freqs) and tiny-qwen2.gguf (a byte-level BPE
    // vocabulary) imported, exported at f32, imported again: the same checkpoint tensors.
    let dir = tmpdir("gguf-export-round-trip");
    for name in ["tiny-llama3_rope", "tiny-qwen2"] {
        let src = fixtures().join(format!("gguf/{name}.gguf"));
        let (a, b) = (dir.join(format!("{name}-a")), dir.join(format!("{name}-b")));
        gguf_to_megatron(&src, &a, 128).unwrap();
        let out = dir.join(format!("{name}.gguf"));
        megatron_to_gguf(&a, &out, GgufOutType::F32).unwrap();
        gguf_to_megatron(&out, &b, 128).unwrap();
        let (ca, cb) = (
            megatron_training::checkpointing::load_checkpoint_weights(&a).unwrap(),
            megatron_training::checkpointing::load_checkpoint_weights(&b).unwrap(),
        );
        assert_eq!(ca.meta.model, cb.meta.model, "{name}: model config");
        assert_eq!(ca.tensors.len(), cb.tensors.len());
        for (k, v) in &ca.tensors {
            assert!(
                cb.tensors[k] == *v,
                "{name}: {k} differs after the round trip"
            );
        }
        let (g, o) = (Gguf::open(&src).unwrap(), Gguf::open(&out).unwrap());
        for t in &g.tensors {
            let ot = o.tensors.iter().find(|x| x.name == t.name).unwrap();
            assert_eq!(ot.dims, t.dims, "{name}: {}", t.name);
            if t.name == "rope_freqs.weight" {
                let (x, y) = (g.dequantize(t).unwrap(), o.dequantize(ot).unwrap());
                for (p, q) in x.iter().zip(&y) {
                    assert!((p - q).abs() <= 1e-5 * p.abs(), "rope_freqs {p} vs {q}");
                }
            }
        }
        for k in g.meta.keys().filter(|k| k.starts_with("tokenizer.ggml.")) {
            let ok = k == "tokenizer.ggml.pre" || same_value(&g.meta[k], &o.meta[k]);
            assert!(ok, "{name}: {k} differs after the round trip");
        }
    }
}

fn crc_of(v: &MetaValue) -> (usize, u32) {
    let joined: Vec<String> = match v {
        MetaValue::StrArray(a) => a.clone(),
        MetaValue::I32Array(a) => a.iter().map(|x| x.to_string()).collect(),
        other => panic!("not an array: {other:?}"),
    };
    (joined.len(), crc32c::crc32c(joined.join("\0").as_bytes()))
}

#[test]
fn megatrons_gpt2_vocabulary_exports_as_llama_cpps_gpt2_vocab() {
    let gpt2 =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../megatron-data/tests/fixtures/gpt2");
    let (v, m) = (gpt2.join("vocab.json"), gpt2.join("merges.txt"));
    let (v, m) = (v.to_str().unwrap(), m.to_str().unwrap());
    let keys = tokenizer_metadata("GPT2BPETokenizer", Some(v), Some(m), None, 50257).unwrap();
    let text = std::fs::read_to_string(fixtures().join("gguf/export/gpt2-vocab.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let want = want.as_object().unwrap();
    assert_eq!(
        keys.len(),
        want.len(),
        "keys: {:?}",
        keys.iter().map(|k| &k.0).collect::<Vec<_>>()
    );
    for (k, v) in &keys {
        let w = &want[k];
        match v {
            MetaValue::Str(s) => assert_eq!(w.as_str(), Some(s.as_str()), "{k}"),
            MetaValue::U32(x) => assert_eq!(w.as_u64(), Some(*x as u64), "{k}"),
            arr => {
                let (len, crc) = crc_of(arr);
                assert_eq!(len as u64, w["len"].as_u64().unwrap(), "{k}: length");
                assert_eq!(crc as u64, w["crc32c"].as_u64().unwrap(), "{k}: contents");
            }
        }
    }
    // A padded embedding gets llama.cpp's padding tokens (UNUSED, type 5).
    let padded = tokenizer_metadata("GPT2BPETokenizer", Some(v), Some(m), None, 50304).unwrap();
    let (tokens, types) = (&padded[2].1, &padded[3].1);
    match (tokens, types) {
        (MetaValue::StrArray(t), MetaValue::I32Array(y)) => {
            assert_eq!(
                (t.len(), t[50303].as_str(), y[50303]),
                (50304, "[PAD50303]", 5)
            );
            assert_eq!((t[50256].as_str(), y[50256]), ("<|endoftext|>", 3));
        }
        other => panic!("{other:?}"),
    }
    // More tokens than embedding rows is refused.
    let e = tokenizer_metadata("GPT2BPETokenizer", Some(v), Some(m), None, 1000).unwrap_err();
    assert!(e.contains("50257 tokens") && e.contains("1000 rows"), "{e}");
}

#[test]
fn gguf_export_refuses_what_llama_cpp_would_run_differently() {
    let dir = tmpdir("gguf-export-refusals");
    for (fixture, needle) in [
        // llama.cpp's own converter drops Qwen3's window silently; this one refuses it.
        ("qwen3", "sliding_window"),
        ("llama_quick_gelu", "hidden_act 'quick_gelu'"),
        ("mixtral", "GGUF export is built for"),
    ] {
        let save = dir.join(fixture);
        hf_to_megatron(&fixtures().join("hf").join(fixture), &save, 128).unwrap();
        let out = dir.join(format!("{fixture}.gguf"));
        let e = megatron_to_gguf(&save, &out, GgufOutType::Q8_0)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{fixture}: {e}");
        assert!(!out.exists() && !out.with_extension("gguf.partial").exists());
    }
    let e: Result<GgufOutType, _> = "q4_k".parse();
    assert!(e.unwrap_err().contains("f32, f16, bf16 or q8_0"));
}
