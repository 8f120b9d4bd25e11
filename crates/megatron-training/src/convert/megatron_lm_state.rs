//! A Megatron-LM run's training state, read from its torch_dist checkpoint, so that `megatron
//! train --load` goes on where Megatron-LM stopped: Adam's moments, the fp32 main parameters
//! of a bf16 run, the optimizer's step, the learning-rate schedule, the iteration and the
//! samples consumed (the data order is Megatron's, so the next batches are the ones Megatron-LM
//! would have read).
//!
//! megatron-core keeps the per-parameter state under the model's own sharded keys —
//! `optimizer.state.{exp_avg,exp_avg_sq}.<key>`, and the main parameters under
//! `optimizer.state.fp32_param.<key>` (non-distributed mixed precision) or
//! `optimizer.state.param.<key>` (the distributed optimizer's `fully_reshardable` form) — so
//! they are found where the weights are, whatever TP/PP/DP layout saved them. The distributed
//! optimizer's default form (`dp_reshardable`) stores its gradient buckets instead; they are
//! read by `megatron_lm_buckets`.

use super::megatron_lm::{locate, with_common_state, TensorKind, WantedTensor};
use super::megatron_lm_buckets::{read_bucket_state, read_gathered_state, WeightsOf};
use super::pickle::PyValue;
use super::pickle_writer::Pickle;
use super::torch_dist::TorchDistCheckpoint;
use super::torch_dist_writer::Storages;
use super::torch_save::f32_tensor_pickle;
use super::torch_save::TorchArchive;
use super::Tensors;
use crate::checkpointing::{CheckpointMeta, ConvertedRun};
use megatron_core::optimizer::{GradScaler, LrDecayStyle, OptimizerParamScheduler, WsdDecayStyle};

/// What a checkpoint holds of the run beyond its weights.
pub(crate) enum RunState {
    /// Saved with `--no-save-optim`, or by a script that saved the model alone.
    NotSaved,
    /// Saved, and not importable here, for the reason given.
    Unsupported(String),
    /// The run continues: its position, and its optimizer tensors by this engine's names
    /// (`optimizer.exp_avg.<name>`, ...), and the main parameters that replace the weights.
    Imported {
        run: ConvertedRun,
        optimizer: Tensors,
        main_params: Tensors,
    },
}

/// Parameter `w`'s Adam moments `m` and `v` under this engine's names.
pub(crate) fn insert_moments(optimizer: &mut Tensors, w: &WantedTensor, m: Vec<f32>, v: Vec<f32>) {
    for (moment, values) in [("exp_avg", m), ("exp_avg_sq", v)] {
        optimizer.insert(
            format!("optimizer.{moment}.{}", w.name),
            (w.shape.clone(), values),
        );
    }
}

/// The run a converted checkpoint continues, its state's tensors added to `tensors` (the main
/// parameters replacing the weights); where the state is not imported, a warning says why and
/// the weights alone land at iteration 0.
pub(crate) fn continued_run(state: RunState, tensors: &mut Tensors) -> Option<ConvertedRun> {
    match state {
        RunState::NotSaved => None,
        RunState::Unsupported(why) => {
            eprintln!(
                "WARNING: the run's optimizer state is not imported: {why}. The converted \
                 checkpoint holds the weights alone, at iteration 0: train from it with --finetune"
            );
            None
        }
        RunState::Imported {
            run,
            optimizer,
            main_params,
        } => {
            tensors.extend(main_params);
            tensors.extend(optimizer);
            Some(run)
        }
    }
}

