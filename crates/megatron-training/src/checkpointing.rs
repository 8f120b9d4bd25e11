//! Checkpoints in Megatron's directory layout: `<save>/latest_checkpointed_iteration.txt` and
//! `<save>/iter_0000100/` holding one `shard_NNNNN.safetensors` per writing rank and the
//! manifest `metadata.json` (format `megatron-rs/2`; the pieces themselves are described in
//! `dist_checkpointing`). `megatron-rs/1` checkpoints (one whole-tensor file) still load.
//!
//! Every rank writes its pieces into `iter_NNNNNNN.partial/`; rank 0 writes the manifest (every
//! tensor's pieces, every file's size and crc32c) last, renames the directory into place and
//! only then replaces the tracker, atomically. A crash therefore never leaves a checkpoint that
//! looks complete and never damages the previous one; `--load` skips, naming them, checkpoints
//! that are incomplete or whose files do not match their manifest, and resumes from the newest
//! complete one at or below the tracker's iteration.

use crate::arguments::TrainConfig;
use crate::dist_checkpointing::{CheckpointReader, FileEntry, Piece, SavedLayout};
use crate::{io_err, TrainError};
use megatron_core::models::ModelChunk;
use megatron_core::optimizer::{Adam, Moment, OptimizerParamScheduler};
use megatron_core::params::view2d;
use megatron_core::{Params, TransformerConfig};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
const V1_SHARD: &str = "model_optim_rng.safetensors";
pub(crate) const MANIFEST: &str = "metadata.json";
const FORMAT_V1: &str = "megatron-rs/1";
pub const FORMAT: &str = "megatron-rs/2";

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    /// Global shape.
    pub shape: Vec<usize>,
    pub dtype: String,
    /// `megatron-rs/1`: the file holding the whole tensor.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub file: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub global_offset: Vec<usize>,
    /// The rectangles it is stored as, which together cover it exactly once.
    #[serde(default)]
    pub pieces: Vec<Piece>,
}

fn adam() -> String {
    "adam".into()
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct CheckpointMeta {
    pub format: String,
    pub iteration: u64,
    pub consumed_train_samples: u64,
    /// Validation samples the run's evaluations have read (Megatron's `consumed_valid_samples`):
    /// each evaluation reads the next ones. Older checkpoints: computed from the iteration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumed_valid_samples: Option<u64>,
    pub scheduler: OptimizerParamScheduler,
    pub optimizer_step: u64,
    /// The loss scaler after the saved step (fp16 and `--loss-scale` runs): a dynamic
    /// scaler's scale and trackers are optimizer state, as Megatron's `grad_scaler` entry is,
    /// so a resumed fp16 run skips the steps the uninterrupted one skips. Older checkpoints
    /// and bf16/fp32 runs have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_scaler: Option<megatron_core::optimizer::GradScaler>,
    /// `--optimizer` of the run that saved it (megatron-core's name; older checkpoints: adam).
    #[serde(default = "adam")]
    pub optimizer: String,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_eps: f32,
    /// The run's `--weight-decay` (decoupled): an export of the optimizer state writes it in
    /// Megatron-LM's parameter groups, as Megatron-LM saves them. Older checkpoints: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f32>,
    /// The run's seed: every random stream (dropout, data order) is counter-based, derived from
    /// it, the iteration and the global sample, so it is the whole RNG state of every rank and
    /// restores under any layout.
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
    /// `--vocab-extra-ids`: the sentinels the tokenizer appends, part of the vocabulary.
    #[serde(default)]
    pub vocab_extra_ids: usize,
    /// TikTokenizer's pattern and special tokens.
    #[serde(default)]
    pub tiktoken: Option<megatron_data::tiktoken_tokenizer::TiktokenOptions>,
    pub tensors: Vec<TensorEntry>,
    /// `megatron-rs/1`: the size of its one file.
    #[serde(default)]
    pub shard_bytes: u64,
    /// Every file, with its size and crc32c.
    #[serde(default)]
    pub files: Vec<FileEntry>,
    #[serde(default)]
    pub layout: Option<SavedLayout>,
    /// A BERT: its segments and heads (`model` is then its encoder's config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bert: Option<megatron_core::models::bert::BertHeads>,
    /// A T5: its stacks (`model` is then the layers' config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t5: Option<megatron_core::models::t5::T5Stacks>,
    /// Integer buffers of a converted Hugging Face file that are not parameters (older
    /// BERT files' `embeddings.position_ids`), kept so the export writes the same file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hf_buffers: Vec<HfBuffer>,
}

impl CheckpointMeta {
    /// The tokenizer the run trained with, as its flags recorded it.
    pub fn tokenizer_spec(&self) -> megatron_data::TokenizerSpec {
        megatron_data::TokenizerSpec {
            tokenizer_type: self.tokenizer_type.clone(),
            vocab_file: self.vocab_file.clone(),
            merge_file: self.merge_file.clone(),
            tokenizer_model: self.tokenizer_model.clone(),
            vocab_size: Some(self.vocab_size),
            vocab_extra_ids: self.vocab_extra_ids,
            tiktoken: self.tiktoken.clone(),
        }
    }

    /// The model's real vocabulary rows (the rest of `padded_vocab_size` is padding): the
    /// tokenizer's size where it can be built, which is not `vocab_size` everywhere — a
    /// NullTokenizer's end-of-document id is one past the `--vocab-size` recorded, and a
    /// `--vocab-size` given beside a tokenizer with its own vocabulary is recorded as given.
    pub fn vocab_rows(&self) -> usize {
        let tok = megatron_data::build_tokenizer_from(&self.tokenizer_spec()).ok();
        self.vocab_rows_of(tok.as_deref())
    }

    /// [`CheckpointMeta::vocab_rows`] with the tokenizer already built (`None`: it could not be).
    pub fn vocab_rows_of(&self, tok: Option<&dyn megatron_data::Tokenizer>) -> usize {
        tok.map_or(self.vocab_size, |t| t.vocab_size())
            .min(self.model.padded_vocab_size)
    }
}

/// An `I64` tensor of a Hugging Face file kept as it was.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct HfBuffer {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<i64>,
}

