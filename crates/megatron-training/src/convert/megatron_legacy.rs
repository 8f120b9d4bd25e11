//! `megatron convert --from torch`: Megatron-LM's legacy `--ckpt-format torch` checkpoints,
//! read without PyTorch. An iteration directory holds one `torch.save` archive per
//! model-parallel rank, `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` (tensor, pipeline and
//! expert-parallel rank, as Megatron's `get_checkpoint_name` names them), each with the `args`
//! Namespace and that rank's `model` state dict (`model0`, `model1`, ... for interleaved
//! stages): local layer numbers, tensor-parallel shards, the rank's own experts. The model
//! comes from the saved arguments as for torch_dist; each tensor is put together from the
//! ranks' shards along its tensor-parallel dimension (the SwiGLU `linear_fc1` as each rank's
//! `[gate_r; up_r]`), layers numbered by the order Megatron assigns them to stages and chunks,
//! experts by their expert-parallel rank.

use super::megatron_legacy_state::{read_legacy_run_state, Piece, Placed};
use super::megatron_lm::{
    expert_of, finish, is_mla_down_projection, model_of_args, mtp_layer_of, stored_names,
    wanted_tensors,
};
use super::megatron_lm_state::continued_run;
use super::pickle::PyValue;
use super::torch_dist::tracked_iteration;
use super::torch_save::{tensor_shape, TorchArchive};
use super::Tensors;
use crate::TrainError;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One rank's file, opened.
struct RankFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// The model-parallel coordinates a directory name gives: its numbers after `mp_rank_`.
fn coordinates(name: &str) -> Option<Vec<usize>> {
    name.strip_prefix("mp_rank_")?
        .split('_')
        .map(|n| n.parse().ok())
        .collect()
}

/// The iteration directory of `dir` that holds `mp_rank_*` directories.
fn resolve(dir: &Path) -> Result<PathBuf, String> {
    let has_ranks = |d: &Path| d.join("mp_rank_00").exists() || d.join("mp_rank_00_000").exists();
    if has_ranks(dir) {
        return Ok(dir.to_path_buf());
    }
    let (d, sub) = tracked_iteration(dir, || {
        format!(
            "{}: neither a --ckpt-format torch iteration directory (no mp_rank_00*) nor a save directory (no latest_checkpointed_iteration.txt)",
            dir.display()
        )
    })?;
    if has_ranks(&d) {
        Ok(d)
    } else if d.join(".metadata").exists() {
        Err(format!(
            "{}: a torch_dist checkpoint: convert it with --from torch_dist",
            d.display()
        ))
    } else {
        Err(format!(
            "{}: the tracker names {sub}, which holds no mp_rank_* directories (an unfinished save?)",
            d.display()
        ))
    }
}

/// A saved integer argument (`default` where absent or None).
fn arg(args: &PyValue, name: &str, default: usize) -> usize {
    args.attr(name)
        .and_then(|v| v.as_int())
        .map_or(default, |v| v as usize)
}

