//! `GptOssForCausalLM` <-> megatron-core's gpt-oss: the Llama attention with q/k/v/o biases and
//! learned sinks (`self_attn.sinks`: megatron-core's `--softmax-type learnable`,
//! `core_attention.softmax_offset`), windowed and full layers (`layer_types`), YaRN; in every
//! layer a biased router (top-k of the logits, softmax over the k: megatron-core's softmax
//! router) and experts whose fused `gate_up_proj` `[E, H, 2I]` interleaves the gate (even
//! columns) and the linear half (odd), applied as `(clamp(up) + 1) * quick_gelu(clamp(gate))`:
//! megatron-core's `--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value
//! swiglu_limit`.

use super::gpt2::transpose;
use super::llama::{move_tensor, num, MlpMapping};
use super::{take, Tensors};
use megatron_core::transformer::config::{Activation, GluConfig, SoftmaxType};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) const ARCHITECTURE: &str = "GptOssForCausalLM";

/// Quick-GELU's sigmoid gain, the only `swiglu_alpha` megatron-core's Quick-GEGLU has.
const QUICK_GELU_ALPHA: f64 = 1.702;

pub(crate) struct GptOssMoe;

/// One expert's `gate_up_proj` `[H, 2I]` (gate and linear columns interleaved: gate `i` is
/// column `2i`) and its bias `[2I]` as megatron-core's fc1 `[2I, H]` = `[gate; up]` and bias.
/// Shared with the GGUF files (`gguf_gpt_oss.rs`), whose `ffn_gate_exps` / `ffn_up_exps` are
/// the two halves.
pub(crate) fn fc1_of_gate_up(w: &[f32], b: &[f32], h: usize) -> (Vec<f32>, Vec<f32>) {
    let f2 = b.len();
    (
        halves_of_pairs(&transpose(w, h, f2), f2, h),
        halves_of_pairs(b, f2, 1),
    )
}

/// The inverse of [`fc1_of_gate_up`].
pub(crate) fn gate_up_of_fc1(fc1: &[f32], b: &[f32], h: usize) -> (Vec<f32>, Vec<f32>) {
    let f2 = b.len();
    (
        transpose(&pairs_of_halves(fc1, f2, h), f2, h),
        pairs_of_halves(b, f2, 1),
    )
}

/// `rows` rows of `cols`, the even rows first, then the odd ones.
fn halves_of_pairs(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let row = |r: usize| &x[r * cols..(r + 1) * cols];
    (0..rows)
        .step_by(2)
        .chain((1..rows).step_by(2))
        .flat_map(row)
        .copied()
        .collect()
}

/// The inverse of [`halves_of_pairs`]: row `i` of each half to rows `2i` and `2i + 1`.
fn pairs_of_halves(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let half = rows / 2;
    let row = |r: usize| &x[r * cols..(r + 1) * cols];
    (0..half)
        .flat_map(|i| row(i).iter().chain(row(half + i)))
        .copied()
        .collect()
}

/// MXFP4's sixteen E2M1 codes (sign, two exponent bits, one mantissa bit).
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// An expert weight `name` as transformers' `GptOssExperts` holds it, `[experts, in, out]`:
/// stored so, or in MXFP4 as the released checkpoints store it — `{name}_blocks`
/// `[experts, out, in/32, 16]` bytes of two codes each (the low nibble first) and
/// `{name}_scales` `[experts, out, in/32]`, one power of two `2^(s - 127)` per 32 codes —
/// dequantized as transformers' `convert_moe_packed_tensors` does (then transposed to
/// `[experts, in, out]`). Written by hand: no crate decodes MXFP4.
fn expert_weight(
    t: &mut Tensors,
    name: &str,
    (e, inp, out): (usize, usize, usize),
) -> Result<Vec<f32>, String> {
    let (bn, sn) = (format!("{name}_blocks"), format!("{name}_scales"));
    if !t.contains_key(&bn) {
        return take(t, name, &[e, inp, out]);
    }
    if !inp.is_multiple_of(32) {
        return Err(format!(
            "{bn}: MXFP4 blocks of 32 need a multiple of 32, not {inp}"
        ));
    }
    let g = inp / 32;
    let blocks = take(t, &bn, &[e, out, g, 16])?;
    let scales = take(t, &sn, &[e, out, g])?;
    let mut w = vec![0.0f32; e * inp * out];
    for x in 0..e {
        for r in 0..out {
            for b in 0..g {
                let at = (x * out + r) * g + b;
                let scale = 2.0f32.powi(scales[at] as i32 - 127);
                for (j, &byte) in blocks[at * 16..(at + 1) * 16].iter().enumerate() {
                    let byte = byte as u8;
                    for (k, code) in [byte & 0x0F, byte >> 4].into_iter().enumerate() {
                        let c = b * 32 + 2 * j + k;
                        w[(x * inp + c) * out + r] = FP4_VALUES[code as usize] * scale;
                    }
                }
            }
        }
    }
    Ok(w)
}

