mod common;

use megatron_comm::run_ranks;
use megatron_core::distributed::overlap_param_gather::{gather_params, ParamGate, ParamsPtr};
use megatron_core::distributed::{GradBuffer, Placement};
use megatron_core::optimizer::{layer_wise_placement, Adam, DistributedOptimizer, UpdateRule};
use megatron_core::params::{Grads, ParamId};
use megatron_core::GPTModel;
use megatron_tensor::cpu::cast::{round_to_half_inplace, Half};

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
    let (_, params) = GPTModel::new(common::tiny_gpt(), 1);
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
            let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
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
        let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
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
            let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
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
        let (_, params) = GPTModel::new(common::tiny_gpt(), 1);
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
                let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
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
            let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
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
                let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
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
                let buffer = &d.grads.buffer;
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

/// Muon's matrices (whole) and the rest (split), as `--optimizer muon
/// --use-distributed-optimizer` lays them out.
fn layer_wise(params: &megatron_core::Params, size: usize, dp: usize, rank: usize) -> GradBuffer {
    GradBuffer::new(params, size, dp, rank, true).into_layer_wise(params, layer_wise_placement)
}

#[test]
fn the_layer_wise_layout_keeps_muon_matrices_whole_and_partitions_each_bucket() {
    let (_, params) = GPTModel::new(common::tiny_gpt(), 1);
    for size in [500usize, 3000, usize::MAX] {
        for dp in [2usize, 3, 4] {
            let b = layer_wise(&params, size, dp, 0);
            assert_eq!(b.buckets, layer_wise(&params, size, dp, dp - 1).buckets);
            let mut whole_on = vec![0usize; dp];
            for bk in &b.buckets {
                // Every element of the bucket owned by exactly one rank.
                let mut owner = vec![usize::MAX; bk.range.len()];
                for r in 0..dp {
                    for s in bk.segments(dp, r) {
                        for i in s {
                            assert_eq!(owner[i - bk.range.start], usize::MAX, "dp {dp}: twice");
                            owner[i - bk.range.start] = r;
                        }
                    }
                }
                assert!(
                    owner.iter().all(|&o| o < dp),
                    "size {size} dp {dp}: unowned"
                );
                // A Muon matrix on one rank; the split parameters even the shards out.
                let mut whole = 0;
                for p in bk.params.clone() {
                    let m = &params.metas[p];
                    let ranks: std::collections::BTreeSet<usize> = owner
                        [m.offset - bk.range.start..m.offset + m.numel - bk.range.start]
                        .iter()
                        .copied()
                        .collect();
                    if let Placement::Whole { .. } = layer_wise_placement(m) {
                        assert_eq!(ranks.len(), 1, "{} split over {ranks:?}", m.name);
                        whole_on[*ranks.first().unwrap()] += 1;
                        whole += m.numel;
                    }
                }
                let lens: Vec<usize> = (0..dp)
                    .map(|r| bk.segments(dp, r).iter().map(|s| s.len()).sum())
                    .collect();
                let split = bk.range.len() - whole;
                let whole_max = (0..dp)
                    .map(|r| {
                        bk.params
                            .clone()
                            .filter(|&p| {
                                let m = &params.metas[p];
                                matches!(layer_wise_placement(m), Placement::Whole { .. })
                                    && owner[m.offset - bk.range.start] == r
                            })
                            .map(|p| params.metas[p].numel)
                            .sum::<usize>()
                    })
                    .collect::<Vec<_>>();
                let top = *whole_max.iter().max().unwrap();
                if split >= whole_max.iter().map(|l| top - l).sum::<usize>() {
                    let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                    assert!(hi - lo <= 1, "size {size} dp {dp}: shards {lens:?}");
                }
                assert_eq!(bk.shard_len(dp), *lens.iter().max().unwrap());
                // Buckets hold several matrices, so the shards are not mostly padding.
                let last = bk.range.start == 0;
                let shared = bk.params.clone().any(|p| params.metas[p].shared);
                if !last && !shared {
                    let largest = bk
                        .params
                        .clone()
                        .filter(|&p| {
                            matches!(
                                layer_wise_placement(&params.metas[p]),
                                Placement::Whole { .. }
                            )
                        })
                        .map(|p| params.metas[p].numel)
                        .max()
                        .unwrap_or(0);
                    assert!(
                        bk.range.len() * 10 >= 9 * dp * largest,
                        "size {size} dp {dp}: a bucket of {} for a matrix of {largest}",
                        bk.range.len()
                    );
                }
            }
            // Eight matrices (and the position embedding) spread over every rank.
            assert!(
                whole_on.iter().all(|&n| n > 0),
                "size {size} dp {dp}: {whole_on:?}"
            );
        }
    }
}

