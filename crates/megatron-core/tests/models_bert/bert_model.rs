//! The whole BERT model: gradients against central differences (pre-LN, post-LN, with the
//! binary head and token types), padding that changes nothing, and tensor-parallel (with
//! sequence parallelism) and pipelined gradients equal to one rank's.

use megatron_comm::run_ranks;
use megatron_core::models::bert::{BertBatch, BertConfig, BertModel, BinaryHead};
use megatron_core::models::ModelChunk;
use megatron_core::params::{Grads, Params};
use megatron_core::pipeline_parallel::executor::Stage;
use megatron_core::pipeline_parallel::partition::StagePartition;
use megatron_core::pipeline_parallel::timers::Timers;
use megatron_core::pipeline_parallel::{build_stage, schedule};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::config::{GeluForm, LayerNormPlacement};
use megatron_core::transformer::step::StepContext;
use megatron_core::TransformerConfig;
use std::time::Instant;

const B: usize = 2;
const T: usize = 8;

fn config(placement: LayerNormPlacement, gelu: GeluForm) -> BertConfig {
    BertConfig::new(
        TransformerConfig {
            num_layers: 2,
            hidden_size: 16,
            num_attention_heads: 4,
            ffn_hidden_size: 32,
            seq_length: T,
            max_position_embeddings: T,
            padded_vocab_size: 32,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
            init_method_std: 0.3,
            layernorm_epsilon: 1e-5,
            layernorm_placement: placement,
            gelu,
            ..Default::default()
        },
        BinaryHead::SentenceOrder,
    )
}

/// One micro-batch's fields: the second sequence has 3 padding tokens.
struct Data {
    tokens: Vec<u32>,
    types: Vec<u32>,
    key_lens: Vec<usize>,
    rows: Vec<u32>,
    labels: Vec<u32>,
    order: Vec<u32>,
}

fn data(seed: usize) -> Data {
    Data {
        tokens: (0..B * T)
            .map(|i| ((i * 7 + seed * 13 + 3) % 32) as u32)
            .collect(),
        types: (0..B * T).map(|i| u32::from(i % T >= T / 2)).collect(),
        key_lens: vec![T, T - 3],
        rows: vec![1, 3, 6, 9, 12],
        labels: vec![(5 + seed as u32) % 32, 17, 2, 30, (11 + seed as u32) % 32],
        order: vec![0, 1],
    }
}

fn batch(d: &Data) -> BertBatch<'_> {
    BertBatch {
        tokens: &d.tokens,
        tokentypes: &d.types,
        key_lens: &d.key_lens,
        masked_rows: &d.rows,
        masked_labels: &d.labels,
        sentence_order: &d.order,
        b: B,
        t: T,
    }
}

/// Loss and, with `grads`, gradients of a whole model on one micro-batch.
fn forward_backward(
    model: &BertModel,
    params: &Params,
    grads: Option<&mut Grads>,
    tp: &mut Tp,
    batch: &BertBatch,
) -> f32 {
    let ctx = StepContext::eval();
    match grads {
        Some(g) => {
            let (_, state) = model
                .forward_step(params, Some(&mut *g), tp, None, batch, 1.0, &ctx)
                .unwrap();
            let l = megatron_core::models::ChunkState::loss(&state).unwrap().0;
            model
                .backward_step(params, g, tp, state, None, batch, &ctx, &mut |_| {})
                .unwrap();
            l
        }
        None => {
            let (_, state) = model
                .forward_step(params, None, tp, None, batch, 1.0, &ctx)
                .unwrap();
            megatron_core::models::ChunkState::loss(&state).unwrap().0
        }
    }
}

fn serial_loss(model: &BertModel, params: &Params, batch: &BertBatch) -> f32 {
    let mut one = serial_group();
    forward_backward(model, params, None, &mut Tp::new(&mut one, false), batch)
}

