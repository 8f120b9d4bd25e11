//! `BertModel` (megatron-core's `BertModel`, and Hugging Face's `BertModel` /
//! `BertForPreTraining` under `post_ln`): word, position and token-type embeddings, an encoder
//! of bidirectional `TransformerLayer`s under the padding mask, then on the last stage the
//! masked-language-model head and, optionally, the sentence-order (binary) head. The loss is
//! Megatron's `pretrain_bert.py` loss: the mean cross-entropy over the micro-batch's masked
//! tokens plus the mean sentence-order cross-entropy over its sequences.
//!
//! Pre-LN (Megatron's BERT): a final LayerNorm after the last layer. Post-LN (the original
//! BERT): a LayerNorm on the embeddings before dropout, each layer normalizes its residual
//! sums, no final LayerNorm.

use super::{BertBinaryHead, BertLMHead, HeadBackward, MaskedTokens};
use crate::models::embedding::LanguageModelEmbedding;
use crate::models::model_chunk::{ChunkState, LossPhase, ModelChunk, ModelFamily};
use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::mappings::{
    gather_from_sequence_parallel_region_forward, scatter_to_sequence_parallel_region_forward,
};
use crate::tensor_parallel::Tp;
use crate::transformer::block::{
    transformer_block_backward, transformer_block_forward, ForwardMode, TransformerBlockSaved,
};
use crate::transformer::config::{AttnMaskType, GeluForm, LayerNormPlacement, TransformerConfig};
use crate::transformer::layer::{LayerNormSaved, Norm, TransformerLayer};
use crate::transformer::saved::{keep, readable, widened};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::AttentionMask;
use megatron_tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// What BERT has after its encoder besides the MLM head (`--bert-no-binary-head` turns the
/// sentence-order head off; a Hugging Face `BertModel` has the pooler alone).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum BinaryHead {
    /// Pooler and sentence-order head, trained (Megatron's default).
    #[default]
    SentenceOrder,
    /// The pooler's weights only (kept for conversion; no loss).
    PoolerOnly,
    /// Neither (`--bert-no-binary-head`).
    None,
}

/// Whether the model has the masked-language-model head (a Hugging Face `BertModel`, e.g. a
/// sentence encoder, has none: it embeds but does not pre-train).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum LmHead {
    #[default]
    MaskedLm,
    None,
}

/// What makes a BERT of a `TransformerConfig`: its segments and its heads (recorded in
/// checkpoints beside the transformer config).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct BertHeads {
    /// Token types (segments): Megatron's `num_tokentypes`, 2 with the binary head, else 0;
    /// Hugging Face's `type_vocab_size`.
    pub num_tokentypes: usize,
    pub binary_head: BinaryHead,
    #[serde(default)]
    pub lm_head: LmHead,
    /// The MLM head's GELU where it differs from the layers': Megatron's `BertLMHead` always
    /// runs torch's exact `F.gelu`, while its layers default to the fused tanh bias-GELU.
    /// `None` follows the model's `gelu` (Hugging Face BERT's one `hidden_act`, and checkpoints
    /// written before this field).
    #[serde(default)]
    pub lm_head_gelu: Option<GeluForm>,
}

impl BertHeads {
    /// Megatron's BERT: the MLM head; two token types with the binary head and none without.
    pub fn megatron(binary_head: BinaryHead) -> Self {
        let num_tokentypes = match binary_head {
            BinaryHead::None => 0,
            _ => 2,
        };
        BertHeads {
            num_tokentypes,
            binary_head,
            lm_head: LmHead::MaskedLm,
            lm_head_gelu: Some(GeluForm::Erf),
        }
    }
}

/// The BERT family: the encoder's `TransformerConfig` (with `AttnMaskType::Padding`) and its
/// heads.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BertConfig {
    pub transformer: TransformerConfig,
    pub heads: BertHeads,
}

