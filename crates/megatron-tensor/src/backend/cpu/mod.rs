//! CPU kernels, one family per file. Names follow llm.c: outputs first, `d`-prefixed gradients,
//! dims in a small `Copy` struct. Every backward accumulates (`+=`) into parameter gradients and
//! overwrites input gradients unless its doc says otherwise.

pub mod adamuon;
pub mod adamw;
pub mod amx;
mod amx_pack;
pub mod attention;
pub mod attention_bias;
#[cfg(target_arch = "x86_64")]
mod attention_packed;
pub mod attention_sink;
mod attention_tile;
pub mod cast;
pub mod class_loss;
pub mod cross_entropy;
pub mod dispatch;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod glu_limits;
pub mod layernorm;
pub mod layout;
pub mod lion;
pub mod matmul;
pub mod matmul_amx;
pub mod matmul_bf16;
pub mod matmul_packed;
pub mod mla;
pub mod mlp_activation;
pub mod moe_gate;
pub mod moe_permute;
pub mod moe_router;
pub mod newton_schulz;
pub mod operand;
pub mod peak;
pub mod pooling;
pub mod quick_geglu;
pub mod reduce;
pub mod ring_attention;
pub mod rmsnorm;
pub mod rope;
pub mod sgd;
#[cfg(target_arch = "x86_64")]
mod sgemm;
pub mod simd;
pub mod swiglu;
pub mod sync_ptr;
pub mod table_features;
pub mod table_layout;
pub mod tanh;

pub use adamuon::{adamuon_normalize, torch_lerp, AdaMuonParams};
pub use adamw::{adamw_update, adamw_update_bf16_moments, AdamWParams};
pub use attention::{
    attention_backward, attention_decode_forward, attention_forward, kv_cache_append,
    sliding_window_starts, AttentionDims, AttentionMask, DecodeDims, RngBlock,
};
pub use attention_sink::{attention_sink_backward, attention_sink_forward, SinkDims};
pub use class_loss::masked_cross_entropy;
pub use cross_entropy::{
    fused_classifier, vocab_parallel_classifier, ClassifierBias, ClassifierDims, ClassifierReduce,
    IGNORE_INDEX,
};
pub use dispatch::{fastest_bf16_kernel, kernel_fingerprint};
pub use dropout::{
    bias_dropout_add_backward, bias_dropout_add_forward, dropout_add_forward, dropout_backward,
};
pub use embedding::{
    embedding_backward, embedding_forward, embedding_lookup_backward, embedding_lookup_forward,
};
pub use gelu::{bias_gelu_backward, bias_gelu_forward, gelu_backward, gelu_forward, GeluApprox};
pub use glu_limits::{limited_glu_backward, limited_glu_forward, GateFunction, GluLimits};
pub use layernorm::{layernorm_backward, layernorm_forward};
pub use layout::{
    concat_columns, gather_group_blocks, scatter_group_blocks, split_columns, GroupBlocks,
};
pub use lion::{lion_update, LionParams};
pub use matmul::{
    bias_backward, bias_rows_forward, grouped_matmul, matmul, matmul_backward, matmul_batched,
    matmul_forward, matmul_operands, matmul_with_threads, syrk_with_threads, BatchStrides,
    GemmProblem, MatmulDims, Operand,
};
pub use mla::{
    mla_attn_narrow_backward, mla_attn_narrow_forward, mla_kv_split_backward, mla_kv_split_forward,
    mla_qkv_backward, mla_qkv_forward, MlaDims,
};
pub use mlp_activation::{
    geglu_backward, geglu_forward, mlp_activation_backward, mlp_activation_forward, relu_backward,
    relu_forward, MlpActivation,
};
pub use newton_schulz::{
    newton_schulz, NewtonSchulz, NewtonSchulzDims, NsOrientation, NsPrecision,
};
pub use operand::OperandMut;
pub use pooling::{mean_pool_forward, PoolNorm};
pub use quick_geglu::{quick_geglu_backward, quick_geglu_forward};
pub use reduce::{first_non_finite, global_norm_squared, scale_inplace};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward, RMSNormDims};
pub use rope::{
    rope_backward, rope_forward, Llama3Scaling, RopeDims, RopeScaling, RopeStyle, RopeTable,
    YarnScaling,
};
pub use sgd::{sgd_update, SgdParams};
pub use swiglu::{swiglu_backward, swiglu_forward};
pub use table_features::{
    context_mean_sd, context_means, table_context_partials, table_features,
    table_features_with_stats, TableInputs, TableStats,
};
pub use table_layout::{swap_rows_cols, TableDims};
pub use tanh::{tanh_backward, tanh_forward};

/// Rows per parallel task for row-wise elementwise kernels: big enough to amortize scheduling,
/// small enough to balance two to a few dozen cores. Fixed (not derived from the thread count) so
/// results are identical whatever the thread count.
pub(crate) const ROWS_PER_TASK: usize = 16;
