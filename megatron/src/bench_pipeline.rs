//! `megatron bench pipeline`: the pipeline bubble measured by the stage timers, for 1F1B and
//! interleaved schedules, beside the theory ((P-1)/M and (P-1)/(V·M) of the ideal compute time).

use crate::bench::BenchArgs;
use megatron_comm::{run_ranks, Communicator};
use megatron_core::models::gpt::Batch;
use megatron_core::params::{Grads, Params};
use megatron_core::pipeline_parallel::executor::Stage;
use megatron_core::pipeline_parallel::partition::StagePartition;
use megatron_core::pipeline_parallel::timers::Timers;
use megatron_core::pipeline_parallel::{build_stage, schedule};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_core::TransformerConfig;
use std::time::Instant;

/// Per stage: (busy seconds = forward + backward, wall seconds of the schedule), medians over
/// the timed steps.
fn measure(
    cfg: &TransformerConfig,
    p: usize,
    v: usize,
    m: usize,
    repeats: usize,
    cores: usize,
) -> Vec<(f64, f64)> {
    let cfg = cfg.clone();
    let per_rank = (cores / p).max(1);
    run_ranks(p, move |rank, c| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(per_rank)
            .build()
            .expect("rank pool");
        pool.install(|| {
            megatron_tensor::threads::set_gemm_threads(per_rank);
            let (b, t) = (1usize, cfg.seq_length);
            let part = StagePartition {
                num_layers: cfg.num_layers,
                p,
                v,
                first: None,
                last: None,
                encoder: None,
                ..Default::default()
            };
            let mut params = Params::for_tp_rank(0, 1);
            let mut inits = Vec::new();
            let (chunks, _) = build_stage(&cfg, &part, rank, &mut params, &mut inits);
            params.initialize(1, &inits);
            let mut grads = Grads::zeros_like(&params);
            let vocab = cfg.padded_vocab_size as u32;
            let tokens: Vec<Vec<u32>> = (0..m)
                .map(|k| {
                    (0..b * t)
                        .map(|i| ((i * 31 + k * 7) as u32) % vocab)
                        .collect()
                })
                .collect();
            let mask = vec![1.0f32; b * t];
            let batches: Vec<Batch> = tokens
                .iter()
                .map(|tk| Batch {
                    tokens: tk,
                    labels: tk,
                    loss_mask: &mask,
                    b,
                    t,
                    position_ids: None,
                    doc_start: None,
                })
                .collect();
            let ctxs = vec![StepContext::eval(); m];
            let ops = schedule(p, rank, m, v).expect("valid schedule");
            let mut one = serial_group();
            let mut tp = Tp::new(&mut one, false);
            let mut samples = Vec::new();
            for step in 0..repeats + 1 {
                let mut timers = Timers::new(Instant::now(), false);
                Stage {
                    chunks: &chunks,
                    partition: part.clone(),
                    rank,
                    pp: &mut *c,
                    tp: &mut tp,
                }
                .run(
                    &params,
                    Some(&mut grads),
                    &ops,
                    &batches,
                    &ctxs,
                    1.0,
                    &mut timers,
                )
                .expect("pipeline step");
                // Line the stages up before the next step, as the optimizer's collectives do.
                c.barrier().expect("barrier");
                if step > 0 {
                    samples.push((
                        (timers.forward + timers.backward).as_secs_f64(),
                        timers.pipeline.as_secs_f64(),
                    ));
                }
            }
            samples.sort_by(|a, b| (a.1).total_cmp(&b.1));
            samples[samples.len() / 2]
        })
    })
    .into_iter()
    .map(|r| r.expect("rank ok"))
    .collect()
}

pub fn pipeline(a: &BenchArgs) -> anyhow::Result<()> {
    let cfg = TransformerConfig {
        num_layers: a.layers,
        hidden_size: a.hidden,
        num_attention_heads: a.heads,
        ffn_hidden_size: a.ffn,
        seq_length: a.seq_length,
        max_position_embeddings: a.seq_length,
        padded_vocab_size: TransformerConfig::pad_vocab(a.vocab, 128),
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: true,
        ..Default::default()
    };
    cfg.validate()?;
    let p = a.ranks.first().copied().unwrap_or(4);
    let cores = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    println!(
        "GPT {} layers, hidden {}, heads {}, ffn {}, seq {}, vocab {}, micro-batch 1; P = {p} stage threads on {cores} cores; median of {} steps",
        cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.seq_length, cfg.padded_vocab_size, a.repeats
    );
    println!(
        "{:>4} {:>3} {:>9}  {:>10} {:>10}  per-stage idle / busy",
        "M", "V", "step ms", "idle/busy", "theory"
    );
    for &m in &[4usize, 8, 16, 32] {
        for v in [1usize, 2] {
            if v > 1 && (!cfg.num_layers.is_multiple_of(p * v) || !m.is_multiple_of(p)) {
                continue;
            }
            let stages = measure(&cfg, p, v, m, a.repeats.max(1), cores);
            let per: Vec<f64> = stages
                .iter()
                .map(|(busy, wall)| (wall - busy) / busy)
                .collect();
            let mean = per.iter().sum::<f64>() / per.len() as f64;
            let wall = stages.iter().map(|s| s.1).fold(0.0, f64::max);
            let theory = (p - 1) as f64 / (v * m) as f64;
            let cols: Vec<String> = per.iter().map(|x| format!("{x:.3}")).collect();
            println!(
                "{m:>4} {v:>3} {:>9.1}  {mean:>10.3} {theory:>10.3}  [{}]",
                wall * 1e3,
                cols.join(", ")
            );
        }
    }
    Ok(())
}
