//! Megatron's `BERTMaskedWordPieceDataset` (megatron-core `bert_dataset.py`,
//! `masked_dataset.py` and `helpers.cpp: build_mapping`): samples of whole sentences of one
//! document up to a target length (shorter with `--short-seq-prob`), split into two segments
//! (swapped half of the time for the sentence-order head), trimmed, framed by `[CLS]`/`[SEP]`,
//! and masked: n-gram candidates (n <= 3, weights 1/n) over whole words, `--mask-prob` of the
//! tokens, each replaced by `[MASK]` 80 % of the time, a random token 10 %, itself 10 %. The
//! same C++ generators (`std::mt19937`, `std::mt19937_64`) and numpy `RandomState` draws in the
//! same order, so sample `i` equals megatron-core's for the same files, split and seed.

use crate::indexed_dataset::IndexedDataset;
pub use crate::masked_dataset::WordPieceTokens;
use crate::masked_dataset::{
    create_masked_lm_predictions, sample_rng, split_sample_index, MaskReplacement, MaskingConfig,
    NgramDistribution,
};
use std::sync::Arc;

/// What shapes the samples (Megatron's `BERTMaskedWordPieceDatasetConfig` as
/// `pretrain_bert.py` fills it).
#[derive(Clone, Copy, Debug)]
pub struct BertSampleConfig {
    pub seq_length: usize,
    pub seed: u64,
    pub masking_probability: f64,
    pub short_seq_prob: f64,
    pub masking_max_ngram: usize,
    /// Whole-word masking (`masking_do_full_word`: `pretrain_bert.py` sets it).
    pub whole_word: bool,
    /// Two segments per sample and the sentence-order label (`--bert-binary-head`).
    pub binary_head: bool,
}

/// One sample, padded to the sequence length (Megatron's dictionary).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BertSample {
    /// `text`: padding positions hold 0.
    pub tokens: Vec<u32>,
    /// `types`: 0 for `[CLS]`, the first segment and its `[SEP]`, 1 for the second.
    pub types: Vec<u32>,
    /// `labels`: the original token where masked, -1 elsewhere.
    pub labels: Vec<i64>,
    /// `is_random`: the segments were swapped.
    pub is_random: bool,
    /// Real tokens (`padding_mask` is 1 on them).
    pub len: usize,
    /// Masked positions (`loss_mask` is 1 on them), ascending.
    pub masked_positions: Vec<usize>,
    pub truncated: bool,
}

/// A split's BERT samples.
pub struct BertDataset {
    ds: Arc<IndexedDataset>,
    sample_index: Vec<[i64; 3]>,
    cfg: BertSampleConfig,
    tok: WordPieceTokens,
}

impl BertDataset {
    /// The samples of `documents` (document ids of the split, ascending and contiguous as
    /// `--split` makes them); with `num_samples`, epochs until at least that many.
    pub fn new(
        ds: Arc<IndexedDataset>,
        documents: &[i32],
        num_samples: Option<u64>,
        cfg: BertSampleConfig,
        tok: WordPieceTokens,
    ) -> Self {
        let sample_index = split_sample_index(
            &ds,
            documents,
            num_samples,
            cfg.seq_length - 3,
            cfg.short_seq_prob,
            cfg.seed,
            if cfg.binary_head { 2 } else { 1 },
        );
        BertDataset {
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

    /// Sample `idx` (`__getitem__`).
    pub fn sample(&self, idx: usize) -> BertSample {
        let [beg, end, target] = self.sample_index[idx];
        let target = target as usize;
        let sentences: Vec<Vec<u32>> = (beg..end).map(|i| self.ds.item(i as usize)).collect();
        let mut rng = sample_rng(self.cfg.seed, idx);
        let mut pivot = sentences.len();
        let mut is_random = false;
        if self.cfg.binary_head {
            pivot = 1;
            if sentences.len() >= 3 {
                pivot = rng.randint(1, sentences.len() as i64) as usize;
            }
            is_random = rng.random() < 0.5;
        }
        let mut a: Vec<u32> = sentences[..pivot].concat();
        let mut b: Vec<u32> = sentences[pivot..].concat();
        if is_random {
            std::mem::swap(&mut a, &mut b);
        }
        let truncated = a.len() + b.len() > target;
        while a.len() + b.len() > target {
            let side = if a.len() > b.len() { &mut a } else { &mut b };
            if rng.random() < 0.5 {
                side.remove(0);
            } else {
                side.pop();
            }
        }
        let t = &self.tok;
        let mut tokens = Vec::with_capacity(self.cfg.seq_length);
        tokens.push(t.cls);
        tokens.extend_from_slice(&a);
        tokens.push(t.sep);
        let mut types = vec![0u32; tokens.len()];
        if !b.is_empty() {
            tokens.extend_from_slice(&b);
            tokens.push(t.sep);
            types.resize(tokens.len(), 1);
        }
        let masking = MaskingConfig {
            probability: self.cfg.masking_probability,
            max_ngram: self.cfg.masking_max_ngram,
            whole_word: self.cfg.whole_word,
            ngrams: NgramDistribution::InverseN,
            replacement: MaskReplacement::MaskRandomKeep,
        };
        let m = create_masked_lm_predictions(&tokens, target, &mut rng, &self.tok, &masking);
        let (masked, positions, labels) = (m.tokens, m.positions, m.labels);
        let len = masked.len();
        assert!(len <= self.cfg.seq_length);
        let mut out_tokens = masked;
        out_tokens.resize(self.cfg.seq_length, t.pad);
        types.resize(self.cfg.seq_length, t.pad);
        let mut out_labels = vec![-1i64; self.cfg.seq_length];
        for (&p, &l) in positions.iter().zip(&labels) {
            out_labels[p] = l as i64;
        }
        // Megatron maps the pad id to 0 in tokens and labels ("so the embedding can look it
        // up").
        for x in out_tokens.iter_mut().filter(|x| **x == t.pad) {
            *x = 0;
        }
        for x in out_labels.iter_mut().filter(|x| **x == t.pad as i64) {
            *x = 0;
        }
        BertSample {
            tokens: out_tokens,
            types,
            labels: out_labels,
            is_random,
            len,
            masked_positions: positions,
            truncated,
        }
    }
}