/// Reads the run's state from `ck` (common state `common`, saved arguments `args`) for the
/// model's tensors `wanted`.
pub(crate) fn read_run_state(
    ck: &TorchDistCheckpoint,
    common: &PyValue,
    args: &PyValue,
    wanted: &[WantedTensor],
    weights: &Tensors,
) -> Result<RunState, String> {
    let Some(opt) = common.get("optimizer") else {
        return Ok(RunState::NotSaved);
    };
    if let Some(why) = unsupported(ck, common, opt, args) {
        return Ok(RunState::Unsupported(why));
    }
    // The step and the loss scale may be tensors: read with the archive that holds them.
    let (step, grad_scaler) = with_common_state(ck, |c, archive| {
        let step = c
            .get("optimizer")
            .and_then(|o| optimizers(o).into_iter().find_map(|o| step_in(o, archive)))
            .transpose()?;
        Ok((step, grad_scaler(c, args, archive)?))
    })?;
    let step = match step {
        Some(s) => s,
        None => step_beside_buckets(ck)?,
    };
    let tp = args
        .attr("tensor_model_parallel_size")
        .and_then(|v| v.as_int())
        .unwrap_or(1) as usize;
    let types = sharding_types(opt);
    // The bucket forms: parameters found by value (`megatron_lm_buckets`).
    let by_value = if types.contains(&"dp_reshardable") {
        Some((
            "bucket form (dp_reshardable)",
            read_bucket_state as BucketReader,
        ))
    } else if types.contains(&"dp_zero_gather_scatter") {
        Some((
            "gathered form (dp_zero_gather_scatter)",
            read_gathered_state as BucketReader,
        ))
    } else {
        None
    };
    let (optimizer, main_params) = if let Some((form, read)) = by_value {
        match read(ck, wanted, weights, tp, WeightsOf::of_args(args)) {
            Ok(state) => state,
            Err(why) => {
                return Ok(RunState::Unsupported(format!(
                    "the distributed optimizer's {form}: {why}; save the run once with \
                     Megatron-LM's --dist-ckpt-optim-fully-reshardable to bring its state"
                )))
            }
        }
    } else if types.contains(&"fully_sharded_model_space") {
        read_parameter_state(ck, wanted, StateShape::FlatShards)?
    } else {
        read_parameter_state(ck, wanted, StateShape::Whole)?
    };
    Ok(RunState::Imported {
        run: converted_run(common, args, step, grad_scaler)?,
        optimizer,
        main_params,
    })
}

/// The run's position and settings from a checkpoint's common state `common` (the torch_dist
/// common state, or a legacy rank file's top level: both hold `iteration` and
/// `opt_param_scheduler`) and saved arguments `args`.
pub(crate) fn converted_run(
    common: &PyValue,
    args: &PyValue,
    step: u64,
    grad_scaler: Option<GradScaler>,
) -> Result<ConvertedRun, String> {
    let int = |name: &str| args.attr(name).and_then(|v| v.as_int());
    let float = |name: &str| args.attr(name).and_then(number);
    let need = |name: &str| {
        float(name).ok_or_else(|| format!("the saved arguments hold no number {name}"))
    };
    let iteration = common
        .get("iteration")
        .and_then(|i| i.as_int())
        .ok_or("the checkpoint holds no iteration")?;
    Ok(ConvertedRun {
        iteration: iteration as u64,
        consumed_train_samples: int("consumed_train_samples").unwrap_or(0) as u64,
        consumed_valid_samples: int("consumed_valid_samples").map(|v| v as u64),
        scheduler: scheduler(common, args)?,
        optimizer_step: step,
        adam_beta1: need("adam_beta1")? as f32,
        adam_beta2: need("adam_beta2")? as f32,
        adam_eps: need("adam_eps")? as f32,
        weight_decay: float("weight_decay").map(|w| w as f32),
        seed: int("seed").unwrap_or(1234) as u64,
        grad_scaler,
    })
}

/// A reader of a bucket form's state: checkpoint, the model's tensors, their weights,
/// tensor-parallel size, the weights' precision.
type BucketReader = fn(
    &TorchDistCheckpoint,
    &[WantedTensor],
    &Tensors,
    usize,
    WeightsOf,
) -> Result<(Tensors, Tensors), String>;

/// How a parameter's optimizer state is stored under its own key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StateShape {
    /// In the parameter's own shape (the non-distributed optimizer, the distributed one's
    /// `fully_reshardable` form).
    Whole,
    /// The distributed optimizer's `fully_sharded_model_space` form (megatron-core 0.9-0.12
    /// wrote it by default): each tensor-parallel shard flattened, so a parameter of global
    /// shape `[X, Y]` split into `[x, y]` shards is stored as `[X/x, Y/y, x*y]`, its last axis
    /// cut where data-parallel ranks' shards of the flat buffer end.
    FlatShards,
}

/// The moments and main parameters stored under each parameter's own sharded key (the
/// non-distributed optimizer, the distributed one's model-space forms).
fn read_parameter_state(
    ck: &TorchDistCheckpoint,
    wanted: &[WantedTensor],
    shape: StateShape,
) -> Result<(Tensors, Tensors), String> {
    let read = |prefix: &str, w: &WantedTensor| match shape {
        StateShape::Whole => {
            let (key, start, size) = locate(ck, prefix, &w.name, &w.shape)?;
            ck.region(&key, &start, &size)
        }
        StateShape::FlatShards => flat_shards_region(ck, prefix, w),
    };
    let mut optimizer = Tensors::new();
    let mut main_params = Tensors::new();
    for w in wanted.iter().filter(|w| w.kind == TensorKind::Parameter) {
        let m = read("optimizer.state.exp_avg.", w)?;
        let v = read("optimizer.state.exp_avg_sq.", w)?;
        insert_moments(&mut optimizer, w, m, v);
        // The fp32 copy the optimizer steps (bf16/fp16 runs; the distributed optimizer keeps
        // one for fp32 runs too, equal to the weights). An fp32 run's weights are its own.
        for prefix in ["optimizer.state.fp32_param.", "optimizer.state.param."] {
            let stored = locate(ck, "", &w.name, &w.shape)
                .is_ok_and(|(key, _, _)| ck.sizes.contains_key(&format!("{prefix}{key}")));
            if stored {
                main_params.insert(w.name.clone(), (w.shape.clone(), read(prefix, w)?));
                break;
            }
        }
    }
    Ok((optimizer, main_params))
}

