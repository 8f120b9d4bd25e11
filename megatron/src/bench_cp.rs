//! `megatron bench cp`: a small Llama-style model (RoPE, GQA, SwiGLU, RMSNorm) trained a few
//! steps on mock data at `--seq-length` with context parallelism 1 and each of `--ranks` on
//! rank threads, for both attention layouts: tokens/s (steps after the first), the saved
//! activations each rank holds, and for ring attention how long the key/value exchanges took
//! on their communication threads and how much of that compute waited for.

use crate::bench::BenchArgs;
use clap::Parser;
use megatron_training::{pretrain, TrainArgs};
use std::time::Instant;

#[derive(Parser)]
#[command(args_override_self = true)]
struct Wrap {
    #[command(flatten)]
    args: TrainArgs,
}

fn train(a: &BenchArgs, cp: usize, comm: &str) -> anyhow::Result<(f64, usize)> {
    let (seq, cps, iters) = (
        a.seq_length.to_string(),
        cp.to_string(),
        a.repeats.max(2) + 1,
    );
    let iters_s = iters.to_string();
    let hidden = a.hidden.to_string();
    let heads = a.heads.to_string();
    let layers = a.layers.to_string();
    let v = [
        "megatron",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "1000",
        "--num-layers",
        &layers,
        "--hidden-size",
        &hidden,
        "--num-attention-heads",
        &heads,
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--seq-length",
        &seq,
        "--max-position-embeddings",
        &seq,
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        &iters_s,
        "--lr",
        "1e-4",
        "--log-interval",
        "1000",
        "--eval-iters",
        "0",
        "--no-progress-bar",
        "--peak-tflops",
        "1",
        "--nproc-per-node",
        &cps,
        "--context-parallel-size",
        &cps,
        "--cp-comm-type",
        comm,
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ];
    let args = Wrap::try_parse_from(v)?.args;
    let started = Instant::now();
    let s = pretrain(&args)?;
    let secs = started.elapsed().as_secs_f64();
    // Tokens of every step over the whole run (set-up and the first step included).
    let tokens = (iters * a.seq_length) as f64;
    Ok((tokens / secs, s.peak_activation_bytes))
}

pub fn cp(a: &BenchArgs) -> anyhow::Result<()> {
    println!(
        "Llama-style model: {} layers, hidden {}, {} heads in 2 query groups, seq {}, micro-batch 1, {} steps per run",
        a.layers,
        a.hidden,
        a.heads,
        a.seq_length,
        a.repeats.max(2) + 1
    );
    println!("| context parallel | attention | tokens/s | saved activations per rank | ring exchange | of it waited for |");
    println!("|---|---|---:|---:|---:|---:|");
    let (base, base_bytes) = train(a, 1, "p2p")?;
    println!(
        "| 1 | - | {base:.0} | {:.1} MiB | - | - |",
        base_bytes as f64 / (1 << 20) as f64
    );
    for &c in &a.ranks {
        for comm in ["p2p", "a2a"] {
            let _ = megatron_core::context_parallel::take_ring_stats();
            let (tps, bytes) = match train(a, c, comm) {
                Ok(r) => r,
                Err(e) => {
                    println!("| {c} | {comm} | refused: {e} | | | |");
                    continue;
                }
            };
            let (exchange, waited) = megatron_core::context_parallel::take_ring_stats();
            let ring = if comm == "p2p" {
                (
                    format!("{:.2} s", exchange.as_secs_f64()),
                    format!(
                        "{:.1} %",
                        100.0 * waited.as_secs_f64() / exchange.as_secs_f64().max(1e-9)
                    ),
                )
            } else {
                ("-".into(), "-".into())
            };
            println!(
                "| {c} | {comm} | {tps:.0} ({:.2}x) | {:.1} MiB ({:.2} of CP 1) | {} | {} |",
                tps / base,
                bytes as f64 / (1 << 20) as f64,
                bytes as f64 / base_bytes as f64,
                ring.0,
                ring.1
            );
        }
    }
    Ok(())
}
