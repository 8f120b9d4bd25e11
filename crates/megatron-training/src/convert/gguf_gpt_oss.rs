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
        for (hf_name, g) in [
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
        ] {
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
