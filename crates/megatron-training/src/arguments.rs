//! Command-line arguments with Megatron's flag names and defaults, and the checks that refuse a
//! bad configuration before any work starts.

use crate::TrainError;
use clap::{Args, ValueEnum};
use megatron_core::optimizer::UpdateRule;
use megatron_core::optimizer::{LrDecayStyle, WsdDecayStyle};
use megatron_core::transformer::config::{
    Activation, GeluForm, GluConfig, MLAConfig, MTPConfig, Normalization, PositionEmbeddingType,
    ResidualPrecision, RotaryConfig, SlidingWindow, SoftmaxType,
};
use megatron_core::TransformerConfig;

/// `--normalization`, spelled as Megatron spells it.
/// `--non-persistent-ckpt-type` (Megatron's values).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonPersistentCkptTypeArg {
    Global,
    Local,
    #[value(name = "in_memory")]
    InMemory,
}

/// `--softmax-type`, spelled as Megatron spells it.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftmaxTypeArg {
    Vanilla,
    #[value(name = "off-by-one")]
    OffByOne,
    Learnable,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormalizationArg {
    #[value(name = "LayerNorm")]
    LayerNorm,
    #[value(name = "RMSNorm")]
    RMSNorm,
}

/// `--bf16-matmul-kernel`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16KernelArg {
    /// Whichever measures faster on this CPU (agreed over the world).
    Auto,
    /// AVX512_BF16 `vdpbf16ps`.
    Dot,
    /// Operands rounded to bf16, f32 FMA GEMM.
    Fma,
    /// Intel AMX tiles (`tdpbf16ps`); refused where the CPU or OS has none.
    Amx,
}

/// What `--load` does when the checkpoint's learning-rate schedule differs from the flags'
/// (Megatron's `OptimizerParamScheduler.load_state_dict`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerOnLoad {
    /// Refuse the difference, naming it.
    Check,
    /// `--override-opt_param-scheduler`: the flags' schedule.
    Override,
    /// `--use-checkpoint-opt_param-scheduler`: the checkpoint's schedule.
    UseCheckpoint,
}

/// Parameters' and matmul operands' precision (`--bf16`, `--fp16`, else fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    BF16,
    F16,
}

impl Precision {
    /// The 16-bit format of the model's parameters, if any.
    pub fn half(self) -> Option<megatron_tensor::cpu::cast::Half> {
        use megatron_tensor::cpu::cast::Half;
        match self {
            Precision::F32 => None,
            Precision::BF16 => Some(Half::BF16),
            Precision::F16 => Some(Half::F16),
        }
    }
}

/// `--use-distributed-optimizer` or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// The whole optimizer state on every data-parallel rank.
    Replicated,
    /// The state sharded over the data-parallel ranks (ZeRO-1).
    Distributed,
}

/// `--optimizer` (megatron-core's names).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OptimizerArg {
    /// AdamW: --adam-beta1, --adam-beta2, --adam-eps.
    #[default]
    Adam,
    /// SGD with momentum (--sgd-momentum) and L2 weight decay, as torch's.
    Sgd,
    /// Lion: sign updates of a momentum (--lion-beta1, --lion-beta2), decoupled weight decay.
    Lion,
    /// Muon (megatron-core's `TensorParallelMuon`): 2-D weights step on their orthogonalized
    /// momentum (--muon-*), the rest on --muon-scalar-optimizer.
    Muon,
    /// Megatron's deprecated spelling of `--optimizer muon --use-distributed-optimizer`.
    #[value(name = "dist_muon")]
    DistMuon,
    /// AdaMuon (megatron-core's `TensorParallelAdaptiveMuon`): Muon whose orthogonalized update
    /// is divided by the root of an EMA of its squares; the same --muon-* flags.
    #[value(name = "adaptive_muon")]
    AdaptiveMuon,
}

/// `--muon-scale-mode`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonScaleModeArg {
    Spectral,
    #[value(name = "unit_rms_norm")]
    UnitRmsNorm,
    #[value(name = "shape_scaling")]
    ShapeScaling,
}

/// `--muon-fp32-matmul-prec`: megatron-core's torch precision of the Newton–Schulz products.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonMatmulPrecArg {
    /// bf16 products (as medium).
    Low,
    /// bf16 operands and results, f32 accumulation.
    Medium,
    /// f32 (torch's TF32 on a GPU; f32 here).
    High,
}

/// `--muon-tp-mode`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonTpModeArg {
    Blockwise,
    Duplicated,
    Distributed,
}

/// `--muon-scalar-optimizer`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonScalarArg {
    Adam,
    Lion,
}

/// Megatron's precision-aware optimizer dtypes (`--exp-avg-dtype` and the like).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateDtypeArg {
    Fp32,
    Bf16,
    Fp16,
    Fp8,
}

/// `--no-weight-decay-cond-type` (Megatron's deprecated spelling of --apply-wd-to-qk-layernorm).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoWeightDecayCondArg {
    #[value(name = "apply_wd_to_qk_layernorm")]
    ApplyWdToQkLayernorm,
}

/// Which tensors weight decay spares, as megatron-core's `get_standard_config_overrides` decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NoWeightDecayCond {
    /// Megatron's classic rule: every 1-D tensor and every bias.
    #[default]
    OneDimAndBiases,
    /// The same, except the query and key norms, which decay (Qwen3-Next).
    OneDimAndBiasesExceptQkLayernorm,
}

/// `--moe-router-score-function`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterScoreArg {
    #[value(name = "softmax")]
    Softmax,
    #[value(name = "sigmoid")]
    Sigmoid,
}

/// `--moe-token-dispatcher-type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatcherArg {
    #[value(name = "allgather")]
    AllGather,
    #[value(name = "alltoall")]
    AllToAll,
}

/// `--cp-comm-type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpCommTypeArg {
    #[value(name = "p2p")]
    P2p,
    #[value(name = "a2a")]
    A2a,
}

/// `--recompute-granularity`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeGranularityArg {
    #[value(name = "full")]
    Full,
    #[value(name = "selective")]
    Selective,
}

/// `--recompute-method`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeMethodArg {
    #[value(name = "uniform")]
    Uniform,
    #[value(name = "block")]
    Block,
}

/// `--moe-router-load-balancing-type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadBalancingArg {
    #[value(name = "aux_loss")]
    AuxLoss,
    #[value(name = "seq_aux_loss")]
    SeqAuxLoss,
    #[value(name = "none")]
    None,
}

/// `--moe-token-drop-policy`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropPolicyArg {
    #[value(name = "probs")]
    Probs,
    #[value(name = "position")]
    Position,
}

/// `--position-embedding-type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionEmbeddingArg {
    #[value(name = "learned_absolute")]
    LearnedAbsolute,
    #[value(name = "rope")]
    Rope,
    /// Rotary embeddings with YaRN's context extension (`--rotary-scaling-factor`, `--yarn-*`).
    #[value(name = "yarn")]
    Yarn,
    #[value(name = "none")]
    None,
}

/// `--moe-router-dtype`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterDtypeArg {
    Fp32,
    Fp64,
}

/// `--rope-type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeTypeArg {
    Rope,
    Yarn,
}

/// `--model`: which model family `megatron train` builds.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ModelArg {
    /// A decoder-only language model (GPT or, by flags, Llama), on token data.
    #[default]
    #[value(name = "gpt")]
    Gpt,
    /// The tabular foundation model, on tables drawn from the synthetic prior.
    #[value(name = "tabular")]
    Tabular,
    /// A BERT encoder (masked-language-model and sentence-order losses), on a sentence-split
    /// indexed dataset (`pretrain_bert.py`).
    #[value(name = "bert")]
    Bert,
    /// A T5 encoder-decoder (span corruption), on a sentence-split indexed dataset
    /// (`pretrain_t5.py`).
    #[value(name = "t5")]
    T5,
}

/// `--transformer-block-type` (NeMo's flag): where a layer's LayerNorms sit.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BlockTypeArg {
    /// Before each block, and a final LayerNorm (GPT, Megatron's BERT).
    #[default]
    #[value(name = "pre_ln")]
    PreLn,
    /// After each residual sum, and on the embeddings (the original BERT).
    #[value(name = "post_ln")]
    PostLn,
}

/// Megatron's tokenizer flags, shared by `train`, `preprocess` and `inspect-data`.
#[derive(Args, Clone, Debug)]
pub struct TokenizerArgs {
    #[arg(long, default_value = "ByteLevelTokenizer")]
    pub tokenizer_type: String,
    /// NullTokenizer's vocabulary size.
    #[arg(long)]
    pub vocab_size: Option<usize>,
    #[arg(long)]
    pub vocab_file: Option<String>,
    #[arg(long)]
    pub merge_file: Option<String>,
    /// A Hugging Face tokenizer.json.
    #[arg(long)]
    pub tokenizer_model: Option<String>,
    /// T5's sentinel tokens `<extra_id_0>`... appended to a WordPiece vocabulary.
    #[arg(long, default_value_t = 0)]
    pub vocab_extra_ids: usize,
    /// TikTokenizer's pre-tokenization split: v1 or v2 (GPT-4o's).
    #[arg(long)]
    pub tiktoken_pattern: Option<megatron_data::tiktoken_tokenizer::TiktokenPattern>,
    /// Ids reserved for special tokens in front of TikTokenizer's ranks.
    #[arg(long, default_value_t = megatron_data::tiktoken_tokenizer::DEFAULT_NUM_SPECIAL_TOKENS)]
    pub tiktoken_num_special_tokens: usize,
    /// TikTokenizer's special tokens, from id 0 (default `<unk> <s> </s>`).
    #[arg(long, num_args = 1.., alias = "tiktoken-special-tokens")]
    pub tokenizer_special_tokens: Option<Vec<String>>,
}

impl TokenizerArgs {
    pub fn spec(&self) -> megatron_data::TokenizerSpec {
        megatron_data::TokenizerSpec {
            tokenizer_type: self.tokenizer_type.clone(),
            vocab_file: self.vocab_file.clone(),
            merge_file: self.merge_file.clone(),
            tokenizer_model: self.tokenizer_model.clone(),
            vocab_size: self.vocab_size,
            vocab_extra_ids: self.vocab_extra_ids,
            tiktoken: self.tiktoken(),
        }
    }

    /// TikTokenizer's settings, where `--tiktoken-pattern` is given.
    pub fn tiktoken(&self) -> Option<megatron_data::tiktoken_tokenizer::TiktokenOptions> {
        self.tiktoken_pattern.map(
            |pattern| megatron_data::tiktoken_tokenizer::TiktokenOptions {
                pattern,
                num_special_tokens: self.tiktoken_num_special_tokens,
                special_tokens: self.tokenizer_special_tokens.clone(),
            },
        )
    }
}

