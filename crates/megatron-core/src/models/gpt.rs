//! `GPTModel`: embedding, decoder block of `TransformerLayer`s, final LayerNorm, output layer
//! (tied to the word embedding unless untied), fused vocabulary-chunked cross-entropy. A model
//! may be one pipeline stage's chunk of layers; `forward_step`/`backward_step` are what the
//! pipeline schedules call, `forward_backward` the whole model at once.

use super::embedding::LanguageModelEmbedding;
use super::model_chunk::{ChunkState, ModelChunk, ModelFamily};
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region_backward, gather_from_sequence_parallel_region_backward,
    gather_from_sequence_parallel_region_forward,
};
use crate::tensor_parallel::{vocab_parallel_cross_entropy, Tp};
use crate::transformer::block::{
    transformer_block_backward, transformer_block_forward, ForwardMode, TransformerBlockSaved,
};
use crate::transformer::config::PositionEmbeddingType;
use crate::transformer::config::TransformerConfig;
use crate::transformer::layer::{FeedForward, LayerNormSaved, Norm, TransformerLayer};
use crate::transformer::moe::{MoELayer, MoEMetrics};
use crate::transformer::multi_token_prediction::{
    MtpDepthSaved, MultiTokenPredictionBlock, ShiftedBatch,
};
use crate::transformer::step::{LossReduction, Recompute, RecomputeMethod, StepContext};
use megatron_comm::CommError;
use megatron_tensor::cpu::{
    AttentionMask, ClassifierDims, RopeScaling, RopeStyle, RopeTable, YarnScaling,
};
use megatron_tensor::{DType, Tensor};

use std::sync::Arc;

/// One micro-batch: `tokens` and `labels` are `[b, t]` flattened; `loss_mask` weights each label.
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub labels: &'a [u32],
    pub loss_mask: &'a [f32],
    pub b: usize,
    pub t: usize,
    /// `[b, t]` position ids replacing `0..t` (Megatron's `--reset-position-ids`).
    pub position_ids: Option<&'a [u32]>,
    /// `[b, t]`: the first position each token may attend to (`--reset-attention-mask`).
    pub doc_start: Option<&'a [u32]>,
}

impl Batch<'_> {
    fn mask(&self) -> AttentionMask<'_> {
        AttentionMask {
            key_lens: None,
            doc_start: self.doc_start,
        }
    }
}

/// Result of one micro-batch's forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct MicroBatchResult {
    /// Mean loss over the unmasked labels.
    pub loss: f32,
    /// Number of unmasked labels.
    pub tokens: f32,
    /// Bytes held by saved activations at the peak (after the last layer's forward).
    pub activation_bytes: usize,
}

/// A GPT model, or one pipeline stage's chunk of it: the embedding on the first stage
/// (`pre_process`), a range of transformer layers, the final LayerNorm, output layer and loss on
/// the last (`post_process`). Layer numbers and parameter names are global.
pub struct GPTModel {
    pub config: TransformerConfig,
    pub embedding: Option<LanguageModelEmbedding>,
    pub layers: Vec<TransformerLayer>,
    pub final_layernorm: Option<Norm>,
    /// The untied output layer, if any.
    pub output_layer: Option<ParamId>,
    /// The weight the output layer multiplies by (last stage): the untied output layer, the word
    /// embedding, or the last stage's copy of the word embedding under pipeline parallelism.
    pub output_weight: Option<ParamId>,
    /// Multi-token prediction (`--mtp-num-layers`), on the chunk with the loss.
    pub mtp: Option<MultiTokenPredictionBlock>,
    /// Under pipeline parallelism, the last stage's copy of the word embedding that
    /// multi-token prediction embeds its shifted tokens with.
    mtp_embedding: Option<LanguageModelEmbedding>,
    vocab_start: usize,
    vocab_per_partition: usize,
}

/// What a stage keeps of one micro-batch between its forward and its backward.
pub struct ForwardState {
    saved: TransformerBlockSaved,
    /// Last stage: the last layer's output, the final LayerNorm statistics and the gradient of
    /// the LayerNorm output (the loss gradient is known in the forward: the output layer and
    /// the cross entropy are fused and run their backward right away).
    tail: Option<(Tensor, LayerNormSaved, Tensor)>,
    /// Last stage: what each multi-token-prediction depth keeps.
    mtp: Vec<MtpDepthSaved>,
    pub activation_bytes: usize,
    /// Last stage: mean loss over unmasked labels and their number.
    pub loss: Option<(f32, f32)>,
}

