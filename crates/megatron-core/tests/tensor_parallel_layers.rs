//! Vocabulary-parallel embedding and cross entropy against the serial kernels; per-layer
//! TP-group collectives and per-rank memory against the formulas.

use megatron_comm::{run_ranks, Communicator};
use megatron_core::params::{Grads, Params};
use megatron_core::tensor_parallel::{vocab_parallel_cross_entropy, Tp, VocabParallelEmbedding};
use megatron_core::transformer::step::StepContext;
use megatron_core::{Batch, GPTModel, TransformerConfig};
use megatron_tensor::cpu::matmul::Operand;
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, fused_classifier, ClassifierDims,
    IGNORE_INDEX,
};
use megatron_tensor::Tensor;

const V: usize = 16; // padded vocabulary: ids 13..16 are padding rows
const H: usize = 8;

fn embedding(tp_rank: usize, tp: usize) -> (VocabParallelEmbedding, Params) {
    let mut params = Params::for_tp_rank(tp_rank, tp);
    let mut inits = Vec::new();
    let e = VocabParallelEmbedding::new(&mut params, &mut inits, "emb", V, H, 0.5);
    params.initialize(7, &inits);
    (e, params)
}

#[test]
fn vocab_parallel_embedding_matches_the_serial_lookup() {
    let ids: Vec<u32> = vec![0, 5, 12, 3, 15, 8, 7, 12];
    let (_, full) = embedding(0, 1);
    let mut want = vec![0.0; ids.len() * H];
    embedding_lookup_forward(&mut want, &ids, &full.data, 0, false);
    let dout: Vec<f32> = (0..ids.len() * H).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut want_grad = vec![0.0; V * H];
    embedding_lookup_backward(&mut want_grad, &dout, &ids, 0);
    for p in [2usize, 4] {
        for sp in [false, true] {
            let (ids, want, dout, want_grad) =
                (ids.clone(), want.clone(), dout.clone(), want_grad.clone());
            let out = run_ranks(p, move |rank, c| {
                let mut tp = Tp::new(c, sp);
                let (e, params) = embedding(rank, p);
                let y = e.forward(&params, &mut tp, &ids).unwrap();
                let (lo, hi) = tp.sequence_shard(ids.len());
                assert_eq!(y.data(), &want[lo * H..hi * H], "tp {p} sp {sp}");
                let mut grads = Grads::zeros_like(&params);
                let d = Tensor::from_vec(&[hi - lo, H], dout[lo * H..hi * H].to_vec()).unwrap();
                e.backward(&mut grads, &mut tp, &ids, d).unwrap();
                let rows = V / p;
                assert_eq!(
                    grads.get(e.weight),
                    &want_grad[rank * rows * H..(rank + 1) * rows * H],
                    "tp {p} sp {sp}: gradients land only in the owned rows"
                );
            });
            for r in out {
                r.unwrap();
            }
        }
    }
}

