//! `megatron convert --from torch_dist` and `--to torch_dist`. From: a checkpoint Megatron-LM saved (`--ckpt-format
//! torch_dist`, its default), at any TP/PP/DP layout, as a megatron-rs checkpoint of its
//! weights. The model comes from the arguments Megatron-LM saved with it (the `args` Namespace
//! of its common state): their names are Megatron's flags, which this engine takes too, so the
//! model is built and checked by the same code as `megatron train`'s flags. Tensor names are
//! megatron-core's sharded-state-dict keys, which are this engine's names but for two things:
//! a homogeneous decoder stores each parameter once for all layers (`decoder.layers.<name>`,
//! the layer as a leading dimension), and the pre-attention and pre-MLP norms are stored under
//! Transformer Engine's fused names (`self_attention.linear_qkv.layer_norm_weight`,
//! `mlp.linear_fc1.layer_norm_weight`) whichever layer spec saved them. Optimizer state, RNG
//! state and `_extra_state`s are not read.

use super::megatron_lm_state::{
    continued_run, export_dir_name, exported_common_state, exported_state, exported_state_names,
    read_run_state, write_tracker, ExpertOptimizer, GroupsPresent, StateExport,
};
use super::pickle::PyValue;
use super::pickle_writer::Pickle;
use super::torch_dist::TorchDistCheckpoint;
use super::torch_dist_writer::{write_torch_dist, Item};
use super::torch_save::TorchArchive;
use super::Tensors;
use crate::checkpointing::{write_converted_run, ConvertedExtras, ConvertedRun};
use crate::TrainError;
use megatron_core::models::model_chunk::ModelChunk;
use megatron_core::models::ModelFamily;
use megatron_core::params::Params;
use megatron_core::TransformerConfig;
use std::path::{Path, PathBuf};

