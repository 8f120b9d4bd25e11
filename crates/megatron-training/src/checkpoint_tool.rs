//! `megatron checkpoint inspect|verify DIR`: what a checkpoint holds and whether its files match
//! its manifest. `DIR` is a save directory (every `iter_*` in it) or one `iter_NNNNNNN`.

use crate::checkpointing::{find_checkpoint, iteration_dir, TRACKER};
use crate::dist_checkpointing::CheckpointReader;
use crate::TrainError;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn is_iteration_dir(p: &Path) -> bool {
    p.join("metadata.json").exists()
        || p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("iter_"))
}

/// The `iter_*` directories under a save directory, newest first.
fn iteration_dirs(save: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let mut its: Vec<u64> = std::fs::read_dir(save)
        .map_err(crate::io_err(save))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .into_string()
                .ok()?
                .strip_prefix("iter_")?
                .parse()
                .ok()
        })
        .collect();
    its.sort_unstable_by(|a, b| b.cmp(a));
    Ok(its.into_iter().map(|i| iteration_dir(save, i)).collect())
}

/// The manifest's story: iteration, layout saved from, files, tensors and their pieces.
pub fn inspect(path: &Path) -> Result<String, TrainError> {
    let r = if is_iteration_dir(path) {
        CheckpointReader::open(path)?
    } else {
        find_checkpoint(path, true)?
    };
    let m = &r.meta;
    let mut s = String::new();
    let _ = writeln!(s, "checkpoint {} ({})", r.dir.display(), m.format);
    let _ = writeln!(
        s,
        "iteration {} | consumed samples {} | optimizer {}, steps {} | seed {}",
        m.iteration, m.consumed_train_samples, m.optimizer, m.optimizer_step, m.seed
    );
    // What a resumed run's flags must reproduce (or override): the saved schedule.
    let sc = &m.scheduler;
    let wsd = match sc.decay_style {
        megatron_core::optimizer::LrDecayStyle::WSD => format!(
            " (final {:?} phase {} samples)",
            sc.wsd_decay_style, sc.wsd_decay_steps
        ),
        _ => String::new(),
    };
    let _ = writeln!(
        s,
        "learning rate: {:e} -> {:e} ({:?}{wsd}), warm-up {} samples from {:e}, decay {} samples, at sample {}",
        sc.max_lr, sc.min_lr, sc.decay_style, sc.warmup_steps, sc.init_lr, sc.decay_steps, sc.num_steps
    );
    match &m.grad_scaler {
        Some(megatron_core::optimizer::GradScaler::Dynamic {
            scale,
            growth_tracker,
            hysteresis_tracker,
            ..
        }) => {
            let _ = writeln!(
                s,
                "loss scale: {scale} (dynamic; {growth_tracker} steps since the last change, {hysteresis_tracker} overflows left before backing off)"
            );
        }
        Some(megatron_core::optimizer::GradScaler::Constant { scale }) => {
            let _ = writeln!(s, "loss scale: {scale} (constant)");
        }
        None => {}
    }
    match &m.layout {
        Some(l) => {
            let _ = writeln!(
                s,
                "saved from: world {} = TP {} x PP {} (virtual {}) x DP {}{}",
                l.world,
                l.tensor_model_parallel,
                l.pipeline_model_parallel,
                l.virtual_pipeline,
                l.data_parallel,
                if l.distributed_optimizer {
                    ", distributed optimizer"
                } else {
                    ""
                }
            );
        }
        None => {
            let _ = writeln!(s, "saved from: one rank (whole tensors)");
        }
    }
    let c = &m.model;
    let _ = writeln!(
        s,
        "model: {} layers, hidden {}, {} heads ({} query groups), ffn {}, vocab {} ({:?}, {:?}, {:?})",
        c.num_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.query_groups(),
        c.ffn_hidden_size,
        c.padded_vocab_size,
        c.normalization,
        c.activation,
        c.position_embedding_type
    );
    if let Some(a) = c.mla {
        let q = a
            .q_lora_rank
            .map_or("from the hidden state".to_string(), |r| {
                format!("latent {r}")
            });
        let _ = writeln!(
            s,
            "multi-latent attention: queries {q}, keys/values latent {}, query/key heads {} + {} rotary, value heads {}",
            a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim
        );
    }
    if let Some(d) = c.mtp {
        let _ = writeln!(
            s,
            "multi-token prediction: {} depth(s), loss weight {}",
            d.num_layers, d.loss_scaling_factor
        );
    }
    let bytes: u64 = m.files.iter().map(|f| f.bytes).sum();
    let _ = writeln!(s, "files: {} ({:.1} MB)", m.files.len(), bytes as f64 / 1e6);
    for f in &m.files {
        let crc = f.crc32c.map_or("-".to_string(), |c| format!("{c:08x}"));
        let _ = writeln!(
            s,
            "  {}  {} bytes  crc32c {crc}  rank {}",
            f.file, f.bytes, f.rank
        );
    }
    let _ = writeln!(s, "tensors: {}", m.tensors.len());
    for t in &m.tensors {
        let _ = writeln!(
            s,
            "  {}  {:?}  {}  {} pieces",
            t.name,
            t.shape,
            t.dtype,
            t.pieces.len()
        );
    }
    Ok(s)
}

/// Checks every file of one checkpoint (or of every checkpoint under a save directory)
/// against its manifest: present, same size, same crc32c. Errors when any fails.
pub fn verify(path: &Path) -> Result<String, TrainError> {
    let dirs = if is_iteration_dir(path) {
        vec![path.to_path_buf()]
    } else {
        iteration_dirs(path)?
    };
    let mut s = String::new();
    let mut bad = Vec::new();
    for d in &dirs {
        match CheckpointReader::open(d).and_then(|r| r.verify()) {
            Ok(()) => {
                let _ = writeln!(s, "ok       {}", d.display());
            }
            Err(e) => {
                let _ = writeln!(s, "CORRUPT  {}: {e}", d.display());
                bad.push(d.display().to_string());
            }
        }
    }
    if dirs.is_empty() {
        let tracker = path.join(TRACKER);
        return Err(TrainError::Checkpoint {
            path: path.display().to_string(),
            msg: format!(
                "no checkpoint here (no iter_* directory; tracker {} {})",
                tracker.display(),
                if tracker.exists() {
                    "present"
                } else {
                    "absent"
                }
            ),
        });
    }
    if bad.is_empty() {
        Ok(s)
    } else {
        Err(TrainError::Checkpoint {
            path: path.display().to_string(),
            msg: format!(
                "{} of {} checkpoints do not match their manifest:\n{s}",
                bad.len(),
                dirs.len()
            ),
        })
    }
}
