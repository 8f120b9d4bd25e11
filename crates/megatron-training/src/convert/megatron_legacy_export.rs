//! `megatron convert --to torch`: a megatron-rs checkpoint as Megatron-LM's legacy
//! `--ckpt-format torch` checkpoint, at the layout (TP, PP, virtual stages, EP) the run that
//! loads it will have. Megatron-LM loads that format only at the layout it was saved at, so the
//! layout is chosen here; this is also the format of older Megatron-LM releases and of the
//! tools that read `mp_rank_*/model_optim_rng.pt` files.
//!
//! Each model-parallel rank's file holds the saved arguments, the rank's model state dict
//! (`model`, or `model0`, `model1`, ... under interleaving) and, for a run that saved it, the
//! non-distributed optimizer's state (torch's Adam state by parameter index, and the fp32 main
//! copies by group for a bf16/fp16 run). The state dict is megatron-core's local layer spec's:
//! stage-local layer numbers, tensor-parallel shards, the rank's own experts renumbered from 0,
//! a `None` `_extra_state` per linear module, the tied output layer's copy on the last of
//! several stages. Its order is the order megatron-core's modules register their parameters,
//! which is also the order of the optimizer's parameter indices; a tensor whose place in that
//! order is not known here is refused rather than guessed.
//!
//! Not written: the distributed optimizer's `distrib_optim.pt` (its gradient-bucket layout is
//! Megatron-LM's to compute at load time; `--to torch_dist` carries that state instead), and an
//! RNG state (this engine's streams are counter-based, not torch's): a run continuing from an
//! iteration directory loads it with `--no-load-rng`.

use super::megatron_lm::{
    is_mla_down_projection, mtp_layer_of, saved_args, wanted_tensors, CkptFormat, LayerSpec,
    SavedLayout, TensorKind,
};
use super::megatron_lm_state::{
    export_dir_name, exported_state, grad_scaler_state, param_group, scheduler_state,
    write_tracker, ExpertOptimizer, GroupsPresent, OptimizerForm, StateExport,
};
use super::pickle_writer::Pickle;
use super::torch_save::{f32_tensor_pickle, save_archive};
use super::tp_shards::{shard_of, splits_evenly};
use crate::TrainError;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The layout of the Megatron-LM run that loads a legacy export, in its flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LegacyLayout {
    pub tp: usize,
    pub pp: usize,
    /// `--num-layers-per-virtual-pipeline-stage` (interleaved stages).
    pub layers_per_virtual_stage: Option<usize>,
    pub ep: usize,
}

/// The layout resolved against the model: model chunks per stage (`vp`, 1 without
/// interleaving).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    tp: usize,
    pp: usize,
    vp: usize,
    ep: usize,
}

/// What a legacy export carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LegacyState {
    /// The optimizer state where the checkpoint holds Adam's past iteration 0.
    IfSaved,
    /// `--no-save-optim`: the weights alone, a release checkpoint.
    WeightsOnly,
}

/// One entry of a rank's model state dict.
#[derive(Clone, Debug)]
struct Entry {
    /// The name in the rank's state dict.
    local: String,
    /// Its place in megatron-core's registration order within the model chunk.
    key: Vec<usize>,
    /// The expert-parallel rank whose file holds it (`None`: every expert rank's).
    expert_rank: Option<usize>,
    what: EntryKind,
}

#[derive(Clone, Debug)]
enum EntryKind {
    /// A model tensor (or the shard of it this rank holds): the engine's name of the tensor
    /// whose values it holds and whose optimizer state it has.
    Tensor {
        source: String,
        split: Option<(usize, usize)>,
        kind: TensorKind,
    },
    /// A linear module's `_extra_state` (`None`: no fp8 metadata).
    ExtraState,
}