impl BertConfig {
    /// Megatron's BERT of `transformer`'s sizes (bidirectional under the padding mask).
    pub fn new(transformer: TransformerConfig, binary_head: BinaryHead) -> Self {
        Self::with_heads(transformer, BertHeads::megatron(binary_head))
    }

    /// A BERT with the given heads (a converted checkpoint's).
    pub fn with_heads(mut transformer: TransformerConfig, heads: BertHeads) -> Self {
        transformer.attn_mask_type = AttnMaskType::Padding;
        BertConfig { transformer, heads }
    }
}

/// One micro-batch of BERT samples (Megatron's `BertDataset` fields), `[b, t]` flattened.
pub struct BertBatch<'a> {
    pub tokens: &'a [u32],
    /// Segment of each token (`types`).
    pub tokentypes: &'a [u32],
    /// Real tokens of each sequence; the rest is padding (`padding_mask`).
    pub key_lens: &'a [usize],
    /// Rows of the micro-batch (`s * t + position`) whose tokens are to be predicted
    /// (`loss_mask`), ascending, and their original tokens (`labels`).
    pub masked_rows: &'a [u32],
    pub masked_labels: &'a [u32],
    /// 1 where the two segments were swapped (`is_random`), per sequence; empty without the
    /// binary head.
    pub sentence_order: &'a [u32],
    pub b: usize,
    pub t: usize,
}

impl BertBatch<'_> {
    fn mask(&self) -> AttentionMask<'_> {
        AttentionMask {
            key_lens: Some(self.key_lens),
            doc_start: None,
        }
    }
}

/// A BERT model, or one pipeline stage's chunk of it.
pub struct BertModel {
    pub config: BertConfig,
    pub embedding: Option<LanguageModelEmbedding>,
    /// Post-LN: the embeddings' LayerNorm (first stage).
    pub embedding_norm: Option<Norm>,
    pub layers: Vec<TransformerLayer>,
    /// Pre-LN: the encoder's final LayerNorm (last stage).
    pub final_layernorm: Option<Norm>,
    pub lm_head: Option<BertLMHead>,
    pub binary_head: Option<BertBinaryHead>,
    /// The LM head's output weight: the word embedding, or the last stage's copy of it.
    pub output_weight: Option<ParamId>,
    /// The first parameter registered after the layers (the last stage's head).
    tail_first: Option<ParamId>,
    /// The sentence-order loss of each micro-batch since the last take, by [`LossPhase`]
    /// (training, evaluation): the sum of the means and their number.
    sop_logged: std::sync::Mutex<[(f64, f64); 2]>,
}

/// What a stage keeps of one micro-batch.
pub struct BertState {
    /// Post-LN first stage: the embedding sum and its LayerNorm statistics.
    embedding: Option<(Tensor, LayerNormSaved)>,
    block: TransformerBlockSaved,
    /// Last stage: the pre-LN final norm's input and statistics, and the gradient of the
    /// tail's input (known in the forward: the heads run their backward right away).
    tail: Option<(Option<(Tensor, LayerNormSaved)>, Tensor)>,
    activation_bytes: usize,
    loss: Option<(f32, f32)>,
}

impl ChunkState for BertState {
    fn activation_bytes(&self) -> usize {
        self.activation_bytes
    }
    fn loss(&self) -> Option<(f32, f32)> {
        self.loss
    }
}

impl BertModel {
    /// Adds one micro-batch's sentence-order loss to the log of `phase` (with the binary head).
    fn record_sop(&self, phase: LossPhase, sop: f64) {
        if self.binary_head.as_ref().is_some_and(|h| h.has_head()) {
            let mut l = self.sop_logged.lock().expect("sentence-order loss log");
            l[phase as usize].0 += sop;
            l[phase as usize].1 += 1.0;
        }
    }

