//! A Megatron-LM run's training state from its legacy `--ckpt-format torch` checkpoint, so that
//! `megatron train --load` goes on where Megatron-LM stopped, as for torch_dist
//! (`megatron_lm_state`). The legacy format keeps the state per model-parallel rank, in one of
//! two shapes:
//!
//! - **The non-distributed optimizer** saves its `state_dict()` in each rank's
//!   `model_optim_rng.pt`: torch's Adam state by parameter index (`state[i].exp_avg`, ...), the
//!   indices listed by parameter group, and, for bf16/fp16 runs, the fp32 main copies by group
//!   (`fp32_from_fp16_params`). An index is a position in Megatron's parameter groups, which are
//!   the rank's parameters in registration order (the order of its model state dict) split by
//!   weight decay (biases and 1-dimensional parameters are not decayed) and by expert
//!   parallelism. Each group says which it is (`wd_mult`, `is_expert_parallel`), so the
//!   parameters are dealt to the groups by that rule and every state tensor's shape is checked
//!   against its parameter's.
//! - **The distributed optimizer** saves beside it `distrib_optim.pt` (from data-parallel rank
//!   0 of each model-parallel rank): per gradient buffer, the main parameters, `exp_avg` and
//!   `exp_avg_sq` as flat tensors gathered over data-parallel ranks, in Megatron's bucket layout
//!   (reverse registration order, 64-element starts, buckets back to back), which the file does
//!   not describe. As for the torch_dist bucket form, each parameter is found by value: the
//!   main parameters at its place are its weights (equal in fp32, rounding to them in bf16 and
//!   fp16), and every parameter the model needs must be found.

use super::megatron_lm::{TensorKind, WantedTensor};
use super::megatron_lm_buckets::{find_in_gathered_buffers, FoundState, WeightsOf};
use super::megatron_lm_state::{
    converted_run, grad_scaler, insert_moments, number, optimizers, step_in, unsupported_run,
    RunState,
};
use super::pickle::PyValue;
use super::torch_save::{tensor_shape, TorchArchive, TorchTensor};
use super::tp_shards::place_piece;
use super::Tensors;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

/// A rank file's coordinates: tensor, pipeline and expert-parallel rank.
pub(crate) type Rank = (usize, usize, usize);

/// Where one tensor-parallel piece of a model tensor is kept: the rank's file, its model chunk
/// (`model`, or `model<chunk>` under interleaving) and the name there.
pub(crate) struct Piece {
    pub rank: Rank,
    pub chunk: usize,
    pub local: String,
}

/// A model tensor and where its pieces are, in tensor-parallel rank order (one piece where it
/// is the same on every rank).
pub(crate) struct Placed {
    pub tensor: WantedTensor,
    pub pieces: Vec<Piece>,
}

/// The checkpoint's rank files, opened.
pub(crate) type RankFiles<'a> = BTreeMap<Rank, &'a (PathBuf, TorchArchive<'a>)>;

/// One parameter of a rank, as its model state dict lists it.
struct LocalParam<'v> {
    chunk: usize,
    name: String,
    shape: Vec<usize>,
    value: &'v PyValue,
}

/// One parameter's optimizer state on one rank.
struct LocalState {
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    main: Option<Vec<f32>>,
}

/// A rank's optimizer state by (model chunk, local name).
type RankState = HashMap<(usize, String), LocalState>;