/// Bytes of one logits tile in the fused output layer, and its most rows. Larger tiles make the
/// three output-layer GEMMs more efficient (GPT-2 124M shapes, 2048 tokens x 50304 vocab:
/// 2.89 s at 166 rows, 2.29 s at 512, 2.33 s at 1024); beyond ~500 rows nothing is gained, and
/// the budget keeps the tile a fraction of the full `[tokens, vocab]` logits.
const CLASSIFIER_TILE_BYTES: usize = 96 << 20;
const CLASSIFIER_MAX_ROWS: usize = 1024;

/// Token rows of the output layer's logits tile for `v` vocabulary rows on this rank.
pub fn classifier_tile_rows(v: usize) -> usize {
    (CLASSIFIER_TILE_BYTES / (4 * v)).clamp(64, CLASSIFIER_MAX_ROWS)
}

/// Bytes of activations the engine keeps for backward per micro-batch, at the peak after the
/// last layer's forward: the engine's counterpart of Korthikanti et al.'s `sbh(34 + 5as/h)`.
/// Per layer and token: the layer input and the mid-layer residual (h each), the fused QKV
/// (`(heads + 2 groups) x kv_channels`, rotary embeddings applied in place), the attention
/// output (`heads x kv_channels`) and the fc1 output (f, or 2f under SwiGLU), each in f32 or,
/// under `--bf16` / `--fp16`, in 16 bits; plus the f32 norm statistics (mean and rstd of two
/// LayerNorms, or the rstd of two RMSNorms) and the f32 attention log-sum-exp (a per token;
/// flash-style attention keeps no `s x s` scores); plus the last layer's output (h per
/// token, in the residual stream's storage); under `--qk-layernorm` the query and key norms'
/// inputs (in 16 or 32 bits) and their f32 statistics per head. Tensor parallelism divides the QKV, attention, fc1, log-sum-exp
/// and query/key-norm terms by `t`;
/// sequence parallelism also the input, residual, statistics and output. Multi-token
/// prediction adds its depths (`activation_bytes_formula_with`).
pub fn activation_bytes_formula(
    cfg: &TransformerConfig,
    b: usize,
    s: usize,
    tp: usize,
    sequence_parallel: bool,
    half: bool,
) -> usize {
    let split = ActivationSplit::tensor_parallel(tp, sequence_parallel);
    activation_bytes_formula_with(cfg, b, s, split, half, Recompute::None)
}

/// How a rank's layers are split, for [`activation_bytes_formula_with`]: tensor parallelism,
/// the experts' tensor parallelism (`--expert-tensor-parallel-size`: each of its ranks gathers
/// its group's routed tokens) and whether sequence parallelism splits the token rows.
#[derive(Clone, Copy, Debug)]
pub struct ActivationSplit {
    pub tp: usize,
    pub etp: usize,
    pub sequence_parallel: bool,
}

impl ActivationSplit {
    /// Experts split as the layers (Megatron's default expert tensor parallelism).
    pub fn tensor_parallel(tp: usize, sequence_parallel: bool) -> Self {
        ActivationSplit {
            tp,
            etp: tp,
            sequence_parallel,
        }
    }
}

