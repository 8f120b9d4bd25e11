//! GGUF (llama.cpp's container): metadata and tensors read from a memory map, tensors
//! dequantized to f32 exactly as ggml / gguf-py define them (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, and the k-quants Q2_K-Q6_K of `k_quants.rs`),
//! and llama.cpp's conversion undone: the `blk.N.*` names and, for Llama only, the rotary row
//! permutation of Q and K. The result is a Hugging Face-style config and tensor set (Llama,
//! Qwen2, Qwen3) that the Llama family file maps on. Written by hand: no maintained Rust crate reads GGUF's quantized types.

use super::Tensors;
use crate::TrainError;
use std::collections::BTreeMap;
use std::path::Path;

/// A metadata value.
#[derive(Clone, Debug)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Arr(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest.
    pub dims: Vec<u64>,
    pub ty: u32,
    pub offset: u64,
}

pub struct Gguf {
    map: memmap2::Mmap,
    pub meta: BTreeMap<String, Value>,
    /// Each key's GGUF value type (9 for arrays), for readers that compare files.
    pub meta_types: BTreeMap<String, u32>,
    pub tensors: Vec<TensorInfo>,
    data_start: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let s = self
            .b
            .get(self.at..self.at + n)
            .ok_or_else(|| format!("truncated at byte {}", self.at))?;
        self.at += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, ty: u32) -> Result<Value, String> {
        let b = |c: &mut Self, n| c.take(n).map(|s| s.to_vec());
        Ok(match ty {
            0 => Value::Int(b(self, 1)?[0] as i128),
            1 => Value::Int(b(self, 1)?[0] as i8 as i128),
            2 => Value::Int(u16::from_le_bytes(b(self, 2)?.try_into().expect("2")) as i128),
            3 => Value::Int(i16::from_le_bytes(b(self, 2)?.try_into().expect("2")) as i128),
            4 => Value::Int(self.u32()? as i128),
            5 => Value::Int(self.u32()? as i32 as i128),
            6 => Value::Float(f32::from_le_bytes(b(self, 4)?.try_into().expect("4")) as f64),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let (t, n) = (self.u32()?, self.u64()?);
                let mut v = Vec::with_capacity(n.min(1 << 20) as usize);
                for _ in 0..n {
                    v.push(self.value(t)?);
                }
                Value::Arr(v)
            }
            10 => Value::Int(self.u64()? as i128),
            11 => Value::Int(self.u64()? as i64 as i128),
            12 => Value::Float(f64::from_le_bytes(b(self, 8)?.try_into().expect("8"))),
            other => return Err(format!("unknown metadata type {other}")),
        })
    }
}

