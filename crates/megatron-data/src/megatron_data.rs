//! Training data from Megatron indexed datasets: per split a `GPTDataset` over each dataset of
//! the blend (indices built as Megatron builds them, cached under `--data-cache-path`), and a
//! `BlendedDataset` on top when several datasets are blended.

use crate::blended_dataset::{
    blend_is_weighted, build_blending_indices, build_exhaustive_blending_indices, parse_blend,
    per_dataset_samples,
};
use crate::gpt_dataset::{
    build_indices, read_sample, split_indices, split_matrix, GPTDatasetIndices,
};
use crate::indexed_dataset::IndexedDataset;
use crate::{npy, parse_split, DataError, GPTSampleSource, Split};
use md5::{Digest, Md5};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct MegatronDataConfig {
    /// `--data-path`: `A B` or `0.3 A 0.7 B`, split by `--split`.
    pub data_path: Vec<String>,
    /// `--train-data-path` / `--valid-data-path` / `--test-data-path`: one blend per split
    /// (each used whole), instead of `--data-path` + `--split`.
    pub per_split: [Vec<String>; 3],
    pub split: String,
    pub seq_length: usize,
    pub seed: u64,
    /// Samples each split must provide; `None`: one epoch of the split's documents (Megatron's
    /// `num_samples=None`, which `--full-validation` asks of the validation split).
    pub num_samples: [Option<u64>; 3],
    pub data_cache_path: Option<String>,
    /// How the validation split's datasets make it up (`--multiple-validation-sets`).
    pub valid_split: ValidSplit,
    /// The extra share of samples each dataset of a weighted blend is built with
    /// (`--mid-level-dataset-surplus`; `None`: megatron-core's default, 0.005).
    pub mid_level_dataset_surplus: Option<f64>,
    /// Identifies the tokenizer in the cache description.
    pub tokenizer: String,
    pub eod: u32,
}

/// How the validation split's datasets make it up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ValidSplit {
    /// One split: a blend of its datasets by weight, as the other splits.
    #[default]
    Blended,
    /// `--multiple-validation-sets`: each dataset of `--valid-data-path` its own validation
    /// set, one epoch each, scored apart (weights are not used), laid end to end in the
    /// split's sample indices.
    PerDataset,
}

/// megatron-core's default `--mid-level-dataset-surplus`.
pub const DEFAULT_SURPLUS: f64 = 0.005;
const SPLIT_NAMES: [&str; 3] = ["train", "valid", "test"];

struct Part {
    ds: Arc<IndexedDataset>,
    ix: GPTDatasetIndices,
}

struct SplitData {
    parts: Vec<Part>,
    index: PartIndex,
    len: u64,
}

/// Which part a split's sample comes from.
enum PartIndex {
    /// One dataset.
    One,
    /// Megatron's `BlendedDataset`: per sample, its dataset and its index there.
    Blend(Vec<i16>, Vec<i64>),
    /// Datasets end to end (`ValidSplit::PerDataset`): where each starts.
    EndToEnd(Vec<u64>),
}

pub struct MegatronGPTData {
    splits: [Option<SplitData>; 3],
    seq_length: usize,
    eod: u32,
    /// One line per split describing what was built or loaded from the cache.
    pub report: Vec<String>,
}

/// True when every dataset named in `--data-path` (weights skipped) has a `.idx` file.
pub fn is_indexed_blend(args: &[String]) -> bool {
    let prefixes: Vec<&String> = args.iter().filter(|a| a.parse::<f64>().is_err()).collect();
    !prefixes.is_empty()
        && prefixes
            .iter()
            .all(|p| Path::new(&format!("{p}.idx")).is_file())
}

