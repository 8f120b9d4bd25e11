//! `megatron bench muon`: what Muon's Newton–Schulz iteration costs on the matrices of one GPT
//! layer (`--hidden`, `--ffn`; the fused QKV split into its three `hidden × hidden` blocks, as
//! megatron-core does by default), in f32 and bf16 products (`--muon-fp32-matmul-prec high` /
//! `medium`), beside the engine's plain GEMM rate on the iteration's shapes: the iteration is three
//! GEMMs per step, so its GFLOP/s should sit near the GEMM's. The last line projects the seconds
//! per optimizer step for `--layers` layers.

use crate::bench::BenchArgs;
use megatron_core::optimizer::muon::NsCoefficients;
use megatron_tensor::cpu::{
    matmul_with_threads, newton_schulz, MatmulDims, NewtonSchulz, NewtonSchulzDims, NsOrientation,
    NsPrecision,
};
use megatron_training::machine_probes::time_median;

/// Flops of one Newton–Schulz step on an `m × n` iterate (`m ≤ n`): `X·Xᵀ`, `A·A`, `B·X`.
fn step_flops(m: usize, n: usize) -> f64 {
    let (m, n) = (m as f64, n as f64);
    4.0 * m * m * n + 2.0 * m * m * m
}

pub fn muon(a: &BenchArgs) -> anyhow::Result<()> {
    if let Some(t) = a.threads {
        megatron_tensor::threads::set_gemm_threads(t);
    }
    let threads = megatron_tensor::threads::gemm_threads();
    let steps = NsCoefficients::Quintic.schedule(5);
    let (h, f) = (a.hidden, a.ffn);
    // (name, rows, cols, how many per layer)
    let shapes = [
        ("qkv block + proj", h, h, 4usize),
        ("fc1", f, h, 1),
        ("fc2", h, f, 1),
    ];
    println!(
        "Newton-Schulz (quintic x {}), {threads} GEMM threads, median of {} calls; GEMM = the engine's matmul on X·Xᵀ's shape",
        steps.len(),
        a.repeats
    );
    println!("| matrix | shape | per layer | f32 ms | f32 GFLOP/s | bf16 ms | bf16 GFLOP/s | GEMM GFLOP/s |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let mut layer_s = [0.0f64; 2];
    for (name, rows, cols, count) in shapes {
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut out = vec![0.0f32; rows * cols];
        let flops = steps.len() as f64 * step_flops(rows.min(cols), rows.max(cols));
        let mut cells = Vec::new();
        for (k, precision) in [NsPrecision::F32, NsPrecision::Bf16]
            .into_iter()
            .enumerate()
        {
            let ns = NewtonSchulz {
                coefficients: &steps,
                precision,
                orientation: NsOrientation::Smaller,
                eps: 1e-7,
            };
            let d = NewtonSchulzDims { rows, cols };
            let t = time_median(a.repeats, || {
                newton_schulz(&mut out, &x, d, &ns, &mut |_| {})
            });
            layer_s[k] += count as f64 * t;
            cells.push(format!("{:.1} | {:.1}", t * 1e3, flops / t / 1e9));
        }
        let (m, n) = (rows.min(cols), rows.max(cols));
        // The iteration's X·Xᵀ on the same data read as `m × n`.
        let mut gram = vec![0.0f32; m * m];
        let t = time_median(a.repeats, || {
            matmul_with_threads(&mut gram, &x, &x, MatmulDims::new(m, m, n).tb(), threads)
        });
        println!(
            "| {name} | {rows}x{cols} | {count} | {} | {} | {:.1} |",
            cells[0],
            cells[1],
            2.0 * (m * m * n) as f64 / t / 1e9
        );
    }
    println!(
        "projected Newton-Schulz seconds per optimizer step for {} layers: f32 {:.2} s, bf16 {:.2} s",
        a.layers,
        layer_s[0] * a.layers as f64,
        layer_s[1] * a.layers as f64
    );
    Ok(())
}