/// What a converted model records beside its transformer config.
#[derive(Clone, Debug, Default)]
pub struct ConvertedExtras {
    pub bert: Option<megatron_core::models::bert::BertHeads>,
    pub t5: Option<megatron_core::models::t5::T5Stacks>,
    pub hf_buffers: Vec<HfBuffer>,
}

pub fn iteration_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

pub(crate) fn partial_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}.partial"))
}

pub(crate) fn ckpt_err(path: &Path, msg: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// The manifest of an `iter_NNNNNNN` directory; a `megatron-rs/1` manifest is described in the
/// pieces of the current format (one piece per tensor, in its one file).
pub(crate) fn read_manifest(dir: &Path) -> Result<CheckpointMeta, TrainError> {
    let manifest = dir.join(MANIFEST);
    let json = std::fs::read_to_string(&manifest).map_err(|e| {
        ckpt_err(
            &manifest,
            format!("missing or unreadable manifest, the checkpoint is incomplete: {e}"),
        )
    })?;
    let mut meta: CheckpointMeta = serde_json::from_str(&json)
        .map_err(|e| ckpt_err(&manifest, format!("corrupt manifest: {e}")))?;
    match meta.format.as_str() {
        FORMAT => Ok(meta),
        FORMAT_V1 => {
            for t in &mut meta.tensors {
                let (r, c) = view2d(&t.shape);
                t.pieces = vec![Piece {
                    file: t.file.clone(),
                    key: t.name.clone(),
                    offset: [0, 0],
                    shape: [r, c],
                }];
            }
            meta.files = vec![FileEntry {
                file: V1_SHARD.into(),
                bytes: meta.shard_bytes,
                crc32c: None,
                rank: 0,
            }];
            Ok(meta)
        }
        other => Err(ckpt_err(
            &manifest,
            format!("format '{other}' is not '{FORMAT}' (or '{FORMAT_V1}')"),
        )),
    }
}

/// What a checkpoint directory holds, for `--load`.
pub enum Search {
    /// The newest complete checkpoint at or below the tracker's iteration.
    Found(Box<CheckpointReader>),
    /// Nothing was ever published there: no directory, or no tracker and no `iter_*`
    /// directory (a first save interrupted leaves only `iter_*.partial`). Why, in words.
    Nothing(String),
    /// Checkpoints were published there but none is complete now: each one's fault.
    Broken(TrainError),
}

/// Searches `load` for the checkpoint to resume from: the newest complete one at or below the
/// tracker's iteration (any, without a tracker). Incomplete or corrupt ones (no manifest, a
/// missing file, a size or checksum mismatch) are skipped, with a message naming them and why
/// where `report`.
pub fn search_checkpoints(load: &Path, report: bool) -> Result<Search, TrainError> {
    if !load.exists() {
        return Ok(Search::Nothing("the directory does not exist".into()));
    }
    let tracker = load.join(TRACKER);
    let bound = match std::fs::read_to_string(&tracker) {
        Ok(s) => Some(s.trim().parse::<u64>().map_err(|_| {
            ckpt_err(
                &tracker,
                format!("tracker holds '{}', not an iteration number", s.trim()),
            )
        })?),
        Err(_) => None,
    };
    let entries = std::fs::read_dir(load)
        .map_err(|e| ckpt_err(load, format!("cannot read the checkpoint directory: {e}")))?;
    let (mut all, mut partial) = (Vec::new(), 0usize);
    for name in entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
    {
        match name.strip_prefix("iter_") {
            Some(n) if n.ends_with(".partial") => partial += 1,
            Some(n) => all.extend(n.parse::<u64>().ok()),
            None => {}
        }
    }
    if bound.is_none() && all.is_empty() {
        let why = match partial {
            0 => "no tracker file and no iter_* directory".to_string(),
            n => format!("no tracker file and no complete iter_* directory ({n} interrupted save(s) left as iter_*.partial)"),
        };
        return Ok(Search::Nothing(why));
    }
    let mut iterations: Vec<u64> = all
        .into_iter()
        .filter(|i| bound.is_none_or(|b| *i <= b))
        .collect();
    iterations.sort_unstable_by(|a, b| b.cmp(a));
    let mut skipped = Vec::new();
    for it in iterations {
        let dir = iteration_dir(load, it);
        match open_verified(&dir) {
            Ok(r) => return Ok(Search::Found(Box::new(r))),
            Err(e) => {
                if report {
                    eprintln!("skipping checkpoint {}: {e}", dir.display());
                }
                skipped.push(e.to_string());
            }
        }
    }
    let why = if skipped.is_empty() {
        match bound {
            Some(b) => format!("no iter_* directory at or below the tracker's iteration {b}"),
            None => "no iter_* directory".into(),
        }
    } else {
        skipped.join("; ")
    };
    Ok(Search::Broken(ckpt_err(
        load,
        format!("no complete checkpoint to load: {why}"),
    )))
}

/// The checkpoint in `dir` (an `iter_NNNNNNN` directory), its files checked against the
/// manifest.
pub fn open_verified(dir: &Path) -> Result<CheckpointReader, TrainError> {
    CheckpointReader::open(dir).and_then(|r| r.verify().map(|_| r))
}

/// The checkpoint `--load` resumes from ([`search_checkpoints`]); an error where there is none.
pub fn find_checkpoint(load: &Path, report: bool) -> Result<CheckpointReader, TrainError> {
    match search_checkpoints(load, report)? {
        Search::Found(r) => Ok(*r),
        Search::Nothing(why) => Err(ckpt_err(
            load,
            format!("no complete checkpoint to load: {why}"),
        )),
        Search::Broken(e) => Err(e),
    }
}

pub struct LoadedCheckpoint {
    pub meta: CheckpointMeta,
    /// Whole tensors by name (parameters, and `optimizer.exp_avg.*` / `optimizer.exp_avg_sq.*`).
    pub tensors: HashMap<String, Vec<f32>>,
    pub dir: PathBuf,
}

/// Every tensor of a checkpoint, whole (for tools, tests and generation; training loads only
/// its shards): `iteration`, or the one `--load` would resume from.
pub fn load_checkpoint(
    load: &Path,
    iteration: Option<u64>,
) -> Result<LoadedCheckpoint, TrainError> {
    load_tensors(load, iteration, |_| true)
}

/// [`load_checkpoint`] without the optimizer's state: the weights only (generation, export),
/// a third of the memory.
pub fn load_checkpoint_weights(load: &Path) -> Result<LoadedCheckpoint, TrainError> {
    load_tensors(load, None, |name| !name.starts_with("optimizer."))
}

fn load_tensors(
    load: &Path,
    iteration: Option<u64>,
    keep: impl Fn(&str) -> bool,
) -> Result<LoadedCheckpoint, TrainError> {
    let mut r = match iteration {
        Some(i) => {
            let r = CheckpointReader::open(&iteration_dir(load, i))?;
            r.verify()?;
            r
        }
        None => find_checkpoint(load, false)?,
    };
    let names: Vec<String> = r
        .meta
        .tensors
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| keep(n))
        .collect();
    let mut tensors = HashMap::new();
    for n in names {
        let v = r.read_whole(&n)?;
        tensors.insert(n, v);
    }
    Ok(LoadedCheckpoint {
        meta: r.meta.clone(),
        tensors,
        dir: r.dir.clone(),
    })
}

