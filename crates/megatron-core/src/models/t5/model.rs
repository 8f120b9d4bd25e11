//! `T5Model` on one pipeline stage (Hugging Face's `T5ForConditionalGeneration`,
//! megatron-core's `T5Model` with relative positions): one word embedding shared by the
//! encoder, the decoder and the tied output layer; each stack with its relative position bias
//! (bidirectional buckets in the encoder, causal ones in the decoder), its layers and a final
//! norm followed by dropout; the decoder's output scaled by `hidden^-1/2` before the tied
//! logits (T5's rescaling), and vocabulary-parallel cross-entropy over the counted labels.
//! The pipeline split of encoder and decoder stages comes with `--model t5`.

use super::layer::{T5Layer, T5LayerInputs, T5LayerSaved, T5Stack};
use super::relative_bias::RelativePositionBias;
use super::T5AttentionShape;
use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::mappings::copy_to_tensor_model_parallel_region_backward;
use crate::tensor_parallel::{vocab_parallel_cross_entropy, Tp, VocabParallelEmbedding};
use crate::transformer::config::TransformerConfig;
use crate::transformer::layer::{add_inplace, LayerNormSaved, Norm};
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
    pub embedding: VocabParallelEmbedding,
    pub encoder_bias: RelativePositionBias,
    pub encoder: Vec<T5Layer>,
    pub encoder_norm: Norm,
    pub decoder_bias: RelativePositionBias,
    pub decoder: Vec<T5Layer>,
    pub decoder_norm: Norm,
}

/// Dropout streams of the embeddings and the stacks' outputs (layers use their numbers).
const STREAM_EMBEDDING: usize = 1 << 20;
const SITE_ENCODER_EMBEDDING: u64 = 1;
const SITE_DECODER_EMBEDDING: u64 = 2;
const SITE_ENCODER_OUTPUT: u64 = 3;
const SITE_DECODER_OUTPUT: u64 = 4;

/// What the stacks keep for backward.
struct SavedStacks {
    encoder: Vec<T5LayerSaved>,
    encoder_out: (Tensor, LayerNormSaved),
    memory: Tensor,
    decoder: Vec<T5LayerSaved>,
    decoder_out: (Tensor, LayerNormSaved),
    enc_bias: Vec<f32>,
    dec_bias: Vec<f32>,
}

/// What backward needs of a forward.
pub struct T5State {
    stacks: SavedStacks,
    /// Gradient of the decoder's final (scaled, dropped) output, known in the forward.
    dlast: Tensor,
    pub loss: f32,
    /// Counted labels.
    pub tokens: f32,
}

impl SavedStacks {
    fn size_in_bytes(&self) -> usize {
        self.encoder
            .iter()
            .map(|s| s.size_in_bytes())
            .sum::<usize>()
            + self
                .decoder
                .iter()
                .map(|s| s.size_in_bytes())
                .sum::<usize>()
            + self.encoder_out.0.size_in_bytes()
            + self.memory.size_in_bytes()
            + self.decoder_out.0.size_in_bytes()
            + 4 * (self.enc_bias.len() + self.dec_bias.len())
    }
}

impl crate::models::ChunkState for T5State {
    fn activation_bytes(&self) -> usize {
        self.stacks.size_in_bytes()
    }
    fn loss(&self) -> Option<(f32, f32)> {
        Some((self.loss, self.tokens))
    }
}

/// One pipeline stage holds the whole T5 for now (the encoder/decoder stage split comes with
/// the pipeline schedules' second tensor): `--model t5` refuses pipeline parallelism.
impl crate::models::ModelChunk for T5Model {
    type Batch<'b> = T5Batch<'b>;
    type State = T5State;

    fn pre_process(&self) -> bool {
        true
    }
    fn post_process(&self) -> bool {
        true
    }
    fn input_shape(&self, batch: &T5Batch<'_>, _tp: &Tp) -> [usize; 2] {
        [batch.b * batch.td, self.config.transformer.hidden_size]
    }
    fn output_shape(&self, batch: &T5Batch<'_>, tp: &Tp) -> [usize; 2] {
        self.input_shape(batch, tp)
    }

    fn forward_step(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        _input: Option<Tensor>,
        batch: &T5Batch<'_>,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<(Option<Tensor>, T5State), CommError> {
        Ok((
            None,
            self.forward(params, grads, tp, batch, grad_scale, ctx)?,
        ))
    }