/// Negative numbers parse as values (`--lr -1` reaches validation, which names the flag,
/// instead of clap's bare usage text).
#[derive(Args, Clone, Debug)]
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    #[arg(long, value_enum, default_value = "gpt")]
    pub model: ModelArg,
    /// Flags of `--model tabular` (ignored otherwise).
    #[command(flatten)]
    pub tabular: crate::tabular::TabularArgs,
    /// `--model bert`: no sentence-order (binary) head, one segment per sample.
    #[arg(long)]
    pub bert_no_binary_head: bool,
    /// `--model bert`: the fraction of tokens masked.
    #[arg(long, default_value_t = 0.15)]
    pub mask_prob: f64,
    /// `--model bert`: the probability of a sample shorter than --seq-length.
    #[arg(long, default_value_t = 0.1)]
    pub short_seq_prob: f64,
    /// `--model t5`: encoder layers (default --num-layers).
    #[arg(long)]
    pub encoder_num_layers: Option<usize>,
    /// `--model t5`: decoder layers (default --num-layers).
    #[arg(long)]
    pub decoder_num_layers: Option<usize>,
    /// `--model t5`: the encoder's sequence length (sets --seq-length).
    #[arg(long)]
    pub encoder_seq_length: Option<usize>,
    /// `--model t5`: the decoder's sequence length.
    #[arg(long, default_value_t = 128)]
    pub decoder_seq_length: usize,
    /// `--model t5`: relative position buckets and the distance the last one starts at.
    #[arg(long, default_value_t = 32)]
    pub relative_attention_num_buckets: usize,
    #[arg(long, default_value_t = 128)]
    pub relative_attention_max_distance: usize,
    /// `--model bert`: `pre_ln` (Megatron's BERT) or `post_ln` (the original BERT).
    #[arg(long, value_enum, default_value = "pre_ln")]
    pub transformer_block_type: BlockTypeArg,
    // Model.
    #[arg(long, default_value_t = 2)]
    pub num_layers: usize,
    #[arg(long, default_value_t = 128)]
    pub hidden_size: usize,
    #[arg(long, default_value_t = 4)]
    pub num_attention_heads: usize,
    /// Defaults to 4 * hidden size, or under --swiglu int(4h * 2/3 / 64) * 64 (Megatron's).
    #[arg(long)]
    pub ffn_hidden_size: Option<usize>,
    #[arg(long, default_value_t = 128)]
    pub seq_length: usize,
    /// Defaults to --seq-length.
    #[arg(long)]
    pub max_position_embeddings: Option<usize>,
    #[arg(long, default_value_t = 128)]
    pub make_vocab_size_divisible_by: usize,
    #[arg(long, default_value_t = 0.1)]
    pub hidden_dropout: f32,
    #[arg(long, default_value_t = 0.1)]
    pub attention_dropout: f32,
    #[arg(long, default_value_t = 0.02)]
    pub init_method_std: f32,
    #[arg(
        long = "norm-epsilon",
        alias = "layernorm-epsilon",
        default_value_t = 1e-5
    )]
    pub norm_epsilon: f32,
    #[arg(long)]
    pub untie_embeddings_and_output_weights: bool,
    #[arg(long, value_enum, default_value = "LayerNorm")]
    pub normalization: NormalizationArg,
    /// SwiGLU MLP: fused fc1 = [gate; up], silu(gate) * up.
    #[arg(long)]
    pub swiglu: bool,
    /// The GELU MLP's exact erf GELU (megatron-core's unfused `F.gelu`) instead of the fused
    /// bias-GELU's tanh approximation.
    #[arg(long)]
    pub no_bias_gelu_fusion: bool,
    /// Squared-ReLU MLP: relu(x)² (megatron-core's `squared_relu`).
    #[arg(long)]
    pub squared_relu: bool,
    /// Quick-GEGLU MLP: fused fc1 = [gate; up], gate * sigmoid(1.702 gate) * up.
    #[arg(long)]
    pub quick_geglu: bool,
    /// gpt-oss's gated unit: `act(gate) * (up + offset)` (megatron-core's `glu_linear_offset`;
    /// with --quick-geglu).
    #[arg(long, default_value_t = 0.0)]
    pub glu_linear_offset: f32,
    /// gpt-oss's clamp of fc1's output: the gate at most V, the linear half within [-V, V]
    /// (with --quick-geglu, or --swiglu on MoE models, as megatron-core allows).
    #[arg(long)]
    pub activation_func_clamp_value: Option<f32>,
    /// Attention's softmax: `vanilla`, `off-by-one` (a zero logit in every denominator) or
    /// `learnable` (a learned logit per head: gpt-oss's attention sinks).
    #[arg(long, value_enum, default_value = "vanilla")]
    pub softmax_type: SoftmaxTypeArg,
    #[arg(long, value_enum, default_value = "learned_absolute")]
    pub position_embedding_type: PositionEmbeddingArg,
    /// Megatron's legacy spelling of `--position-embedding-type rope`.
    #[arg(long)]
    pub use_rotary_position_embeddings: bool,
    /// Megatron's legacy "no learned position embedding": accepted with rope (which has none),
    /// refused otherwise as Megatron refuses it.
    #[arg(long)]
    pub no_position_embedding: bool,
    #[arg(long, default_value_t = 10000.0)]
    pub rotary_base: f64,
    /// Fraction of each head's features that rotary embeddings rotate.
    #[arg(long, default_value_t = 1.0)]
    pub rotary_percent: f32,
    /// Pair features (2i, 2i+1) instead of (i, i + d/2).
    #[arg(long)]
    pub rotary_interleaved: bool,
    /// Llama 3.1 frequency scaling of the rotary embeddings.
    #[arg(long)]
    pub use_rope_scaling: bool,
    /// Linear position interpolation of the rotary embeddings: positions divided by this factor.
    #[arg(long)]
    pub rotary_seq_len_interpolation_factor: Option<f64>,
    /// YaRN's context-extension factor (`--position-embedding-type yarn`).
    #[arg(long, default_value_t = 1.0)]
    pub rotary_scaling_factor: f64,
    /// The context the model was pretrained on (YaRN's frequency correction).
    #[arg(long, default_value_t = 4096)]
    pub yarn_original_max_position_embeddings: usize,
    #[arg(long, default_value_t = 32.0)]
    pub yarn_beta_fast: f64,
    #[arg(long, default_value_t = 1.0)]
    pub yarn_beta_slow: f64,
    /// YaRN's concentration: 0.1 mscale ln(factor) + 1, over the same with --mscale-all-dim
    /// when that is non-zero.
    #[arg(long, default_value_t = 1.0)]
    pub mscale: f64,
    #[arg(long, default_value_t = 0.0)]
    pub mscale_all_dim: f64,
    /// Do not round YaRN's correction range to whole dimensions (rounded by default).
    #[arg(long)]
    pub no_yarn_correction_range_round_to_int: bool,
    /// Megatron's spelling of the default.
    #[arg(long)]
    pub yarn_correction_range_round_to_int: bool,
    #[arg(long, default_value_t = 8.0)]
    pub rope_scaling_factor: f64,
    #[arg(long)]
    pub group_query_attention: bool,
    /// Key/value heads under --group-query-attention (1: multi-query attention).
    #[arg(long, default_value_t = 1)]
    pub num_query_groups: usize,
    /// Per-head dimension; defaults to --hidden-size / --num-attention-heads.
    #[arg(long)]
    pub kv_channels: Option<usize>,
    /// No biases in the linear layers (Llama).
    #[arg(long)]
    pub disable_bias_linear: bool,
    /// A bias on the QKV projection even with --disable-bias-linear (Qwen2).
    #[arg(long)]
    pub add_qkv_bias: bool,
    /// Normalize each head's queries and keys (with --normalization's kind) before RoPE.
    #[arg(long)]
    pub qk_layernorm: bool,
    /// Multi-latent attention (DeepSeek-V2/V3): queries, keys and values from low-rank
    /// latents, rotary embeddings on separate per-head features (needs RoPE or YaRN).
    #[arg(long)]
    pub multi_latent_attention: bool,
    /// Multi-latent attention's rotary embedding, `yarn` (its default in megatron-core, with
    /// --rotary-scaling-factor and the --yarn-*/--mscale* flags) or `rope`; other attention
    /// takes `rope` only (Megatron's flag).
    #[arg(long, value_enum)]
    pub rope_type: Option<RopeTypeArg>,
    /// MLA: the query latent's width; without it the queries come straight from the hidden
    /// state (`linear_q_proj`).
    #[arg(long)]
    pub q_lora_rank: Option<usize>,
    /// MLA: the key/value latent's width.
    #[arg(long, default_value_t = 32)]
    pub kv_lora_rank: usize,
    /// MLA: content features of each query/key head.
    #[arg(long, default_value_t = 128)]
    pub qk_head_dim: usize,
    /// MLA: rotary features of each query/key head (the rotary key is shared by all heads).
    #[arg(long, default_value_t = 64)]
    pub qk_pos_emb_head_dim: usize,
    /// MLA: features of each value head.
    #[arg(long, default_value_t = 128)]
    pub v_head_dim: usize,
    /// Multi-token prediction: this many layers after the decoder, the k-th predicting the
    /// token k + 1 places ahead (DeepSeek-V3).
    #[arg(long)]
    pub mtp_num_layers: Option<usize>,
    /// The multi-token-prediction losses' weight (their mean over the depths times this).
    #[arg(long, default_value_t = 0.1)]
    pub mtp_loss_scaling_factor: f32,
    /// Sliding-window attention: "(L,R)", each query sees itself and the L tokens before it
    /// (R must be 0: decoders are causal; L = -1 is no window).
    #[arg(long, allow_hyphen_values = true)]
    pub window_size: Option<String>,
    /// Layers that keep full attention under --window-size: N (every Nth layer, counting
    /// from 1) or a pattern of one entry per layer, 1 windowed and 0 full ("[1,1,1,0]*3").
    #[arg(long)]
    pub window_attn_skip_freq: Option<String>,
    /// Mixture of experts: this many experts replace the MLP on the MoE layers (dropless).
    #[arg(long)]
    pub num_experts: Option<usize>,
    /// Each expert's FFN width; defaults to --ffn-hidden-size.
    #[arg(long)]
    pub moe_ffn_hidden_size: Option<usize>,
    #[arg(long, default_value_t = 2)]
    pub moe_router_topk: usize,
    #[arg(long, value_enum, default_value = "softmax")]
    pub moe_router_score_function: RouterScoreArg,
    /// The router's precision (Megatron's flag): `fp32`, what the router computes in here
    /// (its logits in fp32 from the 16-bit input and weights under --bf16); `fp64` is refused.
    #[arg(long, value_enum)]
    pub moe_router_dtype: Option<RouterDtypeArg>,
    /// Softmax over all experts before the top-k selection.
    #[arg(long)]
    pub moe_router_pre_softmax: bool,
    #[arg(long)]
    pub moe_router_topk_scaling_factor: Option<f32>,
    /// Group-limited routing: the experts split into this many equal groups by index
    /// (DeepSeek: the expert-parallel ranks or nodes).
    #[arg(long)]
    pub moe_router_num_groups: Option<usize>,
    /// Groups each token may route to, picked by the sum of each group's best
    /// topk / group-topk scores.
    #[arg(long)]
    pub moe_router_group_topk: Option<usize>,
    /// Switch load-balancing loss coefficient (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub moe_aux_loss_coeff: f32,
    /// Router z-loss coefficient (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub moe_z_loss_coeff: f32,
    /// The MoE layers: N (every Nth layer, from layer 0) or a pattern of one entry per layer, 1
    /// MoE and 0 dense ("[0]*1+[1]*3").
    #[arg(long, default_value = "1")]
    pub moe_layer_freq: String,
    /// How tokens reach the experts of other expert-parallel ranks (Megatron's default:
    /// allgather).
    #[arg(long, value_enum, default_value = "allgather")]
    pub moe_token_dispatcher_type: DispatcherArg,
    /// aux_loss (switch loss over the micro-batch), seq_aux_loss (per sequence), none.
    #[arg(long, value_enum, default_value = "aux_loss")]
    pub moe_router_load_balancing_type: LoadBalancingArg,
    /// Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the selection scores,
    /// updated after every step (needs --moe-router-score-function sigmoid, as in Megatron).
    #[arg(long)]
    pub moe_router_enable_expert_bias: bool,
    #[arg(long, default_value_t = 1e-3)]
    pub moe_router_bias_update_rate: f32,
    /// Each expert takes at most ceil(tokens x topk / experts x factor) of a rank's rows; the
    /// rest are dropped (default: dropless).
    #[arg(long)]
    pub moe_expert_capacity_factor: Option<f32>,
    /// Which rows over capacity are dropped: the least probable, or the latest.
    #[arg(long, value_enum, default_value = "probs")]
    pub moe_token_drop_policy: DropPolicyArg,
    /// Every expert gets exactly its capacity of rows (zero-weight padding).
    #[arg(long)]
    pub moe_pad_expert_input_to_capacity: bool,
    /// Width of an always-on shared expert beside the routed ones.
    #[arg(long)]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Scale the shared expert's output by a per-token sigmoid gate (Qwen2-MoE).
    #[arg(long)]
    pub moe_shared_expert_gate: bool,
    /// Run the experts' GEMMs at once, one token block per thread (megatron-core's
    /// GroupedMLP); without it they run one after the other on every thread (SequentialMLP).
    #[arg(long)]
    pub moe_grouped_gemm: bool,
    /// Accepted for compatibility: softmax always runs in fp32 here.
    #[arg(long)]
    pub attention_softmax_in_fp32: bool,
    /// GPU kernel, fusion and launcher flags of Megatron's scripts, accepted without effect.
    #[command(flatten)]
    pub script_compat: crate::script_compat::ScriptCompatArgs,

    // Batches and iterations.
    #[arg(long, default_value_t = 4)]
    pub micro_batch_size: usize,
    /// Defaults to --micro-batch-size (no gradient accumulation).
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    #[arg(long)]
    pub train_iters: Option<u64>,
    /// Sample-based training (Megatron's): the learning-rate flags are then `--lr-*-samples`.
    #[arg(long)]
    pub train_samples: Option<u64>,
    /// `START INCREMENT SAMPLES`: the global batch size grows from START by INCREMENT, one
    /// step per SAMPLES / ((--global-batch-size - START) / INCREMENT) samples consumed, up to
    /// --global-batch-size (with --train-samples, as in Megatron).
    #[arg(long, num_args = 3, value_names = ["START", "INCREMENT", "SAMPLES"])]
    pub rampup_batch_size: Option<Vec<u64>>,
    /// `"THRESHOLD:BATCH_SIZE ..."`: the global batch size from each threshold of consumed
    /// tokens on (K/M/B/T suffixes; the first at 0), megatron-core's replacement of
    /// --rampup-batch-size. Without --global-batch-size, which Megatron then sets to
    /// --micro-batch-size x DP for what it derives from it (iteration-based learning-rate
    /// lengths, the evaluation batch, the training split's size).
    #[arg(long, value_name = "SCHEDULE")]
    pub step_batch_size_schedule: Option<String>,

    // Optimizer and schedule.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// Peak learning rate of the word embedding and the output layer (Megatron's decoupled
    /// group), on the same warm-up and decay.
    #[arg(long)]
    pub decoupled_lr: Option<f64>,
    /// Floor of the decoupled group (default --min-lr).
    #[arg(long)]
    pub decoupled_min_lr: Option<f64>,
    #[arg(long, default_value = "linear")]
    pub lr_decay_style: String,
    #[arg(long)]
    pub lr_decay_iters: Option<u64>,
    #[arg(long)]
    pub lr_warmup_iters: Option<u64>,
    #[arg(long)]
    pub lr_warmup_fraction: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    pub lr_warmup_init: f64,
    #[arg(long)]
    pub lr_wsd_decay_iters: Option<u64>,
    /// Under --train-samples: samples over which the learning rate decays (default: all).
    #[arg(long)]
    pub lr_decay_samples: Option<u64>,
    /// Under --train-samples: warm-up samples.
    #[arg(long)]
    pub lr_warmup_samples: Option<u64>,
    /// Under --train-samples: the WSD decay phase, in samples.
    #[arg(long)]
    pub lr_wsd_decay_samples: Option<u64>,
    #[arg(long, default_value = "exponential")]
    pub lr_wsd_decay_style: String,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f32,
    /// Weigh every counted token of the global batch the same: the gradient is the summed loss
    /// over the global batch's token count, not the mean of each micro-batch's mean (Megatron's
    /// flag; they differ when micro-batches count different numbers of tokens, --eod-mask-loss).
    #[arg(long)]
    pub calculate_per_token_loss: bool,
    /// Decay the --qk-layernorm query and key norms too (megatron-core spares every 1-D tensor
    /// and bias otherwise).
    #[arg(long)]
    pub apply_wd_to_qk_layernorm: bool,
    /// Megatron's deprecated spelling of --apply-wd-to-qk-layernorm.
    #[arg(long, value_enum)]
    pub no_weight_decay_cond_type: Option<NoWeightDecayCondArg>,
    #[arg(long, value_enum, default_value = "adam")]
    pub optimizer: OptimizerArg,
    #[arg(long, default_value_t = 0.9)]
    pub sgd_momentum: f32,
    /// Lion's interpolation between momentum and gradient for the sign update.
    #[arg(long, default_value_t = 0.95)]
    pub lion_beta1: f32,
    /// Lion's momentum decay.
    #[arg(long, default_value_t = 0.98)]
    pub lion_beta2: f32,
    /// Muon's momentum (the EMA of the gradients it orthogonalizes).
    #[arg(long, default_value_t = 0.9)]
    pub muon_momentum: f32,
    /// Orthogonalize a fused QKV weight whole, not as its query, key and value blocks.
    #[arg(long)]
    pub muon_no_split_qkv: bool,
    /// Nesterov's look-ahead on Muon's momentum.
    #[arg(long)]
    pub muon_nesterov: bool,
    #[arg(long, value_enum, default_value = "spectral")]
    pub muon_scale_mode: MuonScaleModeArg,
    #[arg(long, value_enum, default_value = "medium")]
    pub muon_fp32_matmul_prec: MuonMatmulPrecArg,
    /// simple, quintic, polar_express, cans, aol or deepseekv4 (emerging-optimizers' sets).
    #[arg(long, default_value = "quintic")]
    pub muon_coefficient_type: String,
    #[arg(long, default_value_t = 5)]
    pub muon_num_ns_steps: usize,
    #[arg(long, value_enum, default_value = "duplicated")]
    pub muon_tp_mode: MuonTpModeArg,
    #[arg(long, default_value_t = 1.0)]
    pub muon_extra_scale_factor: f32,
    /// The optimizer of the embeddings, output layer, norms and biases under --optimizer muon.
    #[arg(long, value_enum, default_value = "adam")]
    pub muon_scalar_optimizer: MuonScalarArg,
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f32,
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f32,
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f32,
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f32,
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,

    // Data.
    #[arg(long)]
    pub mock_data: bool,
    /// Text files or directories of `.txt` files (tokenized whole until the `.bin/.idx` pipeline).
    #[arg(long, num_args = 1..)]
    pub data_path: Vec<String>,
    #[arg(long, default_value = "969,30,1")]
    pub split: String,
    #[command(flatten)]
    pub tokenizer: TokenizerArgs,
    #[command(flatten)]
    pub fim: crate::fim::FimArgs,
    /// One blend per split instead of --data-path + --split.
    #[arg(long, num_args = 1..)]
    pub train_data_path: Vec<String>,
    #[arg(long, num_args = 1..)]
    pub valid_data_path: Vec<String>,
    #[arg(long, num_args = 1..)]
    pub test_data_path: Vec<String>,
    /// A file holding what --data-path would (a long blend: `0.3 a 0.7 b ...`, whitespace
    /// separated), as Megatron's flag.
    #[arg(long)]
    pub data_args_path: Option<String>,
    /// A JSON file with `train`, `valid` and `test` keys, each what --train-data-path,
    /// --valid-data-path and --test-data-path would hold (a list, or one whitespace-separated
    /// string), as Megatron's flag.
    #[arg(long)]
    pub per_split_data_args_path: Option<String>,
    /// Where GPTDataset indices are cached (named by a hash of their description).
    #[arg(long)]
    pub data_cache_path: Option<String>,
    /// The extra share of samples each dataset of a weighted blend is built with, so that the
    /// blend never runs short (Megatron's flag, default 0.005).
    #[arg(long, default_value_t = megatron_data::megatron_data::DEFAULT_SURPLUS)]
    pub mid_level_dataset_surplus: f64,
    /// Exclude end-of-document labels from the loss.
    #[arg(long)]
    pub eod_mask_loss: bool,
    /// Restart position ids after each end-of-document token.
    #[arg(long)]
    pub reset_position_ids: bool,
    /// Let tokens attend only within their own document.
    #[arg(long)]
    pub reset_attention_mask: bool,
    /// The sampler: `single` (consecutive samples, the default) or `cyclic` (reshuffled every
    /// epoch by `torch.randperm`, as Megatron-LM).
    #[arg(long, value_enum)]
    pub dataloader_type: Option<crate::sample_order::DataloaderTypeArg>,
    /// Under `cyclic`: one shuffle of the whole dataset strided over the data-parallel ranks,
    /// instead of each rank shuffling its own contiguous part.
    #[arg(long)]
    pub no_data_sharding: bool,

    // Evaluation, logging, checkpoints.
    /// Iterations between validations; each reads the next --eval-iters global batches of the
    /// validation split, as Megatron's validation iterator does.
    #[arg(long, default_value_t = 1000)]
    pub eval_interval: u64,
    #[arg(long, default_value_t = 100)]
    pub eval_iters: u64,
    /// Samples per micro-batch of validation and test (Megatron's flag; default
    /// --micro-batch-size): a forward-only pass can take larger micro-batches than training.
    #[arg(long)]
    pub eval_micro_batch_size: Option<usize>,
    /// Samples per evaluation iteration (Megatron's flag; default --global-batch-size): each
    /// evaluation reads --eval-iters of them.
    #[arg(long)]
    pub eval_global_batch_size: Option<usize>,
    /// Each validation scores the whole validation split, one epoch of it (Megatron's flag,
    /// for GPT datasets), as Megatron's full-validation sampler reads it.
    #[arg(long)]
    pub full_validation: bool,
    /// With --full-validation: each dataset of --valid-data-path scored apart, one epoch each,
    /// logged as `validation-<i>` (Megatron's flag; weights are not used; under --data-path the
    /// validation split is one set, as in Megatron-LM).
    #[arg(long)]
    pub multiple_validation_sets: bool,
    /// Names for the sets of --multiple-validation-sets, in order (`validation-<name>`).
    #[arg(long, num_args = 1..)]
    pub validation_set_names: Vec<String>,
    /// Validate only from this iteration on (Megatron's flag; the validation split is sized
    /// for the evaluations that remain).
    #[arg(long)]
    pub start_eval_at_iter: Option<u64>,
    #[arg(long, default_value_t = 100)]
    pub log_interval: u64,
    #[arg(long)]
    pub metrics_file: Option<String>,
    /// Write TensorBoard event files here (rank 0): each iteration's loss, learning rate, grad
    /// norm and loss scale every --tensorboard-log-interval iterations; throughput, MFU and
    /// memory every log interval; validation loss.
    #[arg(long)]
    pub tensorboard_dir: Option<String>,
    /// Iterations between TensorBoard's per-iteration scalars (Megatron's flag and default).
    #[arg(long, default_value_t = 1)]
    pub tensorboard_log_interval: u64,
    /// Also the per-stage timers (forward, backward, p2p wait, optimizer, iteration time).
    #[arg(long)]
    pub log_timers_to_tensorboard: bool,
    /// Also the allocator high-water marks (with --log-memory) and the peak resident memory.
    #[arg(long)]
    pub log_memory_to_tensorboard: bool,
    /// Also the validation perplexity.
    #[arg(long)]
    pub log_validation_ppl_to_tensorboard: bool,
    /// Also the world size.
    #[arg(long)]
    pub log_world_size_to_tensorboard: bool,
    #[arg(long)]
    pub no_log_loss_scale_to_tensorboard: bool,
    #[arg(long)]
    pub no_log_learning_rate_to_tensorboard: bool,
    #[arg(long)]
    pub save: Option<String>,
    #[arg(long)]
    pub save_interval: Option<u64>,
    #[arg(long)]
    pub load: Option<String>,
    /// Take the model (layers, sizes, heads, norms, positions, vocabulary) from the --load
    /// checkpoint instead of the model flags (a converted Hugging Face or GGUF model);
    /// --seq-length still sets the training sequence length.
    #[arg(long)]
    pub use_checkpoint_args: bool,
    /// Load the weights only and start a new run: iteration 0, fresh optimizer and scheduler
    /// (continued pre-training or fine-tuning from a released model).
    #[arg(long)]
    pub finetune: bool,
    /// Load iteration N from --load (its `iter_NNNNNNN`, which must be complete) instead of the
    /// newest: a rollback, say past a loss spike.
    #[arg(long)]
    pub ckpt_step: Option<u64>,
    /// Where --load holds no checkpoint (a first launch with --load = --save): start a new run
    /// from the weights of this checkpoint directory, as --finetune does.
    #[arg(long)]
    pub pretrained_checkpoint: Option<String>,
    /// Where --load holds no checkpoint, stop with an error instead of starting from random
    /// initialization (a mistyped path).
    #[arg(long)]
    pub exit_on_missing_checkpoint: bool,
    /// After each save under --save, delete the checkpoint before it unless its iteration is a
    /// multiple of this (a multiple of --save-interval): the newest is always kept.
    #[arg(long)]
    pub save_retain_interval: Option<u64>,
    /// Also save every N iterations (where --save-interval does not) into a non-persistent
    /// directory that keeps only its newest checkpoint; --load resumes from it where it is at
    /// least as new as the newest under --load.
    #[arg(long)]
    pub non_persistent_save_interval: Option<u64>,
    /// Where non-persistent checkpoints go: `global` (a checkpoint directory like --save's;
    /// the one implemented).
    #[arg(long, value_enum)]
    pub non_persistent_ckpt_type: Option<NonPersistentCkptTypeArg>,
    /// The non-persistent checkpoints' directory (default: the `non_persistent` directory under
    /// --save, or under --load for loading).
    #[arg(long)]
    pub non_persistent_global_ckpt_dir: Option<String>,
    /// Load the weights and the iteration but not the optimizer's moments.
    #[arg(long)]
    pub no_load_optim: bool,
    /// Save checkpoints without the optimizer's moments (a third of the bytes): resuming from
    /// one then needs --no-load-optim or --finetune (Megatron's flag).
    #[arg(long)]
    pub no_save_optim: bool,
    /// Train nothing: evaluate the model (from --load) on the validation and test splits
    /// over --eval-iters global batches, and exit (Megatron's flag).
    #[arg(long)]
    pub skip_train: bool,
    /// With --load: take the learning-rate schedule from these flags (continuing at the
    /// checkpoint's step count) where it differs from the checkpoint's, which is otherwise
    /// refused (GPT family; the tabular model keeps the checkpoint's). Megatron's spelling.
    #[arg(
        long = "override-opt_param-scheduler",
        alias = "override-opt-param-scheduler"
    )]
    pub override_opt_param_scheduler: bool,
    /// With --load: keep the checkpoint's learning-rate schedule whatever these flags say.
    #[arg(
        long = "use-checkpoint-opt_param-scheduler",
        alias = "use-checkpoint-opt-param-scheduler"
    )]
    pub use_checkpoint_opt_param_scheduler: bool,
    /// Accepted: random streams are counter-based from --seed and the iteration, so there is no
    /// RNG state to skip.
    #[arg(long)]
    pub no_load_rng: bool,
    /// Hardware peak for MFU; measured with an FMA loop (and cached) when absent.
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// GEMM threads (defaults to all cores).
    #[arg(long)]
    pub num_threads: Option<usize>,
    /// Plain log lines even on a terminal.
    #[arg(long)]
    pub no_progress_bar: bool,
    /// Ranks (threads of this process); with every other parallel size 1 they are data-parallel.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Ranks that split each layer's matrices (attention heads, MLP columns, vocabulary).
    #[arg(long, default_value_t = 1)]
    pub tensor_model_parallel_size: usize,
    /// Split LayerNorm, dropout and residual activations over the tensor-parallel ranks along
    /// the tokens (needs --tensor-model-parallel-size > 1 to have an effect).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Log this rank's memory by kind (parameters, gradients, optimizer state, saved
    /// activations, pooled buffers, process high-water) each log interval, and print the
    /// predicted breakdown at start-up.
    #[arg(long)]
    pub log_memory: bool,
    /// Selective recomputation of the core attention (= --recompute-granularity selective).
    #[arg(long)]
    pub recompute_activations: bool,
    /// `full` (whole layers, see --recompute-method) or `selective` (--recompute-modules).
    #[arg(long, value_enum)]
    pub recompute_granularity: Option<RecomputeGranularityArg>,
    /// Full recomputation: `uniform` keeps the input of every --recompute-num-layers layers,
    /// `block` recomputes the first --recompute-num-layers layers of each pipeline chunk.
    #[arg(long, value_enum)]
    pub recompute_method: Option<RecomputeMethodArg>,
    #[arg(long)]
    pub recompute_num_layers: Option<usize>,
    /// Selective recomputation: any of core_attn, mlp, layernorm, moe_act (layernorm and
    /// moe_act outputs are never kept here).
    #[arg(long, num_args = 1.., value_delimiter = ' ')]
    pub recompute_modules: Vec<String>,
    /// Stages of consecutive layers (1F1B schedule; interleaved with
    /// --num-layers-per-virtual-pipeline-stage).
    #[arg(long, default_value_t = 1)]
    pub pipeline_model_parallel_size: usize,
    /// Layers per virtual pipeline stage: each stage holds num_layers / (P x this) model chunks
    /// and runs the interleaved 1F1B schedule.
    #[arg(long)]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// `--model t5`: the pipeline stage the decoder starts on; stages before it hold the
    /// encoder (Megatron's split rank), each stack's layers split evenly over its stages.
    #[arg(long)]
    pub pipeline_model_parallel_split_rank: Option<usize>,
    /// `--model t5`: pipeline stages of the encoder, added before the decoder's
    /// --pipeline-model-parallel-size stages (megatron-core's form of the split).
    #[arg(long)]
    pub encoder_pipeline_model_parallel_size: Option<usize>,
    /// Layers of the first / last pipeline stage when the layers do not split evenly.
    #[arg(long)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    #[arg(long)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// Megatron's flexible split: the layers of every virtual stage spelled out, e.g.
    /// `Ett|tt|tt|ttL` (E embedding, t transformer layer, m multi-token prediction layer,
    /// L loss, | between virtual stages in order, `X*n` / `(...)*n` repeat); the virtual
    /// stages per rank are the stages / --pipeline-model-parallel-size.
    #[arg(long)]
    pub pipeline_model_parallel_layout: Option<String>,
    /// Count the embedding as one layer of the first pipeline stage (its first virtual stage),
    /// which then holds one transformer layer fewer: --num-layers + 1 must split evenly.
    #[arg(long)]
    pub account_for_embedding_in_pipeline_split: bool,
    /// Count the output layer and loss as one layer of the last pipeline stage (its last
    /// virtual stage), which then holds one transformer layer fewer.
    #[arg(long)]
    pub account_for_loss_in_pipeline_split: bool,
    /// ZeRO-1: shard Adam state (and fp32 main parameters) over the data-parallel ranks.
    #[arg(long)]
    pub use_distributed_optimizer: bool,
    /// Megatron's precision-aware optimizer: lets --exp-avg-dtype / --exp-avg-sq-dtype store
    /// Adam's moments in bf16 (with --use-distributed-optimizer, as in Megatron).
    #[arg(long)]
    pub use_precision_aware_optimizer: bool,
    /// Storage of Adam's first moment (the update computes in fp32).
    #[arg(long, value_enum, default_value = "fp32")]
    pub exp_avg_dtype: StateDtypeArg,
    /// Storage of Adam's second moment.
    #[arg(long, value_enum, default_value = "fp32")]
    pub exp_avg_sq_dtype: StateDtypeArg,
    /// Main gradients' dtype (fp32 only here: gradients are reduced and kept in fp32).
    #[arg(long, value_enum, default_value = "fp32")]
    pub main_grads_dtype: StateDtypeArg,
    /// Main parameters' dtype (fp32 only here).
    #[arg(long, value_enum, default_value = "fp32")]
    pub main_params_dtype: StateDtypeArg,
    /// Elements per gradient bucket (Megatron's default max(40M, 1M x DP)).
    #[arg(long)]
    pub ddp_bucket_size: Option<usize>,
    /// Reduce each bucket as soon as the last micro-batch's backward finished it.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// All-gather the distributed optimizer's updated parameters during the next forward,
    /// bucket by bucket, instead of right after the step.
    #[arg(long)]
    pub overlap_param_gather: bool,
    /// bf16 parameters, matmul operands and saved activations; fp32 main parameters, gradients
    /// and optimizer state; f32 accumulation.
    #[arg(long)]
    pub bf16: bool,
    /// As --bf16 with IEEE half precision, and the dynamic loss scaler.
    #[arg(long)]
    pub fp16: bool,
    /// Keep the residual stream (the hidden states between layers and pipeline stages) in
    /// fp32 under --bf16; without it they are bf16, as Megatron keeps them.
    #[arg(long)]
    pub fp32_residual_connection: bool,
    /// Instructions of bf16 matmuls: `amx` (Intel AMX tiles), `dot` (AVX512_BF16 vdpbf16ps),
    /// `fma` (operands rounded to bf16, f32 FMA GEMM) or `auto` (whichever measures fastest on
    /// this CPU, AMX among them where the CPU and OS allow it).
    #[arg(long, value_enum, default_value = "auto")]
    pub bf16_matmul_kernel: Bf16KernelArg,
    /// Constant loss scale (otherwise --fp16 scales dynamically).
    #[arg(long)]
    pub loss_scale: Option<f32>,
    #[arg(long, default_value_t = 4294967296.0)]
    pub initial_loss_scale: f32,
    #[arg(long, default_value_t = 1.0)]
    pub min_loss_scale: f32,
    #[arg(long, default_value_t = 1000)]
    pub loss_scale_window: u32,
    #[arg(long, default_value_t = 2)]
    pub hysteresis: u32,
    #[arg(long)]
    pub log_num_zeros_in_grad: bool,
    #[arg(long)]
    pub log_params_norm: bool,
    /// Gather every rank's compute time per iteration each log interval: the log line shows
    /// the fastest and slowest rank and names a rank that stays slower than the median of its
    /// pipeline stage's other ranks by --straggler-margin for --straggler-patience intervals in
    /// a row.
    #[arg(long)]
    pub log_straggler: bool,
    /// Share over the median compute time of its stage's other ranks that makes a rank slow.
    #[arg(long, default_value_t = 0.1)]
    pub straggler_margin: f64,
    /// Log intervals in a row a rank must be slow before it is named.
    #[arg(long, default_value_t = 2)]
    pub straggler_patience: usize,
    /// Testing: this world rank stops arriving (parks forever) at the start of iteration 2, as
    /// a hung or stopped process would.
    #[arg(long, hide = true)]
    pub inject_rank_stall: Option<usize>,
    /// Testing: this world rank sleeps --inject-slow-ms before each step's forward/backward,
    /// as a slow device would.
    #[arg(long, hide = true)]
    pub inject_slow_rank: Option<usize>,
    #[arg(long, hide = true, default_value_t = 0)]
    pub inject_slow_ms: u64,
    /// Testing: make the gradients of these iterations overflow (inf), as an fp16 overflow would.
    #[arg(long, hide = true, num_args = 1..)]
    pub inject_grad_overflow: Vec<u64>,
    /// Testing: a NaN in one local gradient at this iteration, on --inject-nan-grad-rank only.
    #[arg(long, hide = true)]
    pub inject_nan_grad: Option<u64>,
    #[arg(long, hide = true, default_value_t = 0)]
    pub inject_nan_grad_rank: usize,
    /// Megatron's default check: each rank looks at its own loss and gradients before the
    /// data-parallel reduction and stops the job naming itself and the tensor. This turns it
    /// off (it is off anyway under --fp16 with dynamic loss scaling, whose overflows skip steps).
    #[arg(long)]
    pub no_check_for_nan_in_loss_and_grad: bool,
    /// Write checkpoints on a background thread from copies of this rank's pieces; training
    /// goes on, at most one save is in flight, the run waits for it before exiting.
    #[arg(long)]
    pub async_save: bool,
    /// Keep only the newest N complete checkpoints under --save (older ones are deleted once a
    /// newer one is complete); 0 keeps all.
    #[arg(long, default_value_t = 0)]
    pub ckpt_keep_last: usize,
    /// On SIGTERM or SIGINT: finish the iteration, save a checkpoint (with --save) and exit 0.
    #[arg(long)]
    pub exit_signal_handler: bool,
    /// Save (with --save) and stop after the iteration that is a multiple of this.
    #[arg(long)]
    pub exit_interval: Option<u64>,
    /// Save (with --save) and stop once this many minutes of training have passed.
    #[arg(long)]
    pub exit_duration_in_mins: Option<f64>,
    /// Timeout of every collective and point-to-point operation (threads and MPI), in minutes
    /// (fractions allowed): a rank that does not arrive within it fails the job with an error
    /// naming the group, the operation and the missing ranks.
    #[arg(long, default_value_t = 10.0)]
    pub distributed_timeout_minutes: f64,
    /// 1 or more: print per-stage timers (forward, backward, p2p wait, optimizer, bubble) at
    /// every log interval.
    #[arg(long, default_value_t = 0)]
    pub timing_log_level: u8,
    /// Write a Chrome trace (chrome://tracing, Perfetto) of every rank's forwards, backwards
    /// and receives to this file.
    #[arg(long)]
    pub profile_trace: Option<String>,
    /// Split each sequence over this many ranks (two chunks each, load-balanced for causal
    /// attention).
    #[arg(long, default_value_t = 1)]
    pub context_parallel_size: usize,
    /// How attention sees the whole sequence under context parallelism: `p2p` (ring attention:
    /// keys and values pass around the ring) or `a2a` (Ulysses: all-to-all from sequence-split
    /// to head-split and back).
    #[arg(long, value_enum, default_value = "p2p")]
    pub cp_comm_type: CpCommTypeArg,
    /// Experts are split into this many blocks over the ranks of an expert-parallel group
    /// (which may span tensor- and data-parallel ranks: megatron-core's parallel folding).
    #[arg(long, default_value_t = 1)]
    pub expert_model_parallel_size: usize,
    /// Tensor parallelism inside each expert (fc1 column-, fc2 row-parallel); defaults to
    /// --tensor-model-parallel-size, as in Megatron.
    #[arg(long)]
    pub expert_tensor_parallel_size: Option<usize>,
}

