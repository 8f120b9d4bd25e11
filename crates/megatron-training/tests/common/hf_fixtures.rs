//! Tiny random Hugging Face models made by transformers (`bench/make_hf_fixtures.py` and its
//! siblings; committed with their fp32 logits): converting them and reading the logits back.

use megatron_core::inference::{decode_step, KVCache};
use megatron_core::models::ModelFamily;
use megatron_core::Params;
use megatron_training::checkpointing::{load_checkpoint, restore, restore_buffers};
use megatron_training::convert::{hf_to_megatron, megatron_to_hf};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

use super::tmpdir;

pub fn fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(arch)
}

/// Fixture `arch`'s weights under `dir/name` with its config.json as `edit` leaves it: a variant
/// the committed fixtures need not hold (another clamp, a quantization method).
#[allow(dead_code)]
pub fn fixture_with_config(
    arch: &str,
    dir: &Path,
    name: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> PathBuf {
    let (src, out) = (fixture(arch), dir.join(name));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(src.join("model.safetensors"), out.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out
}

pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Logits of the converted model for the fixture's token ids, position by position through the
/// KV cache: `[batch, t, vocab]` (vocabulary padding dropped).
pub fn megatron_logits(save: &Path, ids: &[i64], b: usize, t: usize, vocab: usize) -> Vec<f32> {
    let ck = load_checkpoint(save, None).unwrap();
    let mut params = Params::default();
    let layers = ck.meta.model.num_layers();
    let model = ck
        .meta
        .model
        .build_chunk(&mut params, &mut Vec::new(), 0..layers, true, true);
    params.data = vec![0.0; params.numel()];
    restore(&ck, &mut params, None).unwrap();
    // Buffers too (a router's expert bias), as generate restores them.
    restore_buffers(&ck, &model);
    let vp = ck.meta.model.padded_vocab_size;
    let mut cache = KVCache::new(&model, b, t);
    let mut out = vec![0.0f32; b * t * vocab];
    for pos in 0..t {
        let toks: Vec<u32> = (0..b).map(|bi| ids[bi * t + pos] as u32).collect();
        let logits = decode_step(&model, &params, &mut cache, &toks);
        for bi in 0..b {
            let row = &logits.data()[bi * vp..bi * vp + vocab];
            out[(bi * t + pos) * vocab..(bi * t + pos + 1) * vocab].copy_from_slice(row);
        }
    }
    out
}

/// The largest difference between the logits a converted checkpoint `save` gives on the
/// reference file's `input_ids` and the reference's `logits` tensor (transformers').
pub fn max_logit_difference(save: &Path, reference: &Path, logits: &str) -> f32 {
    let bytes = std::fs::read(reference).unwrap();
    let r = SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<i64> = r
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let lt = r.tensor(logits).unwrap();
    let (b, t, vocab) = (lt.shape()[0], lt.shape()[1], lt.shape()[2]);
    let got = megatron_logits(save, &ids, b, t, vocab);
    f32s(lt.data())
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

pub fn check(arch: &str) {
    let dir = tmpdir(&format!("convert-{arch}"));
    let save = dir.join("megatron");
    hf_to_megatron(&fixture(arch), &save, 128).unwrap();
    // Logits against transformers'.
    let diff = max_logit_difference(
        &save,
        &fixture(arch).join("reference.safetensors"),
        "logits",
    );
    eprintln!("{arch}: max |logit difference| {diff:e}");
    assert!(diff <= 1e-4, "{arch}: logits differ by {diff}");
    // And back: the original tensors, byte for byte.
    let back = dir.join("hf");
    megatron_to_hf(&save, &back).unwrap();
    let a = std::fs::read(fixture(arch).join("model.safetensors")).unwrap();
    let c = std::fs::read(back.join("model.safetensors")).unwrap();
    let (a, c) = (
        SafeTensors::deserialize(&a).unwrap(),
        SafeTensors::deserialize(&c).unwrap(),
    );
    let mut names: Vec<String> = a.names().into_iter().map(String::from).collect();
    names.sort();
    let mut back_names: Vec<String> = c.names().into_iter().map(String::from).collect();
    back_names.sort();
    assert_eq!(names, back_names, "{arch}: tensor names");
    for n in &names {
        let (x, y) = (a.tensor(n).unwrap(), c.tensor(n).unwrap());
        assert_eq!(x.shape(), y.shape(), "{arch}: {n}");
        assert_eq!(x.data(), y.data(), "{arch}: {n} differs");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(back.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["vocab_size"], 96, "{arch}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `arch`'s fixture converted and exported again: the model as read, and the config.json
/// written back.
pub fn converted_and_exported(arch: &str) -> (megatron_core::TransformerConfig, serde_json::Value) {
    let dir = tmpdir(&format!("convert-back-{arch}"));
    hf_to_megatron(&fixture(arch), &dir.join("m"), 128).unwrap();
    let cfg = load_checkpoint(&dir.join("m"), None).unwrap().meta.model;
    megatron_to_hf(&dir.join("m"), &dir.join("hf")).unwrap();
    let text = std::fs::read_to_string(dir.join("hf").join("config.json")).unwrap();
    let _ = std::fs::remove_dir_all(dir);
    (cfg, serde_json::from_str(&text).unwrap())
}

/// Trains a converted checkpoint 2 steps from its own config (`--use-checkpoint-args
/// --finetune`) with `--lr 0`, so every layout computes its losses from the converted weights.
pub fn train_converted(save: &str, layout: &[&str]) -> megatron_training::TrainSummary {
    train_converted_with_vocab(save, "95", layout)
}

/// [`train_converted`] on mock data of `vocab` token ids.
pub fn train_converted_with_vocab(
    save: &str,
    vocab: &str,
    layout: &[&str],
) -> megatron_training::TrainSummary {
    let mut v = vec![
        "--use-checkpoint-args",
        "--load",
        save,
        "--finetune",
        "--lr",
        "0",
        "--train-iters",
        "2",
        "--seq-length",
        "16",
        "--vocab-size",
        vocab,
        "--global-batch-size",
        "4",
    ];
    v.extend_from_slice(layout);
    megatron_training::pretrain(&super::args(&v)).unwrap()
}

/// A checkpoint Megatron-LM saved (`tests/fixtures/megatron`, `bench/make_megatron_*_fixtures.py`).
pub fn megatron_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron")
        .join(name)
}

/// Converts Megatron-LM fixture `name` with `convert` and checks its logits against the
/// fixture's megatron-core reference (within 1e-5); returns the converted checkpoint's
/// directory's parent, for the caller to remove.
pub fn megatron_fixture_gives_reference_logits(
    name: &str,
    convert: impl Fn(&Path, &Path) -> Result<PathBuf, megatron_training::TrainError>,
) {
    let dir = tmpdir(&format!("megatron-fixture-{name}"));
    let save = dir.join("converted");
    convert(&megatron_fixture(name), &save).unwrap();
    let diff = max_logit_difference(
        &save,
        &megatron_fixture(name).join("reference.safetensors"),
        "logits",
    );
    eprintln!("{name}: max |logit difference| against megatron-core {diff:e}");
    assert!(diff <= 1e-5, "{name}: logits differ by {diff}");
    let _ = std::fs::remove_dir_all(dir);
}
