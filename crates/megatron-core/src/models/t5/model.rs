//! `T5Model` on one pipeline stage (Hugging Face's `T5ForConditionalGeneration`,
//! megatron-core's `T5Model` with relative positions): one word embedding shared by the
//! encoder, the decoder and the tied output layer; each stack with its relative position bias
//! (bidirectional buckets in the encoder, causal ones in the decoder), its layers and a final
//! norm followed by dropout; the decoder's output scaled by `hidden^-1/2` before the tied
//! logits (T5's rescaling), and vocabulary-parallel cross-entropy over the counted labels.
//! Under pipeline parallelism a stage holds a part of one stack ([`T5Part`]).

use super::layer::{T5Layer, T5LayerInputs, T5LayerSaved, T5Stack};
use super::relative_bias::RelativePositionBias;
use super::T5AttentionShape;
use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region_backward, gather_from_sequence_parallel_region_backward,
    gather_from_sequence_parallel_region_forward,
};
use crate::tensor_parallel::{vocab_parallel_cross_entropy, Tp, VocabParallelEmbedding};
use crate::transformer::config::TransformerConfig;
use crate::transformer::layer::{add_inplace, DropoutRows, LayerNormSaved, Norm};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::dropout::{dropout_backward, dropout_forward};
use megatron_tensor::cpu::reduce::scale_inplace;
use megatron_tensor::cpu::ClassifierDims;
use megatron_tensor::Tensor;
use serde::{Deserialize, Serialize};

/// What makes a T5 of a `TransformerConfig` (recorded in checkpoints beside it): the stacks'
/// depths, the relative positions and the attention scale.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct T5Stacks {
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    /// `relative_attention_num_buckets`, `relative_attention_max_distance`.
    pub relative_buckets: usize,
    pub relative_max_distance: usize,
    /// The attention scores' factor (1 in T5).
    pub softmax_scale: f32,
    /// The decoder output scaled by `hidden^-1/2` before the logits (the original T5, with
    /// tied embeddings; not T5 v1.1 / Flan-T5: transformers' `scale_decoder_outputs`).
    #[serde(default = "scaled")]
    pub scale_decoder_outputs: bool,
}

fn scaled() -> bool {
    true
}

/// A T5: the layers' sizes, norms and activation in `transformer` (its `num_layers` unused)
/// and the stacks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct T5Config {
    pub transformer: TransformerConfig,
    pub stacks: T5Stacks,
}

/// One micro-batch: encoder inputs `[b, te]`, decoder inputs and labels `[b, td]` (labels
/// `IGNORE_INDEX` where not counted), the loss mask, each sequence's real lengths.
pub struct T5Batch<'a> {
    pub enc_tokens: &'a [u32],
    pub dec_tokens: &'a [u32],
    pub labels: &'a [u32],
    pub loss_mask: &'a [f32],
    pub enc_lens: &'a [usize],
    pub dec_lens: &'a [usize],
    pub b: usize,
    pub te: usize,
    pub td: usize,
}

pub struct T5Model {
    pub config: T5Config,
    /// The encoder's and the decoder's layers this chunk holds (each stack's own numbers).
    pub part: T5Part,
    /// On the stages that embed tokens or compute logits (the encoder's and the decoder's
    /// first stages and the last one); the copies after the first are tied to it.
    pub embedding: Option<VocabParallelEmbedding>,
    /// On every stage of its stack (tied over them).
    pub encoder_bias: Option<RelativePositionBias>,
    pub encoder: Vec<T5Layer>,
    /// With the encoder's last layer.
    pub encoder_norm: Option<Norm>,
    pub decoder_bias: Option<RelativePositionBias>,
    pub decoder: Vec<T5Layer>,
    /// With the decoder's last layer: on the last stage.
    pub decoder_norm: Option<Norm>,
    /// The last stage's own output layer (`--untie-embeddings-and-output-weights`, T5 v1.1's
    /// `lm_head`); the word embedding otherwise.
    pub output_layer: Option<crate::params::ParamId>,
    tp_rank: usize,
    tp_size: usize,
}

