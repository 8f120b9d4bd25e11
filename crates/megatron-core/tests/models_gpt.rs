mod common;

use common::*;
use megatron_core::transformer::step::StepContext;
use megatron_core::{Batch, GPTModel, Grads, TransformerConfig};

fn tiny(untie: bool, dropout: f32) -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: dropout,
        attention_dropout: dropout,
        init_method_std: 0.2,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: untie,
        ..Default::default()
    }
}

#[test]
fn gpt_whole_model_gradient_matches_finite_difference() {
    gradient_check(tiny(false, 0.0));
}

#[test]
fn gpt_untied_output_layer_gradient_matches_finite_difference() {
    gradient_check(tiny(true, 0.0));
}

#[test]
fn gpt_parameters_carry_megatron_names_and_decay_flags() {
    let (_, params) = GPTModel::new(tiny(false, 0.0), 1);
    let names: Vec<&str> = params.metas.iter().map(|m| m.name.as_str()).collect();
    for want in [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.1.mlp.linear_fc2.bias",
        "decoder.final_layernorm.weight",
    ] {
        assert!(names.contains(&want), "missing {want}");
    }
    assert!(
        !names.contains(&"output_layer.weight"),
        "tied model has no output layer"
    );
    for m in &params.metas {
        let is_vector = m.shape.len() == 1;
        assert_eq!(
            m.weight_decay, !is_vector,
            "{}: decay only on matrices",
            m.name
        );
    }
    let qkv = params
        .find("decoder.layers.0.self_attention.linear_qkv.weight")
        .unwrap();
    assert_eq!(params.metas[qkv.0].shape, vec![48, 16]);
}