/// Parameter `w`'s state under `prefix` in the `fully_sharded_model_space` form: the region
/// of the model's own key that `w` is (a layer of stacked layers, an expert), put together
/// from the flattened shards of the grid cells it crosses.
fn flat_shards_region(
    ck: &TorchDistCheckpoint,
    prefix: &str,
    w: &WantedTensor,
) -> Result<Vec<f32>, String> {
    let (model_key, start, size) = locate(ck, "", &w.name, &w.shape)?;
    let global = &ck.sizes[&model_key];
    let key = format!("{prefix}{model_key}");
    let stored = ck
        .sizes
        .get(&key)
        .ok_or_else(|| format!("the checkpoint has no tensor {key}"))?;
    let (grid, numel) = match stored.split_last() {
        Some((&n, grid)) if grid.len() == global.len() => (grid, n),
        _ => {
            return Err(format!(
            "tensor {key} has size {stored:?}, not the flattened shards of {model_key} {global:?}"
        ))
        }
    };
    let local: Vec<usize> = global
        .iter()
        .zip(grid)
        .map(|(g, c)| g / c.max(&1))
        .collect();
    if global.iter().zip(grid).any(|(g, c)| *c == 0 || g % c != 0)
        || local.iter().product::<usize>() != numel
    {
        return Err(format!(
            "tensor {key} has size {stored:?}: {model_key} {global:?} is not a grid of shards of {numel} elements"
        ));
    }
    let rank = global.len();
    let mut out = vec![0.0f32; size.iter().product()];
    // Every grid cell the region crosses, in row-major order.
    let first: Vec<usize> = (0..rank).map(|d| start[d] / local[d]).collect();
    let last: Vec<usize> = (0..rank)
        .map(|d| (start[d] + size[d] - 1) / local[d])
        .collect();
    let mut cell = first.clone();
    loop {
        let mut at = cell.clone();
        at.push(0);
        let mut extent = vec![1; rank];
        extent.push(numel);
        let values = ck.region(&key, &at, &extent)?;
        // The cell's elements inside the region, copied row by row of its last dimension.
        let origin: Vec<usize> = (0..rank).map(|d| cell[d] * local[d]).collect();
        let lo: Vec<usize> = (0..rank).map(|d| start[d].max(origin[d])).collect();
        let hi: Vec<usize> = (0..rank)
            .map(|d| (start[d] + size[d]).min(origin[d] + local[d]))
            .collect();
        let mut idx = lo.clone();
        'rows: loop {
            // Row-major offset of `idx` in a box at `base` of extent `dims`.
            let offset = |base: &[usize], dims: &[usize]| {
                (0..rank).fold(0, |acc, d| acc * dims[d] + idx[d] - base[d])
            };
            let src = offset(&origin, &local);
            let dst = offset(&start, &size);
            let run = hi[rank - 1] - lo[rank - 1];
            out[dst..dst + run].copy_from_slice(&values[src..src + run]);
            // Next row: advance every dimension but the last.
            let mut d = rank - 1;
            loop {
                if d == 0 {
                    break 'rows;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < hi[d] {
                    break;
                }
                idx[d] = lo[d];
            }
        }
        // Next cell.
        let mut d = rank;
        loop {
            if d == 0 {
                return Ok(out);
            }
            d -= 1;
            cell[d] += 1;
            if cell[d] <= last[d] {
                break;
            }
            cell[d] = first[d];
        }
    }
}

/// Why the saved optimizer state cannot be continued here, if it cannot.
fn unsupported(
    ck: &TorchDistCheckpoint,
    common: &PyValue,
    opt: &PyValue,
    args: &PyValue,
) -> Option<String> {
    if let Some(why) = unsupported_run(common, args) {
        return Some(why);
    }
    if let Some(t) = sharding_types(opt).into_iter().find(|t| {
        !matches!(
            *t,
            "fully_reshardable"
                | "dp_reshardable"
                | "fully_sharded_model_space"
                | "dp_zero_gather_scatter"
        )
    }) {
        return Some(format!(
            "the distributed optimizer's state is saved as {t}, a form not read here; save the \
             run once with Megatron-LM's --dist-ckpt-optim-fully-reshardable to bring its state"
        ));
    }
    let moments = ["optimizer.state.exp_avg.", "optimizer.distributed."];
    if !ck.keys().any(|k| moments.iter().any(|m| k.contains(m))) {
        return Some("the checkpoint holds no Adam moments (optimizer.state.exp_avg.*)".into());
    }
    None
}

