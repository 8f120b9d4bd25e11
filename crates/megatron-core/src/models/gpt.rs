//! `GPTModel`: embedding, decoder block of `TransformerLayer`s, final LayerNorm, output layer
//! (tied to the word embedding unless untied), fused vocabulary-chunked cross-entropy.

use super::embedding::LanguageModelEmbedding;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region_backward, gather_from_sequence_parallel_region_backward,
    gather_from_sequence_parallel_region_forward,
};
use crate::tensor_parallel::{vocab_parallel_cross_entropy, Tp};
use crate::transformer::config::TransformerConfig;
use crate::transformer::layer::{LayerNorm, TransformerLayer};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::{AttentionMask, ClassifierDims};
use megatron_tensor::Tensor;

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

pub struct GPTModel {
    pub config: TransformerConfig,
    pub embedding: LanguageModelEmbedding,
    pub layers: Vec<TransformerLayer>,
    pub final_layernorm: LayerNorm,
    pub output_layer: Option<ParamId>,
}

/// Bytes of one logits tile in the fused output layer, and its most rows. Larger tiles make the
/// three output-layer GEMMs more efficient (GPT-2 124M shapes, 2048 tokens x 50304 vocab:
/// 2.89 s at 166 rows, 2.29 s at 512, 2.33 s at 1024); beyond ~500 rows nothing is gained, and
/// the budget keeps the tile a fraction of the full `[tokens, vocab]` logits.
const CLASSIFIER_TILE_BYTES: usize = 96 << 20;
const CLASSIFIER_MAX_ROWS: usize = 1024;

