//! Tabular checkpoints, in Megatron's directory layout (`<save>/iter_NNNNNNN/` and the tracker
//! `latest_checkpointed_iteration.txt`) with the same safety as the GPT ones: the files are
//! written into `iter_NNNNNNN.partial/`, the manifest (`metadata.json`, format
//! `megatron-rs/tabular-1`, every file's size and crc32c) last, then the directory is renamed
//! into place and the tracker replaced, each atomically. Tensors are stored whole (gathered over
//! tensor parallelism), so a checkpoint loads under any layout and into `megatron tabular`.

use crate::checkpoint_save::publish;
use crate::checkpointing::{ckpt_err, iteration_dir, partial_dir, write_synced, TRACKER};
use crate::dist_checkpointing::{file_crc, FileEntry};
use crate::{io_err, TrainError};
use megatron_comm::Communicator;
use megatron_core::models::tabular::TabularConfig;
use megatron_core::optimizer::OptimizerParamScheduler;
use megatron_core::Params;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const TABULAR_FORMAT: &str = "megatron-rs/tabular-1";
const MANIFEST: &str = "metadata.json";
const TENSORS: &str = "model_optim.safetensors";
const EXP_AVG: &str = "optimizer.exp_avg.";
const EXP_AVG_SQ: &str = "optimizer.exp_avg_sq.";

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct TabularCheckpointMeta {
    pub format: String,
    pub iteration: u64,
    pub consumed_tables: u64,
    pub model: TabularConfig,
    /// Borders of the regression bins (standardised target), drawn from the prior at the start.
    pub borders: Vec<f32>,
    /// Most feature columns of the prior's tables, and most context rows of a training view.
    pub max_features: usize,
    pub max_context: usize,
    pub seed: u64,
    pub scheduler: OptimizerParamScheduler,
    pub optimizer_step: u64,
    pub adam: (f32, f32, f32),
    pub files: Vec<FileEntry>,
}

/// Whole tensors by name: the model's and, when given, Adam's moments.
pub type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// The whole tensors of every parameter from each TP rank's `local` values (laid out as
/// `params`), gathered over `tp` (every TP rank takes part; all get the result).
pub fn gather_whole(
    params: &Params,
    local: &[f32],
    tp: &mut dyn Communicator,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let n = local.len();
    let size = tp.size();
    let mut all = vec![0.0f32; n * size];
    if size == 1 {
        all.copy_from_slice(local);
    } else {
        tp.all_gather(local, &mut all)?;
    }
    Ok(params
        .metas
        .iter()
        .map(|m| {
            let numel: usize = m.shape.iter().product();
            let mut whole = vec![0.0f32; numel];
            let shards = if m.tp_split_dim.is_some() { size } else { 1 };
            for r in 0..shards {
                let src = &all[r * n + m.offset..r * n + m.offset + m.numel];
                for (i, &v) in src.iter().enumerate() {
                    whole[m.global_index_on(i, r)] = v;
                }
            }
            whole
        })
        .collect())
}

/// This rank's shard of every parameter, read off whole tensors named as `params` names them
/// (`prefix` before each name), into `local`.
pub fn scatter_whole(
    params: &Params,
    whole: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    prefix: &str,
    local: &mut [f32],
    path: &Path,
) -> Result<(), TrainError> {
    for m in &params.metas {
        let name = format!("{prefix}{}", m.name);
        let (shape, data) = whole
            .get(&name)
            .ok_or_else(|| ckpt_err(path, format!("tensor {name} is missing")))?;
        if *shape != m.shape {
            return Err(ckpt_err(
                path,
                format!(
                    "tensor {name} has shape {shape:?}; this model's is {:?} (different --hidden-size, --ffn-hidden-size or --num-layers?)",
                    m.shape
                ),
            ));
        }
        for (i, d) in local[m.offset..m.offset + m.numel].iter_mut().enumerate() {
            *d = data[m.global_index(i)];
        }
    }
    Ok(())
}

