//! gpt-oss (`GptOssForCausalLM`) as llama.cpp's `gpt-oss` architecture writes it: what its
//! converter's `GptOssModel` gives for an unquantized model. The interleaved `gate_up_proj`
//! `[E, H, 2I]` becomes `ffn_gate_exps` / `ffn_up_exps` `[E, I, H]` (even and odd columns,
//! transposed), `down_proj` `[E, I, H]` becomes `ffn_down_exps` `[E, H, I]`, the biases follow
//! the same split, the sinks are `attn_sinks`, the router `ffn_gate_inp`.
//!
//! llama.cpp fixes what the model may be: its clamped SwiGLU has gpt-oss's constants (gain
//! 1.702, limit 7), windows alternate from a windowed first layer, and its YaRN rounds the
//! correction range outward whatever `truncate` says. Each is refused where a model differs
//! (the last by `gguf_export.rs` for every architecture, where rounding moves a frequency: it
//! does for the released gpt-oss, whose `truncate` is false, in 9 of its 32 frequencies).

use super::gpt2::transpose;
use super::gpt_oss::{fc1_of_gate_up, gate_up_of_fc1};
use super::llama::num;
use super::Tensors;
use serde_json::Value;

/// A tensor by llama.cpp's name: shape (row-major, outermost first) and values.
pub(crate) type GgufTensor = (String, Vec<usize>, Vec<f32>);

/// The gated unit's constants llama.cpp's `LLM_FFN_SWIGLU_OAI_MOE` has built in.
const LLAMA_CPP_ALPHA: f64 = 1.702;
const LLAMA_CPP_LIMIT: f64 = 7.0;

/// Checks that llama.cpp runs `hf` as its config says, and returns the window llama.cpp's
/// `attention.sliding_window` key holds.
pub(crate) fn check_config(hf: &Value) -> Result<usize, String> {
    let alpha = hf["swiglu_alpha"].as_f64().unwrap_or(LLAMA_CPP_ALPHA);
    let limit = hf["swiglu_limit"].as_f64().unwrap_or(LLAMA_CPP_LIMIT);
    if alpha != LLAMA_CPP_ALPHA || limit != LLAMA_CPP_LIMIT {
        return Err(format!(
            "swiglu_alpha {alpha} / swiglu_limit {limit}: llama.cpp's gpt-oss has 1.702 and 7 built in (--activation-func-clamp-value 7)"
        ));
    }
    let window = hf["sliding_window"]
        .as_u64()
        .ok_or("gpt-oss without sliding_window: llama.cpp's gpt-oss needs its window")?
        as usize;
    let layers = num(hf, "num_hidden_layers")?;
    let alternating = (0..layers).all(|l| {
        let want = if l % 2 == 0 {
            "sliding_attention"
        } else {
            "full_attention"
        };
        hf["layer_types"][l].as_str() == Some(want)
    });
    if !alternating {
        return Err("layer_types: llama.cpp's gpt-oss windows every other layer from the first (--window-attn-skip-freq 2)".into());
    }
    Ok(window)
}