/// [`activation_bytes_formula`] under activation recomputation: selective `core_attn` drops
/// each layer's attention output and log-sum-exp, `mlp` its fc1 output; full recomputation
/// keeps one layer input (in the residual stream's storage) per recomputed group instead of the groups'
/// layers (the transient activations of the one group being recomputed are not counted, as
/// in Korthikanti et al.).
pub fn activation_bytes_formula_with(
    cfg: &TransformerConfig,
    b: usize,
    s: usize,
    split: ActivationSplit,
    half: bool,
    recompute: Recompute,
) -> usize {
    use crate::transformer::config::Normalization;
    let ActivationSplit {
        tp,
        etp,
        sequence_parallel,
    } = split;
    let (h, a, l) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers);
    let fc1 = if cfg.activation.is_gated() {
        2 * cfg.ffn_hidden_size
    } else {
        cfg.ffn_hidden_size
    };
    let stats = match cfg.normalization {
        Normalization::LayerNorm => 4,
        Normalization::RMSNorm => 2,
    };
    let e = if half { 2 } else { 4 };
    let tok = b * s;
    // --qk-layernorm keeps the norms' inputs (queries and keys) and their statistics per head.
    let qk_heads = if cfg.qk_layernorm && cfg.mla.is_none() {
        a + cfg.query_groups()
    } else {
        0
    };
    let qk_norm = qk_heads * (e * cfg.head_dim() + 4 * stats / 2);
    let split =
        (tok / tp) * (e * (cfg.qkv_size() + cfg.query_projection_size() + fc1) + 4 * a + qk_norm);
    let rows = if sequence_parallel && tp > 1 {
        tok / tp
    } else {
        tok
    };
    // MLA keeps its latents (before their norms) on the rows its down projections ran on.
    let latents = cfg
        .mla
        .map_or(0, |m| m.q_lora_rank.unwrap_or(0) + m.kv_lora_rank);
    // The layer's input and mid residual are kept in the residual stream's storage.
    let stream = cfg.residual.dtype().size_in_bytes();
    let mut layer = split + rows * (e * latents + stream * 2 * h + 4 * stats);
    let dense_mlp = (tok / tp) * e * fc1;
    // A mixture-of-experts layer keeps, instead of the dense MLP's fc1 output: the router's f32
    // logits, each token's k choices (4 bytes) and probabilities (8), and on the experts' side
    // the dispatched input (gathered over the expert-tensor-parallel group), the experts' fc1
    // output (their share of its width) and the expert outputs combine weighs, one row per
    // routed token (exact with every expert on this rank; the expected rows under balanced
    // routing with expert parallelism), plus the shared expert's fc1 output (and, with its
    // gate, its output and gate values).
    let moe_mlp = cfg.moe.as_ref().map_or(dense_mlp, |x| {
        let gated = if cfg.activation.is_gated() { 2 } else { 1 };
        let slots = rows * x.topk;
        let shared = x.shared_expert_ffn.map_or(0, |f| {
            let gate = if x.shared_expert_gate {
                rows * (e * h + 4)
            } else {
                0
            };
            (tok / tp) * e * gated * f + gate
        });
        let experts = slots * e * (etp * h + gated * x.ffn_hidden_size + h);
        rows * x.num_experts * 4 + slots * 12 + experts + shared
    });
    let input = rows * h * stream;
    // Layer `i` of this stage, by its MLP.
    let bytes_of = |i: usize, layer: usize| {
        if cfg.is_moe_layer(i) {
            layer - dense_mlp + moe_mlp
        } else {
            layer
        }
    };
    let kept = match recompute {
        Recompute::None => (0..l).map(|i| bytes_of(i, layer)).sum(),
        Recompute::Selective(m) => {
            if m.core_attn {
                layer -= (tok / tp) * (e * cfg.query_projection_size() + 4 * a);
            }
            let mlp_recomputed = if m.mlp { dense_mlp } else { 0 };
            (0..l)
                .map(|i| match cfg.is_moe_layer(i) {
                    true => bytes_of(i, layer),
                    false => layer - mlp_recomputed,
                })
                .sum()
        }
        Recompute::Full {
            method: RecomputeMethod::Uniform,
            num_layers,
        } => l.div_ceil(num_layers.max(1)) * input,
        Recompute::Full {
            method: RecomputeMethod::Block,
            num_layers,
        } => {
            let r = num_layers.min(l);
            r * input + (r..l).map(|i| bytes_of(i, layer)).sum::<usize>()
        }
    };
    // Multi-token prediction, per depth: its layer (never fully recomputed); in f32 the
    // shifted embedding, the previous hidden state, their concatenation and the loss gradient
    // of its hidden state; the layer output in the residual stream's storage; and three
    // norms' statistics.
    let mtp = cfg.mtp.map_or(0, |m| {
        m.num_layers * (layer + rows * ((4 * 5 + stream) * h + 6 * stats))
    });
    kept + rows * h * stream + mtp
}

/// The labels a loss counts (`mask`'s sum). Each context-parallel rank holds part of the
/// sequences, so the count is the whole sequences': summed over the group.
fn counted_labels(tp: &mut Tp, mask: &[f32]) -> Result<f32, CommError> {
    let mut total = [mask.iter().sum::<f32>()];
    if let Some(c) = tp.cp() {
        c.all_reduce(&mut total, megatron_comm::ReduceOp::Sum)?;
    }
    Ok(total[0])
}

/// The per-token `losses` weighted by `mask` over `denom` counted labels, summed over the
/// context-parallel group (each rank adds its chunks' share).
fn masked_mean(tp: &mut Tp, losses: &[f32], mask: &[f32], denom: f32) -> Result<f64, CommError> {
    let local = losses
        .iter()
        .zip(mask)
        .map(|(l, m)| (*l as f64) * (*m as f64))
        .sum::<f64>()
        / denom as f64;
    match tp.cp() {
        Some(c) => crate::tensor_parallel::sum_f64(c, local),
        None => Ok(local),
    }
}

