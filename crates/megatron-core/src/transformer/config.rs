use megatron_tensor::cpu::GluLimits;
use serde::{Deserialize, Serialize};

/// A configuration the model cannot be built from. Each message names the flags at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("{flag} must be positive, got {value}")]
    NotPositive { flag: &'static str, value: i64 },
    #[error("--num-attention-heads ({heads}) must divide --hidden-size ({hidden})")]
    HeadsDoNotDivideHidden { heads: usize, hidden: usize },
    #[error("--seq-length ({seq}) exceeds --max-position-embeddings ({max_pos})")]
    SeqLongerThanPositions { seq: usize, max_pos: usize },
    #[error("{flag} must be in [0, 1), got {value}")]
    BadProbability { flag: &'static str, value: f32 },
    #[error("--num-query-groups ({groups}) must divide --num-attention-heads ({heads})")]
    GroupsDoNotDivideHeads { groups: usize, heads: usize },
    #[error("--rotary-percent must be in (0, 1], got {0}")]
    BadRotaryPercent(f32),
    #[error("--rotary-percent {percent} of the head dimension {head_dim} (--kv-channels) gives {rot} rotary features; it must be even and at least 2")]
    OddRotaryDim {
        percent: f32,
        head_dim: usize,
        rot: usize,
    },
    #[error("--rotary-base must be positive, got {0}")]
    BadRotaryBase(f64),
    #[error("--window-attn-skip-freq {0}")]
    BadWindowPattern(String),
    #[error("--window-size applies to causal decoders; this model's attention sees every token")]
    WindowOnEncoder,
    #[error("--v-head-dim ({v}) must not exceed --qk-head-dim + --qk-pos-emb-head-dim ({qk} + {pe}) under --multi-latent-attention")]
    MlaValueWider { v: usize, qk: usize, pe: usize },
    #[error("--multi-latent-attention rotates its --qk-pos-emb-head-dim features: it needs --position-embedding-type rope or yarn")]
    MlaWithoutRope,
    #[error("--multi-latent-attention and --group-query-attention are mutually exclusive (as Megatron asserts): every MLA head has its own key and value")]
    MlaWithGroups,
    #[error("--mtp-loss-scaling-factor must be a non-negative number, got {0}")]
    BadMtpScale(f32),
    #[error("--moe-layer-freq {0}")]
    BadMoELayerPattern(String),
}

/// Which layers a per-layer feature is on (Megatron's `--window-attn-skip-freq`,
/// `--moe-layer-freq`): every `N`th layer (each flag counts as Megatron does: the window's
/// skip from layer `N`, 1-based; experts from layer 0), or an explicit pattern of one entry
/// per layer (`"[1,1,1,0]*2"` on the command line).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum LayerPattern {
    Every(usize),
    List(Vec<bool>),
}

impl LayerPattern {
    /// Why the pattern cannot describe `layers` layers, if it cannot.
    fn check(&self, layers: usize) -> Result<(), String> {
        match self {
            LayerPattern::Every(0) => Err("must be positive, got 0".into()),
            LayerPattern::List(v) if v.len() != layers => Err(format!(
                "has {} entries for {layers} layers (--num-layers)",
                v.len()
            )),
            _ => Ok(()),
        }
    }
}

/// Checkpoints written before the list form hold `"layer_freq": N`.
fn moe_layers_or_freq<'de, D: serde::Deserializer<'de>>(d: D) -> Result<LayerPattern, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Stored {
        Freq(usize),
        Pattern(LayerPattern),
    }
    Ok(match Stored::deserialize(d)? {
        Stored::Freq(n) => LayerPattern::Every(n),
        Stored::Pattern(p) => p,
    })
}

/// Sliding-window attention (`--window-size`, Mistral's and Gemma's local layers): a query
/// of a windowed layer sees itself and the `left` keys before it. `skip` picks the layers
/// that keep full attention (`--window-attn-skip-freq`): with `Every(n)` each `n`th layer,
/// with `List` the layers whose entry is `false`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SlidingWindow {
    pub left: usize,
    pub skip: Option<LayerPattern>,
}

impl SlidingWindow {
    /// The window of layer `l` (0-based global number), as megatron-core's
    /// `is_layer_window_attention` reads the pattern with 1-based layer numbers.
    pub fn of_layer(&self, l: usize) -> Option<usize> {
        let windowed = match &self.skip {
            None => true,
            Some(LayerPattern::Every(n)) => !(l + 1).is_multiple_of(*n),
            Some(LayerPattern::List(v)) => v.get(l).copied().unwrap_or(true),
        };
        windowed.then_some(self.left)
    }
}