/// Writes a complete checkpoint of iteration `meta.iteration` under `save` (one process).
pub fn save(
    save: &Path,
    mut meta: TabularCheckpointMeta,
    tensors: &Tensors,
) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(save).map_err(io_err(save))?;
    let partial = partial_dir(save, meta.iteration);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io_err(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io_err(&partial))?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                s.clone(),
                d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ckpt_err(&partial, e.to_string()))?;
    let blob = safetensors::tensor::serialize(views, None)
        .map_err(|e| ckpt_err(&partial, e.to_string()))?;
    let file = partial.join(TENSORS);
    write_synced(&file, &blob)?;
    let (len, crc) = file_crc(&file)?;
    meta.files = vec![FileEntry {
        file: TENSORS.into(),
        bytes: len,
        crc32c: Some(crc),
        rank: 0,
    }];
    let manifest = partial.join(MANIFEST);
    let json =
        serde_json::to_string_pretty(&meta).map_err(|e| ckpt_err(&manifest, e.to_string()))?;
    write_synced(&manifest, json.as_bytes())?;
    publish(save, &partial, meta.iteration)
}

/// A loaded checkpoint: its manifest and its whole tensors by name.
pub struct TabularCheckpoint {
    pub dir: PathBuf,
    pub meta: TabularCheckpointMeta,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl TabularCheckpoint {
    pub fn has_optimizer_state(&self) -> bool {
        self.tensors.keys().any(|k| k.starts_with(EXP_AVG))
    }
}

/// The tensor names Adam's moments are stored under.
pub fn moment_names() -> (&'static str, &'static str) {
    (EXP_AVG, EXP_AVG_SQ)
}

/// Loads `path`: a save directory (the iteration its tracker names) or an `iter_NNNNNNN`
/// directory; the files are checked against the manifest's sizes and crc32c first.
pub fn load(path: &Path) -> Result<TabularCheckpoint, TrainError> {
    let dir = if path.join(TRACKER).is_file() {
        let tracker = path.join(TRACKER);
        let text = std::fs::read_to_string(&tracker).map_err(io_err(&tracker))?;
        let it: u64 = text
            .trim()
            .parse()
            .map_err(|_| ckpt_err(&tracker, format!("{:?} is not an iteration", text.trim())))?;
        iteration_dir(path, it)
    } else {
        path.to_path_buf()
    };
    let manifest = dir.join(MANIFEST);
    let json = std::fs::read_to_string(&manifest).map_err(|e| {
        ckpt_err(
            &manifest,
            format!("missing or unreadable manifest (not a checkpoint, or an incomplete one): {e}"),
        )
    })?;
    let value: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| ckpt_err(&manifest, e.to_string()))?;
    let format = value.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if format != TABULAR_FORMAT {
        return Err(ckpt_err(
            &dir,
            format!("format {format:?} is not a tabular checkpoint ({TABULAR_FORMAT}); was it saved by --model gpt?"),
        ));
    }
    let meta: TabularCheckpointMeta =
        serde_json::from_value(value).map_err(|e| ckpt_err(&manifest, e.to_string()))?;
    let mut tensors = HashMap::new();
    for f in &meta.files {
        let file = dir.join(&f.file);
        let (len, crc) = file_crc(&file)?;
        if len != f.bytes || Some(crc) != f.crc32c {
            return Err(ckpt_err(
                &file,
                format!(
                    "does not match the manifest ({len} bytes, crc32c {crc:08x}; expected {} bytes, crc32c {:08x}): damaged",
                    f.bytes,
                    f.crc32c.unwrap_or(0)
                ),
            ));
        }
        let bytes = std::fs::read(&file).map_err(io_err(&file))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| ckpt_err(&file, e.to_string()))?;
        for (name, view) in st.tensors() {
            let data = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            tensors.insert(name, (view.shape().to_vec(), data));
        }
    }
    Ok(TabularCheckpoint { dir, meta, tensors })
}