#[test]
fn layer_wise_buckets_reduce_scatter_the_average_and_gather_every_segment() {
    for dp in [2usize, 3] {
        let out = run_ranks(dp, move |rank, c| {
            let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
            let b = layer_wise(&params, 701, dp, rank);
            let mut grads = Grads::zeros_like(&params);
            for (i, g) in grads.data.iter_mut().enumerate() {
                *g = rank_grad(i, rank);
            }
            let mut scratch = Vec::new();
            b.reduce_gradients(&mut grads, c, &mut scratch).unwrap();
            let mine: Vec<usize> = b.owned().into_iter().flatten().flatten().collect();
            let reduced: Vec<(usize, f32)> = mine.iter().map(|&i| (i, grads.data[i])).collect();
            // Each rank writes its segments (elsewhere a wrong value); the gather restores all.
            params.data.iter_mut().for_each(|x| *x = -1.0);
            for &i in &mine {
                params.data[i] = i as f32;
            }
            b.all_gather(&mut params.data, c, &mut scratch).unwrap();
            let mut bits: Vec<u16> = vec![0; params.numel()];
            for &i in &mine {
                bits[i] = i as u16 ^ 0x5a5a;
            }
            b.all_gather(&mut bits[..], c, &mut scratch).unwrap();
            (reduced, params.data, bits, mine.len())
        });
        let mut owned = 0;
        for r in out {
            let (reduced, data, bits, n) = r.unwrap();
            owned += n;
            for (i, g) in reduced {
                assert!(
                    (g - averaged_grad(i, dp)).abs() < 1e-6,
                    "dp {dp}: element {i}"
                );
            }
            assert!(
                data.iter().enumerate().all(|(i, x)| *x == i as f32),
                "dp {dp}"
            );
            assert!(bits
                .iter()
                .enumerate()
                .all(|(i, b)| *b == i as u16 ^ 0x5a5a));
        }
        let (_, params) = GPTModel::new(common::tiny_gpt(), 1);
        assert_eq!(owned, params.numel(), "dp {dp}: every element owned once");
    }
}

/// What one rank ends with after a reduce-scatter and the f32 and 16-bit all-gathers of every
/// bucket, with collective calls of `chunk` elements, and the staging it allocated.
type Collected = (Vec<f32>, Vec<f32>, Vec<u16>, usize, usize);

fn collectives_in_chunks(dp: usize, layer_wise_layout: bool, chunk: usize) -> Vec<Collected> {
    run_ranks(dp, move |rank, c| {
        let (_, mut params) = GPTModel::new(common::tiny_gpt(), 1);
        let mut b = if layer_wise_layout {
            layer_wise(&params, 701, dp, rank)
        } else {
            GradBuffer::new(&params, 701, dp, rank, true)
        };
        b.collective_chunk = chunk;
        let mut grads = Grads::zeros_like(&params);
        for (i, g) in grads.data.iter_mut().enumerate() {
            *g = rank_grad(i, rank) * (1.0 + i as f32 * 1e-3);
        }
        let mut scratch = Vec::new();
        b.reduce_gradients(&mut grads, c, &mut scratch).unwrap();
        let mine: Vec<usize> = b.owned().into_iter().flatten().flatten().collect();
        let reduced: Vec<f32> = mine.iter().map(|&i| grads.data[i]).collect();
        params.data.iter_mut().for_each(|x| *x = -1.0);
        for &i in &mine {
            params.data[i] = i as f32 * 0.5;
        }
        b.all_gather(&mut params.data, c, &mut scratch).unwrap();
        let mut bits: Vec<u16> = vec![0; params.numel()];
        for &i in &mine {
            bits[i] = i as u16 ^ 0x3c3c;
        }
        b.all_gather(&mut bits[..], c, &mut scratch).unwrap();
        (
            reduced,
            params.data,
            bits,
            scratch.capacity(),
            b.scratch_elements(),
        )
    })
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

#[test]
fn collectives_in_small_chunks_give_bit_identical_buffers_with_bounded_staging() {
    for layer_wise_layout in [false, true] {
        for dp in [2usize, 3] {
            let whole = collectives_in_chunks(dp, layer_wise_layout, usize::MAX);
            // Odd totals, chunks shorter than a segment, a 16-bit pair at every edge.
            for chunk in [2usize, 7, 10, 64, 999] {
                let chunked = collectives_in_chunks(dp, layer_wise_layout, chunk);
                for (rank, (w, c)) in whole.iter().zip(&chunked).enumerate() {
                    let what =
                        format!("layer-wise {layer_wise_layout} dp {dp} chunk {chunk} rank {rank}");
                    assert_eq!(w.0, c.0, "{what}: reduced gradients");
                    assert!(
                        c.1.iter().enumerate().all(|(i, x)| *x == i as f32 * 0.5),
                        "{what}: f32 gather"
                    );
                    assert!(
                        c.2.iter().enumerate().all(|(i, b)| *b == i as u16 ^ 0x3c3c),
                        "{what}: 16-bit gather"
                    );
                    // Staging: one chunk of every slot plus this rank's, allocated exactly.
                    let per_slot = (chunk / dp).max(2) & !1;
                    assert_eq!(c.4, (dp + 1) * per_slot, "{what}: predicted staging");
                    assert_eq!(c.3, c.4, "{what}: allocated staging");
                }
            }
            // One call per bucket: the staging is the largest shard in every slot plus one.
            let (_, params) = GPTModel::new(common::tiny_gpt(), 1);
            assert!(whole[0].4 < (dp + 1) * params.numel().div_ceil(dp) + dp + 1);
        }
    }
}