fn ggml_f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// (elements per block, bytes per block) of a tensor type, and its name.
fn block(ty: u32) -> Option<(usize, usize, &'static str)> {
    Some(match ty {
        0 => (1, 4, "F32"),
        1 => (1, 2, "F16"),
        2 => (32, 18, "Q4_0"),
        3 => (32, 20, "Q4_1"),
        6 => (32, 22, "Q5_0"),
        7 => (32, 24, "Q5_1"),
        8 => (32, 34, "Q8_0"),
        10 => (256, 84, "Q2_K"),
        11 => (256, 110, "Q3_K"),
        12 => (256, 144, "Q4_K"),
        13 => (256, 176, "Q5_K"),
        14 => (256, 210, "Q6_K"),
        30 => (1, 2, "BF16"),
        39 => (32, 17, "MXFP4"),
        _ => return None,
    })
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf, TrainError> {
        let bad = |m: String| TrainError::Checkpoint {
            path: path.display().to_string(),
            msg: m,
        };
        if path.is_dir() {
            return Err(bad(
                "is a directory: --from gguf reads one .gguf file".into()
            ));
        }
        let f = std::fs::File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        // SAFETY: read-only mapping of a file that is not written while converting.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| bad(e.to_string()))?;
        let mut c = Cursor { b: &map, at: 0 };
        if c.take(4).map_err(bad)? != b"GGUF" {
            return Err(bad("not a GGUF file (bad magic)".into()));
        }
        let version = c.u32().map_err(bad)?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!("GGUF version {version} (2 and 3 are read)")));
        }
        let (nt, nkv) = (c.u64().map_err(bad)?, c.u64().map_err(bad)?);
        let (mut meta, mut meta_types) = (BTreeMap::new(), BTreeMap::new());
        for _ in 0..nkv {
            let k = c.string().map_err(bad)?;
            let t = c.u32().map_err(bad)?;
            let v = c.value(t).map_err(|e| bad(format!("metadata {k}: {e}")))?;
            meta_types.insert(k.clone(), t);
            meta.insert(k, v);
        }
        let mut tensors = Vec::with_capacity(nt as usize);
        for _ in 0..nt {
            let name = c.string().map_err(bad)?;
            let nd = c.u32().map_err(bad)?;
            let dims = (0..nd)
                .map(|_| c.u64())
                .collect::<Result<Vec<_>, _>>()
                .map_err(bad)?;
            let ty = c.u32().map_err(bad)?;
            let offset = c.u64().map_err(bad)?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let align = meta
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32) as usize;
        let data_start = c.at.div_ceil(align) * align;
        Ok(Gguf {
            map,
            meta,
            meta_types,
            tensors,
            data_start,
        })
    }

    /// A tensor's bytes as stored.
    pub fn raw(&self, t: &TensorInfo) -> Result<&[u8], String> {
        let n: usize = t.dims.iter().product::<u64>() as usize;
        let (per, bytes, _) = block(t.ty).ok_or_else(|| {
            format!(
                "tensor {}: GGUF tensor type {} is not supported",
                t.name, t.ty
            )
        })?;
        let start = self.data_start + t.offset as usize;
        self.map
            .get(start..start + n / per * bytes)
            .ok_or_else(|| format!("tensor {}: data beyond the end of the file", t.name))
    }

    /// A tensor dequantized to f32, in ggml order (`dims[0]` fastest = row-major `[.., dims[0]]`).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>, String> {
        let n: usize = t.dims.iter().product::<u64>() as usize;
        let (per, _, name) = block(t.ty).ok_or_else(|| {
            format!("tensor {}: GGUF tensor type {} is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, MXFP4 are)", t.name, t.ty)
        })?;
        if !n.is_multiple_of(per) {
            return Err(format!(
                "tensor {}: {n} elements is not whole {name} blocks",
                t.name
            ));
        }
        let d = self.raw(t)?;
        let mut out = Vec::with_capacity(n);
        match t.ty {
            0 => out.extend(
                d.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            1 => out.extend(d.chunks_exact(2).map(ggml_f16)),
            30 => out.extend(
                d.chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            39 => {
                // ggml's MXFP4: an E8M0 byte, then 16 bytes whose low nibbles are the first 16
                // values and high nibbles the next 16, codes doubled (`kvalues_mxfp4`) under
                // half the block's power of two.
                const KVALUES: [f32; 16] = [
                    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0,
                    -8.0, -12.0,
                ];
                for blk in d.chunks_exact(17) {
                    let e = blk[0] as u32;
                    let bits = if e < 2 {
                        0x0020_0000 << e
                    } else {
                        (e - 1) << 23
                    };
                    let s = f32::from_bits(bits);
                    let qs = &blk[1..];
                    out.extend(qs.iter().map(|&q| KVALUES[(q & 0x0F) as usize] * s));
                    out.extend(qs.iter().map(|&q| KVALUES[(q >> 4) as usize] * s));
                }
            }
            8 => {
                for blk in d.chunks_exact(34) {
                    let s = ggml_f16(&blk[..2]);
                    out.extend(blk[2..].iter().map(|&q| q as i8 as f32 * s));
                }
            }
            2 => {
                for blk in d.chunks_exact(18) {
                    let s = ggml_f16(&blk[..2]);
                    let qs = &blk[2..];
                    out.extend(qs.iter().map(|&q| ((q & 0x0F) as i32 - 8) as f32 * s));
                    out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * s));
                }
            }
            3 => {
                for blk in d.chunks_exact(20) {
                    let (s, m) = (ggml_f16(&blk[..2]), ggml_f16(&blk[2..4]));
                    let qs = &blk[4..];
                    out.extend(qs.iter().map(|&q| (q & 0x0F) as f32 * s + m));
                    out.extend(qs.iter().map(|&q| (q >> 4) as f32 * s + m));
                }
            }
            6 | 7 => {
                // d (and Q5_1's min m), 32 high bits as a u32, 16 bytes of low nibbles.
                let bytes = if t.ty == 6 { 22 } else { 24 };
                for blk in d.chunks_exact(bytes) {
                    let s = ggml_f16(&blk[..2]);
                    let at = bytes - 20;
                    let m = (t.ty == 7).then(|| ggml_f16(&blk[2..4]));
                    let qh = u32::from_le_bytes(blk[at..at + 4].try_into().expect("4 bytes"));
                    let qs = &blk[at + 4..];
                    out.extend((0..32).map(|e| {
                        let low = (qs[e % 16] >> (4 * (e / 16))) & 0x0F;
                        let q = low | ((((qh >> e) & 1) as u8) << 4);
                        match m {
                            None => s * (q as i8 - 16) as f32,
                            Some(m) => s * q as f32 + m,
                        }
                    }));
                }
            }
            10..=14 => {
                let (_, bytes, _) = block(t.ty).expect("checked above");
                for blk in d.chunks_exact(bytes) {
                    out.extend_from_slice(&super::k_quants::dequantize_block(t.ty, blk));
                }
            }
            _ => unreachable!("checked by block()"),
        }
        Ok(out)
    }
}