/// Reads the run's state from the legacy checkpoint of rank files `files` (saved arguments
/// `args`) for the model's tensors `placed`.
pub(crate) fn read_legacy_run_state(
    files: &RankFiles,
    args: &PyValue,
    placed: &[Placed],
) -> Result<RunState, String> {
    let Some((_, first)) = files.iter().next() else {
        return Err("no rank files".into());
    };
    let common = &first.1.object;
    if common.get("optimizer").is_none() {
        return Ok(RunState::NotSaved);
    }
    if let Some(why) = unsupported_run(common, args) {
        return Ok(RunState::Unsupported(why));
    }
    let params = placed
        .iter()
        .filter(|p| p.tensor.kind == TensorKind::Parameter);
    // Which local names are parameters, per pipeline stage and chunk (the same on every
    // tensor- and expert-parallel rank of the stage).
    let is_param: HashSet<(usize, usize, &str)> = params
        .clone()
        .flat_map(|p| p.pieces.iter())
        .map(|p| (p.rank.1, p.chunk, p.local.as_str()))
        .collect();
    let distributed = matches!(
        args.attr("use_distributed_optimizer"),
        Some(PyValue::Bool(true))
    );
    let rule = GroupRule::of_args(args);
    let mut states: HashMap<Rank, RankState> = HashMap::new();
    for (&rank, file) in files {
        let (path, archive) = (&file.0, &file.1);
        // A tied output layer's copy on the last of several stages is a parameter too (its
        // state is the embedding's, read from the first stage).
        let locals = local_params(&archive.object, |chunk, name| {
            is_param.contains(&(rank.1, chunk, name)) || name == "output_layer.weight"
        });
        let state = if distributed {
            let optim = path.with_file_name("distrib_optim.pt");
            read_distrib_optim(&optim, archive, &locals, WeightsOf::of_args(args))
        } else {
            let opt = archive
                .object
                .get("optimizer")
                .ok_or("no optimizer state")?;
            read_torch_optimizer(archive, opt, &locals, rule)
        };
        let state = match state {
            Ok(s) => s,
            Err(why) => return Ok(RunState::Unsupported(format!("{}: {why}", path.display()))),
        };
        states.insert(rank, state);
    }
    let mut optimizer = Tensors::new();
    let mut main_params = Tensors::new();
    for p in params {
        let w = &p.tensor;
        let numel: usize = w.shape.iter().product();
        let mut out = [
            vec![0.0f32; numel],
            vec![0.0f32; numel],
            vec![0.0f32; numel],
        ];
        let mut mains = 0;
        let ranks = p.pieces.len();
        for (r, piece) in p.pieces.iter().enumerate() {
            let Some(s) = states[&piece.rank].get(&(piece.chunk, piece.local.clone())) else {
                return Ok(RunState::Unsupported(format!(
                    "{}: no optimizer state for {} (model chunk {})",
                    files[&piece.rank].0.display(),
                    piece.local,
                    piece.chunk
                )));
            };
            mains += usize::from(s.main.is_some());
            let sources = [Some(&s.exp_avg), Some(&s.exp_avg_sq), s.main.as_ref()];
            for (o, src) in out.iter_mut().zip(sources) {
                if let Some(src) = src {
                    place_piece(o, &w.shape, w.split, (ranks, r), src);
                }
            }
        }
        let [m, v, main] = out;
        insert_moments(&mut optimizer, w, m, v);
        match mains {
            0 => {}
            n if n == ranks => {
                main_params.insert(w.name.clone(), (w.shape.clone(), main));
            }
            _ => {
                return Ok(RunState::Unsupported(format!(
                    "main parameters for some ranks' pieces of {} and not for others",
                    w.name
                )))
            }
        }
    }
    let step = optimizers(common.get("optimizer").expect("checked above"))
        .into_iter()
        .find_map(|o| step_in(o, &first.1))
        .transpose()?
        .ok_or("the optimizer state holds no step")?;
    let scaler = grad_scaler(common, args, &first.1)?;
    Ok(RunState::Imported {
        run: converted_run(common, args, step, scaler)?,
        optimizer,
        main_params,
    })
}

/// The parameters of a rank file's model chunks (`model`, or `model0`, `model1`, ...), in the
/// order its state dicts list them, which is the order the modules registered them; `is_param`
/// tells a parameter from a buffer or an `_extra_state`.
fn local_params(object: &PyValue, is_param: impl Fn(usize, &str) -> bool) -> Vec<LocalParam<'_>> {
    let chunks: Vec<&PyValue> = match object.get("model") {
        Some(m) => vec![m],
        None => (0..)
            .map_while(|i| object.get(&format!("model{i}")))
            .collect(),
    };
    fn entries(v: &PyValue) -> Vec<(String, &PyValue)> {
        let e = match v {
            PyValue::Dict(e) => e,
            PyValue::Object { entries, .. } => entries,
            _ => return Vec::new(),
        };
        e.iter()
            .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v)))
            .collect()
    }
    let mut out = Vec::new();
    for (chunk, m) in chunks.into_iter().enumerate() {
        for (name, value) in entries(m) {
            if !is_param(chunk, &name) {
                continue;
            }
            if let Some(shape) = tensor_shape(value) {
                out.push(LocalParam {
                    chunk,
                    name,
                    shape,
                    value,
                });
            }
        }
    }
    out
}