/// `--moe-router-score-function`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum RouterScore {
    #[default]
    Softmax,
    Sigmoid,
}

/// Mixture of experts (`--num-experts` and the `--moe-*` flags), dropless.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MoEConfig {
    pub num_experts: usize,
    /// Each expert's FFN width (`--moe-ffn-hidden-size`).
    pub ffn_hidden_size: usize,
    pub topk: usize,
    pub score: RouterScore,
    pub pre_softmax: bool,
    pub topk_scaling_factor: Option<f32>,
    /// Switch load-balancing loss coefficient (`--moe-aux-loss-coeff`, 0: off).
    pub aux_loss_coeff: f32,
    /// `--moe-z-loss-coeff` (0: off).
    pub z_loss_coeff: f32,
    /// The MoE layers (`--moe-layer-freq`): `Every(n)` each `n`th from layer 0, or a `List`
    /// whose `true` entries are MoE layers (`"[0]+[1]*3"`: DeepSeek's dense first layer).
    #[serde(alias = "layer_freq", deserialize_with = "moe_layers_or_freq")]
    pub layers: LayerPattern,
    /// How tokens reach experts on other expert-parallel ranks (`--moe-token-dispatcher-type`).
    #[serde(default)]
    pub dispatcher: TokenDispatcherType,
    /// `--moe-router-load-balancing-type`.
    #[serde(default)]
    pub load_balancing: LoadBalancing,
    /// DeepSeek-V3's aux-loss-free balancing: a per-expert bias added to the scores for the
    /// top-k selection only, moved by this rate toward the mean load after every step
    /// (`--moe-router-enable-expert-bias --moe-router-bias-update-rate`).
    #[serde(default)]
    pub expert_bias_update_rate: Option<f32>,
    /// `--moe-expert-capacity-factor`: each expert takes at most
    /// `ceil(tokens * topk / experts * factor)` of a rank's rows; `None` is dropless.
    #[serde(default)]
    pub capacity_factor: Option<f32>,
    #[serde(default)]
    pub drop_policy: DropPolicy,
    /// `--moe-pad-expert-input-to-capacity`: every expert gets exactly its capacity of rows
    /// (padding rows carry weight 0).
    #[serde(default)]
    pub pad_to_capacity: bool,
    /// `--moe-shared-expert-intermediate-size`: an always-on MLP of this width beside the
    /// routed experts.
    #[serde(default)]
    pub shared_expert_ffn: Option<usize>,
    /// `--moe-shared-expert-gate`: the shared expert's output scaled by a sigmoid gate of the
    /// token (Qwen2-MoE).
    #[serde(default)]
    pub shared_expert_gate: bool,
    /// `--moe-grouped-gemm`: the experts' GEMMs run at once, one block per thread.
    #[serde(default)]
    pub grouped_gemm: bool,
    /// Group-limited routing (`--moe-router-num-groups`, `--moe-router-group-topk`): DeepSeek's
    /// device- or node-limited routing, as (groups, groups each token picks).
    #[serde(default)]
    pub router_groups: Option<(usize, usize)>,
    /// Biases on the router's logits and on the experts' fc1 and fc2 (megatron-core builds them
    /// unless `--disable-bias-linear`; shared experts have none). A field of its own, not read
    /// off `add_bias_linear`, because checkpoints saved before this engine built them hold
    /// none: they read as `false` and keep loading as the model they are.
    #[serde(default)]
    pub biases: bool,
}

impl MoEConfig {
    /// `num_experts` experts of FFN width `ffn`, top-`topk`, with Megatron's defaults for the
    /// rest (softmax router after the top-k, no auxiliary losses, dropless, every layer).
    pub fn new(num_experts: usize, ffn: usize, topk: usize) -> Self {
        MoEConfig {
            num_experts,
            ffn_hidden_size: ffn,
            topk,
            score: RouterScore::Softmax,
            pre_softmax: false,
            topk_scaling_factor: None,
            aux_loss_coeff: 0.0,
            z_loss_coeff: 0.0,
            layers: LayerPattern::Every(1),
            dispatcher: TokenDispatcherType::default(),
            load_balancing: LoadBalancing::default(),
            expert_bias_update_rate: None,
            capacity_factor: None,
            drop_policy: DropPolicy::default(),
            pad_to_capacity: false,
            shared_expert_ffn: None,
            shared_expert_gate: false,
            grouped_gemm: false,
            router_groups: None,
            biases: false,
        }
    }
}

