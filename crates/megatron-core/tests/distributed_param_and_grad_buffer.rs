use megatron_comm::run_ranks;
use megatron_core::distributed::overlap_param_gather::{gather_params, ParamGate, ParamsPtr};
use megatron_core::distributed::GradBuffer;
use megatron_core::optimizer::{Adam, DistributedOptimizer, UpdateRule};
use megatron_core::params::{Grads, ParamId};
use megatron_core::{GPTModel, TransformerConfig};
use megatron_tensor::cpu::cast::{round_to_half_inplace, Half};

fn cfg() -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: false,
        ..Default::default()
    }
}

const ADAM: UpdateRule = UpdateRule::Adam {
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
};

/// The gradient DP rank `rank` contributes for element `i`: different on every rank.
fn rank_grad(i: usize, rank: usize) -> f32 {
    ((i * 7 + rank * 13) % 17) as f32 * 0.01 - 0.08
}

/// What the data-parallel average of [`rank_grad`] over `dp` ranks gives plain Adam.
fn averaged_grad(i: usize, dp: usize) -> f32 {
    (0..dp).map(|r| rank_grad(i, r)).sum::<f32>() / dp as f32
}

#[test]
fn buckets_cover_the_buffer_in_reverse_order_and_shards_partition_them() {
    let (_, params) = GPTModel::new(cfg(), 1);
    for size in [1usize, 500, 3000, usize::MAX] {
        for dp in [1usize, 2, 3, 4, 8] {
            let b = GradBuffer::new(&params, size, dp, 0, true);
            // Reverse registration order, contiguous, covering everything.
            let mut end = params.numel();
            for (i, bk) in b.buckets.iter().enumerate() {
                assert_eq!(bk.range.end, end);
                end = bk.range.start;
                if i + 1 < b.buckets.len() {
                    assert!(bk.range.len() >= size.min(params.numel()), "size {size}");
                }
                let mut covered = 0;
                for r in 0..dp {
                    let s = bk.shard(dp, r);
                    assert!(s.len() <= bk.shard_len(dp));
                    assert_eq!(s.start, (bk.range.start + covered).min(bk.range.end));
                    covered += s.len();
                }
                assert_eq!(covered, bk.range.len());
            }
            assert_eq!(end, 0);
            if size == usize::MAX {
                assert_eq!(b.buckets.len(), 1);
            }
        }
    }
}

#[test]
fn the_distributed_optimizer_matches_adam_and_holds_one_dp_th_of_the_state() {
    for dp in [2usize, 3, 4] {
        let out = run_ranks(dp, move |rank, c| {
            let (_, mut params) = GPTModel::new(cfg(), 1);
            let n = params.numel();
            // Every rank contributes different gradients; the average is what Adam sees.
            let mut grads = Grads::zeros_like(&params);
            for (i, g) in grads.data.iter_mut().enumerate() {
                *g = rank_grad(i, rank);
            }
            let buffer = GradBuffer::new(&params, 700, dp, rank, true);
            let mut d = DistributedOptimizer::new(&params, buffer, ADAM);
            let state = d.state_len();
            d.reduce_gradients(&mut grads, c).unwrap();
            d.step(&mut params, &grads, 1e-2, 0.1, c).unwrap();
            (params.data, state, n)
        });
        // Reference: plain Adam on the averaged gradients.
        let (_, mut params) = GPTModel::new(cfg(), 1);
        let mut grads = Grads::zeros_like(&params);
        for (i, g) in grads.data.iter_mut().enumerate() {
            *g = averaged_grad(i, dp);
        }
        let mut adam = Adam::new(&params, 0.9, 0.95, 1e-8);
        adam.step(&mut params, &grads, 1e-2, 0.1);
        let mut total_state = 0;
        for r in out {
            let (p, state, n) = r.unwrap();
            total_state += state;
            let err = p
                .iter()
                .zip(&params.data)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(err < 1e-6, "dp {dp}: {err}");
            assert!(state <= n.div_ceil(dp) * 8, "dp {dp}: {state} of {n}");
        }
        assert_eq!(
            total_state,
            params.numel(),
            "dp {dp}: every element owned once"
        );
    }
}

#[test]
fn the_distributed_optimizer_with_sgd_matches_torchs_sgd_and_holds_one_dp_th_of_the_buffer() {
    // Two steps, so the second uses the momentum buffer the first left in the shards; weight
    // decay only where the parameter's metadata asks.
    let (lr, wd, momentum) = (1e-2f32, 0.1f32, 0.9f32);
    for dp in [2usize, 3] {
        let out = run_ranks(dp, move |rank, c| {
            let (_, mut params) = GPTModel::new(cfg(), 1);
            let buffer = GradBuffer::new(&params, 700, dp, rank, true);
            let mut d = DistributedOptimizer::new(&params, buffer, UpdateRule::Sgd { momentum });
            for step in 0..2 {
                let mut grads = Grads::zeros_like(&params);
                for (i, g) in grads.data.iter_mut().enumerate() {
                    *g = rank_grad(i + step, rank);
                }
                d.reduce_gradients(&mut grads, c).unwrap();
                d.step(&mut params, &grads, lr, wd, c).unwrap();
            }
            (
                params.data,
                d.moments.iter().map(|m| m.len()).sum::<usize>(),
            )
        });
        // torch.optim.SGD in f64 on the averaged gradients.
        let (_, params) = GPTModel::new(cfg(), 1);
        let mut p: Vec<f64> = params.data.iter().map(|&x| x as f64).collect();
        let mut buf = vec![0.0f64; p.len()];
        for step in 0..2 {
            for m in &params.metas {
                let decay = if m.weight_decay { wd as f64 } else { 0.0 };
                for i in m.offset..m.offset + m.numel {
                    let g = averaged_grad(i + step, dp) as f64 + decay * p[i];
                    buf[i] = if step == 0 {
                        g
                    } else {
                        momentum as f64 * buf[i] + g
                    };
                    p[i] -= lr as f64 * buf[i];
                }
            }
        }
        let mut held = 0;
        for r in out {
            let (got, state) = r.unwrap();
            held += state;
            let err = got
                .iter()
                .zip(&p)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0f64, f64::max);
            assert!(err < 1e-6, "dp {dp}: {err}");
        }
        assert_eq!(held, p.len(), "dp {dp}: one momentum buffer, partitioned");
    }
}