/// The order megatron-core's local spec registers a layer's modules in (`TransformerLayer`,
/// `SelfAttention`/`MLASelfAttention`, `MLP`/`MoELayer`, `SharedExpertMLP`): the module's rank
/// and its sub-position. A module registers its own parameters before its children's.
const LAYER_MODULES: &[(&str, [usize; 2])] = &[
    ("input_layernorm", [0, 0]),
    ("self_attention.core_attention", [1, 0]),
    ("self_attention.linear_proj", [1, 1]),
    ("self_attention.linear_qkv", [1, 2]),
    ("self_attention.linear_q_proj", [1, 3]),
    ("self_attention.linear_q_down_proj", [1, 4]),
    ("self_attention.linear_q_up_proj", [1, 5]),
    ("self_attention.linear_kv_down_proj", [1, 6]),
    ("self_attention.linear_kv_up_proj", [1, 7]),
    ("self_attention.q_layernorm", [1, 8]),
    ("self_attention.k_layernorm", [1, 9]),
    ("self_attention.kv_layernorm", [1, 10]),
    ("pre_mlp_layernorm", [2, 0]),
    ("mlp.linear_fc1", [3, 0]),
    ("mlp.linear_fc2", [3, 1]),
    ("mlp.router", [4, 0]),
    // Routed experts: [5, expert, sub] below.
    ("mlp.shared_experts", [6, 0]),
    ("mlp.shared_experts.linear_fc1", [6, 1]),
    ("mlp.shared_experts.linear_fc2", [6, 2]),
];

/// A module's parameters and buffers in the order it registers them, then its extra state.
fn param_rank(param: &str) -> Option<usize> {
    match param {
        "weight" => Some(0),
        "bias" => Some(1),
        "gate_weight" => Some(0),
        "softmax_offset" => Some(0),
        "expert_bias" => Some(2),
        "_extra_state" => Some(3),
        _ => None,
    }
}

/// Whether `module` is a linear layer (with an `_extra_state`).
fn is_linear(module: &str) -> bool {
    let last = module.rsplit('.').next().unwrap_or(module);
    last.starts_with("linear_") || last == "eh_proj" || last == "output_layer"
}

/// The place of layer parameter `rest` (a name under `decoder.layers.<l>.`) in its layer's
/// registration order, with routed experts at their global index (a rank's experts keep it).
fn layer_key(rest: &str) -> Option<Vec<usize>> {
    let (module, param) = rest.rsplit_once('.')?;
    let p = param_rank(param)?;
    if let Some(r) = module.strip_prefix("mlp.experts.local_experts.") {
        let (e, m) = r.split_once('.')?;
        let sub = match m {
            "linear_fc1" => 0,
            "linear_fc2" => 1,
            _ => return None,
        };
        return Some(vec![5, e.parse().ok()?, sub, p]);
    }
    let [rank, sub] = LAYER_MODULES.iter().find(|(m, _)| *m == module)?.1;
    Some(vec![rank, 0, sub, p])
}

/// `rest` with its routed expert renumbered from the first expert of its expert-parallel
/// rank, and that rank.
fn local_expert(rest: &str, per_rank: usize) -> (String, Option<usize>) {
    if let Some(r) = rest.strip_prefix("mlp.experts.local_experts.") {
        if let Some((e, tail)) = r.split_once('.') {
            if let Ok(e) = e.parse::<usize>() {
                return (
                    format!("mlp.experts.local_experts.{}.{tail}", e % per_rank),
                    Some(e / per_rank),
                );
            }
        }
    }
    (rest.to_string(), None)
}

/// Where a tensor goes: its (stage, chunk), its local name and its key in the chunk's order.
struct Placement {
    chunk: (usize, usize),
    local: String,
    key: Vec<usize>,
    expert_rank: Option<usize>,
}