/// Copies whole tensors into `params` and `adam` (each rank its shard), checking every name and
/// size.
pub fn restore(
    ck: &LoadedCheckpoint,
    params: &mut Params,
    adam: Option<&mut Adam>,
) -> Result<(), TrainError> {
    let get = |name: &str, numel: usize| -> Result<&Vec<f32>, TrainError> {
        let v = ck
            .tensors
            .get(name)
            .ok_or_else(|| ckpt_err(&ck.dir, format!("has no tensor {name}")))?;
        if v.len() != numel {
            return Err(ckpt_err(
                &ck.dir,
                format!(
                    "tensor {name} has {} elements, the model needs {numel}",
                    v.len()
                ),
            ));
        }
        Ok(v)
    };
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

/// Restores `model`'s buffers (router expert biases) from a whole-tensor checkpoint; a
/// checkpoint without them leaves them at their start.
pub fn restore_buffers(ck: &LoadedCheckpoint, model: &impl ModelChunk) {
    for (name, _) in model.buffers() {
        if let Some(v) = ck.tensors.get(&name) {
            model.load_buffer(&name, v);
        }
    }
}

/// The fields in which two model configurations differ, as `name: A in the checkpoint, B from
/// the flags`: the whole configurations printed side by side hide the one field that differs
/// among thirty.
pub(crate) fn config_differences(saved: &TransformerConfig, given: &TransformerConfig) -> String {
    fn flatten(prefix: &str, v: serde_json::Value, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let name = if prefix.is_empty() {
                        k
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flatten(&name, v, out);
                }
            }
            v => out.push((prefix.to_string(), v.to_string())),
        }
    }
    let fields = |c: &TransformerConfig| {
        let mut out = Vec::new();
        flatten("", serde_json::to_value(c).unwrap_or_default(), &mut out);
        out.into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (a, b) = (fields(saved), fields(given));
    let absent = "absent".to_string();
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let diffs: Vec<String> = names
        .into_iter()
        .filter_map(|k| {
            let (x, y) = (a.get(k).unwrap_or(&absent), b.get(k).unwrap_or(&absent));
            (x != y).then(|| format!("{k}: {x} in the checkpoint, {y} from the flags"))
        })
        .collect();
    if diffs.is_empty() {
        // Equal as JSON but not as values (a float that prints the same): show both.
        format!("{saved:?}; the flags give {given:?}")
    } else {
        diffs.join("; ")
    }
}

