use megatron_core::transformer::config::{Activation, TransformerConfig};
use megatron_training::flops::num_floating_point_operations;

fn gpt2_small() -> TransformerConfig {
    TransformerConfig {
        num_layers: 12,
        hidden_size: 768,
        num_attention_heads: 12,
        ffn_hidden_size: 3072,
        seq_length: 1024,
        max_position_embeddings: 1024,
        padded_vocab_size: 50304,
        ..Default::default()
    }
}

#[test]
fn gpt_flops_reduce_to_megatrons_closed_form() {
    // MHA, ffn 4h, GELU: 72 B s L h² (1 + s/(12h) + V/(12 L h)).
    let c = gpt2_small();
    let (b, s, l, h, v) = (8.0, 1024.0, 12.0, 768.0, 50304.0);
    let want = 72.0 * b * s * l * h * h * (1.0 + s / (12.0 * h) + v / (12.0 * l * h));
    let got = num_floating_point_operations(&c, 8);
    assert!((got - want).abs() / want < 1e-12, "{got} vs {want}");
}

#[test]
fn llama_flops_count_query_groups_and_the_third_swiglu_matrix() {
    // SmolLM2-135M's shape: h 576, 9 heads of 64, 3 query groups, ffn 1536, vocab 49152, L 30.
    let c = TransformerConfig {
        num_layers: 30,
        hidden_size: 576,
        num_attention_heads: 9,
        num_query_groups: Some(3),
        ffn_hidden_size: 1536,
        seq_length: 512,
        max_position_embeddings: 512,
        padded_vocab_size: 49152,
        activation: Activation::SwiGLU,
        ..Default::default()
    };
    let (b, s) = (4.0, 512.0);
    let tokens = b * s;
    // Per token and layer: QKV 576 x (576 + 2*192), output 576 x 576, MLP 3 x 576 x 1536;
    // times 6 (fwd + 2 bwd, 2 FLOPs per FMA). Attention: 6 * q * s per token and layer
    // (causal half of 2 matmuls x 2 FLOPs x 3 passes). Logits 6 * h * V per token.
    let per_layer = 576.0 * 960.0 + 576.0 * 576.0 + 3.0 * 576.0 * 1536.0;
    let want =
        tokens * (6.0 * per_layer * 30.0 + 6.0 * 576.0 * 49152.0) + b * s * s * 6.0 * 576.0 * 30.0;
    let got = num_floating_point_operations(&c, 4);
    assert!((got - want).abs() / want < 1e-12, "{got} vs {want}");
}

#[test]
fn moe_flops_count_the_active_experts_only() {
    use megatron_core::transformer::config::{LayerPattern, MoEConfig};
    // Every other layer MoE with 8 experts of width 512, top-2: those layers' MLP term is
    // 2 x 512 wide, the dense ones 3072.
    let mut c = gpt2_small();
    c.moe = Some(MoEConfig {
        layers: LayerPattern::Every(2),
        ..MoEConfig::new(8, 512, 2)
    });
    let dense = num_floating_point_operations(&gpt2_small(), 8);
    let got = num_floating_point_operations(&c, 8);
    let tokens = 8.0 * 1024.0;
    let want = dense - tokens * 6.0 * 768.0 * 2.0 * 6.0 * (3072.0 - 1024.0);
    assert!((got - want).abs() / want < 1e-12, "{got} vs {want}");
    // A shared expert of width 256 is always active.
    c.moe.as_mut().unwrap().shared_expert_ffn = Some(256);
    let shared = num_floating_point_operations(&c, 8);
    let want = want + tokens * 6.0 * 768.0 * 2.0 * 6.0 * 256.0;
    assert!((shared - want).abs() / want < 1e-12, "{shared} vs {want}");
}

#[test]
fn bert_flops_count_bidirectional_scores_and_the_lm_head_dense() {
    // BERT-base: MHA, ffn 4h, GELU, bidirectional: 72 B s L h² (1 + s/(6h) + V/(12 L h) +
    // 1/(12 L)), the last term the MLM head's h x h dense.
    let c = TransformerConfig {
        seq_length: 512,
        padded_vocab_size: 30592,
        ..gpt2_small()
    };
    let (b, s, l, h, v) = (8.0, 512.0, 12.0, 768.0, 30592.0);
    let want =
        72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h) + 1.0 / (12.0 * l));
    let got = megatron_training::flops::bert_floating_point_operations(&c, 8);
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
}

