//! Single-rank checkpoints in Megatron's directory layout:
//! `<save>/latest_checkpointed_iteration.txt` and `<save>/iter_0000100/` holding
//! `model_optim_rng.safetensors` and `metadata.json`.
//!
//! The manifest (`metadata.json`) is written last and names every tensor, its global shape and
//! the exact byte size of the shard file; a directory without it, or whose shard does not match
//! it, is refused. Everything is written under a temporary name and renamed into place, and the
//! tracker file is replaced atomically only after that, so a crash never leaves a checkpoint that
//! looks complete, and never damages the previous one.

use crate::arguments::TrainConfig;
use crate::{io_err, TrainError};
use megatron_comm::Communicator;
use megatron_core::models::ModelFamily;
use megatron_core::optimizer::{Adam, OptimizerParamScheduler};
use megatron_core::tensor_parallel::{gather_to_full, Tp};
use megatron_core::{Params, TransformerConfig};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
const SHARD: &str = "model_optim_rng.safetensors";
const MANIFEST: &str = "metadata.json";
const FORMAT: &str = "megatron-rs/1";

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub file: String,
    /// Offset of this shard in the global tensor, per dimension (all zero on one rank).
    pub global_offset: Vec<usize>,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct CheckpointMeta {
    pub format: String,
    pub iteration: u64,
    pub consumed_train_samples: u64,
    pub scheduler: OptimizerParamScheduler,
    pub optimizer_step: u64,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_eps: f32,
    /// The run's seed: every random stream (dropout, data order) derives from it and the
    /// iteration, so it is the whole RNG state.
    pub seed: u64,
    pub model: TransformerConfig,
    pub tokenizer_type: String,
    pub vocab_size: usize,
    #[serde(default)]
    pub vocab_file: Option<String>,
    #[serde(default)]
    pub merge_file: Option<String>,
    #[serde(default)]
    pub tokenizer_model: Option<String>,
    pub tensors: Vec<TensorEntry>,
    pub shard_bytes: u64,
}

pub fn iteration_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

fn to_bytes(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() * 4);
    for v in x {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn ckpt_err(path: &Path, msg: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

/// Saves parameters, optimizer moments and `meta` for `meta.iteration`.
pub fn save_checkpoint(
    save: &Path,
    mut meta: CheckpointMeta,
    params: &Params,
    adam: &Adam,
) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(save).map_err(io_err(save))?;
    let final_dir = iteration_dir(save, meta.iteration);
    let tmp_dir = save.join(format!(
        ".iter_{:07}.tmp-{}",
        meta.iteration,
        std::process::id()
    ));
    if tmp_dir.exists() {
        std::fs::remove_dir_all(&tmp_dir).map_err(io_err(&tmp_dir))?;
    }
    std::fs::create_dir_all(&tmp_dir).map_err(io_err(&tmp_dir))?;

    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for m in &params.metas {
        let r = m.offset..m.offset + m.numel;
        blobs.push((
            m.name.clone(),
            m.shape.clone(),
            to_bytes(&params.data[r.clone()]),
        ));
        blobs.push((
            format!("optimizer.exp_avg.{}", m.name),
            m.shape.clone(),
            to_bytes(&adam.exp_avg[r.clone()]),
        ));
        blobs.push((
            format!("optimizer.exp_avg_sq.{}", m.name),
            m.shape.clone(),
            to_bytes(&adam.exp_avg_sq[r]),
        ));
    }
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).expect("shape matches bytes"),
            )
        })
        .collect();
    let shard = tmp_dir.join(SHARD);
    let mut info = HashMap::new();
    info.insert("format".to_string(), FORMAT.to_string());
    safetensors::serialize_to_file(views, Some(info), &shard)
        .map_err(|e| ckpt_err(&shard, e.to_string()))?;
    meta.shard_bytes = std::fs::metadata(&shard).map_err(io_err(&shard))?.len();
    meta.tensors = blobs
        .iter()
        .map(|(n, s, _)| TensorEntry {
            name: n.clone(),
            shape: s.clone(),
            dtype: "F32".into(),
            file: SHARD.into(),
            global_offset: vec![0; s.len()],
        })
        .collect();
    meta.format = FORMAT.into();
    let manifest = tmp_dir.join(MANIFEST);
    let json =
        serde_json::to_string_pretty(&meta).map_err(|e| ckpt_err(&manifest, e.to_string()))?;
    write_synced(&manifest, json.as_bytes())?;

    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
    }
    std::fs::rename(&tmp_dir, &final_dir).map_err(io_err(&final_dir))?;
    let tracker_tmp = save.join(format!(".{TRACKER}.tmp"));
    write_synced(&tracker_tmp, format!("{}\n", meta.iteration).as_bytes())?;
    let tracker = save.join(TRACKER);
    std::fs::rename(&tracker_tmp, &tracker).map_err(io_err(&tracker))?;
    Ok(final_dir)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

pub struct LoadedCheckpoint {
    pub meta: CheckpointMeta,
    pub tensors: HashMap<String, Vec<f32>>,
    pub dir: PathBuf,
}