/// `--moe-router-load-balancing-type`: the switch loss over the micro-batch, the same per
/// sequence (`seq_aux_loss`, DeepSeek-V2/V3), or none.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum LoadBalancing {
    #[default]
    AuxLoss,
    SeqAuxLoss,
    None,
}

/// `--moe-token-drop-policy`: which rows over an expert's capacity are dropped — those with
/// the lowest routing probability, or the latest in token order.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum DropPolicy {
    #[default]
    Probs,
    Position,
}

/// `--moe-token-dispatcher-type`: megatron-core's `MoEAlltoAllTokenDispatcher` (each token row
/// goes only to the ranks of its experts) or `MoEAllGatherTokenDispatcher` (every rank sees
/// every token of the expert-parallel group and keeps those of its experts).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum TokenDispatcherType {
    #[default]
    AllToAll,
    AllGather,
}

/// `--normalization`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum Normalization {
    #[default]
    LayerNorm,
    RMSNorm,
}

/// The MLP's activation: GELU, ReLU (the original T5), squared ReLU (`--squared-relu`), or a
/// gated unit on a fused `[gate; up]` fc1 — SwiGLU (`--swiglu`, Llama), GeGLU (T5 v1.1 /
/// Flan-T5's gated GELU) or Quick-GEGLU (`--quick-geglu`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum Activation {
    #[default]
    Gelu,
    SwiGLU,
    Relu,
    GeGLU,
    SquaredRelu,
    QuickGeGLU,
}

impl Activation {
    /// fc1 is `[gate; up]`: twice the MLP's width.
    pub fn is_gated(self) -> bool {
        matches!(
            self,
            Activation::SwiGLU | Activation::GeGLU | Activation::QuickGeGLU
        )
    }

    /// The backend's kernel (GELU's form where the activation has one).
    pub fn kernel(self, gelu: GeluForm) -> megatron_tensor::cpu::MlpActivation {
        use megatron_tensor::cpu::MlpActivation as K;
        match self {
            Activation::Gelu => K::Gelu(gelu.kernel()),
            Activation::SwiGLU => K::SwiGLU(GluLimits::NONE),
            Activation::Relu => K::Relu,
            Activation::GeGLU => K::GeGLU(gelu.kernel()),
            Activation::SquaredRelu => K::SquaredRelu,
            Activation::QuickGeGLU => K::QuickGeGLU(GluLimits::NONE),
        }
    }
}

/// gpt-oss's gated unit (`--glu-linear-offset`, `--activation-func-clamp-value`): the gate
/// clamped from above, the linear half clamped to `[-clamp, clamp]` and offset.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GluConfig {
    pub linear_offset: f32,
    pub clamp_value: Option<f32>,
}

impl GluConfig {
    pub fn is_default(&self) -> bool {
        *self == GluConfig::default()
    }
}

/// `--softmax-type`: attention's softmax plain, with a zero logit in the denominator
/// (`off-by-one`, Miller's "attention is off by one"), or with a learned one per head
/// (`learnable`, gpt-oss's attention sinks: `core_attention.softmax_offset`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum SoftmaxType {
    #[default]
    Vanilla,
    OffByOne,
    Learnable,
}

/// The GELU's form, where the MLP's activation (or BERT's LM head) is GELU: Megatron's fused
/// bias-GELU is the tanh approximation (the default, and GPT-2's); under
/// `--no-bias-gelu-fusion` Megatron runs torch's exact `F.gelu`, which is also Hugging Face
/// BERT's `"gelu"`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum GeluForm {
    #[default]
    Tanh,
    Erf,
}

impl GeluForm {
    /// The backend kernel's form.
    pub fn kernel(self) -> megatron_tensor::cpu::GeluApprox {
        match self {
            GeluForm::Tanh => megatron_tensor::cpu::GeluApprox::Tanh,
            GeluForm::Erf => megatron_tensor::cpu::GeluApprox::Erf,
        }
    }
}

/// `--position-embedding-type`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum PositionEmbeddingType {
    #[default]
    LearnedAbsolute,
    Rope,
    None,
}