/// The place of the engine's tensor `name` at `layout`, with the stage-local number and chunk
/// of each decoder layer in `place`.
fn placement(
    name: &str,
    layout: Layout,
    place: &[(usize, usize, usize)],
    experts_per_rank: usize,
) -> Result<Placement, String> {
    let last = (layout.pp - 1, layout.vp - 1);
    let unknown = || {
        format!(
            "{name}: where megatron-core registers this tensor is not known to the legacy export"
        )
    };
    let top = |section: usize, sub: usize, param: &str| -> Result<Vec<usize>, String> {
        Ok(vec![section, sub, param_rank(param).ok_or_else(unknown)?])
    };
    if let Some(rest) = name.strip_prefix("decoder.layers.") {
        let (l, rest) = rest.split_once('.').ok_or_else(unknown)?;
        let l: usize = l.parse().map_err(|_| unknown())?;
        let &(p, v, i) = place.get(l).ok_or_else(unknown)?;
        let mut key = vec![1, i];
        key.extend(layer_key(rest).ok_or_else(unknown)?);
        let (rest, expert_rank) = local_expert(rest, experts_per_rank);
        return Ok(Placement {
            chunk: (p, v),
            local: format!("decoder.layers.{i}.{rest}"),
            key,
            expert_rank,
        });
    }
    if let Some((k, rest)) = mtp_layer_of(name) {
        let mut key = vec![3, k, 3];
        key.extend(layer_key(rest).ok_or_else(unknown)?);
        let (rest, expert_rank) = local_expert(rest, experts_per_rank);
        return Ok(Placement {
            chunk: last,
            local: format!("mtp.layers.{k}.mtp_model_layer.{rest}"),
            key,
            expert_rank,
        });
    }
    let (module, param) = name.rsplit_once('.').ok_or_else(unknown)?;
    let (chunk, key) = match module {
        "embedding.word_embeddings" => ((0, 0), top(0, 0, param)?),
        "embedding.position_embeddings" => ((0, 0), top(0, 1, param)?),
        "decoder.final_layernorm" => (last, top(2, 0, param)?),
        "output_layer" => (last, top(4, 0, param)?),
        _ => {
            let r = module.strip_prefix("mtp.layers.").ok_or_else(unknown)?;
            let (k, part) = r.split_once('.').ok_or_else(unknown)?;
            let sub = match part {
                "enorm" => 0,
                "hnorm" => 1,
                "eh_proj" => 2,
                "final_layernorm" => 4,
                _ => return Err(unknown()),
            };
            let k: usize = k.parse().map_err(|_| unknown())?;
            (
                last,
                vec![3, k, sub, param_rank(param).ok_or_else(unknown)?],
            )
        }
    };
    Ok(Placement {
        chunk,
        local: name.to_string(),
        key,
        expert_rank: None,
    })
}

/// Every model chunk's state-dict entries, in registration order, by (stage, chunk).
fn chunk_entries(
    cfg: &megatron_core::transformer::config::TransformerConfig,
    layout: Layout,
) -> Result<BTreeMap<(usize, usize), Vec<Entry>>, String> {
    let per = cfg.num_layers / (layout.pp * layout.vp);
    // Megatron's interleaved assignment: chunk v of stage p holds the layers from
    // (v * PP + p) * per on.
    let mut place = vec![(0, 0, 0); cfg.num_layers];
    for v in 0..layout.vp {
        for p in 0..layout.pp {
            for i in 0..per {
                place[(v * layout.pp + p) * per + i] = (p, v, i);
            }
        }
    }
    let experts_per_rank = cfg.moe.as_ref().map_or(1, |m| m.num_experts / layout.ep);
    let mut chunks: BTreeMap<(usize, usize), Vec<Entry>> = BTreeMap::new();
    // Each linear module's extra state, once, by chunk, local name and expert rank (the
    // expert ranks' files name their own experts alike).
    type Where = ((usize, usize), String, Option<usize>);
    let mut linear: BTreeMap<Where, Entry> = BTreeMap::new();
    let mut push = |at: Placement, source: &str, split, kind| {
        if let Some((module, _)) = at.local.rsplit_once('.') {
            if is_linear(module) {
                let mut key = at.key.clone();
                *key.last_mut().expect("a key ends with the parameter") = 3;
                let local = format!("{module}._extra_state");
                let at_key = (at.chunk, local.clone(), at.expert_rank);
                linear.entry(at_key).or_insert(Entry {
                    local,
                    key,
                    expert_rank: at.expert_rank,
                    what: EntryKind::ExtraState,
                });
            }
        }
        chunks.entry(at.chunk).or_default().push(Entry {
            local: at.local,
            key: at.key,
            expert_rank: at.expert_rank,
            what: EntryKind::Tensor {
                source: source.to_string(),
                split,
                kind,
            },
        });
    };
    let mut embedding_split = None;
    for w in wanted_tensors(cfg) {
        let at = placement(&w.name, layout, &place, experts_per_rank)?;
        // megatron-core's local spec splits MLA's down projections by rows over TP.
        let split = if is_mla_down_projection(&w.name) {
            Some((0, 1))
        } else {
            w.split
        };
        if let Some(s) = split {
            if layout.tp > 1 && !splits_evenly(&w.shape, s, layout.tp) {
                return Err(format!(
                    "{} {:?} does not split evenly over --tensor-model-parallel-size {}",
                    w.name, w.shape, layout.tp
                ));
            }
        }
        if w.name == "embedding.word_embeddings.weight" {
            embedding_split = split;
        }
        push(at, &w.name, split, w.kind);
    }
    // The tied output layer: a copy of the embedding on the last stage where that is not the
    // first (its state is the embedding's: their gradients are all-reduced together); its
    // extra state wherever the output layer is.
    let output = placement("output_layer.weight", layout, &place, 1)?;
    if !cfg.untie_embeddings_and_output_weights {
        if layout.pp > 1 {
            push(
                output,
                "embedding.word_embeddings.weight",
                embedding_split,
                TensorKind::Parameter,
            );
        } else {
            let local = "output_layer._extra_state".to_string();
            linear.insert(
                (output.chunk, local.clone(), None),
                Entry {
                    local,
                    key: vec![4, 0, 3],
                    expert_rank: None,
                    what: EntryKind::ExtraState,
                },
            );
        }
    }
    for ((chunk, _, _), entry) in linear {
        chunks.entry(chunk).or_default().push(entry);
    }
    for entries in chunks.values_mut() {
        entries.sort_by(|a, b| a.key.cmp(&b.key));
    }
    Ok(chunks)
}

