//! Whole-model checks shared by the model test files.
#![allow(dead_code)]

pub mod muon_fixture;

use megatron_core::inference::{decode_step, KVCache};
use megatron_core::transformer::step::StepContext;
use megatron_core::{Batch, GPTModel, Grads, TransformerConfig};

/// A tiny tied GPT (2 layers, hidden 16, 2 heads) for the optimizer and gradient-buffer tests:
/// every kind of parameter, cheap enough for many ranks and steps.
pub fn tiny_gpt() -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: false,
        ..Default::default()
    }
}

pub fn data(b: usize, t: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 37 + 11) % 64) as u32).collect();
    let labels: Vec<u32> = (0..b * t).map(|i| ((i * 53 + 5) % 64) as u32).collect();
    let mask: Vec<f32> = (0..b * t)
        .map(|i| if i % 5 == 4 { 0.0 } else { 1.0 })
        .collect();
    (tokens, labels, mask)
}

/// Central differences of the loss against the analytic gradient at three coordinates of every
/// parameter tensor of a whole model (no dropout).
pub fn gradient_check(cfg: TransformerConfig) {
    gradient_check_with_step(cfg, 1e-2);
}

/// [`gradient_check`] with central differences of step `eps`: smaller for a model with kinks
/// (a clamp), so that a step rarely crosses one.
pub fn gradient_check_with_step(cfg: TransformerConfig, eps: f32) {
    let (model, mut params) = GPTModel::new(cfg, 42);
    let (b, t) = (2, 8);
    let (tokens, labels, mask) = data(b, t);
    let batch = Batch {
        tokens: &tokens,
        labels: &labels,
        loss_mask: &mask,
        b,
        t,
        position_ids: None,
        doc_start: None,
    };
    let mut grads = Grads::zeros_like(&params);
    let r = model.forward_backward_serial(&params, &mut grads, &batch, 1.0, &StepContext::eval());
    let l0 = model.forward_loss_serial(&params, &batch);
    assert!(
        (r.loss - l0).abs() < 1e-5,
        "forward_backward loss {} vs forward_loss {}",
        r.loss,
        l0
    );
    assert_gradient_matches_with_step(&mut params, &grads, eps, |p| {
        model.forward_loss_serial(p, &batch) as f64
    });
}

/// Central differences of `objective` at three coordinates of every parameter tensor against
/// the analytic gradient `grads`.
pub fn assert_gradient_matches(
    params: &mut megatron_core::Params,
    grads: &Grads,
    objective: impl Fn(&megatron_core::Params) -> f64,
) {
    assert_gradient_matches_with_step(params, grads, 1e-2, objective)
}

/// [`assert_gradient_matches`] with central differences of step `eps`.
pub fn assert_gradient_matches_with_step(
    params: &mut megatron_core::Params,
    grads: &Grads,
    eps: f32,
    objective: impl Fn(&megatron_core::Params) -> f64,
) {
    let mut checked = 0;
    let mut max_rel = 0.0f64;
    for meta in params.metas.clone() {
        // Three coordinates per parameter tensor, spread over it.
        for k in 0..3 {
            let i = meta.offset + (meta.numel * (2 * k + 1)) / 6;
            let orig = params.data[i];
            params.data[i] = orig + eps;
            let fp = objective(params);
            params.data[i] = orig - eps;
            let fm = objective(params);
            params.data[i] = orig;
            let fd = (fp - fm) / (2.0 * eps as f64);
            let an = grads.data[i] as f64;
            // Tolerance: f32 forward noise (~1e-6 of the loss) over 2*eps, plus 5% relative.
            assert!(
                (fd - an).abs() <= 1e-3 + 5e-2 * an.abs(),
                "{}[{}]: finite difference {fd} vs analytic {an}",
                meta.name,
                i - meta.offset
            );
            if an.abs() > 1e-2 {
                max_rel = max_rel.max((fd - an).abs() / an.abs());
            }
            checked += 1;
        }
    }
    assert!(
        checked == 3 * params.metas.len() && checked >= 3 * 8,
        "{checked} coordinates"
    );
    assert!(max_rel < 5e-2, "max relative error {max_rel}");
}

/// Decoding token by token through the KV cache gives the loss of the full-sequence forward.
pub fn assert_decoding_reproduces_full_sequence_loss(cfg: TransformerConfig) {
    let (model, params) = GPTModel::new(cfg, 9);
    let (b, t) = (2, 8);
    let (tokens, labels, _) = data(b, t);
    let mask = vec![1.0f32; b * t];
    let batch = Batch {
        tokens: &tokens,
        labels: &labels,
        loss_mask: &mask,
        b,
        t,
        position_ids: None,
        doc_start: None,
    };
    let full = model.forward_loss_serial(&params, &batch) as f64;
    let mut cache = KVCache::new(&model, b, t);
    let mut total = 0.0f64;
    for pos in 0..t {
        let step_tokens: Vec<u32> = (0..b).map(|bi| tokens[bi * t + pos]).collect();
        let logits = decode_step(&model, &params, &mut cache, &step_tokens);
        let v = model.config.padded_vocab_size;
        for bi in 0..b {
            let row = &logits.data()[bi * v..(bi + 1) * v];
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|z| (*z as f64 - mx).exp()).sum::<f64>().ln();
            total += lse - row[labels[bi * t + pos] as usize] as f64;
        }
    }
    let decoded = total / (b * t) as f64;
    assert!(
        (decoded - full).abs() < 1e-4,
        "decode {decoded} vs full {full}"
    );
}
