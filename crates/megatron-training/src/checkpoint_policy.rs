//! Megatron's checkpoint flags around `--save` and `--load`, settled once from the flags: which
//! checkpoint a run starts from (`--ckpt-step`, `--pretrained-checkpoint`,
//! `--exit-on-missing-checkpoint`, non-persistent checkpoints) and which checkpoints a save
//! directory keeps (`--ckpt-keep-last`, `--save-retain-interval`,
//! `--non-persistent-save-interval`).
//!
//! A `--load` directory with nothing in it starts the run from random initialization, as
//! Megatron does, because its launch scripts pass the same directory to `--save` and `--load`
//! from the first launch on. A directory where checkpoints were published but none is complete
//! any more is an error instead: starting over there would silently throw a run away.

use crate::arguments::{NonPersistentCkptTypeArg, TrainArgs};
use crate::checkpointing::{iteration_dir, open_verified, search_checkpoints, Search};
use crate::dist_checkpointing::CheckpointReader;
use crate::TrainError;
use std::path::{Path, PathBuf};

/// Megatron's directory of non-persistent checkpoints under `--save` (and `--load`).
const NON_PERSISTENT_SUBDIR: &str = "non_persistent";

/// What `--load` does where it finds no checkpoint at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissingCheckpoint {
    /// Megatron's default: a warning, then training from random initialization.
    #[default]
    StartFromRandom,
    /// `--exit-on-missing-checkpoint`: an error naming the directory.
    Exit,
}

/// How a loaded checkpoint starts the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMode {
    /// The iteration, consumed samples, schedule and optimizer state continue.
    Resume,
    /// The weights only, at iteration 0 (`--finetune`, or a `--pretrained-checkpoint`).
    Finetune,
}

/// Which checkpoints a save directory keeps once a newer one is complete and verified.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    /// `--ckpt-keep-last`: the N newest complete ones (0 keeps all).
    pub keep_last: usize,
    /// `--save-retain-interval`: the checkpoint the tracker named before the new one is
    /// deleted unless its iteration is a multiple of this (Megatron's rule).
    pub retain_interval: Option<u64>,
}

/// Where `--load` looks, in order.
#[derive(Clone, Debug, Default)]
pub struct LoadSettings {
    dir: Option<PathBuf>,
    /// `--ckpt-step`: exactly this iteration under `dir`.
    step: Option<u64>,
    /// `--pretrained-checkpoint`: where `dir` holds nothing.
    pretrained: Option<PathBuf>,
    missing: MissingCheckpoint,
    /// Non-persistent checkpoints to prefer where at least as new as `dir`'s.
    non_persistent: Option<PathBuf>,
    /// `--finetune`.
    finetune: bool,
}

/// Where and when checkpoints are saved.
#[derive(Clone, Debug)]
pub struct SaveSettings {
    pub dir: PathBuf,
    /// `--save-interval`.
    pub interval: Option<u64>,
    pub retention: Retention,
    /// `--non-persistent-save-interval`: the directory and the interval.
    pub non_persistent: Option<(PathBuf, u64)>,
}

/// One save: where it goes and what that directory keeps.
#[derive(Clone, Copy, Debug)]
pub struct SaveTarget<'a> {
    pub dir: &'a Path,
    pub retention: Retention,
}

/// The checkpoint flags of a run.
#[derive(Clone, Debug, Default)]
pub struct CheckpointSettings {
    pub load: LoadSettings,
    pub save: Option<SaveSettings>,
}

/// The checkpoint a run starts from.
pub struct LoadChoice {
    pub reader: CheckpointReader,
    pub mode: LoadMode,
}

fn bad(msg: String) -> TrainError {
    TrainError::Args(msg)
}

