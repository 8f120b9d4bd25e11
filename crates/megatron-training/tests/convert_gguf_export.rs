//! `megatron convert --to gguf` against llama.cpp's own converter: the tiny Hugging Face fixtures
//! converted to megatron-rs and exported must give the tensors (names, ggml types, dims, bytes)
//! and model metadata that llama.cpp's `convert_hf_to_gguf.py` writes for the same fixtures
//! (`bench/make_gguf_export_fixtures.py`), and Megatron's GPT-2 vocabulary must come out as
//! llama.cpp's `ggml-vocab-gpt-2.gguf` holds it.

mod common;

use common::hf_fixtures::fixture_with_config;
use common::tmpdir;
use megatron_training::checkpointing::load_checkpoint;
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
    let qwen2moe =
        matches!(r.meta.get("general.architecture"), Some(Value::Str(a)) if a == "qwen2moe");
    if qwen2moe && !want.contains(&"output.weight") {
        // llama.cpp's converter leaves a tied Qwen2-MoE without `output.weight`, which its
        // qwen2moe loader requires: ours writes the embedding again.
        let find = |n: &str| o.tensors.iter().find(|t| t.name == n).unwrap();
        let (out, embd) = (find("output.weight"), find("token_embd.weight"));
        assert_eq!((out.ty, &out.dims), (embd.ty, &embd.dims));
        assert!(
            o.raw(out).unwrap() == o.raw(embd).unwrap(),
            "{case}: output.weight"
        );
        want.push("output.weight");
    }
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
        ("mixtral", "f32"),
        ("qwen2_moe", "bf16"),
        ("qwen3_moe_all", "q8_0"),
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
    let _ = std::fs::remove_dir_all(dir);
}