/// How a saved argument becomes a flag.
#[derive(Clone, Copy)]
enum Flag {
    /// `--flag VALUE` where the value is not None.
    Value(&'static str),
    /// `--flag` where the value is true.
    Switch(&'static str),
    /// `--flag` where the value is false.
    Negated(&'static str),
    /// `--flag V1 V2 ...` from a list.
    Values(&'static str),
    /// `--flag N` or `--flag [a,b,...]` (Megatron's layer patterns, saved as an int or a list).
    Pattern(&'static str),
    /// `--flag VALUE` for a training-only setting (no effect on the weights or the forward
    /// pass): passed where it is one of `accepted` (any scalar where empty), skipped otherwise.
    Training(&'static str, &'static [&'static str]),
}

/// The saved arguments that make the model and its tokenizer.
const MODEL_ARGS: &[(&str, Flag)] = &[
    ("num_layers", Flag::Value("--num-layers")),
    ("hidden_size", Flag::Value("--hidden-size")),
    ("ffn_hidden_size", Flag::Value("--ffn-hidden-size")),
    ("num_attention_heads", Flag::Value("--num-attention-heads")),
    ("kv_channels", Flag::Value("--kv-channels")),
    (
        "group_query_attention",
        Flag::Switch("--group-query-attention"),
    ),
    ("seq_length", Flag::Value("--seq-length")),
    (
        "max_position_embeddings",
        Flag::Value("--max-position-embeddings"),
    ),
    (
        "position_embedding_type",
        Flag::Value("--position-embedding-type"),
    ),
    ("rotary_base", Flag::Value("--rotary-base")),
    ("rotary_percent", Flag::Value("--rotary-percent")),
    ("rotary_interleaved", Flag::Switch("--rotary-interleaved")),
    (
        "rotary_seq_len_interpolation_factor",
        Flag::Value("--rotary-seq-len-interpolation-factor"),
    ),
    ("use_rope_scaling", Flag::Switch("--use-rope-scaling")),
    ("rope_scaling_factor", Flag::Value("--rope-scaling-factor")),
    ("normalization", Flag::Value("--normalization")),
    // `--norm-epsilon`'s destination in Megatron-LM's parser.
    ("layernorm_epsilon", Flag::Value("--norm-epsilon")),
    ("norm_epsilon", Flag::Value("--norm-epsilon")),
    ("swiglu", Flag::Switch("--swiglu")),
    ("squared_relu", Flag::Switch("--squared-relu")),
    ("quick_geglu", Flag::Switch("--quick-geglu")),
    ("glu_linear_offset", Flag::Value("--glu-linear-offset")),
    (
        "activation_func_clamp_value",
        Flag::Value("--activation-func-clamp-value"),
    ),
    ("softmax_type", Flag::Value("--softmax-type")),
    ("bias_gelu_fusion", Flag::Negated("--no-bias-gelu-fusion")),
    (
        "untie_embeddings_and_output_weights",
        Flag::Switch("--untie-embeddings-and-output-weights"),
    ),
    ("add_bias_linear", Flag::Negated("--disable-bias-linear")),
    ("add_qkv_bias", Flag::Switch("--add-qkv-bias")),
    ("qk_layernorm", Flag::Switch("--qk-layernorm")),
    ("hidden_dropout", Flag::Value("--hidden-dropout")),
    ("attention_dropout", Flag::Value("--attention-dropout")),
    ("init_method_std", Flag::Value("--init-method-std")),
    ("num_experts", Flag::Value("--num-experts")),
    ("moe_ffn_hidden_size", Flag::Value("--moe-ffn-hidden-size")),
    ("moe_router_topk", Flag::Value("--moe-router-topk")),
    (
        "moe_router_score_function",
        Flag::Value("--moe-router-score-function"),
    ),
    (
        "moe_router_pre_softmax",
        Flag::Switch("--moe-router-pre-softmax"),
    ),
    (
        "moe_router_topk_scaling_factor",
        Flag::Value("--moe-router-topk-scaling-factor"),
    ),
    (
        "moe_router_num_groups",
        Flag::Value("--moe-router-num-groups"),
    ),
    (
        "moe_router_group_topk",
        Flag::Value("--moe-router-group-topk"),
    ),
    ("moe_layer_freq", Flag::Pattern("--moe-layer-freq")),
    (
        "moe_router_enable_expert_bias",
        Flag::Switch("--moe-router-enable-expert-bias"),
    ),
    (
        "moe_shared_expert_intermediate_size",
        Flag::Value("--moe-shared-expert-intermediate-size"),
    ),
    (
        "moe_shared_expert_gate",
        Flag::Switch("--moe-shared-expert-gate"),
    ),
    (
        "moe_expert_capacity_factor",
        Flag::Value("--moe-expert-capacity-factor"),
    ),
    (
        "moe_token_drop_policy",
        Flag::Value("--moe-token-drop-policy"),
    ),
    (
        "moe_pad_expert_input_to_capacity",
        Flag::Switch("--moe-pad-expert-input-to-capacity"),
    ),
    (
        "moe_aux_loss_coeff",
        Flag::Training("--moe-aux-loss-coeff", &[]),
    ),
    (
        "moe_z_loss_coeff",
        Flag::Training("--moe-z-loss-coeff", &[]),
    ),
    (
        "moe_router_bias_update_rate",
        Flag::Training("--moe-router-bias-update-rate", &[]),
    ),
    (
        "moe_router_load_balancing_type",
        Flag::Training(
            "--moe-router-load-balancing-type",
            &["aux_loss", "seq_aux_loss", "none"],
        ),
    ),
    (
        "moe_token_dispatcher_type",
        Flag::Training("--moe-token-dispatcher-type", &["allgather", "alltoall"]),
    ),
    ("mtp_num_layers", Flag::Value("--mtp-num-layers")),
    (
        "mtp_loss_scaling_factor",
        Flag::Training("--mtp-loss-scaling-factor", &[]),
    ),
    ("tokenizer_type", Flag::Value("--tokenizer-type")),
    ("vocab_size", Flag::Value("--vocab-size")),
    ("vocab_file", Flag::Value("--vocab-file")),
    ("merge_file", Flag::Value("--merge-file")),
    ("tokenizer_model", Flag::Value("--tokenizer-model")),
    ("vocab_extra_ids", Flag::Value("--vocab-extra-ids")),
    ("tiktoken_pattern", Flag::Value("--tiktoken-pattern")),
    (
        "tiktoken_num_special_tokens",
        Flag::Value("--tiktoken-num-special-tokens"),
    ),
    (
        "tokenizer_special_tokens",
        Flag::Values("--tokenizer-special-tokens"),
    ),
];

/// Saved arguments that make a model this importer does not build: refused by name where set.
const REFUSED: &[(&str, &str)] = &[
    (
        "apply_residual_connection_post_layernorm",
        "the residual taken after the norm",
    ),
    ("apply_layernorm_1p", "zero-centred norm weights"),
    ("layernorm_zero_centered_gamma", "zero-centred norm weights"),
    ("heterogeneous_layers_config_path", "heterogeneous layers"),
    (
        "experimental_attention_variant",
        "an experimental attention variant",
    ),
    ("hybrid_override_pattern", "a hybrid (Mamba) model"),
    ("spec", "a custom layer spec"),
    ("yaml_cfg", "a model configured by YAML"),
    ("qk_l2_norm", "L2-normed queries and keys"),
    ("attention_output_gate", "a gated attention output"),
    ("no_rope_freq", "layers without rotary embeddings"),
    ("mrope_section", "multimodal rotary embeddings"),
];

/// Whether a saved value counts as set (not None, not false, not an empty string or list).
pub(crate) fn is_set(v: &PyValue) -> bool {
    !matches!(v, PyValue::None | PyValue::Bool(false))
        && v.as_str() != Some("")
        && v.as_seq().is_none_or(|s| !s.is_empty())
}

fn text(v: &PyValue) -> Option<String> {
    match v {
        PyValue::Int(i) => Some(i.to_string()),
        PyValue::Float(f) => Some(f.to_string()),
        PyValue::Str(s) => Some(s.clone()),
        _ => None,
    }
}

/// The flags the saved arguments `args` (an `argparse.Namespace`) give.
fn flags_of(args: &PyValue) -> Result<Vec<String>, String> {
    for (name, what) in REFUSED {
        if let Some(v) = args.attr(name).filter(|v| is_set(v)) {
            return Err(format!(
                "the checkpoint is {what} ({name} = {}), which this converter does not import",
                text(v).unwrap_or_else(|| "set".into())
            ));
        }
    }
    if let Some(p) = args
        .attr("position_embedding_type")
        .and_then(|v| v.as_str())
    {
        if !matches!(p, "learned_absolute" | "rope" | "yarn" | "none") {
            return Err(format!(
                "position_embedding_type = {p}: this converter imports learned_absolute, rope, yarn and none"
            ));
        }
    }
    let moe = args.attr("num_experts").is_some_and(is_set);
    let mut flags = Vec::new();
    for &(name, flag) in MODEL_ARGS {
        let Some(v) = args.attr(name) else { continue };
        if name.starts_with("moe_") && !moe {
            continue; // a dense model's MoE defaults
        }
        match flag {
            Flag::Value(f) if !matches!(v, PyValue::None) => {
                let t = text(v).ok_or_else(|| format!("saved argument {name} is {v:?}"))?;
                flags.extend([f.to_string(), t]);
            }
            Flag::Switch(f) if is_set(v) => flags.push(f.to_string()),
            Flag::Negated(f) if matches!(v, PyValue::Bool(false)) => flags.push(f.to_string()),
            Flag::Pattern(f) => match v {
                PyValue::Int(n) => flags.extend([f.to_string(), n.to_string()]),
                PyValue::List(_) => {
                    let items: Option<Vec<String>> = v
                        .as_seq()
                        .unwrap_or(&[])
                        .iter()
                        .map(|x| x.as_int().map(|i| i.to_string()))
                        .collect();
                    let items = items.ok_or_else(|| format!("saved argument {name}: {v:?}"))?;
                    flags.extend([f.to_string(), format!("[{}]", items.join(","))]);
                }
                PyValue::Str(p) => flags.extend([f.to_string(), p.clone()]),
                _ => {}
            },
            Flag::Training(f, accepted) => {
                if let Some(t) =
                    text(v).filter(|t| accepted.is_empty() || accepted.contains(&t.as_str()))
                {
                    flags.extend([f.to_string(), t]);
                }
            }
            Flag::Values(f) if is_set(v) => {
                flags.push(f.to_string());
                for x in v.as_seq().unwrap_or(&[]) {
                    flags.push(text(x).ok_or_else(|| format!("saved argument {name}: {x:?}"))?);
                }
            }
            _ => {}
        }
    }
    // Megatron's validate_args fills kv_channels in as hidden_size / num_attention_heads; a
    // run that did not choose it is given the same flags as one that did not pass it.
    let int = |k: &str| args.attr(k).and_then(|v| v.as_int());
    if let (Some(kv), Some(h), Some(n)) = (
        int("kv_channels"),
        int("hidden_size"),
        int("num_attention_heads"),
    ) {
        if n > 0 && kv * n == h {
            if let Some(i) = flags.iter().position(|f| f == "--kv-channels") {
                flags.drain(i..i + 2);
            }
        }
    }
    if args.attr("group_query_attention").is_some_and(is_set) {
        if let Some(g) = args.attr("num_query_groups").and_then(text) {
            flags.extend(["--num-query-groups".to_string(), g]);
        }
    }
    if args.attr("multi_latent_attention").is_some_and(is_set) {
        mla_flags(args, &mut flags)?;
    } else if args
        .attr("position_embedding_type")
        .and_then(|v| v.as_str())
        == Some("yarn")
    {
        yarn_flags(args, &mut flags)?;
    }
    window_flags(args, &mut flags)?;
    Ok(flags)
}

/// `--position-embedding-type yarn` outside MLA: megatron-core's `yarn_*` config values, from
/// the saved arguments (`rotary_scaling_factor`, `mscale` and `mscale_all_dim` without the
/// prefix), `None` standing for the config's defaults, which are ours.
fn yarn_flags(args: &PyValue, flags: &mut Vec<String>) -> Result<(), String> {
    for (name, flag) in [
        ("rotary_scaling_factor", "--rotary-scaling-factor"),
        (
            "yarn_original_max_position_embeddings",
            "--yarn-original-max-position-embeddings",
        ),
        ("yarn_beta_fast", "--yarn-beta-fast"),
        ("yarn_beta_slow", "--yarn-beta-slow"),
        ("mscale", "--mscale"),
        ("mscale_all_dim", "--mscale-all-dim"),
    ] {
        match args.attr(name) {
            None | Some(PyValue::None) => {}
            Some(v) => {
                let t = text(v).ok_or_else(|| format!("saved argument {name} is {v:?}"))?;
                flags.extend([flag.to_string(), t]);
            }
        }
    }
    if matches!(
        args.attr("yarn_correction_range_round_to_int"),
        Some(PyValue::Bool(false))
    ) {
        flags.push("--no-yarn-correction-range-round-to-int".into());
    }
    Ok(())
}

/// Sliding-window attention: `window_size` (left, right) and the full layers of
/// `window_attn_skip_freq` (every N-th, or a list of 1 windowed / 0 full per layer).
fn window_flags(args: &PyValue, flags: &mut Vec<String>) -> Result<(), String> {
    let Some(w) = args.attr("window_size").filter(|v| is_set(v)) else {
        return Ok(());
    };
    let ints =
        |v: &PyValue| -> Option<Vec<i64>> { v.as_seq()?.iter().map(|x| x.as_int()).collect() };
    let pair = ints(w)
        .filter(|p| p.len() == 2)
        .ok_or_else(|| format!("saved argument window_size is {w:?}, not (left, right)"))?;
    flags.extend(["--window-size".into(), format!("{},{}", pair[0], pair[1])]);
    match args.attr("window_attn_skip_freq") {
        None | Some(PyValue::None) => {}
        Some(PyValue::Int(n)) => flags.extend(["--window-attn-skip-freq".into(), n.to_string()]),
        Some(v) => {
            let items =
                ints(v).ok_or_else(|| format!("saved argument window_attn_skip_freq is {v:?}"))?;
            let items: Vec<String> = items.iter().map(|i| i.to_string()).collect();
            flags.extend([
                "--window-attn-skip-freq".into(),
                format!("[{}]", items.join(",")),
            ]);
        }
    }
    Ok(())
}

/// Multi-latent attention's flags. megatron-core's `MLATransformerConfig` takes the saved
/// arguments of the same names; its rotary embedding is its own, of `rope_type` (YaRN where
/// unset, the config's default) with YaRN's original context and betas at the config's defaults
/// (4096, 32, 1: no saved argument has their names), whatever `position_embedding_type` says,
/// which then only decides whether GPTModel adds learned positions as well.
fn mla_flags(args: &PyValue, flags: &mut Vec<String>) -> Result<(), String> {
    let value = |flags: &mut Vec<String>, name: &str, flag: &str| -> Result<(), String> {
        match args.attr(name) {
            None | Some(PyValue::None) => Ok(()),
            Some(v) => {
                let t = text(v).ok_or_else(|| format!("saved argument {name} is {v:?}"))?;
                flags.extend([flag.to_string(), t]);
                Ok(())
            }
        }
    };
    let drop_flag = |flags: &mut Vec<String>, flag: &str| {
        if let Some(i) = flags.iter().position(|f| f == flag) {
            flags.drain(i..i + 2);
        }
    };
    let rope = match args.attr("rope_type").and_then(|v| v.as_str()) {
        None => "yarn",
        Some(r @ ("rope" | "yarn")) => r,
        Some(other) => {
            return Err(format!(
                "rope_type = {other}: MLA's rotary embedding is rope or yarn"
            ))
        }
    };
    match args
        .attr("position_embedding_type")
        .and_then(|v| v.as_str())
    {
        Some("learned_absolute") => {
            return Err(
                "multi-latent attention with learned absolute positions as well as its rotary \
                 embedding (position_embedding_type = learned_absolute), which this converter \
                 does not import"
                    .into(),
            )
        }
        _ => drop_flag(flags, "--position-embedding-type"),
    }
    // MLA's head widths are its own; Megatron fills kv_channels in regardless.
    drop_flag(flags, "--kv-channels");
    flags.extend([
        "--multi-latent-attention".to_string(),
        "--position-embedding-type".to_string(),
        rope.to_string(),
    ]);
    for (name, flag) in [
        ("q_lora_rank", "--q-lora-rank"),
        ("kv_lora_rank", "--kv-lora-rank"),
        ("qk_head_dim", "--qk-head-dim"),
        ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"),
        ("v_head_dim", "--v-head-dim"),
    ] {
        value(flags, name, flag)?;
    }
    if rope == "yarn" {
        for (name, flag) in [
            ("rotary_scaling_factor", "--rotary-scaling-factor"),
            ("mscale", "--mscale"),
            ("mscale_all_dim", "--mscale-all-dim"),
        ] {
            value(flags, name, flag)?;
        }
        flags.extend(
            [
                "--yarn-original-max-position-embeddings",
                "4096",
                "--yarn-beta-fast",
                "32",
                "--yarn-beta-slow",
                "1",
            ]
            .map(String::from),
        );
    }
    Ok(())
}

/// Megatron-core's key for this engine's layer parameter `rest`: the fused-norm name first.
pub(crate) fn stored_names(rest: &str) -> Vec<String> {
    let fused = match rest {
        "input_layernorm.weight" => Some("self_attention.linear_qkv.layer_norm_weight"),
        "input_layernorm.bias" => Some("self_attention.linear_qkv.layer_norm_bias"),
        "pre_mlp_layernorm.weight" => Some("mlp.linear_fc1.layer_norm_weight"),
        "pre_mlp_layernorm.bias" => Some("mlp.linear_fc1.layer_norm_bias"),
        _ => None,
    };
    // Multi-latent attention's latent norms, which Transformer Engine's layer spec fuses into
    // the up projections after them: after the plain name, which the local spec and the
    // other attention's query/key norms keep.
    let fused_after = match rest {
        "self_attention.q_layernorm.weight" => {
            Some("self_attention.linear_q_up_proj.layer_norm_weight")
        }
        "self_attention.q_layernorm.bias" => {
            Some("self_attention.linear_q_up_proj.layer_norm_bias")
        }
        "self_attention.kv_layernorm.weight" => {
            Some("self_attention.linear_kv_up_proj.layer_norm_weight")
        }
        "self_attention.kv_layernorm.bias" => {
            Some("self_attention.linear_kv_up_proj.layer_norm_bias")
        }
        _ => None,
    };
    fused
        .into_iter()
        .map(String::from)
        .chain([rest.to_string()])
        .chain(fused_after.map(String::from))
        .collect()
}

/// This engine's layer parameter `rest` split into megatron-core's name under the layer and
/// the expert it belongs to: routed experts are stored together under
/// `mlp.experts.experts.<name>`, the expert as a leading dimension.
pub(crate) fn expert_of(rest: &str) -> (String, Option<usize>) {
    if let Some(r) = rest.strip_prefix("mlp.experts.local_experts.") {
        if let Some((e, name)) = r.split_once('.') {
            if let Ok(e) = e.parse::<usize>() {
                return (format!("mlp.experts.experts.{name}"), Some(e));
            }
        }
    }
    (rest.to_string(), None)
}

/// Where parameter `name` of shape `shape` is stored: key, region start and extent.
pub(crate) fn locate(
    ck: &TorchDistCheckpoint,
    prefix: &str,
    name: &str,
    shape: &[usize],
) -> Result<(String, Vec<usize>, Vec<usize>), String> {
    if let Some((k, rest)) = mtp_layer_of(name) {
        return locate_mtp_layer(ck, prefix, name, shape, k, rest);
    }
    let layer = name.strip_prefix("decoder.layers.").and_then(|r| {
        let (l, rest) = r.split_once('.')?;
        Some((l.parse::<usize>().ok()?, rest))
    });
    let Some((l, rest)) = layer else {
        let key = format!("{prefix}{name}");
        return match ck.sizes.get(&key) {
            Some(s) if s == shape => Ok((key, vec![0; shape.len()], shape.to_vec())),
            Some(s) => Err(format!(
                "tensor {key} has size {s:?} in the checkpoint, the model's is {shape:?}"
            )),
            None => Err(format!("the checkpoint has no tensor {key}")),
        };
    };
    let (rest, expert) = expert_of(rest);
    let tried: Vec<String> = stored_names(&rest);
    for stored in &tried {
        // A heterogeneous decoder keeps each layer's own key; a homogeneous one stacks the
        // layers in a leading dimension. Either way the expert, if any, comes next.
        for (key, leading) in [
            (format!("{prefix}decoder.layers.{l}.{stored}"), vec![]),
            (format!("{prefix}decoder.layers.{stored}"), vec![l]),
        ] {
            let Some(s) = ck.sizes.get(&key) else {
                continue;
            };
            let mut start = leading;
            start.extend(expert);
            return region_under(key, s, start, shape, name);
        }
    }
    Err(format!(
        "the checkpoint has no tensor for {name} (looked for {prefix}decoder.layers[.{l}].{})",
        tried.join(" or ")
    ))
}

/// The region of stored tensor `key` (size `stored`) that holds the model's `name` of `shape`
/// behind the leading indices `start` (layer, expert): key, start and extent.
fn region_under(
    key: String,
    stored: &[usize],
    mut start: Vec<usize>,
    shape: &[usize],
    name: &str,
) -> Result<(String, Vec<usize>, Vec<usize>), String> {
    let fits = stored.len() == start.len() + shape.len()
        && stored[start.len()..] == *shape
        && start.iter().zip(stored).all(|(i, n)| i < n);
    if !fits {
        return Err(format!(
            "tensor {key} has size {stored:?} in the checkpoint, the model's {name} is {shape:?}"
        ));
    }
    let mut size = vec![1; start.len()];
    size.extend_from_slice(shape);
    start.extend(std::iter::repeat_n(0, shape.len()));
    Ok((key, start, size))
}

/// A multi-token-prediction depth's transformer layer parameter: the depth and the name under
/// the layer (`mtp.layers.{k}.mtp_model_layer.{rest}`).
pub(crate) fn mtp_layer_of(name: &str) -> Option<(usize, &str)> {
    let r = name.strip_prefix("mtp.layers.")?;
    let (k, r) = r.split_once('.')?;
    Some((k.parse().ok()?, r.strip_prefix("mtp_model_layer.")?))
}

/// Where an MTP depth's layer parameter lies: megatron-core keeps each depth's own keys (no
/// stacking), its GPT depths' layer under `transformer_layer` (the name older checkpoints
/// had; newer code maps `mtp_model_layer` back to it), with the layer spec's norm names.
fn locate_mtp_layer(
    ck: &TorchDistCheckpoint,
    prefix: &str,
    name: &str,
    shape: &[usize],
    k: usize,
    rest: &str,
) -> Result<(String, Vec<usize>, Vec<usize>), String> {
    let (rest, expert) = expert_of(rest);
    let tried = stored_names(&rest);
    for inner in ["transformer_layer", "mtp_model_layer"] {
        for stored in &tried {
            let key = format!("{prefix}mtp.layers.{k}.{inner}.{stored}");
            let Some(s) = ck.sizes.get(&key) else {
                continue;
            };
            return region_under(key, s, expert.into_iter().collect(), shape, name);
        }
    }
    Err(format!(
        "the checkpoint has no tensor for {name} (looked for {prefix}mtp.layers.{k}.transformer_layer.{})",
        tried.join(" or ")
    ))
}

/// The common state Megatron-LM saved beside the tensors (`args`, `iteration`, ...): the
/// `common_state` item of the checkpoint, or `common.pt` where an older megatron-core wrote it.
pub(crate) fn common_state(ck: &TorchDistCheckpoint) -> Result<PyValue, String> {
    with_common_state(ck, |v, _| Ok(v.clone()))
}

/// `f` on the common state and the archive holding the tensors inside it (the optimizer's
/// step is one).
pub(crate) fn with_common_state<T>(
    ck: &TorchDistCheckpoint,
    f: impl FnOnce(&PyValue, &TorchArchive) -> Result<T, String>,
) -> Result<T, String> {
    let file = ck.dir.join("common.pt");
    if file.exists() {
        let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let archive = TorchArchive::read(&bytes).map_err(|e| format!("{}: {e}", file.display()))?;
        return f(&archive.object, &archive);
    }
    let key = ck
        .keys()
        .find(|k| k.starts_with("common_state"))
        .cloned()
        .ok_or_else(|| {
            format!(
                "{}: no common state (common.pt or a common_state item), where Megatron-LM keeps the run's arguments",
                ck.dir.display()
            )
        })?;
    let archive = ck.archive(&key)?;
    // Saved as a sharded object of one shard: a list of the one dict.
    match &archive.object {
        PyValue::List(one) if one.len() == 1 => f(&one[0], &archive),
        other => f(other, &archive),
    }
}

/// A tokenizer file of the saved arguments: absolute where it exists here; as saved (with a
/// warning) where it does not, so the checkpoint still names what the run used.
fn tokenizer_path(flag: &str, p: Option<String>) -> Option<String> {
    let p = p?;
    match std::fs::canonicalize(&p) {
        Ok(abs) => Some(abs.display().to_string()),
        Err(_) => {
            eprintln!(
                "WARNING: the run's {flag} {p} is not on this machine; the checkpoint records it as saved (give the file at that path, or pass {flag} to train and generate)"
            );
            Some(p)
        }
    }
}

/// Converts the torch_dist checkpoint `input` (a save directory or an iteration directory)
/// into a megatron-rs checkpoint under `output` (iteration 0, weights only).
pub fn torch_dist_to_megatron(input: &Path, output: &Path) -> Result<PathBuf, TrainError> {
    let fail = |msg: String| TrainError::Checkpoint {
        path: input.display().to_string(),
        msg,
    };
    let ck = TorchDistCheckpoint::open(input).map_err(fail)?;
    let fail = |msg: String| TrainError::Checkpoint {
        path: ck.dir.display().to_string(),
        msg,
    };
    let common = common_state(&ck).map_err(fail)?;
    let args = common
        .get("args")
        .filter(|a| a.class_name().as_deref() == Some("argparse.Namespace"))
        .ok_or_else(|| fail("the common state holds no args Namespace".into()))?;
    let rows = ck
        .sizes
        .get("embedding.word_embeddings.weight")
        .map(|s| s[0])
        .ok_or_else(|| {
            fail("no embedding.word_embeddings.weight (a GPT checkpoint's first stage)".into())
        })?;
    let (cfg, tokenizer, flags) = model_of_args(args, rows).map_err(fail)?;
    let mut wanted = wanted_tensors(&cfg);
    let tp = args
        .attr("tensor_model_parallel_size")
        .and_then(|v| v.as_int())
        .unwrap_or(1) as usize;
    adopt_saved_down_projection_split(&ck, &mut wanted, tp);
    let mut tensors = Tensors::new();
    let mut used = std::collections::HashSet::new();
    for w in &wanted {
        let (key, start, size) = locate(&ck, "", &w.name, &w.shape).map_err(fail)?;
        let values = ck.region(&key, &start, &size).map_err(fail)?;
        used.insert(key);
        tensors.insert(w.name.clone(), (w.shape.clone(), values));
    }
    let model_part = |k: &str| {
        ["embedding.", "decoder.", "output_layer.", "mtp."]
            .iter()
            .any(|p| k.starts_with(p))
    };
    if let Some(extra) = ck
        .sizes
        .keys()
        .find(|k| model_part(k) && !used.contains(*k))
    {
        return Err(fail(format!(
            "the checkpoint holds {extra}, which the model of its saved arguments has no place for"
        )));
    }
    let iteration = common.get("iteration").and_then(|i| i.as_int());
    let state = read_run_state(&ck, &common, args, &wanted, &tensors).map_err(fail)?;
    let run = continued_run(state, &mut tensors);
    finish(
        (output, &ck.dir, "torch_dist"),
        (args, iteration, &flags),
        cfg,
        (tensors, run),
        tokenizer,
    )
}

/// Multi-latent attention's down projections are duplicated on every tensor-parallel rank
/// here and under Transformer Engine's layer spec, but column-parallel under megatron-core's
/// local spec: where the checkpoint stores one in `tp` row blocks, the run held it split, and
/// its optimizer state (per rank in the bucket forms) is read as of a split tensor.
fn adopt_saved_down_projection_split(
    ck: &TorchDistCheckpoint,
    wanted: &mut [WantedTensor],
    tp: usize,
) {
    if tp < 2 {
        return;
    }
    for w in wanted
        .iter_mut()
        .filter(|w| w.split.is_none() && is_mla_down_projection(&w.name))
    {
        let Ok((key, start, _)) = locate(ck, "", &w.name, &w.shape) else {
            continue;
        };
        let row = start.len() - w.shape.len();
        let rows: std::collections::BTreeSet<usize> = ck
            .chunks(&key)
            .iter()
            .map(|(offset, _)| offset[row])
            .collect();
        if rows.len() == tp {
            w.split = Some((0, 1));
        }
    }
}

/// Multi-latent attention's down projections, whose tensor-parallel split depends on the
/// layer spec that saved them.
pub(crate) fn is_mla_down_projection(name: &str) -> bool {
    name.ends_with("self_attention.linear_q_down_proj.weight")
        || name.ends_with("self_attention.linear_kv_down_proj.weight")
}

/// The model and tokenizer of the saved arguments `args` (embedding rows `rows`), and the
/// flags they were read as.
pub(crate) fn model_of_args(
    args: &PyValue,
    rows: usize,
) -> Result<(TransformerConfig, megatron_data::TokenizerSpec, Vec<String>), String> {
    let flags = flags_of(args)?;
    let (cfg, mut tokenizer) = crate::arguments::model_from_flags(&flags, rows)
        .map_err(|e| format!("its saved arguments ({}): {e}", flags.join(" ")))?;
    tokenizer.vocab_file = tokenizer_path("--vocab-file", tokenizer.vocab_file);
    tokenizer.merge_file = tokenizer_path("--merge-file", tokenizer.merge_file);
    tokenizer.tokenizer_model = tokenizer_path("--tokenizer-model", tokenizer.tokenizer_model);
    if tokenizer.vocab_size.is_none() {
        // A tokenizer with its own vocabulary: its size where it can be built here.
        tokenizer.vocab_size = Some(
            megatron_data::build_tokenizer_from(&tokenizer)
                .map(|t| t.vocab_size())
                .unwrap_or(rows),
        );
    }
    Ok((cfg, tokenizer, flags))
}

/// How a tensor is split over tensor-parallel ranks: dimension and equal blocks each split on
/// its own (`None`: the same on every rank).
pub(crate) type TpSplit = Option<(usize, usize)>;

/// Whether `convert --to torch_dist` carries the optimizer state a checkpoint holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerExport {
    /// Where the checkpoint holds Adam's state past iteration 0 (Megatron's default), for
    /// Megatron-LM to load at expert-parallel size `expert_model_parallel_size`: an MoE run's
    /// optimizer there chains a second one for the experts where that is above 1.
    /// `form` is the optimizer Megatron-LM will load it into.
    IfSaved {
        expert_model_parallel_size: usize,
        form: OptimizerForm,
    },
    /// `--no-save-optim`: the weights alone, a release checkpoint.
    WeightsOnly,
}

pub use super::megatron_lm_state::OptimizerForm;

impl Default for OptimizerExport {
    fn default() -> Self {
        OptimizerExport::IfSaved {
            expert_model_parallel_size: 1,
            form: OptimizerForm::Distributed,
        }
    }
}

/// Whether a tensor of the model is trained (and so has optimizer state) or a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TensorKind {
    Parameter,
    Buffer,
}

/// One tensor the model keeps.
pub(crate) struct WantedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub split: TpSplit,
    pub kind: TensorKind,
}

/// Every tensor the model of `cfg` keeps: its parameters (with their tensor-parallel split) and
/// the buffers a checkpoint keeps (a router's expert bias).
pub(crate) fn wanted_tensors(cfg: &TransformerConfig) -> Vec<WantedTensor> {
    let mut params = Params::default();
    let layers = cfg.num_layers();
    let chunk = cfg.build_chunk(&mut params, &mut Vec::new(), 0..layers, true, true);
    params
        .metas
        .iter()
        .map(|m| WantedTensor {
            name: m.name.clone(),
            shape: m.shape.clone(),
            split: m.tp_split_dim.map(|d| (d, m.tp_chunks)),
            kind: TensorKind::Parameter,
        })
        .chain(chunk.buffers().into_iter().map(|(name, v)| WantedTensor {
            name,
            shape: vec![v.len()],
            split: None,
            kind: TensorKind::Buffer,
        }))
        .collect()
}

/// Writes the converted checkpoint and says what was read: the weights alone at iteration 0,
/// or with the run's optimizer state at the run's iteration.
pub(crate) fn finish(
    (output, read, format): (&Path, &Path, &str),
    (args, iteration, flags): (&PyValue, Option<i64>, &[String]),
    cfg: TransformerConfig,
    (tensors, run): (Tensors, Option<ConvertedRun>),
    tokenizer: megatron_data::TokenizerSpec,
) -> Result<PathBuf, TrainError> {
    let layout = ["tensor_model_parallel_size", "pipeline_model_parallel_size"]
        .map(|k| args.attr(k).and_then(|v| v.as_int()).unwrap_or(1));
    let what = match &run {
        Some(r) => format!(
            "with its optimizer state (step {}, {} samples consumed)",
            r.optimizer_step, r.consumed_train_samples
        ),
        None => "weights only".into(),
    };
    eprintln!(
        "read Megatron-LM's {format} checkpoint {} (iteration {}, saved at TP {} x PP {}): {} tensors, {what}, model flags: {}",
        read.display(),
        iteration.map_or("?".into(), |i| i.to_string()),
        layout[0],
        layout[1],
        tensors.len(),
        flags.join(" ")
    );
    write_converted_run(
        output,
        cfg,
        ConvertedExtras::default(),
        &tensors,
        tokenizer,
        run.unwrap_or_default(),
    )
}

/// Which of megatron-core's layer specs an export names its tensors for (`convert --to
/// torch_dist --transformer-impl`). They agree on dense layers of the usual attention (the
/// local spec maps its norms onto Transformer Engine's fused names) and differ on an MoE
/// layer's pre-MLP norm and on multi-latent attention's norms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayerSpec {
    /// Megatron-LM's default `--transformer-impl transformer_engine`.
    #[default]
    TransformerEngine,
    /// `--transformer-impl local`.
    Local,
}

/// The linear module a layer parameter belongs to (`self_attention.linear_qkv` of
/// `self_attention.linear_qkv.weight`): each has an `_extra_state` megatron-core asks for.
fn linear_module(rest: &str) -> Option<&str> {
    rest.strip_suffix(".weight").filter(|m| {
        m.rsplit('.')
            .next()
            .is_some_and(|last| last.starts_with("linear_"))
    })
}

/// What a layer is made of, as the export names its norms.
#[derive(Clone, Copy)]
struct LayerKind {
    mla: bool,
    moe: bool,
}

/// This engine's layer parameter `rest` under megatron-core's sharded key for `spec`:
/// - Transformer Engine fuses the pre-attention norm into `linear_qkv` (not into MLA's down
///   projections: its MLA keeps `input_layernorm`), MLA's latent norms into the up projections
///   after them, and a dense layer's pre-MLP norm into `linear_fc1` (an MoE layer keeps
///   `pre_mlp_layernorm`);
/// - the local spec maps `input_layernorm` and `pre_mlp_layernorm` onto those fused names
///   (MoE layers too), except in MLA layers, whose spec maps no names.
fn exported_name(rest: &str, spec: LayerSpec, kind: LayerKind) -> String {
    let (module, param) = rest.rsplit_once('.').unwrap_or((rest, ""));
    let fused = match (module, spec) {
        ("input_layernorm", _) if !kind.mla => Some("self_attention.linear_qkv"),
        ("pre_mlp_layernorm", LayerSpec::TransformerEngine) if !kind.moe => Some("mlp.linear_fc1"),
        ("pre_mlp_layernorm", LayerSpec::Local) if !kind.mla => Some("mlp.linear_fc1"),
        ("self_attention.q_layernorm", LayerSpec::TransformerEngine) if kind.mla => {
            Some("self_attention.linear_q_up_proj")
        }
        ("self_attention.kv_layernorm", LayerSpec::TransformerEngine) if kind.mla => {
            Some("self_attention.linear_kv_up_proj")
        }
        _ => None,
    };
    match fused {
        Some(linear) => format!("{linear}.layer_norm_{param}"),
        None => rest.to_string(),
    }
}

/// MLA's rotary embedding as megatron-core's `MLATransformerConfig` takes it from saved
/// arguments: `rope_type`, and under YaRN only the factor and the two mscales (its original
/// context and betas are the config's defaults, which no argument names).
fn mla_rope(
    yarn: &Option<megatron_core::transformer::config::YarnConfig>,
) -> Result<Option<megatron_core::transformer::config::YarnConfig>, String> {
    let Some(y) = yarn else { return Ok(None) };
    let at_defaults = y.original_max_position_embeddings == 4096
        && y.beta_fast == 32.0
        && y.beta_slow == 1.0
        && y.correction_range_round_to_int;
    if !at_defaults {
        return Err(format!(
            "multi-latent attention with YaRN's original context {}, betas {}/{}{}: megatron-core's MLA takes 4096, 32/1 and a rounded correction range, whatever the arguments say, which this export does not write",
            y.original_max_position_embeddings,
            y.beta_fast,
            y.beta_slow,
            if y.correction_range_round_to_int { "" } else { ", an unrounded correction range" }
        ));
    }
    Ok(Some(*y))
}

/// YaRN outside MLA as megatron-core's saved arguments name it, as `yarn_flags` reads them
/// back.
fn yarn_args(y: megatron_core::transformer::config::YarnConfig) -> Vec<(&'static str, Pickle)> {
    vec![
        ("rotary_scaling_factor", Pickle::Float(y.factor)),
        (
            "yarn_original_max_position_embeddings",
            Pickle::Int(y.original_max_position_embeddings as i64),
        ),
        ("yarn_beta_fast", Pickle::Float(y.beta_fast)),
        ("yarn_beta_slow", Pickle::Float(y.beta_slow)),
        ("mscale", Pickle::Float(y.mscale)),
        ("mscale_all_dim", Pickle::Float(y.mscale_all_dim)),
        (
            "yarn_correction_range_round_to_int",
            Pickle::Bool(y.correction_range_round_to_int),
        ),
    ]
}

/// Sliding-window attention as Megatron-LM's saved arguments hold it: `window_size` as
/// `(left, 0)` and `window_attn_skip_freq` as a number or a list of 1 (windowed) / 0 (full) per
/// layer, as `window_flags` reads them back.
fn window_args(
    w: &megatron_core::transformer::config::SlidingWindow,
) -> Vec<(&'static str, Pickle)> {
    use megatron_core::transformer::config::LayerPattern;
    vec![
        (
            "window_size",
            Pickle::Tuple(vec![Pickle::Int(w.left as i64), Pickle::Int(0)]),
        ),
        (
            "window_attn_skip_freq",
            match &w.skip {
                None => Pickle::None,
                Some(LayerPattern::Every(n)) => Pickle::Int(*n as i64),
                Some(LayerPattern::List(v)) => {
                    Pickle::List(v.iter().map(|&b| Pickle::Int(b as i64)).collect())
                }
            },
        ),
    ]
}

/// The saved arguments of multi-latent attention, as `mla_flags` reads them back.
fn mla_args(
    m: &megatron_core::transformer::config::MLAConfig,
    yarn: Option<megatron_core::transformer::config::YarnConfig>,
) -> Vec<(&'static str, Pickle)> {
    let int = |v: usize| Pickle::Int(v as i64);
    vec![
        ("multi_latent_attention", Pickle::Bool(true)),
        ("q_lora_rank", m.q_lora_rank.map_or(Pickle::None, int)),
        ("kv_lora_rank", int(m.kv_lora_rank)),
        ("qk_head_dim", int(m.qk_head_dim)),
        ("qk_pos_emb_head_dim", int(m.qk_pos_emb_head_dim)),
        ("v_head_dim", int(m.v_head_dim)),
        (
            "rope_type",
            Pickle::str(if yarn.is_some() { "yarn" } else { "rope" }),
        ),
        (
            "rotary_scaling_factor",
            Pickle::Float(yarn.map_or(1.0, |y| y.factor)),
        ),
        ("mscale", Pickle::Float(yarn.map_or(1.0, |y| y.mscale))),
        (
            "mscale_all_dim",
            Pickle::Float(yarn.map_or(0.0, |y| y.mscale_all_dim)),
        ),
    ]
}

/// The saved arguments Megatron-LM needs to rebuild and check `cfg` (the names of its flags),
/// as `flags_of` reads them back.
/// The layout and format an export's saved arguments record. Megatron-LM reshards a torch_dist
/// checkpoint to any layout, and that export records TP 1 x PP 1; its legacy format is loaded
/// only at the layout it records (`check_checkpoint_args`), and names its rank files by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SavedLayout {
    pub tp: usize,
    pub pp: usize,
    /// Model chunks per pipeline stage (1: not interleaved).
    pub vp: usize,
    pub ep: usize,
    pub format: CkptFormat,
}

/// Megatron-LM's `--ckpt-format` of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CkptFormat {
    TorchDist,
    Torch,
}

impl SavedLayout {
    const TORCH_DIST: SavedLayout = SavedLayout {
        tp: 1,
        pp: 1,
        vp: 1,
        ep: 1,
        format: CkptFormat::TorchDist,
    };
}

pub(crate) fn saved_args(
    cfg: &TransformerConfig,
    meta: &crate::checkpointing::CheckpointMeta,
    state: &StateExport,
    (spec, form): (LayerSpec, OptimizerForm),
    layout: SavedLayout,
) -> Result<Pickle, String> {
    let carried = matches!(state, StateExport::Carried);
    let distributed = carried && form == OptimizerForm::Distributed;
    use megatron_core::transformer::config::{
        Activation, GeluForm, LayerNormPlacement, Normalization, PositionEmbeddingType,
    };
    let refuse = |what: &str| Err(format!("{what}, which this export does not write"));
    if cfg.mtp.is_some() && cfg.position_embedding_type == PositionEmbeddingType::LearnedAbsolute {
        return refuse("multi-token prediction with learned absolute positions (Megatron-LM asserts rope or none for MTP)");
    }
    let mla = match (&cfg.mla, &cfg.rotary.yarn) {
        (Some(m), yarn) => Some((m, mla_rope(yarn)?)),
        (None, _) => None,
    };
    // Outside MLA, YaRN is megatron-core's `position_embedding_type = "yarn"` with its own
    // `yarn_*` arguments (gpt-oss).
    let yarn = cfg.rotary.yarn.filter(|_| mla.is_none());
    if meta.bert.is_some() || meta.t5.is_some() {
        return refuse("a BERT or T5 model");
    }
    if cfg
        .moe
        .as_ref()
        .is_some_and(|m| m.biases != cfg.add_bias_linear)
    {
        // Megatron-LM builds the router's and the experts' biases from add_bias_linear alone.
        return refuse("experts without biases on a model with linear biases (an MoE checkpoint saved before this engine built megatron-core's expert and router biases)");
    }
    if cfg.layernorm_placement != LayerNormPlacement::default() {
        return refuse("post-norm layers");
    }
    let (swiglu, squared_relu, quick_geglu) = match cfg.activation {
        Activation::Gelu => (false, false, false),
        Activation::SwiGLU => (true, false, false),
        Activation::SquaredRelu => (false, true, false),
        Activation::QuickGeGLU => (false, false, true),
        other => return refuse(&format!("the {other:?} MLP activation")),
    };
    // Megatron's GELU is the tanh form only through its fused bias-GELU, which needs biases.
    let bias_gelu_fusion = match (cfg.gelu, cfg.add_bias_linear) {
        (GeluForm::Tanh, true) => true,
        (GeluForm::Erf, _) => false,
        (GeluForm::Tanh, false) if cfg.activation == Activation::Gelu => {
            return refuse("a tanh GELU without biases (Megatron's unfused GELU is erf)")
        }
        (GeluForm::Tanh, false) => false,
    };
    let int = |v: usize| Pickle::Int(v as i64);
    let float = |v: f32| Pickle::Float(super::decimal(v));
    let opt_f = |v: Option<f64>| v.map_or(Pickle::None, Pickle::Float);
    let opt_s = |v: &Option<String>| v.as_ref().map_or(Pickle::None, |s| Pickle::str(s.as_str()));
    let base = if cfg.rotary.base.fract() == 0.0 {
        Pickle::Int(cfg.rotary.base as i64)
    } else {
        Pickle::Float(cfg.rotary.base)
    };
    let tokenizer_vocab = match meta.tokenizer_type.as_str() {
        "NullTokenizer" => int(meta.vocab_size),
        _ => Pickle::None,
    };
    let mut entries = vec![
        ("num_layers", int(cfg.num_layers)),
        ("hidden_size", int(cfg.hidden_size)),
        ("ffn_hidden_size", int(cfg.ffn_hidden_size)),
        ("num_attention_heads", int(cfg.num_attention_heads)),
        (
            "kv_channels",
            int(match mla {
                // Megatron fills it in so, and MLA reads its own head widths instead.
                Some(_) => cfg.hidden_size / cfg.num_attention_heads,
                None => cfg.head_dim(),
            }),
        ),
        (
            "group_query_attention",
            Pickle::Bool(cfg.num_query_groups.is_some()),
        ),
        ("num_query_groups", int(cfg.query_groups())),
        ("seq_length", int(cfg.seq_length)),
        ("max_position_embeddings", int(cfg.max_position_embeddings)),
        (
            "position_embedding_type",
            Pickle::str(match cfg.position_embedding_type {
                PositionEmbeddingType::LearnedAbsolute => "learned_absolute",
                PositionEmbeddingType::Rope if yarn.is_some() => "yarn",
                PositionEmbeddingType::Rope => "rope",
                PositionEmbeddingType::None => "none",
            }),
        ),
        ("add_position_embedding", Pickle::Bool(true)),
        ("rotary_base", base),
        ("rotary_percent", float(cfg.rotary.percent)),
        ("rotary_interleaved", Pickle::Bool(cfg.rotary.interleaved)),
        (
            "rotary_seq_len_interpolation_factor",
            opt_f(cfg.rotary.seq_len_interpolation_factor),
        ),
        (
            "use_rope_scaling",
            Pickle::Bool(cfg.rotary.scaling_factor.is_some()),
        ),
        (
            "rope_scaling_factor",
            Pickle::Float(cfg.rotary.scaling_factor.unwrap_or(8.0)),
        ),
        (
            "normalization",
            Pickle::str(match cfg.normalization {
                Normalization::LayerNorm => "LayerNorm",
                Normalization::RMSNorm => "RMSNorm",
            }),
        ),
        ("layernorm_epsilon", float(cfg.layernorm_epsilon)),
        ("swiglu", Pickle::Bool(swiglu)),
        ("squared_relu", Pickle::Bool(squared_relu)),
        ("quick_geglu", Pickle::Bool(quick_geglu)),
        ("glu_linear_offset", float(cfg.glu.linear_offset)),
        (
            "activation_func_clamp_value",
            cfg.glu.clamp_value.map_or(Pickle::None, float),
        ),
        (
            "softmax_type",
            Pickle::str(match cfg.softmax_type {
                megatron_core::transformer::config::SoftmaxType::Vanilla => "vanilla",
                megatron_core::transformer::config::SoftmaxType::OffByOne => "off-by-one",
                megatron_core::transformer::config::SoftmaxType::Learnable => "learnable",
            }),
        ),
        ("bias_gelu_fusion", Pickle::Bool(bias_gelu_fusion)),
        (
            "untie_embeddings_and_output_weights",
            Pickle::Bool(cfg.untie_embeddings_and_output_weights),
        ),
        ("add_bias_linear", Pickle::Bool(cfg.add_bias_linear)),
        ("add_qkv_bias", Pickle::Bool(cfg.add_qkv_bias)),
        ("qk_layernorm", Pickle::Bool(cfg.qk_layernorm)),
        ("hidden_dropout", float(cfg.hidden_dropout)),
        ("attention_dropout", float(cfg.attention_dropout)),
        ("init_method_std", float(cfg.init_method_std)),
        ("padded_vocab_size", int(cfg.padded_vocab_size)),
        ("make_vocab_size_divisible_by", int(128)),
        ("tokenizer_type", Pickle::str(meta.tokenizer_type.as_str())),
        ("vocab_size", tokenizer_vocab),
        ("vocab_file", opt_s(&meta.vocab_file)),
        ("merge_file", opt_s(&meta.merge_file)),
        ("tokenizer_model", opt_s(&meta.tokenizer_model)),
        ("vocab_extra_ids", int(meta.vocab_extra_ids)),
        ("tensor_model_parallel_size", int(layout.tp)),
        ("pipeline_model_parallel_size", int(layout.pp)),
        (
            "ckpt_format",
            Pickle::str(match layout.format {
                CkptFormat::TorchDist => "torch_dist",
                CkptFormat::Torch => "torch",
            }),
        ),
        (
            "transformer_impl",
            Pickle::str(match spec {
                LayerSpec::TransformerEngine => "transformer_engine",
                LayerSpec::Local => "local",
            }),
        ),
        // No RNG state (this engine's streams are counter-based, not torch's): Megatron-LM
        // then does not look for one. The optimizer state where it is carried.
        ("no_save_optim", Pickle::Bool(!carried)),
        ("no_save_rng", Pickle::Bool(true)),
        ("use_distributed_optimizer", Pickle::Bool(distributed)),
        // A loss scaler means an fp16 run here (bf16 and fp32 runs keep none).
        ("fp16", Pickle::Bool(meta.grad_scaler.is_some())),
        ("optimizer", Pickle::str(meta.optimizer.as_str())),
        ("adam_beta1", float(meta.adam_beta1)),
        ("adam_beta2", float(meta.adam_beta2)),
        ("adam_eps", float(meta.adam_eps)),
        (
            "weight_decay",
            meta.weight_decay.map_or(Pickle::None, float),
        ),
        ("seed", Pickle::Int(meta.seed as i64)),
        ("lr_warmup_init", Pickle::Float(meta.scheduler.init_lr)),
        (
            "lr_wsd_decay_samples",
            Pickle::Int(meta.scheduler.wsd_decay_steps as i64),
        ),
        (
            "lr_wsd_decay_style",
            Pickle::str(match meta.scheduler.wsd_decay_style {
                megatron_core::optimizer::WsdDecayStyle::Linear => "linear",
                megatron_core::optimizer::WsdDecayStyle::Cosine => "cosine",
                megatron_core::optimizer::WsdDecayStyle::Exponential => "exponential",
                megatron_core::optimizer::WsdDecayStyle::MinusSqrt => "minus_sqrt",
            }),
        ),
        (
            "dist_ckpt_optim_fully_reshardable",
            Pickle::Bool(distributed),
        ),
        (
            "consumed_train_samples",
            Pickle::Int(meta.consumed_train_samples as i64),
        ),
        (
            "consumed_valid_samples",
            Pickle::Int(meta.consumed_valid_samples.unwrap_or(0) as i64),
        ),
    ];
    if layout.format == CkptFormat::Torch {
        entries.extend([
            ("expert_model_parallel_size", int(layout.ep)),
            (
                "virtual_pipeline_model_parallel_size",
                if layout.vp > 1 {
                    int(layout.vp)
                } else {
                    Pickle::None
                },
            ),
        ]);
    }
    entries.extend(moe_args(cfg.moe.as_ref()));
    entries.extend(loss_scale_args(meta.grad_scaler.as_ref()));
    if let Some((m, rope)) = mla {
        entries.extend(mla_args(m, rope));
    }
    if let Some(y) = yarn {
        entries.extend(yarn_args(y));
    }
    if let Some(w) = &cfg.window {
        entries.extend(window_args(w));
    }
    if let Some(m) = &cfg.mtp {
        entries.extend([
            ("mtp_num_layers", int(m.num_layers)),
            ("mtp_loss_scaling_factor", float(m.loss_scaling_factor)),
        ]);
    }
    Ok(Pickle::New(
        "argparse",
        "Namespace",
        Box::new(Pickle::dict(entries)),
    ))
}

/// An fp16 run's loss-scaling arguments (Megatron's names), as its scaler recorded them.
fn loss_scale_args(
    scaler: Option<&megatron_core::optimizer::GradScaler>,
) -> Vec<(&'static str, Pickle)> {
    use megatron_core::optimizer::GradScaler;
    let float = |v: f32| Pickle::Float(super::decimal(v));
    match scaler {
        None => Vec::new(),
        Some(GradScaler::Constant { scale }) => vec![("loss_scale", float(*scale))],
        Some(GradScaler::Dynamic {
            min_scale,
            growth_interval,
            hysteresis,
            ..
        }) => vec![
            ("loss_scale", Pickle::None),
            ("min_loss_scale", float(*min_scale)),
            ("loss_scale_window", Pickle::Int(*growth_interval as i64)),
            ("hysteresis", Pickle::Int(*hysteresis as i64)),
        ],
    }
}

/// The MoE part of the saved arguments (`num_experts` None for a dense model).
fn moe_args(
    moe: Option<&megatron_core::transformer::config::MoEConfig>,
) -> Vec<(&'static str, Pickle)> {
    use megatron_core::transformer::config::{
        DropPolicy, LayerPattern, LoadBalancing, RouterScore, TokenDispatcherType,
    };
    let Some(m) = moe else {
        return vec![("num_experts", Pickle::None)];
    };
    let int = |v: usize| Pickle::Int(v as i64);
    let float = |v: f32| Pickle::Float(super::decimal(v));
    let opt_f = |v: Option<f32>| v.map_or(Pickle::None, float);
    vec![
        ("num_experts", int(m.num_experts)),
        ("moe_ffn_hidden_size", int(m.ffn_hidden_size)),
        ("moe_router_topk", int(m.topk)),
        (
            "moe_router_score_function",
            Pickle::str(match m.score {
                RouterScore::Softmax => "softmax",
                RouterScore::Sigmoid => "sigmoid",
            }),
        ),
        ("moe_router_pre_softmax", Pickle::Bool(m.pre_softmax)),
        (
            "moe_router_topk_scaling_factor",
            opt_f(m.topk_scaling_factor),
        ),
        (
            "moe_router_num_groups",
            m.router_groups.map_or(Pickle::None, |g| int(g.0)),
        ),
        (
            "moe_router_group_topk",
            m.router_groups.map_or(Pickle::None, |g| int(g.1)),
        ),
        ("moe_aux_loss_coeff", float(m.aux_loss_coeff)),
        ("moe_z_loss_coeff", float(m.z_loss_coeff)),
        (
            "moe_layer_freq",
            match &m.layers {
                LayerPattern::Every(n) => int(*n),
                LayerPattern::List(v) => {
                    Pickle::List(v.iter().map(|&b| Pickle::Int(i64::from(b))).collect())
                }
            },
        ),
        (
            "moe_token_dispatcher_type",
            Pickle::str(match m.dispatcher {
                TokenDispatcherType::AllGather => "allgather",
                TokenDispatcherType::AllToAll => "alltoall",
            }),
        ),
        (
            "moe_router_load_balancing_type",
            Pickle::str(match m.load_balancing {
                LoadBalancing::AuxLoss => "aux_loss",
                LoadBalancing::SeqAuxLoss => "seq_aux_loss",
                LoadBalancing::None => "none",
            }),
        ),
        (
            "moe_router_enable_expert_bias",
            Pickle::Bool(m.expert_bias_update_rate.is_some()),
        ),
        (
            "moe_router_bias_update_rate",
            float(m.expert_bias_update_rate.unwrap_or(1e-3)),
        ),
        ("moe_expert_capacity_factor", opt_f(m.capacity_factor)),
        (
            "moe_token_drop_policy",
            Pickle::str(match m.drop_policy {
                DropPolicy::Probs => "probs",
                DropPolicy::Position => "position",
            }),
        ),
        (
            "moe_pad_expert_input_to_capacity",
            Pickle::Bool(m.pad_to_capacity),
        ),
        (
            "moe_shared_expert_intermediate_size",
            m.shared_expert_ffn.map_or(Pickle::None, int),
        ),
        ("moe_shared_expert_gate", Pickle::Bool(m.shared_expert_gate)),
        ("moe_grouped_gemm", Pickle::Bool(m.grouped_gemm)),
    ]
}

/// `megatron convert --to torch_dist`: the newest checkpoint under `input` (a megatron-rs save
/// directory) as a Megatron-LM `--ckpt-format torch_dist` checkpoint of its weights under
/// `output`: `release/` and a tracker naming it, Megatron's form for converted weights (its
/// `--load` starts from them at iteration 0 without optimizer or RNG state), saved at TP 1 x
/// PP 1, which megatron-core reshards to any layout when it loads.
pub fn megatron_to_torch_dist(
    input: &Path,
    output: &Path,
    optim: OptimizerExport,
    spec: LayerSpec,
) -> Result<PathBuf, TrainError> {
    let ck = match optim {
        OptimizerExport::IfSaved { .. } => crate::checkpointing::load_checkpoint(input, None)?,
        OptimizerExport::WeightsOnly => crate::checkpointing::load_checkpoint_weights(input)?,
    };
    let cfg = ck.meta.model.clone();
    let fail = |msg: String| TrainError::Checkpoint {
        path: input.display().to_string(),
        msg,
    };
    let state = exported_state(&ck.meta, &ck.tensors);
    let carried = matches!(state, StateExport::Carried);
    let form = match optim {
        OptimizerExport::IfSaved { form, .. } => form,
        OptimizerExport::WeightsOnly => OptimizerForm::Distributed,
    };
    let args = saved_args(
        &cfg,
        &ck.meta,
        &state,
        (spec, form),
        SavedLayout::TORCH_DIST,
    )
    .map_err(fail)?;
    let (dir_name, tracker_text) = export_dir_name(&ck.meta, &state);
    let release = output.join(dir_name);
    if release.exists() {
        return Err(TrainError::Checkpoint {
            path: release.display().to_string(),
            msg: "already exists (choose a new --output)".into(),
        });
    }
    let layers = cfg.num_layers;
    let shape_of = |name: &str| {
        ck.meta
            .tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.shape.clone())
            .unwrap_or_default()
    };
    // megatron-core keeps each layer's own keys where its layers differ (MoE layers between
    // dense ones), and stacks them in a leading dimension otherwise.
    let per_layer = cfg.moe.as_ref().is_some_and(|m| {
        !matches!(
            m.layers,
            megatron_core::transformer::config::LayerPattern::Every(1)
        )
    });
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let mut items = Vec::new();
    let mut modules = std::collections::BTreeSet::new();
    let mut mtp_modules = std::collections::BTreeSet::new();
    for (name, values) in ck
        .tensors
        .iter()
        .filter(|(n, _)| !n.starts_with("optimizer."))
    {
        let shape = shape_of(name);
        let layer = name.strip_prefix("decoder.layers.").and_then(|r| {
            let (l, rest) = r.split_once('.')?;
            Some((l.parse::<usize>().ok()?, rest))
        });
        // The weights, then (a parameter of a carried run) its main copy and moments under
        // the same sharded key and placement.
        let state: Vec<(&str, &Vec<f32>)> = if carried {
            exported_state_names(name, form)
                .into_iter()
                .map(|(prefix, ours)| ck.tensors.get(&ours).map(|v| (prefix, v)))
                .collect::<Option<_>>()
                .unwrap_or_default() // a buffer: no optimizer state
        } else {
            Vec::new()
        };
        let mut push = |key: String, size: Vec<usize>, offset: Vec<usize>, chunk: Vec<usize>| {
            for &(prefix, values) in std::iter::once(&("", values)).chain(&state) {
                items.push(Item::Tensor {
                    key: format!("{prefix}{key}"),
                    size: size.clone(),
                    offset: offset.clone(),
                    chunk: chunk.clone(),
                    values,
                });
            }
        };
        if let Some((k, rest)) = mtp_layer_of(name) {
            // A depth's layer: its own keys under `transformer_layer`, the layer spec's names.
            let (rest, expert) = expert_of(rest);
            let kind = LayerKind {
                mla: cfg.mla.is_some(),
                moe: cfg.is_moe_layer(layers + k),
            };
            let module = format!("mtp.layers.{k}.transformer_layer");
            let key = format!("{module}.{}", exported_name(&rest, spec, kind));
            if let Some(m) = linear_module(&rest) {
                mtp_modules.insert((format!("{module}.{m}"), expert));
            }
            let leading: Vec<usize> = expert.into_iter().collect();
            let mut size = vec![experts; leading.len()];
            size.extend_from_slice(&shape);
            let mut offset = leading.clone();
            offset.extend(std::iter::repeat_n(0, shape.len()));
            let mut chunk = vec![1; leading.len()];
            chunk.extend_from_slice(&shape);
            push(key, size, offset, chunk);
            continue;
        }
        let Some((l, rest)) = layer else {
            if let Some(m) = name
                .strip_prefix("mtp.layers.")
                .and_then(|r| r.strip_suffix(".eh_proj.weight"))
            {
                mtp_modules.insert((format!("mtp.layers.{m}.eh_proj"), None));
            }
            push(name.clone(), shape.clone(), vec![0; shape.len()], shape);
            continue;
        };
        let (rest, expert) = expert_of(rest);
        let kind = LayerKind {
            mla: cfg.mla.is_some(),
            moe: cfg.is_moe_layer(l),
        };
        let stored = exported_name(&rest, spec, kind);
        if let Some(module) = linear_module(&rest) {
            modules.insert((l, module.to_string(), expert));
        }
        let (key, mut leading) = if per_layer {
            (format!("decoder.layers.{l}.{stored}"), vec![])
        } else {
            (format!("decoder.layers.{stored}"), vec![(l, layers)])
        };
        leading.extend(expert.map(|e| (e, experts)));
        let mut size: Vec<usize> = leading.iter().map(|&(_, n)| n).collect();
        size.extend_from_slice(&shape);
        let mut offset: Vec<usize> = leading.iter().map(|&(i, _)| i).collect();
        offset.extend(std::iter::repeat_n(0, shape.len()));
        let mut chunk = vec![1; leading.len()];
        chunk.extend_from_slice(&shape);
        push(key, size, offset, chunk);
    }
    // The linear modules' extra states megatron-core asks for (fp8 metadata under Transformer
    // Engine, whose attention has one too): none, as a run without fp8 saves them, named as
    // megatron-core names a sharded object (`/shard_<offsets>_<shape>`).
    let attention: Vec<_> = (0..layers)
        .map(|l| (l, "self_attention.core_attention".to_string(), None))
        .collect();
    for (l, module, expert) in modules.into_iter().chain(attention) {
        let (prefix, mut at) = if per_layer {
            (format!("decoder.layers.{l}."), vec![])
        } else {
            ("decoder.layers.".to_string(), vec![(l, layers)])
        };
        at.extend(expert.map(|e| (e, experts)));
        if at.is_empty() {
            at.push((0, 1));
        }
        let join = |f: fn(&(usize, usize)) -> usize| {
            at.iter()
                .map(|x| f(x).to_string())
                .collect::<Vec<_>>()
                .join(".")
        };
        items.push(Item::Object {
            key: format!(
                "{prefix}{module}._extra_state/shard_{}_{}",
                join(|x| x.0),
                join(|x| x.1)
            ),
            object: Pickle::List(vec![Pickle::None]),
            storages: Vec::new(),
        });
    }
    // The MTP depths' linear modules and attention, each depth's own keys.
    let depths = cfg.mtp.as_ref().map_or(0, |m| m.num_layers);
    let mtp_attention = (0..depths).map(|k| {
        (
            format!("mtp.layers.{k}.transformer_layer.self_attention.core_attention"),
            None,
        )
    });
    for (module, expert) in mtp_modules.into_iter().chain(mtp_attention) {
        let (offsets, shape) = match expert {
            Some(e) => (e.to_string(), experts.to_string()),
            None => ("0".to_string(), "1".to_string()),
        };
        items.push(Item::Object {
            key: format!("{module}._extra_state/shard_{offsets}_{shape}"),
            object: Pickle::List(vec![Pickle::None]),
            storages: Vec::new(),
        });
    }
    let mut common = vec![
        ("args", args),
        ("checkpoint_version", Pickle::Float(3.0)),
        ("iteration", Pickle::Int(ck.meta.iteration as i64)),
        ("num_floating_point_operations_so_far", Pickle::Int(0)),
    ];
    let mut storages = Vec::new();
    if carried {
        let experts = match optim {
            OptimizerExport::IfSaved {
                expert_model_parallel_size: ep,
                ..
            } if ep > 1 => ExpertOptimizer::Chained,
            _ => ExpertOptimizer::Shared,
        };
        // The parameters: the tensors with moments (not the buffers).
        let params = ck.meta.tensors.iter().filter_map(|t| {
            ck.tensors
                .contains_key(&format!("optimizer.exp_avg.{}", t.name))
                .then_some((t.name.as_str(), t.shape.as_slice()))
        });
        let present = GroupsPresent::of(params, experts);
        let (entries, tensors) = exported_common_state(&ck.meta, experts, (form, present));
        common.extend(entries);
        storages = tensors;
    }
    items.push(Item::Object {
        key: "common_state/shard_0_1".into(),
        object: Pickle::List(vec![Pickle::dict(common)]),
        storages,
    });
    std::fs::create_dir_all(output).map_err(crate::io_err(output))?;
    write_torch_dist(&release, &items).map_err(|msg| TrainError::Checkpoint {
        path: release.display().to_string(),
        msg,
    })?;
    write_tracker(output, &tracker_text)?;
    Ok(release)
}