#[test]
fn vocab_parallel_cross_entropy_matches_the_serial_kernel() {
    let (n, c) = (10usize, H);
    let x: Vec<f32> = (0..n * c)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
        .collect();
    let w: Vec<f32> = (0..V * c)
        .map(|i| ((i * 53 % 29) as f32 - 14.0) * 0.05)
        .collect();
    // Targets in every shard, plus ignored tokens; padded rows (13..16) only in the softmax.
    let targets: Vec<u32> = vec![0, 12, IGNORE_INDEX, 5, 9, 3, IGNORE_INDEX, 7, 11, 2];
    let dloss: Vec<f32> = (0..n).map(|i| 0.1 + 0.01 * i as f32).collect();
    let d = move |v| ClassifierDims {
        n,
        c,
        v,
        chunk_rows: 4,
    };
    let mut want = vec![0.0; n];
    let mut want_dx = vec![0.0; n * c];
    let mut want_dw = vec![0.0; V * c];
    fused_classifier(
        &mut want,
        Some((&mut want_dx, &mut want_dw)),
        &x,
        Operand::F32(&w),
        None,
        &targets,
        &dloss,
        d(V),
    );
    for p in [2usize, 4] {
        let (x, w, targets, dloss, want, want_dx, want_dw) = (
            x.clone(),
            w.clone(),
            targets.clone(),
            dloss.clone(),
            want.clone(),
            want_dx.clone(),
            want_dw.clone(),
        );
        let out = run_ranks(p, move |rank, c_| {
            let mut tp = Tp::new(c_, false);
            let rows = V / p;
            let shard = &w[rank * rows * c..(rank + 1) * rows * c];
            let mut losses = vec![0.0; n];
            let mut dx = vec![0.0; n * c];
            let mut dw = vec![0.0; rows * c];
            let before = tp.comm.stats();
            vocab_parallel_cross_entropy(
                &mut tp,
                &mut losses,
                Some((&mut dx, &mut dw)),
                &x,
                Operand::F32(shard),
                None,
                &targets,
                &dloss,
                d(rows),
                rank * rows,
            )
            .unwrap();
            // Three [rows]-sized all-reduces per tile of 4 tokens: 3 tiles.
            let calls = tp.comm.stats().calls["all_reduce"]
                - before.calls.get("all_reduce").copied().unwrap_or(0);
            assert_eq!(calls, 9);
            for (a, b) in losses.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "loss {a} vs {b}");
            }
            assert_eq!(losses[2], 0.0, "ignored target");
            for (a, b) in dw
                .iter()
                .zip(&want_dw[rank * rows * c..(rank + 1) * rows * c])
            {
                assert!((a - b).abs() <= 1e-5, "dweight {a} vs {b}");
            }
            // Partial input gradients sum to the serial one.
            tp.comm
                .all_reduce(&mut dx, megatron_comm::ReduceOp::Sum)
                .unwrap();
            for (a, b) in dx.iter().zip(&want_dx) {
                assert!((a - b).abs() <= 1e-5, "dx {a} vs {b}");
            }
        });
        for r in out {
            r.unwrap();
        }
    }
}

fn gpt(layers: usize) -> TransformerConfig {
    TransformerConfig {
        num_layers: layers,
        hidden_size: 64,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 32,
        max_position_embeddings: 32,
        padded_vocab_size: 256,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: false,
        ..Default::default()
    }
}

/// Collective calls and bytes of one forward (loss only) and one forward + backward.
type Counts = Vec<(&'static str, u64, u64)>;

fn counts(c: &dyn Communicator) -> Counts {
    let s = c.stats();
    s.calls.iter().map(|(k, v)| (*k, *v, s.bytes[k])).collect()
}

fn diff(a: &Counts, b: &Counts) -> Counts {
    a.iter()
        .map(|(k, c, by)| {
            let (c0, b0) = b.iter().find(|x| x.0 == *k).map_or((0, 0), |x| (x.1, x.2));
            (*k, c - c0, by - b0)
        })
        .filter(|x| x.1 > 0)
        .collect()
}

/// Per-layer TP collectives: the counts of an L = 2 model minus those of L = 1, for a forward
/// alone and for forward + backward; plus saved-activation bytes and parameters per rank.
fn measure(p: usize, sp: bool) -> Vec<(Counts, Counts, usize, usize)> {
    run_ranks(p, move |rank, c| {
        let (b, t) = (2usize, 32usize);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 31 % 250) as u32).collect();
        let labels: Vec<u32> = (0..b * t).map(|i| (i * 17 % 250) as u32).collect();
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
        let mut per = Vec::new();
        for layers in [1usize, 2] {
            let (model, params) = GPTModel::new_tp(gpt(layers), 1, rank, p);
            let mut grads = Grads::zeros_like(&params);
            let mut tp = Tp::new(c, sp);
            let s0 = counts(tp.comm);
            model.forward_loss(&params, &mut tp, &batch).unwrap();
            let s1 = counts(tp.comm);
            let r = model
                .forward_backward(
                    &params,
                    &mut grads,
                    &mut tp,
                    &batch,
                    1.0,
                    &StepContext::eval(),
                )
                .unwrap();
            let s2 = counts(tp.comm);
            per.push((
                diff(&s1, &s0),
                diff(&s2, &s1),
                r.activation_bytes,
                params.numel(),
            ));
        }
        per
    })
    .into_iter()
    .map(|r| r.unwrap())
    .next()
    .unwrap()
}