/// A layer's tensors: (the architectures that have it, empty for all), llama.cpp's name after
/// `blk.N.`, Hugging Face's after `model.layers.N.`. Read both ways, by import and export.
/// Stacked expert tensors (`ffn_*_exps`) are split and joined apart ([`EXPERT_PROJECTIONS`]).
pub(crate) const LAYER_NAMES: &[(&[&str], &str, &str)] = &[
    (&[], "attn_norm.weight", "input_layernorm.weight"),
    (&[], "ffn_norm.weight", "post_attention_layernorm.weight"),
    (&[], "attn_q.weight", "self_attn.q_proj.weight"),
    (&[], "attn_k.weight", "self_attn.k_proj.weight"),
    (&[], "attn_v.weight", "self_attn.v_proj.weight"),
    (&[], "attn_output.weight", "self_attn.o_proj.weight"),
    (DENSE, "ffn_gate.weight", "mlp.gate_proj.weight"),
    (DENSE, "ffn_up.weight", "mlp.up_proj.weight"),
    (DENSE, "ffn_down.weight", "mlp.down_proj.weight"),
    (QKV_BIAS, "attn_q.bias", "self_attn.q_proj.bias"),
    (QKV_BIAS, "attn_k.bias", "self_attn.k_proj.bias"),
    (QKV_BIAS, "attn_v.bias", "self_attn.v_proj.bias"),
    (QK_NORM, "attn_q_norm.weight", "self_attn.q_norm.weight"),
    (QK_NORM, "attn_k_norm.weight", "self_attn.k_norm.weight"),
    (
        &["llama"],
        "ffn_gate_inp.weight",
        "block_sparse_moe.gate.weight",
    ),
    (QWEN_MOE, "ffn_gate_inp.weight", "mlp.gate.weight"),
    (
        &["qwen2moe"],
        "ffn_gate_shexp.weight",
        "mlp.shared_expert.gate_proj.weight",
    ),
    (
        &["qwen2moe"],
        "ffn_up_shexp.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
    (
        &["qwen2moe"],
        "ffn_down_shexp.weight",
        "mlp.shared_expert.down_proj.weight",
    ),
    (
        &["qwen2moe"],
        "ffn_gate_inp_shexp.weight",
        "mlp.shared_expert_gate.weight",
    ),
];
const DENSE: &[&str] = &["llama", "qwen2", "qwen3"];
const QKV_BIAS: &[&str] = &["qwen2", "qwen2moe"];
const QK_NORM: &[&str] = &["qwen3", "qwen3moe"];
const QWEN_MOE: &[&str] = &["qwen2moe", "qwen3moe"];

/// GPT-2's tensors outside the layers: llama.cpp's name, Hugging Face's.
pub(crate) const GPT2_NAMES: &[(&str, &str)] = &[
    ("token_embd.weight", "transformer.wte.weight"),
    ("position_embd.weight", "transformer.wpe.weight"),
    ("output_norm.weight", "transformer.ln_f.weight"),
    ("output_norm.bias", "transformer.ln_f.bias"),
    ("output.weight", "lm_head.weight"),
];

/// GPT-2's layer modules (`blk.N.` / `transformer.h.N.`, then `.weight` or `.bias`), and whether
/// Hugging Face stores the weight as a Conv1D (`[in, out]`, transposed from llama.cpp's).
pub(crate) const GPT2_LAYER_MODULES: &[(&str, &str, bool)] = &[
    ("attn_norm", "ln_1", false),
    ("ffn_norm", "ln_2", false),
    ("attn_qkv", "attn.c_attn", true),
    ("attn_output", "attn.c_proj", true),
    ("ffn_up", "mlp.c_fc", true),
    ("ffn_down", "mlp.c_proj", true),
];

/// A llama.cpp GPT-2 GGUF as the Hugging Face GPT2LMHeadModel config and tensors (llama.cpp's
/// gpt2 graph: GELU in its tanh form, tied or separate output).
fn hf_gpt2_of(g: &Gguf) -> Result<(serde_json::Value, Tensors), String> {
    let num = |k: &str| {
        g.meta
            .get(&format!("gpt2.{k}"))
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| format!("metadata gpt2.{k} missing"))
    };
    let mut t = Tensors::new();
    for info in &g.tensors {
        let v = g.dequantize(info)?;
        let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        let name = &info.name;
        let not_part = || format!("tensor {name}: not part of a gpt2 model");
        if let Some((_, hf)) = GPT2_NAMES.iter().find(|(gg, _)| gg == name) {
            t.insert(hf.to_string(), (shape, v));
            continue;
        }
        let rest = name.strip_prefix("blk.").ok_or_else(not_part)?;
        let (l, part) = rest.split_once('.').ok_or_else(not_part)?;
        let (module, kind) = part.rsplit_once('.').ok_or_else(not_part)?;
        let (_, hf, conv1d) = GPT2_LAYER_MODULES
            .iter()
            .find(|(gg, _, _)| *gg == module)
            .filter(|_| kind == "weight" || kind == "bias")
            .ok_or_else(not_part)?;
        let (shape, v) = if *conv1d && kind == "weight" && shape.len() == 2 {
            (
                vec![shape[1], shape[0]],
                super::gpt2::transpose(&v, shape[0], shape[1]),
            )
        } else {
            (shape, v)
        };
        t.insert(format!("transformer.h.{l}.{hf}.{kind}"), (shape, v));
    }
    // Hugging Face's GPT-2 ties its output to the embedding: a separate one must be that copy.
    if let Some((_, out)) = t.remove("lm_head.weight") {
        let same = t
            .get("transformer.wte.weight")
            .is_some_and(|(_, e)| *e == out);
        if !same {
            return Err(
                "output.weight differs from token_embd.weight: GPT2LMHeadModel ties them".into(),
            );
        }
    }
    let vocab = t
        .get("transformer.wte.weight")
        .map(|(s, _)| s[0])
        .ok_or("no token_embd.weight")?;
    let f = |k: &str, d: f64| {
        g.meta
            .get(&format!("gpt2.{k}"))
            .and_then(Value::as_f64)
            .unwrap_or(d)
    };
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_layer": num("block_count")?,
        "n_embd": num("embedding_length")?,
        "n_head": num("attention.head_count")?,
        "n_inner": num("feed_forward_length")?,
        "n_positions": num("context_length")?,
        "layer_norm_epsilon": f("attention.layer_norm_epsilon", 1e-5),
        "tie_word_embeddings": true,
        "vocab_size": vocab,
    });
    Ok((config, t))
}