/// What one pipeline stage holds of a T5: ranges of the encoder's and of the decoder's layers
/// (either may be empty). Under Megatron's encoder/decoder split a stage holds layers of one
/// stack; without pipelining, all of both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct T5Part {
    pub encoder: std::ops::Range<usize>,
    pub decoder: std::ops::Range<usize>,
}

impl T5Part {
    /// The part of a stage holding the model's layers `layers` (encoder layers first).
    pub fn of_layers(stacks: &T5Stacks, layers: std::ops::Range<usize>) -> T5Part {
        let e = stacks.encoder_layers;
        T5Part {
            encoder: layers.start.min(e)..layers.end.min(e),
            decoder: layers.start.max(e) - e..layers.end.max(e) - e,
        }
    }
    fn has_encoder(&self) -> bool {
        !self.encoder.is_empty()
    }
    fn has_decoder(&self) -> bool {
        !self.decoder.is_empty()
    }
    /// Embeds the encoder's tokens: the first stage.
    fn encoder_start(&self) -> bool {
        self.has_encoder() && self.encoder.start == 0
    }
    fn encoder_end(&self, st: &T5Stacks) -> bool {
        self.has_encoder() && self.encoder.end == st.encoder_layers
    }
    /// Embeds the decoder's tokens (its input from the previous stage is the encoder output
    /// alone).
    fn decoder_start(&self) -> bool {
        self.has_decoder() && self.decoder.start == 0
    }
    /// Computes the logits and the loss: the last stage.
    fn decoder_end(&self, st: &T5Stacks) -> bool {
        self.has_decoder() && self.decoder.end == st.decoder_layers
    }
}

/// This rank's rows of `n` token rows: its block under sequence parallelism.
fn rows(tp: &Tp, n: usize) -> usize {
    let (lo, hi) = tp.sequence_shard(n);
    hi - lo
}

/// Dropout streams of the embeddings and the stacks' outputs (layers use their numbers).
const STREAM_EMBEDDING: usize = 1 << 20;
const SITE_ENCODER_EMBEDDING: u64 = 1;
const SITE_DECODER_EMBEDDING: u64 = 2;
const SITE_ENCODER_OUTPUT: u64 = 3;
const SITE_DECODER_OUTPUT: u64 = 4;

/// What a stage's stacks keep for backward.
#[derive(Default)]
struct SavedStacks {
    encoder: Vec<T5LayerSaved>,
    /// The encoder's last layer's output and its final norm's statistics.
    encoder_out: Option<(Tensor, LayerNormSaved)>,
    /// The encoder output the decoder layers read.
    memory: Option<Tensor>,
    decoder: Vec<T5LayerSaved>,
    decoder_out: Option<(Tensor, LayerNormSaved)>,
    enc_bias: Vec<f32>,
    dec_bias: Vec<f32>,
}

/// What backward needs of a forward.
pub struct T5State {
    stacks: SavedStacks,
    /// Last stage: gradient of the decoder's final (scaled, dropped) output, known in the
    /// forward.
    dlast: Option<Tensor>,
    /// Last stage: the mean loss and the counted labels.
    loss_and_tokens: Option<(f32, f32)>,
}

impl T5State {
    /// The micro-batch's mean loss (last stage; 0 elsewhere).
    pub fn loss(&self) -> f32 {
        self.loss_and_tokens.map_or(0.0, |l| l.0)
    }
}

impl SavedStacks {
    fn size_in_bytes(&self) -> usize {
        let t = |x: &Option<Tensor>| x.as_ref().map_or(0, |x| x.size_in_bytes());
        let out = |x: &Option<(Tensor, LayerNormSaved)>| {
            x.as_ref()
                .map_or(0, |(x, l)| x.size_in_bytes() + l.size_in_bytes())
        };
        self.encoder
            .iter()
            .chain(&self.decoder)
            .map(|s| s.size_in_bytes())
            .sum::<usize>()
            + out(&self.encoder_out)
            + t(&self.memory)
            + out(&self.decoder_out)
            + 4 * (self.enc_bias.len() + self.dec_bias.len())
    }
}