/// Why a run of arguments `args` and scheduler state (in `common`) cannot go on here with its
/// optimizer state, whatever the format saved it: another optimizer than Adam, L2 weight
/// decay, a weight-decay schedule.
pub(crate) fn unsupported_run(common: &PyValue, args: &PyValue) -> Option<String> {
    let arg = |name: &str| args.attr(name);
    if let Some(o) = arg("optimizer").and_then(|v| v.as_str()) {
        if o != "adam" {
            return Some(format!(
                "the run's optimizer is {o}; the state of --optimizer adam is what is imported"
            ));
        }
    }
    if matches!(arg("decoupled_weight_decay"), Some(PyValue::Bool(false))) {
        return Some("the run used Adam with L2 weight decay (not decoupled), which this engine does not train".into());
    }
    common.get("opt_param_scheduler").and_then(|s| {
        // Absent (an older scheduler, or this engine's export): constant.
        let constant = s
            .get("wd_incr_style")
            .and_then(|v| v.as_str())
            .is_none_or(|v| v == "constant");
        let same = s.get("start_wd").and_then(number) == s.get("end_wd").and_then(number);
        (!constant || !same).then(|| {
            "the run's weight decay changes over training (--start-weight-decay/--end-weight-decay), which this engine does not schedule".to_string()
        })
    })
}

/// The optimizer's state dict and, where Megatron-LM chains several (experts apart: a dict by
/// index), each one's.
pub(crate) fn optimizers(opt: &PyValue) -> Vec<&PyValue> {
    match opt {
        // The legacy format's ChainedOptimizer: a list.
        PyValue::List(each) => each.iter().collect(),
        PyValue::Dict(entries) if entries.iter().all(|(k, _)| matches!(k, PyValue::Int(_))) => {
            entries.iter().map(|(_, v)| v).collect()
        }
        other => vec![other],
    }
}

/// The distributed optimizer's checkpoint forms the state is saved in (none: the
/// non-distributed optimizer's).
fn sharding_types(opt: &PyValue) -> Vec<&str> {
    optimizers(opt)
        .into_iter()
        .filter_map(|o| o.get("param_state_sharding_type").and_then(|v| v.as_str()))
        .collect()
}

/// The step of the bucket form, kept per domain beside its buckets (each parameter group's
/// `step`), where the common state holds none.
fn step_beside_buckets(ck: &TorchDistCheckpoint) -> Result<u64, String> {
    let key = ck
        .keys()
        .find(|k| k.contains("optimizer.distributed.") && k.contains(".optimizer/"))
        .ok_or("the optimizer state holds no step (state.common_step or param_groups[0].step)")?
        .clone();
    let archive = ck.archive(&key)?;
    let value = match &archive.object {
        PyValue::List(one) if one.len() == 1 => &one[0],
        other => other,
    };
    step_in(value, &archive)
        .transpose()?
        .ok_or_else(|| format!("{key} holds no param_groups[0].step"))
}

/// The step in an optimizer's state dict `opt`, if it holds one: one shared step
/// (`state.common_step`, a tensor, of the non-distributed optimizers), each parameter
/// group's `step` (the distributed optimizer's), or, in the legacy format, torch's Adam's own
/// per-parameter `state[i].step` (the same for every parameter).
pub(crate) fn step_in(opt: &PyValue, archive: &TorchArchive) -> Option<Result<u64, String>> {
    // Mixed precision wraps the inner optimizer's state dict in another `optimizer`.
    let inner = opt.get("optimizer").unwrap_or(opt);
    let value = inner
        .get("state")
        .and_then(|s| s.get("common_step"))
        .or_else(|| {
            inner
                .get("param_groups")
                .and_then(|g| g.as_seq())
                .and_then(|g| g.first())
                .and_then(|g| g.get("step"))
        })
        .or_else(|| match inner.get("state")? {
            PyValue::Dict(by_index) => by_index.iter().find_map(|(_, s)| s.get("step")),
            _ => None,
        })?;
    let step = match number(value) {
        Some(s) => Ok(s),
        None => archive.tensor(value).and_then(|t| {
            t.values
                .first()
                .map(|&v| v as f64)
                .ok_or_else(|| "an empty step tensor".to_string())
        }),
    };
    Some(step.map(|s| s.round() as u64))
}

