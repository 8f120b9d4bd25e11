//! Saving a checkpoint from a running job (Megatron's `save_checkpoint`, fully parallel):
//! every rank writes the pieces it owns, synchronously or on a background thread
//! (`--async-save`), then rank 0 writes the manifest last and moves the checkpoint into place.

use crate::arguments::OptimizerKind;
use crate::checkpoint_policy::{Retention, SaveTarget};
use crate::checkpointing::{
    ckpt_err, iteration_dir, partial_dir, write_synced, CheckpointMeta, FORMAT, MANIFEST, TRACKER,
};
use crate::dist_checkpointing::{
    merge_fragments, write_rank_shard, Blob, CheckpointReader, PieceSrc, SavedLayout,
};
use crate::{io_err, TrainError};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Instant;

impl<F: crate::family::TrainFamily> crate::training::Trainer<'_, F> {
    /// The pieces this rank writes: its shards of every parameter and both moments that no
    /// other rank writes (TP-replicated tensors by TP rank 0, copies owned by another stage never,
    /// DP-replicated state split over the DP ranks, distributed state as its shards).
    fn checkpoint_pieces(&self) -> Vec<PieceSrc<'_>> {
        let (dp_rank, dp) = self.comms.dp_rank_size();
        let tp_rank = self.comms.tp.rank();
        let mut out = Vec::new();
        let moments = !self.cfg.args.no_save_optim;
        for p in self.optimizer.state_pieces(&self.params, dp_rank, dp) {
            let m = &self.params.metas[p.param];
            if m.shared || (m.tp_replicated && tp_rank != 0) {
                continue;
            }
            for segment in m.global_segments(p.local.clone(), m.tp_rank) {
                let mut state = vec![(m.name.clone(), Cow::Borrowed(p.value))];
                // --no-save-optim: the parameters alone.
                if moments {
                    state.extend(p.moments.iter().map(|(k, data)| {
                        (format!("optimizer.{}.{}", k.name(), m.name), data.clone())
                    }));
                }
                for (tensor, data) in state {
                    let shape = m.shape.clone();
                    let base = p.local.start;
                    out.push(PieceSrc {
                        tensor,
                        shape,
                        segment,
                        data,
                        base,
                    });
                }
            }
        }
        for (name, values) in &self.buffer_snapshot {
            let n = values.len();
            out.push(PieceSrc {
                tensor: name.clone(),
                shape: vec![n],
                segment: megatron_core::params::GlobalSegment {
                    row: 0,
                    col: 0,
                    rows: 1,
                    cols: n,
                    local_start: 0,
                    local_stride: n,
                },
                data: Cow::Borrowed(values),
                base: 0,
            });
        }
        out
    }

    /// Copies the model's buffers to write with this save (their writer only).
    fn snapshot_buffers(&mut self) {
        let writer = self.comms.dp_rank_size().0 == 0 && self.comms.tp.rank() == 0;
        self.buffer_snapshot = if writer {
            use megatron_core::models::ModelChunk;
            self.chunks.iter().flat_map(|c| c.buffers()).collect()
        } else {
            Vec::new()
        };
    }

    fn checkpoint_meta(
        &self,
        iteration: u64,
        tok: &dyn megatron_data::Tokenizer,
    ) -> CheckpointMeta {
        let (a, cfg) = (&self.cfg.args, self.cfg);
        CheckpointMeta {
            format: FORMAT.into(),
            iteration,
            consumed_train_samples: self.consumed,
            consumed_valid_samples: Some(self.consumed_valid),
            scheduler: self.sched.clone(),
            optimizer_step: self.optimizer.step_count(),
            grad_scaler: self.scaler.clone(),
            optimizer: self.optimizer.name().into(),
            adam_beta1: a.adam_beta1,
            adam_beta2: a.adam_beta2,
            adam_eps: a.adam_eps,
            weight_decay: Some(a.weight_decay),
            seed: a.seed,
            model: cfg.model.clone(),
            tokenizer_type: tok.name().to_string(),
            vocab_size: a.tokenizer.vocab_size.unwrap_or(tok.vocab_size()),
            vocab_file: recorded_path(&a.tokenizer.vocab_file),
            merge_file: recorded_path(&a.tokenizer.merge_file),
            tokenizer_model: recorded_path(&a.tokenizer.tokenizer_model),
            vocab_extra_ids: a.tokenizer.vocab_extra_ids,
            tiktoken: a.tokenizer.tiktoken(),
            tensors: Vec::new(),
            shard_bytes: 0,
            files: Vec::new(),
            layout: Some(SavedLayout {
                world: cfg.world(),
                tensor_model_parallel: cfg.tp,
                pipeline_model_parallel: cfg.pp,
                virtual_pipeline: cfg.partition.v,
                data_parallel: cfg.dp,
                distributed_optimizer: cfg.optimizer == OptimizerKind::Distributed,
            }),
            bert: F::bert_heads(self.cfg),
            t5: F::t5_stacks(self.cfg),
            hf_buffers: Vec::new(),
        }
    }

    /// Every rank checks at start-up that it can write its shards under `--save`, so a
    /// directory that cannot be written stops the run before it trains, not at its first
    /// save hours later (every rank writes its own shards; under MPI each may see another
    /// file system).
    pub(crate) fn check_save_dir(&mut self, dir: &Path) -> Result<(), TrainError> {
        let rank = self.comms.world_rank;
        let probe = dir.join(format!(".write_check.rank{rank}"));
        let checked = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&probe, b"megatron-rs"))
            .and_then(|()| std::fs::remove_file(&probe));
        let failed = checked.as_ref().err().map(|e| e.to_string());
        if self.comms.world_max(f32::from(failed.is_some()))? > 0.0 {
            let why = failed.unwrap_or_else(|| "another rank cannot write there".into());
            return Err(TrainError::Args(format!(
                "--save {}: cannot write checkpoints there ({why}); nothing was trained",
                dir.display()
            )));
        }
        Ok(())
    }

    /// Rank 0 prepares `iter_NNNNNNN.partial`, every rank learns whether it could.
    fn begin_save(&mut self, dir: &Path, iteration: u64) -> Result<PathBuf, TrainError> {
        let rank = self.comms.world_rank;
        let partial = partial_dir(dir, iteration);
        let mut failed = None;
        if rank == 0 {
            let prepare = || -> Result<(), TrainError> {
                std::fs::create_dir_all(dir).map_err(io_err(dir))?;
                if partial.exists() {
                    std::fs::remove_dir_all(&partial).map_err(io_err(&partial))?;
                }
                std::fs::create_dir_all(&partial).map_err(io_err(&partial))
            };
            failed = prepare().err();
        }
        if self.comms.world_max(f32::from(failed.is_some()))? > 0.0 {
            return Err(failed.unwrap_or_else(|| ckpt_err(&partial, "rank 0 could not prepare it")));
        }
        Ok(partial)
    }

    /// Once every rank has written (or failed to): rank 0 merges the fragments into the
    /// manifest, renames the directory into place, updates the tracker and deletes what the
    /// directory's [`Retention`] no longer keeps. Every rank takes part; the directory is
    /// returned on rank 0.
    fn finish_save(
        &mut self,
        target: SaveTarget<'_>,
        partial: &Path,
        meta: Option<CheckpointMeta>,
        written: Result<(), TrainError>,
    ) -> Result<Option<PathBuf>, TrainError> {
        let world = self.cfg.world();
        let rank = self.comms.world_rank;
        let mut failed = written.err();
        if self.comms.world_max(f32::from(failed.is_some()))? > 0.0 {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(partial);
            }
            return Err(failed.unwrap_or_else(|| {
                ckpt_err(
                    partial,
                    "another rank failed to write its shard; nothing was marked saved",
                )
            }));
        }
        let mut done = None;
        if let (0, Some(meta)) = (rank, meta) {
            let (dir, iteration) = (target.dir, meta.iteration);
            let previous = tracked_iteration(dir);
            let done_and_retained = finalize(dir, partial, meta, world)
                .and_then(|p| retain(dir, &p, iteration, previous, target.retention).map(|_| p));
            match done_and_retained {
                Ok(p) => done = Some(p),
                Err(e) => failed = Some(e),
            }
        }
        if self.comms.world_max(f32::from(failed.is_some()))? > 0.0 {
            return Err(failed.unwrap_or_else(|| ckpt_err(partial, "rank 0 could not finish it")));
        }
        Ok(done)
    }

    /// Saves iteration `iteration` under `dir`, synchronously or (`--async-save`) by handing
    /// copies of this rank's pieces to a background writer (a save still in flight is finished
    /// first: at most one at a time). Every rank takes part. Returns what to report.
    pub(crate) fn save_checkpoint(
        &mut self,
        target: SaveTarget<'_>,
        iteration: u64,
        tok: &dyn megatron_data::Tokenizer,
    ) -> Result<Vec<String>, TrainError> {
        let mut report = self.finish_pending_save(true)?;
        let started = Instant::now();
        let partial = self.begin_save(target.dir, iteration)?;
        let meta = (self.comms.world_rank == 0).then(|| self.checkpoint_meta(iteration, tok));
        let rank = self.comms.world_rank;
        self.snapshot_buffers();
        if self.cfg.args.async_save {
            // Copies of this rank's pieces (the staging buffers); training goes on.
            let mut pool = std::mem::take(&mut self.staging).into_iter();
            let blobs: Vec<Blob> = self
                .checkpoint_pieces()
                .iter()
                .map(|p| Blob::copy_of(p, pool.next()))
                .collect();
            drop(pool);
            let bytes: usize = blobs.iter().map(|b| b.data.len() * 4).sum();
            let p = partial.clone();
            let slot = megatron_tensor::alloc::current_slot();
            let handle = std::thread::Builder::new()
                .name(format!("ckpt-writer-{rank}"))
                .spawn(move || {
                    megatron_tensor::alloc::set_slot(slot);
                    let srcs: Vec<PieceSrc> = blobs.iter().map(Blob::as_src).collect();
                    write_rank_shard(&p, rank, &srcs)?;
                    drop(srcs);
                    // The buffers go back to the trainer for the next save.
                    Ok(blobs.into_iter().map(|b| b.data).collect())
                })
                .map_err(|e| ckpt_err(&partial, format!("cannot start the writer thread: {e}")))?;
            self.pending_save = Some(PendingSave {
                dir: target.dir.to_path_buf(),
                retention: target.retention,
                partial,
                iteration,
                meta,
                handle,
                started,
                bytes,
            });
            if rank == 0 {
                report.push(format!(
                    " checkpoint of iteration {iteration} handed to the background writer ({:.3} s stall)",
                    started.elapsed().as_secs_f64()
                ));
            }
            return Ok(report);
        }
        let pieces = self.checkpoint_pieces();
        let bytes: usize = pieces
            .iter()
            .map(|p| p.segment.rows * p.segment.cols * 4)
            .sum();
        let written = write_rank_shard(&partial, rank, &pieces);
        drop(pieces);
        if let Some(path) = self.finish_save(target, &partial, meta, written)? {
            report.push(saved_line(iteration, &path, started, bytes));
            self.last_checkpoint = Some(path);
        }
        Ok(report)
    }

    /// `--async-save`: allocates and touches the staging buffers before training, so the first
    /// save's stall is a copy, not a first touch of fresh pages.
    pub(crate) fn prepare_async_staging(&mut self) {
        let staged: Vec<Vec<f32>> = self
            .checkpoint_pieces()
            .iter()
            .map(|p| Blob::copy_of(p, None).data)
            .collect();
        self.staging = staged;
    }

    /// Finishes a background save once every rank's writer is done: `wait` blocks for it (a new
    /// save, the end of the run); otherwise it only finishes when all writers already are (a
    /// cheap check every iteration). A failed background save is reported and never marked
    /// latest; training goes on.
    pub(crate) fn finish_pending_save(&mut self, wait: bool) -> Result<Vec<String>, TrainError> {
        let Some(p) = &self.pending_save else {
            return Ok(Vec::new());
        };
        if !wait {
            let busy = f32::from(!p.handle.is_finished());
            if self.comms.world_max(busy)? > 0.0 {
                return Ok(Vec::new());
            }
        }
        let p = self.pending_save.take().expect("checked above");
        let written = match p.handle.join() {
            Ok(Ok(buffers)) => {
                self.staging = buffers;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ckpt_err(&p.partial, "the background writer panicked")),
        };
        let target = SaveTarget {
            dir: &p.dir,
            retention: p.retention,
        };
        match self.finish_save(target, &p.partial, p.meta, written) {
            Ok(Some(path)) => {
                let line = saved_line(p.iteration, &path, p.started, p.bytes);
                self.last_checkpoint = Some(path);
                Ok(vec![line + " in the background"])
            }
            Ok(None) => Ok(Vec::new()),
            Err(e) => Ok(vec![format!(
                " background save of iteration {} failed, not marked latest: {e}",
                p.iteration
            )]),
        }
    }
}

