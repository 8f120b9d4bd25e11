//! A Hugging Face-style model (config.json values and tensors, as the families' `to_hf` give
//! them) as a llama.cpp GGUF: what `convert_hf_to_gguf.py` writes for the same model, for the
//! architectures llama.cpp runs that megatron-rs trains (gpt2, llama with or without experts,
//! qwen2, qwen3, qwen2moe, qwen3moe, gpt-oss). Whatever llama.cpp would not run the same way (another
//! activation, sliding windows, biases it does not load, routing it does not do) is refused by
//! name rather than dropped.

use super::gguf::{
    expert_hf_name, layer_name, llama3_rope_divisors, rope_rows, Direction, EXPERT_PROJECTIONS,
    GPT2_LAYER_MODULES, GPT2_NAMES, SPECIAL_TOKENS, TOKENIZER_FLAGS,
};
use super::gguf_writer::{encode, GgmlType, GgufWriter, MetaValue, Q8_0_BLOCK};
use super::llama::num;
use super::pre_tokenizers::llama_cpp_pre_name;
use super::Tensors;
use serde_json::Value;
use std::path::Path;

/// `--outtype` of llama.cpp's converter: the type of the 2-D weights (norms, biases and
/// position embeddings stay F32, as llama.cpp keeps them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufOutType {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl std::str::FromStr for GgufOutType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "f32" => GgufOutType::F32,
            "f16" => GgufOutType::F16,
            "bf16" => GgufOutType::Bf16,
            "q8_0" => GgufOutType::Q8_0,
            other => return Err(format!("'{other}' (f32, f16, bf16 or q8_0)")),
        })
    }
}

impl GgufOutType {
    /// `general.file_type` (llama.cpp's `LlamaFileType`).
    fn file_type(self) -> u32 {
        match self {
            GgufOutType::F32 => 0,
            GgufOutType::F16 => 1,
            GgufOutType::Q8_0 => 7,
            GgufOutType::Bf16 => 32,
        }
    }

    /// The storage of a tensor `name` of `shape`, by the rules of llama.cpp's converter (routers
    /// and the shared expert's gate stay F32 too).
    fn storage(self, name: &str, shape: &[usize]) -> GgmlType {
        let always_f32 = shape.len() <= 1
            || name.ends_with("_norm.weight")
            || !name.ends_with(".weight")
            || name == "position_embd.weight"
            || name.contains(".ffn_gate_inp");
        if always_f32 {
            return GgmlType::F32;
        }
        match self {
            GgufOutType::F32 => GgmlType::F32,
            GgufOutType::F16 => GgmlType::F16,
            GgufOutType::Bf16 => GgmlType::Bf16,
            // A row that is not whole blocks falls back to F16, as llama.cpp's does.
            GgufOutType::Q8_0 if !shape[shape.len() - 1].is_multiple_of(Q8_0_BLOCK) => {
                GgmlType::F16
            }
            GgufOutType::Q8_0 => GgmlType::Q8_0,
        }
    }
}

/// llama.cpp's architecture for a config.json `architectures` entry, and whether its
/// converter permutes Q/K rows (only its LlamaModel does).
fn gguf_architecture(class: &str) -> Result<(&'static str, bool), String> {
    match class {
        "LlamaForCausalLM" | "MistralForCausalLM" | "MixtralForCausalLM" => Ok(("llama", true)),
        "Qwen2ForCausalLM" => Ok(("qwen2", false)),
        "Qwen3ForCausalLM" => Ok(("qwen3", false)),
        "Qwen2MoeForCausalLM" => Ok(("qwen2moe", false)),
        "Qwen3MoeForCausalLM" => Ok(("qwen3moe", false)),
        "GPT2LMHeadModel" => Ok(("gpt2", false)),
        "GptOssForCausalLM" => Ok(("gpt-oss", false)),
        other => Err(format!(
            "{other}: GGUF export is built for GPT-2, Llama, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and gpt-oss models (not BERT, T5 or DeepSeek-V3)"
        )),
    }
}