fn gradient_check(cfg: BertConfig) {
    let (model, mut params) = BertModel::new_tp(cfg, 42, 0, 1);
    let d = data(0);
    let batch = batch(&d);
    let mut grads = Grads::zeros_like(&params);
    let mut one = serial_group();
    let l = forward_backward(
        &model,
        &params,
        Some(&mut grads),
        &mut Tp::new(&mut one, false),
        &batch,
    );
    assert_eq!(l.to_bits(), serial_loss(&model, &params, &batch).to_bits());
    let eps = 1e-2f32;
    let (mut checked, mut significant) = (0, 0);
    for meta in params.metas.clone() {
        for k in 0..3 {
            let i = meta.offset + (meta.numel * (2 * k + 1)) / 6;
            let orig = params.data[i];
            params.data[i] = orig + eps;
            let fp = serial_loss(&model, &params, &batch) as f64;
            params.data[i] = orig - eps;
            let fm = serial_loss(&model, &params, &batch) as f64;
            params.data[i] = orig;
            let fd = (fp - fm) / (2.0 * eps as f64);
            let an = grads.data[i] as f64;
            assert!(
                (fd - an).abs() <= 2e-3 + 5e-2 * an.abs(),
                "{}[{}]: finite difference {fd} vs analytic {an}",
                meta.name,
                i - meta.offset
            );
            checked += 1;
            significant += usize::from(an.abs() > 1e-2);
        }
    }
    assert!(checked >= 3 * 20, "{checked} coordinates");
    assert!(
        significant * 2 >= checked,
        "{significant} of {checked} above 0.01"
    );
}

#[test]
fn pre_ln_bert_gradients_match_finite_difference() {
    gradient_check(config(LayerNormPlacement::PreLn, GeluForm::Tanh));
}

#[test]
fn post_ln_bert_with_exact_gelu_gradients_match_finite_difference() {
    let cfg = config(LayerNormPlacement::PostLn, GeluForm::Erf);
    let (_, params) = BertModel::new_tp(cfg.clone(), 1, 0, 1);
    // Post-LN: an embedding LayerNorm, each layer's norms after the residual sums, no final norm.
    assert!(params.find("embedding.layernorm.weight").is_some());
    assert!(params
        .find("encoder.layers.1.post_mlp_layernorm.weight")
        .is_some());
    assert!(params.find("encoder.final_layernorm.weight").is_none());
    assert!(params
        .find("embedding.tokentype_embeddings.weight")
        .is_some());
    gradient_check(cfg);
}

#[test]
fn padding_tokens_change_no_loss_and_no_gradient() {
    for placement in [LayerNormPlacement::PreLn, LayerNormPlacement::PostLn] {
        let (model, params) = BertModel::new_tp(config(placement, GeluForm::Tanh), 3, 0, 1);
        let run = |d: &Data| {
            let mut grads = Grads::zeros_like(&params);
            let mut one = serial_group();
            let l = forward_backward(
                &model,
                &params,
                Some(&mut grads),
                &mut Tp::new(&mut one, false),
                &batch(d),
            );
            (l, grads.data)
        };
        let d = data(0);
        let mut padded = data(0);
        // Other tokens and segments in the second sequence's 3 padding positions.
        for p in T + T - 3..2 * T {
            padded.tokens[p] = (padded.tokens[p] + 5) % 32;
            padded.types[p] = 1 - padded.types[p];
        }
        let (l0, g0) = run(&d);
        let (l1, g1) = run(&padded);
        assert_eq!(l0.to_bits(), l1.to_bits(), "{placement:?}: loss");
        // Only the padding tokens' own embedding rows may differ (their outputs are unused).
        let (_, all) = (0, g0.len());
        let differ = g0.iter().zip(&g1).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "{placement:?}: {differ} of {all} gradients differ"
        );
        // And a real token does change the loss.
        let mut real = data(0);
        real.tokens[T + 2] = (real.tokens[T + 2] + 5) % 32;
        assert_ne!(run(&real).0.to_bits(), l0.to_bits());
    }
}

/// Loss and gradients by name, on `size` tensor-parallel ranks with or without SP: the
/// replicated parameters whole, the vocabulary-split ones as this rank's rows.
fn tp_run(
    cfg: BertConfig,
    rank: usize,
    size: usize,
    tp: &mut Tp,
) -> (f32, Vec<(String, Vec<f32>)>) {
    let (model, params) = BertModel::new_tp(cfg, 9, rank, size);
    let mut grads = Grads::zeros_like(&params);
    let mut total = 0.0;
    for seed in 0..2 {
        let d = data(seed);
        total += forward_backward(&model, &params, Some(&mut grads), tp, &batch(&d));
    }
    if tp.sequence_parallel {
        megatron_core::tensor_parallel::allreduce_sequence_parallel_grads(&params, &mut grads, tp)
            .unwrap();
    }
    let named = [
        "embedding.word_embeddings.weight",
        "output_layer.bias",
        "embedding.position_embeddings.weight",
        "embedding.tokentype_embeddings.weight",
        "encoder.layers.0.input_layernorm.weight",
        "encoder.final_layernorm.bias",
        "lm_head.dense.weight",
        "lm_head.layer_norm.weight",
        "pooler.dense.weight",
        "binary_head.weight",
    ]
    .iter()
    .map(|n| {
        let id = params.find(n).unwrap();
        (n.to_string(), grads.get(id).to_vec())
    })
    .collect();
    (total, named)
}