impl GptOssMoe {
    /// Whether `cfg` is a gpt-oss model (what `megatron convert --to hf` exports as one), or
    /// why not where it uses part of gpt-oss's design.
    pub(crate) fn fits(cfg: &TransformerConfig) -> Result<bool, String> {
        let uses = cfg.softmax_type != SoftmaxType::Vanilla || !cfg.glu.is_default();
        if !uses {
            return Ok(false);
        }
        let why = if cfg.softmax_type != SoftmaxType::Learnable {
            Some(
                "--softmax-type off-by-one (gpt-oss's sinks are learned: --softmax-type learnable)",
            )
        } else if cfg.activation != Activation::QuickGeGLU
            || cfg.glu.linear_offset != 1.0
            || cfg.glu.clamp_value.is_none()
        {
            Some("an MLP other than gpt-oss's (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value V)")
        } else if !cfg.add_bias_linear || !cfg.add_qkv_bias {
            Some("--disable-bias-linear (gpt-oss has biases on every linear layer and its router)")
        } else if cfg.qk_layernorm {
            Some("--qk-layernorm (gpt-oss has no query/key norms)")
        } else {
            match &cfg.moe {
                None => Some("a dense MLP (gpt-oss's are experts: --num-experts)"),
                Some(m) if m.shared_expert_ffn.is_some() => {
                    Some("a shared expert (gpt-oss has none)")
                }
                Some(m)
                    if m.pre_softmax
                        || m.score != Default::default()
                        || m.topk_scaling_factor.is_some()
                        || m.router_groups.is_some() =>
                {
                    Some("a router other than the softmax over the top-k logits")
                }
                Some(m) if !m.biases => {
                    Some("experts without biases (saved before this engine built them)")
                }
                Some(m) if m.expert_bias_update_rate.is_some() => {
                    Some("--moe-router-enable-expert-bias")
                }
                Some(_) if (0..cfg.num_layers).any(|l| !cfg.is_moe_layer(l)) => {
                    Some("dense layers among the experts (gpt-oss has experts on every layer)")
                }
                Some(_) => None,
            }
        };
        match why {
            None => Ok(true),
            Some(w) => Err(format!(
                "attention sinks or gpt-oss's clamped MLP with {w}: no Hugging Face family holds it"
            )),
        }
    }
}