/// The metadata and tensors of a GGUF for a Hugging Face config `hf` and its tensors `t`
/// (taken out of `t`; what is left has no place in the GGUF).
pub(crate) fn gguf_of_hf(
    hf: &Value,
    t: &mut Tensors,
    out: GgufOutType,
    name: &str,
) -> Result<GgufWriter, String> {
    let class = hf["architectures"][0].as_str().unwrap_or("");
    let (arch, permuted) = gguf_architecture(class)?;
    let mut w = GgufWriter::default();
    let u32v = |v: usize| MetaValue::U32(v as u32);
    w.meta("general.architecture", MetaValue::Str(arch.into()));
    w.meta("general.type", MetaValue::Str("model".into()));
    w.meta("general.name", MetaValue::Str(name.into()));
    let key = |k: &str| format!("{arch}.{k}");
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    if arch == "gpt2" {
        match hf["activation_function"].as_str().unwrap_or("gelu_new") {
            // llama.cpp's GELU is the tanh form (read through an f16 table); an erf GELU is
            // within 4.7e-4 of it everywhere (the largest gap, at x = -2.70), so it is
            // written rather than refused.
            "gelu_new" | "gelu_pytorch_tanh" | "gelu" => {}
            other => {
                return Err(format!(
                    "activation_function '{other}': llama.cpp's gpt2 architecture computes GELU"
                ))
            }
        }
        let (layers, h) = (num(hf, "n_layer")?, num(hf, "n_embd")?);
        let ffn = hf["n_inner"].as_u64().map_or(4 * h, |v| v as usize);
        w.meta(key("block_count"), u32v(layers));
        w.meta(key("context_length"), u32v(num(hf, "n_positions")?));
        w.meta(key("embedding_length"), u32v(h));
        w.meta(key("feed_forward_length"), u32v(ffn));
        w.meta(key("attention.head_count"), u32v(num(hf, "n_head")?));
        w.meta(
            key("attention.layer_norm_epsilon"),
            MetaValue::F32(hf["layer_norm_epsilon"].as_f64().unwrap_or(1e-5) as f32),
        );
        w.meta(key("vocab_size"), u32v(num(hf, "vocab_size")?));
        for (name, (shape, v)) in std::mem::take(t) {
            let (g, conv1d) =
                gpt2_name(&name).ok_or_else(|| format!("tensor {name}: no GGUF counterpart"))?;
            // Conv1D weights are stored `[in, out]`; llama.cpp's converter transposes them.
            let (shape, v) = if conv1d && shape.len() == 2 {
                (
                    vec![shape[1], shape[0]],
                    super::gpt2::transpose(&v, shape[0], shape[1]),
                )
            } else {
                (shape, v)
            };
            tensors.push((g, shape, v));
        }
    } else {
        if let Some(act) = hf["hidden_act"].as_str().filter(|a| *a != "silu") {
            return Err(format!(
                "hidden_act '{act}': llama.cpp's {arch} architecture is SwiGLU (silu) only"
            ));
        }
        let windowed = hf["sliding_window"].as_u64().is_some()
            && hf["use_sliding_window"].as_bool() != Some(false);
        let gpt_oss = arch == "gpt-oss";
        if gpt_oss {
            let window = super::gguf_gpt_oss::check_config(hf)?;
            w.meta(key("attention.sliding_window"), u32v(window));
        } else if windowed {
            return Err(format!(
                "sliding_window: llama.cpp's {arch} architecture attends to every earlier position"
            ));
        }
        let (layers, h, heads) = (
            num(hf, "num_hidden_layers")?,
            num(hf, "hidden_size")?,
            num(hf, "num_attention_heads")?,
        );
        let groups = hf["num_key_value_heads"]
            .as_u64()
            .map_or(heads, |v| v as usize);
        let hd = hf["head_dim"].as_u64().map_or(h / heads, |v| v as usize);
        let rope = &hf["rope_parameters"];
        let base = rope["rope_theta"]
            .as_f64()
            .or(hf["rope_theta"].as_f64())
            .unwrap_or(10000.0);
        w.meta(key("block_count"), u32v(layers));
        w.meta(
            key("context_length"),
            u32v(num(hf, "max_position_embeddings")?),
        );
        w.meta(key("embedding_length"), u32v(h));
        w.meta(
            key("feed_forward_length"),
            u32v(num(hf, "intermediate_size")?),
        );
        w.meta(key("attention.head_count"), u32v(heads));
        w.meta(key("attention.head_count_kv"), u32v(groups));
        w.meta(key("rope.freq_base"), MetaValue::F32(base as f32));
        w.meta(
            key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(hf["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32),
        );
        w.meta(key("attention.key_length"), u32v(hd));
        w.meta(key("attention.value_length"), u32v(hd));
        w.meta(key("vocab_size"), u32v(num(hf, "vocab_size")?));
        w.meta(key("rope.dimension_count"), u32v(hd));
        moe_metadata(hf, arch, &mut w)?;
        if gpt_oss {
            tensors.extend(super::gguf_gpt_oss::tensors(hf, t)?);
        } else {
            stack_experts(arch, layers, t, &mut tensors)?;
        }
        let f = |k: &str| rope[k].as_f64();
        match rope["rope_type"].as_str().unwrap_or("default") {
            "default" => {}
            "linear" => {
                w.meta(key("rope.scaling.type"), MetaValue::Str("linear".into()));
                let factor = f("factor").ok_or("rope_type linear without factor")?;
                w.meta(key("rope.scaling.factor"), MetaValue::F32(factor as f32));
            }
            "yarn" => {
                let plain =
                    f("mscale").unwrap_or(1.0) == 1.0 && f("mscale_all_dim").unwrap_or(0.0) == 0.0;
                if rope["truncate"].as_bool() == Some(false) {
                    unrounded_yarn_check(rope, hd, base)?;
                }
                if !plain || rope.get("attention_factor").is_some() {
                    return Err("YaRN with mscale / mscale_all_dim / attention_factor: llama.cpp's rope.scaling keys cannot say it".into());
                }
                w.meta(key("rope.scaling.type"), MetaValue::Str("yarn".into()));
                let factor = f("factor").ok_or("rope_type yarn without factor")?;
                w.meta(key("rope.scaling.factor"), MetaValue::F32(factor as f32));
                let orig = rope["original_max_position_embeddings"]
                    .as_u64()
                    .ok_or("rope_type yarn without original_max_position_embeddings")?;
                w.meta(
                    key("rope.scaling.original_context_length"),
                    u32v(orig as usize),
                );
                // Written only where they differ from llama.cpp's defaults (32, 1); always for
                // gpt-oss, whose converter copies them from every gpt-oss config.
                for (k, g, default) in [
                    ("beta_fast", "yarn_beta_fast", 32.0),
                    ("beta_slow", "yarn_beta_slow", 1.0),
                ] {
                    if let Some(v) = f(k).filter(|v| *v != default || gpt_oss) {
                        w.meta(key(&format!("rope.scaling.{g}")), MetaValue::F32(v as f32));
                    }
                }
            }
            "llama3" => {
                if arch != "llama" {
                    return Err(format!(
                        "rope_type llama3 on {arch}: llama.cpp reads rope_freqs for llama only"
                    ));
                }
                let d = llama3_rope_divisors(
                    base,
                    hd,
                    f("factor").unwrap_or(8.0),
                    f("low_freq_factor").unwrap_or(1.0),
                    f("high_freq_factor").unwrap_or(4.0),
                    rope["original_max_position_embeddings"]
                        .as_f64()
                        .unwrap_or(8192.0),
                );
                tensors.push((
                    "rope_freqs.weight".into(),
                    vec![d.len()],
                    d.iter().map(|&x| x as f32).collect(),
                ));
            }
            other => return Err(format!("rope_type '{other}' has no GGUF form here")),
        }
        for (name, (shape, v)) in std::mem::take(t) {
            let g = llama_name(arch, &name).ok_or_else(|| {
                format!("tensor {name}: llama.cpp's {arch} architecture has no place for it")
            })?;
            let cols = *shape.last().unwrap_or(&1);
            let v = match g.rsplit_once('.').map(|(p, _)| p.rsplit('.').next()) {
                Some(Some("attn_q")) if permuted && shape.len() == 2 => {
                    rope_rows(&v, heads, hd, cols, Direction::ToGguf)
                }
                Some(Some("attn_k")) if permuted && shape.len() == 2 => {
                    rope_rows(&v, groups, hd, cols, Direction::ToGguf)
                }
                _ => v,
            };
            tensors.push((g, shape, v));
        }
    }
    let tied = !tensors.iter().any(|(g, _, _)| g == "output.weight");
    if arch == "qwen2moe" && tied {
        // llama.cpp's qwen2moe loader requires `output.weight` (the other architectures fall
        // back to the embedding): a tied model gets the embedding written twice.
        let embd = tensors.iter().find(|(g, _, _)| g == "token_embd.weight");
        let (_, shape, v) = embd.ok_or("no token_embd.weight")?.clone();
        tensors.push(("output.weight".into(), shape, v));
    }
    w.meta("general.file_type", MetaValue::U32(out.file_type()));
    w.meta("general.quantization_version", MetaValue::U32(2));
    for (g, shape, v) in tensors {
        let ty = out.storage(&g, &shape);
        let cols = *shape.last().unwrap_or(&1);
        w.tensor(g, shape, ty, encode(ty, &v, cols));
    }
    Ok(w)
}

/// llama.cpp's YaRN rounds the correction range outward whatever `truncate` says: a model with
/// `truncate: false` (gpt-oss's) exports only where rounding leaves every rotary frequency as
/// it is, else llama.cpp would rotate by other frequencies than the model was trained with.
fn unrounded_yarn_check(rope: &Value, head_dim: usize, base: f64) -> Result<(), String> {
    let f = |k: &str, d: f64| rope[k].as_f64().unwrap_or(d);
    let yarn = |round_to_int| megatron_tensor::cpu::YarnScaling {
        factor: f("factor", 1.0),
        original_max_position: f("original_max_position_embeddings", 4096.0),
        beta_fast: f("beta_fast", 32.0),
        beta_slow: f("beta_slow", 1.0),
        mscale: 1.0,
        mscale_all_dim: 0.0,
        round_to_int,
    };
    let (ours, llama_cpp) = (
        yarn(false).frequencies(head_dim, base),
        yarn(true).frequencies(head_dim, base),
    );
    let apart: Vec<f64> = ours
        .iter()
        .zip(&llama_cpp)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .filter(|d| *d > 1e-12)
        .collect();
    if apart.is_empty() {
        return Ok(());
    }
    let worst = apart.iter().cloned().fold(0.0, f64::max);
    Err(format!(
        "YaRN with truncate false (--no-yarn-correction-range-round-to-int): llama.cpp rounds the correction range, which moves {} of this model's {} rotary frequencies (up to {:.0} %); a model trained with the rounded range (megatron-core's default) exports",
        apart.len(),
        ours.len(),
        worst * 100.0
    ))
}

/// The expert keys, after checking that llama.cpp's graph for `arch` routes as the config says:
/// softmax routers on every layer, top-k weights renormalized (Mixtral, Qwen3-MoE) or not
/// (Qwen2-MoE), Qwen2-MoE's shared expert present.
fn moe_metadata(hf: &Value, arch: &str, w: &mut GgufWriter) -> Result<(), String> {
    let experts = hf["num_local_experts"]
        .as_u64()
        .or(hf["num_experts"].as_u64());
    let Some(experts) = experts.filter(|&e| e > 0) else {
        return Ok(());
    };
    let key = |k: &str| format!("{arch}.{k}");
    let every_layer = hf["decoder_sparse_step"].as_u64().unwrap_or(1) == 1
        && hf["mlp_only_layers"]
            .as_array()
            .is_none_or(|a| a.is_empty());
    if !every_layer {
        return Err(format!(
            "dense layers among the expert layers (mlp_only_layers / decoder_sparse_step): llama.cpp's {arch} puts experts on every layer"
        ));
    }
    let norm = hf["norm_topk_prob"].as_bool();
    match arch {
        "qwen2moe" if norm == Some(true) => {
            return Err(
                "norm_topk_prob true: llama.cpp's qwen2moe does not renormalize the top-k weights"
                    .into(),
            )
        }
        "qwen3moe" if norm != Some(true) => {
            return Err(
                "norm_topk_prob false: llama.cpp's qwen3moe renormalizes the top-k weights".into(),
            )
        }
        "qwen2moe" if hf["shared_expert_intermediate_size"].as_u64().unwrap_or(0) == 0 => {
            return Err("no shared expert: llama.cpp's qwen2moe requires one".into())
        }
        _ => {}
    }
    w.meta(key("expert_count"), MetaValue::U32(experts as u32));
    let used = num(hf, "num_experts_per_tok")?;
    w.meta(key("expert_used_count"), MetaValue::U32(used as u32));
    if arch != "llama" {
        // gpt-oss's experts are intermediate_size wide (it has no dense MLP).
        let ffn = if arch == "gpt-oss" {
            num(hf, "intermediate_size")?
        } else {
            num(hf, "moe_intermediate_size")?
        };
        w.meta(
            key("expert_feed_forward_length"),
            MetaValue::U32(ffn as u32),
        );
    }
    if let Some(s) = hf["shared_expert_intermediate_size"]
        .as_u64()
        .filter(|&s| s > 0)
    {
        w.meta(
            key("expert_shared_feed_forward_length"),
            MetaValue::U32(s as u32),
        );
    }
    Ok(())
}

/// Every layer's per-expert projections taken out of `t` and stacked as llama.cpp's
/// `blk.N.ffn_{gate,up,down}_exps.weight` (`[experts, rows, cols]`).
fn stack_experts(
    arch: &str,
    layers: usize,
    t: &mut Tensors,
    out: &mut Vec<(String, Vec<usize>, Vec<f32>)>,
) -> Result<(), String> {
    for l in 0..layers {
        for (g, mixtral, qwen) in EXPERT_PROJECTIONS {
            let name = |e| {
                format!(
                    "model.layers.{l}.{}",
                    expert_hf_name(arch, e, (mixtral, qwen))
                )
            };
            let (mut stacked, mut shape, mut experts) = (Vec::new(), None, 0);
            while let Some((s, v)) = t.remove(&name(experts)) {
                if *shape.get_or_insert(s.clone()) != s {
                    return Err(format!("{}: experts of different shapes", name(experts)));
                }
                stacked.extend(v);
                experts += 1;
            }
            if let Some(s) = shape {
                out.push((format!("blk.{l}.{g}"), vec![experts, s[0], s[1]], stacked));
            }
        }
    }
    Ok(())
}

/// llama.cpp's name of a Llama-family Hugging Face tensor.
fn llama_name(arch: &str, name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (l, part) = rest.split_once('.')?;
    layer_name(arch, part, Direction::ToGguf).map(|g| format!("blk.{l}.{g}"))
}

/// llama.cpp's name of a GPT-2 Hugging Face tensor, and whether it is a Conv1D weight.
fn gpt2_name(name: &str) -> Option<(String, bool)> {
    if let Some((g, _)) = GPT2_NAMES.iter().find(|(_, hf)| *hf == name) {
        return Some((g.to_string(), false));
    }
    let rest = name.strip_prefix("transformer.h.")?;
    let (l, part) = rest.split_once('.')?;
    let (module, kind) = part.rsplit_once('.')?;
    let (g, _, conv1d) = GPT2_LAYER_MODULES.iter().find(|(_, hf, _)| *hf == module)?;
    matches!(kind, "weight" | "bias")
        .then(|| (format!("blk.{l}.{g}.{kind}"), *conv1d && kind == "weight"))
}

/// The `tokenizer.ggml.*` keys of llama.cpp for a recorded tokenizer, with its vocabulary
/// padded to `vocab` entries as llama.cpp's converter pads (`[PAD{i}]`, type UNUSED).
/// Built for byte-level BPE: Megatron's `GPT2BPETokenizer` (vocab.json + merges.txt) and a
/// Hugging Face tokenizer.json whose pre-tokenizer llama.cpp names (`pre_tokenizers.rs`); and
/// for SentencePiece vocabularies as Hugging Face's Llama tokenizer.json holds them
/// (`spm_vocab.rs`, llama.cpp's `llama` model). Others would split text differently in
/// llama.cpp, so they are refused.
pub fn tokenizer_metadata(
    tokenizer_type: &str,
    vocab_file: Option<&str>,
    merge_file: Option<&str>,
    tokenizer_model: Option<&str>,
    vocab: usize,
) -> Result<Vec<(String, MetaValue)>, String> {
    const NORMAL: i32 = 1;
    const UNUSED: i32 = 5;
    const CONTROL: i32 = 3;
    const USER_DEFINED: i32 = 4;
    let read = |p: &str| std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"));
    let json = |p: &str| -> Result<Value, String> {
        serde_json::from_str(&read(p)?).map_err(|e| format!("{p}: {e}"))
    };
    let mut by_id: Vec<Option<(String, i32)>> = Vec::new();
    let mut spm: Option<super::spm_vocab::SpmVocab> = None;
    // A sentencepiece model's own BOS and EOS, and whether Megatron's tokenizer adds BOS.
    let mut spm_model: Option<(Option<u32>, Option<u32>, bool)> = None;
    let mut put = |id: usize, tok: &str, ty: i32| {
        if by_id.len() <= id {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((tok.to_string(), ty));
    };
    let (merges, pre, special_file): (Vec<String>, &str, Option<std::path::PathBuf>) =
        match (tokenizer_type, vocab_file, merge_file, tokenizer_model) {
            ("GPT2BPETokenizer", Some(v), Some(m), _) => {
                let map = json(v)?;
                let map = map.as_object().ok_or_else(|| format!("{v}: not a JSON object"))?;
                for (tok, id) in map {
                    let id = id.as_u64().ok_or_else(|| format!("{v}: id of {tok} is not a number"))?;
                    let ty = if tok == "<|endoftext|>" { CONTROL } else { NORMAL };
                    put(id as usize, tok, ty);
                }
                let merges = read(m)?
                    .lines()
                    .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
                    .map(String::from)
                    .collect();
                (merges, "gpt-2", None)
            }
            (kind @ ("Llama2Tokenizer" | "GPTSentencePieceTokenizer"), _, _, Some(p)) => {
                // The pieces, scores and types as llama.cpp's converter writes a tokenizer.model.
                let m = megatron_data::sentencepiece_model::load(p).map_err(|e| e.to_string())?;
                if let Some(why) = m.unlike_a_merge_vocabulary() {
                    return Err(format!(
                        "{p}: {why}: llama.cpp's llama vocabulary would tokenize this model's text differently"
                    ));
                }
                for (i, (tok, ty)) in m.vocab.tokens.iter().zip(&m.vocab.types).enumerate() {
                    put(i, tok, *ty);
                }
                spm_model = Some((m.bos, m.eos, kind == "Llama2Tokenizer"));
                spm = Some(m.vocab);
                (Vec::new(), "default", None)
            }
            (_, _, _, Some(p)) if tokenizer_type == "HuggingFaceTokenizer" => 'arm: {
                let t = json(p)?;
                let config = Path::new(p).with_file_name("tokenizer_config.json");
                let config = config.exists().then_some(config);
                if let Some(v) = super::spm_vocab::of_tokenizer_json(&t, p)? {
                    for (i, (tok, ty)) in v.tokens.iter().zip(&v.types).enumerate() {
                        put(i, tok, *ty);
                    }
                    spm = Some(v);
                    break 'arm (Vec::new(), "default", config);
                }
                let model = &t["model"];
                if model["type"].as_str() != Some("BPE") {
                    return Err(format!("{p}: a {} model (byte-level BPE and byte-fallback SentencePiece BPE are built)", model["type"]));
                }
                let ignore_merges = model["ignore_merges"].as_bool().unwrap_or(false);
                let pre = llama_cpp_pre_name(&t["pre_tokenizer"], ignore_merges).ok_or_else(|| {
                    format!(
                        "{p}: pre_tokenizer {} (ignore_merges {ignore_merges}) is none of llama.cpp's gpt-2, smollm, qwen2, llama-bpe or default; llama.cpp would split text differently",
                        t["pre_tokenizer"]
                    )
                })?;
                // llama.cpp does not normalize: NFC (Qwen2's) changes only text that is not
                // already NFC, as llama.cpp's own converter accepts; anything else is refused.
                match &t["normalizer"] {
                    Value::Null => {}
                    n if n["type"] == "NFC" => {}
                    n => return Err(format!("{p}: normalizer {n}: llama.cpp does not normalize text")),
                }
                let vocab_map = model["vocab"].as_object().ok_or_else(|| format!("{p}: no model.vocab"))?;
                for (tok, id) in vocab_map {
                    put(id.as_u64().unwrap_or(0) as usize, tok, NORMAL);
                }
                for a in t["added_tokens"].as_array().into_iter().flatten() {
                    let special = a["special"].as_bool().unwrap_or(false);
                    let ty = if special { CONTROL } else { USER_DEFINED };
                    put(a["id"].as_u64().unwrap_or(0) as usize, a["content"].as_str().unwrap_or(""), ty);
                }
                let merges = model["merges"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|m| match m {
                        Value::Array(pair) => pair.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" "),
                        other => other.as_str().unwrap_or("").to_string(),
                    })
                    .collect();
                (merges, pre, config)
            }
            (other, ..) => {
                return Err(format!(
                    "tokenizer {other}: GGUF export writes byte-level BPE and SentencePiece vocabularies (GPT2BPETokenizer with --vocab-file/--merge-file, Llama2Tokenizer or GPTSentencePieceTokenizer with a tokenizer.model, or a HuggingFaceTokenizer tokenizer.json)"
                ))
            }
        };
    if by_id.len() > vocab {
        return Err(format!(
            "the tokenizer has {} tokens, the model's embedding {vocab} rows",
            by_id.len()
        ));
    }
    by_id.resize(vocab, None);
    let (tokens, types): (Vec<String>, Vec<i32>) = by_id
        .into_iter()
        .enumerate()
        .map(|(i, e)| e.unwrap_or((format!("[PAD{i}]"), UNUSED)))
        .unzip();
    let id_of = |s: &str| tokens.iter().position(|t| t == s);
    let mut special: Vec<(&str, usize)> = Vec::new();
    let (mut flags, mut template) = (Vec::new(), None);
    if let Some(cfg) = special_file {
        let c: Value = json(&cfg.display().to_string())?;
        for (g, k) in SPECIAL_TOKENS {
            // A token as a string, or as an AddedToken object.
            let s = c[k].as_str().or(c[k]["content"].as_str());
            if let Some(id) = s.and_then(id_of) {
                special.push((g, id));
            }
        }
        for (g, k) in TOKENIZER_FLAGS {
            if let Some(b) = c[k].as_bool() {
                flags.push((g, b));
            }
        }
        template = c["chat_template"].as_str().map(String::from);
    } else if spm.is_some() {
        // The model's BOS/EOS, else SentencePiece's own names; its unknown token by type.
        let unk = types.iter().position(|&t| t == super::spm_vocab::UNKNOWN);
        let (bos, eos) = match spm_model {
            Some((bos, eos, add_bos)) => {
                flags.extend([("add_bos_token", add_bos), ("add_eos_token", false)]);
                (bos.map(|i| i as usize), eos.map(|i| i as usize))
            }
            None => (id_of("<s>"), id_of("</s>")),
        };
        let named = [("bos", bos), ("eos", eos), ("unknown", unk)];
        special.extend(named.into_iter().filter_map(|(g, id)| Some((g, id?))));
    } else if let Some(id) = id_of("<|endoftext|>") {
        // GPT-2's one special token begins and ends every document (llama.cpp's GPT-2 vocab).
        special.extend([("bos", id), ("eos", id)]);
    }
    let model = if spm.is_some() { "llama" } else { "gpt2" };
    let rows = tokens.len();
    let mut m = vec![
        (
            "tokenizer.ggml.model".to_string(),
            MetaValue::Str(model.into()),
        ),
        ("tokenizer.ggml.pre".to_string(), MetaValue::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".to_string(),
            MetaValue::StrArray(tokens),
        ),
    ];
    if let Some(v) = &spm {
        // Padding rows score as llama.cpp's converter scores them.
        let mut scores = v.scores.clone();
        scores.resize(rows, -1000.0);
        m.push((
            "tokenizer.ggml.scores".to_string(),
            MetaValue::F32Array(scores),
        ));
    }
    m.push((
        "tokenizer.ggml.token_type".to_string(),
        MetaValue::I32Array(types),
    ));
    if spm.is_none() {
        m.push((
            "tokenizer.ggml.merges".to_string(),
            MetaValue::StrArray(merges),
        ));
    }
    // llama.cpp adds a space prefix to a SentencePiece vocabulary unless told not to.
    if spm.as_ref().is_some_and(|v| !v.add_space_prefix)
        && !flags.iter().any(|(f, _)| *f == "add_space_prefix")
    {
        flags.push(("add_space_prefix", false));
    }
    for (g, id) in special {
        m.push((
            format!("tokenizer.ggml.{g}_token_id"),
            MetaValue::U32(id as u32),
        ));
    }
    for (flag, b) in flags {
        m.push((format!("tokenizer.ggml.{flag}"), MetaValue::Bool(b)));
    }
    if let Some(t) = template {
        m.push(("tokenizer.chat_template".into(), MetaValue::Str(t)));
    }
    Ok(m)
}