    fn backward_step(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        state: T5State,
        _dy: Option<Tensor>,
        batch: &T5Batch<'_>,
        ctx: &StepContext,
        on_ready: &mut dyn FnMut(usize),
    ) -> Result<Option<Tensor>, CommError> {
        self.backward(params, grads, tp, state, batch, ctx)?;
        on_ready(0);
        Ok(None)
    }

    fn shared_embedding(&self) -> Option<crate::params::ParamId> {
        None
    }
}

impl crate::models::ModelFamily for T5Config {
    type Chunk = T5Model;

    fn num_layers(&self) -> usize {
        self.stacks.encoder_layers + self.stacks.decoder_layers
    }

    fn build_chunk(
        &self,
        params: &mut Params,
        inits: &mut Vec<Init>,
        _layers: std::ops::Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> T5Model {
        // The stage's layer range counts `--num-layers`; a T5 stage holds both stacks whole.
        assert!(
            pre_process && post_process,
            "a T5 is built on one pipeline stage"
        );
        T5Model::build(self.clone(), params, inits)
    }
}

impl T5Model {
    pub fn build(config: T5Config, params: &mut Params, inits: &mut Vec<Init>) -> T5Model {
        let cfg = &config.transformer;
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let std = cfg.init_method_std;
        let embedding = VocabParallelEmbedding::new(
            params,
            inits,
            "embedding.word_embeddings.weight",
            cfg.padded_vocab_size,
            h,
            std,
        );
        let st = config.stacks;
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
        let encoder_bias = RelativePositionBias::new(
            "encoder.relative_pos_emb",
            rel,
            true,
            heads,
            std,
            params,
            inits,
        );
        let encoder = (0..st.encoder_layers)
            .map(|l| {
                T5Layer::new(
                    cfg,
                    T5Stack::Encoder,
                    l,
                    l,
                    config.stacks.softmax_scale,
                    params,
                    inits,
                )
            })
            .collect();
        let encoder_norm = norm("encoder.final_layernorm", params, inits);
        let decoder_bias = RelativePositionBias::new(
            "decoder.relative_pos_emb",
            rel,
            false,
            heads,
            std,
            params,
            inits,
        );
        let decoder = (0..st.decoder_layers)
            .map(|l| {
                let stream = st.encoder_layers + l;
                T5Layer::new(
                    cfg,
                    T5Stack::Decoder,
                    l,
                    stream,
                    config.stacks.softmax_scale,
                    params,
                    inits,
                )
            })
            .collect();
        let decoder_norm = norm("decoder.final_layernorm", params, inits);
        T5Model {
            config,
            embedding,
            encoder_bias,
            encoder,
            encoder_norm,
            decoder_bias,
            decoder,
            decoder_norm,
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

    fn dropout(&self, x: Tensor, ctx: &StepContext, site: u64) -> Tensor {
        let p = self.p(ctx);
        if p == 0.0 {
            return x;
        }
        let mut d = Tensor::for_overwrite(x.shape());
        dropout_forward(d.data_mut(), x.data(), p, ctx.site(STREAM_EMBEDDING, site));
        d
    }

    fn dropout_grad(&self, dy: Tensor, ctx: &StepContext, site: u64) -> Tensor {
        let p = self.p(ctx);
        if p == 0.0 {
            return dy;
        }
        let mut d = Tensor::for_overwrite(dy.shape());
        dropout_backward(d.data_mut(), dy.data(), p, ctx.site(STREAM_EMBEDDING, site));
        d
    }

    /// The decoder output's rescaling before the tied logits: `hidden^-1/2`.
    fn output_scale(&self) -> f32 {
        (self.config.transformer.hidden_size as f32).powf(-0.5)
    }

    /// This rank's vocabulary slice of the logits, `[b * td, vocab / tp]`, without dropout
    /// (evaluation, conversion checks, generation).
    pub fn logits(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &T5Batch,
    ) -> Result<Tensor, CommError> {
        let ctx = StepContext::eval();
        let (last, _) = self.decoder_output(params, tp, batch, &ctx)?;
        let (n, h, v) = (
            last.shape()[0],
            self.config.transformer.hidden_size,
            self.embedding.vocab_per_partition,
        );
        let mut logits = Tensor::for_overwrite(&[n, v]);
        megatron_tensor::cpu::matmul_forward(
            logits.data_mut(),
            last.data(),
            &params.get(self.embedding.weight),
            None,
            n,
            h,
            v,
        );
        Ok(logits)
    }

    /// Both stacks: the decoder's final output (normed, dropped, rescaled) `[b * td, hidden]`
    /// and what backward needs of them.
    fn decoder_output(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &T5Batch,
        ctx: &StepContext,
    ) -> Result<(Tensor, SavedStacks), CommError> {
        let (b, te, td) = (batch.b, batch.te, batch.td);
        // Encoder.
        let x = self.embedding.forward(params, tp, batch.enc_tokens)?;
        let mut x = self.dropout(x, ctx, SITE_ENCODER_EMBEDDING);
        let enc_bias = self.encoder_bias.forward(params, te, te);
        let enc_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: te, tk: te },
            bias: &enc_bias,
            self_lens: batch.enc_lens,
            memory: None,
        };
        let mut encoder = Vec::with_capacity(self.encoder.len());
        for l in &self.encoder {
            let (y, s) = l.forward(params, tp, x, &enc_in, ctx)?;
            encoder.push(s);
            x = y;
        }
        let (normed, ln) = self.encoder_norm.forward(params, &x);
        let memory = self.dropout(normed, ctx, SITE_ENCODER_OUTPUT);
        let encoder_out = (x, ln);
        // Decoder.
        let y = self.embedding.forward(params, tp, batch.dec_tokens)?;
        let mut y = self.dropout(y, ctx, SITE_DECODER_EMBEDDING);
        let dec_bias = self.decoder_bias.forward(params, td, td);
        let dec_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: td, tk: td },
            bias: &dec_bias,
            self_lens: batch.dec_lens,
            memory: Some((&memory, batch.enc_lens, te)),
        };
        let mut decoder = Vec::with_capacity(self.decoder.len());
        for l in &self.decoder {
            let (z, s) = l.forward(params, tp, y, &dec_in, ctx)?;
            decoder.push(s);
            y = z;
        }
        let (normed, ln) = self.decoder_norm.forward(params, &y);
        let mut last = self.dropout(normed, ctx, SITE_DECODER_OUTPUT);
        scale_inplace(last.data_mut(), self.output_scale());
        let decoder_out = (y, ln);
        Ok((
            last,
            SavedStacks {
                encoder,
                encoder_out,
                memory,
                decoder,
                decoder_out,
                enc_bias,
                dec_bias,
            },
        ))
    }

    /// Greedy decoding (Hugging Face's `generate` without sampling or beams): each sequence's
    /// decoder starts from `start` and appends the most likely of the first `vocab` ids (the
    /// padded rows excluded) until `eos`, then `pad`, for `max_new` tokens. The decoder is run
    /// again over the whole prefix at every step (no cache): T5 generation here is for checks
    /// and short outputs. Returns `[b][1 + max_new]` ids. Whole vocabulary on one rank.
    #[allow(clippy::too_many_arguments)]
    pub fn greedy(
        &self,
        params: &Params,
        tp: &mut Tp,
        enc_tokens: &[u32],
        enc_lens: &[usize],
        (start, eos, pad): (u32, u32, u32),
        vocab: usize,
        max_new: usize,
    ) -> Result<Vec<Vec<u32>>, CommError> {
        let b = enc_lens.len();
        let te = enc_tokens.len() / b.max(1);
        let mut out: Vec<Vec<u32>> = vec![vec![start]; b];
        let mut done = vec![false; b];
        for _ in 0..max_new {
            let td = out[0].len();
            let dec: Vec<u32> = out.iter().flatten().copied().collect();
            let labels = vec![megatron_tensor::cpu::IGNORE_INDEX; b * td];
            let mask = vec![0.0f32; b * td];
            let batch = T5Batch {
                enc_tokens,
                dec_tokens: &dec,
                labels: &labels,
                loss_mask: &mask,
                enc_lens,
                dec_lens: &vec![td; b],
                b,
                te,
                td,
            };
            let logits = self.logits(params, tp, &batch)?;
            let v = logits.shape()[1];
            for (s, seq) in out.iter_mut().enumerate() {
                if done[s] {
                    seq.push(pad);
                    continue;
                }
                let row =
                    &logits.data()[(s * td + td - 1) * v..(s * td + td - 1) * v + vocab.min(v)];
                let next = megatron_tensor::cpu::reduce::argmax(row) as u32;
                seq.push(next);
                done[s] = next == eos;
            }
        }
        Ok(out)
    }

    /// Forward and, with `grads`, what backward needs (the output layer and loss gradients are
    /// computed here, as GPT's fused output layer does). The loss is the mean over the counted
    /// labels, its gradient scaled by `grad_scale`. Collective over `tp`.
    pub fn forward(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        batch: &T5Batch,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<T5State, CommError> {
        let (b, td) = (batch.b, batch.td);
        let h = self.config.transformer.hidden_size;
        let (last, stacks) = self.decoder_output(params, tp, batch, ctx)?;
        // Tied logits and the loss.
        let n = b * td;
        let total = batch.loss_mask.iter().sum::<f32>().max(1.0);
        let v = self.embedding.vocab_per_partition;
        let dims = ClassifierDims {
            n,
            c: h,
            v,
            chunk_rows: crate::models::gpt::classifier_tile_rows(v),
        };
        let mut losses = vec![0.0f32; n];
        let w = self.embedding.weight;
        let mut dlast = Tensor::for_overwrite(&[0]);
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
                    &params.get(w),
                    None,
                    batch.labels,
                    &dloss,
                    dims,
                    self.embedding.vocab_start,
                )?;
                dlast = copy_to_tensor_model_parallel_region_backward(tp, dx)?;
            }
            None => vocab_parallel_cross_entropy(
                tp,
                &mut losses,
                None,
                last.data(),
                &params.get(w),
                None,
                batch.labels,
                &[],
                dims,
                self.embedding.vocab_start,
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
            loss: loss as f32,
            tokens: batch.loss_mask.iter().sum(),
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
        let (b, te, td) = (batch.b, batch.te, batch.td);
        let mut dlast = state.dlast;
        scale_inplace(dlast.data_mut(), self.output_scale());
        let dnormed = self.dropout_grad(dlast, ctx, SITE_DECODER_OUTPUT);
        let (y, ln) = &state.stacks.decoder_out;
        let mut dy = self.decoder_norm.backward(params, grads, ln, y, &dnormed);
        let dec_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: td, tk: td },
            bias: &state.stacks.dec_bias,
            self_lens: batch.dec_lens,
            memory: Some((&state.stacks.memory, batch.enc_lens, te)),
        };
        let mut dmemory = Tensor::zeros(state.stacks.memory.shape());
        let mut dbias = vec![0.0f32; state.stacks.dec_bias.len()];
        for (l, s) in self.decoder.iter().zip(state.stacks.decoder).rev() {
            let g = l.backward(params, grads, tp, s, dy, &dec_in, ctx)?;
            dy = g.dx;
            let dm = g.dmemory.expect("a decoder layer reads the encoder output");
            add_inplace(&mut dmemory, &dm);
            megatron_tensor::cpu::reduce::add_inplace(&mut dbias, &g.dbias);
        }
        self.decoder_bias.backward(grads, &dbias, td, td);
        let dy = self.dropout_grad(dy, ctx, SITE_DECODER_EMBEDDING);
        self.embedding.backward(grads, tp, batch.dec_tokens, dy)?;
        // Encoder.
        let dnormed = self.dropout_grad(dmemory, ctx, SITE_ENCODER_OUTPUT);
        let (x, ln) = &state.stacks.encoder_out;
        let mut dx = self.encoder_norm.backward(params, grads, ln, x, &dnormed);
        let enc_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: te, tk: te },
            bias: &state.stacks.enc_bias,
            self_lens: batch.enc_lens,
            memory: None,
        };
        let mut dbias = vec![0.0f32; state.stacks.enc_bias.len()];
        for (l, s) in self.encoder.iter().zip(state.stacks.encoder).rev() {
            let g = l.backward(params, grads, tp, s, dx, &enc_in, ctx)?;
            dx = g.dx;
            megatron_tensor::cpu::reduce::add_inplace(&mut dbias, &g.dbias);
        }
        self.encoder_bias.backward(grads, &dbias, te, te);
        let dx = self.dropout_grad(dx, ctx, SITE_ENCODER_EMBEDDING);
        self.embedding.backward(grads, tp, batch.enc_tokens, dx)?;
        Ok(())
    }
}