/// The layout `l` for this model, or why the model cannot be laid out so (naming the flag).
fn resolve_layout(
    cfg: &megatron_core::transformer::config::TransformerConfig,
    l: LegacyLayout,
) -> Result<Layout, String> {
    let flags = [
        ("--tensor-model-parallel-size", l.tp),
        ("--pipeline-model-parallel-size", l.pp),
        ("--expert-model-parallel-size", l.ep),
        (
            "--num-layers-per-virtual-pipeline-stage",
            l.layers_per_virtual_stage.unwrap_or(1),
        ),
    ];
    if let Some((flag, _)) = flags.iter().find(|(_, n)| *n == 0) {
        return Err(format!("{flag} must be at least 1"));
    }
    let groups = cfg.query_groups();
    if !cfg.num_attention_heads.is_multiple_of(l.tp) || !groups.is_multiple_of(l.tp) {
        return Err(format!(
            "{} attention heads ({groups} query groups) do not divide over --tensor-model-parallel-size {}",
            cfg.num_attention_heads, l.tp
        ));
    }
    if !cfg.num_layers.is_multiple_of(l.pp) {
        return Err(format!(
            "{} layers do not divide into --pipeline-model-parallel-size {} equal stages",
            cfg.num_layers, l.pp
        ));
    }
    let vp = match l.layers_per_virtual_stage {
        None => 1,
        Some(_) if l.pp == 1 => return Err(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size above 1"
                .into(),
        ),
        Some(per) if (cfg.num_layers / l.pp).is_multiple_of(per) => cfg.num_layers / l.pp / per,
        Some(per) => {
            return Err(format!(
                "--num-layers-per-virtual-pipeline-stage {per} does not divide a stage's {} layers",
                cfg.num_layers / l.pp
            ))
        }
    };
    match &cfg.moe {
        None if l.ep > 1 => {
            return Err(format!(
                "--expert-model-parallel-size {} for a model without experts",
                l.ep
            ))
        }
        Some(m) if !m.num_experts.is_multiple_of(l.ep) => {
            return Err(format!(
                "{} experts do not divide over --expert-model-parallel-size {}",
                m.num_experts, l.ep
            ))
        }
        _ => {}
    }
    if cfg.mtp.is_some() && l.pp > 1 {
        return Err("multi-token prediction over several pipeline stages (Megatron-LM keeps an embedding copy on the last stage for it), which the legacy export does not write: export at --pipeline-model-parallel-size 1, or --to torch_dist".into());
    }
    Ok(Layout {
        tp: l.tp,
        pp: l.pp,
        vp,
        ep: l.ep,
    })
}