/// Whether `saved` differs from `given` only in its experts' biases, which a checkpoint saved
/// before this engine built them lacks on a model with linear biases.
fn predates_moe_biases(saved: &TransformerConfig, given: &TransformerConfig) -> bool {
    let mut old = saved.clone();
    match (&mut old.moe, &given.moe) {
        (Some(s), Some(g)) if !s.biases && g.biases && saved.add_bias_linear => {
            s.biases = true;
            old == *given
        }
        _ => false,
    }
}

/// `--load`: refuses a checkpoint (chosen by [`crate::checkpoint_policy::LoadSettings::resolve`])
/// saved for another model, and reads this rank's shards of the parameters. The optimizer's
/// state is read later from the returned reader ([`load_optimizer_state`]), once the optimizer
/// exists.
pub(crate) fn load_into(
    cfg: &TrainConfig,
    choice: crate::checkpoint_policy::LoadChoice,
    params: &mut Params,
    lead: bool,
) -> Result<(crate::setup::Restored, CheckpointReader), TrainError> {
    let finetune = choice.mode == crate::checkpoint_policy::LoadMode::Finetune;
    let mut r = choice.reader;
    // The training sequence length and the residual stream's storage are the run's; the
    // model is the checkpoint's.
    let mut saved = r.meta.model.clone();
    saved.seq_length = cfg.model.seq_length;
    saved.residual = cfg.model.residual;
    // The GELU form means nothing to an MLP without GELU (Megatron-LM turns the bias-GELU fusion
    // off under --swiglu, so its checkpoints record the other form than the flags give).
    if !matches!(
        cfg.model.activation,
        megatron_core::transformer::config::Activation::Gelu
            | megatron_core::transformer::config::Activation::GeGLU
    ) {
        saved.gelu = cfg.model.gelu;
    }
    // YaRN at factor 1 rotates as RoPE does: a checkpoint of either is the same model (megatron-
    // core's MLA takes YaRN by default, at Megatron's default factor 1).
    let identity = |y: &Option<megatron_core::transformer::config::YarnConfig>| {
        y.as_ref().is_some_and(|y| y.factor == 1.0)
    };
    if (identity(&saved.rotary.yarn) && cfg.model.rotary.yarn.is_none())
        || (identity(&cfg.model.rotary.yarn) && saved.rotary.yarn.is_none())
    {
        saved.rotary.yarn = cfg.model.rotary.yarn;
    }
    if saved != cfg.model && predates_moe_biases(&saved, &cfg.model) {
        return Err(TrainError::Checkpoint {
            path: r.dir.display().to_string(),
            msg: "holds experts and a router without biases (saved before megatron-rs built megatron-core's MoE biases, which these flags ask for): resume it with --use-checkpoint-args, which builds the model it holds".into(),
        });
    }
    if saved != cfg.model {
        return Err(TrainError::Checkpoint {
            path: r.dir.display().to_string(),
            msg: format!(
                "was saved for another model configuration: {}",
                config_differences(&saved, &cfg.model)
            ),
        });
    }
    let metas = params.metas.clone();
    for m in &metas {
        let out = &mut params.data[m.offset..m.offset + m.numel];
        r.read_local(&m.name, m, 0..m.numel, out)?;
    }
    let (iteration, consumed) = (r.meta.iteration, r.meta.consumed_train_samples);
    if lead {
        println!(
            "loaded checkpoint {} at iteration {iteration} ({consumed} consumed samples){}",
            r.dir.display(),
            if finetune {
                "; weights only (--finetune), starting at iteration 0"
            } else {
                ""
            }
        );
    }
    let dir = r.dir.display().to_string();
    let restored = if finetune {
        crate::setup::Restored {
            iteration: 0,
            consumed_samples: 0,
            consumed_valid_samples: 0,
            scheduler_steps: 0,
            scheduler: None,
            grad_scaler: None,
            mode: choice_mode(finetune),
            dir,
        }
    } else {
        // A converted checkpoint (no step taken) has no schedule to continue.
        let continued = !cfg.args.no_load_optim && r.meta.scheduler.num_steps > 0;
        crate::setup::Restored {
            iteration,
            consumed_samples: consumed,
            consumed_valid_samples: r
                .meta
                .consumed_valid_samples
                .unwrap_or_else(|| cfg.valid_samples_before(iteration)),
            scheduler_steps: r.meta.scheduler.num_steps,
            scheduler: continued.then(|| r.meta.scheduler.clone()),
            grad_scaler: continued.then(|| r.meta.grad_scaler.clone()),
            mode: choice_mode(finetune),
            dir,
        }
    };
    Ok((restored, r))
}