impl MlpMapping for GptOssMoe {
    /// gpt-oss's layers differ from Llama's in the experts and in the attention's biases and
    /// sinks, all set here.
    fn configure(&self, hf: &Value, cfg: &mut TransformerConfig) -> Result<(), String> {
        match hf["quantization_config"]["quant_method"].as_str() {
            None | Some("mxfp4") => {}
            Some(q) => {
                return Err(format!(
                    "quantization_config.quant_method '{q}': this converter reads gpt-oss's experts unquantized or in MXFP4 (the released checkpoints'); dequantize first (transformers: from_pretrained with the quantizer's dequantize option, then save_pretrained)"
                ))
            }
        }
        let alpha = hf["swiglu_alpha"].as_f64().unwrap_or(QUICK_GELU_ALPHA);
        if (alpha - QUICK_GELU_ALPHA).abs() > 1e-9 {
            return Err(format!(
                "swiglu_alpha {alpha}: megatron-core's Quick-GEGLU has the gain 1.702"
            ));
        }
        if hf["attention_bias"].as_bool() == Some(false) {
            return Err("attention_bias false: gpt-oss without biases is not built".into());
        }
        let limit = hf["swiglu_limit"].as_f64().unwrap_or(7.0);
        if !(limit.is_finite() && limit > 0.0) {
            return Err(format!("swiglu_limit {limit} is not a positive number"));
        }
        let experts = num(hf, "num_local_experts")?;
        cfg.moe = Some(megatron_core::transformer::config::MoEConfig {
            biases: true,
            ..super::mixtral::moe_config(hf, experts, cfg.ffn_hidden_size, false)?
        });
        cfg.activation = Activation::QuickGeGLU;
        cfg.glu = GluConfig {
            linear_offset: 1.0,
            clamp_value: Some(limit as f32),
        };
        cfg.softmax_type = SoftmaxType::Learnable;
        cfg.add_bias_linear = true;
        cfg.add_qkv_bias = true;
        Ok(())
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        m: &mut Tensors,
        src: &str,
        dst: &str,
    ) -> Result<(), String> {
        let moe = cfg.moe.as_ref().expect("configured");
        let (h, f, e) = (cfg.hidden_size, moe.ffn_hidden_size, moe.num_experts);
        let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
        move_tensor(
            t,
            m,
            (&format!("{s}.router.weight"), &format!("{d}.router.weight")),
            [e, h],
        )?;
        let b = take(t, &format!("{s}.router.bias"), &[e])?;
        m.insert(format!("{d}.router.bias"), (vec![e], b));
        let gate_up = expert_weight(t, &format!("{s}.experts.gate_up_proj"), (e, h, 2 * f))?;
        let gate_up_b = take(t, &format!("{s}.experts.gate_up_proj_bias"), &[e, 2 * f])?;
        let down = expert_weight(t, &format!("{s}.experts.down_proj"), (e, f, h))?;
        let down_b = take(t, &format!("{s}.experts.down_proj_bias"), &[e, h])?;
        for x in 0..e {
            let q = format!("{d}.experts.local_experts.{x}");
            let (fc1, fc1_b) = fc1_of_gate_up(
                &gate_up[x * h * 2 * f..(x + 1) * h * 2 * f],
                &gate_up_b[x * 2 * f..(x + 1) * 2 * f],
                h,
            );
            m.insert(format!("{q}.linear_fc1.weight"), (vec![2 * f, h], fc1));
            m.insert(format!("{q}.linear_fc1.bias"), (vec![2 * f], fc1_b));
            // fc2 [H, I] is down_proj [I, H] transposed.
            let fc2 = transpose(&down[x * f * h..(x + 1) * f * h], f, h);
            m.insert(format!("{q}.linear_fc2.weight"), (vec![h, f], fc2));
            let b = down_b[x * h..(x + 1) * h].to_vec();
            m.insert(format!("{q}.linear_fc2.bias"), (vec![h], b));
        }
        Ok(())
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        t: &mut Tensors,
        dst: &str,
        src: &str,
    ) -> Result<(), String> {
        let moe = cfg.moe.as_ref().expect("an MoE model");
        let (h, f, e) = (cfg.hidden_size, moe.ffn_hidden_size, moe.num_experts);
        let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
        move_tensor(
            m,
            t,
            (&format!("{s}.router.weight"), &format!("{d}.router.weight")),
            [e, h],
        )?;
        let b = take(m, &format!("{s}.router.bias"), &[e])?;
        t.insert(format!("{d}.router.bias"), (vec![e], b));
        let (mut gate_up, mut gate_up_b) = (Vec::with_capacity(e * h * 2 * f), Vec::new());
        let (mut down, mut down_b) = (Vec::with_capacity(e * f * h), Vec::with_capacity(e * h));
        for x in 0..e {
            let q = format!("{s}.experts.local_experts.{x}");
            let fc1 = take(m, &format!("{q}.linear_fc1.weight"), &[2 * f, h])?;
            let b = take(m, &format!("{q}.linear_fc1.bias"), &[2 * f])?;
            let (w, b) = gate_up_of_fc1(&fc1, &b, h);
            gate_up.extend(w);
            gate_up_b.extend(b);
            let fc2 = take(m, &format!("{q}.linear_fc2.weight"), &[h, f])?;
            down.extend(transpose(&fc2, h, f));
            down_b.extend(take(m, &format!("{q}.linear_fc2.bias"), &[h])?);
        }
        t.insert(
            format!("{d}.experts.gate_up_proj"),
            (vec![e, h, 2 * f], gate_up),
        );
        t.insert(
            format!("{d}.experts.gate_up_proj_bias"),
            (vec![e, 2 * f], gate_up_b),
        );
        t.insert(format!("{d}.experts.down_proj"), (vec![e, f, h], down));
        t.insert(format!("{d}.experts.down_proj_bias"), (vec![e, h], down_b));
        Ok(())
    }

    fn hf_config(
        &self,
        cfg: &TransformerConfig,
        _qkv_bias: bool,
    ) -> (&'static str, &'static str, Value) {
        let moe = cfg.moe.as_ref().expect("an MoE model");
        (
            ARCHITECTURE,
            "gpt_oss",
            json!({
                "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.topk,
                "intermediate_size": moe.ffn_hidden_size,
                "swiglu_alpha": QUICK_GELU_ALPHA,
                "swiglu_limit": cfg.glu.clamp_value,
                "output_router_logits": false,
                "router_aux_loss_coef": moe.aux_loss_coeff,
                // The experts' activation is fixed by swiglu_alpha and swiglu_limit; this
                // key is transformers' default, which nothing in gpt-oss reads.
                "hidden_act": "silu",
            }),
        )
    }
}