#[derive(Args, Clone, Debug)]
pub struct GenerateArgs {
    /// Checkpoint directory (as given to --save).
    #[arg(long)]
    pub load: String,
    #[arg(long, default_value = "")]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// 0 means no top-k filtering.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// 0 or 1 means no nucleus filtering (0 is Megatron's "off").
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    #[arg(long)]
    pub greedy: bool,
    /// Token ids instead of text ("5 17 42"; no tokenizer needed).
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// End the output with a line of the generated ids, space separated.
    #[arg(long)]
    pub print_ids: bool,
    /// Wrap --prompt in the ChatML chat template (`<|im_start|>role ... <|im_end|>`, SmolLM2's
    /// and Qwen's) and stop at the end of the assistant's turn.
    #[arg(long)]
    pub chat: bool,
    /// The system message under --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Writes the logits of every prompt position (`[prompt tokens, vocab]`, f32 safetensors).
    #[arg(long)]
    pub logits_out: Option<std::path::PathBuf>,
    /// Weights rounded to bf16 once, every matmul on bf16 operands with f32 accumulation.
    #[arg(long)]
    pub bf16: bool,
    /// T5: the decoder's first token (default: the tokenizer's `[BOS]`, else 0 as Hugging
    /// Face's T5 starts from its pad token).
    #[arg(long)]
    pub decoder_start_id: Option<u32>,
    /// T5: the token that ends the output (default: the tokenizer's `[EOS]`, else 1, Hugging
    /// Face's T5 `</s>`).
    #[arg(long)]
    pub eos_id: Option<u32>,
}