/// A save whose pieces a background thread is writing (`--async-save`).
pub(crate) struct PendingSave {
    dir: PathBuf,
    retention: Retention,
    partial: PathBuf,
    iteration: u64,
    /// Rank 0: the manifest's contents as of the save.
    meta: Option<CheckpointMeta>,
    handle: std::thread::JoinHandle<Result<Vec<Vec<f32>>, TrainError>>,
    started: Instant,
    bytes: usize,
}

fn saved_line(iteration: u64, path: &Path, started: Instant, bytes: usize) -> String {
    let secs = started.elapsed().as_secs_f64();
    format!(
        " saved checkpoint at iteration {iteration} to {} ({:.2} s; this rank wrote {:.1} MB, {:.2} GB/s)",
        path.display(),
        secs,
        bytes as f64 / 1e6,
        bytes as f64 / secs / 1e9
    )
}

/// Rank 0: the manifest from the ranks' fragments, written last; then the rename into place
/// and the tracker, each atomic.
pub(crate) fn finalize(
    save: &Path,
    partial: &Path,
    mut meta: CheckpointMeta,
    world: usize,
) -> Result<PathBuf, TrainError> {
    let (tensors, files) = merge_fragments(partial, world)?;
    meta.tensors = tensors;
    meta.files = files;
    let manifest = partial.join(MANIFEST);
    let json =
        serde_json::to_string_pretty(&meta).map_err(|e| ckpt_err(&manifest, e.to_string()))?;
    write_synced(&manifest, json.as_bytes())?;
    publish(save, partial, meta.iteration)
}