/// Reads the iteration named by the tracker file (or `iteration` if given).
pub fn load_checkpoint(
    load: &Path,
    iteration: Option<u64>,
) -> Result<LoadedCheckpoint, TrainError> {
    let iteration = match iteration {
        Some(i) => i,
        None => {
            let tracker = load.join(TRACKER);
            let s = std::fs::read_to_string(&tracker)
                .map_err(|e| ckpt_err(&tracker, format!("cannot read the tracker file: {e}")))?;
            s.trim().parse::<u64>().map_err(|_| {
                ckpt_err(
                    &tracker,
                    format!("tracker holds '{}', not an iteration number", s.trim()),
                )
            })?
        }
    };
    let dir = iteration_dir(load, iteration);
    let manifest = dir.join(MANIFEST);
    let json = std::fs::read_to_string(&manifest).map_err(|e| {
        ckpt_err(
            &manifest,
            format!("missing or unreadable manifest, the checkpoint is incomplete: {e}"),
        )
    })?;
    let meta: CheckpointMeta = serde_json::from_str(&json)
        .map_err(|e| ckpt_err(&manifest, format!("corrupt manifest: {e}")))?;
    if meta.format != FORMAT {
        return Err(ckpt_err(
            &manifest,
            format!("format '{}' is not '{FORMAT}'", meta.format),
        ));
    }
    let shard = dir.join(SHARD);
    let bytes = std::fs::read(&shard).map_err(|e| ckpt_err(&shard, format!("cannot read: {e}")))?;
    if bytes.len() as u64 != meta.shard_bytes {
        return Err(ckpt_err(
            &shard,
            format!(
                "truncated or altered: {} bytes, the manifest records {}",
                bytes.len(),
                meta.shard_bytes
            ),
        ));
    }
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| ckpt_err(&shard, format!("not a valid safetensors file: {e}")))?;
    let mut tensors = HashMap::new();
    for t in &meta.tensors {
        let v = st
            .tensor(&t.name)
            .map_err(|e| ckpt_err(&shard, format!("tensor {}: {e}", t.name)))?;
        if v.shape() != t.shape.as_slice() || v.dtype() != Dtype::F32 {
            return Err(ckpt_err(
                &shard,
                format!(
                    "tensor {} has shape {:?}, the manifest records {:?}",
                    t.name,
                    v.shape(),
                    t.shape
                ),
            ));
        }
        tensors.insert(t.name.clone(), from_bytes(v.data()));
    }
    Ok(LoadedCheckpoint { meta, tensors, dir })
}

/// Copies the checkpoint's tensors into `params` and `adam`, checking every name and shape.
pub fn restore(
    ck: &LoadedCheckpoint,
    params: &mut Params,
    adam: Option<&mut Adam>,
) -> Result<(), TrainError> {
    let shard = ck.dir.join(SHARD);
    let get = |name: &str, numel: usize| -> Result<&Vec<f32>, TrainError> {
        let v = ck
            .tensors
            .get(name)
            .ok_or_else(|| ckpt_err(&shard, format!("has no tensor {name}")))?;
        if v.len() != numel {
            return Err(ckpt_err(
                &shard,
                format!(
                    "tensor {name} has {} elements, the model needs {numel}",
                    v.len()
                ),
            ));
        }
        Ok(v)
    };
    // Checkpoints hold whole tensors; a tensor-parallel rank copies out its shard.
    let metas = params.metas.clone();
    let shard_of = |dst: &mut [f32], m: &megatron_core::ParamMeta, full: &[f32]| {
        for (i, v) in dst.iter_mut().enumerate() {
            *v = full[m.global_index(i)];
        }
    };
    for m in &metas {
        let global: usize = m.shape.iter().product();
        let r = m.offset..m.offset + m.numel;
        shard_of(&mut params.data[r], m, get(&m.name, global)?);
    }
    if let Some(adam) = adam {
        for m in &metas {
            let global: usize = m.shape.iter().product();
            let r = m.offset..m.offset + m.numel;
            shard_of(
                &mut adam.exp_avg[r.clone()],
                m,
                get(&format!("optimizer.exp_avg.{}", m.name), global)?,
            );
            shard_of(
                &mut adam.exp_avg_sq[r],
                m,
                get(&format!("optimizer.exp_avg_sq.{}", m.name), global)?,
            );
        }
        adam.step = ck.meta.optimizer_step;
    }
    Ok(())
}

