//! Megatron's `BERTMaskedWordPieceDataset` (megatron-core `bert_dataset.py`,
//! `masked_dataset.py` and `helpers.cpp: build_mapping`): samples of whole sentences of one
//! document up to a target length (shorter with `--short-seq-prob`), split into two segments
//! (swapped half of the time for the sentence-order head), trimmed, framed by `[CLS]`/`[SEP]`,
//! and masked: n-gram candidates (n <= 3, weights 1/n) over whole words, `--mask-prob` of the
//! tokens, each replaced by `[MASK]` 80 % of the time, a random token 10 %, itself 10 %. The
//! same C++ generators (`std::mt19937`, `std::mt19937_64`) and numpy `RandomState` draws in the
//! same order, so sample `i` equals megatron-core's for the same files, split and seed.

use crate::indexed_dataset::IndexedDataset;
use crate::numpy_rng::RandomState;
use rand_mt::{Mt, Mt64};
use std::sync::Arc;

/// `helpers.cpp`'s `LONG_SENTENCE_LEN`: documents with a longer sentence are skipped.
const LONG_SENTENCE_LEN: i32 = 512;

/// The special tokens and the vocabulary facts the masking reads (a WordPiece vocabulary).
#[derive(Clone, Debug)]
pub struct WordPieceTokens {
    pub cls: u32,
    pub sep: u32,
    pub mask: u32,
    pub pad: u32,
    /// Per token id: whether its piece continues a word (`##...`).
    pub continues_word: Vec<bool>,
}

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

/// `helpers.cpp`'s `get_target_sample_len`.
fn target_sample_len(short_seq_ratio: u32, max_length: i32, gen: &mut Mt) -> i32 {
    if short_seq_ratio == 0 {
        return max_length;
    }
    let r = gen.next_u32();
    if r.is_multiple_of(short_seq_ratio) {
        return 2 + (r % (max_length as u32 - 1)) as i32;
    }
    max_length
}