#[test]
fn bert_at_tensor_parallel_2_with_and_without_sequence_parallelism_matches_one_rank() {
    let cfg = config(LayerNormPlacement::PreLn, GeluForm::Tanh);
    let mut g = serial_group();
    let (l1, one) = tp_run(cfg.clone(), 0, 1, &mut Tp::new(&mut g, false));
    for sp in [false, true] {
        let c = cfg.clone();
        let out = run_ranks(2, move |r, comm| {
            tp_run(c.clone(), r, 2, &mut Tp::new(comm, sp))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (l, named) = r.unwrap();
            assert!(
                (l - l1).abs() <= 1e-5 * l1.abs(),
                "sp {sp} rank {rank}: {l} vs {l1}"
            );
            for ((name, a), (_, b)) in one.iter().zip(&named) {
                // Vocabulary-split tensors: this rank's half of the rows.
                let want: &[f32] = if a.len() == b.len() {
                    a
                } else {
                    &a[rank * b.len()..(rank + 1) * b.len()]
                };
                let err = want
                    .iter()
                    .zip(b)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-5, "sp {sp} rank {rank} {name}: {err}");
            }
        }
    }
}

#[test]
fn pipelined_bert_gradients_equal_the_whole_model_gradients() {
    let cfg = BertConfig {
        transformer: TransformerConfig {
            num_layers: 4,
            ..config(LayerNormPlacement::PostLn, GeluForm::Tanh).transformer
        },
        ..config(LayerNormPlacement::PostLn, GeluForm::Tanh)
    };
    let m = 2;
    let ds: Vec<Data> = (0..m).map(data).collect();
    let (model, params) = BertModel::new_tp(cfg.clone(), 4, 0, 1);
    let mut grads = Grads::zeros_like(&params);
    let mut one = serial_group();
    for d in &ds {
        let ctx = StepContext::eval();
        let mut tp = Tp::new(&mut one, false);
        let (_, st) = model
            .forward_step(
                &params,
                Some(&mut grads),
                &mut tp,
                None,
                &batch(d),
                0.5,
                &ctx,
            )
            .unwrap();
        model
            .backward_step(
                &params,
                &mut grads,
                &mut tp,
                st,
                None,
                &batch(d),
                &ctx,
                &mut |_| {},
            )
            .unwrap();
    }
    let p = 2;
    let out = run_ranks(p, move |rank, c| {
        let part = StagePartition {
            num_layers: 4,
            p,
            v: 1,
            first: None,
            last: None,
            encoder: None,
            ..Default::default()
        };
        let mut params = Params::for_tp_rank(0, 1);
        let mut inits = Vec::new();
        let (chunks, _) = build_stage(&cfg, &part, rank, &mut params, &mut inits);
        params.initialize(4, &inits);
        let mut grads = Grads::zeros_like(&params);
        let ds: Vec<Data> = (0..m).map(data).collect();
        let bs: Vec<BertBatch> = ds.iter().map(batch).collect();
        let ctxs = vec![StepContext::eval(); m];
        let ops = schedule(p, rank, m, 1).unwrap();
        let mut one = serial_group();
        let mut tp = Tp::new(&mut one, false);
        let mut timers = Timers::new(Instant::now(), false);
        Stage {
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
            0.5,
            &mut timers,
        )
        .unwrap();
        params
            .metas
            .iter()
            .map(|meta| {
                (
                    meta.name.clone(),
                    meta.shared,
                    grads.data[meta.offset..meta.offset + meta.numel].to_vec(),
                )
            })
            .collect::<Vec<_>>()
    });
    // Summed over stages by name: the word embedding's gradient is split between the first
    // stage and the last stage's copy (the embedding group sums them); every other parameter
    // lives on exactly one stage.
    let mut summed: std::collections::BTreeMap<String, Vec<f32>> = Default::default();
    let mut copies = 0;
    for r in out {
        for (name, shared, g) in r.unwrap() {
            copies += usize::from(shared);
            let acc = summed.entry(name).or_insert_with(|| vec![0.0; g.len()]);
            acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
        }
    }
    assert_eq!(
        copies, 1,
        "the last stage holds one copy of the word embedding"
    );
    assert_eq!(summed.len(), params.metas.len());
    for (name, g) in summed {
        let want = grads.get(params.find(&name).unwrap());
        let err = g
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err < 1e-5, "{name}: {err}");
    }
}
