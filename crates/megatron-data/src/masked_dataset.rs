//! What megatron-core's masked WordPiece datasets (`masked_dataset.py`, BERT's and T5's) share:
//! `helpers.cpp: build_mapping` (samples of whole sentences of one document up to a target
//! length, shorter with `--short-seq-prob`; the C++ `std::mt19937` and `std::mt19937_64`
//! streams) and `_create_masked_lm_predictions` (n-gram candidates over whole words, drawn
//! with numpy `RandomState` calls in Megatron's order).

use crate::numpy_rng::RandomState;
use rand_mt::{Mt, Mt64};

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

/// The sample index of a split (`_build_sample_index`): `build_mapping` over the sentence
/// boundaries of `documents` (the split's document ids, ascending); with `num_samples`, epochs
/// until at least that many, else one epoch.
pub fn split_sample_index(
    ds: &crate::indexed_dataset::IndexedDataset,
    documents: &[i32],
    num_samples: Option<u64>,
    max_seq_length: usize,
    short_seq_prob: f64,
    seed: u64,
    min_num_sent: i32,
) -> Vec<[i64; 3]> {
    let di = ds.document_indices();
    let mut bounds: Vec<i64> = documents.iter().map(|&d| di[d as usize]).collect();
    if let Some(&last) = documents.last() {
        bounds.push(di[last as usize + 1]);
    }
    let (epochs, max) = match num_samples {
        Some(n) => (i32::MAX - 1, n),
        None => (1, u64::MAX),
    };
    build_mapping(
        &bounds,
        &ds.lengths(),
        epochs,
        max,
        max_seq_length as i32,
        short_seq_prob,
        seed as i32,
        min_num_sent,
    )
}

/// The numpy random state of sample `idx`: `RandomState((seed + idx) % 2**32)`.
pub fn sample_rng(seed: u64, idx: usize) -> RandomState {
    RandomState::new((seed.wrapping_add(idx as u64) % (1u64 << 32)) as u32)
}

/// How n-gram lengths are drawn: weights `1/n` for `n <= max_ngram` (BERT), or a geometric
/// distribution with `p = 0.2` capped at `max_ngram` (T5's span corruption).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NgramDistribution {
    InverseN,
    Geometric,
}

/// What a masked token becomes (`_get_token_mask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskReplacement {
    /// BERT: `[MASK]` 80 %, a random vocabulary token 10 %, unchanged 10 %.
    MaskRandomKeep,
    /// T5: always `[MASK]` (the span becomes a sentinel anyway); draws nothing.
    AlwaysMask,
}

/// The masking settings (`MaskedWordPieceDatasetConfig` without permutation).
#[derive(Clone, Copy, Debug)]
pub struct MaskingConfig {
    pub probability: f64,
    pub max_ngram: usize,
    /// `masking_do_full_word`.
    pub whole_word: bool,
    pub ngrams: NgramDistribution,
    pub replacement: MaskReplacement,
}

/// The masking of one sample.
pub struct MaskedPrediction {
    /// The tokens with masked positions replaced.
    pub tokens: Vec<u32>,
    /// Masked positions, ascending, and their original tokens.
    pub positions: Vec<usize>,
    pub labels: Vec<u32>,
    /// The masked n-grams (positions, original tokens), by first position.
    pub spans: Vec<(Vec<usize>, Vec<u32>)>,
}

/// `_create_masked_lm_predictions` without permutation.
pub fn create_masked_lm_predictions(
    tokens: &[u32],
    target: usize,
    rng: &mut RandomState,
    t: &WordPieceTokens,
    cfg: &MaskingConfig,
) -> MaskedPrediction {
    let mut candidates: Vec<Vec<usize>> = Vec::new();
    for (i, &tok) in tokens.iter().enumerate() {
        if tok == t.cls || tok == t.sep {
            continue;
        }
        let continues = t.continues_word.get(tok as usize).copied().unwrap_or(false);
        match candidates.last_mut() {
            Some(last) if continues && cfg.whole_word => last.push(i),
            _ => candidates.push(vec![i]),
        }
    }
    let p = cfg.probability;
    let n_maskings = (p * target as f64).min(1f64.max((tokens.len() as f64 * p).round_ties_even()));
    let max_ngram = cfg.max_ngram;
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
    let mut spans: Vec<(Vec<usize>, Vec<u32>)> = Vec::new();
    for grams in &ngrams {
        if picked.len() as f64 >= n_maskings {
            break;
        }
        let mut n = match cfg.ngrams {
            NgramDistribution::InverseN => rng.choice_index(&probs) + 1,
            NgramDistribution::Geometric => (rng.geometric(0.2) as usize).min(max_ngram),
        };
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
            if let Some(m) = token_mask(rng, t, cfg.replacement) {
                out[i] = m;
            }
            picked.push((i, tokens[i]));
        }
        spans.push((
            indices.clone(),
            indices.iter().map(|&i| tokens[i]).collect(),
        ));
    }
    // Megatron shuffles the candidates once more (for permutation, off here): the same
    // draws, so the random state is where Megatron's is.
    rng.shuffle(&mut ngrams);
    picked.sort_by_key(|x| x.0);
    spans.sort_by_key(|s| s.0[0]);
    let (positions, labels) = picked.into_iter().unzip();
    MaskedPrediction {
        tokens: out,
        positions,
        labels,
        spans,
    }
}

/// `_get_token_mask`.
fn token_mask(rng: &mut RandomState, t: &WordPieceTokens, how: MaskReplacement) -> Option<u32> {
    if how == MaskReplacement::AlwaysMask {
        return Some(t.mask);
    }
    if rng.random() < 0.8 {
        return Some(t.mask);
    }
    if rng.random() >= 0.5 {
        let v = t.continues_word.len() as i64;
        return Some(rng.randint(0, v) as u32);
    }
    None
}
