//! The executor on rank threads: a stage holds exactly the micro-batches its schedule implies
//! (counted by the engine's saved-activation accounting), and the pipelined gradients equal
//! those of the whole model.

use megatron_comm::run_ranks;
use megatron_core::models::gpt::Batch;
use megatron_core::params::{Grads, Params};
use megatron_core::pipeline_parallel::executor::Stage;
use megatron_core::pipeline_parallel::partition::StagePartition;
use megatron_core::pipeline_parallel::timers::Timers;
use megatron_core::pipeline_parallel::{build_stage, peak_in_flight, schedule};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_core::{GPTModel, TransformerConfig};
use std::time::Instant;

fn cfg() -> TransformerConfig {
    TransformerConfig {
        num_layers: 8,
        hidden_size: 32,
        num_attention_heads: 4,
        ffn_hidden_size: 64,
        seq_length: 16,
        max_position_embeddings: 16,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: true,
        ..Default::default()
    }
}

struct Data {
    tokens: Vec<Vec<u32>>,
    labels: Vec<Vec<u32>>,
    mask: Vec<f32>,
}

fn data(m: usize, b: usize, t: usize) -> Data {
    Data {
        tokens: (0..m)
            .map(|k| (0..b * t).map(|i| ((i * 7 + k * 13) % 64) as u32).collect())
            .collect(),
        labels: (0..m)
            .map(|k| {
                (0..b * t)
                    .map(|i| ((i * 5 + k * 3 + 1) % 64) as u32)
                    .collect()
            })
            .collect(),
        mask: vec![1.0; b * t],
    }
}

fn batches(d: &Data, b: usize, t: usize) -> Vec<Batch<'_>> {
    d.tokens
        .iter()
        .zip(&d.labels)
        .map(|(tok, lab)| Batch {
            tokens: tok,
            labels: lab,
            loss_mask: &d.mask,
            b,
            t,
            position_ids: None,
            doc_start: None,
        })
        .collect()
}

/// Per stage: measured peak micro-batches in flight, the schedule's bound, bytes of one
/// micro-batch per chunk, measured peak bytes, gradients by parameter name.
type StageResult = (usize, usize, Vec<usize>, usize, Vec<(String, Vec<f32>)>);

/// Runs one step of the schedule on `p` stages with `v` chunks.
fn pipelined(p: usize, v: usize, m: usize) -> Vec<StageResult> {
    run_ranks(p, move |rank, c| {
        let (b, t) = (2, 16);
        let part = StagePartition {
            num_layers: 8,
            p,
            v,
            first: None,
            last: None,
            encoder: None,
            ..Default::default()
        };
        let mut params = Params::for_tp_rank(0, 1);
        let mut inits = Vec::new();
        let (chunks, _) = build_stage(&cfg(), &part, rank, &mut params, &mut inits);
        params.initialize(3, &inits);
        let mut grads = Grads::zeros_like(&params);
        let d = data(m, b, t);
        let bs = batches(&d, b, t);
        let ctxs = vec![StepContext::eval(); m];
        let ops = schedule(p, rank, m, v).unwrap();
        let mut one = serial_group();
        let mut tp = Tp::new(&mut one, false);
        let mut timers = Timers::new(Instant::now(), false);
        let r = Stage {
            chunks: &chunks,
            partition: part,
            rank,
            pp: c,
            tp: &mut tp,
        }
        .run(
            &params,
            Some(&mut grads),
            &ops,
            &bs,
            &ctxs,
            1.0 / m as f32,
            &mut timers,
        )
        .unwrap();
        let named = params
            .metas
            .iter()
            .map(|meta| {
                (
                    meta.name.clone(),
                    grads.data[meta.offset..meta.offset + meta.numel].to_vec(),
                )
            })
            .collect();
        (
            r.peak_in_flight,
            peak_in_flight(&ops),
            r.chunk_bytes,
            r.peak_activation_bytes,
            named,
        )
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn stages_hold_exactly_the_micro_batches_their_schedule_implies() {
    for (p, v, m) in [(4, 1, 8), (4, 1, 3), (2, 1, 5), (2, 2, 4), (4, 2, 8)] {
        let stages = pipelined(p, v, m);
        for (rank, (peak, bound, chunk_bytes, peak_bytes, _)) in stages.iter().enumerate() {
            assert_eq!(peak, bound, "p {p} v {v} m {m} stage {rank}");
            if v == 1 {
                assert_eq!(*bound, (p - rank).min(m));
                // Each micro-batch's activations are freed after its backward: the peak is
                // the bound times one micro-batch.
                assert_eq!(*peak_bytes, bound * chunk_bytes[0], "stage {rank}");
            } else {
                // Replaying the schedule with each chunk's bytes gives the measured peak.
                let ops = schedule(p, rank, m, v).unwrap();
                let (mut live, mut most) = (0usize, 0usize);
                for op in ops {
                    match op {
                        megatron_core::pipeline_parallel::Op::Forward { chunk, .. } => {
                            live += chunk_bytes[chunk]
                        }
                        megatron_core::pipeline_parallel::Op::Backward { chunk, .. } => {
                            live -= chunk_bytes[chunk]
                        }
                    }
                    most = most.max(live);
                }
                assert_eq!(*peak_bytes, most, "stage {rank}");
            }
        }
    }
}

#[test]
fn pipelined_gradients_equal_the_whole_model_gradients() {
    let m = 4;
    let (b, t) = (2, 16);
    let (model, params) = GPTModel::new(cfg(), 3);
    let mut grads = Grads::zeros_like(&params);
    let d = data(m, b, t);
    for batch in batches(&d, b, t) {
        model.forward_backward_serial(
            &params,
            &mut grads,
            &batch,
            1.0 / m as f32,
            &StepContext::eval(),
        );
    }
    for (p, v) in [(2, 1), (4, 1), (2, 2)] {
        for (rank, (_, _, _, _, named)) in pipelined(p, v, m).into_iter().enumerate() {
            for (name, g) in named {
                let id = params.find(&name).unwrap();
                let want = grads.get(id);
                let tied_copy =
                    name == "embedding.word_embeddings.weight" && rank == p - 1 && p > 1;
                if tied_copy {
                    continue; // summed with the first stage's by the embedding group
                }
                let err = g
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-5, "p {p} v {v} stage {rank} {name}: {err}");
            }
        }
    }
}