impl MegatronGPTData {
    pub fn build(cfg: &MegatronDataConfig) -> Result<Self, DataError> {
        let mut opened: std::collections::HashMap<String, Arc<IndexedDataset>> = Default::default();
        let mut open = |p: &str| -> Result<Arc<IndexedDataset>, DataError> {
            if let Some(d) = opened.get(p) {
                return Ok(d.clone());
            }
            let d = Arc::new(IndexedDataset::open(p)?);
            opened.insert(p.to_string(), d.clone());
            Ok(d)
        };
        let use_per_split = cfg.per_split.iter().any(|v| !v.is_empty());
        let matrix = split_matrix(&parse_split(&cfg.split)?);
        let mut splits: [Option<SplitData>; 3] = [None, None, None];
        let mut report = Vec::new();
        for s in 0..3 {
            let (list, bounds) = if use_per_split {
                if cfg.per_split[s].is_empty() {
                    continue;
                }
                (&cfg.per_split[s], Some((0.0, 1.0)))
            } else {
                (&cfg.data_path, matrix[s])
            };
            let blend = parse_blend(list)?;
            let Some(bounds) = bounds else { continue };
            let size = cfg.num_samples[s];
            if size == Some(0) {
                continue;
            }
            let weights: Vec<f64> = blend.iter().map(|b| b.0).collect();
            // (As in Megatron-LM, only a per-split validation blend is split into sets: under
            // --data-path the validation split is that blend's.)
            let per_dataset = s == 1 && use_per_split && cfg.valid_split == ValidSplit::PerDataset;
            // An unweighted list of several datasets: Megatron builds one epoch of each and
            // blends them in proportion to their lengths.
            let by_length = blend.len() > 1 && !per_dataset && !blend_is_weighted(list);
            let want: Vec<Option<u64>> = match size {
                _ if by_length => vec![None; blend.len()],
                _ if blend.len() == 1 || per_dataset => vec![size; blend.len()],
                Some(size) => per_dataset_samples(
                    &weights,
                    size as usize,
                    cfg.mid_level_dataset_surplus.unwrap_or(DEFAULT_SURPLUS),
                )
                    .into_iter()
                    .map(Some)
                    .collect(),
                None => {
                    return Err(DataError::Format {
                        path: blend[0].1.clone(),
                        msg: format!(
                            "the {} split blends {} datasets, which need a sample count to be weighed (one epoch is read of a single dataset)",
                            SPLIT_NAMES[s],
                            blend.len()
                        ),
                    })
                }
            };
            let mut parts = Vec::new();
            let mut empty = None;
            for ((_, prefix), n) in blend.iter().zip(&want) {
                let ds = open(prefix)?;
                let docs = split_indices(bounds, ds.len());
                if docs.is_empty() {
                    let msg = format!(
                        "the {} split of --split {} holds no documents of {prefix}",
                        SPLIT_NAMES[s], cfg.split
                    );
                    if s == 0 {
                        return Err(DataError::Format {
                            path: prefix.clone(),
                            msg,
                        });
                    }
                    empty = Some(msg);
                    break;
                }
                let (ix, how) = cached_indices(cfg, prefix, &ds, &docs, bounds, s, *n)?;
                let entropy = unigram_entropy(&ds, &docs)
                    .map(|h| format!(", unigram entropy {h:.4} nats"))
                    .unwrap_or_default();
                report.push(format!(
                    "{} split, {prefix}: {} documents, {} samples, {} epochs ({how}){entropy}",
                    SPLIT_NAMES[s],
                    docs.len(),
                    ix.len(),
                    ix.num_epochs
                ));
                parts.push(Part { ds, ix });
            }
            if let Some(msg) = empty {
                // Like Megatron, an empty validation or test split is simply not built.
                report.push(format!("{msg}: skipped"));
                continue;
            }
            let blend_ix = match size {
                _ if by_length => {
                    let lengths: Vec<u64> = parts.iter().map(|p| p.ix.len() as u64).collect();
                    let total: u64 = lengths.iter().sum();
                    match size {
                        // Megatron's `min(size, sum(lengths))`: one epoch of everything at most.
                        Some(size) if size > total && s == 0 => {
                            return Err(DataError::Format {
                                path: blend[0].1.clone(),
                                msg: format!(
                                    "an unweighted --data-path blend holds {total} training samples (one epoch of each dataset, blended by length, as Megatron builds it), and the run reads {size}: give weights (W1 PREFIX1 W2 PREFIX2 ...) to read the datasets more than once"
                                ),
                            })
                        }
                        Some(size) => {
                            let w: Vec<f64> =
                                lengths.iter().map(|&n| n as f64 / total as f64).collect();
                            Some(build_blending_indices(&w, size.min(total) as usize))
                        }
                        None => Some(build_exhaustive_blending_indices(&lengths)),
                    }
                }
                // Megatron's blend is as long as its datasets' shares, each rounded up.
                Some(size) if parts.len() > 1 && !per_dataset => {
                    let shares: u64 = per_dataset_samples(&weights, size as usize, 0.0)
                        .iter()
                        .sum();
                    Some(build_blending_indices(&weights, shares as usize))
                }
                _ => None,
            };
            if let Some((di, si)) = &blend_ix {
                for (d, part) in parts.iter().enumerate() {
                    let need = si
                        .iter()
                        .zip(di)
                        .filter(|(_, &x)| x as usize == d)
                        .map(|(&j, _)| j + 1)
                        .max()
                        .unwrap_or(0);
                    if need as usize > part.ix.len() {
                        return Err(DataError::Format {
                            path: blend[d].1.clone(),
                            msg: format!(
                                "the blend needs {need} samples, the dataset has {}",
                                part.ix.len()
                            ),
                        });
                    }
                }
            }
            let (index, len) = match (blend_ix, size) {
                (Some((di, si)), _) => {
                    let len = di.len() as u64;
                    (PartIndex::Blend(di, si), len)
                }
                _ if per_dataset => {
                    let mut starts = Vec::with_capacity(parts.len());
                    let mut len = 0;
                    for p in &parts {
                        starts.push(len);
                        len += p.ix.len() as u64;
                    }
                    (PartIndex::EndToEnd(starts), len)
                }
                _ => (PartIndex::One, parts[0].ix.len() as u64),
            };
            splits[s] = Some(SplitData { parts, index, len });
        }
        if splits[0].is_none() {
            return Err(DataError::Format {
                path: "--data-path".into(),
                msg: "no training data (check --split and the data paths)".into(),
            });
        }
        Ok(MegatronGPTData {
            splits,
            seq_length: cfg.seq_length,
            eod: cfg.eod,
            report,
        })
    }
}