/// Rotary embedding settings (`--rotary-base`, `--rotary-percent`, `--rotary-interleaved`,
/// `--use-rope-scaling --rope-scaling-factor`).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct RotaryConfig {
    pub base: f64,
    pub percent: f32,
    pub interleaved: bool,
    /// Llama 3.1 scaling factor, if enabled.
    pub scaling_factor: Option<f64>,
    /// YaRN (`--position-embedding-type yarn`), if enabled.
    #[serde(default)]
    pub yarn: Option<YarnConfig>,
    /// Linear position interpolation (`--rotary-seq-len-interpolation-factor`): positions
    /// divided by this factor.
    #[serde(default)]
    pub seq_len_interpolation_factor: Option<f64>,
}

/// Megatron's YaRN settings (`--rotary-scaling-factor`, `--yarn-original-max-position-embeddings`,
/// `--yarn-beta-fast`, `--yarn-beta-slow`, `--mscale`, `--mscale-all-dim`,
/// `--yarn-correction-range-round-to-int`).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    pub correction_range_round_to_int: bool,
}

impl Default for RotaryConfig {
    fn default() -> Self {
        RotaryConfig {
            base: 10000.0,
            percent: 1.0,
            interleaved: false,
            scaling_factor: None,
            yarn: None,
            seq_len_interpolation_factor: None,
        }
    }
}

fn yes() -> bool {
    true
}

/// Which keys a token's attention sees (Megatron's `AttnMaskType`): the tokens before it
/// (decoders), or every real token of its sequence, padding excluded (encoders: BERT, T5's
/// encoder). Context parallelism's ring, `--reset-attention-mask` and KV-cache decoding are
/// causal by construction: the encoder families that set `Padding` refuse them.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum AttnMaskType {
    #[default]
    Causal,
    Padding,
}

/// The storage of the residual stream, the hidden states that pass from layer to layer (and
/// between pipeline stages). Megatron keeps them in the parameters' dtype under `--bf16`
/// unless `--fp32-residual-connection`; each residual sum is then taken in f32 and rounded
/// once. Gradients flow in f32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ResidualPrecision {
    #[default]
    F32,
    BF16,
}

impl ResidualPrecision {
    pub fn dtype(self) -> megatron_tensor::DType {
        match self {
            ResidualPrecision::F32 => megatron_tensor::DType::F32,
            ResidualPrecision::BF16 => megatron_tensor::DType::BF16,
        }
    }
}

/// Megatron's `TransformerConfig`: one config-driven decoder covers GPT-2 (the defaults) and
/// the Llama family (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases), as megatron-core's
/// `GPTModel` does with another layer spec. Fields added after the first checkpoints default
/// to GPT's values when an old checkpoint's config is read.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TransformerConfig {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub ffn_hidden_size: usize,
    pub seq_length: usize,
    pub max_position_embeddings: usize,
    /// Padded vocabulary size (rows of the embedding).
    pub padded_vocab_size: usize,
    pub hidden_dropout: f32,
    pub attention_dropout: f32,
    pub init_method_std: f32,
    pub layernorm_epsilon: f32,
    pub untie_embeddings_and_output_weights: bool,
    #[serde(default)]
    pub normalization: Normalization,
    #[serde(default)]
    pub activation: Activation,
    #[serde(default)]
    pub position_embedding_type: PositionEmbeddingType,
    #[serde(default)]
    pub rotary: RotaryConfig,
    /// Key/value heads (`--num-query-groups`); `None`: one per attention head.
    #[serde(default)]
    pub num_query_groups: Option<usize>,
    /// Per-head dimension (`--kv-channels`); `None`: hidden size / heads.
    #[serde(default)]
    pub kv_channels: Option<usize>,
    /// Biases on the linear layers (off with `--disable-bias-linear`).
    #[serde(default = "yes")]
    pub add_bias_linear: bool,
    /// The QKV projection's bias (`--add-qkv-bias`, Qwen2); defaults to `add_bias_linear`.
    #[serde(default = "yes")]
    pub add_qkv_bias: bool,
    /// Normalize each head's queries and keys before rotary embeddings (`--qk-layernorm`,
    /// with `--normalization`'s kind; Qwen3, OLMo 2).
    #[serde(default)]
    pub qk_layernorm: bool,
    /// Mixture of experts in place of the MLP on the layers `moe.layer_freq` picks.
    #[serde(default)]
    pub moe: Option<MoEConfig>,
    /// Causal (decoders) or bidirectional over the real tokens (encoders).
    #[serde(default)]
    pub attn_mask_type: AttnMaskType,
    /// Tanh-approximated or exact GELU.
    #[serde(default)]
    pub gelu: GeluForm,
    /// Where the LayerNorms sit in a layer: before each block (GPT, Megatron's BERT) or after
    /// each residual add (the original BERT, Hugging Face's `BertModel`).
    #[serde(default)]
    pub layernorm_placement: LayerNormPlacement,
    /// Sliding-window attention on some or all layers.
    #[serde(default)]
    pub window: Option<SlidingWindow>,
    /// Multi-latent attention (`--multi-latent-attention`, DeepSeek-V2/V3) in place of the
    /// fused-QKV attention.
    #[serde(default)]
    pub mla: Option<MLAConfig>,
    /// Multi-token prediction (`--mtp-num-layers`, DeepSeek-V3) after the decoder.
    #[serde(default)]
    pub mtp: Option<MTPConfig>,
    /// The gated unit's clamp and offset (gpt-oss).
    #[serde(default, skip_serializing_if = "GluConfig::is_default")]
    pub glu: GluConfig,
    /// Attention's softmax (`--softmax-type`).
    #[serde(default, skip_serializing_if = "is_vanilla")]
    pub softmax_type: SoftmaxType,
    /// How the residual stream between layers is stored: a setting of the run (`--bf16`
    /// without `--fp32-residual-connection`), not of the model, so checkpoints do not carry it.
    #[serde(skip)]
    pub residual: ResidualPrecision,
}

