//! Multi-token prediction (`--mtp-num-layers`, megatron-core's `MultiTokenPredictionBlock`):
//! the gradient of the whole objective (the decoder's loss plus the depths' weighted mean loss)
//! against finite differences, the depths' shifted inputs, names and shapes.

mod common;

use common::{assert_gradient_matches, data};
use megatron_core::transformer::config::{
    Activation, MLAConfig, MTPConfig, Normalization, PositionEmbeddingType, RotaryConfig,
};
use megatron_core::transformer::multi_token_prediction::ShiftedBatch;
use megatron_core::transformer::step::{LossReduction, StepContext};
use megatron_core::{Batch, GPTModel, Grads, Params, TransformerConfig};

fn tiny_gpt(depths: usize) -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 4,
        ffn_hidden_size: 32,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.2,
        mtp: Some(MTPConfig {
            num_layers: depths,
            loss_scaling_factor: 0.3,
        }),
        ..Default::default()
    }
}

/// The training objective of one micro-batch (what the gradient is the gradient of), and the
/// gradient: the decoder's mean loss plus the weight times the depths' mean losses; or, with
/// per-token losses, the decoder's summed loss plus the weight times each depth's mean loss
/// times the decoder's token count (megatron-core's `original_num_tokens / num_tokens`).
fn objective_with(
    model: &GPTModel,
    params: &Params,
    batch: &Batch,
    reduction: LossReduction,
) -> (f64, Grads) {
    let mut grads = Grads::zeros_like(params);
    let ctx = StepContext::eval().with_loss_reduction(reduction);
    let r = model.forward_backward_serial(params, &mut grads, batch, 1.0, &ctx);
    let mtp = model.mtp.as_ref().expect("an MTP model");
    let losses = mtp.take_losses();
    assert_eq!(losses.len(), mtp.layers.len());
    let extra: f64 = losses.iter().map(|(l, n)| l / n).sum::<f64>();
    let w = mtp.depth_weight() as f64;
    match reduction {
        LossReduction::MicroBatchMean => (r.loss as f64 + w * extra, grads),
        LossReduction::TokenSum => {
            let n = r.tokens as f64;
            (r.loss as f64 * n + w * extra * n, grads)
        }
    }
}

fn objective(model: &GPTModel, params: &Params, batch: &Batch) -> (f64, Grads) {
    objective_with(model, params, batch, LossReduction::MicroBatchMean)
}

fn mtp_gradient_check(cfg: TransformerConfig) {
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
    let (_, grads) = objective(&model, &params, &batch);
    assert!(params
        .metas
        .iter()
        .any(|m| m.name.starts_with("mtp.layers.")));
    assert_gradient_matches(&mut params, &grads, |p| objective(&model, p, &batch).0);
}

#[test]
fn mtp_objective_gradient_matches_finite_difference_with_learned_positions() {
    // Two depths on GPT-2's shape: shifted tokens and positions, tied output layer.
    mtp_gradient_check(tiny_gpt(2));
}

#[test]
fn mtp_per_token_objective_gradient_matches_finite_difference() {
    let (model, mut params) = GPTModel::new(tiny_gpt(2), 42);
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
    let sum = LossReduction::TokenSum;
    let (_, grads) = objective_with(&model, &params, &batch, sum);
    assert_gradient_matches(&mut params, &grads, |p| {
        objective_with(&model, p, &batch, sum).0
    });
}

#[test]
fn mtp_objective_gradient_matches_finite_difference_on_an_mla_llama() {
    mtp_gradient_check(TransformerConfig {
        normalization: Normalization::RMSNorm,
        activation: Activation::SwiGLU,
        position_embedding_type: PositionEmbeddingType::Rope,
        rotary: RotaryConfig {
            base: 100.0,
            ..Default::default()
        },
        add_bias_linear: false,
        add_qkv_bias: false,
        untie_embeddings_and_output_weights: true,
        qk_layernorm: true,
        mla: Some(MLAConfig {
            q_lora_rank: Some(8),
            kv_lora_rank: 6,
            qk_head_dim: 4,
            qk_pos_emb_head_dim: 2,
            v_head_dim: 3,
        }),
        ..tiny_gpt(1)
    });
}

#[test]
fn each_depth_shifts_tokens_positions_labels_and_mask_one_place_per_sequence() {
    let first = ShiftedBatch::first(&[1, 2, 3, 4, 5, 6], None, &[2, 3, 4, 5, 6, 7], &[1.0; 6], 3);
    let d1 = first.shifted(3);
    assert_eq!(d1.tokens, [2, 3, 0, 5, 6, 0]);
    assert_eq!(d1.positions, [1, 2, 0, 1, 2, 0]);
    assert_eq!(d1.labels, [3, 4, 0, 6, 7, 0]);
    assert_eq!(d1.loss_mask, [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]);
    let d2 = d1.shifted(3);
    assert_eq!(d2.labels, [4, 0, 0, 7, 0, 0]);
    assert_eq!(d2.loss_mask, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
}

#[test]
fn mtp_parameters_have_megatron_names_and_follow_the_last_layer() {
    let (_, params) = GPTModel::new(tiny_gpt(2), 1);
    for n in [
        "mtp.layers.1.enorm.weight",
        "mtp.layers.1.hnorm.weight",
        "mtp.layers.1.final_layernorm.weight",
        "mtp.layers.1.mtp_model_layer.self_attention.linear_qkv.weight",
        "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight",
    ] {
        assert!(params.find(n).is_some(), "{n}");
    }
    let eh = &params.metas[params.find("mtp.layers.0.eh_proj.weight").unwrap().0];
    assert_eq!((eh.shape.clone(), eh.tp_split_dim), (vec![16, 32], Some(0)));
    // An MoE last layer makes the depths' layers MoE layers too.
    let mut cfg = tiny_gpt(1);
    cfg.moe = Some(megatron_core::transformer::config::MoEConfig {
        layers: megatron_core::transformer::config::LayerPattern::List(vec![false, true]),
        ..megatron_core::transformer::config::MoEConfig::new(2, 8, 1)
    });
    let (_, params) = GPTModel::new(cfg, 1);
    assert!(params
        .find("mtp.layers.0.mtp_model_layer.mlp.router.weight")
        .is_some());
}
