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
    use megatron_core::transformer::config::MoEConfig;
    // Every other layer MoE with 8 experts of width 512, top-2: those layers' MLP term is
    // 2 x 512 wide, the dense ones 3072.
    let mut c = gpt2_small();
    c.moe = Some(MoEConfig {
        layer_freq: 2,
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