/// The other name of a row of [`LAYER_NAMES`] of architecture `arch`: llama.cpp's for Hugging
/// Face's `part` (`ToGguf`), or Hugging Face's for llama.cpp's (`FromGguf`).
pub(crate) fn layer_name(arch: &str, part: &str, way: Direction) -> Option<&'static str> {
    LAYER_NAMES
        .iter()
        .filter(|(archs, _, _)| archs.is_empty() || archs.contains(&arch))
        .map(|&(_, g, hf)| match way {
            Direction::ToGguf => (hf, g),
            Direction::FromGguf => (g, hf),
        })
        .find(|(from, _)| *from == part)
        .map(|(_, to)| to)
}

/// llama.cpp's stacked expert tensors (`blk.N.ffn_{gate,up,down}_exps.weight`, `[experts, rows,
/// cols]`) and the per-expert Hugging Face names of the same projections: Mixtral's
/// `block_sparse_moe.experts.E.{w1,w3,w2}`, Qwen-MoE's `mlp.experts.E.{gate,up,down}_proj`.
pub(crate) const EXPERT_PROJECTIONS: [(&str, &str, &str); 3] = [
    ("ffn_gate_exps.weight", "w1", "gate_proj"),
    ("ffn_up_exps.weight", "w3", "up_proj"),
    ("ffn_down_exps.weight", "w2", "down_proj"),
];

/// The Hugging Face name (after `model.layers.N.`) of expert `e`'s projection, `(mixtral,
/// qwen)` names as in [`EXPERT_PROJECTIONS`].
pub(crate) fn expert_hf_name(arch: &str, e: usize, (mixtral, qwen): (&str, &str)) -> String {
    if arch == "llama" {
        format!("block_sparse_moe.experts.{e}.{mixtral}.weight")
    } else {
        format!("mlp.experts.{e}.{qwen}.weight")
    }
}