/// The rotary table every layer shares, for the longest sequence the model sees (training
/// length or position limit, whichever is larger, so generation can run to
/// `--max-position-embeddings`).
pub fn rope_table(cfg: &TransformerConfig) -> Option<(Arc<RopeTable>, RopeStyle)> {
    (cfg.position_embedding_type == PositionEmbeddingType::Rope).then(|| {
        let r = cfg.rotary;
        let positions = cfg.seq_length.max(cfg.max_position_embeddings);
        let scaling = match (r.yarn, r.scaling_factor) {
            (Some(y), _) => Some(RopeScaling::Yarn(YarnScaling {
                factor: y.factor,
                original_max_position: y.original_max_position_embeddings as f64,
                beta_fast: y.beta_fast,
                beta_slow: y.beta_slow,
                mscale: y.mscale,
                mscale_all_dim: y.mscale_all_dim,
                round_to_int: y.correction_range_round_to_int,
            })),
            (None, Some(f)) => Some(RopeScaling::llama3(f)),
            (None, None) => r.seq_len_interpolation_factor.map(RopeScaling::Linear),
        };
        let table = RopeTable::new(cfg.rotary_dim(), r.base, positions, scaling);
        // MLA rotates its rotary features as pairs (2i, 2i + 1), as megatron-core's
        // `mla_rotary_interleaved` and DeepSeek's checkpoints do, whatever --rotary-interleaved says.
        let style = if r.interleaved || cfg.mla.is_some() {
            RopeStyle::Interleaved
        } else {
            RopeStyle::RotateHalf
        };
        (Arc::new(table), style)
    })
}

impl GPTModel {
    /// Builds the model and its parameters, initialized from `seed`.
    pub fn new(config: TransformerConfig, seed: u64) -> (GPTModel, Params) {
        Self::new_tp(config, seed, 0, 1)
    }

    /// The model as one rank of a tensor-parallel group of `tp_size` holds it: sharded
    /// parameters hold this rank's slice of the TP = 1 initialization.
    pub fn new_tp(
        config: TransformerConfig,
        seed: u64,
        tp_rank: usize,
        tp_size: usize,
    ) -> (GPTModel, Params) {
        let mut params = Params::for_tp_rank(tp_rank, tp_size);
        let mut inits = Vec::new();
        let model = Self::build(config, &mut params, &mut inits);
        params.initialize(seed, &inits);
        (model, params)
    }