/// `helpers.cpp`'s `build_mapping`: `(first sentence, end sentence, target length)` of every
/// sample, epochs over the documents until `max_num_samples` (checked at each epoch's start,
/// as the C++ does), shuffled with `mt19937_64(seed + 1)`. `docs` holds the sentence
/// boundaries of the split's documents (`len = documents + 1`), `sizes` every sentence's
/// length.
#[allow(clippy::too_many_arguments)]
pub fn build_mapping(
    docs: &[i64],
    sizes: &[i32],
    num_epochs: i32,
    max_num_samples: u64,
    max_seq_length: i32,
    short_seq_prob: f64,
    seed: i32,
    min_num_sent: i32,
) -> Vec<[i64; 3]> {
    let short_seq_ratio = if short_seq_prob > 0.0 {
        (1.0 / short_seq_prob).round() as u32
    } else {
        0
    };
    let mut gen = Mt::new(seed as u32);
    let mut maps: Vec<[i64; 3]> = Vec::new();
    for _epoch in 0..num_epochs {
        if maps.len() as u64 >= max_num_samples {
            break;
        }
        for doc in 0..docs.len() - 1 {
            let (first, last) = (docs[doc], docs[doc + 1]);
            let mut prev_start = first;
            let mut remain = last - first;
            let long = remain > 1 && (first..last).any(|s| sizes[s as usize] > LONG_SENTENCE_LEN);
            if remain < min_num_sent as i64 || long {
                continue;
            }
            let (mut seq_len, mut num_sent) = (0i64, 0i32);
            let mut target = target_sample_len(short_seq_ratio, max_seq_length, &mut gen);
            for s in first..last {
                seq_len += sizes[s as usize] as i64;
                num_sent += 1;
                remain -= 1;
                if (seq_len >= target as i64 && remain > 1 && num_sent >= min_num_sent)
                    || remain == 0
                {
                    maps.push([prev_start, s + 1, target as i64]);
                    prev_start = s + 1;
                    target = target_sample_len(short_seq_ratio, max_seq_length, &mut gen);
                    seq_len = 0;
                    num_sent = 0;
                }
            }
        }
    }
    let mut gen64 = Mt64::new(seed as u64 + 1);
    for i in (1..maps.len()).rev() {
        let j = (gen64.next_u64() % (i as u64 + 1)) as usize;
        maps.swap(i, j);
    }
    maps
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
        let di = ds.document_indices();
        let mut bounds: Vec<i64> = documents.iter().map(|&d| di[d as usize]).collect();
        if let Some(&last) = documents.last() {
            bounds.push(di[last as usize + 1]);
        }
        let sizes = ds.lengths();
        let (epochs, max) = match num_samples {
            Some(n) => (i32::MAX - 1, n),
            None => (1, u64::MAX),
        };
        let sample_index = build_mapping(
            &bounds,
            &sizes,
            epochs,
            max,
            cfg.seq_length as i32 - 3,
            cfg.short_seq_prob,
            cfg.seed as i32,
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
        let seed = (self.cfg.seed.wrapping_add(idx as u64) % (1u64 << 32)) as u32;
        let mut rng = RandomState::new(seed);
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
        let (masked, positions, labels) = self.mask(&tokens, target, &mut rng);
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

    /// `_create_masked_lm_predictions` without permutation and with n-gram weights 1/n:
    /// (masked tokens, masked positions ascending, their original tokens).
    fn mask(
        &self,
        tokens: &[u32],
        target: usize,
        rng: &mut RandomState,
    ) -> (Vec<u32>, Vec<usize>, Vec<u32>) {
        let t = &self.tok;
        let mut candidates: Vec<Vec<usize>> = Vec::new();
        for (i, &tok) in tokens.iter().enumerate() {
            if tok == t.cls || tok == t.sep {
                continue;
            }
            let continues = t.continues_word.get(tok as usize).copied().unwrap_or(false);
            match candidates.last_mut() {
                Some(last) if continues && self.cfg.whole_word => last.push(i),
                _ => candidates.push(vec![i]),
            }
        }
        let p = self.cfg.masking_probability;
        let n_maskings =
            (p * target as f64).min(1f64.max((tokens.len() as f64 * p).round_ties_even()));
        let max_ngram = self.cfg.masking_max_ngram;
        let mut nprobs: Vec<f64> = (1..=max_ngram).map(|n| 1.0 / n as f64).collect();
        let s: f64 = nprobs.iter().sum();
        nprobs.iter_mut().for_each(|x| *x /= s);
        let s2: f64 = nprobs.iter().sum();
        let probs: Vec<f64> = nprobs.iter().map(|x| x / s2).collect();
        // Per candidate: its n-grams of 1..=max_ngram candidates (clipped at the end).
        let mut ngrams: Vec<Vec<Vec<usize>>> = (0..candidates.len())
            .map(|idx| {
                (1..=max_ngram)
                    .map(|n| candidates[idx..(idx + n).min(candidates.len())].concat())
                    .collect()
            })
            .collect();
        rng.shuffle(&mut ngrams);
        let mut out = tokens.to_vec();
        let mut picked: Vec<(usize, u32)> = Vec::new();
        let mut taken = std::collections::HashSet::new();
        for grams in &ngrams {
            if picked.len() as f64 >= n_maskings {
                break;
            }
            let mut n = rng.choice_index(&probs) + 1;
            let chosen = loop {
                let indices = &grams[n - 1];
                n -= 1;
                if n_maskings >= (picked.len() + indices.len()) as f64 {
                    break Some(indices);
                }
                if n == 0 {
                    break None;
                }
            };
            let Some(indices) = chosen else { continue };
            if indices.iter().any(|i| taken.contains(i)) {
                continue;
            }
            for &i in indices {
                taken.insert(i);
                if let Some(m) = self.token_mask(rng) {
                    out[i] = m;
                }
                picked.push((i, tokens[i]));
            }
        }
        // Megatron shuffles the candidates once more (for permutation, off here): the same
        // draws, so the random state is where Megatron's is.
        rng.shuffle(&mut ngrams);
        picked.sort_by_key(|x| x.0);
        let (positions, labels) = picked.into_iter().unzip();
        (out, positions, labels)
    }

    /// `_get_token_mask`: `[MASK]` 80 %, a random vocabulary token 10 %, unchanged 10 %.
    fn token_mask(&self, rng: &mut RandomState) -> Option<u32> {
        if rng.random() < 0.8 {
            return Some(self.tok.mask);
        }
        if rng.random() >= 0.5 {
            let v = self.tok.continues_word.len() as i64;
            return Some(rng.randint(0, v) as u32);
        }
        None
    }
}
