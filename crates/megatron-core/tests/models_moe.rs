//! A tiny mixture-of-experts decoder (dropless top-k routing, experts = the model's MLP).

mod common;

use common::*;
use megatron_core::transformer::config::{Activation, LayerPattern, MoEConfig, RouterScore};
use megatron_core::{GPTModel, TransformerConfig};

fn tiny_moe(score: RouterScore, pre_softmax: bool, activation: Activation) -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 2,
        ffn_hidden_size: 24,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.2,
        activation,
        moe: Some(MoEConfig {
            score,
            pre_softmax,
            ..MoEConfig::new(4, 12, 2)
        }),
        ..Default::default()
    }
}

#[test]
fn moe_model_gradient_matches_finite_difference_for_each_router() {
    // Every expert selected (top-4 of 4): the loss is smooth in every parameter, so central
    // differences see the whole path (router, probabilities, experts, input gradient); the
    // top-k selection itself is checked in the router kernel's tests.
    for (score, pre, act) in [
        (RouterScore::Softmax, false, Activation::Gelu),
        (RouterScore::Softmax, true, Activation::SwiGLU),
        (RouterScore::Sigmoid, false, Activation::SwiGLU),
    ] {
        let mut cfg = tiny_moe(score, pre, act);
        cfg.moe.as_mut().unwrap().topk = 4;
        gradient_check(cfg);
    }
}

#[test]
fn moe_with_shared_experts_and_their_gate_matches_finite_difference() {
    for gate in [false, true] {
        let mut cfg = tiny_moe(RouterScore::Softmax, false, Activation::SwiGLU);
        let m = cfg.moe.as_mut().unwrap();
        m.topk = 4;
        m.shared_expert_ffn = Some(20);
        m.shared_expert_gate = gate;
        gradient_check(cfg);
    }
}

#[test]
fn moe_with_dropped_rows_matches_finite_difference() {
    // Position dropping (every expert keeps its earliest rows) does not depend on the values,
    // so the loss stays smooth: dropped rows simply contribute nothing, to the output and to
    // the gradients of the router and the experts.
    let mut cfg = tiny_moe(RouterScore::Sigmoid, false, Activation::Gelu);
    let m = cfg.moe.as_mut().unwrap();
    m.topk = 4;
    m.capacity_factor = Some(0.5);
    m.drop_policy = megatron_core::transformer::config::DropPolicy::Position;
    gradient_check(cfg);
}

#[test]
fn the_grouped_expert_gemm_gives_the_bits_of_the_sequential_one() {
    use megatron_core::transformer::step::StepContext;
    use megatron_core::{Batch, Grads};
    megatron_tensor::threads::set_gemm_threads(2);
    let run = |grouped: bool| {
        let mut cfg = tiny_moe(RouterScore::Softmax, false, Activation::SwiGLU);
        cfg.moe.as_mut().unwrap().grouped_gemm = grouped;
        let (model, params) = GPTModel::new(cfg, 42);
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
        let r =
            model.forward_backward_serial(&params, &mut grads, &batch, 1.0, &StepContext::eval());
        (r.loss, grads.data)
    };
    let (l0, g0) = run(false);
    let (l1, g1) = run(true);
    assert_eq!(l0.to_bits(), l1.to_bits());
    assert!(g0.iter().zip(&g1).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn moe_layers_follow_the_layer_frequency_with_megatron_names() {
    let mut cfg = tiny_moe(RouterScore::Softmax, false, Activation::Gelu);
    cfg.num_layers = 4;
    cfg.moe.as_mut().unwrap().layers = LayerPattern::Every(2);
    // A list picks layers one by one: DeepSeek's dense first layer, then experts but on 2.
    let mut listed = cfg.clone();
    listed.moe.as_mut().unwrap().layers = LayerPattern::List(vec![false, true, false, true]);
    listed.validate().unwrap();
    let (_, params) = GPTModel::new(cfg.clone(), 1);
    let (_, params_listed) = GPTModel::new(listed.clone(), 1);
    for l in 0..4 {
        let router = params.find(&format!("decoder.layers.{l}.mlp.router.weight"));
        let dense = params.find(&format!("decoder.layers.{l}.mlp.linear_fc1.weight"));
        assert_eq!(router.is_some(), l % 2 == 0, "layer {l}");
        assert_eq!(dense.is_some(), l % 2 == 1, "layer {l}");
        let router = params_listed.find(&format!("decoder.layers.{l}.mlp.router.weight"));
        let dense = params_listed.find(&format!("decoder.layers.{l}.mlp.linear_fc1.weight"));
        assert_eq!(router.is_some(), l % 2 == 1, "listed layer {l}");
        assert_eq!(dense.is_some(), l % 2 == 0, "listed layer {l}");
    }
    listed.moe.as_mut().unwrap().layers = LayerPattern::List(vec![true; 3]);
    let e = listed.validate().unwrap_err().to_string();
    assert!(
        e.contains("--moe-layer-freq has 3 entries for 4 layers"),
        "{e}"
    );
    // A checkpoint written before the list form holds `"layer_freq": 2`.
    let mut old = serde_json::to_value(cfg.moe.as_ref().unwrap()).unwrap();
    let obj = old.as_object_mut().unwrap();
    obj.remove("layers");
    obj.insert("layer_freq".into(), 2.into());
    let read: MoEConfig = serde_json::from_value(old).unwrap();
    assert_eq!(read.layers, LayerPattern::Every(2));
    let e3 = params
        .find("decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight")
        .unwrap();
    assert_eq!(params.metas[e3.0].shape, [16, 12]);
    let mut cfg = tiny_moe(RouterScore::Softmax, false, Activation::SwiGLU);
    cfg.moe.as_mut().unwrap().shared_expert_ffn = Some(20);
    cfg.moe.as_mut().unwrap().shared_expert_gate = true;
    let (_, params) = GPTModel::new(cfg, 1);
    for (name, shape) in [
        (
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
            vec![40, 16],
        ),
        (
            "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
            vec![16, 20],
        ),
        (
            "decoder.layers.0.mlp.shared_experts.gate_weight",
            vec![1, 16],
        ),
    ] {
        let id = params.find(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(params.metas[id.0].shape, shape, "{name}");
    }
}

#[test]
fn moe_kv_cache_decoding_reproduces_full_sequence_loss() {
    assert_decoding_reproduces_full_sequence_loss(tiny_moe(
        RouterScore::Softmax,
        false,
        Activation::SwiGLU,
    ));
}