/// The directory of the rank at tensor rank `t`, pipeline rank `p`, expert rank `e`, as
/// Megatron's `get_checkpoint_name` names it.
fn rank_dir(l: Layout, (t, p, e): (usize, usize, usize)) -> String {
    let mut s = format!("mp_rank_{t:02}");
    if l.pp > 1 {
        s += &format!("_{p:03}");
    }
    if l.ep > 1 {
        s += &format!("_{e:03}");
    }
    s
}

/// The storages of one rank file, by key.
#[derive(Default)]
struct Storages {
    entries: Vec<(String, Vec<u8>)>,
}

impl Storages {
    /// A new storage holding `values` as f32, and the tensor of `shape` viewing it.
    fn tensor(&mut self, values: &[f32], shape: &[usize]) -> Pickle {
        let key = self.entries.len().to_string();
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = f32_tensor_pickle(&key, shape);
        self.entries.push((key, bytes));
        t
    }
}

/// A parameter of a rank, for its optimizer state: its model tensor (shared with the state
/// dict's storage), the engine's name of its source and its local shape and name.
struct RankParam<'a> {
    local: &'a str,
    source: &'a str,
    /// The source's whole shape, and this rank's shard's.
    global_shape: &'a [usize],
    shape: Vec<usize>,
    split: Option<(usize, usize)>,
    model: Pickle,
}