    /// Registers the parameters (no values yet).
    pub fn build(
        config: TransformerConfig,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> GPTModel {
        let l = config.num_layers;
        Self::build_chunk(config, params, inits, 0..l, true, true)
    }

    /// One pipeline stage's chunk: layers `layers` (global numbers), with the embedding if
    /// `pre_process` and the final LayerNorm and output layer if `post_process`. The last stage
    /// of a tied model registers its own copy of the word embedding
    /// ([`LanguageModelEmbedding::last_stage_copy`]).
    pub fn build_chunk(
        config: TransformerConfig,
        params: &mut Params,
        inits: &mut Vec<Init>,
        layers: std::ops::Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> GPTModel {
        let embedding = pre_process.then(|| LanguageModelEmbedding::new(&config, params, inits));
        let rope = rope_table(&config);
        let layers = layers
            .map(|l| TransformerLayer::new(&config, "decoder", l, rope.clone(), params, inits))
            .collect();
        let final_layernorm = post_process.then(|| {
            Norm::new(
                config.normalization,
                "decoder.final_layernorm",
                config.hidden_size,
                config.layernorm_epsilon,
                params,
                inits,
            )
        });
        let output_layer =
            (post_process && config.untie_embeddings_and_output_weights).then(|| {
                params.add_sharded(
                    inits,
                    "output_layer.weight".into(),
                    &[config.padded_vocab_size, config.hidden_size],
                    true,
                    Init::Normal(config.init_method_std),
                    Sharding::Split(0),
                )
            });
        let (tp_rank, t) = (params.tp.0, params.tp.1.max(1));
        let output_weight = if !post_process {
            None
        } else if let Some(o) = output_layer {
            Some(o)
        } else if let Some(e) = &embedding {
            Some(e.word_embeddings)
        } else {
            Some(LanguageModelEmbedding::last_stage_copy(
                &config, params, inits,
            ))
        };
        let mtp = (post_process && config.mtp.is_some())
            .then(|| MultiTokenPredictionBlock::new(&config, rope, params, inits));
        // A last stage without the embedding embeds MTP's tokens with a copy of the first
        // stage's table: the output layer's, if tied, else one more (its gradient summed with
        // the first stage's over the embedding group either way).
        let mtp_embedding = (mtp.is_some() && embedding.is_none()).then(|| {
            let word = match (config.untie_embeddings_and_output_weights, output_weight) {
                (false, Some(w)) => w,
                _ => LanguageModelEmbedding::last_stage_copy(&config, params, inits),
            };
            LanguageModelEmbedding::sharing_word(&config, word, params)
        });
        let per = config.padded_vocab_size / t;
        GPTModel {
            config,
            embedding,
            layers,
            final_layernorm,
            output_layer,
            output_weight,
            mtp,
            mtp_embedding,
            vocab_start: tp_rank * per,
            vocab_per_partition: per,
        }
    }

    /// The word embedding of the first stage, or the last stage's copy (tied models, and
    /// multi-token prediction's).
    pub fn word_embeddings(&self) -> Option<ParamId> {
        match (&self.embedding, &self.mtp_embedding) {
            (Some(e), _) | (None, Some(e)) => Some(e.word_embeddings),
            (None, None) if !self.config.untie_embeddings_and_output_weights => self.output_weight,
            (None, None) => None,
        }
    }

    /// The embedding multi-token prediction embeds its shifted tokens with.
    fn mtp_embedding(&self) -> &LanguageModelEmbedding {
        self.mtp_embedding
            .as_ref()
            .or(self.embedding.as_ref())
            .expect("an MTP chunk has the embedding or its copy")
    }

    fn classifier_dims(&self, n: usize) -> ClassifierDims {
        let v = self.vocab_per_partition;
        ClassifierDims {
            n,
            c: self.config.hidden_size,
            v,
            chunk_rows: classifier_tile_rows(v),
        }
    }

    /// The output layer's input: all token rows (gathered under sequence parallelism).
    fn output_input(&self, tp: &mut Tp, xf: Tensor) -> Result<Tensor, CommError> {
        if tp.sequence_parallel {
            gather_from_sequence_parallel_region_forward(tp, &xf)
        } else {
            Ok(xf)
        }
    }

    /// The fused output layer and cross entropy with their backward: per-token `losses`, the
    /// output weight's gradient, and the gradient of the output layer's input `xg` (all token
    /// rows) for this rank's rows. The output layer is column-parallel over the vocabulary, so
    /// that gradient is summed over TP (reduce-scattered to the token blocks under SP).
    #[allow(clippy::too_many_arguments)]
    fn output_loss_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        xg: Tensor,
        labels: &[u32],
        dloss: &[f32],
        losses: &mut [f32],
    ) -> Result<Tensor, CommError> {
        let n = labels.len();
        let wid = self
            .output_weight
            .expect("the last stage has an output weight");
        let mut dxg = Tensor::for_overwrite(&[n, self.config.hidden_size]);
        vocab_parallel_cross_entropy(
            tp,
            losses,
            Some((dxg.data_mut(), grads.get_mut(wid))),
            xg.data(),
            params.operand(wid).operand(),
            None,
            labels,
            dloss,
            self.classifier_dims(n),
            self.vocab_start,
        )?;
        drop(xg);
        if tp.sequence_parallel {
            gather_from_sequence_parallel_region_backward(tp, &dxg)
        } else {
            copy_to_tensor_model_parallel_region_backward(tp, dxg)
        }
    }

    /// Forward and backward of one micro-batch on a whole model (no pipeline). Gradients
    /// accumulate into `grads`, scaled by `grad_scale` (1 / number of micro-batches for
    /// Megatron's mean over micro-batches). Every TP rank of the group calls it with the same
    /// batch.
    pub fn forward_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        batch: &Batch,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<MicroBatchResult, CommError> {
        let (_, state) =
            self.forward_step(params, Some(&mut *grads), tp, None, batch, grad_scale, ctx)?;
        let activation_bytes = state.activation_bytes;
        let (loss, tokens) = state.loss.expect("a whole model computes the loss");
        self.backward_step(params, grads, tp, state, None, batch, ctx, &mut |_| {})?;
        Ok(MicroBatchResult {
            loss,
            tokens,
            activation_bytes,
        })
    }

    /// Mean loss over the unmasked labels of a whole model, without dropout and without
    /// keeping activations.
    pub fn forward_loss(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &Batch,
    ) -> Result<f32, CommError> {
        let (_, state) =
            self.forward_step(params, None, tp, None, batch, 1.0, &StepContext::eval())?;
        Ok(state.loss.expect("a whole model computes the loss").0)
    }

    /// [`GPTModel::forward_backward`] of a model without tensor parallelism.
    pub fn forward_backward_serial(
        &self,
        params: &Params,
        grads: &mut Grads,
        batch: &Batch,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> MicroBatchResult {
        let mut one = crate::tensor_parallel::serial_group();
        self.forward_backward(
            params,
            grads,
            &mut Tp::new(&mut one, false),
            batch,
            grad_scale,
            ctx,
        )
        .expect("a group of one rank does not communicate")
    }

    /// [`GPTModel::forward_loss`] of a model without tensor parallelism.
    pub fn forward_loss_serial(&self, params: &Params, batch: &Batch) -> f32 {
        let mut one = crate::tensor_parallel::serial_group();
        self.forward_loss(params, &mut Tp::new(&mut one, false), batch)
            .expect("a group of one rank does not communicate")
    }
}

impl ChunkState for ForwardState {
    fn activation_bytes(&self) -> usize {
        self.activation_bytes
    }
    fn loss(&self) -> Option<(f32, f32)> {
        self.loss
    }
}

impl GPTModel {
    /// The multi-token-prediction depths on the decoder's normed output `h0` (this rank's
    /// rows): each depth's forward, its loss and that loss's gradient of its hidden state
    /// (weighted by `--mtp-loss-scaling-factor` over the depths). `main` is the step's gradient
    /// scale and the decoder loss's counted labels.
    fn mtp_forward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        h0: Tensor,
        batch: &Batch<'_>,
        (grad_scale, main_tokens): (f32, f32),
        ctx: &StepContext,
    ) -> Result<Vec<MtpDepthSaved>, CommError> {
        let mtp = self.mtp.as_ref().expect("an MTP chunk");
        let e = self.mtp_embedding();
        let (b, t) = (batch.b, batch.t);
        let n = b * t;
        // Shifts run on whole sequences: under context parallelism, gathered from the group.
        let cp = tp.cp_layout();
        let mut full = ShiftedBatch::first(
            batch.tokens,
            batch.position_ids,
            batch.labels,
            batch.loss_mask,
            t,
        );
        if let Some(c) = tp.cp() {
            full = full.gathered(c, cp, b, t)?;
        }
        let t_full = t * cp.size;
        let weight = mtp.depth_weight();
        let mut saved: Vec<MtpDepthSaved> = Vec::with_capacity(mtp.layers.len());
        let mut h = h0;
        for (k, layer) in mtp.layers.iter().enumerate() {
            full = full.shifted(t_full);
            let sb = match cp.size {
                1 => full.clone(),
                _ => full.on_rank(cp, b, t_full),
            };
            let embedded = e.forward_shifted(params, tp, &sb.tokens, &sb.positions, t, ctx, k)?;
            let out = layer.forward(params, tp, sb, embedded, h, (b, t), ctx, batch.mask())?;
            let mut depth = out.saved;
            let (labels, mask) = (&depth.batch.labels, &depth.batch.loss_mask);
            let denom = counted_labels(tp, mask)?.max(1.0);
            // megatron-core's MTP loss: each depth's mean over its counted labels, scaled
            // like the decoder loss (per token: by the decoder's count over this depth's).
            let dloss: Vec<f32> = match ctx.loss_reduction {
                LossReduction::MicroBatchMean => mask
                    .iter()
                    .map(|m| m / denom * weight * grad_scale)
                    .collect(),
                LossReduction::TokenSum => mask
                    .iter()
                    .map(|m| m * main_tokens / denom * weight * grad_scale)
                    .collect(),
            };
            let xg = self.output_input(tp, out.hidden.clone())?;
            let mut losses = vec![0.0f32; n];
            let dhidden =
                self.output_loss_backward(params, grads, tp, xg, labels, &dloss, &mut losses)?;
            mtp.record_loss(k, masked_mean(tp, &losses, mask, denom)?);
            depth.dhidden = dhidden;
            h = out.hidden;
            saved.push(depth);
        }
        Ok(saved)
    }

    /// The depths' backward, last first: the gradient of the decoder's normed output.
    fn mtp_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        states: Vec<MtpDepthSaved>,
        batch: &Batch<'_>,
        ctx: &StepContext,
    ) -> Result<Tensor, CommError> {
        let mtp = self.mtp.as_ref().expect("an MTP chunk");
        let e = self.mtp_embedding();
        let (b, t) = (batch.b, batch.t);
        let mut dnext: Option<Tensor> = None;
        for (k, (layer, mut s)) in mtp.layers.iter().zip(states).enumerate().rev() {
            let mut dh = std::mem::replace(&mut s.dhidden, Tensor::zeros(&[0]));
            if let Some(d) = dnext.take() {
                megatron_tensor::cpu::reduce::add_inplace(dh.data_mut(), d.data());
            }
            let (de, dprev, sb) =
                layer.backward(params, grads, tp, s, &dh, (b, t), ctx, batch.mask())?;
            e.backward_shifted(grads, tp, &sb.tokens, &sb.positions, t, de, ctx, k)?;
            dnext = Some(dprev);
        }
        Ok(dnext.expect("at least one depth"))
    }