#[test]
fn tp_collectives_per_layer_match_the_theory() {
    let (s, b, h) = (32u64, 2u64, 64u64);
    let sbh_bytes = s * b * h * 4;
    for p in [2u64, 4] {
        // Without sequence parallelism: forward two all-reduces of s*b*h, backward two more.
        let m = measure(p as usize, false);
        let fwd = diff(&m[1].0, &m[0].0);
        assert_eq!(
            fwd,
            vec![("all_reduce", 2, 2 * sbh_bytes)],
            "tp {p} forward"
        );
        let both = diff(&m[1].1, &m[0].1);
        assert_eq!(
            both,
            vec![("all_reduce", 4, 4 * sbh_bytes)],
            "tp {p} fwd+bwd"
        );
        // With sequence parallelism: forward two all-gathers and two reduce-scatters of s*b*h;
        // backward two reduce-scatters (input gradients of the column-parallel linears), two
        // all-gathers (output gradients of the row-parallel linears) and two all-gathers that
        // re-gather the LayerNorm outputs for the weight gradients (Megatron does the same so
        // the gathered input is never kept).
        let m = measure(p as usize, true);
        let fwd = diff(&m[1].0, &m[0].0);
        assert_eq!(
            fwd,
            vec![
                ("all_gather", 2, 2 * sbh_bytes),
                ("reduce_scatter", 2, 2 * sbh_bytes)
            ],
            "tp {p} sp forward"
        );
        let both = diff(&m[1].1, &m[0].1);
        assert_eq!(
            both,
            vec![
                ("all_gather", 6, 6 * sbh_bytes),
                ("reduce_scatter", 4, 4 * sbh_bytes)
            ],
            "tp {p} sp fwd+bwd"
        );
    }
}

#[test]
fn per_rank_parameters_and_activations_follow_the_formulas() {
    let cfg = gpt(2);
    let (l, h, f, a, v) = (2usize, 64usize, 256usize, 4usize, 256usize);
    let (s, b) = (32usize, 2usize);
    let serial = measure(1, false);
    for p in [2usize, 4] {
        for sp in [false, true] {
            let m = measure(p, sp);
            // Parameters: the split ones divide by t; LayerNorms, row-parallel biases and
            // position embeddings stay whole.
            let replicated = l * (4 * h + 2 * h) + 2 * h + cfg.max_position_embeddings * h;
            let split = serial[1].3 - replicated;
            assert_eq!(
                m[1].3,
                split / p + replicated,
                "tp {p}: parameters per rank"
            );
            assert!(split / p + replicated < serial[1].3 / p + replicated);
            // Saved activations per layer (f32): input and mid [sb, h] and four LayerNorm
            // statistics per token (split by t under SP), qkv 3h, attention output h, fc1 f,
            // log-sum-exp a per token (always split by t): the engine's formula.
            let tok = s * b;
            let per_layer = if sp {
                4 * (tok / p) * (6 * h + f + a + 4)
            } else {
                4 * (tok * (2 * h + 4) + (tok / p) * (4 * h + f + a))
            };
            let last = if sp { 4 * tok * h / p } else { 4 * tok * h };
            assert_eq!(
                m[1].2,
                l * per_layer + last,
                "tp {p} sp {sp}: activation bytes"
            );
        }
    }
    let _ = v;
}