/// Parameters and Adam state of the whole model in the TP = 1, PP = 1 layout (whole tensors of
/// every layer): shards are gathered over the TP group, stages combined over the pipeline group
/// (each stage contributes its own tensors, zeros elsewhere, summed). Every rank of both groups
/// takes part and receives the result.
pub(crate) fn gather_full_state(
    cfg: &TrainConfig,
    params: &Params,
    adam: &Adam,
    tp: &mut Tp,
    pp: &mut dyn Communicator,
) -> Result<(Params, Adam), TrainError> {
    let mut full = Params::default();
    let layers = cfg.model.num_layers();
    cfg.model
        .build_chunk(&mut full, &mut Vec::new(), 0..layers, true, true);
    let mut gather = |data: &[f32]| -> Result<Vec<f32>, TrainError> {
        let stage = if tp.size() > 1 {
            gather_to_full(params, data, tp)?
        } else {
            data.to_vec()
        };
        if pp.size() == 1 {
            return Ok(stage);
        }
        let mut out = vec![0.0f32; full.numel()];
        let mut at = 0;
        for m in &params.metas {
            let global: usize = m.shape.iter().product();
            if !m.shared {
                let id = full
                    .find(&m.name)
                    .expect("a stage parameter is a model parameter");
                let fm = &full.metas[id.0];
                out[fm.offset..fm.offset + fm.numel].copy_from_slice(&stage[at..at + global]);
            }
            at += global;
        }
        pp.all_reduce(&mut out, megatron_comm::ReduceOp::Sum)?;
        Ok(out)
    };
    let data = gather(&params.data)?;
    let exp_avg = gather(&adam.exp_avg)?;
    let exp_avg_sq = gather(&adam.exp_avg_sq)?;
    full.data = data;
    let mut full_adam = adam.clone();
    full_adam.exp_avg = exp_avg;
    full_adam.exp_avg_sq = exp_avg_sq;
    Ok((full, full_adam))
}

/// `--load`: reads the checkpoint, refuses one saved for another model, and copies its
/// parameters and Adam state into this rank's shards.
pub(crate) fn load_into(
    cfg: &TrainConfig,
    dir: &str,
    params: &mut Params,
    adam: &mut Adam,
    lead: bool,
) -> Result<crate::setup::Restored, TrainError> {
    let ck = load_checkpoint(Path::new(dir), None)?;
    if ck.meta.model != cfg.model {
        return Err(TrainError::Checkpoint {
            path: ck.dir.display().to_string(),
            msg: format!(
                "was saved for another model configuration ({:?}); the flags give {:?}",
                ck.meta.model, cfg.model
            ),
        });
    }
    restore(&ck, params, Some(adam))?;
    let (iteration, consumed) = (ck.meta.iteration, ck.meta.consumed_train_samples);
    if lead {
        println!(
            "loaded checkpoint {} at iteration {iteration} ({consumed} consumed samples)",
            ck.dir.display()
        );
    }
    Ok(crate::setup::Restored {
        iteration,
        consumed_samples: consumed,
        scheduler_steps: ck.meta.scheduler.num_steps,
    })
}

impl crate::training::Trainer<'_> {
    /// Saves a checkpoint of iteration `iteration` under `dir` (every rank takes part: the
    /// optimizer's state is gathered over DP, shards over TP, stages over PP); returns its path
    /// on the rank that wrote it.
    pub(crate) fn save_checkpoint(
        &mut self,
        dir: &Path,
        iteration: u64,
        tok: &dyn megatron_data::Tokenizer,
    ) -> Result<Option<PathBuf>, TrainError> {
        let numel = self.params.numel();
        let (dp_rank, _) = self.comms.dp_rank_size();
        let dp: &mut dyn Communicator = match self.comms.dp.as_deref_mut() {
            Some(c) => c,
            None => &mut self.serial_dp,
        };
        let state = self.optimizer.full_state(numel, dp)?;
        // 16-bit parameters under the distributed optimizer: the fp32 main copy is saved.
        let staged_main = state.main.map(|main| Params {
            data: main,
            half: megatron_core::params::HalfParams::None,
            metas: self.params.metas.clone(),
            tp: self.params.tp,
            gate: None,
        });
        let saving: &Params = staged_main.as_ref().unwrap_or(&self.params);
        if dp_rank != 0 {
            return Ok(None);
        }
        // Shards are gathered into the TP = 1 layout: the checkpoint loads under any layout.
        let (tp, pp) = (&mut self.comms.tp, &mut *self.comms.pp);
        let gathered = if tp.size() > 1 || pp.size() > 1 {
            Some(gather_full_state(self.cfg, saving, &state.adam, tp, pp)?)
        } else {
            None
        };
        if !self.lead {
            return Ok(None);
        }
        let (full, full_adam) = gathered
            .as_ref()
            .map_or((saving, &*state.adam), |(p, a)| (p, a));
        let a = &self.cfg.args;
        let meta = CheckpointMeta {
            format: String::new(),
            iteration,
            consumed_train_samples: self.consumed,
            scheduler: self.sched.clone(),
            optimizer_step: full_adam.step,
            adam_beta1: a.adam_beta1,
            adam_beta2: a.adam_beta2,
            adam_eps: a.adam_eps,
            seed: a.seed,
            model: self.cfg.model.clone(),
            tokenizer_type: tok.name().to_string(),
            vocab_size: a.tokenizer.vocab_size.unwrap_or(tok.vocab_size()),
            vocab_file: a.tokenizer.vocab_file.clone(),
            merge_file: a.tokenizer.merge_file.clone(),
            tokenizer_model: a.tokenizer.tokenizer_model.clone(),
            tensors: Vec::new(),
            shard_bytes: 0,
        };
        Ok(Some(save_checkpoint(dir, meta, full, full_adam)?))
    }
}