    /// This chunk's mixture-of-experts layers, the multi-token-prediction depths' included
    /// (their routers log, update their expert bias and checkpoint it like the decoder's).
    fn moe_layers(&self) -> impl Iterator<Item = &MoELayer> {
        let depths = self.mtp.iter().flat_map(|m| m.layers.iter());
        let layers = self.layers.iter().chain(depths.map(|d| &d.mtp_model_layer));
        layers.filter_map(|l| match &l.mlp {
            FeedForward::MoE(m) => Some(m.as_ref()),
            FeedForward::Dense(_) => None,
        })
    }
}

impl ModelChunk for GPTModel {
    type Batch<'b> = Batch<'b>;
    type State = ForwardState;

    fn pre_process(&self) -> bool {
        self.embedding.is_some()
    }

    fn post_process(&self) -> bool {
        self.final_layernorm.is_some()
    }

    /// Hidden states of this rank's token rows (a block of them under sequence parallelism).
    fn input_shape(&self, batch: &Batch<'_>, tp: &Tp) -> [usize; 2] {
        let (lo, hi) = tp.sequence_shard(batch.b * batch.t);
        [hi - lo, self.config.hidden_size]
    }

    fn output_shape(&self, batch: &Batch<'_>, tp: &Tp) -> [usize; 2] {
        self.input_shape(batch, tp)
    }