/// gpt-oss as llama.cpp's converter writes it (`gpt-oss`: experts split from the interleaved
/// `gate_up_proj` and transposed, sinks, router and expert biases, the window, YaRN), at f32 and
/// q8_0, from the fixture with llama.cpp's built-in clamp of 7; at the fixture's own clamp, with
/// windows on other layers than every other one from the first, or with an unrounded YaRN range
/// that llama.cpp's rounding would change, it is refused by name.
#[test]
fn gpt_oss_exports_as_llama_cpps_converter_writes_it_and_what_it_cannot_run_is_refused() {
    let dir = tmpdir("gguf-export-gpt-oss");
    let with_config = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let hf = fixture_with_config("gpt_oss", &dir, &format!("{name}-hf"), edit);
        let save = dir.join(name);
        hf_to_megatron(&hf, &save, 128).unwrap();
        save
    };
    let limit7 = with_config("limit7", &|c| c["swiglu_limit"] = serde_json::json!(7.0));
    for outtype in ["f32", "q8_0"] {
        let out = dir.join(format!("gpt_oss-{outtype}.gguf"));
        megatron_to_gguf(&limit7, &out, outtype.parse().unwrap()).unwrap();
        let reference = fixtures().join(format!("gguf/export/gpt_oss-{outtype}.gguf"));
        assert_same_gguf(&out, &reference);
    }
    let refused = |save: &Path, want: &str| {
        let out = dir.join("refused.gguf");
        let e = megatron_to_gguf(save, &out, "f32".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
        assert!(!out.exists());
    };
    let own = with_config("limit1.5", &|_| {});
    refused(&own, "swiglu_limit 1.5");
    let full_first = with_config("full-first", &|c| {
        c["swiglu_limit"] = serde_json::json!(7.0);
        c["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]);
    });
    refused(&full_first, "layer_types");
    // gpt-oss's own YaRN (rope base 150000, factor 32 over 4096, truncate false) on heads of 8:
    // llama.cpp's rounded correction range moves one of the four frequencies by 66 %
    // (transformers' `_compute_yarn_parameters` with truncate false and true agrees: 1 of 4,
    // 65.7 %). The fixture's own YaRN (factor 4 over 8) is the same either way, and exports.
    let real_yarn = with_config("real-yarn", &|c| {
        c["swiglu_limit"] = serde_json::json!(7.0);
        let r = &mut c["rope_parameters"];
        r["rope_theta"] = serde_json::json!(150000.0);
        r["factor"] = serde_json::json!(32.0);
        r["original_max_position_embeddings"] = serde_json::json!(4096);
    });
    refused(
        &real_yarn,
        "moves 1 of this model's 4 rotary frequencies (up to 66 %)",
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A gpt-oss GGUF imports as the model llama.cpp runs: our export of the fixture reads back to
/// the Hugging Face import's tensors exactly, and llama.cpp's converter's file of the MXFP4
/// fixture (its experts repacked as ggml MXFP4 blocks, the released files' form) to the tensors
/// of the Hugging Face MXFP4 import — two dequantizations of the same codes, bit for bit.
#[test]
fn gpt_oss_ggufs_import_to_the_tensors_of_the_hugging_face_import() {
    let dir = tmpdir("gguf-import-gpt-oss");
    let weights = |save: &Path| {
        let mut t: Vec<(String, Vec<f32>)> =
            megatron_training::checkpointing::load_checkpoint_weights(save)
                .unwrap()
                .tensors
                .into_iter()
                .collect();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    };
    let hf = fixture_with_config("gpt_oss", &dir, "hf7", |c| {
        c["swiglu_limit"] = serde_json::json!(7.0)
    });
    let from_hf = dir.join("from-hf");
    hf_to_megatron(&hf, &from_hf, 128).unwrap();
    let out = dir.join("gpt_oss.gguf");
    megatron_to_gguf(&from_hf, &out, "f32".parse().unwrap()).unwrap();
    let back = dir.join("back");
    gguf_to_megatron(&out, &back, 128).unwrap();
    assert_eq!(weights(&from_hf), weights(&back));
    let model = |s: &Path| load_checkpoint(s, None).unwrap().meta.model;
    let (a, b) = (model(&from_hf), model(&back));
    assert_eq!(
        (a.glu, a.softmax_type, &a.window),
        (b.glu, b.softmax_type, &b.window)
    );
    assert_eq!(a.moe, b.moe);
    let mx_hf = dir.join("mx-hf");
    hf_to_megatron(&fixtures().join("hf/gpt_oss_mxfp4"), &mx_hf, 128).unwrap();
    let mx_gguf = dir.join("mx-gguf");
    gguf_to_megatron(
        &fixtures().join("gguf/export/gpt_oss_mxfp4-f32.gguf"),
        &mx_gguf,
        128,
    )
    .unwrap();
    assert_eq!(weights(&mx_hf), weights(&mx_gguf));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn llama_cpps_files_import_and_export_back_to_the_same_tensors() {
    // Every reference file llama.cpp's converter wrote imported, then exported at its own type:
    // the same file, tensor for tensor (dequantizing and requantizing Q8_0 / BF16 / F16 is the
    // identity); and the f32 ones give the checkpoint the Hugging Face fixture gives, exactly.
    let dir = tmpdir("gguf-import-llama-cpp");
    for (fixture, outtype) in [
        ("gpt2", "q8_0"),
        ("llama", "f32"),
        ("llama", "q8_0"),
        ("llama_linear_rope", "f16"),
        ("qwen2", "bf16"),
        ("qwen3_yarn", "q8_0"),
        ("mixtral", "f32"),
        ("qwen2_moe", "bf16"),
        ("qwen3_moe_all", "q8_0"),
    ] {
        let reference = fixtures().join(format!("gguf/export/{fixture}-{outtype}.gguf"));
        let save = dir.join(format!("{fixture}-{outtype}"));
        gguf_to_megatron(&reference, &save, 128).unwrap();
        let out = dir.join(format!("{fixture}-{outtype}.gguf"));
        megatron_to_gguf(&save, &out, outtype.parse().unwrap()).unwrap();
        assert_same_gguf(&out, &reference);
        if outtype == "f32" {
            let from_hf = dir.join(format!("{fixture}-hf"));
            hf_to_megatron(&fixtures().join("hf").join(fixture), &from_hf, 128).unwrap();
            let load = megatron_training::checkpointing::load_checkpoint_weights;
            let (a, b) = (load(&save).unwrap(), load(&from_hf).unwrap());
            assert_eq!(a.meta.model, b.meta.model, "{fixture}: model config");
            assert_eq!(a.tensors.len(), b.tensors.len(), "{fixture}");
            for (k, v) in &b.tensors {
                assert!(
                    a.tensors[k] == *v,
                    "{fixture}: {k} differs from the HF import"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_gpt2_exported_at_f32_imports_back_to_the_same_checkpoint() {
    let dir = tmpdir("gguf-gpt2-round-trip");
    let (a, b, file) = (dir.join("a"), dir.join("b"), dir.join("gpt2.gguf"));
    hf_to_megatron(&fixtures().join("hf/gpt2"), &a, 128).unwrap();
    megatron_to_gguf(&a, &file, GgufOutType::F32).unwrap();
    gguf_to_megatron(&file, &b, 128).unwrap();
    let load = megatron_training::checkpointing::load_checkpoint_weights;
    let (ca, cb) = (load(&a).unwrap(), load(&b).unwrap());
    assert_eq!(ca.meta.model, cb.meta.model);
    assert_eq!(ca.tensors.len(), cb.tensors.len());
    for (k, v) in &ca.tensors {
        assert!(cb.tensors[k] == *v, "{k} differs after the round trip");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn gguf_export_round_trips_through_import_with_rope_freqs() {
    // tiny-llama3_rope.gguf (Llama 3.1 rope_freqs) and tiny-qwen2.gguf imported, exported at
    // f32, imported again: the same model and checkpoint tensors, and the same rope_freqs.
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
        let freqs = o.tensors.iter().any(|t| t.name == "rope_freqs.weight");
        assert_eq!(
            freqs,
            name == "tiny-llama3_rope",
            "{name}: rope_freqs written"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn crc_of(v: &MetaValue) -> (usize, u32) {
    let joined: Vec<String> = match v {
        MetaValue::StrArray(a) => a.clone(),
        MetaValue::I32Array(a) => a.iter().map(|x| x.to_string()).collect(),
        other => panic!("not an array: {other:?}"),
    };
    (joined.len(), crc32c::crc32c(joined.join("\0").as_bytes()))
}

fn gpt2_vocab_files() -> (String, String) {
    let gpt2 =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../megatron-data/tests/fixtures/gpt2");
    let s = |f: &str| gpt2.join(f).to_str().unwrap().to_string();
    (s("vocab.json"), s("merges.txt"))
}

/// `keys` are the tokenizer keys of llama.cpp's `ggml-vocab-gpt-2.gguf` (the digest written by
/// `bench/make_gguf_export_fixtures.py`): the same keys, the arrays' lengths and crc32c.
fn assert_is_llama_cpps_gpt2_vocab(keys: &[(String, MetaValue)]) {
    let text = std::fs::read_to_string(fixtures().join("gguf/export/gpt2-vocab.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let want = want.as_object().unwrap();
    let names: Vec<&String> = keys.iter().map(|k| &k.0).collect();
    assert_eq!(keys.len(), want.len(), "keys: {names:?}");
    for (k, v) in keys {
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
}

/// A file's `tokenizer.*` keys as the writer's values.
fn tokenizer_keys(g: &Gguf) -> Vec<(String, MetaValue)> {
    let strs = |a: &[Value]| a.iter().map(|v| v.as_str().unwrap().to_string()).collect();
    g.meta
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| {
            let v = match v {
                Value::Str(s) => MetaValue::Str(s.clone()),
                Value::Int(i) => MetaValue::U32(*i as u32),
                Value::Bool(b) => MetaValue::Bool(*b),
                Value::Arr(a) if matches!(a.first(), Some(Value::Str(_))) => {
                    MetaValue::StrArray(strs(a))
                }
                Value::Arr(a) => MetaValue::I32Array(
                    a.iter()
                        .map(|v| match v {
                            Value::Int(i) => *i as i32,
                            other => panic!("{k}: {other:?}"),
                        })
                        .collect(),
                ),
                other => panic!("{k}: {other:?}"),
            };
            (k.clone(), v)
        })
        .collect()
}

#[test]
fn megatrons_gpt2_vocabulary_exports_as_llama_cpps_gpt2_vocab() {
    let (v, m) = gpt2_vocab_files();
    let (v, m) = (v.as_str(), m.as_str());
    let keys = tokenizer_metadata("GPT2BPETokenizer", Some(v), Some(m), None, 50257).unwrap();
    assert_is_llama_cpps_gpt2_vocab(&keys);
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
        ("qwen3_moe", "dense layers among the expert layers"),
        ("t5", "GGUF export is built for"),
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
    // An output whose directory does not exist is named as given; nothing is left behind.
    let save = dir.join("llama");
    hf_to_megatron(&fixtures().join("hf/llama"), &save, 128).unwrap();
    let out = dir.join("missing").join("x.gguf");
    let e = megatron_to_gguf(&save, &out, GgufOutType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&out.display().to_string()) && !e.contains(".partial"),
        "{e}"
    );
    assert!(!dir.join("missing").exists());
    let e: Result<GgufOutType, _> = "q4_k".parse();
    assert!(e.unwrap_err().contains("f32, f16, bf16 or q8_0"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_byte_level_tokenizer_json_exports_as_llama_cpps_vocab_and_survives_import() {
    // GPT-2's tokenizer as Hugging Face writes it (tokenizer.json + tokenizer_config.json) beside
    // the llama fixture grown to GPT-2's 50,257 rows: exported, its vocabulary is llama.cpp's
    // GPT-2 vocabulary; imported back and exported again, the same tokenizer keys.
    let dir = tmpdir("gguf-export-tokenizer");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let src = fixtures().join("hf/llama");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["vocab_size"] = 50257.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let (mut shape, mut data) = (view.shape().to_vec(), view.data().to_vec());
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            // New rows: small distinct values, so every row quantizes to something.
            for i in shape[0] * shape[1]..50257 * shape[1] {
                data.extend(((i % 97) as f32 * 1e-3).to_le_bytes());
            }
            shape[0] = 50257;
        }
        owned.push((name, shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, s, d)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d);
            (n.clone(), v.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &hf.join("model.safetensors")).unwrap();
    let (v, m) = gpt2_vocab_files();
    let vocab: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(v).unwrap()).unwrap();
    let merges: Vec<String> = std::fs::read_to_string(m)
        .unwrap()
        .lines()
        .skip(1)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 50256, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": true, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
            "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
            "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
            "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "vocab": vocab, "merges": merges},
    });
    std::fs::write(hf.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let special = r#"{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}"#;
    std::fs::write(hf.join("tokenizer_config.json"), special).unwrap();

    let save = dir.join("m");
    hf_to_megatron(&hf, &save, 128).unwrap();
    let first = dir.join("first.gguf");
    megatron_to_gguf(&save, &first, GgufOutType::Q8_0).unwrap();
    let g = Gguf::open(&first).unwrap();
    let mut keys = tokenizer_keys(&g);
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    assert_is_llama_cpps_gpt2_vocab(&keys);
    let embd = g
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap();
    assert_eq!(
        embd.dims,
        [32, 50257],
        "padding rows trimmed to the vocabulary"
    );

    let back = dir.join("back");
    gguf_to_megatron(&first, &back, 128).unwrap();
    assert!(back.join("tokenizer_config.json").exists());
    let second = dir.join("second.gguf");
    megatron_to_gguf(&back, &second, GgufOutType::Q8_0).unwrap();
    let mut again = tokenizer_keys(&Gguf::open(&second).unwrap());
    again.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        again == keys,
        "tokenizer keys changed through import and export"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn q5_and_k_quant_tensors_dequantize_as_gguf_py_does_bit_for_bit() {
    // bench/make_gguf_kquant_fixture.py: 2 x 512 values per type (Q5_0, Q5_1, Q2_K ... Q6_K)
    // quantized by ggml itself, and
    // gguf-py's reference dequantization of them.
    let g = Gguf::open(&fixtures().join("gguf/k-quants.gguf")).unwrap();
    let bytes = std::fs::read(fixtures().join("gguf/k-quants-expected.safetensors")).unwrap();
    let want = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(g.tensors.len(), 7);
    for t in &g.tensors {
        let name = t.name.trim_end_matches(".weight");
        let w: Vec<f32> = want
            .tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let got = g.dequantize(t).unwrap();
        assert_eq!(got.len(), w.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(&w).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{name}[{i}]: {a} vs gguf-py {b}");
        }
    }
}