#[test]
fn with_16_bit_parameters_the_distributed_optimizer_keeps_fp32_main_shards_and_gathers_the_rounding(
) {
    // Odd bucket sizes give odd shard lengths: the 16-bit all-gather packs two values per
    // word and must still place every element.
    for half in [Half::BF16, Half::F16] {
        for dp in [2usize, 3, 4] {
            let out = run_ranks(dp, move |rank, c| {
                let (_, mut params) = GPTModel::new(cfg(), 1);
                params.set_half(Some(half));
                let mut grads = Grads::zeros_like(&params);
                for (i, g) in grads.data.iter_mut().enumerate() {
                    *g = rank_grad(i, rank);
                }
                let buffer = GradBuffer::new(&params, 701, dp, rank, true);
                let mut d = DistributedOptimizer::new(&params, buffer, ADAM);
                params.data = Vec::new();
                d.reduce_gradients(&mut grads, c).unwrap();
                d.step(&mut params, &grads, 1e-2, 0.1, c).unwrap();
                let main = d.full_main(params.numel(), c).unwrap();
                (params.values(), main, d.main.len())
            });
            let (_, mut params) = GPTModel::new(cfg(), 1);
            params.set_half(Some(half));
            let mut grads = Grads::zeros_like(&params);
            for (i, g) in grads.data.iter_mut().enumerate() {
                *g = averaged_grad(i, dp);
            }
            let mut adam = Adam::new(&params, 0.9, 0.95, 1e-8);
            adam.step(&mut params, &grads, 1e-2, 0.1);
            let (model, main) = (params.values(), params.data.clone());
            let mut rounded = main.clone();
            round_to_half_inplace(&mut rounded, half);
            // Plain Adam's model parameters are the rounding of its fp32 main parameters.
            assert!(
                model == rounded,
                "{half:?}: the model reads the rounded mains"
            );
            let mut held = 0;
            for r in out {
                let (m16, m32, len) = r.unwrap();
                held += len;
                let err = m32
                    .iter()
                    .zip(&main)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-6, "{half:?} dp {dp}: main {err}");
                // Every element of the gathered 16-bit parameters is the rounding of its main
                // value (one unit of slack where the f32 mains differ in the last bits).
                for (i, (a, b)) in m16.iter().zip(&rounded).enumerate() {
                    assert!(
                        (a - b).abs() <= b.abs() * 1e-2 + 1e-7,
                        "{half:?} dp {dp} [{i}]: {a} vs {b}"
                    );
                }
            }
            assert_eq!(
                held,
                params.numel(),
                "{half:?} dp {dp}: main shards partition"
            );
        }
    }
}

#[test]
fn params_read_during_an_overlapped_gather_are_already_gathered() {
    // The optimizer updates only its shards; a communication thread gathers bucket by bucket
    // while this thread reads every parameter through `Params::get` at once: each read must
    // wait for its bucket and see the gathered (fully updated) values.
    for half in [None, Some(Half::BF16)] {
        let out = run_ranks(2, move |rank, c| {
            let run = |overlap: bool, c: &mut dyn megatron_comm::Communicator| {
                let (_, mut params) = GPTModel::new(cfg(), 1);
                params.set_half(half);
                let mut grads = Grads::zeros_like(&params);
                for (i, g) in grads.data.iter_mut().enumerate() {
                    *g = rank_grad(i, rank);
                }
                let buffer = GradBuffer::new(&params, 300, 2, rank, true);
                let mut d = DistributedOptimizer::new(&params, buffer, ADAM);
                if half.is_some() {
                    params.data = Vec::new();
                }
                d.reduce_gradients(&mut grads, c).unwrap();
                if !overlap {
                    d.step(&mut params, &grads, 1e-2, 0.1, c).unwrap();
                    return (0..params.metas.len())
                        .map(|i| params.get(ParamId(i)).to_vec())
                        .collect::<Vec<_>>();
                }
                d.update(&mut params, &grads, 1e-2, 0.1);
                let gate = std::sync::Arc::new(ParamGate::new());
                params.gate = Some(gate.clone());
                let ptr = ParamsPtr::new(&mut params);
                let buffer = &d.buffer;
                std::thread::scope(|s| {
                    let h = s.spawn(move || gather_params(buffer, ptr, c, &gate));
                    let seen: Vec<Vec<f32>> = (0..params.metas.len())
                        .map(|i| params.get(ParamId(i)).to_vec())
                        .collect();
                    h.join().unwrap().unwrap();
                    seen
                })
            };
            let plain = run(false, c);
            let overlapped = run(true, c);
            plain == overlapped
        });
        for r in out {
            assert!(
                r.unwrap(),
                "{half:?}: a read saw values before its bucket was gathered"
            );
        }
    }
}