/// Bytes of activations the engine keeps for backward per micro-batch (f32), at the peak after
/// the last layer's forward: the engine's counterpart of Korthikanti et al.'s `sbh(34 + 5as/h)`.
/// Per layer and token: the layer input and the mid-layer residual (h each), four LayerNorm
/// statistics, QKV (3h), attention output (h), fc1 pre-activation (f) and the attention
/// log-sum-exp (a per token; flash-style attention keeps no `s x s` scores), plus the last
/// layer's output (h per token). Tensor parallelism divides the QKV, attention, fc1 and
/// log-sum-exp terms by `t`; sequence parallelism also the input, residual, statistics and
/// output: with SP all of it is `/t`.
pub fn activation_bytes_formula(
    cfg: &TransformerConfig,
    b: usize,
    s: usize,
    tp: usize,
    sequence_parallel: bool,
) -> usize {
    let (h, f, a, l) = (
        cfg.hidden_size,
        cfg.ffn_hidden_size,
        cfg.num_attention_heads,
        cfg.num_layers,
    );
    let tok = b * s;
    let split = (tok / tp) * (4 * h + f + a);
    let (per_layer, last) = if sequence_parallel && tp > 1 {
        (split + (tok / tp) * (2 * h + 4), tok / tp * h)
    } else {
        (split + tok * (2 * h + 4), tok * h)
    };
    4 * (l * per_layer + last)
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
        let embedding = LanguageModelEmbedding::new(&config, params, inits);
        let layers = (0..config.num_layers)
            .map(|l| TransformerLayer::new(&config, l, params, inits))
            .collect();
        let final_layernorm = LayerNorm::new(
            "decoder.final_layernorm",
            config.hidden_size,
            config.layernorm_epsilon,
            params,
            inits,
        );
        let output_layer = if config.untie_embeddings_and_output_weights {
            Some(params.add_sharded(
                inits,
                "output_layer.weight".into(),
                &[config.padded_vocab_size, config.hidden_size],
                true,
                Init::Normal(config.init_method_std),
                Sharding::Split(0),
            ))
        } else {
            None
        };
        GPTModel {
            config,
            embedding,
            layers,
            final_layernorm,
            output_layer,
        }
    }

    fn output_weight(&self) -> ParamId {
        self.output_layer.unwrap_or(self.embedding.word_embeddings)
    }

    fn classifier_dims(&self, n: usize) -> ClassifierDims {
        let v = self.embedding.word.vocab_per_partition;
        ClassifierDims {
            n,
            c: self.config.hidden_size,
            v,
            chunk_rows: (CLASSIFIER_TILE_BYTES / (4 * v)).clamp(64, CLASSIFIER_MAX_ROWS),
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

    /// Forward and backward of one micro-batch. Gradients accumulate into `grads`, scaled by
    /// `grad_scale` (1 / number of micro-batches for Megatron's mean over micro-batches).
    /// Every TP rank of the group calls it with the same batch.
    pub fn forward_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        batch: &Batch,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<MicroBatchResult, CommError> {
        let (b, t) = (batch.b, batch.t);
        let n = b * t;
        let mut x = self
            .embedding
            .forward(params, tp, batch.tokens, batch.position_ids, t, ctx)?;
        let mut saved = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (y, s) = layer.forward(params, tp, x, b, t, ctx, batch.mask())?;
            saved.push(s);
            x = y;
        }
        let activation_bytes =
            saved.iter().map(|s| s.size_in_bytes()).sum::<usize>() + x.size_in_bytes();
        let (xf, lnf) = self.final_layernorm.forward(params, &x);
        let xg = self.output_input(tp, xf)?;
        let total: f32 = batch.loss_mask.iter().sum();
        let denom = total.max(1.0);
        let dloss: Vec<f32> = batch
            .loss_mask
            .iter()
            .map(|m| m / denom * grad_scale)
            .collect();
        let mut losses = vec![0.0f32; n];
        let mut dxg = Tensor::for_overwrite(&[n, self.config.hidden_size]);
        let wid = self.output_weight();
        let vocab_start = self.embedding.word.vocab_start;
        let dims = self.classifier_dims(n);
        vocab_parallel_cross_entropy(
            tp,
            &mut losses,
            Some((dxg.data_mut(), grads.get_mut(wid))),
            xg.data(),
            params.get(wid),
            batch.labels,
            &dloss,
            dims,
            vocab_start,
        )?;
        drop(xg);
        // The output layer is column-parallel over the vocabulary: its input gradient is summed
        // over TP (reduce-scattered to the token blocks under sequence parallelism).
        let dxf = if tp.sequence_parallel {
            gather_from_sequence_parallel_region_backward(tp, &dxg)?
        } else {
            copy_to_tensor_model_parallel_region_backward(tp, dxg)?
        };
        let mut dx = self.final_layernorm.backward(params, grads, &lnf, &x, &dxf);
        drop(dxf);
        drop(x);
        for (layer, s) in self.layers.iter().zip(saved).rev() {
            dx = layer.backward(params, grads, tp, s, dx, b, t, ctx, batch.mask())?;
        }
        self.embedding
            .backward(grads, tp, batch.tokens, batch.position_ids, t, dx, ctx)?;
        let loss = losses
            .iter()
            .zip(batch.loss_mask)
            .map(|(l, m)| (*l as f64) * (*m as f64))
            .sum::<f64>()
            / denom as f64;
        Ok(MicroBatchResult {
            loss: loss as f32,
            tokens: total,
            activation_bytes,
        })
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

    /// Mean loss over the unmasked labels, without dropout and without keeping activations.
    pub fn forward_loss(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &Batch,
    ) -> Result<f32, CommError> {
        let (b, t) = (batch.b, batch.t);
        let n = b * t;
        let ctx = StepContext::eval();
        let mut x =
            self.embedding
                .forward(params, tp, batch.tokens, batch.position_ids, t, &ctx)?;
        for layer in &self.layers {
            x = layer.forward_no_grad(params, tp, x, b, t, &ctx, batch.mask())?;
        }
        let (xf, _) = self.final_layernorm.forward(params, &x);
        let xg = self.output_input(tp, xf)?;
        let mut losses = vec![0.0f32; n];
        let wid = self.output_weight();
        let vocab_start = self.embedding.word.vocab_start;
        vocab_parallel_cross_entropy(
            tp,
            &mut losses,
            None,
            xg.data(),
            params.get(wid),
            batch.labels,
            &[],
            self.classifier_dims(n),
            vocab_start,
        )?;
        let total: f32 = batch.loss_mask.iter().sum();
        Ok((losses
            .iter()
            .zip(batch.loss_mask)
            .map(|(l, m)| (*l as f64) * (*m as f64))
            .sum::<f64>()
            / total.max(1.0) as f64) as f32)
    }
}