/// An fp16 run's loss scaler: `--loss-scale`'s constant, or Megatron's dynamic scaler with the
/// scale and trackers it saved (`optimizer.grad_scaler`) and the run's window, hysteresis and
/// floor.
pub(crate) fn grad_scaler(
    common: &PyValue,
    args: &PyValue,
    archive: &TorchArchive,
) -> Result<Option<GradScaler>, String> {
    if !matches!(args.attr("fp16"), Some(PyValue::Bool(true))) {
        return Ok(None);
    }
    if let Some(scale) = args.attr("loss_scale").and_then(number) {
        return Ok(Some(GradScaler::Constant {
            scale: scale as f32,
        }));
    }
    let saved = common
        .get("optimizer")
        .and_then(|o| optimizers(o).into_iter().find_map(|o| o.get("grad_scaler")))
        .ok_or("an fp16 run without its loss scaler's state (optimizer.grad_scaler)")?;
    let scale = match saved.get("scale") {
        Some(v) => match number(v) {
            Some(s) => s as f32,
            None => *archive
                .tensor(v)?
                .values
                .first()
                .ok_or("an empty loss scale tensor")?,
        },
        None => return Err("optimizer.grad_scaler holds no scale".into()),
    };
    let count = |k: &str| saved.get(k).and_then(|v| v.as_int()).unwrap_or(0) as u32;
    let arg = |k: &str, default: f64| args.attr(k).and_then(number).unwrap_or(default);
    let mut s = GradScaler::dynamic(
        scale,
        arg("min_loss_scale", 1.0) as f32,
        arg("loss_scale_window", 1000.0) as u32,
        arg("hysteresis", 2.0) as u32,
    );
    if let GradScaler::Dynamic {
        growth_tracker,
        hysteresis_tracker,
        ..
    } = &mut s
    {
        *growth_tracker = count("growth_tracker");
        *hysteresis_tracker = count("hysteresis_tracker");
    }
    Ok(Some(s))
}

/// The learning-rate schedule as the run left it: Megatron-LM's `opt_param_scheduler` state
/// (in samples, as this engine's), with the warm-up start and the WSD decay from the saved
/// arguments.
fn scheduler(common: &PyValue, args: &PyValue) -> Result<OptimizerParamScheduler, String> {
    let s = common
        .get("opt_param_scheduler")
        .ok_or("the common state holds no opt_param_scheduler")?;
    let num = |k: &str| {
        s.get(k)
            .and_then(number)
            .ok_or_else(|| format!("opt_param_scheduler holds no number {k}"))
    };
    let style = s
        .get("lr_decay_style")
        .and_then(|v| v.as_str())
        .ok_or("opt_param_scheduler holds no lr_decay_style")?;
    let decay_style = LrDecayStyle::parse(style).ok_or_else(|| {
        format!("opt_param_scheduler's lr_decay_style {style} is not one this engine schedules")
    })?;
    let arg_num = |k: &str| args.attr(k).and_then(number);
    let gbs = arg_num("global_batch_size").unwrap_or(1.0);
    let wsd_decay_steps = arg_num("lr_wsd_decay_samples")
        .or_else(|| arg_num("lr_wsd_decay_iters").map(|i| i * gbs))
        .unwrap_or(0.0);
    let wsd = args
        .attr("lr_wsd_decay_style")
        .and_then(|v| v.as_str())
        .unwrap_or("exponential");
    let wsd_decay_style = WsdDecayStyle::parse(wsd).ok_or_else(|| {
        format!("the saved lr_wsd_decay_style {wsd} is not one this engine schedules")
    })?;
    Ok(OptimizerParamScheduler {
        init_lr: arg_num("lr_warmup_init").unwrap_or(0.0),
        max_lr: num("max_lr")?,
        min_lr: num("min_lr")?,
        warmup_steps: num("lr_warmup_steps")? as u64,
        decay_steps: num("lr_decay_steps")? as u64,
        decay_style,
        wsd_decay_steps: wsd_decay_steps as u64,
        wsd_decay_style,
        num_steps: num("num_steps")? as u64,
    })
}

/// A Python int or float.
pub(crate) fn number(v: &PyValue) -> Option<f64> {
    match v {
        PyValue::Int(i) => Some(*i as f64),
        PyValue::Float(f) => Some(*f),
        _ => None,
    }
}

/// Whether an export to Megatron-LM carries the run's optimizer state.
pub(crate) enum StateExport {
    /// The checkpoint holds none (a converted model, `--no-save-optim`, iteration 0).
    Nothing,
    /// It holds state Megatron-LM would not continue from, for the reason given.
    Refused(String),
    /// Adam's moments and the fp32 main parameters, in the distributed optimizer's
    /// `fully_reshardable` form (model-space tensors any TP/PP/DP layout loads).
    Carried,
}