/// The validated configuration of a run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub args: TrainArgs,
    /// Where checkpoints are loaded from and saved to, and which are kept.
    pub checkpoints: crate::checkpoint_policy::CheckpointSettings,
    pub model: TransformerConfig,
    pub precision: Precision,
    pub optimizer: OptimizerKind,
    /// `--optimizer` with its hyperparameters (under Muon: the scalar parameters' rule).
    pub update_rule: UpdateRule,
    /// `--optimizer muon`'s settings (the QKV split filled in by the model).
    pub muon: Option<megatron_core::optimizer::MuonConfig>,
    /// The tensors weight decay spares.
    pub no_weight_decay_cond: NoWeightDecayCond,
    /// How the distributed optimizer stores Adam's moments (`--exp-avg-dtype`,
    /// `--exp-avg-sq-dtype`).
    pub moment_dtypes: megatron_core::optimizer::MomentDtypes,
    /// `--dataloader-type` and `--no-data-sharding`.
    pub sample_order: crate::sample_order::SampleOrder,
    /// `--calculate-per-token-loss`.
    pub loss_reduction: megatron_core::transformer::step::LossReduction,
    /// Megatron's `check_for_nan_in_loss_and_grad`: each rank checks its own loss and
    /// gradients before they are reduced over data-parallel ranks.
    pub check_for_nan_in_loss_and_grad: bool,
    pub global_batch_size: usize,
    /// Validation and test batches: `--eval-micro-batch-size`, `--eval-global-batch-size`.
    pub eval_micro_batch_size: usize,
    pub eval_global_batch_size: usize,
    /// What a validation scores (`--full-validation`, `--multiple-validation-sets`).
    pub validation: ValidationScope,
    /// Data-parallel size (ranks / model-parallel sizes).
    pub dp: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline stages and how the layers are split over them.
    pub pp: usize,
    /// Context-parallel size (the sequence split over this many ranks) and how attention sees
    /// the whole sequence.
    pub cp: usize,
    pub cp_comm_type: megatron_core::context_parallel::CpCommType,
    /// Expert-parallel and expert-tensor-parallel sizes (1 and 1 without experts).
    pub ep: usize,
    pub etp: usize,
    pub partition: megatron_core::pipeline_parallel::partition::StagePartition,
    /// The global batch size of each iteration (ramped up under --rampup-batch-size).
    pub batches: crate::num_microbatches::BatchSizeSchedule,
    pub train_iters: u64,
    /// What `--load` does with the checkpoint's learning-rate schedule.
    pub scheduler_on_load: SchedulerOnLoad,
    /// The learning-rate schedule in samples, as Megatron's `OptimizerParamScheduler` counts.
    pub lr_decay_samples: u64,
    pub lr_warmup_samples: u64,
    pub lr_wsd_decay_samples: u64,
    pub lr_decay_style: LrDecayStyle,
    pub lr_wsd_decay_style: WsdDecayStyle,
    /// Activation recomputation.
    pub recompute: megatron_core::transformer::step::Recompute,
    pub vocab_size: usize,
    /// `--model bert`: its heads and masking.
    pub bert: Option<crate::family_bert::BertSettings>,
    /// `--model t5`: its stacks, decoder length and masking.
    pub t5: Option<crate::family_t5::T5Settings>,
}

fn bad(msg: String) -> TrainError {
    TrainError::Args(msg)
}

/// What each validation scores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValidationScope {
    /// The next `--eval-iters` evaluation batches of the validation split.
    EvalIters,
    /// `--full-validation`: the whole split, one epoch built for it.
    Full,
    /// `--multiple-validation-sets`: each dataset's whole validation set apart, with its
    /// name (`--validation-set-names`, else its position).
    FullPerDataset { names: Vec<String> },
}

impl TrainConfig {
    /// Micro-batches per data-parallel rank in an iteration at the largest global batch size
    /// (the most any iteration runs; buffers and memory predictions are sized for it).
    pub fn num_microbatches(&self) -> usize {
        let most = self.batches.batch_sizes().into_iter().max().unwrap_or(0);
        (most / self.batches.micro_times_dp) as usize
    }

    /// Training samples the run reads (Megatron's first entry of `train_val_test_num_samples`):
    /// `--train-samples`, else iterations times the global batch size.
    pub fn train_samples(&self) -> u64 {
        self.args
            .train_samples
            .unwrap_or(self.train_iters * self.global_batch_size as u64)
    }

    /// Samples one evaluation reads: `--eval-iters` evaluation batches
    /// (`--eval-global-batch-size`).
    pub fn eval_samples(&self) -> u64 {
        self.args.eval_iters * self.eval_global_batch_size as u64
    }

    /// The configuration an evaluation's micro-batches are built with: the evaluation batch
    /// sizes in place of training's (the families size their micro-batches from them).
    pub fn for_evaluation(&self) -> TrainConfig {
        let mut c = self.clone();
        c.args.micro_batch_size = self.eval_micro_batch_size;
        c.global_batch_size = self.eval_global_batch_size;
        c
    }

    /// Whether validation runs after training iteration `iteration` (Megatron's condition:
    /// every `--eval-interval`, from `--start-eval-at-iter` on).
    pub fn validates_after(&self, iteration: u64) -> bool {
        let a = &self.args;
        iteration.is_multiple_of(a.eval_interval)
            && a.start_eval_at_iter.is_none_or(|s| iteration >= s)
    }

    /// Samples of the validation and test splits to build, as Megatron's
    /// `get_train_valid_test_num_samples` counts them: every evaluation point of the run plus
    /// the one after training (one under `--skip-train`), one test pass. The validation split's
    /// size sets its shuffle, so it must be Megatron's for the same samples.
    /// Under `--full-validation` the validation split is one epoch (`None`), as Megatron
    /// builds it then.
    pub fn eval_split_samples(&self) -> (Option<u64>, u64) {
        let a = &self.args;
        let eval = self.eval_samples();
        let valid = |n: u64| match self.validation {
            ValidationScope::EvalIters => Some(n),
            ValidationScope::Full | ValidationScope::FullPerDataset { .. } => None,
        };
        if a.skip_train {
            return (valid(eval), eval);
        }
        let skipped = a.start_eval_at_iter.map_or(0, |s| s / a.eval_interval);
        let points = (self.train_iters / a.eval_interval + 1).saturating_sub(skipped);
        (valid(points * eval), eval)
    }

    /// Validation samples the evaluations before resuming at `iteration` read, for a
    /// checkpoint that does not record them (Megatron's fallback formula).
    pub fn valid_samples_before(&self, iteration: u64) -> u64 {
        let a = &self.args;
        let skipped = a.start_eval_at_iter.map_or(0, |s| s / a.eval_interval);
        (iteration / a.eval_interval).saturating_sub(skipped) * self.eval_samples()
    }

    /// Ranks of the job: data x tensor x pipeline x context parallel.
    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp * self.cp
    }
}

impl TrainArgs {
    /// Checks the flags against each other (the layout checklist) and derives the rest.
    /// Megatron's precision-aware optimizer flags, checked as megatron-core's `OptimizerConfig`
    /// checks them: other dtypes than fp32 need `--use-precision-aware-optimizer`, which needs
    /// the distributed optimizer and Adam. bf16 moments are built; fp16 and fp8 moments, and
    /// other main-gradient or main-parameter dtypes, are refused by name.
    fn moment_dtypes(&self) -> Result<megatron_core::optimizer::MomentDtypes, TrainError> {
        use megatron_core::optimizer::{MomentDtype, MomentDtypes};
        let flags = [
            ("--exp-avg-dtype", self.exp_avg_dtype),
            ("--exp-avg-sq-dtype", self.exp_avg_sq_dtype),
            ("--main-grads-dtype", self.main_grads_dtype),
            ("--main-params-dtype", self.main_params_dtype),
        ];
        if !self.use_precision_aware_optimizer {
            if let Some((flag, _)) = flags.iter().find(|f| f.1 != StateDtypeArg::Fp32) {
                return Err(bad(format!(
                    "{flag} other than fp32 needs --use-precision-aware-optimizer (as in Megatron)"
                )));
            }
            return Ok(MomentDtypes::default());
        }
        if !self.use_distributed_optimizer {
            return Err(bad(
                "--use-precision-aware-optimizer needs --use-distributed-optimizer (as in Megatron)"
                    .into(),
            ));
        }
        if self.optimizer != OptimizerArg::Adam {
            return Err(bad(
                "--use-precision-aware-optimizer needs --optimizer adam (as in Megatron)".into(),
            ));
        }
        for (flag, d) in &flags[2..] {
            if *d != StateDtypeArg::Fp32 {
                return Err(bad(format!(
                    "{flag} {d:?} is not built: gradients and main parameters are fp32 here"
                )));
            }
        }
        let moment = |(flag, d): (&str, StateDtypeArg)| match d {
            StateDtypeArg::Fp32 => Ok(MomentDtype::F32),
            StateDtypeArg::Bf16 => Ok(MomentDtype::Bf16),
            other => Err(bad(format!(
                "{flag} {other:?} is not built: moments are stored in fp32 or bf16"
            ))),
        };
        Ok(MomentDtypes {
            exp_avg: moment(flags[0])?,
            exp_avg_sq: moment(flags[1])?,
        })
    }

    /// `--full-validation`, for what Megatron builds it for: a GPT's indexed validation split.
    fn validation_scope(&self) -> Result<ValidationScope, TrainError> {
        if !self.validation_set_names.is_empty() && !self.multiple_validation_sets {
            return Err(bad(
                "--validation-set-names names the sets of --multiple-validation-sets".into(),
            ));
        }
        if self.multiple_validation_sets && !self.full_validation {
            return Err(bad(
                "--multiple-validation-sets needs --full-validation (each set is scored whole, as in Megatron-LM)".into(),
            ));
        }
        if !self.full_validation {
            return Ok(ValidationScope::EvalIters);
        }
        if self.model != ModelArg::Gpt {
            return Err(bad(format!(
                "--full-validation reads GPT datasets (Megatron's works only for them), not --model {:?}",
                self.model
            )
            .to_lowercase()));
        }
        let indexed = !self.train_data_path.is_empty()
            || megatron_data::megatron_data::is_indexed_blend(&self.data_path);
        if self.mock_data || !indexed {
            return Err(bad(
                "--full-validation scores one epoch of an indexed validation split (--data-path PREFIX with --split, or --valid-data-path PREFIX); mock data and raw text have no epoch to score"
                    .into(),
            ));
        }
        Ok(match self.multiple_validation_sets {
            true => ValidationScope::FullPerDataset {
                names: self.validation_set_names.clone(),
            },
            false => ValidationScope::Full,
        })
    }

    /// `--apply-wd-to-qk-layernorm` (or its deprecated spelling), refused without the norms it
    /// names: a flag that would change nothing is more likely a mistake than a wish.
    fn no_weight_decay_cond(&self) -> Result<NoWeightDecayCond, TrainError> {
        let flag = match (
            self.apply_wd_to_qk_layernorm,
            self.no_weight_decay_cond_type,
        ) {
            (false, None) => return Ok(NoWeightDecayCond::OneDimAndBiases),
            (true, _) => "--apply-wd-to-qk-layernorm",
            (false, Some(_)) => "--no-weight-decay-cond-type apply_wd_to_qk_layernorm",
        };
        if !self.qk_layernorm {
            return Err(bad(format!(
                "{flag} needs --qk-layernorm (the query and key norms it decays)"
            )));
        }
        Ok(NoWeightDecayCond::OneDimAndBiasesExceptQkLayernorm)
    }

    /// The element-wise rule: `--optimizer`'s, or under Muon `--muon-scalar-optimizer`'s.
    fn update_rule(&self) -> UpdateRule {
        let adam = UpdateRule::Adam {
            beta1: self.adam_beta1,
            beta2: self.adam_beta2,
            eps: self.adam_eps,
        };
        let lion = UpdateRule::Lion {
            beta1: self.lion_beta1,
            beta2: self.lion_beta2,
        };
        match (self.optimizer, self.muon_scalar_optimizer) {
            (OptimizerArg::Adam, _)
            | (
                OptimizerArg::Muon | OptimizerArg::DistMuon | OptimizerArg::AdaptiveMuon,
                MuonScalarArg::Adam,
            ) => adam,
            (OptimizerArg::Lion, _)
            | (
                OptimizerArg::Muon | OptimizerArg::DistMuon | OptimizerArg::AdaptiveMuon,
                MuonScalarArg::Lion,
            ) => lion,
            (OptimizerArg::Sgd, _) => UpdateRule::Sgd {
                momentum: self.sgd_momentum,
            },
        }
    }

    /// `--optimizer muon`'s settings, checked as megatron-core checks them.
    fn muon(
        &self,
        model: &TransformerConfig,
    ) -> Result<Option<megatron_core::optimizer::MuonConfig>, TrainError> {
        use megatron_core::optimizer::{
            MuonConfig, MuonMoment2, MuonMomentum, MuonScaleMode, MuonTpMode, NsCoefficients,
        };
        use megatron_tensor::cpu::{AdaMuonParams, NsPrecision};
        let (name, moment2) = match self.optimizer {
            OptimizerArg::Muon => ("muon", MuonMoment2::None),
            // Megatron's OptimizerConfig defaults (`adaptive_muon_beta2`, `_eps`: no flags).
            OptimizerArg::AdaptiveMuon => (
                "adaptive_muon",
                MuonMoment2::AdaMuon(AdaMuonParams {
                    beta2: 0.95,
                    eps: 1e-8,
                }),
            ),
            _ => return Ok(None),
        };
        if self.fp16 {
            return Err(bad(format!(
                "--optimizer {name} with --fp16 is not supported (as in Megatron): use --bf16"
            )));
        }
        if !(0.0..1.0).contains(&self.muon_momentum) {
            return Err(bad(format!(
                "--muon-momentum must be in [0, 1), got {}",
                self.muon_momentum
            )));
        }
        if self.muon_num_ns_steps == 0 {
            return Err(bad("--muon-num-ns-steps must be at least 1, got 0".into()));
        }
        if !(self.muon_extra_scale_factor > 0.0 && self.muon_extra_scale_factor.is_finite()) {
            return Err(bad(format!(
                "--muon-extra-scale-factor must be positive, got {}",
                self.muon_extra_scale_factor
            )));
        }
        let coefficients =
            NsCoefficients::from_name(&self.muon_coefficient_type).ok_or_else(|| {
                let names: Vec<_> = NsCoefficients::ALL.iter().map(|c| c.name()).collect();
                bad(format!(
                    "--muon-coefficient-type {}: not a coefficient set; one of {}",
                    self.muon_coefficient_type,
                    names.join(", ")
                ))
            })?;
        // megatron-core's split: per query group, its query heads, one key and one value head
        // (only a fused QKV weight; multi-latent attention has none).
        let qkv_split = (!self.muon_no_split_qkv && model.mla.is_none()).then(|| {
            let d = model.head_dim();
            let groups = model.query_groups();
            [model.num_attention_heads / groups * d, d, d]
        });
        Ok(Some(MuonConfig {
            momentum: self.muon_momentum,
            momentum_kind: if self.muon_nesterov {
                MuonMomentum::Nesterov
            } else {
                MuonMomentum::Plain
            },
            coefficients,
            num_ns_steps: self.muon_num_ns_steps,
            precision: match self.muon_fp32_matmul_prec {
                MuonMatmulPrecArg::Low | MuonMatmulPrecArg::Medium => NsPrecision::Bf16,
                MuonMatmulPrecArg::High => NsPrecision::F32,
            },
            scale_mode: match self.muon_scale_mode {
                MuonScaleModeArg::Spectral => MuonScaleMode::Spectral,
                MuonScaleModeArg::UnitRmsNorm => MuonScaleMode::UnitRmsNorm,
                MuonScaleModeArg::ShapeScaling => MuonScaleMode::ShapeScaling,
            },
            extra_scale_factor: self.muon_extra_scale_factor,
            tp_mode: match self.muon_tp_mode {
                MuonTpModeArg::Blockwise => MuonTpMode::Blockwise,
                MuonTpModeArg::Duplicated => MuonTpMode::Duplicated,
                MuonTpModeArg::Distributed => MuonTpMode::Distributed,
            },
            qkv_split,
            scalar: self.update_rule(),
            moment2,
        }))
    }