/// Megatron's multi-token prediction (`--mtp-num-layers D`, `--mtp-loss-scaling-factor`):
/// after the decoder, D more layers, the k-th predicting the token k + 1 places ahead from the
/// previous depth's hidden state and the embedding of the token k places ahead; their losses,
/// averaged over the depths and scaled by the factor, join the training loss.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct MTPConfig {
    pub num_layers: usize,
    pub loss_scaling_factor: f32,
}

/// Megatron's `MLATransformerConfig` widths (`--q-lora-rank`, `--kv-lora-rank`,
/// `--qk-head-dim`, `--qk-pos-emb-head-dim`, `--v-head-dim`): queries from a low-rank latent
/// (or, without `q_lora_rank`, straight from the hidden state), keys and values from one
/// shared latent, each head's query/key of `qk_head_dim` content and `qk_pos_emb_head_dim`
/// rotary features (the rotary key shared by all heads), values of `v_head_dim`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MLAConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_head_dim: usize,
    pub qk_pos_emb_head_dim: usize,
    pub v_head_dim: usize,
}

/// `--transformer-block-type` (NeMo's name): `pre_ln` normalizes each block's input and the
/// stack's output (a final LayerNorm); `post_ln` normalizes each residual sum and the
/// embeddings instead, with no final LayerNorm.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum LayerNormPlacement {
    #[default]
    PreLn,
    PostLn,
}

impl TransformerConfig {
    /// Init std of the layers that write into the residual stream (attention and MLP output
    /// projections): `init_method_std / sqrt(2 * num_layers)`.
    pub fn output_layer_init_std(&self) -> f32 {
        self.init_method_std / (2.0 * self.num_layers as f32).sqrt()
    }

    /// The attention kernel's head width (MLA: a query/key head's content and rotary
    /// features; its values are padded to this width).
    pub fn head_dim(&self) -> usize {
        match self.mla {
            Some(m) => m.qk_head_dim + m.qk_pos_emb_head_dim,
            None => self
                .kv_channels
                .unwrap_or(self.hidden_size / self.num_attention_heads),
        }
    }

    /// Key/value heads: query groups, or one per head (multi-head attention; MLA).
    pub fn query_groups(&self) -> usize {
        match self.mla {
            Some(_) => self.num_attention_heads,
            None => self.num_query_groups.unwrap_or(self.num_attention_heads),
        }
    }

    /// Width of the attention output, the output projection's input (Megatron's
    /// `query_projection_size`; MLA's `heads * v_head_dim`).
    pub fn query_projection_size(&self) -> usize {
        match self.mla {
            Some(m) => self.num_attention_heads * m.v_head_dim,
            None => self.num_attention_heads * self.head_dim(),
        }
    }

    /// Width of the fused QKV the attention kernel reads: queries plus one key and one value
    /// per group (MLA: per head, at the kernel's head width).
    pub fn qkv_size(&self) -> usize {
        (self.num_attention_heads + 2 * self.query_groups()) * self.head_dim()
    }