/// How Megatron-LM deals a rank's parameters to its optimizer's groups: by weight decay (its
/// default rule: biases and 1-dimensional parameters are not decayed;
/// `--apply-wd-to-qk-layernorm` decays the query/key norms) and by whether a parameter is
/// expert-parallel (experts, where expert parallelism is above 1 or expert TP differs from TP).
#[derive(Clone, Copy)]
struct GroupRule {
    decay_qk_norms: bool,
    experts_apart: bool,
}

impl GroupRule {
    fn of_args(args: &PyValue) -> GroupRule {
        let int = |k: &str| args.attr(k).and_then(|v| v.as_int());
        let tp = int("tensor_model_parallel_size").unwrap_or(1);
        let etp = int("expert_tensor_parallel_size").unwrap_or(tp);
        GroupRule {
            decay_qk_norms: matches!(
                args.attr("apply_wd_to_qk_layernorm"),
                Some(PyValue::Bool(true))
            ),
            experts_apart: int("expert_model_parallel_size").unwrap_or(1) > 1 || etp != tp,
        }
    }

    /// The group kind of `p`: (not decayed, expert-parallel).
    fn kind(self, p: &LocalParam) -> (bool, bool) {
        let qk_norm = p.name.contains("q_layernorm.") || p.name.contains("k_layernorm.");
        let no_decay =
            (p.shape.len() == 1 || p.name.ends_with(".bias")) && !(self.decay_qk_norms && qk_norm);
        (
            no_decay,
            self.experts_apart && p.name.contains(".mlp.experts."),
        )
    }
}

/// The non-distributed optimizer's state dict `opt` (one, or a chained list) for the rank's
/// parameters `params`.
fn read_torch_optimizer(
    archive: &TorchArchive,
    opt: &PyValue,
    params: &[LocalParam],
    rule: GroupRule,
) -> Result<RankState, String> {
    let mut out = RankState::new();
    for o in optimizers(opt) {
        // Mixed precision wraps torch's state dict, beside the fp32 main copies by group.
        let (inner, mains) = match o.get("fp32_from_fp16_params") {
            Some(m) => (
                o.get("optimizer")
                    .ok_or("fp32_from_fp16_params without its optimizer")?,
                Some(
                    m.as_seq()
                        .ok_or("fp32_from_fp16_params is not a list of groups")?,
                ),
            ),
            None => (o, None),
        };
        let groups = inner
            .get("param_groups")
            .and_then(|g| g.as_seq())
            .ok_or("an optimizer state without param_groups")?;
        let state = inner
            .get("state")
            .ok_or("an optimizer state without state")?;
        let mut seen = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            let num = |k: &str, default: f64| g.get(k).and_then(number).unwrap_or(default);
            let (wd_mult, lr_mult) = (num("wd_mult", 1.0), num("lr_mult", 1.0));
            if lr_mult != 1.0 || matches!(g.get("is_decoupled_lr"), Some(PyValue::Bool(true))) {
                return Err(format!(
                    "parameter group {gi} has its own learning rate (lr_mult {lr_mult}, or --decoupled-lr), which this engine does not schedule"
                ));
            }
            if wd_mult != 0.0 && wd_mult != 1.0 {
                return Err(format!(
                    "parameter group {gi} scales weight decay by {wd_mult}, which this engine does not"
                ));
            }
            let expert = matches!(g.get("is_expert_parallel"), Some(PyValue::Bool(true)));
            let key = (wd_mult == 0.0, expert);
            if seen.contains(&key) {
                return Err(format!(
                    "two parameter groups of the same kind (weight decay {}, experts {expert}): groups from overrides are not read",
                    !key.0
                ));
            }
            seen.push(key);
            let ids = g
                .get("params")
                .and_then(|p| p.as_seq())
                .ok_or_else(|| format!("parameter group {gi} lists no params"))?;
            let members: Vec<&LocalParam> = params.iter().filter(|p| rule.kind(p) == key).collect();
            if members.len() != ids.len() {
                return Err(format!(
                    "parameter group {gi} (weight decay {}, experts {expert}) lists {} parameters, the rank's model has {} of that kind: not Megatron-LM's grouping",
                    !key.0,
                    ids.len(),
                    members.len()
                ));
            }
            let group_mains = match mains {
                Some(m) => Some(
                    m.get(gi)
                        .and_then(|g| g.as_seq())
                        .filter(|g| g.len() == ids.len())
                        .ok_or_else(|| {
                            format!(
                                "fp32_from_fp16_params has no {} tensors for group {gi}",
                                ids.len()
                            )
                        })?,
                ),
                None => None,
            };
            for (j, (p, id)) in members.iter().zip(ids).enumerate() {
                let id = id.as_int().ok_or("a parameter index that is not an int")?;
                let st = by_index(state, id)
                    .ok_or_else(|| format!("no state for parameter index {id} ({})", p.name))?;
                let tensor = |v: Option<&PyValue>, what: &str| -> Result<Vec<f32>, String> {
                    let v = v.ok_or_else(|| format!("no {what} for {}", p.name))?;
                    let t: TorchTensor = archive
                        .tensor(v)
                        .map_err(|e| format!("{what} of {}: {e}", p.name))?;
                    if t.shape != p.shape {
                        return Err(format!(
                            "the {what} of parameter index {id} has shape {:?}, its parameter {} {:?}: not Megatron-LM's grouping",
                            t.shape, p.name, p.shape
                        ));
                    }
                    Ok(t.values)
                };
                let local = LocalState {
                    exp_avg: tensor(st.get("exp_avg"), "exp_avg")?,
                    exp_avg_sq: tensor(st.get("exp_avg_sq"), "exp_avg_sq")?,
                    main: group_mains
                        .map(|m| tensor(m.get(j), "fp32 main parameter"))
                        .transpose()?,
                };
                if out.insert((p.chunk, p.name.clone()), local).is_some() {
                    return Err(format!("{} is in two parameter groups", p.name));
                }
            }
        }
    }
    Ok(out)
}