impl CheckpointSettings {
    /// Validates the checkpoint flags together.
    pub fn from_args(a: &TrainArgs) -> Result<Self, TrainError> {
        let non_persistent = match (a.non_persistent_ckpt_type, a.non_persistent_save_interval) {
            (Some(NonPersistentCkptTypeArg::Local | NonPersistentCkptTypeArg::InMemory), _) => {
                return Err(bad(format!(
                    "--non-persistent-ckpt-type {}: megatron-rs writes non-persistent checkpoints as `global` ones only (a checkpoint directory like --save's, each rank writing its own shards)",
                    match a.non_persistent_ckpt_type {
                        Some(NonPersistentCkptTypeArg::InMemory) => "in_memory",
                        _ => "local",
                    }
                )))
            }
            (Some(NonPersistentCkptTypeArg::Global), _) | (None, Some(_)) => true,
            (None, None) => false,
        };
        if a.non_persistent_global_ckpt_dir.is_some() && !non_persistent {
            return Err(bad(
                "--non-persistent-global-ckpt-dir needs --non-persistent-ckpt-type global or --non-persistent-save-interval N".into(),
            ));
        }
        let np_dir = |base: &Option<String>| -> Option<PathBuf> {
            non_persistent.then_some(())?;
            a.non_persistent_global_ckpt_dir
                .as_ref()
                .map(PathBuf::from)
                .or_else(|| {
                    base.as_ref()
                        .map(|b| Path::new(b).join(NON_PERSISTENT_SUBDIR))
                })
        };
        if a.ckpt_step.is_some() && a.load.is_none() {
            return Err(bad("--ckpt-step needs --load DIR".into()));
        }
        if a.exit_on_missing_checkpoint && a.load.is_none() {
            return Err(bad("--exit-on-missing-checkpoint needs --load DIR".into()));
        }
        let load = LoadSettings {
            dir: a.load.as_ref().map(PathBuf::from),
            step: a.ckpt_step,
            pretrained: a.pretrained_checkpoint.as_ref().map(PathBuf::from),
            missing: if a.exit_on_missing_checkpoint {
                MissingCheckpoint::Exit
            } else {
                MissingCheckpoint::StartFromRandom
            },
            non_persistent: np_dir(&a.load),
            finetune: a.finetune,
        };
        for (flag, v) in [
            ("--save-interval", a.save_interval),
            ("--save-retain-interval", a.save_retain_interval),
            (
                "--non-persistent-save-interval",
                a.non_persistent_save_interval,
            ),
        ] {
            if v == Some(0) {
                return Err(bad(format!("{flag} must be positive, got 0")));
            }
            if v.is_some() && a.save.is_none() {
                return Err(bad(format!("{flag} needs --save DIR")));
            }
        }
        if let Some(r) = a.save_retain_interval {
            match a.save_interval {
                Some(s) if r.is_multiple_of(s) => {}
                Some(s) => {
                    return Err(bad(format!(
                        "--save-retain-interval ({r}) must be a multiple of --save-interval ({s})"
                    )))
                }
                None => return Err(bad("--save-retain-interval needs --save-interval N".into())),
            }
        }
        let save = a.save.as_ref().map(|dir| SaveSettings {
            dir: PathBuf::from(dir),
            interval: a.save_interval,
            retention: Retention {
                keep_last: a.ckpt_keep_last,
                retain_interval: a.save_retain_interval,
            },
            non_persistent: a
                .non_persistent_save_interval
                .and_then(|n| Some((np_dir(&a.save)?, n))),
        });
        Ok(CheckpointSettings { load, save })
    }
}

impl SaveSettings {
    /// The save due after `iteration`, if any: a persistent one every `--save-interval` and
    /// where `forced` (the last iteration, an exit), otherwise a non-persistent one every
    /// `--non-persistent-save-interval` (Megatron's order), which keeps only its newest.
    pub fn target(&self, iteration: u64, forced: bool) -> Option<SaveTarget<'_>> {
        if forced || self.interval.is_some_and(|s| iteration.is_multiple_of(s)) {
            return Some(SaveTarget {
                dir: &self.dir,
                retention: self.retention,
            });
        }
        let (dir, every) = self.non_persistent.as_ref()?;
        iteration.is_multiple_of(*every).then_some(SaveTarget {
            dir,
            retention: Retention {
                keep_last: 1,
                retain_interval: None,
            },
        })
    }

    /// Every directory this run may save into (each is checked for writing at start-up).
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(self.dir.as_path())
            .chain(self.non_persistent.iter().map(|(d, _)| d.as_path()))
    }
}

impl LoadSettings {
    /// Whether any flag asks for a checkpoint (`--load` or `--pretrained-checkpoint`).
    pub fn is_set(&self) -> bool {
        self.dir.is_some() || self.pretrained.is_some()
    }