#[test]
fn gpt_init_scales_output_projections() {
    let mut cfg = tiny(false, 0.0);
    cfg.hidden_size = 64;
    cfg.ffn_hidden_size = 256;
    cfg.init_method_std = 0.02;
    let (_, params) = GPTModel::new(cfg, 3);
    let std_of = |name: &str| {
        let x = params.get(params.find(name).unwrap());
        (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
    };
    let qkv = std_of("decoder.layers.0.self_attention.linear_qkv.weight");
    let proj = std_of("decoder.layers.0.self_attention.linear_proj.weight");
    assert!((qkv - 0.02).abs() < 0.001, "qkv std {qkv}");
    assert!(
        (proj - 0.01).abs() < 0.001,
        "proj std {proj} (0.02 / sqrt(2 * 2 layers))"
    );
    assert!(params
        .get(params.find("decoder.layers.0.mlp.linear_fc1.bias").unwrap())
        .iter()
        .all(|v| *v == 0.0));
    assert!(params
        .get(
            params
                .find("decoder.layers.0.input_layernorm.weight")
                .unwrap()
        )
        .iter()
        .all(|v| *v == 1.0));
}

#[test]
fn gpt_dropout_changes_loss_in_training_but_not_in_eval() {
    let (model, params) = GPTModel::new(tiny(false, 0.3), 7);
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
    let mut g = Grads::zeros_like(&params);
    let a = model
        .forward_backward_serial(&params, &mut g, &batch, 1.0, &StepContext::train(1, 1, 0))
        .loss;
    let a2 = model
        .forward_backward_serial(&params, &mut g, &batch, 1.0, &StepContext::train(1, 1, 0))
        .loss;
    let c = model
        .forward_backward_serial(&params, &mut g, &batch, 1.0, &StepContext::train(1, 2, 0))
        .loss;
    assert_eq!(a, a2, "same key, same masks");
    assert_ne!(a, c, "another iteration draws other masks");
    assert_eq!(
        model.forward_loss_serial(&params, &batch),
        model.forward_loss_serial(&params, &batch)
    );
}

#[test]
fn kv_cache_decoding_reproduces_full_sequence_loss() {
    assert_decoding_reproduces_full_sequence_loss(tiny(false, 0.0));
}

#[test]
fn reset_position_ids_and_attention_mask_isolate_documents() {
    // Sequence 1 = [doc A (5 tokens incl. its end-of-document 63), doc B (11 tokens)];
    // sequence 2 = [doc B, 5 filler tokens]. With positions and attention reset at the
    // end-of-document token, B's losses are the same in both.
    let mut cfg = tiny(false, 0.0);
    cfg.seq_length = 16;
    cfg.max_position_embeddings = 16;
    let (model, params) = GPTModel::new(cfg, 5);
    let t = 16;
    let doc_a = [7u32, 8, 9, 10, 63];
    let doc_b: Vec<u32> = (0..12).map(|i| (i * 5 + 3) % 60).collect();
    let mut s1: Vec<u32> = doc_a.to_vec();
    s1.extend(&doc_b[..]);
    let (tok1, lab1) = (s1[..t].to_vec(), s1[1..=t].to_vec());
    let mut s2: Vec<u32> = doc_b.clone();
    s2.extend([1u32, 2, 3, 4, 5]);
    let (tok2, lab2) = (s2[..t].to_vec(), s2[1..=t].to_vec());
    let mut pos1 = vec![0u32; t];
    let mut start1 = vec![0u32; t];
    for q in 0..t {
        if q >= 5 {
            pos1[q] = (q - 5) as u32;
            start1[q] = 5;
        } else {
            pos1[q] = q as u32;
        }
    }
    // Losses on B's 11 labels only.
    let mask1: Vec<f32> = (0..t).map(|q| if q >= 5 { 1.0 } else { 0.0 }).collect();
    let mask2: Vec<f32> = (0..t).map(|q| if q < 11 { 1.0 } else { 0.0 }).collect();
    let l1 = model.forward_loss_serial(
        &params,
        &Batch {
            tokens: &tok1,
            labels: &lab1,
            loss_mask: &mask1,
            b: 1,
            t,
            position_ids: Some(&pos1),
            doc_start: Some(&start1),
        },
    );
    let l2 = model.forward_loss_serial(
        &params,
        &Batch {
            tokens: &tok2,
            labels: &lab2,
            loss_mask: &mask2,
            b: 1,
            t,
            position_ids: None,
            doc_start: None,
        },
    );
    assert!(
        (l1 - l2).abs() < 1e-5,
        "document B alone {l2} vs after A with resets {l1}"
    );
    let l_no_reset = model.forward_loss_serial(
        &params,
        &Batch {
            tokens: &tok1,
            labels: &lab1,
            loss_mask: &mask1,
            b: 1,
            t,
            position_ids: None,
            doc_start: None,
        },
    );
    assert!(
        (l_no_reset - l2).abs() > 1e-4,
        "without resets, document A leaks into B"
    );
}

/// The encoder's attention (`AttnMaskType::Padding`: every token sees its whole sequence)
/// through the same layers: gradients hold, and an early position's loss depends on a later
/// token, which under the causal mask it never does.
mod bidirectional {
    use super::*;
    use megatron_core::transformer::config::AttnMaskType;

    fn encoder() -> TransformerConfig {
        TransformerConfig {
            attn_mask_type: AttnMaskType::Padding,
            ..tiny(false, 0.0)
        }
    }

    #[test]
    fn bidirectional_attention_whole_model_gradient_matches_finite_difference() {
        gradient_check(encoder());
    }

    /// Loss at position 0 alone, with the last token `last`.
    fn first_position_loss(cfg: TransformerConfig, last: u32) -> f32 {
        let (model, params) = GPTModel::new(cfg, 3);
        let (b, t) = (1, 8);
        let (mut tokens, labels, _) = data(b, t);
        tokens[t - 1] = last;
        let mut mask = vec![0.0f32; t];
        mask[0] = 1.0;
        model.forward_loss_serial(
            &params,
            &Batch {
                tokens: &tokens,
                labels: &labels,
                loss_mask: &mask,
                b,
                t,
                position_ids: None,
                doc_start: None,
            },
        )
    }

    #[test]
    fn an_early_position_sees_a_later_token_only_without_the_causal_mask() {
        let causal = tiny(false, 0.0);
        assert_eq!(
            first_position_loss(causal.clone(), 1).to_bits(),
            first_position_loss(causal, 50).to_bits()
        );
        let (a, b) = (
            first_position_loss(encoder(), 1),
            first_position_loss(encoder(), 50),
        );
        assert!((a - b).abs() > 1e-4, "{a} vs {b}");
    }
}