impl crate::models::ChunkState for T5State {
    fn activation_bytes(&self) -> usize {
        self.stacks.size_in_bytes()
    }
    fn loss(&self) -> Option<(f32, f32)> {
        self.loss_and_tokens
    }
}

/// A T5's pipeline chunk under Megatron's encoder/decoder stage split: encoder stages pass the
/// encoder's hidden states on, its last stage the encoder output (`[b * te, h]`); a decoder
/// stage sends its hidden states and the encoder output together, `[b * td + b * te, h]`
/// (Megatron sends the two as two tensors; one message of both rows keeps the executor's
/// one-tensor exchange), so every decoder stage reads the encoder output for its
/// cross-attention, and in backward it sends the sum of the later stages' gradients of it.
impl crate::models::ModelChunk for T5Model {
    type Batch<'b> = T5Batch<'b>;
    type State = T5State;

    fn pre_process(&self) -> bool {
        self.part.encoder_start()
    }
    fn post_process(&self) -> bool {
        self.part.decoder_end(&self.config.stacks)
    }
    fn input_shape(&self, batch: &T5Batch<'_>, tp: &Tp) -> [usize; 2] {
        let h = self.config.transformer.hidden_size;
        let (enc, dec) = (rows(tp, batch.b * batch.te), rows(tp, batch.b * batch.td));
        if self.part.has_encoder() || self.part.decoder_start() {
            [enc, h]
        } else {
            [dec + enc, h]
        }
    }
    fn output_shape(&self, batch: &T5Batch<'_>, tp: &Tp) -> [usize; 2] {
        let h = self.config.transformer.hidden_size;
        let (enc, dec) = (rows(tp, batch.b * batch.te), rows(tp, batch.b * batch.td));
        if self.part.has_decoder() {
            [dec + enc, h]
        } else {
            [enc, h]
        }
    }

    fn forward_step(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        input: Option<Tensor>,
        batch: &T5Batch<'_>,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<(Option<Tensor>, T5State), CommError> {
        let (y, stacks) = self.run_stacks(params, tp, input, batch, ctx)?;
        if !self.post_process() {
            let state = T5State {
                stacks,
                dlast: None,
                loss_and_tokens: None,
            };
            return Ok((Some(y), state));
        }
        Ok((
            None,
            self.loss(params, grads, tp, y, stacks, batch, grad_scale)?,
        ))
    }

    fn backward_step(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        state: T5State,
        dy: Option<Tensor>,
        batch: &T5Batch<'_>,
        ctx: &StepContext,
        on_ready: &mut dyn FnMut(usize),
    ) -> Result<Option<Tensor>, CommError> {
        let dy = match dy {
            Some(d) => d,
            None => state
                .dlast
                .expect("the last stage's forward was given gradients"),
        };
        let dx = self.backward_stacks(params, grads, tp, state.stacks, dy, batch, ctx)?;
        on_ready(0);
        Ok(dx)
    }

    fn shared_embedding(&self) -> Option<crate::params::ParamId> {
        None
    }

    fn pipeline_tied(&self) -> Vec<crate::models::TiedParam> {
        if self.pre_process() && self.post_process() {
            return Vec::new();
        }
        let cfg = &self.config.transformer;
        let t = self.tp_size;
        let bias = self.config.stacks.relative_buckets * cfg.num_attention_heads / t;
        vec![
            crate::models::TiedParam {
                numel: cfg.padded_vocab_size / t * cfg.hidden_size,
                id: self.embedding.as_ref().map(|e| e.weight),
            },
            crate::models::TiedParam {
                numel: bias,
                id: self.encoder_bias.as_ref().map(|b| b.table),
            },
            crate::models::TiedParam {
                numel: bias,
                id: self.decoder_bias.as_ref().map(|b| b.table),
            },
        ]
    }
}