    /// The checkpoint the run starts from, or `None` to start from random initialization:
    /// `--ckpt-step`'s iteration; else the newest complete one under `--load`, or the newest
    /// non-persistent one where it is at least as new; else, where `--load` holds nothing,
    /// `--pretrained-checkpoint`'s (weights only), or nothing (an error under
    /// `--exit-on-missing-checkpoint`). `report`: print what was chosen and why.
    pub fn resolve(&self, report: bool) -> Result<Option<LoadChoice>, TrainError> {
        let resume = if self.finetune {
            LoadMode::Finetune
        } else {
            LoadMode::Resume
        };
        let mut nothing = None;
        if let Some(dir) = &self.dir {
            if let Some(step) = self.step {
                let at = iteration_dir(dir, step);
                if !at.exists() {
                    return Err(bad(format!(
                        "--ckpt-step {step}: there is no {} (iterations saved under --load: {})",
                        at.display(),
                        saved_iterations(dir)
                    )));
                }
                let reader = open_verified(&at).map_err(|e| {
                    bad(format!(
                        "--ckpt-step {step}: iteration {step} under --load {} cannot be loaded: {e}",
                        dir.display()
                    ))
                })?;
                return Ok(Some(LoadChoice {
                    reader,
                    mode: resume,
                }));
            }
            let persistent = search_checkpoints(dir, report)?;
            let newest = match &persistent {
                Search::Found(r) => Some(r.meta.iteration),
                _ => None,
            };
            if let Some(reader) = self.non_persistent_checkpoint(newest, report)? {
                return Ok(Some(LoadChoice {
                    reader,
                    mode: resume,
                }));
            }
            match persistent {
                Search::Found(reader) => {
                    return Ok(Some(LoadChoice {
                        reader: *reader,
                        mode: resume,
                    }))
                }
                Search::Broken(e) => return Err(e),
                Search::Nothing(why) => nothing = Some((dir, why)),
            }
        }
        if let Some(p) = &self.pretrained {
            return match search_checkpoints(p, report)? {
                Search::Found(reader) => {
                    let reader = *reader;
                    if let (true, Some((dir, why))) = (report, &nothing) {
                        println!(
                            "no checkpoint under --load {} ({why}): starting a new run from the weights of --pretrained-checkpoint {}",
                            dir.display(),
                            p.display()
                        );
                    }
                    Ok(Some(LoadChoice {
                        reader,
                        mode: LoadMode::Finetune,
                    }))
                }
                Search::Nothing(why) => Err(bad(format!(
                    "--pretrained-checkpoint {}: no checkpoint there ({why}){}",
                    p.display(),
                    nothing
                        .map(|(d, _)| format!(", and none under --load {}", d.display()))
                        .unwrap_or_default()
                ))),
                Search::Broken(e) => Err(e),
            };
        }
        let Some((dir, why)) = nothing else {
            return Ok(None);
        };
        match self.missing {
            MissingCheckpoint::Exit => Err(TrainError::Checkpoint {
                path: dir.display().to_string(),
                msg: format!("--exit-on-missing-checkpoint: no checkpoint to load ({why})"),
            }),
            MissingCheckpoint::StartFromRandom => {
                if report {
                    println!(
                        "WARNING: no checkpoint under --load {} ({why}): training starts from random initialization (--exit-on-missing-checkpoint stops instead)",
                        dir.display()
                    );
                }
                Ok(None)
            }
        }
    }

    /// The newest non-persistent checkpoint, where there is one at least as new as the newest
    /// persistent one (`newest`). One that cannot be read is reported and passed over.
    fn non_persistent_checkpoint(
        &self,
        newest: Option<u64>,
        report: bool,
    ) -> Result<Option<CheckpointReader>, TrainError> {
        let Some(dir) = &self.non_persistent else {
            return Ok(None);
        };
        match search_checkpoints(dir, report)? {
            Search::Found(r) if newest.is_none_or(|p| r.meta.iteration >= p) => {
                if report {
                    println!(
                        "loading the non-persistent checkpoint of iteration {} from {}",
                        r.meta.iteration,
                        dir.display()
                    );
                }
                Ok(Some(*r))
            }
            Search::Found(r) => {
                if report {
                    println!(
                        "non-persistent checkpoint of iteration {} is older than the persistent one; not used",
                        r.meta.iteration
                    );
                }
                Ok(None)
            }
            Search::Broken(e) => {
                if report {
                    eprintln!("non-persistent checkpoints not used: {e}");
                }
                Ok(None)
            }
            Search::Nothing(_) => Ok(None),
        }
    }
}

/// The iterations of the `iter_NNNNNNN` directories under `dir`, in words (for errors).
fn saved_iterations(dir: &Path) -> String {
    let mut its: Vec<u64> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|n| n.strip_prefix("iter_")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    its.sort_unstable();
    if its.is_empty() {
        return "none".into();
    }
    its.iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
