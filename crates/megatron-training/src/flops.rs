//! Model FLOPs (Megatron's `num_floating_point_operations`) and the hardware peak for MFU (the
//! FMA loop that measures it lives in the tensor backend, `cpu::peak`).

use megatron_core::TransformerConfig;

/// FLOPs of one iteration of `batch` sequences (forward + both backward GEMMs), with Megatron's
/// terms for grouped-query attention (query projection `q = heads * kv_channels`, key/value
/// `kv = groups * kv_channels`) and SwiGLU (three MLP matrices instead of two), causal attention
/// (the `s²` term already halved as Megatron now does).
pub fn num_floating_point_operations(c: &TransformerConfig, batch: usize) -> f64 {
    let (h, l, s) = (
        c.hidden_size as f64,
        c.num_layers as f64,
        c.seq_length as f64,
    );
    let ffn = c.ffn_hidden_size as f64;
    let v = c.padded_vocab_size as f64;
    let q = c.query_projection_size() as f64;
    let kv = (c.query_groups() * c.head_dim()) as f64;
    let tokens = batch as f64 * s;
    let gated = if c.activation.is_gated() { 3.0 } else { 2.0 };
    // MoE layers count their active experts only (moe_ffn x top-k) plus the shared expert,
    // as Megatron does (the router and the shared expert's gate are ignored, like biases).
    // Multi-token prediction's depths count as layers like the last decoder layer, plus their
    // norms and eh_proj and one more output layer each, as Megatron counts them.
    let depths = c.mtp.map_or(0, |m| m.num_layers);
    let l = l + depths as f64;
    let moe_layers = (0..c.num_layers + depths)
        .filter(|&i| c.is_moe_layer(i))
        .count() as f64;
    let moe = c.moe.as_ref().map_or(0.0, |m| {
        m.ffn_hidden_size as f64 * m.topk as f64 + m.shared_expert_ffn.unwrap_or(0) as f64
    });
    let mlp = 6.0 * h * gated * (ffn * (l - moe_layers) + moe * moe_layers);
    let (attn_proj, core) = match c.mla {
        Some(m) => mla_terms(c, &m),
        None => (6.0 * (h * (q + 2.0 * kv) + q * h), 6.0 * q),
    };
    let logits = 6.0 * h * v * (1.0 + depths as f64);
    let mtp = 6.0 * depths as f64 * (3.0 * h + 2.0 * h * h);
    tokens * (mlp + attn_proj * l + logits + mtp) + batch as f64 * s * s * core * l
}

/// Megatron's multi-latent attention terms per layer: the token-linear part (query latent or
/// direct query projection, key/value latent, the shared rotary key, the output projection;
/// the `+ 1`s are the latents' norms, as Megatron counts them) and the factor of `s²` (scores
/// over `qk + pe` features, values of `v`, halved for the causal mask).
fn mla_terms(
    c: &TransformerConfig,
    m: &megatron_core::transformer::config::MLAConfig,
) -> (f64, f64) {
    let h = c.hidden_size as f64;
    let a = c.num_attention_heads as f64;
    let (qk, pe, v) = (
        m.qk_head_dim as f64,
        m.qk_pos_emb_head_dim as f64,
        m.v_head_dim as f64,
    );
    let kv_lora = m.kv_lora_rank as f64;
    let q_term = match m.q_lora_rank {
        None => h * a * (qk + pe),
        Some(r) => r as f64 * (h + a * (qk + pe) + 1.0),
    };
    let linear = q_term + kv_lora * (h + a * (qk + v) + 1.0) + h * pe + a * v * h;
    (6.0 * linear, 6.0 * (a * (qk + pe) / 2.0 + a * v / 2.0))
}

/// FLOPs of one iteration of `batch` BERT sequences: the decoder's terms with bidirectional
/// attention (the full `s²` score and context products) and the MLM head's dense layer.
pub fn bert_floating_point_operations(c: &TransformerConfig, batch: usize) -> f64 {
    let (h, l, s) = (
        c.hidden_size as f64,
        c.num_layers as f64,
        c.seq_length as f64,
    );
    let q = c.query_projection_size() as f64;
    let b = batch as f64;
    // The causal formula counts half of the score products; the encoder computes all of them.
    num_floating_point_operations(c, batch) + b * s * s * 6.0 * q * l + b * s * 6.0 * h * h
}