    /// The stage's chunk: layers `layers` (global numbers), with the embeddings if
    /// `pre_process` and the heads if `post_process`.
    pub fn build_chunk(
        config: BertConfig,
        params: &mut Params,
        inits: &mut Vec<Init>,
        layers: Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> BertModel {
        let cfg = &config.transformer;
        let post_ln = cfg.layernorm_placement == LayerNormPlacement::PostLn;
        let norm = |name: &str, params: &mut Params, inits: &mut Vec<Init>| {
            Norm::new(
                cfg.normalization,
                name,
                cfg.hidden_size,
                cfg.layernorm_epsilon,
                params,
                inits,
            )
        };
        let embedding = pre_process.then(|| {
            LanguageModelEmbedding::with_tokentypes(cfg, config.heads.num_tokentypes, params, inits)
        });
        let embedding_norm =
            (pre_process && post_ln).then(|| norm("embedding.layernorm", params, inits));
        let layers: Vec<TransformerLayer> = layers
            .map(|l| TransformerLayer::new(cfg, "encoder", l, None, params, inits))
            .collect();
        let tail_first = post_process.then_some(ParamId(params.metas.len()));
        let final_layernorm =
            (post_process && !post_ln).then(|| norm("encoder.final_layernorm", params, inits));
        let lm_head = (post_process && config.heads.lm_head == LmHead::MaskedLm).then(|| {
            let gelu = config.heads.lm_head_gelu.unwrap_or(cfg.gelu);
            BertLMHead::new(cfg, gelu, params, inits)
        });
        let binary_head = match config.heads.binary_head {
            _ if !post_process => None,
            BinaryHead::None => None,
            BinaryHead::PoolerOnly => Some(BertBinaryHead::pooler_only(cfg, params, inits)),
            BinaryHead::SentenceOrder => Some(BertBinaryHead::new(cfg, params, inits)),
        };
        let output_weight = match (&embedding, post_process) {
            (_, false) => None,
            (Some(e), true) => Some(e.word_embeddings),
            (None, true) => Some(LanguageModelEmbedding::last_stage_copy(cfg, params, inits)),
        };
        BertModel {
            config,
            embedding,
            embedding_norm,
            layers,
            final_layernorm,
            lm_head,
            binary_head,
            output_weight,
            tail_first,
            sop_logged: std::sync::Mutex::new([(0.0, 0.0); 2]),
        }
    }

    /// The whole model on one tensor-parallel rank of `tp_size`, initialized from `seed`.
    pub fn new_tp(config: BertConfig, seed: u64, tp_rank: usize, tp_size: usize) -> (Self, Params) {
        let mut params = Params::for_tp_rank(tp_rank, tp_size);
        let mut inits = Vec::new();
        let l = config.transformer.num_layers;
        let model = Self::build_chunk(config, &mut params, &mut inits, 0..l, true, true);
        params.initialize(seed, &inits);
        (model, params)
    }

    /// The encoder's output for every token of `batch` (`[b * t, hidden]`, after the final
    /// LayerNorm under pre-LN; padding rows included): what sentence embeddings pool. A whole
    /// model (embeddings and every layer), no dropout. Collective over `tp`.
    pub fn encode(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &BertBatch,
    ) -> Result<Tensor, CommError> {
        let e = self
            .embedding
            .as_ref()
            .expect("encode runs a whole model, embeddings included");
        let ctx = StepContext::eval();
        let (x, _) = self.embed(e, params, tp, batch, &ctx, ForwardMode::Eval)?;
        let (x, _) = transformer_block_forward(
            &self.layers,
            params,
            tp,
            x,
            (batch.b, batch.t),
            &ctx,
            batch.mask(),
            ForwardMode::Eval,
        )?;
        let x = match &self.final_layernorm {
            Some(ln) => ln.forward(params, &x).0,
            None => widened(x),
        };
        if tp.sequence_parallel {
            gather_from_sequence_parallel_region_forward(tp, &x)
        } else {
            Ok(x)
        }
    }

    /// The embeddings of a first stage: `[rows, h]` of this rank, and what backward needs.
    fn embed(
        &self,
        e: &LanguageModelEmbedding,
        params: &Params,
        tp: &mut Tp,
        batch: &BertBatch,
        ctx: &StepContext,
        mode: ForwardMode,
    ) -> Result<(Tensor, Option<(Tensor, LayerNormSaved)>), CommError> {
        let types = (self.config.heads.num_tokentypes > 0).then_some(batch.tokentypes);
        let sum = e.sum_forward(params, tp, batch.tokens, None, types, batch.t)?;
        let (x, saved) = match &self.embedding_norm {
            Some(ln) => {
                let (y, s) = ln.forward(params, &sum);
                (y, (mode == ForwardMode::Train).then(|| (keep(sum), s)))
            }
            None => (sum, None),
        };
        Ok((
            e.dropout_forward(tp, x, batch.tokens.len(), batch.t, ctx),
            saved,
        ))
    }

    /// The heads' loss on the encoder output `y` (every row of the micro-batch), and with
    /// `backward` its gradient added to `dy`. Returns (MLM loss, sentence-order loss).
    fn heads(
        &self,
        params: &Params,
        tp: &mut Tp,
        y: &Tensor,
        batch: &BertBatch,
        mut backward: Option<HeadBackward>,
    ) -> Result<(f64, f64), CommError> {
        let lm = self
            .lm_head
            .as_ref()
            .expect("the last stage has the LM head");
        let masked = MaskedTokens {
            rows: batch.masked_rows,
            labels: batch.masked_labels,
        };
        let wid = self
            .output_weight
            .expect("the last stage has an output weight");
        let lm_loss = lm.loss(
            params,
            tp,
            y,
            wid,
            &masked,
            backward.as_mut().map(|b| b.reborrow()),
        )?;
        let sop_loss = match &self.binary_head {
            Some(h) if h.has_head() => h.loss(params, y, batch.t, batch.sentence_order, backward),
            _ => 0.0,
        };
        Ok((lm_loss, sop_loss))
    }
}

impl ModelChunk for BertModel {
    type Batch<'b> = BertBatch<'b>;
    type State = BertState;