fn choice_mode(finetune: bool) -> crate::checkpoint_policy::LoadMode {
    if finetune {
        crate::checkpoint_policy::LoadMode::Finetune
    } else {
        crate::checkpoint_policy::LoadMode::Resume
    }
}

/// The moments this rank's optimizer holds, read from the checkpoint `load_into` opened.
pub(crate) fn load_optimizer_state(
    r: &mut CheckpointReader,
    params: &Params,
    optimizer: &mut dyn megatron_core::optimizer::MegatronOptimizer,
) -> Result<(), TrainError> {
    let step = r.meta.optimizer_step;
    let name = optimizer.name();
    let has = |k: Moment, r: &CheckpointReader| {
        params
            .metas
            .first()
            .is_some_and(|m| r.has(&format!("optimizer.{}.{}", k.name(), m.name)))
    };
    let any_state = [Moment::ExpAvg, Moment::MomentumBuffer]
        .into_iter()
        .any(|k| has(k, r));
    if !any_state && r.meta.iteration == 0 {
        // A converted model: the optimizer simply starts.
        println!(
            "checkpoint {} holds no optimizer state: the optimizer starts from zero state",
            r.dir.display()
        );
        return Ok(());
    }
    if r.meta.optimizer != name {
        return Err(ckpt_err(
            &r.dir,
            format!(
                "holds the state of --optimizer {} at iteration {}, and this run uses \
                 --optimizer {}: pass --no-load-optim to start its state from zero, or \
                 --finetune to start a new run from the weights",
                r.meta.optimizer, r.meta.iteration, name
            ),
        ));
    }
    // The first parameter's state tells whether any was saved (every parameter's is).
    let first = if params.metas.is_empty() {
        &[][..]
    } else {
        optimizer.moments_of(0)
    };
    if let Some(k) = first.iter().find(|k| !has(**k, r)) {
        // A run saved with --no-save-optim continues only when told to restart the optimizer
        // (as Megatron refuses it).
        let why = if any_state {
            format!("no {} (saved with --sgd-momentum 0)", k.name())
        } else {
            "no optimizer state (saved with --no-save-optim)".into()
        };
        return Err(ckpt_err(
            &r.dir,
            format!(
                "holds {why} at iteration {}: pass --no-load-optim to continue with the \
                 optimizer's state restarted from zero, or --finetune to start a new run from \
                 its weights",
                r.meta.iteration
            ),
        ));
    }
    let mut failure = None;
    let res = optimizer.load_state(params, step, &mut |moment, param, local, out| {
        let m = &params.metas[param];
        let which = moment.name();
        r.read_local(&format!("optimizer.{which}.{}", m.name), m, local, out)
            .map_err(|e| {
                let s = e.to_string();
                failure = Some(e);
                s
            })
    });
    match (res, failure) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(e)) => Err(e),
        (Err(s), None) => Err(ckpt_err(&r.dir, s)),
    }
}