    pub fn validate(&self, vocab_size: usize) -> Result<TrainConfig, TrainError> {
        if self.data_args_path.is_some() || self.per_split_data_args_path.is_some() {
            return self.with_data_args_files()?.validate(vocab_size);
        }
        if self.optimizer == OptimizerArg::DistMuon {
            eprintln!(
                "warning: --optimizer dist_muon is deprecated (as in Megatron): use --optimizer muon \
                 --use-distributed-optimizer"
            );
            let mut a = self.clone();
            a.optimizer = OptimizerArg::Muon;
            a.use_distributed_optimizer = true;
            return a.validate(vocab_size);
        }
        if self.micro_batch_size == 0 {
            return Err(bad("--micro-batch-size must be positive, got 0".into()));
        }
        if self.nproc_per_node == 0 {
            return Err(bad("--nproc-per-node must be positive, got 0".into()));
        }
        if self.exit_interval == Some(0) {
            return Err(bad("--exit-interval must be positive, got 0".into()));
        }
        if let Some(m) = self.exit_duration_in_mins {
            if !(m >= 0.0 && m.is_finite()) {
                return Err(bad(format!(
                    "--exit-duration-in-mins must be a non-negative number, got {m}"
                )));
            }
        }
        if !(self.distributed_timeout_minutes > 0.0 && self.distributed_timeout_minutes.is_finite())
        {
            return Err(bad(format!(
                "--distributed-timeout-minutes must be positive, got {}",
                self.distributed_timeout_minutes
            )));
        }
        for (flag, v) in [
            ("--lr", self.lr),
            ("--min-lr", self.min_lr),
            ("--lr-warmup-init", self.lr_warmup_init),
            ("--weight-decay", f64::from(self.weight_decay)),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(format!(
                    "{flag} must be a non-negative number, got {v}"
                )));
            }
        }
        // torch.optim.Adam's own checks: a beta of 1 or more makes the bias correction
        // 1 - beta^t zero or negative, and the first step divides by it.
        for (flag, v) in [
            ("--adam-beta1", self.adam_beta1),
            ("--adam-beta2", self.adam_beta2),
            ("--lion-beta1", self.lion_beta1),
            ("--lion-beta2", self.lion_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(bad(format!("{flag} must be in [0, 1), got {v}")));
            }
        }
        for (flag, v) in [
            ("--decoupled-lr", self.decoupled_lr),
            ("--decoupled-min-lr", self.decoupled_min_lr),
        ] {
            if let Some(v) = v.filter(|v| !(*v >= 0.0 && v.is_finite())) {
                return Err(bad(format!(
                    "{flag} must be a non-negative number, got {v}"
                )));
            }
        }
        if self.decoupled_min_lr.is_some() && self.decoupled_lr.is_none() {
            return Err(bad(
                "--decoupled-min-lr needs --decoupled-lr (the group it is the floor of)".into(),
            ));
        }
        for (flag, v) in [
            ("--adam-eps", self.adam_eps),
            ("--sgd-momentum", self.sgd_momentum),
            ("--init-method-std", self.init_method_std),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(format!(
                    "{flag} must be a non-negative number, got {v}"
                )));
            }
        }
        if self.make_vocab_size_divisible_by == 0 {
            return Err(bad(
                "--make-vocab-size-divisible-by must be positive, got 0 (1 pads nothing)".into(),
            ));
        }
        if !(self.straggler_margin > 0.0 && self.straggler_margin.is_finite()) {
            return Err(bad(format!(
                "--straggler-margin must be positive, got {}",
                self.straggler_margin
            )));
        }
        if self.straggler_patience == 0 {
            return Err(bad("--straggler-patience must be at least 1".into()));
        }
        if self.fp16 && self.bf16 {
            return Err(bad("give only one of --fp16 and --bf16".into()));
        }
        if self.bf16_matmul_kernel != Bf16KernelArg::Auto && !self.bf16 {
            return Err(bad(format!(
                "--bf16-matmul-kernel {} only applies with --bf16",
                self.bf16_matmul_kernel
                    .to_possible_value()
                    .map_or_else(String::new, |v| v.get_name().to_string())
            )));
        }
        if self.bf16_matmul_kernel == Bf16KernelArg::Amx {
            if let Some(why) = megatron_tensor::cpu::amx::amx_unavailable_reason() {
                return Err(bad(format!(
                    "--bf16-matmul-kernel amx: AMX is not usable here: {why}"
                )));
            }
        }
        if self.overlap_param_gather && !self.use_distributed_optimizer {
            return Err(bad(
                "--overlap-param-gather needs --use-distributed-optimizer (only it all-gathers parameters)".into(),
            ));
        }
        if self.loss_scale.is_some_and(|s| s <= 0.0) || self.initial_loss_scale <= 0.0 {
            return Err(bad(
                "--loss-scale / --initial-loss-scale must be positive".into()
            ));
        }
        // --use-checkpoint-args: the checkpoint's model, read before the layout (its layers are
        // what the pipeline splits).
        let checkpoints = crate::checkpoint_policy::CheckpointSettings::from_args(self)?;
        let ckpt_model = if self.use_checkpoint_args {
            Some(self.checkpoint_model(&checkpoints, self.tensor_model_parallel_size.max(1))?)
        } else {
            None
        };
        let num_layers = ckpt_model
            .as_ref()
            .map_or(self.num_layers, |m| m.num_layers);
        let (tp, pp, vp, partition) = self.layout(num_layers)?;
        let cp = self.context_parallel()?;
        if !self.nproc_per_node.is_multiple_of(tp * pp * cp) {
            return Err(bad(format!(
                "--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) must divide the number of ranks (--nproc-per-node {}, or the MPI world)",
                self.nproc_per_node
            )));
        }
        let dp = self.nproc_per_node / (tp * pp * cp);
        let gbs = self.global_batch_size.unwrap_or(self.micro_batch_size * dp);
        if gbs == 0 || !gbs.is_multiple_of(self.micro_batch_size * dp) {
            return Err(bad(format!(
                "--global-batch-size ({gbs}) must be a positive multiple of --micro-batch-size ({}) times the data-parallel size ({dp})",
                self.micro_batch_size
            )));
        }
        if !(self.mid_level_dataset_surplus >= 0.0 && self.mid_level_dataset_surplus.is_finite()) {
            return Err(bad(format!(
                "--mid-level-dataset-surplus ({}) must be a non-negative fraction",
                self.mid_level_dataset_surplus
            )));
        }
        let eval_mbs = self.eval_micro_batch_size.unwrap_or(self.micro_batch_size);
        let eval_gbs = self.eval_global_batch_size.unwrap_or(gbs);
        if eval_mbs == 0 || eval_gbs == 0 || !eval_gbs.is_multiple_of(eval_mbs * dp) {
            return Err(bad(format!(
                "--eval-global-batch-size ({eval_gbs}) must be a positive multiple of --eval-micro-batch-size ({eval_mbs}) times the data-parallel size ({dp})"
            )));
        }
        let rampup = match self.rampup_batch_size.as_deref() {
            None => None,
            Some(&[start, increment, samples]) => Some(crate::num_microbatches::Rampup {
                start,
                increment,
                samples,
            }),
            Some(other) => {
                return Err(bad(format!(
                    "--rampup-batch-size takes START INCREMENT SAMPLES, got {other:?}"
                )))
            }
        };
        let batches = match &self.step_batch_size_schedule {
            None => crate::num_microbatches::BatchSizeSchedule::new(
                gbs as u64,
                (self.micro_batch_size * dp) as u64,
                rampup,
            )?,
            Some(_) if self.global_batch_size.is_some() => {
                return Err(bad(
                    "give only one of --step-batch-size-schedule and --global-batch-size (as Megatron-LM)".into(),
                ))
            }
            Some(_) if rampup.is_some() => {
                return Err(bad(
                    "give only one of --step-batch-size-schedule and --rampup-batch-size (megatron-core replaced the ramp with the schedule and ignores it)".into(),
                ))
            }
            Some(text) => crate::num_microbatches::BatchSizeSchedule::stepped(
                crate::num_microbatches::parse_step_schedule(text, self.seq_length as u64)?,
                (self.micro_batch_size * dp) as u64,
            ),
        };
        let train_iters = match (self.train_iters, self.train_samples) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "give only one of --train-iters and --train-samples".into()
                ))
            }
            (Some(0), None) | (None, Some(0)) => {
                return Err(bad(
                    "--train-iters / --train-samples must be positive".into()
                ))
            }
            (Some(i), None) => i,
            (None, Some(s)) => match batches.train_iters(s) {
                0 => {
                    return Err(bad(format!(
                        "--train-samples ({s}) holds no whole global batch ({gbs})"
                    )))
                }
                i => i,
            },
            (None, None) => {
                return Err(bad(
                    "one of --train-iters or --train-samples is required".into()
                ))
            }
        };
        let (lr_decay_style, lr_wsd_decay_style, schedule) = self.lr_schedule(train_iters, gbs)?;
        for (flag, v) in [
            ("--log-interval", self.log_interval),
            ("--eval-interval", self.eval_interval),
            ("--tensorboard-log-interval", self.tensorboard_log_interval),
        ] {
            if v == 0 {
                return Err(bad(format!("{flag} must be positive, got 0")));
            }
        }
        if !self.mock_data && self.data_path.is_empty() && self.train_data_path.is_empty() {
            return Err(bad("give --data-path PREFIX|FILE|DIR ..., --train-data-path PREFIX ..., or --mock-data".into()));
        }
        if self.num_threads == Some(0) {
            return Err(bad("--num-threads must be positive, got 0".into()));
        }
        let from_checkpoint = ckpt_model.is_some();
        let mut model = match ckpt_model {
            Some(m) => m,
            None => self.model_config(vocab_size, tp)?,
        };
        // T5's stacks keep their own f32 stream.
        let stream_in_bf16 = matches!(self.model, ModelArg::Gpt | ModelArg::Bert);
        model.residual = if self.bf16 && !self.fp32_residual_connection && stream_in_bf16 {
            ResidualPrecision::BF16
        } else {
            ResidualPrecision::F32
        };
        let bert = self.bert_settings(&mut model, cp, from_checkpoint)?;
        let t5 = self.t5_settings(&model, cp)?;
        if model.mtp.is_some() {
            let why = if self.model != ModelArg::Gpt {
                Some("it predicts with the decoder's output layer (GPT and the Llama family)")
            } else if pp > 1
                && model.position_embedding_type == PositionEmbeddingType::LearnedAbsolute
            {
                Some("under pipeline parallelism the last stage embeds the shifted tokens with a copy of the word embedding only, so the learned position embedding is not built there: use --position-embedding-type rope (or --pipeline-model-parallel-size 1)")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(bad(format!("--mtp-num-layers: {why}")));
            }
        }
        if self.sequence_parallel
            && tp > 1
            && !(self.micro_batch_size * self.seq_length).is_multiple_of(tp)
        {
            return Err(bad(format!(
                "--sequence-parallel: the tokens of a micro-batch (--micro-batch-size {} x --seq-length {}) must be divisible by --tensor-model-parallel-size ({tp})",
                self.micro_batch_size, self.seq_length
            )));
        }
        let (ep, etp) = self.expert_layout(&model, tp, pp, dp)?;
        if cp > 1 && self.cp_comm_type == CpCommTypeArg::A2a {
            let (heads, groups) = (model.num_attention_heads / tp, model.query_groups() / tp);
            if !heads.is_multiple_of(cp) || !groups.is_multiple_of(cp) {
                return Err(bad(format!(
                    "--cp-comm-type a2a splits each tensor-parallel rank's {heads} attention heads in {groups} query groups over --context-parallel-size {cp}: both must be divisible by it"
                )));
            }
        }
        let recompute = self.recompute()?;
        if vp > 1 {
            // Every iteration's count, the ramp's included (a stepped size that does not
            // split into micro-batches is refused when reached).
            for size in batches
                .batch_sizes()
                .into_iter()
                .filter(|b| b.is_multiple_of(batches.micro_times_dp))
            {
                let m = size as usize / (self.micro_batch_size * dp);
                megatron_core::pipeline_parallel::interleaved::check(pp, m, vp).map_err(|e| {
                    bad(format!(
                        "{e} (micro-batches = global batch size {size} / (--micro-batch-size {} x data-parallel size {dp}); see --global-batch-size and --rampup-batch-size)",
                        self.micro_batch_size
                    ))
                })?;
            }
        }
        let mut args = self.clone();
        if let (ModelArg::T5, Some(e)) = (self.model, self.encoder_seq_length) {
            // Megatron's --encoder-seq-length is the run's sequence length.
            args.seq_length = e;
        }
        let muon = self.muon(&model)?;
        Ok(TrainConfig {
            args,
            checkpoints,
            model,
            precision: if self.bf16 {
                Precision::BF16
            } else if self.fp16 {
                Precision::F16
            } else {
                Precision::F32
            },
            optimizer: if self.use_distributed_optimizer {
                OptimizerKind::Distributed
            } else {
                OptimizerKind::Replicated
            },
            update_rule: self.update_rule(),
            muon,
            no_weight_decay_cond: self.no_weight_decay_cond()?,
            moment_dtypes: self.moment_dtypes()?,
            sample_order: crate::sample_order::SampleOrder::from_args(
                self.dataloader_type,
                self.no_data_sharding,
            )?,
            loss_reduction: if self.calculate_per_token_loss {
                megatron_core::transformer::step::LossReduction::TokenSum
            } else {
                megatron_core::transformer::step::LossReduction::MicroBatchMean
            },
            // As Megatron: under dynamic loss scaling non-finite gradients are the scaler's
            // signal to skip a step, not an error.
            check_for_nan_in_loss_and_grad: !(self.no_check_for_nan_in_loss_and_grad
                || (self.fp16 && self.loss_scale.is_none())),
            global_batch_size: gbs,
            eval_micro_batch_size: eval_mbs,
            eval_global_batch_size: eval_gbs,
            validation: self.validation_scope()?,
            dp,
            tp,
            pp,
            cp,
            cp_comm_type: match self.cp_comm_type {
                CpCommTypeArg::P2p => megatron_core::context_parallel::CpCommType::P2p,
                CpCommTypeArg::A2a => megatron_core::context_parallel::CpCommType::A2a,
            },
            ep,
            etp,
            partition,
            train_iters,
            lr_decay_style,
            lr_wsd_decay_style,
            batches,
            scheduler_on_load: match (
                self.override_opt_param_scheduler,
                self.use_checkpoint_opt_param_scheduler,
            ) {
                (true, true) => {
                    return Err(bad(
                        "give only one of --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler".into(),
                    ))
                }
                (true, false) => SchedulerOnLoad::Override,
                (false, true) => SchedulerOnLoad::UseCheckpoint,
                (false, false) => SchedulerOnLoad::Check,
            },
            lr_decay_samples: schedule.decay,
            lr_warmup_samples: schedule.warmup,
            lr_wsd_decay_samples: schedule.wsd_decay,
            recompute,
            vocab_size,
            bert,
            t5,
        })
    }

    /// `--model t5`: the stacks and the flags T5 refuses, named.
    fn t5_settings(
        &self,
        model: &TransformerConfig,
        cp: usize,
    ) -> Result<Option<crate::family_t5::T5Settings>, TrainError> {
        if self.model != ModelArg::T5 {
            return Ok(None);
        }
        let refuse = |on: bool, flag: &str, why: &str| {
            if on {
                Err(bad(format!("--model t5: {flag} is not supported ({why})")))
            } else {
                Ok(())
            }
        };
        refuse(
            cp > 1,
            "--context-parallel-size > 1",
            "context parallelism is built for decoders",
        )?;
        refuse(
            self.reset_attention_mask || self.reset_position_ids,
            "--reset-attention-mask / --reset-position-ids",
            "samples are spans of sentences",
        )?;
        refuse(
            self.mock_data,
            "--mock-data",
            "T5 samples are built from a sentence-split dataset",
        )?;
        refuse(
            self.fim.fim_data,
            "--fim-data",
            "fill-in-the-middle samples are GPT samples",
        )?;
        refuse(
            model.moe.is_some(),
            "--num-experts",
            "mixture-of-experts T5 is not built",
        )?;
        refuse(
            model.window.is_some(),
            "--window-size",
            "sliding-window T5 is not built",
        )?;
        refuse(
            model.softmax_type != SoftmaxType::Vanilla,
            "--softmax-type",
            "T5 with attention sinks is not built",
        )?;
        refuse(
            model.mla.is_some(),
            "--multi-latent-attention",
            "T5's attention has its relative position bias, not rotary features",
        )?;
        refuse(
            self.calculate_per_token_loss,
            "--calculate-per-token-loss",
            "Megatron's T5 loss is each micro-batch's mean",
        )?;
        refuse(
            self.tokenizer.vocab_extra_ids == 0,
            "--vocab-extra-ids 0",
            "span corruption needs sentinel tokens (Megatron's recipe uses 100)",
        )?;
        if !(self.mask_prob > 0.0 && self.mask_prob < 1.0) {
            return Err(bad(format!(
                "--mask-prob must be in (0, 1), got {}",
                self.mask_prob
            )));
        }
        // The decoder reads [BOS], then a sentinel and the tokens of each masked span: at most
        // twice the masked tokens plus one (Megatron asserts it per sample; here it is checked
        // once, before any sample is drawn).
        let encoder = self.encoder_seq_length.unwrap_or(self.seq_length);
        let worst = 1 + 2 * (self.mask_prob * encoder.saturating_sub(2) as f64).floor() as usize;
        if self.decoder_seq_length < worst {
            return Err(bad(format!(
                "--decoder-seq-length {} is too short for --mask-prob {} of --encoder-seq-length {encoder}: a sample's decoder input can reach {worst} tokens",
                self.decoder_seq_length, self.mask_prob
            )));
        }
        let tp = self.tensor_model_parallel_size;
        if self.sequence_parallel
            && tp > 1
            && !(self.micro_batch_size * self.decoder_seq_length).is_multiple_of(tp)
        {
            return Err(bad(format!(
                "--sequence-parallel: the decoder's tokens of a micro-batch (--micro-batch-size {} x --decoder-seq-length {}) must be divisible by --tensor-model-parallel-size ({tp})",
                self.micro_batch_size, self.decoder_seq_length
            )));
        }
        Ok(Some(crate::family_t5::T5Settings {
            stacks: megatron_core::models::t5::T5Stacks {
                encoder_layers: self.encoder_num_layers.unwrap_or(self.num_layers),
                decoder_layers: self.decoder_num_layers.unwrap_or(self.num_layers),
                relative_buckets: self.relative_attention_num_buckets,
                relative_max_distance: self.relative_attention_max_distance,
                softmax_scale: 1.0,
                // Tied: the original T5's rescaled output; untied: T5 v1.1's.
                scale_decoder_outputs: !model.untie_embeddings_and_output_weights,
            },
            decoder_seq_length: self.decoder_seq_length,
            mask_prob: self.mask_prob,
            short_seq_prob: self.short_seq_prob,
        }))
    }

    /// `--model bert`: the encoder's attention and norms set on `model`, the flags BERT
    /// refuses named, the heads and masking settings.
    fn bert_settings(
        &self,
        model: &mut TransformerConfig,
        cp: usize,
        from_checkpoint: bool,
    ) -> Result<Option<crate::family_bert::BertSettings>, TrainError> {
        use megatron_core::models::bert::{BertHeads, BinaryHead};
        if self.model != ModelArg::Bert {
            if self.transformer_block_type != BlockTypeArg::PreLn {
                return Err(bad(
                    "--transformer-block-type post_ln is built for --model bert".into(),
                ));
            }
            return Ok(None);
        }
        let refuse = |on: bool, flag: &str, why: &str| {
            if on {
                Err(bad(format!(
                    "--model bert: {flag} is not supported ({why})"
                )))
            } else {
                Ok(())
            }
        };
        refuse(
            cp > 1,
            "--context-parallel-size > 1",
            "the ring and all-to-all attention are causal",
        )?;
        refuse(
            self.reset_attention_mask,
            "--reset-attention-mask",
            "samples are sentence pairs, not packed documents",
        )?;
        refuse(
            self.reset_position_ids,
            "--reset-position-ids",
            "samples are sentence pairs, not packed documents",
        )?;
        refuse(
            self.mock_data,
            "--mock-data",
            "BERT samples are built from a sentence-split dataset",
        )?;
        refuse(
            self.fim.fim_data,
            "--fim-data",
            "fill-in-the-middle samples are GPT samples",
        )?;
        refuse(
            self.calculate_per_token_loss,
            "--calculate-per-token-loss",
            "Megatron's BERT loss is each micro-batch's mean, with its sentence-order loss",
        )?;
        refuse(
            model.untie_embeddings_and_output_weights,
            "--untie-embeddings-and-output-weights",
            "the MLM head's output layer is the word embedding",
        )?;
        refuse(
            model.moe.is_some(),
            "--num-experts",
            "mixture-of-experts BERT is not built",
        )?;
        refuse(
            model.mla.is_some(),
            "--multi-latent-attention",
            "BERT learns its positions; MLA rotates its queries and keys",
        )?;
        refuse(
            model.position_embedding_type
                != megatron_core::transformer::config::PositionEmbeddingType::LearnedAbsolute,
            "--position-embedding-type other than learned_absolute",
            "BERT learns its positions",
        )?;
        if !(self.mask_prob > 0.0 && self.mask_prob < 1.0) {
            return Err(bad(format!(
                "--mask-prob must be in (0, 1), got {}",
                self.mask_prob
            )));
        }
        if !(0.0..=1.0).contains(&self.short_seq_prob) {
            return Err(bad(format!(
                "--short-seq-prob must be in [0, 1], got {}",
                self.short_seq_prob
            )));
        }
        // A sample is [CLS] A [SEP] B [SEP]: the target length (Megatron's
        // `get_target_sample_len`, 2 + r % (seq - 4)) needs at least two tokens of text.
        if self.seq_length < 5 {
            return Err(bad(format!(
                "--model bert: --seq-length must be at least 5 ([CLS], two [SEP] and a token on each side), got {}",
                self.seq_length
            )));
        }
        if model.window.is_some() {
            return Err(bad("--model bert: --window-size is built for causal decoders (BERT's attention sees the whole sequence)".into()));
        }
        if model.softmax_type != SoftmaxType::Vanilla {
            return Err(bad("--model bert: --softmax-type off-by-one/learnable is built for decoders (gpt-oss); BERT keeps the plain softmax".into()));
        }
        model.attn_mask_type = megatron_core::transformer::config::AttnMaskType::Padding;
        // A checkpoint's model (--use-checkpoint-args: a converted BERT is post-LN) keeps its
        // LayerNorm placement.
        if !from_checkpoint {
            model.layernorm_placement = match self.transformer_block_type {
                BlockTypeArg::PreLn => {
                    megatron_core::transformer::config::LayerNormPlacement::PreLn
                }
                BlockTypeArg::PostLn => {
                    megatron_core::transformer::config::LayerNormPlacement::PostLn
                }
            };
        }
        let binary = if self.bert_no_binary_head {
            BinaryHead::None
        } else {
            BinaryHead::SentenceOrder
        };
        Ok(Some(crate::family_bert::BertSettings {
            heads: BertHeads::megatron(binary),
            mask_prob: self.mask_prob,
            short_seq_prob: self.short_seq_prob,
        }))
    }

    /// `--position-embedding-type` after Megatron's legacy RoPE flags.
    fn position_embedding(&self) -> Result<PositionEmbeddingArg, TrainError> {
        let t = if self.use_rotary_position_embeddings {
            PositionEmbeddingArg::Rope
        } else {
            self.position_embedding_type
        };
        if self.no_position_embedding
            && !matches!(t, PositionEmbeddingArg::Rope | PositionEmbeddingArg::Yarn)
        {
            return Err(bad("--no-position-embedding is deprecated, use --position-embedding-type (as Megatron says; with rope it is accepted: rope has no learned position embedding)".into()));
        }
        Ok(t)
    }

    /// `--rotary-seq-len-interpolation-factor`, checked: positive, and one context extension.
    fn seq_len_interpolation(&self) -> Result<Option<f64>, TrainError> {
        let Some(f) = self.rotary_seq_len_interpolation_factor else {
            return Ok(None);
        };
        if !(f > 0.0 && f.is_finite()) {
            return Err(bad(format!(
                "--rotary-seq-len-interpolation-factor must be positive, got {f}"
            )));
        }
        let other = if self.use_rope_scaling {
            Some("--use-rope-scaling")
        } else if self.position_embedding()? == PositionEmbeddingArg::Yarn {
            Some("--position-embedding-type yarn")
        } else {
            None
        };
        if let Some(o) = other {
            return Err(bad(format!(
                "--rotary-seq-len-interpolation-factor and {o} are two context extensions: pass one"
            )));
        }
        Ok(Some(f))
    }

    /// `--position-embedding-type yarn` and its flags, checked.
    /// Under `--multi-latent-attention` with `--position-embedding-type rope`, YaRN unless
    /// `--rope-type rope`, as megatron-core's `MLATransformerConfig` defaults (at Megatron's
    /// default --rotary-scaling-factor 1 it rotates as RoPE does).
    fn yarn(&self) -> Result<Option<megatron_core::transformer::config::YarnConfig>, TrainError> {
        let position = self.position_embedding()?;
        if self.rope_type == Some(RopeTypeArg::Yarn) && !self.multi_latent_attention {
            return Err(bad(
                "--rope-type yarn is for --multi-latent-attention (Megatron: common attention only supports rope_type \"rope\"; use --position-embedding-type yarn)".into(),
            ));
        }
        // (At factor 1 YaRN rotates as RoPE does: the model stays a RoPE one.)
        let mla_yarn = self.multi_latent_attention
            && position == PositionEmbeddingArg::Rope
            && self.rope_type != Some(RopeTypeArg::Rope)
            && self.rotary_scaling_factor != 1.0;
        if position != PositionEmbeddingArg::Yarn && !mla_yarn {
            return Ok(None);
        }
        if self.use_rope_scaling {
            return Err(bad(
                "--use-rope-scaling (Llama 3.1's) and --position-embedding-type yarn are two context extensions: pass one".into(),
            ));
        }
        for (flag, v) in [
            ("--rotary-scaling-factor", self.rotary_scaling_factor),
            ("--yarn-beta-fast", self.yarn_beta_fast),
            ("--yarn-beta-slow", self.yarn_beta_slow),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(bad(format!("{flag} must be positive, got {v}")));
            }
        }
        if self.yarn_original_max_position_embeddings == 0 {
            return Err(bad(
                "--yarn-original-max-position-embeddings must be positive, got 0".into(),
            ));
        }
        if self.no_yarn_correction_range_round_to_int && self.yarn_correction_range_round_to_int {
            return Err(bad("give one of --yarn-correction-range-round-to-int and --no-yarn-correction-range-round-to-int".into()));
        }
        Ok(Some(megatron_core::transformer::config::YarnConfig {
            factor: self.rotary_scaling_factor,
            original_max_position_embeddings: self.yarn_original_max_position_embeddings,
            beta_fast: self.yarn_beta_fast,
            beta_slow: self.yarn_beta_slow,
            mscale: self.mscale,
            mscale_all_dim: self.mscale_all_dim,
            correction_range_round_to_int: !self.no_yarn_correction_range_round_to_int,
        }))
    }

    /// `--multi-latent-attention` and its widths; the MLA flags without it are refused.
    fn mla_config(&self) -> Result<Option<MLAConfig>, TrainError> {
        if !self.multi_latent_attention {
            if self.q_lora_rank.is_some() {
                return Err(bad(
                    "--q-lora-rank is a width of multi-latent attention: it needs --multi-latent-attention".into(),
                ));
            }
            return Ok(None);
        }
        if self.group_query_attention {
            return Err(bad("--multi-latent-attention and --group-query-attention are mutually exclusive (as Megatron asserts)".into()));
        }
        if self.kv_channels.is_some() {
            return Err(bad("--kv-channels does not apply under --multi-latent-attention: its head widths are --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim".into()));
        }
        Ok(Some(MLAConfig {
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            qk_head_dim: self.qk_head_dim,
            qk_pos_emb_head_dim: self.qk_pos_emb_head_dim,
            v_head_dim: self.v_head_dim,
        }))
    }

    /// The MLP's activation: `--swiglu`, `--squared-relu`, `--quick-geglu` (at most one, as
    /// Megatron asserts), else GELU.
    fn activation(&self) -> Result<Activation, TrainError> {
        let chosen: Vec<(&str, Activation)> = [
            (self.swiglu, "--swiglu", Activation::SwiGLU),
            (self.squared_relu, "--squared-relu", Activation::SquaredRelu),
            (self.quick_geglu, "--quick-geglu", Activation::QuickGeGLU),
        ]
        .into_iter()
        .filter(|(on, _, _)| *on)
        .map(|(_, flag, a)| (flag, a))
        .collect();
        match chosen.as_slice() {
            [] => Ok(Activation::Gelu),
            [(_, a)] => Ok(*a),
            [(a, _), (b, _), ..] => Err(bad(format!(
                "{a} and {b} choose two MLP activations: pass one"
            ))),
        }
    }

    /// `--glu-linear-offset` and `--activation-func-clamp-value`, where megatron-core applies
    /// them: Quick-GEGLU takes both; SwiGLU only the clamp, and only on MoE models.
    fn glu_config(&self, activation: Activation) -> Result<GluConfig, TrainError> {
        let glu = GluConfig {
            linear_offset: self.glu_linear_offset,
            clamp_value: self.activation_func_clamp_value,
        };
        if !self.glu_linear_offset.is_finite() {
            return Err(bad(format!(
                "--glu-linear-offset must be a finite number, got {}",
                self.glu_linear_offset
            )));
        }
        if let Some(c) = glu.clamp_value {
            if !(c.is_finite() && c > 0.0) {
                return Err(bad(format!(
                    "--activation-func-clamp-value must be finite and greater than zero, got {c}"
                )));
            }
        }
        match activation {
            _ if glu.is_default() => {}
            Activation::QuickGeGLU => {}
            Activation::SwiGLU if glu.linear_offset != 0.0 => {
                return Err(bad("--glu-linear-offset is built for --quick-geglu (megatron-core fuses the offset only there, and wants it zero when SwiGLU is clamped)".into()));
            }
            Activation::SwiGLU if self.num_experts.is_none() => {
                return Err(bad("--activation-func-clamp-value with --swiglu needs --num-experts (megatron-core: the SwiGLU clamp is only supported with MoE)".into()));
            }
            Activation::SwiGLU => {}
            _ => {
                let flag = if glu.linear_offset != 0.0 {
                    "--glu-linear-offset"
                } else {
                    "--activation-func-clamp-value"
                };
                return Err(bad(format!(
                    "{flag} acts on a gated unit: pass --quick-geglu (gpt-oss) or --swiglu"
                )));
            }
        }
        Ok(glu)
    }

    /// `--window-size` and `--window-attn-skip-freq`.
    fn sliding_window(&self) -> Result<Option<SlidingWindow>, TrainError> {
        use crate::layer_pattern::{parse_layer_pattern, parse_window_size};
        let left = match &self.window_size {
            Some(w) => parse_window_size(w).map_err(bad)?,
            None => None,
        };
        let skip = match &self.window_attn_skip_freq {
            Some(p) => Some(parse_layer_pattern("--window-attn-skip-freq", p).map_err(bad)?),
            None => None,
        };
        Ok(match (left, skip) {
            (Some(left), skip) => Some(SlidingWindow { left, skip }),
            (None, Some(_)) if self.window_size.is_none() => return Err(bad(
                "--window-attn-skip-freq picks the layers without a window: it needs --window-size"
                    .into(),
            )),
            (None, _) => None,
        })
    }

    /// The model's `TransformerConfig` from the model flags, checked, and checked against
    /// the tensor-parallel size `tp`.
    fn model_config(&self, vocab_size: usize, tp: usize) -> Result<TransformerConfig, TrainError> {
        let activation = self.activation()?;
        let model = TransformerConfig {
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            ffn_hidden_size: self.ffn_hidden_size.unwrap_or_else(|| {
                TransformerConfig::default_ffn_hidden_size(self.hidden_size, activation)
            }),
            seq_length: self.seq_length,
            max_position_embeddings: self.max_position_embeddings.unwrap_or(self.seq_length),
            padded_vocab_size: TransformerConfig::pad_vocab(
                vocab_size,
                self.make_vocab_size_divisible_by * self.tensor_model_parallel_size,
            ),
            hidden_dropout: self.hidden_dropout,
            attention_dropout: self.attention_dropout,
            init_method_std: self.init_method_std,
            layernorm_epsilon: self.norm_epsilon,
            untie_embeddings_and_output_weights: self.untie_embeddings_and_output_weights,
            normalization: match self.normalization {
                NormalizationArg::LayerNorm => Normalization::LayerNorm,
                NormalizationArg::RMSNorm => Normalization::RMSNorm,
            },
            activation,
            position_embedding_type: match self.position_embedding()? {
                PositionEmbeddingArg::LearnedAbsolute => PositionEmbeddingType::LearnedAbsolute,
                PositionEmbeddingArg::Rope | PositionEmbeddingArg::Yarn => {
                    PositionEmbeddingType::Rope
                }
                PositionEmbeddingArg::None => PositionEmbeddingType::None,
            },
            rotary: RotaryConfig {
                base: self.rotary_base,
                percent: self.rotary_percent,
                interleaved: self.rotary_interleaved,
                scaling_factor: self.use_rope_scaling.then_some(self.rope_scaling_factor),
                yarn: self.yarn()?,
                seq_len_interpolation_factor: self.seq_len_interpolation()?,
            },
            num_query_groups: self.group_query_attention.then_some(self.num_query_groups),
            kv_channels: self.kv_channels,
            add_bias_linear: !self.disable_bias_linear,
            add_qkv_bias: !self.disable_bias_linear || self.add_qkv_bias,
            qk_layernorm: self.qk_layernorm,
            moe: self.moe_config()?,
            attn_mask_type: Default::default(),
            gelu: if self.no_bias_gelu_fusion {
                GeluForm::Erf
            } else {
                GeluForm::Tanh
            },
            layernorm_placement: Default::default(),
            window: self.sliding_window()?,
            mla: self.mla_config()?,
            mtp: self.mtp_num_layers.map(|n| MTPConfig {
                num_layers: n,
                loss_scaling_factor: self.mtp_loss_scaling_factor,
            }),
            glu: self.glu_config(activation)?,
            softmax_type: match self.softmax_type {
                SoftmaxTypeArg::Vanilla => SoftmaxType::Vanilla,
                SoftmaxTypeArg::OffByOne => SoftmaxType::OffByOne,
                SoftmaxTypeArg::Learnable => SoftmaxType::Learnable,
            },
            residual: Default::default(),
        };
        model.validate()?;
        if self.group_query_attention && !model.query_groups().is_multiple_of(tp) {
            return Err(bad(format!(
                "--num-query-groups ({}) must be divisible by --tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole query groups (as megatron-core requires)",
                model.query_groups()
            )));
        }
        for (what, v) in [
            ("--num-attention-heads", model.num_attention_heads),
            ("--ffn-hidden-size", model.ffn_hidden_size),
        ] {
            if !v.is_multiple_of(tp) {
                return Err(bad(format!(
                    "{what} ({v}) must be divisible by --tensor-model-parallel-size ({tp})"
                )));
            }
        }
        Ok(model)
    }

    /// The parallel layout: tensor- and pipeline-parallel sizes, model chunks per stage and how
    /// the layers split over stages.
    fn layout(
        &self,
        num_layers: usize,
    ) -> Result<
        (
            usize,
            usize,
            usize,
            megatron_core::pipeline_parallel::partition::StagePartition,
        ),
        TrainError,
    > {
        let tp = self.tensor_model_parallel_size;
        if tp == 0 || !self.nproc_per_node.is_multiple_of(tp) {
            return Err(bad(format!(
                "--tensor-model-parallel-size ({tp}) must divide the number of ranks (--nproc-per-node {}, or the MPI world)",
                self.nproc_per_node
            )));
        }
        let (pp, encoder) = self.pipeline_stages()?;
        if pp == 0 || !self.nproc_per_node.is_multiple_of(tp * pp) {
            return Err(bad(format!(
                "--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) must divide the number of ranks (--nproc-per-node {}, or the MPI world)",
                self.nproc_per_node
            )));
        }
        let accounted = usize::from(self.account_for_embedding_in_pipeline_split)
            + usize::from(self.account_for_loss_in_pipeline_split);
        let layout = self
            .pipeline_model_parallel_layout
            .as_deref()
            .map(|s| self.layer_layout(s, pp, num_layers))
            .transpose()?;
        let vp = match self.num_layers_per_virtual_pipeline_stage {
            None if layout.is_some() => layout.as_ref().map_or(1, |c| c.len() / pp),
            Some(_) if layout.is_some() => {
                return Err(bad(
                    "give only one of --pipeline-model-parallel-layout and --num-layers-per-virtual-pipeline-stage".into(),
                ))
            }
            None => 1,
            Some(0) => {
                return Err(bad(
                    "--num-layers-per-virtual-pipeline-stage must be positive".into(),
                ))
            }
            Some(_) if pp == 1 => return Err(bad(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
                    .into(),
            )),
            Some(lv) => {
                // Megatron counts the accounted embedding and loss as layers here too.
                let slots = num_layers + accounted;
                if !slots.is_multiple_of(pp * lv) {
                    let with = if accounted > 0 {
                        format!(" (+ {accounted} accounted for by --account-for-embedding/loss-in-pipeline-split)")
                    } else {
                        String::new()
                    };
                    return Err(bad(format!("--num-layers ({num_layers}){with} must be divisible by --pipeline-model-parallel-size ({pp}) x --num-layers-per-virtual-pipeline-stage ({lv})")));
                }
                slots / (pp * lv)
            }
        };
        // A T5's pipeline splits its encoder's and its decoder's layers, in that order.
        let (num_layers, encoder) = match self.model {
            ModelArg::T5 => {
                let enc = self.encoder_num_layers.unwrap_or(num_layers);
                let dec = self.decoder_num_layers.unwrap_or(num_layers);
                let split = encoder.map(|stages| {
                    megatron_core::pipeline_parallel::partition::EncoderStages {
                        layers: enc,
                        stages,
                    }
                });
                (enc + dec, split)
            }
            _ => (num_layers, None),
        };
        let partition = megatron_core::pipeline_parallel::partition::StagePartition {
            num_layers,
            p: pp,
            v: vp,
            first: self.decoder_first_pipeline_num_layers,
            last: self.decoder_last_pipeline_num_layers,
            encoder,
            account_for_embedding: self.account_for_embedding_in_pipeline_split,
            account_for_loss: self.account_for_loss_in_pipeline_split,
            layout,
        };
        partition.check().map_err(bad)?;
        Ok((tp, pp, vp, partition))
    }

    /// The pipeline's stages and, for a T5, how many hold its encoder: the split rank within
    /// --pipeline-model-parallel-size, or --encoder-pipeline-model-parallel-size stages before
    /// the decoder's.
    fn pipeline_stages(&self) -> Result<(usize, Option<usize>), TrainError> {
        let pp = self.pipeline_model_parallel_size;
        let (split, enc) = (
            self.pipeline_model_parallel_split_rank,
            self.encoder_pipeline_model_parallel_size,
        );
        if self.model != ModelArg::T5 {
            if split.is_some() || enc.is_some() {
                return Err(bad("--pipeline-model-parallel-split-rank and --encoder-pipeline-model-parallel-size split an encoder-decoder (--model t5)".into()));
            }
            return Ok((pp, None));
        }
        match (split, enc) {
            (Some(_), Some(_)) => Err(bad(
                "give --pipeline-model-parallel-split-rank or --encoder-pipeline-model-parallel-size, not both".into(),
            )),
            (Some(s), None) if pp < 2 => Err(bad(format!(
                "--pipeline-model-parallel-split-rank {s} needs --pipeline-model-parallel-size > 1"
            ))),
            (Some(s), None) => Ok((pp, Some(s))),
            (None, Some(0)) => Err(bad(
                "--encoder-pipeline-model-parallel-size must be positive".into(),
            )),
            (None, Some(e)) => Ok((pp + e, Some(e))),
            (None, None) if pp > 1 => Err(bad(format!(
                "--model t5 at --pipeline-model-parallel-size {pp} needs --pipeline-model-parallel-split-rank S (stages before S hold the encoder) or --encoder-pipeline-model-parallel-size"
            ))),
            (None, None) => Ok((pp, None)),
        }
    }

    /// `--pipeline-model-parallel-layout`: the transformer layers of each virtual stage.
    fn layer_layout(
        &self,
        s: &str,
        pp: usize,
        num_layers: usize,
    ) -> Result<Vec<usize>, TrainError> {
        use megatron_core::pipeline_parallel::layer_layout::PipelineParallelLayerLayout;
        let flag = |e: String| bad(format!("--pipeline-model-parallel-layout '{s}': {e}"));
        if self.model == ModelArg::T5 {
            return Err(flag(
                "an encoder-decoder splits its stacks with --pipeline-model-parallel-split-rank"
                    .into(),
            ));
        }
        PipelineParallelLayerLayout::parse(s)
            .map_err(flag)?
            .decoder_counts(pp, num_layers, self.mtp_num_layers.unwrap_or(0))
            .map_err(flag)
    }

    /// `--use-checkpoint-args`: the model of the checkpoint --load would resume from, trained at
    /// --seq-length.
    fn checkpoint_model(
        &self,
        checkpoints: &crate::checkpoint_policy::CheckpointSettings,
        tp: usize,
    ) -> Result<TransformerConfig, TrainError> {
        if !checkpoints.load.is_set() {
            return Err(bad(
                "--use-checkpoint-args needs --load DIR or --pretrained-checkpoint DIR".into(),
            ));
        }
        let r = checkpoints
            .load
            .resolve(false)?
            .ok_or_else(|| {
                bad("--use-checkpoint-args: there is no checkpoint under --load to take the model from".into())
            })?
            .reader;
        let mut model = r.meta.model.clone();
        model.seq_length = self.seq_length;
        model.validate()?;
        for (what, v) in [
            ("--num-attention-heads", model.num_attention_heads),
            ("--num-query-groups", model.query_groups()),
            ("--ffn-hidden-size", model.ffn_hidden_size),
            ("the padded vocabulary", model.padded_vocab_size),
        ] {
            if !v.is_multiple_of(tp) {
                return Err(bad(format!(
                    "the checkpoint's {what} ({v}) is not divisible by --tensor-model-parallel-size ({tp})"
                )));
            }
        }
        Ok(model)
    }

    /// `--expert-model-parallel-size` and `--expert-tensor-parallel-size` against the model
    /// and the world of `dp x tp x pp` ranks.
    fn expert_layout(
        &self,
        model: &TransformerConfig,
        tp: usize,
        pp: usize,
        dp: usize,
    ) -> Result<(usize, usize), TrainError> {
        let ep = self.expert_model_parallel_size;
        if ep == 0 {
            return Err(bad(
                "--expert-model-parallel-size must be positive, got 0".into()
            ));
        }
        let Some(moe) = &model.moe else {
            if ep > 1 || self.expert_tensor_parallel_size.is_some() {
                return Err(bad(
                    "--expert-model-parallel-size / --expert-tensor-parallel-size need a model with experts (--num-experts)".into(),
                ));
            }
            return Ok((1, tp));
        };
        // Megatron's default: the dense tensor-parallel size.
        let etp = self.expert_tensor_parallel_size.unwrap_or(tp);
        if etp == 0 {
            return Err(bad(
                "--expert-tensor-parallel-size must be positive, got 0".into()
            ));
        }
        if !moe.ffn_hidden_size.is_multiple_of(etp) {
            return Err(bad(format!(
                "--moe-ffn-hidden-size ({}) must be divisible by --expert-tensor-parallel-size ({etp})",
                moe.ffn_hidden_size
            )));
        }
        let world = dp * tp * pp * self.context_parallel_size;
        if !world.is_multiple_of(etp * ep * pp) {
            return Err(bad(format!(
                "--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) x --pipeline-model-parallel-size ({pp}) must divide the {world} ranks"
            )));
        }
        if let Some(f) = moe.shared_expert_ffn.filter(|f| !f.is_multiple_of(tp)) {
            return Err(bad(format!(
                "--moe-shared-expert-intermediate-size ({f}) must be divisible by --tensor-model-parallel-size ({tp})"
            )));
        }
        if !moe.num_experts.is_multiple_of(ep) {
            return Err(bad(format!(
                "--num-experts ({}) must be divisible by --expert-model-parallel-size ({ep})",
                moe.num_experts
            )));
        }
        Ok((ep, etp))
    }

    /// `--context-parallel-size` against the sequence and the features that do not split
    /// along it yet.
    fn context_parallel(&self) -> Result<usize, TrainError> {
        let cp = self.context_parallel_size;
        if cp == 0 {
            return Err(bad("--context-parallel-size must be positive, got 0".into()));
        }
        if cp == 1 {
            return Ok(1);
        }
        if !self.seq_length.is_multiple_of(2 * cp) {
            return Err(bad(format!(
                "--seq-length ({}) must be divisible by 2 x --context-parallel-size ({cp}): each rank holds two chunks of the sequence",
                self.seq_length
            )));
        }
        Ok(cp)
    }

    /// The `--recompute-*` flags as Megatron reads them.
    pub(crate) fn recompute(
        &self,
    ) -> Result<megatron_core::transformer::step::Recompute, TrainError> {
        use megatron_core::transformer::step::{Recompute, RecomputeMethod, SelectiveModules};
        let granularity = match (self.recompute_granularity, self.recompute_activations) {
            (Some(RecomputeGranularityArg::Full), true) => {
                return Err(bad(
                    "--recompute-activations is selective recomputation; it does not go with --recompute-granularity full".into(),
                ))
            }
            (g, true) => g.or(Some(RecomputeGranularityArg::Selective)),
            (g, false) => g,
        };
        match granularity {
            None => {
                if self.recompute_method.is_some() || !self.recompute_modules.is_empty() {
                    return Err(bad(
                        "--recompute-method / --recompute-modules need --recompute-granularity (or --recompute-activations)".into(),
                    ));
                }
                Ok(Recompute::None)
            }
            Some(RecomputeGranularityArg::Full) => {
                if !self.recompute_modules.is_empty() {
                    return Err(bad(
                        "--recompute-modules is for --recompute-granularity selective".into(),
                    ));
                }
                let num_layers = self.recompute_num_layers.unwrap_or(1);
                if num_layers == 0 {
                    return Err(bad("--recompute-num-layers must be positive, got 0".into()));
                }
                Ok(Recompute::Full {
                    method: match self.recompute_method.unwrap_or(RecomputeMethodArg::Uniform) {
                        RecomputeMethodArg::Uniform => RecomputeMethod::Uniform,
                        RecomputeMethodArg::Block => RecomputeMethod::Block,
                    },
                    num_layers,
                })
            }
            Some(RecomputeGranularityArg::Selective) => {
                if self.recompute_method.is_some() || self.recompute_num_layers.is_some() {
                    return Err(bad(
                        "--recompute-method / --recompute-num-layers are for --recompute-granularity full (as in Megatron)".into(),
                    ));
                }
                let mut m = SelectiveModules::default();
                let modules: Vec<&str> = if self.recompute_modules.is_empty() {
                    vec!["core_attn"]
                } else {
                    self.recompute_modules.iter().map(String::as_str).collect()
                };
                for name in modules {
                    match name {
                        "core_attn" => m.core_attn = true,
                        "mlp" => m.mlp = true,
                        "layernorm" | "moe_act" => {}
                        other => {
                            return Err(bad(format!(
                                "--recompute-modules {other}: known are core_attn, mlp, layernorm, moe_act"
                            )))
                        }
                    }
                }
                Ok(Recompute::Selective(m))
            }
        }
    }

    /// `--num-experts` and the `--moe-*` flags, checked.
    fn moe_config(
        &self,
    ) -> Result<Option<megatron_core::transformer::config::MoEConfig>, TrainError> {
        use megatron_core::transformer::config::{
            DropPolicy, LoadBalancing, MoEConfig, RouterScore, TokenDispatcherType,
        };
        if self.moe_router_dtype == Some(RouterDtypeArg::Fp64) {
            return Err(bad(
                "--moe-router-dtype fp64 is not built: the router computes its logits and probabilities in fp32 (--moe-router-dtype fp32)".into(),
            ));
        }
        let Some(e) = self.num_experts else {
            return Ok(None);
        };
        if e == 0 {
            return Err(bad("--num-experts must be positive, got 0".into()));
        }
        if self.moe_router_topk == 0 || self.moe_router_topk > e {
            return Err(bad(format!(
                "--moe-router-topk ({}) must be between 1 and --num-experts ({e})",
                self.moe_router_topk
            )));
        }
        let router_groups = match (self.moe_router_num_groups, self.moe_router_group_topk) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(bad(
                    "--moe-router-num-groups needs --moe-router-group-topk (the groups a token may use)".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(bad(
                    "--moe-router-group-topk needs --moe-router-num-groups (as in Megatron)".into(),
                ))
            }
            (Some(g), Some(k)) => {
                let k_experts = self.moe_router_topk;
                if g == 0 || e % g != 0 {
                    return Err(bad(format!(
                        "--moe-router-num-groups ({g}) must divide --num-experts ({e})"
                    )));
                }
                if k == 0 || k > g {
                    return Err(bad(format!(
                        "--moe-router-group-topk ({k}) must be between 1 and --moe-router-num-groups ({g})"
                    )));
                }
                if k > k_experts || k * (e / g) < k_experts {
                    return Err(bad(format!(
                        "--moe-router-group-topk ({k}) groups of {} experts must hold --moe-router-topk ({k_experts}) experts, each group scored by its best topk / group-topk (at least 1)",
                        e / g
                    )));
                }
                Some((g, k))
            }
        };
        if self.moe_router_enable_expert_bias
            && self.moe_router_score_function != RouterScoreArg::Sigmoid
        {
            return Err(bad(
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron)".into(),
            ));
        }
        if !(self.moe_router_bias_update_rate >= 0.0
            && self.moe_router_bias_update_rate.is_finite())
        {
            return Err(bad(format!(
                "--moe-router-bias-update-rate must be a non-negative number, got {}",
                self.moe_router_bias_update_rate
            )));
        }
        if let Some(f) = self.moe_expert_capacity_factor {
            if !(f > 0.0 && f.is_finite()) {
                return Err(bad(format!(
                    "--moe-expert-capacity-factor must be positive, got {f}"
                )));
            }
        } else if self.moe_pad_expert_input_to_capacity {
            return Err(bad(
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor".into(),
            ));
        }
        if self.moe_ffn_hidden_size == Some(0) {
            return Err(bad("--moe-ffn-hidden-size must be positive, got 0".into()));
        }
        if self.moe_shared_expert_intermediate_size == Some(0) {
            return Err(bad(
                "--moe-shared-expert-intermediate-size must be positive, got 0".into(),
            ));
        }
        if self.moe_shared_expert_gate && self.moe_shared_expert_intermediate_size.is_none() {
            return Err(bad(
                "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size".into(),
            ));
        }
        if self.tensor_model_parallel_size > 1 && !self.sequence_parallel {
            return Err(bad(format!(
                "--num-experts with --tensor-model-parallel-size {} needs --sequence-parallel (as in Megatron: each tensor-parallel rank routes its own tokens)",
                self.tensor_model_parallel_size
            )));
        }
        Ok(Some(MoEConfig {
            num_experts: e,
            ffn_hidden_size: self.moe_ffn_hidden_size.unwrap_or_else(|| {
                self.ffn_hidden_size.unwrap_or_else(|| {
                    let act = self
                        .activation()
                        .unwrap_or(megatron_core::transformer::config::Activation::Gelu);
                    TransformerConfig::default_ffn_hidden_size(self.hidden_size, act)
                })
            }),
            topk: self.moe_router_topk,
            score: match self.moe_router_score_function {
                RouterScoreArg::Softmax => RouterScore::Softmax,
                RouterScoreArg::Sigmoid => RouterScore::Sigmoid,
            },
            pre_softmax: self.moe_router_pre_softmax,
            topk_scaling_factor: self.moe_router_topk_scaling_factor,
            aux_loss_coeff: self.moe_aux_loss_coeff,
            z_loss_coeff: self.moe_z_loss_coeff,
            layers: crate::layer_pattern::parse_layer_pattern(
                "--moe-layer-freq",
                &self.moe_layer_freq,
            )
            .map_err(bad)?,
            dispatcher: match self.moe_token_dispatcher_type {
                DispatcherArg::AllGather => TokenDispatcherType::AllGather,
                DispatcherArg::AllToAll => TokenDispatcherType::AllToAll,
            },
            load_balancing: match self.moe_router_load_balancing_type {
                LoadBalancingArg::AuxLoss => LoadBalancing::AuxLoss,
                LoadBalancingArg::SeqAuxLoss => LoadBalancing::SeqAuxLoss,
                LoadBalancingArg::None => LoadBalancing::None,
            },
            expert_bias_update_rate: self
                .moe_router_enable_expert_bias
                .then_some(self.moe_router_bias_update_rate),
            capacity_factor: self.moe_expert_capacity_factor,
            drop_policy: match self.moe_token_drop_policy {
                DropPolicyArg::Probs => DropPolicy::Probs,
                DropPolicyArg::Position => DropPolicy::Position,
            },
            pad_to_capacity: self.moe_pad_expert_input_to_capacity,
            shared_expert_ffn: self.moe_shared_expert_intermediate_size,
            shared_expert_gate: self.moe_shared_expert_gate,
            grouped_gemm: self.moe_grouped_gemm,
            router_groups,
            biases: !self.disable_bias_linear,
        }))
    }

    /// The learning-rate schedule: decay style, WSD decay style, decay and warmup iterations.
    fn lr_schedule(
        &self,
        train_iters: u64,
        gbs: usize,
    ) -> Result<(LrDecayStyle, WsdDecayStyle, LrSchedule), TrainError> {
        let lr_decay_style = LrDecayStyle::parse(&self.lr_decay_style).ok_or_else(|| {
            bad(format!("--lr-decay-style '{}': expected constant, linear, cosine, inverse-square-root or WSD", self.lr_decay_style))
        })?;
        let lr_wsd_decay_style =
            WsdDecayStyle::parse(&self.lr_wsd_decay_style).ok_or_else(|| {
                bad(format!(
                    "--lr-wsd-decay-style '{}': expected linear, cosine, exponential or minus_sqrt",
                    self.lr_wsd_decay_style
                ))
            })?;
        if self.lr < 0.0 || self.min_lr < 0.0 || self.min_lr > self.lr {
            return Err(bad(format!(
                "--min-lr ({}) must be between 0 and --lr ({})",
                self.min_lr, self.lr
            )));
        }
        if let Some(f) = self.lr_warmup_fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(bad(format!(
                    "--lr-warmup-fraction must be in [0, 1], got {f}"
                )));
            }
        }
        let schedule = match self.train_samples {
            // Sample-based training: Megatron refuses the iteration-based flags, and the
            // sample-based ones (and ramp-up) under --train-iters.
            Some(train_samples) => {
                refuse_given(
                    &[
                        ("--lr-decay-iters", self.lr_decay_iters.is_some()),
                        ("--lr-warmup-iters", self.lr_warmup_iters.is_some()),
                        ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters.is_some()),
                    ],
                    |flag| {
                        format!(
                            "{flag} is for --train-iters; under --train-samples use {} (as Megatron)",
                            flag.replace("iters", "samples")
                        )
                    },
                )?;
                let decay = self.lr_decay_samples.unwrap_or(train_samples);
                LrSchedule {
                    decay,
                    warmup: warmup_of(
                        ("--lr-warmup-samples", self.lr_warmup_samples),
                        self.lr_warmup_fraction,
                        decay,
                    )?,
                    wsd_decay: self.lr_wsd_decay_samples.unwrap_or(0),
                }
            }
            None => {
                refuse_given(
                    &[
                        ("--rampup-batch-size", self.rampup_batch_size.is_some()),
                        ("--lr-decay-samples", self.lr_decay_samples.is_some()),
                        ("--lr-warmup-samples", self.lr_warmup_samples.is_some()),
                        (
                            "--lr-wsd-decay-samples",
                            self.lr_wsd_decay_samples.is_some(),
                        ),
                    ],
                    |flag| {
                        format!(
                            "{flag} needs sample-based training (--train-samples), as in Megatron"
                        )
                    },
                )?;
                let decay_iters = self.lr_decay_iters.unwrap_or(train_iters);
                let warmup_iters = warmup_of(
                    ("--lr-warmup-iters", self.lr_warmup_iters),
                    self.lr_warmup_fraction,
                    decay_iters,
                )?;
                let gbs = gbs as u64;
                LrSchedule {
                    decay: decay_iters * gbs,
                    warmup: warmup_iters * gbs,
                    wsd_decay: self.lr_wsd_decay_iters.unwrap_or(0) * gbs,
                }
            }
        };
        if schedule.warmup > schedule.decay {
            return Err(bad(format!(
                "the learning-rate warm-up ({} samples) exceeds its decay ({} samples): see --lr-warmup-iters/-samples and --lr-decay-iters/-samples",
                schedule.warmup, schedule.decay
            )));
        }
        Ok((lr_decay_style, lr_wsd_decay_style, schedule))
    }
}