/// FLOPs of one iteration of `batch` T5 samples of `te` encoder and `td` decoder tokens:
/// each encoder layer's projections, bidirectional scores and MLP over `te`; each decoder
/// layer's self-attention (causal) over `td`, its cross-attention (queries and output over
/// `td`, keys and values of the `te` encoder rows, `td x te` scores) and MLP; the logits over
/// `td`. Forward and both backward GEMMs (x 6 per multiply-add), as Megatron counts.
pub fn t5_floating_point_operations(
    c: &TransformerConfig,
    (encoder_layers, decoder_layers): (usize, usize),
    (te, td): (usize, usize),
    batch: usize,
) -> f64 {
    let h = c.hidden_size as f64;
    let q = c.query_projection_size() as f64;
    let ffn = c.ffn_hidden_size as f64;
    let v = c.padded_vocab_size as f64;
    let (te, td, b) = (te as f64, td as f64, batch as f64);
    let gated = if c.activation.is_gated() { 3.0 } else { 2.0 };
    let mlp = |t: f64| 6.0 * t * h * ffn * gated;
    let self_proj = |t: f64| 6.0 * t * 4.0 * h * q;
    let encoder = self_proj(te) + 12.0 * te * te * q + mlp(te);
    let cross = 6.0 * td * 2.0 * h * q + 6.0 * te * 2.0 * h * q + 12.0 * td * te * q;
    let decoder = self_proj(td) + 6.0 * td * td * q + cross + mlp(td);
    b * (encoder * encoder_layers as f64 + decoder * decoder_layers as f64 + 6.0 * td * h * v)
}

/// The unit a run's matmuls run on, whose peak its MFU is against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeakUnit {
    /// The f32 FMA units (fp32, and the `fma` bf16 kernel: rounded operands on the f32 GEMM).
    Fma,
    /// The bf16 dot-product instruction (`--bf16` on `vdpbf16ps`): twice the multiply-adds of
    /// an FMA per instruction (on AMD Zen 5, 2x the FMA peak; on some Intel CPUs less).
    DotBf16,
    /// Intel AMX tiles (`--bf16` with the AMX kernel): ~8-16x the FMA peak.
    AmxBf16,
}

impl PeakUnit {
    /// The unit of the calling thread's matmuls (precision and bf16 kernel as set up).
    pub fn of_this_thread() -> Self {
        use megatron_tensor::cpu::matmul_packed::BlockKernel;
        match megatron_tensor::cpu::matmul::bf16_block_kernel() {
            Some(BlockKernel::AmxTiles) => PeakUnit::AmxBf16,
            Some(BlockKernel::DotProduct) => PeakUnit::DotBf16,
            None => PeakUnit::Fma,
        }
    }
}

/// The peak from `--peak-tflops`, else a cached measurement, else a fresh one (cached under
/// `$XDG_CACHE_HOME` or `~/.cache`), of the unit the matmuls run on.
pub fn peak_flops(flag_tflops: Option<f64>, threads: usize, unit: PeakUnit) -> f64 {
    if let Some(t) = flag_tflops {
        return t * 1e12;
    }
    let (name, measure): (&str, fn(usize) -> f64) = match unit {
        PeakUnit::Fma => ("fp32", megatron_tensor::cpu::peak::measure_peak_flops),
        PeakUnit::DotBf16 => ("dot_bf16", |t| {
            megatron_tensor::cpu::matmul_bf16::bf16_dot_peak_gflops(t).unwrap_or(0.0) * 1e9
        }),
        PeakUnit::AmxBf16 => ("amx_bf16", |t| {
            megatron_tensor::cpu::matmul_amx::amx_peak_gflops(t).unwrap_or(0.0) * 1e9
        }),
    };
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .map(|d| d.join("megatron-rs"));
    let file = dir
        .as_ref()
        .map(|d| d.join(format!("peak_{name}_flops_{threads}t.txt")));
    if let Some(f) = &file {
        if let Some(v) = std::fs::read_to_string(f)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
        {
            // A peak measured while another job held the cores is too low, and would make
            // every later MFU on this machine too high: a short FMA check (~20 ms) that beats
            // the cached figure by 10 % means the cache was measured under load.
            let stale = unit == PeakUnit::Fma
                && megatron_tensor::cpu::peak::fma_flops_threads(threads, 50_000_000) > 1.1 * v;
            if !stale {
                return v;
            }
        }
    }
    // The peak is a property of the hardware: the best of a few runs filters out neighbours.
    let v = (0..3).map(|_| measure(threads)).fold(0.0, f64::max);
    if let (Some(d), Some(f)) = (dir, file) {
        let _ = std::fs::create_dir_all(&d);
        let _ = std::fs::write(f, format!("{v}\n"));
    }
    v
}