/// A checkpoint of whole tensors at iteration 0 with no optimizer state (a converted model):
/// written by this one process in the sharded format, manifest last.
/// The tokenizer a converted checkpoint records: Megatron's `--tokenizer-type` and its
/// `--tokenizer-model` file.
pub(crate) struct RecordedTokenizer {
    pub tokenizer_type: &'static str,
    pub path: String,
}

pub(crate) fn write_whole_checkpoint(
    save: &Path,
    model: TransformerConfig,
    extras: ConvertedExtras,
    tensors: &crate::convert::Tensors,
    vocab_size: usize,
    tokenizer: Option<RecordedTokenizer>,
) -> Result<(), TrainError> {
    let spec = megatron_data::TokenizerSpec {
        tokenizer_type: tokenizer
            .as_ref()
            .map_or("NullTokenizer", |t| t.tokenizer_type)
            .into(),
        // A NullTokenizer's `--vocab-size` leaves out its end-of-document id, the last row.
        vocab_size: Some(match tokenizer {
            Some(_) => vocab_size,
            None => vocab_size.saturating_sub(1),
        }),
        vocab_file: None,
        merge_file: None,
        tokenizer_model: tokenizer.map(|t| t.path),
        vocab_extra_ids: 0,
        tiktoken: None,
    };
    write_converted_checkpoint(save, model, extras, tensors, spec)
}

/// Where a converted checkpoint's run stands: a model alone starts at iteration 0 with no
/// optimizer state; a run brought with its optimizer state (Megatron-LM's) continues where it
/// stopped, its moments among the tensors as `optimizer.<moment>.<parameter>`.
#[derive(Clone, Debug)]
pub struct ConvertedRun {
    pub iteration: u64,
    pub consumed_train_samples: u64,
    pub consumed_valid_samples: Option<u64>,
    pub scheduler: OptimizerParamScheduler,
    pub optimizer_step: u64,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_eps: f32,
    pub weight_decay: Option<f32>,
    pub seed: u64,
    /// An fp16 run's loss scaler as it stopped.
    pub grad_scaler: Option<megatron_core::optimizer::GradScaler>,
}