    fn take_sop_losses(&self, phase: LossPhase) -> Option<(f64, f64)> {
        self.binary_head.as_ref().filter(|h| h.has_head())?;
        let mut l = self.sop_logged.lock().expect("sentence-order loss log");
        Some(std::mem::take(&mut l[phase as usize]))
    }

    fn pre_process(&self) -> bool {
        self.embedding.is_some()
    }

    fn post_process(&self) -> bool {
        self.tail_first.is_some()
    }

    fn input_shape(&self, batch: &BertBatch<'_>, tp: &Tp) -> [usize; 2] {
        let (lo, hi) = tp.sequence_shard(batch.b * batch.t);
        [hi - lo, self.config.transformer.hidden_size]
    }

    fn output_shape(&self, batch: &BertBatch<'_>, tp: &Tp) -> [usize; 2] {
        self.input_shape(batch, tp)
    }

    fn activation_dtype(&self) -> DType {
        self.config.transformer.residual.dtype()
    }

    fn forward_step(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        input: Option<Tensor>,
        batch: &BertBatch<'_>,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<(Option<Tensor>, BertState), CommError> {
        let mode = if grads.is_some() {
            ForwardMode::Train
        } else {
            ForwardMode::Eval
        };
        let (x, embedding) = match (&self.embedding, input) {
            (Some(e), _) => self.embed(e, params, tp, batch, ctx, mode)?,
            (None, Some(x)) => (x, None),
            (None, None) => panic!("a stage without the embedding needs its input"),
        };
        let (x, block) = transformer_block_forward(
            &self.layers,
            params,
            tp,
            x,
            (batch.b, batch.t),
            ctx,
            batch.mask(),
            mode,
        )?;
        let mut activation_bytes = block.size_in_bytes()
            + embedding
                .as_ref()
                .map_or(0, |(s, ln)| s.size_in_bytes() + ln.size_in_bytes());
        if !self.post_process() {
            let state = BertState {
                embedding,
                block,
                tail: None,
                activation_bytes,
                loss: None,
            };
            return Ok((Some(x), state));
        }
        let (xf, lnf) = match &self.final_layernorm {
            Some(ln) => {
                let (y, s) = ln.forward(params, &x);
                (y, Some((x, s)))
            }
            None => (widened(x), None),
        };
        let y = if tp.sequence_parallel {
            gather_from_sequence_parallel_region_forward(tp, &xf)?
        } else {
            xf
        };
        let (loss, tail) = match grads {
            Some(grads) => {
                let mut dy = Tensor::zeros(y.shape());
                let (lm, sop) = self.heads(
                    params,
                    tp,
                    &y,
                    batch,
                    Some(HeadBackward {
                        grads,
                        dy: &mut dy,
                        dloss: grad_scale,
                    }),
                )?;
                drop(y);
                // Every rank holds the whole gradient of the gathered rows: its own block is
                // the gradient of its rows.
                let dxf = if tp.sequence_parallel {
                    scatter_to_sequence_parallel_region_forward(tp, &dy)
                } else {
                    dy
                };
                let lnf = lnf.map(|(x, s)| (keep(x), s));
                activation_bytes += lnf.as_ref().map_or(0, |(x, _)| x.size_in_bytes());
                self.record_sop(LossPhase::Training, sop);
                (lm + sop, Some((lnf, dxf)))
            }
            None => {
                let (lm, sop) = self.heads(params, tp, &y, batch, None)?;
                self.record_sop(LossPhase::Evaluation, sop);
                (lm + sop, None)
            }
        };
        let state = BertState {
            embedding,
            block,
            tail,
            activation_bytes,
            loss: Some((loss as f32, batch.masked_rows.len() as f32)),
        };
        Ok((None, state))
    }

