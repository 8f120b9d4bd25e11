//! Megatron's `T5MaskedWordPieceDataset` (megatron-core `t5_dataset.py` on `masked_dataset.py`):
//! span corruption. A sample is whole sentences of one document up to a target length
//! (`build_mapping` with room for 2 specials, one sentence at least), truncated, then masked
//! with whole-word n-grams of geometric length (p = 0.2, at most 10) until `--mask-prob` of the
//! tokens; each masked span becomes one sentinel (`<extra_id_k>`, in order) in the encoder
//! input, and the decoder reads `[BOS]` then each sentinel followed by its span's tokens and
//! predicts each sentinel and span followed by `[EOS]`. Sample `i` equals megatron-core's for
//! the same files, split and seed.

use crate::indexed_dataset::IndexedDataset;
use crate::masked_dataset::{
    create_masked_lm_predictions, sample_rng, split_sample_index, MaskReplacement, MaskingConfig,
    NgramDistribution, WordPieceTokens,
};
use std::sync::Arc;

/// T5's special tokens beyond BERT's: Megatron's `BertWordPieceTokenizer` adds `[BOS]`,
/// `[EOS]` and `--vocab-extra-ids` sentinels after the vocabulary.
#[derive(Clone, Debug)]
pub struct T5Tokens {
    pub pieces: WordPieceTokens,
    pub bos: u32,
    pub eos: u32,
    /// `<extra_id_0>`, `<extra_id_1>`, ... (`additional_special_tokens_ids`).
    pub sentinels: Vec<u32>,
}

/// `--encoder-seq-length`, `--decoder-seq-length`, `--mask-prob`, `--short-seq-prob`, seed.
#[derive(Clone, Copy, Debug)]
pub struct T5SampleConfig {
    pub encoder_seq_length: usize,
    pub decoder_seq_length: usize,
    pub seed: u64,
    pub masking_probability: f64,
    pub short_seq_prob: f64,
}

/// One sample, padded (Megatron's dictionary; padding positions hold 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct T5Sample {
    /// `text_enc`.
    pub encoder_input: Vec<u32>,
    /// `text_dec`.
    pub decoder_input: Vec<u32>,
    /// `labels`: -1 after the decoder's tokens.
    pub labels: Vec<i64>,
    /// Real encoder and decoder tokens (`enc_mask`, `dec_mask` and `loss_mask` are 1 on the
    /// first `encoder_len` / `decoder_len` positions).
    pub encoder_len: usize,
    pub decoder_len: usize,
    pub truncated: bool,
}

/// A split's T5 samples.
pub struct T5Dataset {
    ds: Arc<IndexedDataset>,
    sample_index: Vec<[i64; 3]>,
    cfg: T5SampleConfig,
    tok: T5Tokens,
}

/// `pretrain_t5.py`'s masking.
const MAX_NGRAM: usize = 10;

impl T5Dataset {
    /// The samples of `documents` (the split's document ids); with `num_samples`, epochs
    /// until at least that many.
    pub fn new(
        ds: Arc<IndexedDataset>,
        documents: &[i32],
        num_samples: Option<u64>,
        cfg: T5SampleConfig,
        tok: T5Tokens,
    ) -> Self {
        let sample_index = split_sample_index(
            &ds,
            documents,
            num_samples,
            cfg.encoder_seq_length - 2,
            cfg.short_seq_prob,
            cfg.seed,
            1,
        );
        T5Dataset {
            ds,
            sample_index,
            cfg,
            tok,
        }
    }

    pub fn len(&self) -> usize {
        self.sample_index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sample_index.is_empty()
    }

    /// Sample `idx` (`__getitem__`). Panics if the masking needs more sentinels than the
    /// tokenizer has or the sample outgrows the sequence lengths (as Megatron asserts).
    pub fn sample(&self, idx: usize) -> T5Sample {
        let [beg, end, target] = self.sample_index[idx];
        let target = target as usize;
        let mut tokens: Vec<u32> = (beg..end).flat_map(|i| self.ds.item(i as usize)).collect();
        let mut rng = sample_rng(self.cfg.seed, idx);
        let truncated = tokens.len() > target;
        tokens.truncate(target);
        let masking = MaskingConfig {
            probability: self.cfg.masking_probability,
            max_ngram: MAX_NGRAM,
            whole_word: true,
            ngrams: NgramDistribution::Geometric,
            replacement: MaskReplacement::AlwaysMask,
        };
        let m = create_masked_lm_predictions(&tokens, target, &mut rng, &self.tok.pieces, &masking);
        let t = &self.tok;
        let mut encoder_input = Vec::new();
        let mut decoder_input = vec![t.bos];
        let mut decoder_output = Vec::new();
        let mut from = 0;
        for (k, (indices, labels)) in m.spans.iter().enumerate() {
            let sentinel = t.sentinels[k];
            encoder_input.extend_from_slice(&m.tokens[from..indices[0]]);
            encoder_input.push(sentinel);
            decoder_input.push(sentinel);
            decoder_input.extend_from_slice(labels);
            decoder_output.push(sentinel);
            decoder_output.extend_from_slice(labels);
            from = indices[indices.len() - 1] + 1;
        }
        encoder_input.extend_from_slice(&m.tokens[from..]);
        decoder_output.push(t.eos);
        let (ne, nd) = (encoder_input.len(), decoder_input.len());
        assert!(
            ne <= self.cfg.encoder_seq_length && nd <= self.cfg.decoder_seq_length,
            "sample {idx}: {ne} encoder and {nd} decoder tokens"
        );
        let pad = t.pieces.pad;
        let (encoder_len, decoder_len) = (ne, nd);
        encoder_input.resize(self.cfg.encoder_seq_length, pad);
        decoder_input.resize(self.cfg.decoder_seq_length, pad);
        let mut labels: Vec<i64> = decoder_output.iter().map(|&x| x as i64).collect();
        labels.resize(self.cfg.decoder_seq_length, -1);
        // Megatron maps the pad id to 0 ("so the embedding can look it up").
        for x in encoder_input.iter_mut().chain(decoder_input.iter_mut()) {
            if *x == pad {
                *x = 0;
            }
        }
        for x in labels.iter_mut().filter(|x| **x == pad as i64) {
            *x = 0;
        }
        T5Sample {
            encoder_input,
            decoder_input,
            labels,
            encoder_len,
            decoder_len,
            truncated,
        }
    }
}