impl Default for ConvertedRun {
    fn default() -> Self {
        ConvertedRun {
            iteration: 0,
            consumed_train_samples: 0,
            consumed_valid_samples: None,
            scheduler: OptimizerParamScheduler {
                init_lr: 0.0,
                max_lr: 0.0,
                min_lr: 0.0,
                warmup_steps: 0,
                decay_steps: 0,
                decay_style: megatron_core::optimizer::LrDecayStyle::Constant,
                wsd_decay_steps: 0,
                wsd_decay_style: megatron_core::optimizer::WsdDecayStyle::Linear,
                num_steps: 0,
            },
            optimizer_step: 0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            weight_decay: None,
            seed: 1234,
            grad_scaler: None,
        }
    }
}

/// [`write_whole_checkpoint`] with the tokenizer as Megatron's flags give it (`vocab_size`
/// is required: the recorded `--vocab-size`, or the tokenizer's size).
pub(crate) fn write_converted_checkpoint(
    save: &Path,
    model: TransformerConfig,
    extras: ConvertedExtras,
    tensors: &crate::convert::Tensors,
    tokenizer: megatron_data::TokenizerSpec,
) -> Result<(), TrainError> {
    write_converted_run(
        save,
        model,
        extras,
        tensors,
        tokenizer,
        ConvertedRun::default(),
    )
    .map(|_| ())
}

/// A converted checkpoint at `run`'s iteration, written by this one process in the sharded
/// format, manifest last; its directory.
pub(crate) fn write_converted_run(
    save: &Path,
    model: TransformerConfig,
    extras: ConvertedExtras,
    tensors: &crate::convert::Tensors,
    tokenizer: megatron_data::TokenizerSpec,
    run: ConvertedRun,
) -> Result<PathBuf, TrainError> {
    use crate::dist_checkpointing::{write_rank_shard, PieceSrc};
    use megatron_core::params::GlobalSegment;
    std::fs::create_dir_all(save).map_err(io_err(save))?;
    let partial = partial_dir(save, run.iteration);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io_err(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io_err(&partial))?;
    let pieces: Vec<PieceSrc> = tensors
        .iter()
        .map(|(name, (shape, data))| {
            let (rows, cols) = view2d(shape);
            PieceSrc {
                tensor: name.clone(),
                shape: shape.clone(),
                segment: GlobalSegment {
                    row: 0,
                    col: 0,
                    rows,
                    cols,
                    local_start: 0,
                    local_stride: cols,
                },
                data: std::borrow::Cow::Borrowed(data),
                base: 0,
            }
        })
        .collect();
    write_rank_shard(&partial, 0, &pieces)?;
    let meta = CheckpointMeta {
        format: FORMAT.into(),
        iteration: run.iteration,
        consumed_train_samples: run.consumed_train_samples,
        consumed_valid_samples: run.consumed_valid_samples,
        scheduler: run.scheduler,
        optimizer_step: run.optimizer_step,
        grad_scaler: run.grad_scaler,
        optimizer: adam(),
        adam_beta1: run.adam_beta1,
        adam_beta2: run.adam_beta2,
        adam_eps: run.adam_eps,
        weight_decay: run.weight_decay,
        seed: run.seed,
        model,
        tokenizer_type: tokenizer.tokenizer_type,
        vocab_size: tokenizer.vocab_size.unwrap_or(0),
        vocab_file: tokenizer.vocab_file,
        merge_file: tokenizer.merge_file,
        tokenizer_model: tokenizer.tokenizer_model,
        vocab_extra_ids: tokenizer.vocab_extra_ids,
        tiktoken: tokenizer.tiktoken,
        tensors: Vec::new(),
        shard_bytes: 0,
        files: Vec::new(),
        layout: None,
        bert: extras.bert,
        t5: extras.t5,
        hf_buffers: extras.hf_buffers,
    };
    crate::checkpoint_save::finalize(save, &partial, meta, 1)
}