/// Entropy (nats) of the split's unigram distribution, the loss of a context-free model; only for
/// splits small enough to count in passing (up to 50M tokens).
fn unigram_entropy(ds: &IndexedDataset, docs: &[i32]) -> Option<f64> {
    let total: usize = docs.iter().map(|&d| ds.length(d as usize)).sum();
    if total == 0 || total > 50_000_000 {
        return None;
    }
    let mut counts = std::collections::HashMap::<u32, u64>::new();
    let mut buf = Vec::new();
    for &d in docs {
        buf.clear();
        ds.get(d as usize, 0, ds.length(d as usize), &mut buf);
        for &t in &buf {
            *counts.entry(t).or_default() += 1;
        }
    }
    let n = total as f64;
    Some(
        counts
            .values()
            .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
            .sum(),
    )
}

fn cached_indices(
    cfg: &MegatronDataConfig,
    prefix: &str,
    ds: &IndexedDataset,
    docs: &[i32],
    bounds: (f64, f64),
    split: usize,
    num_samples: Option<u64>,
) -> Result<(GPTDatasetIndices, &'static str), DataError> {
    let build = || {
        build_indices(
            &ds.lengths(),
            docs,
            num_samples,
            cfg.seq_length,
            cfg.seed as u32,
            1,
            true,
        )
    };
    let Some(dir) = &cfg.data_cache_path else {
        return Ok((build()?, "built"));
    };
    let description = serde_json::to_string_pretty(&serde_json::json!({
        "class": "GPTDataset",
        "dataset_path": prefix,
        "num_samples": num_samples,
        "index_split": SPLIT_NAMES[split],
        "random_seed": cfg.seed,
        "sequence_length": cfg.seq_length,
        "split": cfg.split,
        "split_bounds": [bounds.0, bounds.1],
        "num_sequences": ds.len(),
        "tokenizer": cfg.tokenizer,
    }))
    .expect("json");
    let hash = format!("{:x}", Md5::digest(description.as_bytes()));
    let dir = PathBuf::from(dir);
    let base = |what: &str| dir.join(format!("{hash}-GPTDataset-{}-{what}", SPLIT_NAMES[split]));
    let files = [
        base("document_index.npy"),
        base("sample_index.npy"),
        base("shuffle_index.npy"),
    ];
    let desc_file = base("description.txt");
    if desc_file.is_file() && files.iter().all(|f| f.is_file()) {
        let (_, d) = npy::read_i64(&files[0])?;
        let (_, s) = npy::read_i64(&files[1])?;
        let (_, sh) = npy::read_i64(&files[2])?;
        let ix = GPTDatasetIndices {
            document_index: d.iter().map(|&v| v as i32).collect(),
            sample_index: s
                .chunks_exact(2)
                .map(|c| [c[0] as u32, c[1] as u32])
                .collect(),
            shuffle_index: sh.iter().map(|&v| v as u32).collect(),
            num_epochs: 0,
            separate_final_epoch: false,
        };
        let ix = GPTDatasetIndices {
            num_epochs: (ix.document_index.len() / docs.len().max(1)).max(1),
            ..ix
        };
        return Ok((ix, "loaded from --data-cache-path"));
    }
    let ix = build()?;
    std::fs::create_dir_all(&dir).map_err(|e| DataError::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    npy::write_i64(
        &files[0],
        &[ix.document_index.len()],
        &ix.document_index
            .iter()
            .map(|&v| v as i64)
            .collect::<Vec<_>>(),
    )?;
    npy::write_i64(
        &files[1],
        &[ix.sample_index.len(), 2],
        &ix.sample_index
            .iter()
            .flat_map(|r| r.iter().map(|&v| v as i64))
            .collect::<Vec<_>>(),
    )?;
    npy::write_i64(
        &files[2],
        &[ix.shuffle_index.len()],
        &ix.shuffle_index
            .iter()
            .map(|&v| v as i64)
            .collect::<Vec<_>>(),
    )?;
    // The description goes last: its presence marks a complete cache entry.
    std::fs::write(&desc_file, description).map_err(|e| DataError::Io {
        path: desc_file.display().to_string(),
        source: e,
    })?;
    Ok((ix, "built and cached"))
}

impl GPTSampleSource for MegatronGPTData {
    fn seq_length(&self) -> usize {
        self.seq_length
    }
    fn num_samples(&self, split: Split) -> u64 {
        self.splits[split as usize].as_ref().map_or(0, |s| s.len)
    }
    fn sample(&self, split: Split, idx: u64, out: &mut [u32]) {
        let sd = self.splits[split as usize]
            .as_ref()
            .expect("split has data");
        let idx = idx % sd.len;
        let (part, j) = match &sd.index {
            PartIndex::Blend(di, si) => (
                &sd.parts[di[idx as usize] as usize],
                si[idx as usize] as usize,
            ),
            PartIndex::EndToEnd(starts) => {
                let p = starts.partition_point(|&s| s <= idx) - 1;
                (&sd.parts[p], (idx - starts[p]) as usize)
            }
            PartIndex::One => (&sd.parts[0], idx as usize),
        };
        let mut buf = Vec::with_capacity(out.len());
        read_sample(
            &part.ds,
            &part.ix,
            j % part.ix.len(),
            self.seq_length,
            1,
            &mut buf,
        );
        out.copy_from_slice(&buf[..out.len()]);
    }
    fn eod(&self) -> Option<u32> {
        Some(self.eod)
    }
    fn validation_sets(&self) -> Vec<u64> {
        match &self.splits[1] {
            Some(SplitData {
                parts,
                index: PartIndex::EndToEnd(_),
                ..
            }) => parts.iter().map(|p| p.ix.len() as u64).collect(),
            _ => vec![self.num_samples(Split::Valid)],
        }
    }
}