/// Llama 3.1's per-frequency divisors of the rotary frequencies (what llama.cpp stores as
/// `rope_freqs.weight`): 1 for short wavelengths, `factor` beyond `original / low`, a smooth
/// blend between.
pub(crate) fn llama3_rope_divisors(
    base: f64,
    head_dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    original: f64,
) -> Vec<f64> {
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    (0..head_dim / 2)
        .map(|i| {
            let inv = base.powf(-((2 * i) as f64) / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let s = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - s) / factor + s)
            }
        })
        .collect()
}

/// Which way a name or a layout is translated between the two formats.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Hugging Face's to llama.cpp's (export).
    ToGguf,
    /// llama.cpp's to Hugging Face's (import).
    FromGguf,
}

/// llama.cpp's rotary permutation of Q or K rows (`convert_hf_to_gguf.py`'s `permute`) or its
/// inverse: GGUF row `h*hd + 2i + s` is Hugging Face row `h*hd + s*hd/2 + i`.
pub(crate) fn rope_rows(
    x: &[f32],
    heads: usize,
    hd: usize,
    cols: usize,
    way: Direction,
) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for s in 0..2 {
                let gguf = (h * hd + 2 * i + s) * cols;
                let hf = (h * hd + s * hd / 2 + i) * cols;
                let (src, dst) = match way {
                    Direction::ToGguf => (hf, gguf),
                    Direction::FromGguf => (gguf, hf),
                };
                out[dst..dst + cols].copy_from_slice(&x[src..src + cols]);
            }
        }
    }
    out
}

/// The Hugging Face class a GGUF architecture reads as (`experts`: llama's `expert_count` is
/// non-zero, Mixtral), and whether llama.cpp permuted its Q/K rows: `convert_hf_to_gguf.py`
/// permutes only for its `LlamaModel` (Mixtral included); the Qwen families keep Hugging Face's
/// rotate-half rows.
fn hf_architecture(arch: &str, experts: bool) -> Option<(&'static str, bool)> {
    match (arch, experts) {
        ("llama", false) => Some(("LlamaForCausalLM", true)),
        ("llama", true) => Some(("MixtralForCausalLM", true)),
        ("qwen2", _) => Some(("Qwen2ForCausalLM", false)),
        ("qwen3", _) => Some(("Qwen3ForCausalLM", false)),
        ("qwen2moe", _) => Some(("Qwen2MoeForCausalLM", false)),
        ("qwen3moe", _) => Some(("Qwen3MoeForCausalLM", false)),
        _ => None,
    }
}