/// What an export of checkpoint `meta` holding `tensors` can carry.
pub(crate) fn state_export(
    meta: &CheckpointMeta,
    tensors: &std::collections::HashMap<String, Vec<f32>>,
) -> StateExport {
    if meta.iteration == 0 || !tensors.keys().any(|k| k.starts_with("optimizer.")) {
        return StateExport::Nothing;
    }
    if meta.optimizer != "adam" {
        return StateExport::Refused(format!(
            "the state of --optimizer {} (the export carries Adam's)",
            meta.optimizer
        ));
    }
    StateExport::Carried
}

/// What an export of checkpoint `meta` carries, where a refused state is announced and the
/// export holds the weights alone.
pub(crate) fn exported_state(
    meta: &CheckpointMeta,
    tensors: &std::collections::HashMap<String, Vec<f32>>,
) -> StateExport {
    match state_export(meta, tensors) {
        StateExport::Refused(why) => {
            eprintln!(
                "WARNING: the optimizer state at iteration {} is not exported: {why}. The export \
                 holds the weights alone, a release checkpoint Megatron-LM starts from",
                meta.iteration
            );
            StateExport::Nothing
        }
        other => other,
    }
}

/// The directory an export is written to under its save directory and what the tracker says:
/// the iteration's own where it carries the run's state (Megatron-LM loads optimizer state only
/// from an iteration's directory), `release` for weights alone.
pub(crate) fn export_dir_name(meta: &CheckpointMeta, state: &StateExport) -> (String, String) {
    match state {
        StateExport::Carried => (
            format!("iter_{:07}", meta.iteration),
            meta.iteration.to_string(),
        ),
        _ => ("release".to_string(), "release".to_string()),
    }
}

/// Writes Megatron's tracker, `latest_checkpointed_iteration.txt`, under a temporary name and
/// renames it: it goes last, naming a directory already complete.
pub(crate) fn write_tracker(output: &std::path::Path, text: &str) -> Result<(), crate::TrainError> {
    let tracker = output.join("latest_checkpointed_iteration.txt");
    let tmp = output.join("latest_checkpointed_iteration.txt.partial");
    std::fs::write(&tmp, text).map_err(crate::io_err(&tmp))?;
    std::fs::rename(&tmp, &tracker).map_err(crate::io_err(&tracker))
}

/// Where Megatron-LM keeps an MoE run's expert state: in its one optimizer (expert-parallel
/// size 1, expert TP equal to TP), or in a second one chained after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertOptimizer {
    Shared,
    Chained,
}

/// The optimizer a Megatron-LM run loads an export into (its `--use-distributed-optimizer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerForm {
    /// The distributed optimizer, from its `fully_reshardable` form.
    #[default]
    Distributed,
    /// The non-distributed optimizers: `FP32Optimizer`, or under `--bf16`/`--fp16`
    /// `Float16OptimizerWithFloat16Params` with its fp32 main copies (`fp32_param`).
    NonDistributed,
}

/// The megatron-core keys of parameter `name`'s optimizer state (the parameter's own sharded
/// key under each prefix) and this checkpoint's names of the same tensors: the main
/// parameter is the weights themselves (this engine's checkpoints hold the fp32 copy). The
/// non-distributed form names the main copy `fp32_param`, which an fp32 run does not ask for
/// (megatron-core then leaves the key unread).
pub(crate) fn exported_state_names(name: &str, form: OptimizerForm) -> [(&'static str, String); 3] {
    let main = match form {
        OptimizerForm::Distributed => "optimizer.state.param.",
        OptimizerForm::NonDistributed => "optimizer.state.fp32_param.",
    };
    [
        (main, name.to_string()),
        (
            "optimizer.state.exp_avg.",
            format!("optimizer.exp_avg.{name}"),
        ),
        (
            "optimizer.state.exp_avg_sq.",
            format!("optimizer.exp_avg_sq.{name}"),
        ),
    ]
}

/// The common-state entries that carry the run on: the distributed optimizer's parameter
/// groups (decayed and not, matched by Megatron-LM on load by their `wd_mult`/`lr_mult`/
/// `max_lr`/`min_lr`; each with the step), the scheduler's state and the sharding form.
/// Which of an optimizer's two parameter groups (decayed, not decayed) have parameters: the
/// non-distributed optimizer's state lists exactly those (megatron-core merges the saved list
/// with the loading run's, which must be as long).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GroupsPresent {
    pub dense: [bool; 2],
    pub experts: [bool; 2],
}