#[test]
fn t5_flops_count_both_stacks_and_the_cross_attention() {
    // T5-base shape with te = td = s: per token an encoder layer costs 72 h² + 12 s h
    // (bidirectional scores), a decoder layer 96 h² + 18 s h (self-attention 24 h² + 6 s h
    // causal, cross-attention 24 h² + 12 s h, MLP 48 h²); logits 6 h V per decoder token.
    let c = TransformerConfig {
        padded_vocab_size: 32128,
        ..gpt2_small()
    };
    let (b, s, l, h, v) = (4.0, 512.0, 12.0, 768.0, 32128.0);
    let want = b * s * l * (168.0 * h * h + 30.0 * s * h) + 6.0 * b * s * h * v;
    let got = megatron_training::flops::t5_floating_point_operations(&c, (12, 12), (512, 512), 4);
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    // A shorter decoder costs less than the encoder-length one.
    let short = megatron_training::flops::t5_floating_point_operations(&c, (12, 12), (512, 114), 4);
    assert!(short < got);
}

#[test]
fn mla_flops_count_the_attention_weights_the_model_holds() {
    // Megatron's MLA terms: every attention weight once per token (6 FLOPs per parameter over
    // forward and backward) plus its `+ 1` per latent for the norms; scores over qk + pe
    // features and values of v, causal halves.
    use megatron_core::transformer::config::{MLAConfig, PositionEmbeddingType};
    let (h, a, qk, pe, v, q_lora, kv_lora) = (64, 4, 16, 8, 12, 24, 16);
    let c = TransformerConfig {
        num_layers: 2,
        hidden_size: h,
        num_attention_heads: a,
        ffn_hidden_size: 96,
        seq_length: 32,
        max_position_embeddings: 32,
        padded_vocab_size: 256,
        activation: Activation::SwiGLU,
        position_embedding_type: PositionEmbeddingType::Rope,
        add_bias_linear: false,
        add_qkv_bias: false,
        mla: Some(MLAConfig {
            q_lora_rank: Some(q_lora),
            kv_lora_rank: kv_lora,
            qk_head_dim: qk,
            qk_pos_emb_head_dim: pe,
            v_head_dim: v,
        }),
        ..Default::default()
    };
    let (_, params) = megatron_core::GPTModel::new(c.clone(), 1);
    let attn_weights: usize = params
        .metas
        .iter()
        .filter(|m| m.name.contains("self_attention") && m.name.ends_with("proj.weight"))
        .map(|m| m.numel)
        .sum();
    // The rotary key's columns of the key/value down projection are in it.
    assert_eq!(
        attn_weights,
        2 * (h * q_lora
            + q_lora * a * (qk + pe)
            + h * (kv_lora + pe)
            + kv_lora * a * (qk + v)
            + a * v * h)
    );
    let (b, s) = (3.0, 32.0);
    let tokens = b * s;
    let mlp = 3.0 * 64.0 * 96.0 * 2.0;
    let linear = attn_weights as f64 + 2.0 * (q_lora + kv_lora) as f64;
    // Per token, layer and key: Q·K over qk + pe and P·V over v, 2 FLOPs per FMA, 3 passes,
    // half the keys (causal).
    let core = (a * (qk + pe) + a * v) as f64 * 2.0 * 3.0 / 2.0;
    let want = tokens * 6.0 * (mlp + linear + 64.0 * 256.0) + b * s * s * core * 2.0;
    let got = num_floating_point_operations(&c, 3);
    assert!((got - want).abs() / want < 1e-12, "{got} vs {want}");
}

#[test]
fn mtp_flops_add_a_layer_its_projections_and_an_output_layer_per_depth() {
    // Megatron counts each depth as a layer like the last, plus its norms (3h) and eh_proj
    // (2h²), plus one more output layer.
    use megatron_core::transformer::config::MTPConfig;
    let base = gpt2_small();
    let with = TransformerConfig {
        mtp: Some(MTPConfig {
            num_layers: 2,
            loss_scaling_factor: 0.1,
        }),
        ..gpt2_small()
    };
    let (b, s, h, v) = (8.0, 1024.0, 768.0, 50304.0);
    let per_depth = 72.0 * h * h + 6.0 * s * h + 6.0 * (3.0 * h + 2.0 * h * h) + 6.0 * h * v;
    let want = 2.0 * b * s * per_depth;
    let got = num_floating_point_operations(&with, 8) - num_floating_point_operations(&base, 8);
    assert!((got - want).abs() / want < 1e-9, "{got} vs {want}");
}