    fn activation_dtype(&self) -> DType {
        self.config.residual.dtype()
    }

    fn forward_step(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        input: Option<Tensor>,
        batch: &Batch<'_>,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<(Option<Tensor>, ForwardState), CommError> {
        let (b, t) = (batch.b, batch.t);
        let n = b * t;
        let x = match (&self.embedding, input) {
            (Some(e), _) => e.forward(params, tp, batch.tokens, batch.position_ids, t, ctx)?,
            (None, Some(x)) => x,
            (None, None) => panic!("a stage without the embedding needs its input"),
        };
        let keep = grads.is_some();
        let mode = if keep {
            ForwardMode::Train
        } else {
            ForwardMode::Eval
        };
        let (x, saved) = transformer_block_forward(
            &self.layers,
            params,
            tp,
            x,
            (b, t),
            ctx,
            batch.mask(),
            mode,
        )?;
        let mut activation_bytes = saved.size_in_bytes();
        let Some(lnf_layer) = &self.final_layernorm else {
            let state = ForwardState {
                saved,
                tail: None,
                mtp: Vec::new(),
                activation_bytes,
                loss: None,
            };
            return Ok((Some(x), state));
        };
        if keep {
            activation_bytes += x.size_in_bytes();
        }
        let (xf, lnf) = lnf_layer.forward(params, &x);
        // Multi-token prediction starts from the decoder's normed output (training only).
        let mtp_input = (self.mtp.is_some() && keep).then(|| xf.clone());
        let xg = self.output_input(tp, xf)?;
        let total = counted_labels(tp, batch.loss_mask)?;
        let denom = total.max(1.0);
        let mut losses = vec![0.0f32; n];
        let wid = self
            .output_weight
            .expect("the last stage has an output weight");
        let dims = self.classifier_dims(n);
        let mut tail = None;
        let mut mtp = Vec::new();
        match grads {
            Some(grads) => {
                // The reported loss stays the micro-batch's mean either way.
                let dloss: Vec<f32> = match ctx.loss_reduction {
                    LossReduction::MicroBatchMean => batch
                        .loss_mask
                        .iter()
                        .map(|m| m / denom * grad_scale)
                        .collect(),
                    LossReduction::TokenSum => {
                        batch.loss_mask.iter().map(|m| m * grad_scale).collect()
                    }
                };
                let dxf = self.output_loss_backward(
                    params,
                    grads,
                    tp,
                    xg,
                    batch.labels,
                    &dloss,
                    &mut losses,
                )?;
                tail = Some((x, lnf, dxf));
                if let Some(h0) = mtp_input {
                    mtp =
                        self.mtp_forward(params, grads, tp, h0, batch, (grad_scale, total), ctx)?;
                    activation_bytes += mtp.iter().map(|s| s.size_in_bytes()).sum::<usize>();
                }
            }
            None => vocab_parallel_cross_entropy(
                tp,
                &mut losses,
                None,
                xg.data(),
                params.operand(wid).operand(),
                None,
                batch.labels,
                &[],
                dims,
                self.vocab_start,
            )?,
        }
        let loss = masked_mean(tp, &losses, batch.loss_mask, denom)?;
        let state = ForwardState {
            saved,
            tail,
            mtp,
            activation_bytes,
            loss: Some((loss as f32, total)),
        };
        Ok((None, state))
    }