/// The entry of a torch optimizer's `state` (a dict by parameter index) for index `id`.
fn by_index(state: &PyValue, id: i64) -> Option<&PyValue> {
    match state {
        PyValue::Dict(e) => e
            .iter()
            .find(|(k, _)| matches!(k, PyValue::Int(i) if *i == id))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// The distributed optimizer's `distrib_optim.pt` at `path` (one state, or a chained list with
/// `None` where this rank saved none) for the parameters `params` of the rank whose model file
/// is `model` and whose weights are `weights_of` their main parameters.
fn read_distrib_optim(
    path: &std::path::Path,
    model: &TorchArchive,
    params: &[LocalParam],
    weights_of: WeightsOf,
) -> Result<RankState, String> {
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: the file is only read, and a checkpoint being converted is not written.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("{}: {e}", path.display()))?;
    let archive = TorchArchive::read(&map)?;
    let states: Vec<&PyValue> = match &archive.object {
        PyValue::List(each) => each
            .iter()
            .filter(|s| !matches!(s, PyValue::None))
            .collect(),
        one => vec![one],
    };
    let weights: Vec<Vec<f32>> = params
        .iter()
        .map(|p| model.tensor(p.value).map(|t| t.values))
        .collect::<Result<_, _>>()?;
    // Each local parameter its own candidate, found in any of the file's states.
    let candidates: Vec<(usize, &[f32])> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| (i, w.as_slice()))
        .collect();
    let mut found: Vec<Option<FoundState>> = vec![None; params.len()];
    for state in states {
        find_in_gathered_buffers(state, &archive, &candidates, weights_of, &mut found)?;
    }
    let mut out = RankState::new();
    for (p, f) in params.iter().zip(found) {
        if let Some([exp_avg, exp_avg_sq, main]) = f {
            out.insert(
                (p.chunk, p.name.clone()),
                LocalState {
                    exp_avg,
                    exp_avg_sq,
                    main: Some(main),
                },
            );
        }
    }
    Ok(out)
}