/// `megatron convert --to torch`: the newest checkpoint under `input` as a Megatron-LM legacy
/// checkpoint at `layout` under `output` (see the module doc).
pub fn megatron_to_torch(
    input: &Path,
    output: &Path,
    layout: LegacyLayout,
    what: LegacyState,
) -> Result<PathBuf, TrainError> {
    let ck = match what {
        LegacyState::IfSaved => crate::checkpointing::load_checkpoint(input, None)?,
        LegacyState::WeightsOnly => crate::checkpointing::load_checkpoint_weights(input)?,
    };
    let cfg = ck.meta.model.clone();
    let fail = |msg: String| TrainError::Checkpoint {
        path: input.display().to_string(),
        msg,
    };
    let layout = resolve_layout(&cfg, layout).map_err(fail)?;
    let state = exported_state(&ck.meta, &ck.tensors);
    let carried = matches!(state, StateExport::Carried);
    let saved = SavedLayout {
        tp: layout.tp,
        pp: layout.pp,
        vp: layout.vp,
        ep: layout.ep,
        format: CkptFormat::Torch,
    };
    let args = saved_args(
        &cfg,
        &ck.meta,
        &state,
        (LayerSpec::Local, OptimizerForm::NonDistributed),
        saved,
    )
    .map_err(fail)?;
    let chunks = chunk_entries(&cfg, layout).map_err(fail)?;
    let (dir_name, tracker_text) = export_dir_name(&ck.meta, &state);
    let dir = output.join(&dir_name);
    let tmp = output.join(format!("{dir_name}.partial"));
    if dir.exists() {
        return Err(TrainError::Checkpoint {
            path: dir.display().to_string(),
            msg: "already exists (choose a new --output)".into(),
        });
    }
    let shapes: HashMap<&str, &[usize]> = ck
        .meta
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    let experts = if layout.ep > 1 {
        ExpertOptimizer::Chained
    } else {
        ExpertOptimizer::Shared
    };
    let present = GroupsPresent::of(
        wanted_tensors(&cfg)
            .iter()
            .filter(|w| w.kind == TensorKind::Parameter)
            .map(|w| {
                (
                    w.name.as_str(),
                    shapes.get(w.name.as_str()).copied().unwrap_or(&[]),
                )
            })
            .collect::<Vec<_>>()
            .into_iter(),
        experts,
    );
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(crate::io_err(&tmp))?;
    }
    let written = (|| -> Result<(), TrainError> {
        for t in 0..layout.tp {
            for p in 0..layout.pp {
                for e in 0..layout.ep {
                    let mut storages = Storages::default();
                    let mut params: Vec<RankParam> = Vec::new();
                    let mut models = Vec::new();
                    for v in 0..layout.vp {
                        let mut model = Vec::new();
                        let entries = chunks.get(&(p, v)).map_or(&[][..], |c| c.as_slice());
                        for entry in entries
                            .iter()
                            .filter(|x| x.expert_rank.is_none_or(|r| r == e))
                        {
                            let value = match &entry.what {
                                EntryKind::ExtraState => Pickle::None,
                                EntryKind::Tensor {
                                    source,
                                    split,
                                    kind,
                                } => {
                                    let shape = shapes.get(source.as_str()).ok_or_else(|| {
                                        fail(format!("the checkpoint has no tensor {source}"))
                                    })?;
                                    let values = &ck.tensors[source.as_str()];
                                    let (local_shape, shard) =
                                        shard(values, shape, *split, (layout.tp, t));
                                    let tensor = storages.tensor(&shard, &local_shape);
                                    if *kind == TensorKind::Parameter {
                                        params.push(RankParam {
                                            local: &entry.local,
                                            source,
                                            global_shape: shape,
                                            shape: local_shape,
                                            split: *split,
                                            model: tensor.clone(),
                                        });
                                    }
                                    tensor
                                }
                            };
                            model.push((entry.local.as_str(), value));
                        }
                        models.push(Pickle::dict(model));
                    }
                    let keys: Vec<String> = if layout.vp > 1 {
                        (0..layout.vp).map(|v| format!("model{v}")).collect()
                    } else {
                        vec!["model".into()]
                    };
                    let mut model_entries: Vec<(Pickle, Pickle)> =
                        keys.into_iter().map(Pickle::str).zip(models).collect();
                    if carried {
                        let optimizer = rank_optimizer(
                            &ck,
                            &params,
                            (layout.tp, t),
                            (experts, present),
                            &mut storages,
                        )
                        .map_err(fail)?;
                        model_entries.push((Pickle::str("optimizer"), optimizer));
                        model_entries.push((
                            Pickle::str("opt_param_scheduler"),
                            scheduler_state(&ck.meta),
                        ));
                    }
                    // Megatron's `generate_state_dict` order.
                    let mut top: Vec<(Pickle, Pickle)> = vec![
                        (Pickle::str("args"), args.clone()),
                        (Pickle::str("checkpoint_version"), Pickle::Float(3.0)),
                        (
                            Pickle::str("iteration"),
                            Pickle::Int(ck.meta.iteration as i64),
                        ),
                    ];
                    top.extend(model_entries);
                    top.push((
                        Pickle::str("num_floating_point_operations_so_far"),
                        Pickle::Int(0),
                    ));
                    let refs: Vec<(&str, &[u8])> = storages
                        .entries
                        .iter()
                        .map(|(k, b)| (k.as_str(), b.as_slice()))
                        .collect();
                    let bytes = save_archive(&Pickle::Dict(top), &refs).map_err(fail)?;
                    let rank = tmp.join(rank_dir(layout, (t, p, e)));
                    std::fs::create_dir_all(&rank).map_err(crate::io_err(&rank))?;
                    let file = rank.join("model_optim_rng.pt");
                    std::fs::write(&file, bytes).map_err(crate::io_err(&file))?;
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = written {
        // Nothing half-written is left to look like a checkpoint.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &dir).map_err(crate::io_err(&dir))?;
    write_tracker(output, &tracker_text)?;
    Ok(dir)
}

/// Tensor rank `t`'s shard of `values` (of `shape`, split `split` over `tp` ranks) and its
/// shape: the whole tensor where it is not split.
fn shard(
    values: &[f32],
    shape: &[usize],
    split: Option<(usize, usize)>,
    (tp, t): (usize, usize),
) -> (Vec<usize>, Vec<f32>) {
    match split {
        Some(s) if tp > 1 => {
            let mut local = shape.to_vec();
            local[s.0] /= tp;
            (local, shard_of(values, shape, s, tp, t))
        }
        _ => (shape.to_vec(), values.to_vec()),
    }
}

/// A rank's non-distributed optimizer state: one optimizer, or the dense and the experts'
/// chained (a list) where the experts are apart. Its parameter groups are Megatron's
/// (`_get_param_groups`): the decayed group, then the one without weight decay (biases and
/// 1-D parameters), each listed where some rank has parameters of its kind; a parameter's
/// index is its place in the groups in that order, each group in registration order.
fn rank_optimizer(
    ck: &crate::checkpointing::LoadedCheckpoint,
    params: &[RankParam],
    (tp, t): (usize, usize),
    (experts, present): (ExpertOptimizer, GroupsPresent),
    storages: &mut Storages,
) -> Result<Pickle, String> {
    let meta = &ck.meta;
    let step = meta.optimizer_step as f32;
    let kind_of = |p: &RankParam| {
        let no_decay = p.shape.len() == 1 || p.local.ends_with(".bias");
        let expert = experts == ExpertOptimizer::Chained && p.local.contains(".mlp.experts.");
        (no_decay, expert)
    };
    let optimizers: Vec<bool> = match (meta.model.moe.is_some(), experts) {
        (true, ExpertOptimizer::Chained) => vec![false, true],
        _ => vec![false],
    };
    let mut out = Vec::new();
    for expert in optimizers {
        let present = if expert {
            present.experts
        } else {
            present.dense
        };
        let mut state = Vec::new();
        let mut groups = Vec::new();
        let mut mains = Vec::new();
        let mut id = 0i64;
        for (no_decay, wd_mult) in [(false, 1.0), (true, 0.0)] {
            if !present[usize::from(no_decay)] {
                continue;
            }
            let mut ids = Vec::new();
            let mut group_mains = Vec::new();
            for p in params.iter().filter(|p| kind_of(p) == (no_decay, expert)) {
                let moment = |which: &str| -> Result<Vec<f32>, String> {
                    let name = format!("optimizer.{which}.{}", p.source);
                    let v = ck
                        .tensors
                        .get(&name)
                        .ok_or_else(|| format!("the checkpoint has no {name}"))?;
                    Ok(shard(v, p.global_shape, p.split, (tp, t)).1)
                };
                let m = storages.tensor(&moment("exp_avg")?, &p.shape);
                let v = storages.tensor(&moment("exp_avg_sq")?, &p.shape);
                let s = storages.tensor(&[step], &[]);
                state.push((
                    Pickle::Int(id),
                    Pickle::dict([("step", s), ("exp_avg", m), ("exp_avg_sq", v)]),
                ));
                ids.push(Pickle::Int(id));
                group_mains.push(p.model.clone());
                id += 1;
            }
            let mut g = param_group(meta, expert, wd_mult, OptimizerForm::NonDistributed);
            g.push(("params", Pickle::List(ids)));
            groups.push(Pickle::dict(g));
            mains.push(Pickle::List(group_mains));
        }
        // `FP32Optimizer` loads torch's own dict; the mixed-precision optimizer the same under
        // `optimizer`, with the fp32 main copies (the weights: this engine keeps them in
        // fp32): both are written, each reads its own.
        let inner = vec![
            (Pickle::str("state"), Pickle::Dict(state)),
            (Pickle::str("param_groups"), Pickle::List(groups)),
        ];
        let mut entries = inner.clone();
        entries.push((Pickle::str("optimizer"), Pickle::Dict(inner)));
        entries.push((Pickle::str("fp32_from_fp16_params"), Pickle::List(mains)));
        if let Some(scaler) = grad_scaler_state(meta, |scale| storages.tensor(&[scale], &[1])) {
            entries.push((Pickle::str("grad_scaler"), scaler));
        }
        out.push(Pickle::Dict(entries));
    }
    Ok(if out.len() == 1 {
        out.pop().expect("one")
    } else {
        Pickle::List(out)
    })
}