/// The rotary settings as Hugging Face's `rope_parameters`. llama.cpp writes YaRN and linear
/// interpolation as `{arch}.rope.scaling.*` keys, and Llama 3.1's scaling as a `rope_freqs`
/// tensor of per-frequency divisors, which must then be Llama 3.1's for some factor (low 1,
/// high 4, 8192 original positions): anything else would be dropped silently, so it is refused.
pub(crate) fn rope_parameters(
    g: &Gguf,
    arch: &str,
    rope_freqs: Option<&[f32]>,
    head_dim: usize,
    base: f64,
) -> Result<serde_json::Value, String> {
    let key = |k: &str| g.meta.get(&format!("{arch}.rope.scaling.{k}"));
    let num = |k: &str| key(k).and_then(Value::as_f64);
    if let Some(divisors) = rope_freqs {
        // Each frequency's wavelength puts it below the band (divisor 1), above it (the factor
        // itself) or in it (a blend that still determines the factor): read the factor off the
        // first one that shows it, then check every divisor against Llama 3.1's rule.
        let inv = |i: usize| base.powf(-((2 * i) as f64) / head_dim as f64);
        let (low, high) = (8192.0, 8192.0 / 4.0);
        let smooth = |wavelen: f64| (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
        let factor = divisors
            .iter()
            .enumerate()
            .find_map(|(i, &d)| {
                let wavelen = 2.0 * std::f64::consts::PI / inv(i);
                let d = d as f64;
                if wavelen > low {
                    Some(d)
                } else if wavelen >= high {
                    let s = smooth(wavelen);
                    (1.0 / d - s > 0.0).then(|| (1.0 - s) / (1.0 / d - s))
                } else {
                    None
                }
            })
            .unwrap_or(1.0);
        let want = llama3_rope_divisors(base, head_dim, factor, 1.0, 4.0, 8192.0);
        let same = divisors.len() == want.len()
            && divisors
                .iter()
                .zip(&want)
                .all(|(d, w)| (*d as f64 - w).abs() <= 1e-4 * w);
        if !same {
            return Err(
                "rope_freqs.weight is not Llama 3.1's frequency scaling (low 1, high 4, 8192 original positions): not built"
                    .into(),
            );
        }
        // The divisors are f32: the factor to the precision they carry.
        let factor = (factor * 1e4).round() / 1e4;
        return Ok(serde_json::json!({
            "rope_theta": base, "rope_type": "llama3", "factor": factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }));
    }
    match key("type").and_then(Value::as_str) {
        None | Some("none") => Ok(serde_json::json!({"rope_theta": base, "rope_type": "default"})),
        Some("linear") => Ok(serde_json::json!({
            "rope_theta": base, "rope_type": "linear",
            "factor": num("factor").ok_or("rope.scaling.type linear without rope.scaling.factor")?,
        })),
        Some("yarn") => {
            // llama.cpp's own YaRN knobs, 1 unless a model says otherwise: not built.
            for k in ["yarn_ext_factor", "yarn_attn_factor"] {
                if num(k).is_some_and(|e| e != 1.0) {
                    return Err(format!("rope.scaling.{k} other than 1 is not built"));
                }
            }
            let mut p = serde_json::json!({
                "rope_theta": base, "rope_type": "yarn",
                "factor": num("factor").ok_or("rope.scaling.type yarn without rope.scaling.factor")?,
                "original_max_position_embeddings": key("original_context_length")
                    .and_then(Value::as_u64)
                    .ok_or("rope.scaling.type yarn without rope.scaling.original_context_length")?,
            });
            for (k, hf) in [
                ("yarn_beta_fast", "beta_fast"),
                ("yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(v) = num(k) {
                    p[hf] = serde_json::json!(v);
                }
            }
            Ok(p)
        }
        Some(other) => Err(format!("rope.scaling.type '{other}' is not built")),
    }
}

/// A llama.cpp GGUF of the Llama, Qwen2 or Qwen3 architecture as the Hugging Face config.json
/// and tensors of the same model (metadata under `{arch}.`, llama.cpp's tensor names).
pub(crate) fn hf_model_of(g: &Gguf) -> Result<(serde_json::Value, Tensors), String> {
    let arch = g
        .meta
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    let experts = g
        .meta
        .get(&format!("{arch}.expert_count"))
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    if arch == "gpt2" {
        return hf_gpt2_of(g);
    }
    if arch == "gpt-oss" {
        return super::gguf_gpt_oss::hf_of(g);
    }
    let Some((class, permuted)) = hf_architecture(arch, experts > 0) else {
        return Err(format!(
            "general.architecture '{arch}': only gpt2, llama (Mixtral included), qwen2, qwen3, qwen2moe, qwen3moe and gpt-oss GGUFs are read"
        ));
    };
    let num = |k: &str| {
        g.meta
            .get(&format!("{arch}.{k}"))
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| format!("metadata {arch}.{k} missing"))
    };
    let (layers, h, heads, ffn) = (
        num("block_count")?,
        num("embedding_length")?,
        num("attention.head_count")?,
        num("feed_forward_length")?,
    );
    let groups = num("attention.head_count_kv").unwrap_or(heads);
    // Written where config.json had head_dim (Qwen3: 128 beside a hidden size of 1024 / 16).
    let hd = num("attention.key_length").unwrap_or(h / heads);
    let vocab = match g
        .meta
        .get(&format!("{arch}.vocab_size"))
        .and_then(Value::as_u64)
    {
        Some(v) => v as usize,
        None => match g.meta.get("tokenizer.ggml.tokens") {
            Some(Value::Arr(a)) => a.len(),
            // A file without a vocabulary: the embedding's rows.
            _ => match g.tensors.iter().find(|t| t.name == "token_embd.weight") {
                Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
                _ => return Err("no vocabulary size".into()),
            },
        },
    };
    let f = |k: &str, d: f64| {
        g.meta
            .get(&format!("{arch}.{k}"))
            .and_then(Value::as_f64)
            .unwrap_or(d)
    };
    let not_part = |name: &str| format!("tensor {name}: not part of a {arch} model");
    let mut t = Tensors::new();
    let mut tied = true;
    let mut rope_freqs = None;
    for info in &g.tensors {
        let v = g.dequantize(info)?;
        let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        let cols = *shape.last().unwrap_or(&1);
        let name = &info.name;
        let hf = if name == "token_embd.weight" {
            "model.embed_tokens.weight".to_string()
        } else if name == "output_norm.weight" {
            "model.norm.weight".to_string()
        } else if name == "output.weight" {
            tied = false;
            "lm_head.weight".to_string()
        } else if let Some(rest) = name.strip_prefix("blk.") {
            let (l, part) = rest
                .split_once('.')
                .ok_or_else(|| format!("tensor {name}: unexpected name"))?;
            if let Some((_, mixtral, qwen)) = EXPERT_PROJECTIONS.iter().find(|(g, _, _)| *g == part)
            {
                // [experts, rows, cols]: one Hugging Face tensor per expert.
                let (e, rows) = (shape[0], shape[1]);
                if shape.len() != 3 {
                    return Err(format!(
                        "tensor {name}: expected 3 dimensions, got {shape:?}"
                    ));
                }
                for (x, chunk) in v.chunks_exact(rows * cols).enumerate().take(e) {
                    let hf = expert_hf_name(arch, x, (mixtral, qwen));
                    t.insert(
                        format!("model.layers.{l}.{hf}"),
                        (vec![rows, cols], chunk.to_vec()),
                    );
                }
                continue;
            }
            let p = layer_name(arch, part, Direction::FromGguf).ok_or_else(|| not_part(name))?;
            format!("model.layers.{l}.{p}")
        } else if name == "rope_freqs.weight" {
            rope_freqs = Some(v);
            continue;
        } else {
            return Err(not_part(name));
        };
        let v = if permuted && hf.ends_with("q_proj.weight") {
            rope_rows(&v, heads, hd, cols, Direction::FromGguf)
        } else if permuted && hf.ends_with("k_proj.weight") {
            rope_rows(&v, groups, hd, cols, Direction::FromGguf)
        } else {
            v
        };
        t.insert(hf, (shape, v));
    }
    let mut config = serde_json::json!({
        "architectures": [class],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": hd,
        "max_position_embeddings": num("context_length")?,
        "rms_norm_eps": f("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": f("rope.freq_base", 10000.0),
        "rope_parameters": rope_parameters(g, arch, rope_freqs.as_deref(), hd, f("rope.freq_base", 10000.0))?,
        "tie_word_embeddings": tied,
        "vocab_size": vocab,
    });
    if experts > 0 {
        // llama.cpp's MoE graphs: softmax routers, top-k weights renormalized for Mixtral and
        // Qwen3-MoE and not for Qwen2-MoE, experts on every layer, Qwen2-MoE's shared expert
        // behind a sigmoid gate.
        let used = num("expert_used_count")?;
        let expert_ffn = num("expert_feed_forward_length").unwrap_or(ffn);
        let moe = match arch {
            "llama" => {
                serde_json::json!({"num_local_experts": experts, "num_experts_per_tok": used})
            }
            _ => serde_json::json!({
                "num_experts": experts, "num_experts_per_tok": used,
                "moe_intermediate_size": expert_ffn, "norm_topk_prob": arch == "qwen3moe",
                "decoder_sparse_step": 1, "mlp_only_layers": [],
                "shared_expert_intermediate_size": num("expert_shared_feed_forward_length").unwrap_or(0),
                "qkv_bias": arch == "qwen2moe",
            }),
        };
        for (k, v) in moe.as_object().expect("an object") {
            config[k] = v.clone();
        }
    }
    Ok((config, t))
}

/// llama.cpp's special-token keys (`tokenizer.ggml.{bos,eos,unknown,padding}_token_id`) and
/// `tokenizer_config.json`'s names for them.
pub(crate) const SPECIAL_TOKENS: [(&str, &str); 4] = [
    ("bos", "bos_token"),
    ("eos", "eos_token"),
    ("unknown", "unk_token"),
    ("padding", "pad_token"),
];

/// llama.cpp's tokenizer flags and `tokenizer_config.json`'s names for them.
pub(crate) const TOKENIZER_FLAGS: [(&str, &str); 3] = [
    ("add_bos_token", "add_bos_token"),
    ("add_eos_token", "add_eos_token"),
    ("add_space_prefix", "add_prefix_space"),
];

/// The GGUF's special tokens as the `tokenizer_config.json` Hugging Face writes beside
/// `tokenizer.json` (token strings, the add-BOS/EOS/space flags, the chat template), so an
/// export back to GGUF keeps them; None when the GGUF names none.
pub(crate) fn tokenizer_config_json(g: &Gguf) -> Option<serde_json::Value> {
    let tokens = match g.meta.get("tokenizer.ggml.tokens") {
        Some(Value::Arr(a)) => a,
        _ => return None,
    };
    let mut c = serde_json::Map::new();
    for (gguf, hf) in SPECIAL_TOKENS {
        let id = g
            .meta
            .get(&format!("tokenizer.ggml.{gguf}_token_id"))
            .and_then(Value::as_u64);
        if let Some(t) = id
            .and_then(|i| tokens.get(i as usize))
            .and_then(Value::as_str)
        {
            c.insert(hf.into(), serde_json::json!(t));
        }
    }
    for (gguf, hf) in TOKENIZER_FLAGS {
        if let Some(Value::Bool(b)) = g.meta.get(&format!("tokenizer.ggml.{gguf}")) {
            c.insert(hf.into(), serde_json::json!(b));
        }
    }
    if let Some(Value::Str(t)) = g.meta.get("tokenizer.chat_template") {
        c.insert("chat_template".into(), serde_json::json!(t));
    }
    (!c.is_empty()).then_some(serde_json::Value::Object(c))
}

/// The GGUF's vocabulary as a Hugging Face `tokenizer.json`: byte-level BPE (`gpt2`) or
/// SentencePiece (`llama`, `spm_vocab.rs`); `None` for a GGUF without one (`none`); another
/// tokenizer model is refused by name.
pub(crate) fn tokenizer_json(g: &Gguf) -> Result<Option<serde_json::Value>, String> {
    match g.meta.get("tokenizer.ggml.model").and_then(Value::as_str) {
        Some("gpt2") => {}
        Some("llama") => return spm_tokenizer_json(g).map(Some),
        None | Some("none") => return Ok(None),
        Some(other) => {
            return Err(format!(
                "tokenizer.ggml.model {other}: only gpt2 (byte-level BPE) and llama (SentencePiece) vocabularies are converted"
            ))
        }
    }
    let strings = |k: &str| -> Vec<String> {
        match g.meta.get(k) {
            Some(Value::Arr(a)) => a
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect(),
            _ => Vec::new(),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens");
    let merges = strings("tokenizer.ggml.merges");
    let types: Vec<i128> = match g.meta.get("tokenizer.ggml.token_type") {
        Some(Value::Arr(a)) => a
            .iter()
            .map(|v| if let Value::Int(i) = v { *i } else { 1 })
            .collect(),
        _ => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    // Control tokens (type 3) are special and user-defined ones (type 4) plain added tokens:
    // llama.cpp matches both whole in the text, never split.
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let special = match types.get(i) {
                Some(3) => true,
                Some(4) => false,
                _ => return None,
            };
            Some(
                serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                                    "rstrip": false, "normalized": false, "special": special}),
            )
        })
        .collect();
    let pre = g
        .meta
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = super::pre_tokenizers::pre_tokenizer_json(pre)?;
    Ok(Some(serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    })))
}