/// Converts the `--ckpt-format torch` checkpoint `input` (a save directory or an iteration
/// directory) into a megatron-rs checkpoint under `output`: the weights, and the run's optimizer
/// state where it holds Adam's (`megatron_legacy_state`).
pub fn torch_to_megatron(input: &Path, output: &Path) -> Result<PathBuf, TrainError> {
    let fail_in = |msg: String| TrainError::Checkpoint {
        path: input.display().to_string(),
        msg,
    };
    let dir = resolve(input).map_err(fail_in)?;
    let fail = |msg: String| TrainError::Checkpoint {
        path: dir.display().to_string(),
        msg,
    };
    // Every rank's file, by its directory's coordinates.
    let mut files: BTreeMap<Vec<usize>, RankFile> = BTreeMap::new();
    for e in std::fs::read_dir(&dir).map_err(crate::io_err(&dir))? {
        let e = e.map_err(crate::io_err(&dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(c) = coordinates(&name) else {
            continue;
        };
        let path = ["model_optim_rng.pt", "model_rng.pt"]
            .iter()
            .map(|f| e.path().join(f))
            .find(|p| p.exists())
            .ok_or_else(|| fail(format!("{name} holds no model_optim_rng.pt")))?;
        let f = std::fs::File::open(&path)
            .map_err(|e| fail(format!("{}: cannot open: {e}", path.display())))?;
        // SAFETY: the file is only read, and a checkpoint being converted is not written.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(crate::io_err(&path))?;
        files.insert(c, RankFile { path, map });
    }
    let archives: BTreeMap<Vec<usize>, (PathBuf, TorchArchive)> = files
        .iter()
        .map(|(c, f)| {
            TorchArchive::read(&f.map)
                .map(|a| (c.clone(), (f.path.clone(), a)))
                .map_err(|e| fail(format!("{}: {e}", f.path.display())))
        })
        .collect::<Result<_, _>>()?;
    let first = archives
        .values()
        .next()
        .ok_or_else(|| fail("no mp_rank_* files".into()))?;
    let args = first
        .1
        .object
        .get("args")
        .filter(|a| a.class_name().as_deref() == Some("argparse.Namespace"))
        .ok_or_else(|| fail(format!("{}: no args Namespace", first.0.display())))?;
    let tp = arg(args, "tensor_model_parallel_size", 1);
    let pp = arg(args, "pipeline_model_parallel_size", 1);
    let ep = arg(args, "expert_model_parallel_size", 1);
    let etp = arg(args, "expert_tensor_parallel_size", tp);
    // The name's numbers: tensor rank, then the pipeline rank where PP > 1 and the expert rank
    // where EP > 1.
    let rank_of = |c: &[usize]| -> Option<(usize, usize, usize)> {
        let mut it = c.iter().copied();
        let t = it.next()?;
        let p = if pp > 1 { it.next()? } else { 0 };
        let e = if ep > 1 { it.next()? } else { 0 };
        it.next().is_none().then_some((t, p, e))
    };
    let mut by_rank: BTreeMap<(usize, usize, usize), &(PathBuf, TorchArchive)> = BTreeMap::new();
    for (c, a) in &archives {
        let r = rank_of(c).ok_or_else(|| {
            fail(format!(
                "{}: a rank directory that is not TP {tp} x PP {pp} x EP {ep}'s",
                a.0.display()
            ))
        })?;
        by_rank.insert(r, a);
    }
    for t in 0..tp {
        for p in 0..pp {
            for e in 0..ep {
                if !by_rank.contains_key(&(t, p, e)) {
                    return Err(fail(format!(
                        "the file of tensor rank {t}, pipeline rank {p}, expert rank {e} is missing"
                    )));
                }
            }
        }
    }
    if etp != tp && etp != 1 {
        return Err(fail(format!(
            "expert tensor parallelism {etp} beside tensor parallelism {tp}: read here where they are equal or the experts are whole (1)"
        )));
    }
    let rows = arg(args, "padded_vocab_size", 0);
    let (cfg, tokenizer, flags) = model_of_args(args, rows).map_err(fail)?;
    // Each stage's model chunks (`model`, or `model0`.. under interleaving) and their layers.
    let chunks_of = |a: &TorchArchive| -> Vec<BTreeMap<String, PyValue>> {
        let one = |v: &PyValue| match v {
            PyValue::Dict(e) => e
                .iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v.clone())))
                .collect(),
            _ => BTreeMap::new(),
        };
        match a.object.get("model") {
            Some(m) => vec![one(m)],
            None => (0..)
                .map_while(|i| a.object.get(&format!("model{i}")))
                .map(one)
                .collect(),
        }
    };
    let stages: BTreeMap<(usize, usize, usize), Vec<BTreeMap<String, PyValue>>> =
        by_rank.iter().map(|(r, a)| (*r, chunks_of(&a.1))).collect();
    let vp = stages[&(0, 0, 0)].len();
    // Megatron's interleaved order: chunk 0 of every stage, then chunk 1, ...
    let layers_in = |m: &BTreeMap<String, PyValue>| -> usize {
        m.keys()
            .filter_map(|k| {
                k.strip_prefix("decoder.layers.")?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .collect::<BTreeSet<_>>()
            .len()
    };
    let mut place: Vec<(usize, usize, usize)> = Vec::new(); // global layer -> (stage, chunk, local)
    for v in 0..vp {
        for p in 0..pp {
            let chunk = stages[&(0, p, 0)]
                .get(v)
                .ok_or_else(|| fail(format!("pipeline rank {p} has no model chunk {v}")))?;
            for i in 0..layers_in(chunk) {
                place.push((p, v, i));
            }
        }
    }
    if place.len() != cfg.num_layers {
        return Err(fail(format!(
            "the stages hold {} layers, the saved arguments say {}",
            place.len(),
            cfg.num_layers
        )));
    }
    let experts_per_rank = cfg.moe.as_ref().map_or(1, |m| m.num_experts / ep);
    let mut tensors = Tensors::new();
    let mut placed = Vec::new();
    for mut wanted in wanted_tensors(&cfg) {
        let (name, shape) = (wanted.name.clone(), wanted.shape.clone());
        // Where the tensor lives: (stage, chunk), expert rank, and the local names to try. A
        // decoder layer's parameters are under its stage-local number; an MTP depth's layer
        // under `mtp.layers.{k}.mtp_model_layer.` of the last stage.
        let layer = match mtp_layer_of(&name) {
            Some((k, rest)) => Some((
                (pp - 1, vp - 1),
                format!("mtp.layers.{k}.mtp_model_layer."),
                rest,
            )),
            None => name.strip_prefix("decoder.layers.").and_then(|r| {
                let (l, rest) = r.split_once('.')?;
                let (p, v, i) = *place.get(l.parse::<usize>().ok()?)?;
                Some(((p, v), format!("decoder.layers.{i}."), rest))
            }),
        };
        let (stage, chunk, e_rank, local_names, expert) = match layer {
            Some(((p, v), at, rest)) => {
                let (stored, expert) = expert_of(rest);
                let names: Vec<String> = match expert {
                    Some(e) => {
                        let local = e % experts_per_rank;
                        let tail = stored.trim_start_matches("mlp.experts.experts.");
                        let (module, param) = tail.rsplit_once('.').unwrap_or((tail, ""));
                        vec![
                            // SequentialMLP, and Transformer Engine's grouped linear.
                            format!("{at}mlp.experts.local_experts.{local}.{tail}"),
                            format!("{at}mlp.experts.{module}.{param}{local}"),
                        ]
                    }
                    None => stored_names(rest)
                        .into_iter()
                        .rev()
                        .map(|s| format!("{at}{s}"))
                        .collect(),
                };
                (
                    p,
                    v,
                    expert.map_or(0, |e| e / experts_per_rank),
                    names,
                    expert.is_some(),
                )
            }
            None => {
                // The embedding on the first stage's first chunk; the rest on the last's.
                let (p, v) = if name.starts_with("embedding.") {
                    (0, 0)
                } else {
                    (pp - 1, vp - 1)
                };
                (p, v, 0, vec![name.clone()], false)
            }
        };
        let group = if expert { etp } else { tp };
        if is_mla_down_projection(&name) && group > 1 {
            // Column-parallel under megatron-core's local spec, duplicated under Transformer
            // Engine's: the first rank's rows say which.
            let model = &stages[&(0, stage, e_rank)][chunk];
            let rows = local_names
                .iter()
                .find_map(|n| model.get(n))
                .and_then(tensor_shape)
                .and_then(|s| s.first().copied());
            if rows.is_some_and(|r| r * group == shape[0]) {
                wanted.split = Some((0, 1));
            }
        }
        let split = if group == 1 { None } else { wanted.split };
        let ranks = if split.is_some() { group } else { 1 };
        let mut pieces = Vec::with_capacity(ranks);
        let mut sources = Vec::with_capacity(ranks);
        for t in 0..ranks {
            let file = &by_rank[&(t, stage, e_rank)];
            let model = &stages[&(t, stage, e_rank)][chunk];
            let (local, value) = local_names
                .iter()
                .find_map(|n| model.get(n).map(|v| (n, v)))
                .ok_or_else(|| {
                    fail(format!(
                        "{}: no {} (for {name})",
                        file.0.display(),
                        local_names.join(" or ")
                    ))
                })?;
            let tensor = file
                .1
                .tensor(value)
                .map_err(|e| fail(format!("{}: {local}: {e}", file.0.display())))?;
            sources.push(Piece {
                rank: (t, stage, e_rank),
                chunk,
                local: local.clone(),
            });
            pieces.push((local.clone(), tensor));
        }
        let values = assemble(&name, &shape, split, pieces).map_err(fail)?;
        tensors.insert(name, (shape, values));
        placed.push(Placed {
            tensor: wanted,
            pieces: sources,
        });
    }
    let iteration = first.1.object.get("iteration").and_then(|i| i.as_int());
    let state = read_legacy_run_state(&by_rank, args, &placed).map_err(fail)?;
    let run = continued_run(state, &mut tensors);
    finish(
        (output, &dir, "--ckpt-format torch"),
        (args, iteration, &flags),
        cfg,
        (tensors, run),
        tokenizer,
    )
}

/// The global tensor `name` of `shape` from its ranks' shards, in tensor-parallel rank order:
/// along dimension `d` the global tensor is `c` blocks, and rank `r` holds the `r`-th part of
/// each.
fn assemble(
    name: &str,
    shape: &[usize],
    split: Option<(usize, usize)>,
    pieces: Vec<(String, super::torch_save::TorchTensor)>,
) -> Result<Vec<f32>, String> {
    let Some((d, c)) = split else {
        let (local, t) = pieces.into_iter().next().expect("one piece");
        if t.shape != shape {
            return Err(format!(
                "{local} has shape {:?}, the model's {name} is {shape:?}",
                t.shape
            ));
        }
        return Ok(t.values);
    };
    let ranks = pieces.len();
    let mut local_shape = shape.to_vec();
    local_shape[d] /= ranks;
    for (local, t) in &pieces {
        if t.shape != local_shape || !super::tp_shards::splits_evenly(shape, (d, c), ranks) {
            return Err(format!(
                "{local} has shape {:?}, one of {ranks} shards of the model's {name} {shape:?} is {local_shape:?}",
                t.shape
            ));
        }
    }
    let mut out = vec![0.0f32; shape.iter().product()];
    for (r, (_, t)) in pieces.iter().enumerate() {
        super::tp_shards::place_shard(&mut out, shape, (d, c), ranks, r, &t.values);
    }
    Ok(out)
}
