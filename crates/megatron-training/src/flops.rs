//! Model FLOPs (Megatron's `num_floating_point_operations`) and the hardware peak for MFU.

use megatron_core::TransformerConfig;
use std::time::Instant;

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
    let gated = match c.activation {
        megatron_core::transformer::config::Activation::Gelu => 2.0,
        megatron_core::transformer::config::Activation::SwiGLU => 3.0,
    };
    let mlp = 6.0 * h * ffn * gated * l;
    let attn_proj = 6.0 * (h * (q + 2.0 * kv) + q * h) * l;
    let logits = 6.0 * h * v;
    tokens * (mlp + attn_proj + logits) + batch as f64 * s * s * 6.0 * q * l
}

/// Peak fp32 FLOP/s of this CPU on `threads` threads, measured with a tight FMA loop on the
/// widest vector unit present (AVX-512, else AVX2+FMA, else scalar).
pub fn measure_peak_flops(threads: usize) -> f64 {
    // About 0.1-0.3 s per thread: long enough that thread start-up does not count.
    let run = || fma_flops_per_sec(1_000_000_000);
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| std::thread::spawn(run))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
}

/// FLOP/s of one thread running `iters` iterations of the FMA loop.
fn fma_flops_per_sec(iters: u64) -> f64 {
    let t = Instant::now();
    let flops = fma_loop(iters);
    flops / t.elapsed().as_secs_f64()
}

fn fma_loop(iters: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected at run time.
            return unsafe { x86::fma_avx512(iters) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: as above.
            return unsafe { x86::fma_avx2(iters) };
        }
    }
    let mut acc = [1.0f32; 8];
    let m = std::hint::black_box(0.999_999f32);
    let a = std::hint::black_box(1e-7f32);
    for _ in 0..iters / 8 {
        for x in acc.iter_mut() {
            *x = x.mul_add(m, a);
        }
    }
    std::hint::black_box(acc);
    (iters / 8 * 8 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Twelve independent accumulators in registers hide the FMA latency on two FMA ports.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(iters: u64) -> f64 {
        let m = _mm512_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm512_set1_ps(std::hint::black_box(1e-7));
        let (mut r0, mut r1, mut r2, mut r3) = (
            _mm512_set1_ps(1.0),
            _mm512_set1_ps(1.1),
            _mm512_set1_ps(1.2),
            _mm512_set1_ps(1.3),
        );
        let (mut r4, mut r5, mut r6, mut r7) = (
            _mm512_set1_ps(1.4),
            _mm512_set1_ps(1.5),
            _mm512_set1_ps(1.6),
            _mm512_set1_ps(1.7),
        );
        let (mut r8, mut r9, mut r10, mut r11) = (
            _mm512_set1_ps(1.8),
            _mm512_set1_ps(1.9),
            _mm512_set1_ps(2.0),
            _mm512_set1_ps(2.1),
        );
        let n = iters / 12;
        for _ in 0..n {
            r0 = _mm512_fmadd_ps(r0, m, a);
            r1 = _mm512_fmadd_ps(r1, m, a);
            r2 = _mm512_fmadd_ps(r2, m, a);
            r3 = _mm512_fmadd_ps(r3, m, a);
            r4 = _mm512_fmadd_ps(r4, m, a);
            r5 = _mm512_fmadd_ps(r5, m, a);
            r6 = _mm512_fmadd_ps(r6, m, a);
            r7 = _mm512_fmadd_ps(r7, m, a);
            r8 = _mm512_fmadd_ps(r8, m, a);
            r9 = _mm512_fmadd_ps(r9, m, a);
            r10 = _mm512_fmadd_ps(r10, m, a);
            r11 = _mm512_fmadd_ps(r11, m, a);
        }
        std::hint::black_box([r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11]);
        (n * 12 * 16 * 2) as f64
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(iters: u64) -> f64 {
        let m = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm256_set1_ps(std::hint::black_box(1e-7));
        let (mut r0, mut r1, mut r2, mut r3) = (
            _mm256_set1_ps(1.0),
            _mm256_set1_ps(1.1),
            _mm256_set1_ps(1.2),
            _mm256_set1_ps(1.3),
        );
        let (mut r4, mut r5, mut r6, mut r7) = (
            _mm256_set1_ps(1.4),
            _mm256_set1_ps(1.5),
            _mm256_set1_ps(1.6),
            _mm256_set1_ps(1.7),
        );
        let n = iters / 8;
        for _ in 0..n {
            r0 = _mm256_fmadd_ps(r0, m, a);
            r1 = _mm256_fmadd_ps(r1, m, a);
            r2 = _mm256_fmadd_ps(r2, m, a);
            r3 = _mm256_fmadd_ps(r3, m, a);
            r4 = _mm256_fmadd_ps(r4, m, a);
            r5 = _mm256_fmadd_ps(r5, m, a);
            r6 = _mm256_fmadd_ps(r6, m, a);
            r7 = _mm256_fmadd_ps(r7, m, a);
        }
        std::hint::black_box([r0, r1, r2, r3, r4, r5, r6, r7]);
        (n * 8 * 8 * 2) as f64
    }
}

/// The peak from `--peak-tflops`, else a cached measurement, else a fresh one (cached under
/// `$XDG_CACHE_HOME` or `~/.cache`).
pub fn peak_flops(flag_tflops: Option<f64>, threads: usize) -> f64 {
    if let Some(t) = flag_tflops {
        return t * 1e12;
    }
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .map(|d| d.join("megatron-rs"));
    let file = dir
        .as_ref()
        .map(|d| d.join(format!("peak_fp32_flops_{threads}t.txt")));
    if let Some(f) = &file {
        if let Some(v) = std::fs::read_to_string(f)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
        {
            return v;
        }
    }
    // The peak is a property of the hardware: the best of a few runs filters out neighbours.
    let v = (0..3)
        .map(|_| measure_peak_flops(threads))
        .fold(0.0, f64::max);
    if let (Some(d), Some(f)) = (dir, file) {
        let _ = std::fs::create_dir_all(&d);
        let _ = std::fs::write(f, format!("{v}\n"));
    }
    v
}

/// The faster instructions for bf16 matmuls on this CPU, measured once per process: the bf16
/// dot-product instruction against the f32 FMA, one thread each, best of two. Both kernels
/// compute the same products (bf16 x bf16 is exact in f32) with f32 accumulation, so this
/// changes speed, never the model being trained (beyond summation order).
pub fn fastest_bf16_kernel() -> megatron_tensor::cpu::matmul::Bf16Kernel {
    use megatron_tensor::cpu::matmul::Bf16Kernel;
    static CHOICE: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let dot = (0..2)
            .filter_map(|_| megatron_tensor::cpu::matmul_bf16::bf16_dot_peak_gflops(1))
            .fold(0.0, f64::max);
        if dot == 0.0 {
            return Bf16Kernel::Fma;
        }
        let fma = (0..2)
            .map(|_| fma_flops_per_sec(200_000_000) / 1e9)
            .fold(0.0, f64::max);
        // vdpbf16ps counts 2 multiply-adds per lane; it must beat the FMA to pay for itself.
        if dot > fma {
            Bf16Kernel::Dot
        } else {
            Bf16Kernel::Fma
        }
    })
}
