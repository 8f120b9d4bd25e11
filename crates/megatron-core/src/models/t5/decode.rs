//! Generation with a T5 (Hugging Face's `generate` for `T5ForConditionalGeneration`): the
//! encoder runs once; each decoder layer keeps its self-attention's keys and values and the
//! cross-attention's keys and values of the encoder output, so a step costs one position per
//! layer instead of the whole prefix. The whole model on one stage, without dropout.

use super::layer::T5LayerCache;
use super::model::T5Model;
use super::T5AttentionShape;
use super::T5LayerInputs;
use crate::params::Params;
use crate::tensor_parallel::Tp;
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::reduce::scale_inplace;
use megatron_tensor::Tensor;

/// The decoder's state between steps.
pub struct T5DecodeCache {
    layers: Vec<T5LayerCache>,
    /// The decoder's relative bias for `max_t` positions, `[heads, max_t, max_t]`.
    bias: Vec<f32>,
    max_t: usize,
    enc_lens: Vec<usize>,
    /// Positions decoded so far.
    pos: usize,
}

impl T5Model {
    /// Runs the encoder on `enc_tokens` (`[b, te]`, `enc_lens` real) and prepares the decoder
    /// for up to `max_t` positions.
    pub fn start_decoding(
        &self,
        params: &Params,
        tp: &mut Tp,
        enc_tokens: &[u32],
        enc_lens: &[usize],
        max_t: usize,
    ) -> Result<T5DecodeCache, CommError> {
        let ctx = StepContext::eval();
        let b = enc_lens.len();
        let te = enc_tokens.len() / b.max(1);
        let encoder_bias = self.encoder_bias.as_ref().expect("the whole model");
        let mut x = self.word_embedding().forward(params, tp, enc_tokens)?;
        let bias = encoder_bias.forward(params, te, te);
        let enc_in = T5LayerInputs {
            shape: T5AttentionShape { b, tq: te, tk: te },
            bias: &bias,
            self_lens: enc_lens,
            memory: None,
        };
        for l in &self.encoder {
            x = l.forward(params, tp, x, &enc_in, &ctx)?.0;
        }
        let norm = self.encoder_norm.as_ref().expect("the whole model");
        let (memory, _) = norm.forward(params, &x);
        let layers = self
            .decoder
            .iter()
            .map(|l| l.decode_cache(params, tp, &memory, b, te, max_t))
            .collect::<Result<Vec<_>, _>>()?;
        let decoder_bias = self.decoder_bias.as_ref().expect("the whole model");
        Ok(T5DecodeCache {
            layers,
            bias: decoder_bias.forward(params, max_t, max_t),
            max_t,
            enc_lens: enc_lens.to_vec(),
            pos: 0,
        })
    }

    /// One decoder position per sequence: `tokens` (`[b]`) at the next position. Returns this
    /// rank's vocabulary slice of the logits, `[b, vocab / tp]`.
    pub fn decode_step(
        &self,
        params: &Params,
        tp: &mut Tp,
        cache: &mut T5DecodeCache,
        tokens: &[u32],
    ) -> Result<Tensor, CommError> {
        let pos = cache.pos;
        assert!(
            pos < cache.max_t,
            "the decode cache holds {} positions",
            cache.max_t
        );
        // The query's row of the relative bias, `[heads, pos + 1]`.
        let t = cache.max_t;
        let heads = cache.bias.len() / (t * t);
        let mut bias = Vec::with_capacity(heads * (pos + 1));
        for h in 0..heads {
            let row = h * t * t + pos * t;
            bias.extend_from_slice(&cache.bias[row..row + pos + 1]);
        }
        let mut y = self.word_embedding().forward(params, tp, tokens)?;
        for (l, c) in self.decoder.iter().zip(&mut cache.layers) {
            y = l.decode_step(params, tp, y, c, pos, &bias, &cache.enc_lens)?;
        }
        cache.pos += 1;
        let norm = self.decoder_norm.as_ref().expect("the whole model");
        let (mut last, _) = norm.forward(params, &y);
        scale_inplace(last.data_mut(), self.output_scale());
        Ok(self.output_logits(params, &last))
    }

    /// Decoding: each sequence's decoder starts from `start` and appends
    /// `pick(logits row, sequence, step)` (the logits of the first `vocab` ids, the padded
    /// rows excluded) until `eos`, then `pad`, for `max_new` tokens. Returns `[b][1 + max_new]`
    /// ids. Whole vocabulary on one rank.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &self,
        params: &Params,
        tp: &mut Tp,
        enc_tokens: &[u32],
        enc_lens: &[usize],
        (start, eos, pad): (u32, u32, u32),
        vocab: usize,
        max_new: usize,
        pick: &mut dyn FnMut(&[f32], usize, usize) -> u32,
    ) -> Result<Vec<Vec<u32>>, CommError> {
        let b = enc_lens.len();
        let mut cache = self.start_decoding(params, tp, enc_tokens, enc_lens, max_new.max(1))?;
        let mut out: Vec<Vec<u32>> = vec![vec![start]; b];
        let mut done = vec![false; b];
        for step in 0..max_new {
            let last: Vec<u32> = out.iter().map(|s| *s.last().expect("starts")).collect();
            let logits = self.decode_step(params, tp, &mut cache, &last)?;
            let v = logits.shape()[1];
            for (s, seq) in out.iter_mut().enumerate() {
                if done[s] {
                    seq.push(pad);
                    continue;
                }
                let next = pick(&logits.data()[s * v..s * v + vocab.min(v)], s, step);
                seq.push(next);
                done[s] = next == eos;
            }
        }
        Ok(out)
    }

    /// Greedy decoding ([`T5Model::generate`] picking the most likely id).
    #[allow(clippy::too_many_arguments)]
    pub fn greedy(
        &self,
        params: &Params,
        tp: &mut Tp,
        enc_tokens: &[u32],
        enc_lens: &[usize],
        ids: (u32, u32, u32),
        vocab: usize,
        max_new: usize,
    ) -> Result<Vec<Vec<u32>>, CommError> {
        self.generate(
            params,
            tp,
            enc_tokens,
            enc_lens,
            ids,
            vocab,
            max_new,
            &mut |row, _, _| megatron_tensor::cpu::reduce::argmax(row) as u32,
        )
    }
}
