//! `megatron bench gemm`: GFLOP/s of the engine's matmul on the three GEMMs of a transformer
//! linear layer (forward, input gradient, weight gradient), median of repeated calls.

use clap::Args;
use megatron_tensor::cpu::{matmul_with_threads, MatmulDims};
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// What to benchmark (only `gemm` today).
    #[arg(default_value = "gemm")]
    pub what: String,
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    #[arg(long, default_value_t = 768)]
    pub hidden: usize,
    #[arg(long, default_value_t = 3072)]
    pub ffn: usize,
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run(a: &BenchArgs) -> anyhow::Result<()> {
    if a.what != "gemm" {
        anyhow::bail!("bench {}: only `gemm` is available", a.what);
    }
    let threads = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    let (n, h, f) = (a.tokens, a.hidden, a.ffn);
    // (label, m, n, k, trans_a, trans_b): y = x W^T, dx = dy W, dW = dy^T x.
    let cases = [
        ("fwd   x[N,h]·W[f,h]^T", n, f, h, false, true),
        ("dgrad dy[N,f]·W[f,h]", n, h, f, false, false),
        ("wgrad dy[N,f]^T·x[N,h]", f, h, n, true, false),
    ];
    println!(
        "gemm crate (x86-v4), {threads} threads, median of {} calls",
        a.repeats
    );
    for (label, m, nn, k, ta, tb) in cases {
        let x = vec![0.5f32; m * k];
        let w = vec![0.25f32; k * nn];
        let mut out = vec![0.0f32; m * nn];
        let mut d = MatmulDims::new(m, nn, k);
        d.trans_a = ta;
        d.trans_b = tb;
        matmul_with_threads(&mut out, &x, &w, d, threads);
        let mut times: Vec<f64> = (0..a.repeats)
            .map(|_| {
                let t = Instant::now();
                matmul_with_threads(&mut out, &x, &w, d, threads);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "{label:<26} {m}x{nn}x{k}: {:.1} GFLOP/s",
            2.0 * (m * nn * k) as f64 / med / 1e9
        );
    }
    Ok(())
}