    /// Whether layer `l` (global number) is an MoE layer. The multi-token-prediction layers
    /// (numbered from `num_layers` on) follow the last decoder layer, as megatron-core builds
    /// them from its spec.
    /// The MLP's (and experts') activation kernel, with gpt-oss's clamp and offset.
    pub fn activation_kernel(&self) -> megatron_tensor::cpu::MlpActivation {
        use megatron_tensor::cpu::MlpActivation as K;
        let limits = GluLimits {
            linear_offset: self.glu.linear_offset,
            clamp: self.glu.clamp_value,
        };
        match self.activation.kernel(self.gelu) {
            K::SwiGLU(_) => K::SwiGLU(limits),
            K::QuickGeGLU(_) => K::QuickGeGLU(limits),
            k => k,
        }
    }

    pub fn is_moe_layer(&self, l: usize) -> bool {
        let l = self.pattern_layer(l);
        self.moe.as_ref().is_some_and(|m| match &m.layers {
            LayerPattern::Every(n) => l.is_multiple_of((*n).max(1)),
            LayerPattern::List(v) => v.get(l).copied().unwrap_or(false),
        })
    }

    /// The sliding window of layer `l` (global number), if it has one.
    pub fn attention_window(&self, l: usize) -> Option<usize> {
        let l = self.pattern_layer(l);
        self.window.as_ref().and_then(|w| w.of_layer(l))
    }

    /// The decoder layer whose per-layer settings layer `l` takes: itself, or for a
    /// multi-token-prediction layer the last decoder layer.
    fn pattern_layer(&self, l: usize) -> usize {
        l.min(self.num_layers.saturating_sub(1))
    }

    /// Features of each head that rotary embeddings rotate (MLA: of its rotary part).
    pub fn rotary_dim(&self) -> usize {
        let rotated = match self.mla {
            Some(m) => m.qk_pos_emb_head_dim,
            None => self.head_dim(),
        };
        (rotated as f32 * self.rotary.percent) as usize
    }

    /// MLA's factor on the softmax scale beyond `1/sqrt(qk + pe)`: YaRN's
    /// `mscale(factor, mscale_all_dim)²` (megatron-core's `MultiLatentAttention.softmax_scale`),
    /// 1 without YaRN. Applied to the queries.
    pub fn mla_query_scale(&self) -> f32 {
        match self.rotary.yarn {
            Some(y) if self.mla.is_some() => {
                let m = if y.factor <= 1.0 {
                    1.0
                } else {
                    0.1 * y.mscale_all_dim * y.factor.ln() + 1.0
                };
                (m * m) as f32
            }
            _ => 1.0,
        }
    }

