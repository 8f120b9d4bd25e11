//! BERT conversion against transformers (`bench/make_hf_bert_fixtures.py`; tiny random models
//! committed with their outputs): a converted `BertForPreTraining` gives transformers' last
//! hidden state and its pre-training loss (masked-LM + next-sentence), a converted `BertModel`
//! its hidden state; converted back, both give the original file byte for byte.

mod common;

use common::{safetensor_f32 as floats, safetensor_i64 as ints, tmpdir};
use megatron_core::models::bert::BertBatch;
use megatron_core::models::{ChunkState, ModelChunk};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_training::convert::{hf_to_megatron, megatron_to_hf};
use megatron_training::load::load_bert;
use safetensors::SafeTensors;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Converts fixture `name`, checks the hidden states (and the loss, if the reference has one),
/// converts back and compares the files. Returns the converted checkpoint's loss, if any.
fn check(name: &str) -> Option<f32> {
    let dir = tmpdir(&format!("convert-{name}"));
    let save = dir.join("megatron");
    hf_to_megatron(&fixture(name), &save, 128).unwrap();
    let refb = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let r = SafeTensors::deserialize(&refb).unwrap();
    let ids = ints(&r, "input_ids");
    let types = ints(&r, "token_type_ids");
    let mask = ints(&r, "attention_mask");
    let shape = r.tensor("input_ids").unwrap().shape().to_vec();
    let (b, t) = (shape[0], shape[1]);
    let tokens: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
    let tokentypes: Vec<u32> = types.iter().map(|&x| x as u32).collect();
    let key_lens: Vec<usize> = mask
        .chunks(t)
        .map(|m| m.iter().filter(|&&x| x == 1).count())
        .collect();
    let (model, params, _) = load_bert(&save).unwrap();
    let (mut rows, mut labels, mut order) = (Vec::new(), Vec::new(), Vec::new());
    if r.names().contains(&"labels") {
        for (i, &l) in ints(&r, "labels").iter().enumerate() {
            if l >= 0 {
                rows.push(i as u32);
                labels.push(l as u32);
            }
        }
        order = ints(&r, "next_sentence_label")
            .iter()
            .map(|&x| x as u32)
            .collect();
    }
    let batch = BertBatch {
        tokens: &tokens,
        tokentypes: &tokentypes,
        key_lens: &key_lens,
        masked_rows: &rows,
        masked_labels: &labels,
        sentence_order: &order,
        b,
        t,
    };
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    let y = model.encode(&params, &mut tp, &batch).unwrap();
    let want = floats(&r, "last_hidden_state");
    // Padding positions' outputs are transformers' too (their queries see the real tokens).
    let d = max_diff(y.data(), &want);
    eprintln!("{name}: max |hidden state difference| {d:e}");
    assert!(d <= 1e-4, "{name}: hidden states differ by {d}");
    let loss = r.names().contains(&"loss").then(|| {
        let (_, state) = model
            .forward_step(
                &params,
                None,
                &mut tp,
                None,
                &batch,
                1.0,
                &StepContext::eval(),
            )
            .unwrap();
        let got = state.loss().unwrap().0;
        let want = floats(&r, "loss")[0];
        eprintln!("{name}: loss {got} vs transformers {want}");
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "{name}: loss {got} vs {want}"
        );
        got
    });
    let back = dir.join("hf");
    megatron_to_hf(&save, &back).unwrap();
    let a = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
    let c = std::fs::read(back.join("model.safetensors")).unwrap();
    assert!(
        a == c,
        "{name}: the exported model.safetensors differs from the original"
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(back.join("config.json")).unwrap()).unwrap();
    let orig: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
            .unwrap();
    for key in [
        "architectures",
        "hidden_act",
        "vocab_size",
        "type_vocab_size",
        "layer_norm_eps",
    ] {
        assert_eq!(cfg[key], orig[key], "{name}: config.json {key}");
    }
    let _ = std::fs::remove_dir_all(dir);
    loss
}

#[test]
fn bert_for_pretraining_converts_to_transformers_outputs_and_loss_and_back_byte_for_byte() {
    assert!(check("bert_pretraining").is_some());
}

#[test]
fn bert_model_with_pooler_converts_to_transformers_hidden_states_and_back_byte_for_byte() {
    assert!(check("bert_model").is_none());
}