    fn backward_step(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        state: ForwardState,
        dy: Option<Tensor>,
        batch: &Batch<'_>,
        ctx: &StepContext,
        on_ready: &mut dyn FnMut(usize),
    ) -> Result<Option<Tensor>, CommError> {
        let (b, t) = (batch.b, batch.t);
        let offset = |id: ParamId| params.metas[id.0].offset;
        let dx = match (state.tail, &self.final_layernorm) {
            (Some((x, lnf, mut dxf)), Some(ln)) => {
                if !state.mtp.is_empty() {
                    let dh0 = self.mtp_backward(params, grads, tp, state.mtp, batch, ctx)?;
                    megatron_tensor::cpu::reduce::add_inplace(dxf.data_mut(), dh0.data());
                }
                let dx = ln.backward(params, grads, &lnf, &x, &dxf);
                on_ready(offset(ln.weight()));
                dx
            }
            (None, None) => dy.expect("a stage without the loss needs the output gradient"),
            _ => panic!("backward_step of a state not made by forward_step with gradients"),
        };
        let dx = transformer_block_backward(
            &self.layers,
            params,
            grads,
            tp,
            state.saved,
            dx,
            (b, t),
            ctx,
            batch.mask(),
            on_ready,
        )?;
        match &self.embedding {
            Some(e) => {
                e.backward(grads, tp, batch.tokens, batch.position_ids, t, dx, ctx)?;
                on_ready(offset(e.word_embeddings));
                Ok(None)
            }
            None => Ok(Some(dx)),
        }
    }

    fn shared_embedding(&self) -> Option<ParamId> {
        // Untied, the first and last stages share the word embedding only for multi-token
        // prediction's copy.
        if self.config.untie_embeddings_and_output_weights && self.config.mtp.is_none() {
            None
        } else {
            self.word_embeddings()
        }
    }

    fn take_moe_metrics(&self) -> Vec<(usize, MoEMetrics)> {
        self.moe_layers()
            .map(|m| (m.layer, m.take_metrics()))
            .collect()
    }

    fn take_mtp_losses(&self) -> Vec<(f64, f64)> {
        self.mtp.as_ref().map_or(Vec::new(), |m| m.take_losses())
    }

    fn finalize_step(
        &self,
        tp: &mut Tp,
        mut dp: Option<&mut dyn megatron_comm::Communicator>,
    ) -> Result<(), CommError> {
        for m in self.moe_layers() {
            m.update_expert_bias(tp, megatron_comm::reborrow(&mut dp))?;
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<(String, Vec<f32>)> {
        self.moe_layers().filter_map(|m| m.expert_bias()).collect()
    }

    fn load_buffer(&self, name: &str, values: &[f32]) -> bool {
        match self.moe_layers().find(|m| m.expert_bias_name() == name) {
            Some(m) => {
                m.set_expert_bias(values);
                true
            }
            None => false,
        }
    }
}

/// GPT and the Llama family: one decoder family, configured by [`TransformerConfig`].
impl ModelFamily for TransformerConfig {
    type Chunk = GPTModel;

    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn build_chunk(
        &self,
        params: &mut Params,
        inits: &mut Vec<Init>,
        layers: std::ops::Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> GPTModel {
        GPTModel::build_chunk(
            self.clone(),
            params,
            inits,
            layers,
            pre_process,
            post_process,
        )
    }
}
