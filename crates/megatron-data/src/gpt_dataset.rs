//! Megatron's `GPTDataset` indices (`gpt_dataset.py` and `helpers.cpp: build_sample_idx`): the
//! document index (epochs of the split's documents, shuffled, the final epoch apart when little
//! of it is used), the sample index (document position and offset where each sample starts; one
//! token of overlap between consecutive samples) and the shuffle index, all from one numpy
//! `RandomState(seed)` used in the same order, so the sample order equals Megatron's.

use crate::indexed_dataset::IndexedDataset;
use crate::numpy_rng::RandomState;
use crate::DataError;

/// Megatron's split matrix from `--split` weights: `[(begin, end)]` fractions, `None` for an
/// empty split.
pub fn split_matrix(weights: &[f64; 3]) -> [Option<(f64, f64)>; 3] {
    let sum: f64 = weights.iter().sum();
    let w: Vec<f64> = weights.iter().map(|x| x / sum).collect();
    let mut out = [None; 3];
    let mut acc = 0.0f64;
    for i in 0..3 {
        let (b, e) = (acc, acc + w[i]);
        acc = e;
        if e > b {
            out[i] = Some((b, e));
        }
    }
    out
}

/// The sequence ids of one split: `round(b * N) .. round(e * N)` (Python's round half to even).
pub fn split_indices(bounds: (f64, f64), num_sequences: usize) -> Vec<i32> {
    let n = num_sequences as f64;
    let beg = (bounds.0 * n).round_ties_even() as i64;
    let end = (bounds.1 * n).round_ties_even() as i64;
    (beg..end).map(|v| v as i32).collect()
}

#[derive(Clone, Debug, PartialEq)]
pub struct GPTDatasetIndices {
    pub document_index: Vec<i32>,
    /// `[num_samples + 1]` rows of (position in `document_index`, offset in that document).
    /// 32-bit like Megatron's int32 / uint32 arrays: below 2^32 - 1 samples (checked), half the
    /// memory of 64-bit indices, which is most of the build time on a fresh process.
    pub sample_index: Vec<[u32; 2]>,
    pub shuffle_index: Vec<u32>,
    pub num_epochs: usize,
    pub separate_final_epoch: bool,
}