impl crate::models::ModelFamily for T5Config {
    type Chunk = T5Model;

    fn num_layers(&self) -> usize {
        self.stacks.encoder_layers + self.stacks.decoder_layers
    }

    /// `layers` count the encoder's layers first, then the decoder's.
    fn build_chunk(
        &self,
        params: &mut Params,
        inits: &mut Vec<Init>,
        layers: std::ops::Range<usize>,
        _pre_process: bool,
        _post_process: bool,
    ) -> T5Model {
        T5Model::build_part(
            self.clone(),
            T5Part::of_layers(&self.stacks, layers),
            params,
            inits,
        )
    }
}

impl T5Model {
    /// The whole model on one stage.
    pub fn build(config: T5Config, params: &mut Params, inits: &mut Vec<Init>) -> T5Model {
        let st = config.stacks;
        let part = T5Part {
            encoder: 0..st.encoder_layers,
            decoder: 0..st.decoder_layers,
        };
        Self::build_part(config, part, params, inits)
    }

    /// The layers of `part` and what goes with them. Copies of parameters another stage owns
    /// (the word embedding after the first stage, a relative bias after its stack's first
    /// stage) are registered under the owner's name and marked shared: saved by the owner,
    /// counted once in the gradient norm, and initialized to the same values (initialization
    /// is a function of the name).
    pub fn build_part(
        config: T5Config,
        part: T5Part,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> T5Model {
        let cfg = &config.transformer;
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let std = cfg.init_method_std;
        let st = config.stacks;
        let share = |params: &mut Params, id: crate::params::ParamId, copy: bool| {
            params.metas[id.0].shared = copy;
        };
        let untied = cfg.untie_embeddings_and_output_weights;
        let logits_from_embedding = part.decoder_end(&st) && !untied;
        let embedding = (part.encoder_start() || part.decoder_start() || logits_from_embedding)
            .then(|| {
                let e = VocabParallelEmbedding::new(
                    params,
                    inits,
                    "embedding.word_embeddings.weight",
                    cfg.padded_vocab_size,
                    h,
                    std,
                );
                share(params, e.weight, !part.encoder_start());
                e
            });
        let rel = (st.relative_buckets, st.relative_max_distance);
        let norm = |name: &str, params: &mut Params, inits: &mut Vec<Init>| {
            Norm::new(
                cfg.normalization,
                name,
                h,
                cfg.layernorm_epsilon,
                params,
                inits,
            )
        };
        let bias = |name: &str,
                    range: &std::ops::Range<usize>,
                    bidirectional: bool,
                    params: &mut Params,
                    inits: &mut Vec<Init>| {
            (!range.is_empty()).then(|| {
                let b =
                    RelativePositionBias::new(name, rel, bidirectional, heads, std, params, inits);
                share(params, b.table, range.start != 0);
                b
            })
        };
        let layer = |stack, l: usize, stream: usize, params: &mut Params, inits: &mut _| {
            T5Layer::new(cfg, stack, l, stream, st.softmax_scale, params, inits)
        };
        let encoder_bias = bias(
            "encoder.relative_pos_emb",
            &part.encoder,
            true,
            params,
            inits,
        );
        let encoder = part
            .encoder
            .clone()
            .map(|l| layer(T5Stack::Encoder, l, l, params, inits))
            .collect();
        let encoder_norm = part
            .encoder_end(&st)
            .then(|| norm("encoder.final_layernorm", params, inits));
        let decoder_bias = bias(
            "decoder.relative_pos_emb",
            &part.decoder,
            false,
            params,
            inits,
        );
        let decoder = part
            .decoder
            .clone()
            .map(|l| layer(T5Stack::Decoder, l, st.encoder_layers + l, params, inits))
            .collect();
        let decoder_norm = part
            .decoder_end(&st)
            .then(|| norm("decoder.final_layernorm", params, inits));
        let output_layer = (part.decoder_end(&st) && untied).then(|| {
            params.add_sharded(
                inits,
                "output_layer.weight".into(),
                &[cfg.padded_vocab_size, h],
                true,
                Init::Normal(std),
                crate::params::Sharding::Split(0),
            )
        });
        let (tp_rank, tp_size) = (params.tp.0, params.tp.1.max(1));
        T5Model {
            config,
            part,
            embedding,
            encoder_bias,
            encoder,
            encoder_norm,
            decoder_bias,
            decoder,
            decoder_norm,
            output_layer,
            tp_rank,
            tp_size,
        }
    }

    /// The whole model on one tensor-parallel rank of `tp_size`, initialized from `seed`.
    pub fn new_tp(
        config: T5Config,
        seed: u64,
        tp_rank: usize,
        tp_size: usize,
    ) -> (T5Model, Params) {
        let mut params = Params::for_tp_rank(tp_rank, tp_size);
        let mut inits = Vec::new();
        let m = Self::build(config, &mut params, &mut inits);
        params.initialize(seed, &inits);
        (m, params)
    }

    fn p(&self, ctx: &StepContext) -> f32 {
        ctx.p(self.config.transformer.hidden_dropout)
    }

    /// Dropout of this rank's rows `at` of a stack's stream.
    fn dropout(&self, x: Tensor, ctx: &StepContext, at: &DropoutRows, site: u64) -> Tensor {
        let p = self.p(ctx);
        if p == 0.0 {
            return x;
        }
        let mut d = Tensor::for_overwrite(x.shape());
        let key = at.key(ctx, STREAM_EMBEDDING, site);
        at.each(|r, k| {
            dropout_forward(&mut d.data_mut()[r.clone()], &x.data()[r], p, key.offset(k))
        });
        d
    }

    fn dropout_grad(&self, dy: Tensor, ctx: &StepContext, at: &DropoutRows, site: u64) -> Tensor {
        let p = self.p(ctx);
        if p == 0.0 {
            return dy;
        }
        let mut d = Tensor::for_overwrite(dy.shape());
        let key = at.key(ctx, STREAM_EMBEDDING, site);
        at.each(|r, k| {
            dropout_backward(
                &mut d.data_mut()[r.clone()],
                &dy.data()[r],
                p,
                key.offset(k),
            )
        });
        d
    }

    /// Where this rank's rows of the encoder's and of the decoder's stream sit.
    fn streams(&self, tp: &Tp, batch: &T5Batch) -> (DropoutRows, DropoutRows) {
        let h = self.config.transformer.hidden_size;
        let (b, te, td) = (batch.b, batch.te, batch.td);
        (
            DropoutRows::of_block(tp, b, te, rows(tp, b * te), h),
            DropoutRows::of_block(tp, b, td, rows(tp, b * td), h),
        )
    }

    /// The decoder output's rescaling before the logits: `hidden^-1/2`, or none.
    pub(super) fn output_scale(&self) -> f32 {
        if self.config.stacks.scale_decoder_outputs {
            (self.config.transformer.hidden_size as f32).powf(-0.5)
        } else {
            1.0
        }
    }

    /// The output layer's weight (this rank's vocabulary rows) and their first id.
    pub(super) fn output_weight(&self) -> (crate::params::ParamId, usize, usize) {
        let cfg = &self.config.transformer;
        let per = cfg.padded_vocab_size / self.tp_size;
        match (self.output_layer, &self.embedding) {
            (Some(w), _) => (w, per, self.tp_rank * per),
            (None, Some(e)) => (e.weight, e.vocab_per_partition, e.vocab_start),
            (None, None) => panic!("the last stage computes the logits"),
        }
    }

    pub(super) fn word_embedding(&self) -> &VocabParallelEmbedding {
        self.embedding
            .as_ref()
            .expect("this stage embeds tokens or computes logits")
    }

    /// This rank's vocabulary slice of the logits, `[b * td, vocab / tp]`, without dropout
    /// (evaluation, conversion checks, generation). The whole model on one stage.
    pub fn logits(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &T5Batch,
    ) -> Result<Tensor, CommError> {
        let ctx = StepContext::eval();
        let (last, _) = self.run_stacks(params, tp, None, batch, &ctx)?;
        let last = if tp.sequence_parallel {
            gather_from_sequence_parallel_region_forward(tp, &last)?
        } else {
            last
        };
        Ok(self.output_logits(params, &last))
    }

    /// This rank's vocabulary slice of the logits of the decoder's final output `last`.
    pub(super) fn output_logits(&self, params: &Params, last: &Tensor) -> Tensor {
        let (w, v, _) = self.output_weight();
        let (n, h) = (last.shape()[0], self.config.transformer.hidden_size);
        let mut logits = Tensor::for_overwrite(&[n, v]);
        megatron_tensor::cpu::matmul_forward(
            logits.data_mut(),
            last.data(),
            params.operand(w).operand(),
            None,
            n,
            h,
            v,
        );
        logits
    }

    /// This stage's stacks on one micro-batch: what it sends on (on the last stage, the
    /// decoder's final output: normed, dropped, rescaled, `[b * td, hidden]`) and what backward
    /// needs. `input` is the previous stage's message (none on the first stage).
    fn run_stacks(
        &self,
        params: &Params,
        tp: &mut Tp,
        input: Option<Tensor>,
        batch: &T5Batch,
        ctx: &StepContext,
    ) -> Result<(Tensor, SavedStacks), CommError> {
        let (b, te, td) = (batch.b, batch.te, batch.td);
        let st = &self.config.stacks;
        let (enc_at, dec_at) = self.streams(tp, batch);
        let mut saved = SavedStacks::default();
        let mut input = input;
        let mut memory = None;
        if let Some(bias) = &self.encoder_bias {
            let mut x = match input.take() {
                Some(x) => x,
                None => {
                    let x = self
                        .word_embedding()
                        .forward(params, tp, batch.enc_tokens)?;
                    self.dropout(x, ctx, &enc_at, SITE_ENCODER_EMBEDDING)
                }
            };
            saved.enc_bias = bias.forward(params, te, te);
            let enc_in = T5LayerInputs {
                shape: T5AttentionShape { b, tq: te, tk: te },
                bias: &saved.enc_bias,
                self_lens: batch.enc_lens,
                memory: None,
            };
            for l in &self.encoder {
                let (y, s) = l.forward(params, tp, x, &enc_in, ctx)?;
                saved.encoder.push(s);
                x = y;
            }
            let Some(norm) = &self.encoder_norm else {
                return Ok((x, saved));
            };
            let (normed, ln) = norm.forward(params, &x);
            let m = self.dropout(normed, ctx, &enc_at, SITE_ENCODER_OUTPUT);
            saved.encoder_out = Some((x, ln));
            if !self.part.has_decoder() {
                return Ok((m, saved));
            }
            memory = Some(m);
        }
        let bias = self
            .decoder_bias
            .as_ref()
            .expect("a T5 stage holds encoder or decoder layers");
        // The decoder's hidden states (unless this stage embeds them) and the encoder output.
        let (hidden, memory) = match (memory, input) {
            (Some(m), _) => (None, m),
            (None, Some(x)) if self.part.decoder_start() => (None, x),
            (None, Some(x)) => {
                let (y, m) = x.split_rows(rows(tp, b * td));
                (Some(y), m)
            }
            (None, None) => unreachable!("a decoder stage after the first receives its input"),
        };
        let mut y = match hidden {
            Some(y) => y,
            None => {
                let y = self
                    .word_embedding()
                    .forward(params, tp, batch.dec_tokens)?;
                self.dropout(y, ctx, &dec_at, SITE_DECODER_EMBEDDING)
            }
        };
        saved.dec_bias = bias.forward(params, td, td);
        let dec_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: td, tk: td },
            bias: &saved.dec_bias,
            self_lens: batch.dec_lens,
            memory: Some((&memory, batch.enc_lens, te)),
        };
        for l in &self.decoder {
            let (z, s) = l.forward(params, tp, y, &dec_in, ctx)?;
            saved.decoder.push(s);
            y = z;
        }
        let out = match &self.decoder_norm {
            Some(norm) if self.part.decoder_end(st) => {
                let (normed, ln) = norm.forward(params, &y);
                let mut last = self.dropout(normed, ctx, &dec_at, SITE_DECODER_OUTPUT);
                scale_inplace(last.data_mut(), self.output_scale());
                saved.decoder_out = Some((y, ln));
                last
            }
            _ => Tensor::cat_rows(&y, &memory),
        };
        saved.memory = Some(memory);
        Ok((out, saved))
    }

    /// Backward of [`T5Model::run_stacks`]: `dy` is the gradient of what it returned. Returns
    /// the gradient of its input (none on the first stage).
    #[allow(clippy::too_many_arguments)]
    fn backward_stacks(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: SavedStacks,
        dy: Tensor,
        batch: &T5Batch,
        ctx: &StepContext,
    ) -> Result<Option<Tensor>, CommError> {
        let (b, te, td) = (batch.b, batch.te, batch.td);
        let (enc_at, dec_at) = self.streams(tp, batch);
        let mut dy = Some(dy);
        let mut dmemory = None;
        if let Some(bias) = &self.decoder_bias {
            let memory = saved
                .memory
                .as_ref()
                .expect("a decoder stage saves the memory");
            let d = dy.take().expect("one output gradient");
            let (mut dh, mut dm) = match (&self.decoder_norm, &saved.decoder_out) {
                (Some(norm), Some((y, ln))) => {
                    let mut d = d;
                    scale_inplace(d.data_mut(), self.output_scale());
                    let dnormed = self.dropout_grad(d, ctx, &dec_at, SITE_DECODER_OUTPUT);
                    let dh = norm.backward(params, grads, ln, y, &dnormed);
                    (dh, Tensor::zeros(memory.shape()))
                }
                _ => d.split_rows(rows(tp, b * td)),
            };
            let dec_in = T5LayerInputs {
                shape: T5AttentionShape { b, tq: td, tk: td },
                bias: &saved.dec_bias,
                self_lens: batch.dec_lens,
                memory: Some((memory, batch.enc_lens, te)),
            };
            let mut dbias = vec![0.0f32; saved.dec_bias.len()];
            for (l, s) in self.decoder.iter().zip(saved.decoder).rev() {
                let g = l.backward(params, grads, tp, s, dh, &dec_in, ctx)?;
                dh = g.dx;
                add_inplace(
                    &mut dm,
                    &g.dmemory.expect("a decoder layer reads the memory"),
                );
                megatron_tensor::cpu::reduce::add_inplace(&mut dbias, &g.dbias);
            }
            bias.backward(grads, &dbias, td, td);
            if !self.part.decoder_start() {
                return Ok(Some(Tensor::cat_rows(&dh, &dm)));
            }
            let dh = self.dropout_grad(dh, ctx, &dec_at, SITE_DECODER_EMBEDDING);
            self.word_embedding()
                .backward(grads, tp, batch.dec_tokens, dh)?;
            if !self.part.has_encoder() {
                return Ok(Some(dm));
            }
            dmemory = Some(dm);
        }
        let bias = self
            .encoder_bias
            .as_ref()
            .expect("a T5 stage holds encoder or decoder layers");
        let mut dx = match (&self.encoder_norm, saved.encoder_out) {
            (Some(norm), Some((x, ln))) => {
                let dm = dmemory.or(dy).expect("the encoder output's gradient");
                let dnormed = self.dropout_grad(dm, ctx, &enc_at, SITE_ENCODER_OUTPUT);
                norm.backward(params, grads, &ln, &x, &dnormed)
            }
            _ => dy.expect("the encoder's hidden states' gradient"),
        };
        let enc_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: te, tk: te },
            bias: &saved.enc_bias,
            self_lens: batch.enc_lens,
            memory: None,
        };
        let mut dbias = vec![0.0f32; saved.enc_bias.len()];
        for (l, s) in self.encoder.iter().zip(saved.encoder).rev() {
            let g = l.backward(params, grads, tp, s, dx, &enc_in, ctx)?;
            dx = g.dx;
            megatron_tensor::cpu::reduce::add_inplace(&mut dbias, &g.dbias);
        }
        bias.backward(grads, &dbias, te, te);
        if !self.part.encoder_start() {
            return Ok(Some(dx));
        }
        let dx = self.dropout_grad(dx, ctx, &enc_at, SITE_ENCODER_EMBEDDING);
        self.word_embedding()
            .backward(grads, tp, batch.enc_tokens, dx)?;
        Ok(None)
    }

    /// Forward of the whole model (one stage) and, with `grads`, what backward needs. The
    /// loss is the mean over the counted labels, its gradient scaled by `grad_scale`.
    /// Collective over `tp`.
    pub fn forward(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        batch: &T5Batch,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<T5State, CommError> {
        let (last, stacks) = self.run_stacks(params, tp, None, batch, ctx)?;
        self.loss(params, grads, tp, last, stacks, batch, grad_scale)
    }

    /// The tied logits and the loss of the decoder's final output `last` (the output layer and
    /// loss gradients are computed here, as GPT's fused output layer does).
    #[allow(clippy::too_many_arguments)]
    fn loss(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        last: Tensor,
        stacks: SavedStacks,
        batch: &T5Batch,
        grad_scale: f32,
    ) -> Result<T5State, CommError> {
        let n = batch.b * batch.td;
        let h = self.config.transformer.hidden_size;
        let total = batch.loss_mask.iter().sum::<f32>().max(1.0);
        let (w, v, vocab_start) = self.output_weight();
        let dims = ClassifierDims {
            n,
            c: h,
            v,
            chunk_rows: crate::models::gpt::classifier_tile_rows(v),
        };
        // The output layer reads every token row (gathered under sequence parallelism).
        let last = if tp.sequence_parallel {
            gather_from_sequence_parallel_region_forward(tp, &last)?
        } else {
            last
        };
        let mut losses = vec![0.0f32; n];
        let mut dlast = None;
        match grads {
            Some(g) => {
                let dloss: Vec<f32> = batch
                    .loss_mask
                    .iter()
                    .map(|m| m / total * grad_scale)
                    .collect();
                let mut dx = Tensor::for_overwrite(&[n, h]);
                vocab_parallel_cross_entropy(
                    tp,
                    &mut losses,
                    Some((dx.data_mut(), g.get_mut(w))),
                    last.data(),
                    params.operand(w).operand(),
                    None,
                    batch.labels,
                    &dloss,
                    dims,
                    vocab_start,
                )?;
                dlast = Some(if tp.sequence_parallel {
                    gather_from_sequence_parallel_region_backward(tp, &dx)?
                } else {
                    copy_to_tensor_model_parallel_region_backward(tp, dx)?
                });
            }
            None => vocab_parallel_cross_entropy(
                tp,
                &mut losses,
                None,
                last.data(),
                params.operand(w).operand(),
                None,
                batch.labels,
                &[],
                dims,
                vocab_start,
            )?,
        }
        let loss = losses
            .iter()
            .zip(batch.loss_mask)
            .map(|(l, m)| (*l as f64) * (*m as f64))
            .sum::<f64>()
            / total as f64;
        Ok(T5State {
            stacks,
            dlast,
            loss_and_tokens: Some((loss as f32, batch.loss_mask.iter().sum())),
        })
    }

    /// Backward of [`T5Model::forward`] (which was given gradients).
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        state: T5State,
        batch: &T5Batch,
        ctx: &StepContext,
    ) -> Result<(), CommError> {
        let dlast = state.dlast.expect("the forward was given gradients");
        self.backward_stacks(params, grads, tp, state.stacks, dlast, batch, ctx)?;
        Ok(())
    }
}