    fn backward_step(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        state: BertState,
        dy: Option<Tensor>,
        batch: &BertBatch<'_>,
        ctx: &StepContext,
        on_ready: &mut dyn FnMut(usize),
    ) -> Result<Option<Tensor>, CommError> {
        let offset = |id: ParamId| params.metas[id.0].offset;
        let dx = match state.tail {
            Some((lnf, dxf)) => {
                let dx = match (lnf, &self.final_layernorm) {
                    (Some((x, s)), Some(ln)) => ln.backward(params, grads, &s, &readable(&x), &dxf),
                    _ => dxf,
                };
                on_ready(offset(self.tail_first.expect("a last stage's head")));
                dx
            }
            None => dy.expect("a stage without the heads needs the output gradient"),
        };
        let dx = transformer_block_backward(
            &self.layers,
            params,
            grads,
            tp,
            state.block,
            dx,
            (batch.b, batch.t),
            ctx,
            batch.mask(),
            on_ready,
        )?;
        let Some(e) = &self.embedding else {
            return Ok(Some(dx));
        };
        let mut dsum = e.dropout_backward(tp, dx, batch.tokens.len(), batch.t, ctx);
        if let (Some((sum, s)), Some(ln)) = (state.embedding, &self.embedding_norm) {
            dsum = ln.backward(params, grads, &s, &readable(&sum), &dsum);
        }
        let types = (self.config.heads.num_tokentypes > 0).then_some(batch.tokentypes);
        e.sum_backward(grads, tp, batch.tokens, None, types, batch.t, dsum)?;
        on_ready(offset(e.word_embeddings));
        Ok(None)
    }

    fn shared_embedding(&self) -> Option<ParamId> {
        match &self.embedding {
            Some(e) => Some(e.word_embeddings),
            None => self.output_weight,
        }
    }
}

impl ModelFamily for BertConfig {
    type Chunk = BertModel;

    fn num_layers(&self) -> usize {
        self.transformer.num_layers
    }

    fn build_chunk(
        &self,
        params: &mut Params,
        inits: &mut Vec<Init>,
        layers: Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> BertModel {
        BertModel::build_chunk(
            self.clone(),
            params,
            inits,
            layers,
            pre_process,
            post_process,
        )
    }
}