/// A `llama` (SentencePiece) vocabulary as a `tokenizer.json` (`spm_vocab.rs`).
fn spm_tokenizer_json(g: &Gguf) -> Result<serde_json::Value, String> {
    let arr = |k: &str| -> Result<&Vec<Value>, String> {
        match g.meta.get(k) {
            Some(Value::Arr(a)) => Ok(a),
            _ => Err(format!("a llama vocabulary without {k}")),
        }
    };
    let tokens: Vec<String> = arr("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| v.as_str().unwrap_or("").to_string())
        .collect();
    let n = tokens.len();
    let scores: Vec<f32> = arr("tokenizer.ggml.scores")?
        .iter()
        .map(|v| v.as_f64().unwrap_or(0.0) as f32)
        .collect();
    let types: Vec<i32> = match g.meta.get("tokenizer.ggml.token_type") {
        Some(Value::Arr(a)) => a
            .iter()
            .map(|v| if let Value::Int(i) = v { *i as i32 } else { 1 })
            .collect(),
        _ => vec![super::spm_vocab::NORMAL; n],
    };
    if scores.len() != n || types.len() != n {
        return Err(format!(
            "{n} tokens but {} scores and {} token types",
            scores.len(),
            types.len()
        ));
    }
    let flag = |k: &str, default: bool| match g.meta.get(&format!("tokenizer.ggml.{k}")) {
        Some(Value::Bool(b)) => *b,
        _ => default,
    };
    let id = |k: &str| {
        g.meta
            .get(&format!("tokenizer.ggml.{k}_token_id"))
            .and_then(Value::as_u64)
            .map(|i| i as usize)
    };
    // llama.cpp's defaults for this tokenizer model: BOS added, EOS not, a space prefix.
    let bos = id("bos").map(|i| (i, flag("add_bos_token", true)));
    let eos = id("eos").map(|i| (i, flag("add_eos_token", false)));
    let vocab = super::spm_vocab::SpmVocab {
        tokens,
        scores,
        types,
        add_space_prefix: flag("add_space_prefix", true),
    };
    Ok(super::spm_vocab::tokenizer_json(&vocab, bos, eos))
}