/// Moves a complete `partial` directory into place as iteration `iteration`, then points the
/// tracker at it; each step atomic, so a crash leaves either the old or the new checkpoint.
pub(crate) fn publish(save: &Path, partial: &Path, iteration: u64) -> Result<PathBuf, TrainError> {
    let final_dir = iteration_dir(save, iteration);
    if final_dir.exists() {
        // A checkpoint of the same iteration from an earlier run: replaced only now that the new
        // one is complete.
        std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
    }
    std::fs::rename(partial, &final_dir).map_err(io_err(&final_dir))?;
    if let Ok(d) = std::fs::File::open(save) {
        let _ = d.sync_all();
    }
    let tracker_tmp = save.join(format!(".{TRACKER}.tmp"));
    write_synced(&tracker_tmp, format!("{iteration}\n").as_bytes())?;
    let tracker = save.join(TRACKER);
    std::fs::rename(&tracker_tmp, &tracker).map_err(io_err(&tracker))?;
    Ok(final_dir)
}

/// The iteration the tracker under `save` names, if any (before a save replaces it).
fn tracked_iteration(save: &Path) -> Option<u64> {
    std::fs::read_to_string(save.join(TRACKER))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Once `newest` (iteration `iteration`) is complete and verified, deletes what `retention`
/// no longer keeps: the checkpoint the tracker named before (`previous`) unless its iteration
/// is a multiple of `--save-retain-interval` or it is a symbolic link (Megatron's rule), and
/// complete checkpoints older than the `--ckpt-keep-last` newest. Incomplete directories are
/// left for a person to look at.
fn retain(
    save: &Path,
    newest: &Path,
    iteration: u64,
    previous: Option<u64>,
    retention: Retention,
) -> Result<(), TrainError> {
    let stale = retention.retain_interval.and_then(|every| {
        previous.filter(|&p| p > 0 && p != iteration && !p.is_multiple_of(every))
    });
    if retention.keep_last == 0 && stale.is_none() {
        return Ok(());
    }
    CheckpointReader::open(newest)?.verify()?;
    if let Some(p) = stale {
        let dir = iteration_dir(save, p);
        let linked = std::fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_symlink());
        if dir.exists() && !linked {
            std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
    }
    if retention.keep_last == 0 {
        return Ok(());
    }
    let mut complete: Vec<(u64, PathBuf)> = std::fs::read_dir(save)
        .map_err(io_err(save))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let it = name.strip_prefix("iter_")?.parse::<u64>().ok()?;
            e.path().join(MANIFEST).exists().then(|| (it, e.path()))
        })
        .collect();
    complete.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
    for (_, dir) in complete.into_iter().skip(retention.keep_last) {
        std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    }
    Ok(())
}

/// A tokenizer file as the checkpoint records it: absolute, so `generate`, `embed` and
/// `convert` find it from any directory (a relative `--tokenizer-model` named a file only from
/// where training ran); as given where it cannot be resolved.
fn recorded_path(p: &Option<String>) -> Option<String> {
    p.as_ref()
        .map(|p| std::fs::canonicalize(p).map_or_else(|_| p.clone(), |a| a.display().to_string()))
}