/// llama.cpp's tensors for the Hugging Face tensors `t` of a `layers`-layer model (taken out
/// of `t`).
pub(crate) fn tensors(hf: &Value, t: &mut Tensors) -> Result<Vec<GgufTensor>, String> {
    let layers = num(hf, "num_hidden_layers")?;
    let mut out = Vec::new();
    let mut take = |name: &str| {
        t.remove(name)
            .ok_or_else(|| format!("missing tensor {name}"))
    };
    for (hf_name, g) in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ] {
        let (s, v) = take(hf_name)?;
        out.push((g.to_string(), s, v));
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (hf_name, g) in PAIRS {
            let (s, v) = take(&format!("{p}.{hf_name}"))?;
            out.push((format!("blk.{l}.{g}"), s, v));
        }
        let (s, gate_up) = take(&format!("{p}.mlp.experts.gate_up_proj"))?;
        let (_, gate_up_b) = take(&format!("{p}.mlp.experts.gate_up_proj_bias"))?;
        let (_, down) = take(&format!("{p}.mlp.experts.down_proj"))?;
        let (e, h, f2) = (s[0], s[1], s[2]);
        let f = f2 / 2;
        // Per expert, megatron-core's fc1 [gate; up] is llama.cpp's gate and up [I, H], one
        // after the other; down_proj [I, H] transposed is its down [H, I].
        let (mut gate, mut up) = (Vec::with_capacity(e * f * h), Vec::with_capacity(e * f * h));
        let (mut gate_b, mut up_b) = (Vec::with_capacity(e * f), Vec::with_capacity(e * f));
        let mut down_t = Vec::with_capacity(e * h * f);
        for x in 0..e {
            let (fc1, b) = fc1_of_gate_up(
                &gate_up[x * h * f2..(x + 1) * h * f2],
                &gate_up_b[x * f2..(x + 1) * f2],
                h,
            );
            gate.extend_from_slice(&fc1[..f * h]);
            up.extend_from_slice(&fc1[f * h..]);
            gate_b.extend_from_slice(&b[..f]);
            up_b.extend_from_slice(&b[f..]);
            down_t.extend(transpose(&down[x * f * h..(x + 1) * f * h], f, h));
        }
        let blk = |g: &str| format!("blk.{l}.{g}");
        out.push((blk("ffn_gate_exps.weight"), vec![e, f, h], gate));
        out.push((blk("ffn_up_exps.weight"), vec![e, f, h], up));
        out.push((blk("ffn_gate_exps.bias"), vec![e, f], gate_b));
        out.push((blk("ffn_up_exps.bias"), vec![e, f], up_b));
        out.push((blk("ffn_down_exps.weight"), vec![e, h, f], down_t));
    }
    Ok(out)
}

