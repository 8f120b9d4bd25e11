//! `megatron bench tp`: one GPT micro-batch (forward + backward) on rank threads at each
//! tensor-parallel size, with and without sequence parallelism: time, the TP-group collectives
//! counted by the communicator, parameters and saved activations per rank against the engine's
//! formula.

use crate::bench::BenchArgs;
use megatron_comm::run_ranks;
use megatron_core::models::gpt::activation_bytes_formula;
use megatron_core::tensor_parallel::Tp;
use megatron_core::transformer::step::StepContext;
use megatron_core::{Batch, GPTModel, Grads, TransformerConfig};
use std::time::Instant;

struct Row {
    ms: f64,
    calls: Vec<(&'static str, u64, u64)>,
    params: usize,
    activations: usize,
}

fn one(cfg: &TransformerConfig, b: usize, p: usize, sp: bool, repeats: usize, cores: usize) -> Row {
    let cfg = cfg.clone();
    let per_rank = (cores / p).max(1);
    let rows = run_ranks(p, move |rank, c| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(per_rank)
            .build()
            .expect("rank pool");
        pool.install(|| {
            megatron_tensor::threads::set_gemm_threads(per_rank);
            let t = cfg.seq_length;
            let v = cfg.padded_vocab_size as u32;
            let tokens: Vec<u32> = (0..b * t).map(|i| (i as u32 * 7919) % v).collect();
            let labels: Vec<u32> = (0..b * t).map(|i| (i as u32 * 104_729 + 1) % v).collect();
            let mask = vec![1.0f32; b * t];
            let batch = Batch {
                tokens: &tokens,
                labels: &labels,
                loss_mask: &mask,
                b,
                t,
                position_ids: None,
                doc_start: None,
            };
            let (model, params) = GPTModel::new_tp(cfg.clone(), 1, rank, p);
            let mut grads = Grads::zeros_like(&params);
            let mut tp = Tp::new(c, sp);
            let ctx = StepContext::eval();
            let r = model
                .forward_backward(&params, &mut grads, &mut tp, &batch, 1.0, &ctx)
                .expect("collectives");
            let before = c_stats(&run_stats(&mut tp));
            let mut times = Vec::new();
            for _ in 0..repeats {
                let s = Instant::now();
                run_once(&model, &params, &mut grads, &mut tp, &batch, &ctx);
                times.push(s.elapsed().as_secs_f64());
            }
            let after = c_stats(&run_stats(&mut tp));
            let calls: Vec<(&'static str, u64, u64)> = after
                .iter()
                .map(|(k, n, by)| {
                    let (n0, b0) = before
                        .iter()
                        .find(|x| x.0 == *k)
                        .map_or((0, 0), |x| (x.1, x.2));
                    (*k, (n - n0) / repeats as u64, (by - b0) / repeats as u64)
                })
                .filter(|x| x.1 > 0)
                .collect();
            (times, calls, params.numel(), r.activation_bytes)
        })
    });
    let rows: Vec<_> = rows.into_iter().map(|r| r.expect("rank ok")).collect();
    let mut per_call: Vec<f64> = (0..repeats)
        .map(|i| rows.iter().map(|r| r.0[i]).fold(0.0, f64::max))
        .collect();
    per_call.sort_by(f64::total_cmp);
    let r0 = &rows[0];
    Row {
        ms: per_call[per_call.len() / 2] * 1e3,
        calls: r0.1.clone(),
        params: r0.2,
        activations: r0.3,
    }
}

fn run_stats(tp: &mut Tp) -> megatron_comm::CommStats {
    tp.comm.stats()
}

fn c_stats(s: &megatron_comm::CommStats) -> Vec<(&'static str, u64, u64)> {
    s.calls.iter().map(|(k, v)| (*k, *v, s.bytes[k])).collect()
}

fn run_once(
    model: &GPTModel,
    params: &megatron_core::Params,
    grads: &mut Grads,
    tp: &mut Tp,
    batch: &Batch,
    ctx: &StepContext,
) {
    model
        .forward_backward(params, grads, tp, batch, 1.0, ctx)
        .expect("collectives");
}

pub fn tp(a: &BenchArgs) -> anyhow::Result<()> {
    let cfg = TransformerConfig {
        num_layers: a.layers,
        hidden_size: a.hidden,
        num_attention_heads: a.heads,
        ffn_hidden_size: a.ffn,
        seq_length: a.seq_length,
        max_position_embeddings: a.seq_length,
        padded_vocab_size: TransformerConfig::pad_vocab(a.vocab, 128 * 4),
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: false,
        ..Default::default()
    };
    cfg.validate()?;
    let b = a.micro_batch;
    let cores = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    let mib = |x: usize| x as f64 / (1 << 20) as f64;
    println!(
        "GPT {} layers, hidden {}, heads {}, ffn {}, seq {}, padded vocab {}, micro-batch {b}; {cores} cores shared by the rank threads; median of {} forward+backward",
        cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.seq_length, cfg.padded_vocab_size, a.repeats
    );
    println!(
        "{:>3} {:>3} {:>10} {:>13} {:>15} {:>15}  TP collectives per micro-batch (calls, MiB)",
        "tp", "sp", "ms", "params MiB", "activ. MiB", "formula MiB"
    );
    for &p in &a.ranks {
        for sp in [false, true] {
            if sp && p == 1 {
                continue;
            }
            let r = one(&cfg, b, p, sp, a.repeats, cores);
            let f = activation_bytes_formula(&cfg, b, cfg.seq_length, p, sp, false);
            let calls: Vec<String> = r
                .calls
                .iter()
                .map(|(k, n, by)| format!("{k} {n} ({:.1})", mib(*by as usize)))
                .collect();
            println!(
                "{p:>3} {:>3} {:>10.1} {:>13.2} {:>15.2} {:>15.2}  {}",
                if sp { "on" } else { "off" },
                r.ms,
                mib(r.params * 4),
                mib(r.activations),
                mib(f),
                calls.join(", ")
            );
        }
    }
    Ok(())
}