    /// Megatron's default FFN width: 4h, or under SwiGLU `int(4h * 2/3 / 64) * 64`, which
    /// keeps the three matrices near the parameter count of GELU's two (Megatron leaves
    /// `--quick-geglu` at 4h).
    pub fn default_ffn_hidden_size(hidden: usize, activation: Activation) -> usize {
        if matches!(activation, Activation::SwiGLU | Activation::GeGLU) {
            ((4 * hidden) as f64 * 2.0 / 3.0 / 64.0) as usize * 64
        } else {
            4 * hidden
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        for (flag, v) in [
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--ffn-hidden-size", self.ffn_hidden_size),
            ("--seq-length", self.seq_length),
            ("--max-position-embeddings", self.max_position_embeddings),
            ("--vocab-size", self.padded_vocab_size),
        ] {
            if v == 0 {
                return Err(ConfigError::NotPositive { flag, value: 0 });
            }
        }
        if self.kv_channels.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(ConfigError::HeadsDoNotDivideHidden {
                heads: self.num_attention_heads,
                hidden: self.hidden_size,
            });
        }
        if self.seq_length > self.max_position_embeddings {
            return Err(ConfigError::SeqLongerThanPositions {
                seq: self.seq_length,
                max_pos: self.max_position_embeddings,
            });
        }
        let groups = self.query_groups();
        if groups == 0 || !self.num_attention_heads.is_multiple_of(groups) {
            return Err(ConfigError::GroupsDoNotDivideHeads {
                groups,
                heads: self.num_attention_heads,
            });
        }
        if let Some(m) = &self.moe {
            m.layers
                .check(self.num_layers)
                .map_err(ConfigError::BadMoELayerPattern)?;
        }
        if let Some(w) = &self.window {
            if self.attn_mask_type != AttnMaskType::Causal {
                return Err(ConfigError::WindowOnEncoder);
            }
            if let Some(p) = &w.skip {
                p.check(self.num_layers)
                    .map_err(ConfigError::BadWindowPattern)?;
            }
        }
        if let Some(m) = self.mtp {
            if m.num_layers == 0 {
                return Err(ConfigError::NotPositive {
                    flag: "--mtp-num-layers",
                    value: 0,
                });
            }
            if !m.loss_scaling_factor.is_finite() || m.loss_scaling_factor < 0.0 {
                return Err(ConfigError::BadMtpScale(m.loss_scaling_factor));
            }
        }
        if let Some(m) = self.mla {
            for (flag, v) in [
                ("--kv-lora-rank", m.kv_lora_rank),
                ("--qk-head-dim", m.qk_head_dim),
                ("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim),
                ("--v-head-dim", m.v_head_dim),
                ("--q-lora-rank", m.q_lora_rank.unwrap_or(1)),
            ] {
                if v == 0 {
                    return Err(ConfigError::NotPositive { flag, value: 0 });
                }
            }
            if m.v_head_dim > m.qk_head_dim + m.qk_pos_emb_head_dim {
                return Err(ConfigError::MlaValueWider {
                    v: m.v_head_dim,
                    qk: m.qk_head_dim,
                    pe: m.qk_pos_emb_head_dim,
                });
            }
            if self.position_embedding_type != PositionEmbeddingType::Rope {
                return Err(ConfigError::MlaWithoutRope);
            }
            if self.num_query_groups.is_some() {
                return Err(ConfigError::MlaWithGroups);
            }
        }
        if self.kv_channels == Some(0) {
            return Err(ConfigError::NotPositive {
                flag: "--kv-channels",
                value: 0,
            });
        }
        if self.position_embedding_type == PositionEmbeddingType::Rope {
            let r = self.rotary;
            if !(r.percent > 0.0 && r.percent <= 1.0) {
                return Err(ConfigError::BadRotaryPercent(r.percent));
            }
            if r.base.is_nan() || r.base <= 0.0 {
                return Err(ConfigError::BadRotaryBase(r.base));
            }
            let rot = self.rotary_dim();
            if rot < 2 || !rot.is_multiple_of(2) {
                return Err(ConfigError::OddRotaryDim {
                    percent: r.percent,
                    head_dim: self.head_dim(),
                    rot,
                });
            }
        }
        for (flag, p) in [
            ("--hidden-dropout", self.hidden_dropout),
            ("--attention-dropout", self.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(ConfigError::BadProbability { flag, value: p });
            }
        }
        Ok(())
    }

    /// Vocabulary padded up to a multiple of `divisible_by` (Megatron's `_vocab_size_with_padding`).
    pub fn pad_vocab(vocab: usize, divisible_by: usize) -> usize {
        let d = divisible_by.max(1);
        vocab.div_ceil(d) * d
    }
}

/// GPT-2's choices for everything but the sizes (which are zero and must be set).
impl Default for TransformerConfig {
    fn default() -> Self {
        TransformerConfig {
            num_layers: 0,
            hidden_size: 0,
            num_attention_heads: 0,
            ffn_hidden_size: 0,
            seq_length: 0,
            max_position_embeddings: 0,
            padded_vocab_size: 0,
            hidden_dropout: 0.1,
            attention_dropout: 0.1,
            init_method_std: 0.02,
            layernorm_epsilon: 1e-5,
            untie_embeddings_and_output_weights: false,
            normalization: Normalization::LayerNorm,
            activation: Activation::Gelu,
            position_embedding_type: PositionEmbeddingType::LearnedAbsolute,
            rotary: RotaryConfig::default(),
            num_query_groups: None,
            kv_channels: None,
            add_bias_linear: true,
            add_qkv_bias: true,
            qk_layernorm: false,
            moe: None,
            attn_mask_type: AttnMaskType::Causal,
            gelu: GeluForm::Tanh,
            layernorm_placement: LayerNormPlacement::PreLn,
            window: None,
            mla: None,
            mtp: None,
            glu: GluConfig::default(),
            softmax_type: SoftmaxType::Vanilla,
            residual: ResidualPrecision::F32,
        }
    }
}

fn is_vanilla(s: &SoftmaxType) -> bool {
    *s == SoftmaxType::Vanilla
}