/// The Hugging Face `GptOssForCausalLM` config.json and tensors of a llama.cpp `gpt-oss` GGUF:
/// the inverse of [`tensors`] (experts of any type `Gguf::dequantize` reads, MXFP4 — the
/// released files' — included), and the model llama.cpp runs: its clamp of 7, windows on every
/// other layer from the first, YaRN with the correction range rounded (`truncate` left at its
/// default, true).
pub(crate) fn hf_of(g: &super::gguf::Gguf) -> Result<(Value, Tensors), String> {
    use super::gguf::Value as Meta;
    let key = |k: &str| format!("gpt-oss.{k}");
    let num = |k: &str| {
        g.meta
            .get(&key(k))
            .and_then(Meta::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| format!("metadata {} missing", key(k)))
    };
    let f = |k: &str, d: f64| g.meta.get(&key(k)).and_then(Meta::as_f64).unwrap_or(d);
    if g.meta
        .contains_key(&key("attention.sliding_window_pattern"))
    {
        return Err(format!(
            "{}: windows other than every other layer are not read",
            key("attention.sliding_window_pattern")
        ));
    }
    let (layers, h, heads) = (
        num("block_count")?,
        num("embedding_length")?,
        num("attention.head_count")?,
    );
    let groups = num("attention.head_count_kv").unwrap_or(heads);
    let hd = num("attention.key_length").unwrap_or(h / heads);
    let (experts, ffn) = (num("expert_count")?, num("expert_feed_forward_length")?);
    let mut t = Tensors::new();
    // Each layer's experts as llama.cpp stores them (gate, up, down and the gate and up
    // biases), put back into Hugging Face's form below.
    let mut experts_of: std::collections::BTreeMap<(usize, String), Vec<f32>> = Default::default();
    let mut vocab = None;
    for info in &g.tensors {
        let v = g.dequantize(info)?;
        let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        let name = info.name.as_str();
        let hf = match name {
            "token_embd.weight" => {
                vocab = shape.first().copied();
                "model.embed_tokens.weight".to_string()
            }
            "output_norm.weight" => "model.norm.weight".to_string(),
            "output.weight" => "lm_head.weight".to_string(),
            _ => {
                let rest = name
                    .strip_prefix("blk.")
                    .ok_or_else(|| format!("tensor {name}: not part of a gpt-oss model"))?;
                let (l, part) = rest
                    .split_once('.')
                    .ok_or_else(|| format!("tensor {name}: unexpected name"))?;
                let l: usize = l
                    .parse()
                    .map_err(|_| format!("tensor {name}: unexpected name"))?;
                if EXPERT_PARTS.contains(&part) {
                    experts_of.insert((l, part.to_string()), v);
                    continue;
                }
                let hf = PAIRS
                    .iter()
                    .find(|(_, gg)| *gg == part)
                    .map(|(hf, _)| *hf)
                    .ok_or_else(|| format!("tensor {name}: not part of a gpt-oss model"))?;
                format!("model.layers.{l}.{hf}")
            }
        };
        t.insert(hf, (shape, v));
    }
    for l in 0..layers {
        let mut part = |g: &str| {
            experts_of
                .remove(&(l, g.to_string()))
                .ok_or_else(|| format!("tensor blk.{l}.{g} missing"))
        };
        let [gate, up, gate_b, up_b, down] = EXPERT_PARTS.map(&mut part);
        let (gate, up, gate_b, up_b, down) = (gate?, up?, gate_b?, up_b?, down?);
        let (mut w, mut b) = (Vec::with_capacity(gate.len() * 2), Vec::new());
        let mut down_proj = Vec::with_capacity(down.len());
        for x in 0..experts {
            let e = |v: &[f32], n: usize| v[x * n..(x + 1) * n].to_vec();
            let fc1 = [e(&gate, ffn * h), e(&up, ffn * h)].concat();
            let fc1_b = [e(&gate_b, ffn), e(&up_b, ffn)].concat();
            let (wx, bx) = gate_up_of_fc1(&fc1, &fc1_b, h);
            w.extend(wx);
            b.extend(bx);
            down_proj.extend(transpose(&down[x * h * ffn..(x + 1) * h * ffn], h, ffn));
        }
        let p = format!("model.layers.{l}.mlp.experts");
        t.insert(format!("{p}.gate_up_proj"), (vec![experts, h, 2 * ffn], w));
        t.insert(
            format!("{p}.gate_up_proj_bias"),
            (vec![experts, 2 * ffn], b),
        );
        t.insert(format!("{p}.down_proj"), (vec![experts, ffn, h], down_proj));
    }
    let base = f("rope.freq_base", 150000.0);
    let layer_types: Vec<&str> = (0..layers)
        .map(|l| {
            if l % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let config = serde_json::json!({
        "architectures": [super::gpt_oss::ARCHITECTURE],
        "model_type": "gpt_oss",
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": hd,
        "max_position_embeddings": num("context_length")?,
        "rms_norm_eps": f("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_parameters": super::gguf::rope_parameters(g, "gpt-oss", None, hd, base)?,
        "sliding_window": num("attention.sliding_window")?,
        "layer_types": layer_types,
        "num_local_experts": experts,
        "num_experts_per_tok": num("expert_used_count")?,
        "swiglu_alpha": LLAMA_CPP_ALPHA,
        "swiglu_limit": LLAMA_CPP_LIMIT,
        "attention_bias": true,
        "tie_word_embeddings": false,
        "vocab_size": vocab.ok_or("no token_embd.weight")?,
    });
    Ok((config, t))
}

/// llama.cpp's expert tensors that [`fc1_of_gate_up`] and a transposition make of Hugging Face's
/// `gate_up_proj`, its bias and `down_proj`.
const EXPERT_PARTS: [&str; 5] = [
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_gate_exps.bias",
    "ffn_up_exps.bias",
    "ffn_down_exps.weight",
];

/// Hugging Face names under a layer and llama.cpp's, for the tensors that map one to one.
const PAIRS: [(&str, &str); 14] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    (
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
    ),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.sinks", "attn_sinks.weight"),
    ("mlp.router.weight", "ffn_gate_inp.weight"),
    ("mlp.router.bias", "ffn_gate_inp.bias"),
    ("mlp.experts.down_proj_bias", "ffn_down_exps.bias"),
];