impl GroupsPresent {
    /// From the parameters `(name, shape)` by Megatron's rule (biases and 1-D parameters are
    /// not decayed), the experts apart where `experts` says they have their own optimizer.
    pub(crate) fn of<'a>(
        params: impl Iterator<Item = (&'a str, &'a [usize])>,
        experts: ExpertOptimizer,
    ) -> Self {
        let mut g = GroupsPresent {
            dense: [false; 2],
            experts: [false; 2],
        };
        for (name, shape) in params {
            let plain = usize::from(shape.len() == 1 || name.ends_with(".bias"));
            let expert = experts == ExpertOptimizer::Chained && name.contains(".mlp.experts.");
            if expert {
                g.experts[plain] = true;
            } else {
                g.dense[plain] = true;
            }
        }
        g
    }
}

/// One of Megatron's parameter groups as its optimizer state lists it, without its
/// parameters: decayed (`wd_mult` 1) or not (0), of the experts or not. The scheduler sets
/// every group's lr and weight decay again when it loads; these are the values the run
/// stopped with. The distributed optimizer keeps the step in each group, the non-distributed
/// ones beside the state.
pub(crate) fn param_group(
    meta: &CheckpointMeta,
    experts: bool,
    wd_mult: f64,
    form: OptimizerForm,
) -> Vec<(&'static str, Pickle)> {
    let s = &meta.scheduler;
    let lr = s.get_lr();
    let wd = super::decimal(meta.weight_decay.unwrap_or(0.0));
    let mut entries = vec![
        ("is_expert_parallel", Pickle::Bool(experts)),
        ("default_config", Pickle::Bool(true)),
        ("wd_mult", Pickle::Float(wd_mult)),
        ("lr_mult", Pickle::Float(1.0)),
        ("is_decoupled_lr", Pickle::Bool(false)),
        ("max_lr", Pickle::Float(s.max_lr)),
        ("min_lr", Pickle::Float(s.min_lr)),
        ("lr", Pickle::Float(lr)),
        (
            "betas",
            Pickle::Tuple(vec![
                Pickle::Float(super::decimal(meta.adam_beta1)),
                Pickle::Float(super::decimal(meta.adam_beta2)),
            ]),
        ),
        ("eps", Pickle::Float(super::decimal(meta.adam_eps))),
        ("weight_decay", Pickle::Float(wd * wd_mult)),
        ("amsgrad", Pickle::Bool(false)),
        ("maximize", Pickle::Bool(false)),
        ("foreach", Pickle::None),
        ("capturable", Pickle::Bool(false)),
        ("differentiable", Pickle::Bool(false)),
        ("fused", Pickle::None),
        ("decoupled_weight_decay", Pickle::Bool(true)),
    ];
    if form == OptimizerForm::Distributed {
        entries.push(("step", Pickle::Float(meta.optimizer_step as f64)));
    }
    entries
}

/// The learning-rate scheduler's state. Without start_wd and its kin: Megatron-LM checks those
/// against totals (its --train-iters) this checkpoint does not record, and takes its flags'
/// instead.
pub(crate) fn scheduler_state(meta: &CheckpointMeta) -> Pickle {
    let s = &meta.scheduler;
    let style = match s.decay_style {
        LrDecayStyle::Constant => "constant",
        LrDecayStyle::Linear => "linear",
        LrDecayStyle::Cosine => "cosine",
        LrDecayStyle::InverseSquareRoot => "inverse-square-root",
        LrDecayStyle::WSD => "WSD",
    };
    let int = |v: u64| Pickle::Int(v as i64);
    Pickle::dict([
        ("max_lr", Pickle::Float(s.max_lr)),
        ("lr_warmup_steps", int(s.warmup_steps)),
        ("num_steps", int(s.num_steps)),
        ("lr_decay_style", Pickle::str(style)),
        ("lr_decay_steps", int(s.decay_steps)),
        ("min_lr", Pickle::Float(s.min_lr)),
    ])
}

/// An fp16 run's loss scaler as each of its optimizers saves it (Megatron's
/// `DynamicGradScaler` state: the scale a one-element tensor, made by `scale_tensor`, the
/// trackers ints; a constant scaler keeps none).
pub(crate) fn grad_scaler_state(
    meta: &CheckpointMeta,
    scale_tensor: impl FnOnce(f32) -> Pickle,
) -> Option<Pickle> {
    meta.grad_scaler.as_ref().map(|g| match g {
        GradScaler::Dynamic {
            growth_tracker,
            hysteresis_tracker,
            ..
        } => Pickle::dict([
            ("scale", scale_tensor(g.scale())),
            ("growth_tracker", Pickle::Int(*growth_tracker as i64)),
            (
                "hysteresis_tracker",
                Pickle::Int(*hysteresis_tracker as i64),
            ),
        ]),
        GradScaler::Constant { .. } => Pickle::dict([]),
    })
}