impl TrainArgs {
    /// These flags with `--data-args-path` / `--per-split-data-args-path` read into the
    /// data-path flags they stand for (Megatron's `get_blend_and_blend_per_split`).
    fn with_data_args_files(&self) -> Result<TrainArgs, TrainError> {
        let given = [
            ("--data-path", !self.data_path.is_empty()),
            ("--train-data-path", !self.train_data_path.is_empty()),
            ("--valid-data-path", !self.valid_data_path.is_empty()),
            ("--test-data-path", !self.test_data_path.is_empty()),
            ("--mock-data", self.mock_data),
        ];
        let mut a = self.clone();
        let read = |flag: &str, path: &str| {
            std::fs::read_to_string(path).map_err(|e| bad(format!("{flag} {path}: {e}")))
        };
        match (&self.data_args_path, &self.per_split_data_args_path) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "give only one of --data-args-path and --per-split-data-args-path".into(),
                ))
            }
            (Some(path), None) => {
                refuse_given(&given, |flag| {
                    format!("--data-args-path stands for the data flags: drop {flag}")
                })?;
                a.data_path = read("--data-args-path", path)?
                    .split_whitespace()
                    .map(str::to_string)
                    .collect();
                if a.data_path.is_empty() {
                    return Err(bad(format!("--data-args-path {path}: the file is empty")));
                }
            }
            (None, Some(path)) => {
                refuse_given(&given, |flag| {
                    format!("--per-split-data-args-path stands for the data flags: drop {flag}")
                })?;
                let text = read("--per-split-data-args-path", path)?;
                let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                    bad(format!("--per-split-data-args-path {path}: not JSON: {e}"))
                })?;
                let split = |key: &str| -> Result<Vec<String>, TrainError> {
                    let words = |s: &str| s.split_whitespace().map(str::to_string).collect();
                    match &json[key] {
                        serde_json::Value::String(s) => Ok(words(s)),
                        serde_json::Value::Array(items) => items
                            .iter()
                            .map(|v| match v {
                                serde_json::Value::String(s) => Ok(s.clone()),
                                serde_json::Value::Number(n) => Ok(n.to_string()),
                                other => Err(bad(format!(
                                    "--per-split-data-args-path {path}: \"{key}\" holds {other}, not a path or weight"
                                ))),
                            })
                            .collect(),
                        serde_json::Value::Null => Ok(Vec::new()),
                        other => Err(bad(format!(
                            "--per-split-data-args-path {path}: \"{key}\" is {other}, not a list of paths and weights"
                        ))),
                    }
                };
                a.train_data_path = split("train")?;
                a.valid_data_path = split("valid")?;
                a.test_data_path = split("test")?;
                if a.train_data_path.is_empty() {
                    return Err(bad(format!(
                        "--per-split-data-args-path {path}: no \"train\" blend"
                    )));
                }
            }
            (None, None) => {}
        }
        a.data_args_path = None;
        a.per_split_data_args_path = None;
        Ok(a)
    }
}

