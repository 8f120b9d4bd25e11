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
        let (e, h, f2) = (s[0], s[1], s[2]);
        let f = f2 / 2;
        // [E, H, 2I] -> gate and up [E, I, H]: column 2i (gate) or 2i + 1 (up) as row i.
        let split = |odd: usize| -> Vec<f32> {
            let mut w = Vec::with_capacity(e * f * h);
            for x in 0..e {
                let m = &gate_up[x * h * f2..(x + 1) * h * f2];
                for i in 0..f {
                    w.extend((0..h).map(|k| m[k * f2 + 2 * i + odd]));
                }
            }
            w
        };
        out.push((
            format!("blk.{l}.ffn_gate_exps.weight"),
            vec![e, f, h],
            split(0),
        ));
        out.push((
            format!("blk.{l}.ffn_up_exps.weight"),
            vec![e, f, h],
            split(1),
        ));
        let (_, b) = take(&format!("{p}.mlp.experts.gate_up_proj_bias"))?;
        let half = |odd: usize| -> Vec<f32> {
            (0..e)
                .flat_map(|x| (0..f).map(move |i| (x, i)))
                .map(|(x, i)| b[x * f2 + 2 * i + odd])
                .collect()
        };
        out.push((format!("blk.{l}.ffn_gate_exps.bias"), vec![e, f], half(0)));
        out.push((format!("blk.{l}.ffn_up_exps.bias"), vec![e, f], half(1)));
        // down_proj [E, I, H] -> [E, H, I].
        let (_, down) = take(&format!("{p}.mlp.experts.down_proj"))?;
        let mut w = Vec::with_capacity(e * h * f);
        for x in 0..e {
            let m = &down[x * f * h..(x + 1) * f * h];
            for o in 0..h {
                w.extend((0..f).map(|i| m[i * h + o]));
            }
        }
        out.push((format!("blk.{l}.ffn_down_exps.weight"), vec![e, h, f], w));
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
    // Each layer's experts as llama.cpp splits them: gate and up (weights, biases), joined
    // back into the interleaved gate_up_proj below.
    let mut halves: std::collections::BTreeMap<(usize, &'static str), Vec<f32>> =
        Default::default();
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
                let p = format!("model.layers.{l}");
                match part {
                    "ffn_gate_exps.weight"
                    | "ffn_up_exps.weight"
                    | "ffn_gate_exps.bias"
                    | "ffn_up_exps.bias" => {
                        let part: &'static str = [
                            "ffn_gate_exps.weight",
                            "ffn_up_exps.weight",
                            "ffn_gate_exps.bias",
                            "ffn_up_exps.bias",
                        ]
                        .into_iter()
                        .find(|x| *x == part)
                        .expect("matched");
                        halves.insert((l, part), v);
                        continue;
                    }
                    "ffn_down_exps.weight" => {
                        // [E, H, I] -> down_proj [E, I, H].
                        let mut w = Vec::with_capacity(v.len());
                        for x in 0..experts {
                            let m = &v[x * h * ffn..(x + 1) * h * ffn];
                            for i in 0..ffn {
                                w.extend((0..h).map(|o| m[o * ffn + i]));
                            }
                        }
                        t.insert(
                            format!("{p}.mlp.experts.down_proj"),
                            (vec![experts, ffn, h], w),
                        );
                        continue;
                    }
                    _ => {}
                }
                let hf = PAIRS
                    .iter()
                    .find(|(_, gg)| *gg == part)
                    .map(|(hf, _)| *hf)
                    .ok_or_else(|| format!("tensor {name}: not part of a gpt-oss model"))?;
                format!("{p}.{hf}")
            }
        };
        t.insert(hf, (shape, v));
    }
    for l in 0..layers {
        let mut half = |part: &'static str| {
            halves
                .remove(&(l, part))
                .ok_or_else(|| format!("tensor blk.{l}.{part} missing"))
        };
        let (gate, up) = (half("ffn_gate_exps.weight")?, half("ffn_up_exps.weight")?);
        let (gb, ub) = (half("ffn_gate_exps.bias")?, half("ffn_up_exps.bias")?);
        // [E, I, H] gate and up -> [E, H, 2I], gate in the even columns.
        let mut w = vec![0.0f32; experts * h * 2 * ffn];
        let mut b = vec![0.0f32; experts * 2 * ffn];
        for x in 0..experts {
            for i in 0..ffn {
                for k in 0..h {
                    let at = (x * h + k) * 2 * ffn + 2 * i;
                    w[at] = gate[(x * ffn + i) * h + k];
                    w[at + 1] = up[(x * ffn + i) * h + k];
                }
                b[x * 2 * ffn + 2 * i] = gb[x * ffn + i];
                b[x * 2 * ffn + 2 * i + 1] = ub[x * ffn + i];
            }
        }
        let p = format!("model.layers.{l}.mlp.experts");
        t.insert(format!("{p}.gate_up_proj"), (vec![experts, h, 2 * ffn], w));
        t.insert(
            format!("{p}.gate_up_proj_bias"),
            (vec![experts, 2 * ffn], b),
        );
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