impl GPTDatasetIndices {
    /// Number of samples available (may exceed the number requested).
    pub fn len(&self) -> usize {
        self.sample_index.len() - 1
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Builds the three indices for `documents` (sequence ids) of a dataset whose sequence lengths
/// are `sizes`. `drop_last_partial` is Megatron's `drop_last_partial_sequence` (true except for
/// the validation split when asked otherwise).
pub fn build_indices(
    sizes: &[i32],
    documents: &[i32],
    num_samples: Option<u64>,
    seq_length: usize,
    seed: u32,
    add_extra_token: usize,
    drop_last_partial: bool,
) -> Result<GPTDatasetIndices, DataError> {
    let s = seq_length as i64;
    let x = add_extra_token as i64;
    let tokens_per_epoch: i64 = documents.iter().map(|&d| sizes[d as usize] as i64).sum();
    if tokens_per_epoch <= x || seq_length < 2 {
        return Err(DataError::Format {
            path: String::from("GPTDataset"),
            msg: format!("{tokens_per_epoch} tokens in the split, fewer than one sample of --seq-length {seq_length} + {add_extra_token}"),
        });
    }
    let mut num_epochs = 1i64;
    if let Some(ns) = num_samples {
        let requested = ns as i64 * s + x;
        let mut tokens = tokens_per_epoch;
        while tokens < requested {
            tokens += tokens_per_epoch;
            num_epochs += 1;
        }
    }
    let mut separate = false;
    let mut sans_final = 0i64;
    if num_epochs > 1 {
        let ns = num_samples.expect("several epochs only with a sample count") as i64;
        sans_final = ((num_epochs - 1) * tokens_per_epoch - x) / s;
        let from_final = ns - sans_final;
        let per_epoch = (tokens_per_epoch - x) / s;
        assert!(from_final >= 0 && from_final <= per_epoch + 1);
        separate = from_final < (0.80 * per_epoch as f64) as i64;
    }
    let mut rng = RandomState::new(seed);
    let epochs = |rng: &mut RandomState, e: i64| {
        let mut v: Vec<i32> = Vec::with_capacity(documents.len() * e as usize);
        for _ in 0..e {
            v.extend_from_slice(documents);
        }
        rng.shuffle(&mut v);
        v
    };
    let document_index = if !separate || num_epochs == 1 {
        epochs(&mut rng, num_epochs)
    } else {
        let mut first = epochs(&mut rng, num_epochs - 1);
        first.extend(epochs(&mut rng, 1));
        first
    };
    let sample_index = build_sample_index(
        sizes,
        &document_index,
        s,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial,
        x,
    );
    let total = sample_index.len() as i64 - 1;
    if total >= u32::MAX as i64 - 1 || document_index.len() >= u32::MAX as usize {
        return Err(DataError::Format {
            path: String::from("GPTDataset"),
            msg: format!("{total} samples: 64-bit indices are not supported yet (limit 2^32 - 2)"),
        });
    }
    let first = if separate { sans_final } else { total };
    let mut shuffle_index: Vec<u32> = (0..first as u32).collect();
    rng.shuffle(&mut shuffle_index);
    if first != total {
        let mut last: Vec<u32> = (first as u32..total as u32).collect();
        rng.shuffle(&mut last);
        shuffle_index.extend(last);
    }
    Ok(GPTDatasetIndices {
        document_index,
        sample_index,
        shuffle_index,
        num_epochs: num_epochs as usize,
        separate_final_epoch: separate,
    })
}

fn build_sample_index(
    sizes: &[i32],
    document_index: &[i32],
    s: i64,
    num_epochs: i64,
    tokens_per_epoch: i64,
    drop_last: bool,
    x: i64,
) -> Vec<[u32; 2]> {
    let num_samples = if drop_last {
        (num_epochs * tokens_per_epoch - x) / s
    } else {
        ((num_epochs * tokens_per_epoch - x) as f32 / s as f32).ceil() as i64
    };
    let mut out = Vec::with_capacity(num_samples as usize + 1);
    let (mut di, mut off) = (0usize, 0i64);
    out.push([0u32, 0u32]);
    while (out.len() as i64) <= num_samples {
        let mut remaining = s + x;
        while remaining != 0 {
            let len = sizes[document_index[di] as usize] as i64 - off;
            remaining -= len;
            if remaining <= 0 {
                off += remaining + len - x;
                remaining = 0;
            } else {
                if di == document_index.len() - 1 {
                    off = sizes[document_index[di] as usize] as i64 - x;
                    break;
                }
                di += 1;
                off = 0;
            }
        }
        out.push([di as u32, off as u32]);
    }
    out
}

/// Reads sample `idx` (`seq_length + add_extra_token` tokens) through the indices.
pub fn read_sample(
    ds: &IndexedDataset,
    ix: &GPTDatasetIndices,
    idx: usize,
    seq_length: usize,
    add_extra_token: usize,
    out: &mut Vec<u32>,
) {
    out.clear();
    let i = ix.shuffle_index[idx] as usize;
    let [d0, o0] = ix.sample_index[i];
    let [d1, o1] = ix.sample_index[i + 1];
    let (d0, o0, d1, o1) = (d0 as i64, o0 as i64, d1 as i64, o1 as i64);
    let (d0, d1, o0, o1) = (d0 as usize, d1 as usize, o0 as usize, o1 as usize);
    if d0 == d1 {
        let doc = ix.document_index[d0] as usize;
        ds.get(doc, o0, o1 - o0 + add_extra_token, out);
    } else {
        for (k, pos) in (d0..=d1).enumerate() {
            let doc = ix.document_index[pos] as usize;
            let len = ds.length(doc);
            let (start, end) = if k == 0 {
                (o0, len)
            } else if pos == d1 {
                (0, o1 + add_extra_token)
            } else {
                (0, len)
            };
            ds.get(doc, start, end - start, out);
        }
    }
    debug_assert!(out.len() <= seq_length + add_extra_token);
}