/// The first of `flags` that was given, refused with `why(flag)`.
fn refuse_given(flags: &[(&str, bool)], why: impl Fn(&str) -> String) -> Result<(), TrainError> {
    match flags.iter().find(|(_, given)| *given) {
        Some((flag, _)) => Err(bad(why(flag))),
        None => Ok(()),
    }
}

/// Warm-up length: the explicit flag's value, or `--lr-warmup-fraction` of the decay (in the
/// same unit), or none.
fn warmup_of(
    (flag, explicit): (&str, Option<u64>),
    fraction: Option<f64>,
    decay: u64,
) -> Result<u64, TrainError> {
    match (explicit, fraction) {
        (Some(_), Some(_)) => Err(bad(format!(
            "give only one of {flag} and --lr-warmup-fraction"
        ))),
        (Some(w), None) => Ok(w),
        (None, Some(f)) => Ok((f * decay as f64) as u64),
        (None, None) => Ok(0),
    }
}

/// The learning-rate schedule's lengths in samples (Megatron's scheduler steps).
#[derive(Clone, Copy, Debug)]
struct LrSchedule {
    decay: u64,
    warmup: u64,
    wsd_decay: u64,
}

/// `megatron preprocess` (Megatron's `tools/preprocess_data.py` flags).
#[derive(Args, Clone, Debug)]
pub struct PreprocessArgs {
    /// JSON-lines files, plain text files, or directories of them.
    #[arg(long, num_args = 1.., required = true)]
    pub input: Vec<String>,
    #[arg(long, num_args = 1.., default_value = "text")]
    pub json_keys: Vec<String>,
    #[arg(long)]
    pub output_prefix: String,
    #[command(flatten)]
    pub tokenizer: TokenizerArgs,
    #[arg(long)]
    pub append_eod: bool,
    /// One sequence per sentence, documents still delimited (`<prefix>_<key>_sentence.*`), for
    /// BERT's dataset.
    #[arg(long)]
    pub split_sentences: bool,
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Count and report malformed lines instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    #[arg(long, default_value_t = 100000)]
    pub log_interval: usize,
}