pub(crate) fn exported_common_state(
    meta: &CheckpointMeta,
    experts: ExpertOptimizer,
    (form, present): (OptimizerForm, GroupsPresent),
) -> (Vec<(&'static str, Pickle)>, Storages) {
    // One optimizer, holding both groups (decayed and not): the load looks up the groups the
    // run has. An MoE run's experts have groups of their own in it, or, where Megatron-LM
    // chains a second optimizer for them, that one's (a dict by index). An fp16 run's loss
    // scaler is in each optimizer.
    let mut storages: Storages = Vec::new();
    let scaler = grad_scaler_state(meta, |scale| {
        storages.push(("scale".to_string(), scale.to_le_bytes().to_vec()));
        f32_tensor_pickle("scale", &[1])
    });
    if form == OptimizerForm::NonDistributed {
        storages.push((
            "common_step".to_string(),
            (meta.optimizer_step as f32).to_le_bytes().to_vec(),
        ));
    }
    let entries = |groups: Vec<Pickle>| {
        let mut e = match form {
            OptimizerForm::Distributed => vec![
                (
                    Pickle::str("optimizer"),
                    Pickle::dict([("param_groups", Pickle::List(groups))]),
                ),
                (
                    Pickle::str("param_state_sharding_type"),
                    Pickle::str("fully_reshardable"),
                ),
            ],
            // `FP32Optimizer` loads the torch optimizer's own dict; the mixed-precision one
            // the same under `optimizer`: both are written, each reads its own.
            OptimizerForm::NonDistributed => {
                let inner = || {
                    vec![
                        (
                            Pickle::str("state"),
                            Pickle::dict([("common_step", f32_tensor_pickle("common_step", &[]))]),
                        ),
                        (Pickle::str("param_groups"), Pickle::List(groups.clone())),
                    ]
                };
                let mut e = inner();
                e.push((Pickle::str("optimizer"), Pickle::Dict(inner())));
                e
            }
        };
        e.extend(scaler.clone().map(|s| (Pickle::str("grad_scaler"), s)));
        e
    };
    // Both groups of each optimizer for the distributed one (which pairs the groups it has
    // with saved ones by their settings), those with parameters for the other.
    let kept = |experts: bool, wd_mult: f64| {
        let present = if experts {
            present.experts
        } else {
            present.dense
        };
        form == OptimizerForm::Distributed || present[usize::from(wd_mult == 0.0)]
    };
    let groups_of = |experts: bool| -> Vec<Pickle> {
        [1.0, 0.0]
            .into_iter()
            .filter(|&wd| kept(experts, wd))
            .map(|wd| Pickle::dict(param_group(meta, experts, wd, form)))
            .collect()
    };
    let dense = || groups_of(false);
    let expert_groups = || groups_of(true);
    let optimizers = match (meta.model.moe.is_some(), experts) {
        (false, _) => Pickle::Dict(entries(dense())),
        // The non-distributed optimizer keeps experts in the dense groups when they are not
        // split apart (expert-parallel size 1).
        (true, ExpertOptimizer::Shared) if form == OptimizerForm::NonDistributed => {
            Pickle::Dict(entries(dense()))
        }
        (true, ExpertOptimizer::Shared) => Pickle::Dict(entries(
            dense().into_iter().chain(expert_groups()).collect(),
        )),
        (true, ExpertOptimizer::Chained) => Pickle::Dict(vec![
            (Pickle::Int(0), Pickle::Dict(entries(dense()))),
            (Pickle::Int(1), Pickle::Dict(entries(expert_groups()))),
        ]),
    };
    let entries = vec![
        ("optimizer", optimizers),
        ("opt_param_scheduler", scheduler_state(meta)),
        (
            "content_metadata",
            match form {
                OptimizerForm::Distributed => Pickle::dict([
                    (
                        "distrib_optim_sharding_type",
                        Pickle::str("fully_reshardable"),
                    ),
                    (
                        "distrib_optim_fully_reshardable_mem_efficient",
                        Pickle::Bool(false),
                    ),
                    ("singleton_local_shards", Pickle::Bool(false)),
                    ("chained_optim_avoid_prefix", Pickle::Bool(true)),
                ]),
                OptimizerForm::NonDistributed => Pickle::dict([
                    ("singleton_local_shards", Pickle::Bool(false)),
                    ("chained_optim_avoid_prefix", Pickle::Bool(true)),
                ]),
            },
        ),
    ];
    (entries, storages)
}
