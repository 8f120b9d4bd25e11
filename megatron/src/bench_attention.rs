//! `megatron bench attention`: causal attention forward and backward at `--tokens`/`--seq-length`
//! tokens, `--heads` heads of `--hidden / --heads`, on the f32 kernel and with its products on
//! the packed bf16 kernel `--bf16` runs here (AMX tiles, else the AVX512_BF16 dot product),
//! alternated in one invocation;
//! median milliseconds and GFLOP/s of the products (4·t²·d per head forward, causal half; 2.5x
//! that backward, the recomputed scores included).

use crate::bench::BenchArgs;
use megatron_tensor::cpu::matmul::{
    set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulPrecision,
};
use megatron_tensor::cpu::{attention_backward, attention_forward, AttentionDims, AttentionMask};
use megatron_tensor::RngKey;
use std::time::Instant;

pub fn attention(a: &BenchArgs) -> anyhow::Result<()> {
    let threads = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    let (t, h) = (a.seq_length, a.hidden);
    anyhow::ensure!(
        t > 0 && a.heads > 0 && a.tokens > 0,
        "--tokens, --seq-length and --heads must be positive"
    );
    anyhow::ensure!(
        a.tokens.is_multiple_of(t) && h.is_multiple_of(a.heads),
        "--tokens must be a multiple of --seq-length and --hidden of --heads"
    );
    let d = AttentionDims {
        b: a.tokens / t,
        t,
        heads: a.heads,
        groups: a.heads,
        head_dim: h / a.heads,
        causal: true,
        dropout: 0.0,
        rng_heads: (0, a.heads),
        rng_block: None,
    };
    let key = RngKey::new(1);
    let qkv: Vec<f32> = (0..a.tokens * 3 * h)
        .map(|i| key.normal(i as u64))
        .collect();
    let dout: Vec<f32> = (0..a.tokens * h)
        .map(|i| key.normal((1 << 40) + i as u64))
        .collect();
    let (mut out, mut lse) = (vec![0.0f32; a.tokens * h], vec![0.0f32; d.b * d.heads * t]);
    let mut dqkv = vec![0.0f32; qkv.len()];
    let flop_fwd = (d.b * d.heads) as f64 * 4.0 * (t * t) as f64 / 2.0 * d.head_dim as f64;
    set_matmul_precision(MatmulPrecision::BF16);
    set_bf16_kernel(Bf16Kernel::Amx);
    let packed = megatron_tensor::cpu::matmul::attention_block_kernel();
    set_matmul_precision(MatmulPrecision::F32);
    println!(
        "# attention b {} t {t} heads {} head_dim {}, causal, {threads} threads, {} repeats alternating; bf16 column: {}",
        d.b,
        d.heads,
        d.head_dim,
        a.repeats,
        packed.map_or("no AVX512_BF16 or AMX: f32 kernel".to_string(), |k| format!("{k:?}"))
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let kinds = [
        ("f32", MatmulPrecision::F32),
        ("bf16", MatmulPrecision::BF16),
    ];
    let mut times = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    pool.install(|| {
        set_bf16_kernel(Bf16Kernel::Amx);
        for _ in 0..a.repeats + 1 {
            for (k, (_, p)) in kinds.iter().enumerate() {
                set_matmul_precision(*p);
                let s = Instant::now();
                attention_forward(&mut out, &mut lse, &qkv, AttentionMask::NONE, d, key);
                times[k][0].push(s.elapsed().as_secs_f64());
                let s = Instant::now();
                attention_backward(
                    &mut dqkv,
                    &dout,
                    &out,
                    &lse,
                    &qkv,
                    AttentionMask::NONE,
                    d,
                    key,
                );
                times[k][1].push(s.elapsed().as_secs_f64());
            }
        }
        set_matmul_precision(MatmulPrecision::F32);
    });
    for (k, (name, _)) in kinds.iter().enumerate() {
        let [f, b] = [0, 1].map(|i| {
            let mut v = times[k][i][1..].to_vec();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        });
        println!(
            "{name:<9} forward {:>8.2} ms ({:>6.0} GFLOP/s)  backward {:>8.2} ms ({:>6.0} GFLOP/s)",
            f * 1e3,
            flop_fwd / f / 1e9,
            b * 1e3,
            2.5 * flop_fwd / b / 1e9
        );
    }
    Ok(())
}