impl PreprocessArgs {
    pub fn config(&self) -> megatron_data::preprocess::PreprocessConfig {
        megatron_data::preprocess::PreprocessConfig {
            input: self.input.clone(),
            json_keys: self.json_keys.clone(),
            output_prefix: self.output_prefix.clone(),
            append_eod: self.append_eod,
            split_sentences: self.split_sentences,
            workers: self.workers,
            skip_bad_lines: self.skip_bad_lines,
            log_interval: self.log_interval,
        }
    }
}

/// `megatron merge-datasets`.
#[derive(Args, Clone, Debug)]
pub struct MergeArgs {
    /// Dataset prefixes (without .bin/.idx).
    #[arg(long, num_args = 1.., required = true)]
    pub input: Vec<String>,
    #[arg(long)]
    pub output_prefix: String,
}

/// `megatron inspect-data`: the same data flags as `train`, plus which samples to print.
#[derive(Args, Clone, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    #[arg(long, default_value = "train")]
    pub split_name: String,
    #[arg(long, default_value_t = 0)]
    pub start: u64,
    #[arg(long, default_value_t = 10)]
    pub count: u64,
}

/// `megatron train-tokenizer`: byte-level BPE.
#[derive(Args, Clone, Debug)]
pub struct TrainTokenizerArgs {
    /// Text files, JSON-lines files, or directories of them.
    #[arg(long, num_args = 1.., required = true)]
    pub input: Vec<String>,
    #[arg(long, default_value = "text")]
    pub json_key: String,
    #[arg(long)]
    pub vocab_size: usize,
    #[arg(long, default_value_t = 2)]
    pub min_frequency: u64,
    #[arg(long, num_args = 1.., default_value = "<|endoftext|>")]
    pub special_tokens: Vec<String>,
    /// Receives tokenizer.json, vocab.json and merges.txt.
    #[arg(long)]
    pub output_dir: String,
}

impl TrainTokenizerArgs {
    pub fn config(&self) -> megatron_data::train_tokenizer::TrainTokenizerConfig {
        megatron_data::train_tokenizer::TrainTokenizerConfig {
            input: self.input.clone(),
            json_key: self.json_key.clone(),
            vocab_size: self.vocab_size,
            min_frequency: self.min_frequency,
            special_tokens: self.special_tokens.clone(),
            output_dir: self.output_dir.clone(),
        }
    }
}

/// `megatron train`'s model and tokenizer flags, parsed and checked as `megatron train` checks
/// them, for a model described by flags rather than given on the command line (a Megatron-LM
/// checkpoint's saved arguments, whose names are these flags'). The vocabulary is padded to
/// `padded_vocab` rows, the checkpoint's.
pub(crate) fn model_from_flags(
    flags: &[String],
    padded_vocab: usize,
) -> Result<(TransformerConfig, megatron_data::TokenizerSpec), TrainError> {
    #[derive(clap::Parser)]
    #[command(no_binary_name = true, args_override_self = true)]
    struct Flags {
        #[command(flatten)]
        args: TrainArgs,
    }
    let parsed = <Flags as clap::Parser>::try_parse_from(flags).map_err(|e| {
        bad(format!(
            "the saved arguments give flags this engine does not take: {}",
            e.render().to_string().lines().next().unwrap_or_default()
        ))
    })?;
    let mut model = parsed.args.model_config(padded_vocab, 1)?;
    model.padded_vocab_size = padded_vocab;
    Ok((model, parsed.args.tokenizer.spec()))
}
