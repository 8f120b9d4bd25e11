//! T5's attention block: encoder self-attention with a relative bias, causal decoder
//! self-attention, and cross-attention to the encoder output with padded keys — gradients of
//! every parameter, of the states, of the encoder output and of the bias against central
//! differences; at tensor parallelism 2 (heads split) the same outputs and gradients as one rank.

use megatron_core::models::t5::attention::T5AttentionShape;
use megatron_core::models::t5::{T5Attention, T5AttentionKind};
use megatron_core::params::{Grads, Params};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_tensor::Tensor;

const H: usize = 8;
const HEADS: usize = 4;
const HD: usize = 3;
const B: usize = 2;

fn build(kind: T5AttentionKind, rank: usize, size: usize) -> (T5Attention, Params) {
    let mut params = Params::for_tp_rank(rank, size);
    let mut inits = Vec::new();
    let a = T5Attention::new(
        kind,
        "decoder.layers.0.cross_attention",
        H,
        (HEADS, HD),
        (0.4, 0.4),
        1.0,
        0.0,
        0,
        &mut params,
        &mut inits,
    );
    params.initialize(11, &inits);
    (a, params)
}

fn tensor(n: usize, seed: usize) -> Tensor {
    Tensor::from_vec(
        &[n / H, H],
        (0..n)
            .map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 9.0)
            .collect(),
    )
    .unwrap()
}

/// `Σ y * r` and, with gradients, (dx, dmemory, dbias) for this rank's heads.
#[allow(clippy::type_complexity)]
fn run(
    a: &T5Attention,
    params: &Params,
    grads: Option<&mut Grads>,
    tp: &mut Tp,
    x: &Tensor,
    mem: Option<&Tensor>,
    bias: &[f32],
    s: T5AttentionShape,
) -> (f64, Option<(Tensor, Option<Tensor>, Option<Vec<f32>>)>) {
    let ctx = StepContext::eval();
    let lens = [s.tk, s.tk - 2];
    let (y, saved) = a
        .forward(params, tp, x, mem, Some(bias), Some(&lens), s, &ctx)
        .unwrap();
    let r = tensor(y.data().len(), 5);
    let loss: f64 = y
        .data()
        .iter()
        .zip(r.data())
        .map(|(a, b)| (*a as f64) * (*b as f64))
        .sum();
    let back = grads.map(|g| {
        a.backward(params, g, tp, saved, x, mem, r, true, s, &ctx)
            .unwrap()
    });
    (loss, back)
}

fn shape(kind: T5AttentionKind) -> T5AttentionShape {
    match kind {
        T5AttentionKind::Cross => T5AttentionShape { b: B, tq: 4, tk: 6 },
        _ => T5AttentionShape { b: B, tq: 5, tk: 5 },
    }
}

#[test]
fn t5_attention_gradients_match_finite_difference() {
    for kind in [
        T5AttentionKind::EncoderSelf,
        T5AttentionKind::DecoderSelf,
        T5AttentionKind::Cross,
    ] {
        let s = shape(kind);
        let (a, mut params) = build(kind, 0, 1);
        let mut x = tensor(B * s.tq * H, 1);
        let mut mem = (kind == T5AttentionKind::Cross).then(|| tensor(B * s.tk * H, 2));
        let mut bias: Vec<f32> = (0..HEADS * s.tq * s.tk)
            .map(|i| ((i * 13 % 7) as f32 - 3.0) / 4.0)
            .collect();
        let mut grads = Grads::zeros_like(&params);
        let mut one = serial_group();
        let (_, back) = run(
            &a,
            &params,
            Some(&mut grads),
            &mut Tp::new(&mut one, false),
            &x,
            mem.as_ref(),
            &bias,
            s,
        );
        let (dx, dmem, dbias) = back.unwrap();
        let eps = 1e-2f32;
        let mut checked = 0;
        let mut check = |fd: f64, an: f64, what: &str| {
            assert!(
                (fd - an).abs() <= 2e-3 + 3e-2 * an.abs(),
                "{kind:?} {what}: {fd} vs {an}"
            );
            checked += 1;
        };
        macro_rules! fd {
            ($buf:expr, $i:expr) => {{
                let orig = $buf[$i];
                $buf[$i] = orig + eps;
                let mut one = serial_group();
                let fp = run(
                    &a,
                    &params,
                    None,
                    &mut Tp::new(&mut one, false),
                    &x,
                    mem.as_ref(),
                    &bias,
                    s,
                )
                .0;
                $buf[$i] = orig - eps;
                let mut one = serial_group();
                let fm = run(
                    &a,
                    &params,
                    None,
                    &mut Tp::new(&mut one, false),
                    &x,
                    mem.as_ref(),
                    &bias,
                    s,
                )
                .0;
                $buf[$i] = orig;
                (fp - fm) / (2.0 * eps as f64)
            }};
        }
        for meta in params.metas.clone() {
            for k in 0..4 {
                let i = meta.offset + (meta.numel * (2 * k + 1)) / 8;
                let f = fd!(params.data, i);
                check(f, grads.data[i] as f64, &meta.name);
            }
        }
        for i in (0..x.data().len()).step_by(7) {
            let f = fd!(x.data_mut(), i);
            check(f, dx.data()[i] as f64, "x");
        }
        if let (Some(m), Some(dm)) = (mem.as_mut(), &dmem) {
            for i in (0..m.data().len()).step_by(7) {
                let orig = m.data()[i];
                let eval = |v: f32, m: &mut Tensor| {
                    m.data_mut()[i] = v;
                    let mut one = serial_group();
                    run(
                        &a,
                        &params,
                        None,
                        &mut Tp::new(&mut one, false),
                        &x,
                        Some(m),
                        &bias,
                        s,
                    )
                    .0
                };
                let f = (eval(orig + eps, m) - eval(orig - eps, m)) / (2.0 * eps as f64);
                m.data_mut()[i] = orig;
                check(f, dm.data()[i] as f64, "memory");
            }
            // Padded keys of the second sequence get no gradient.
            let padded = &dm.data()[(s.tk + s.tk - 2) * H..];
            assert!(padded.iter().all(|v| *v == 0.0));
        }
        let db = dbias.unwrap();
        for i in (0..bias.len()).step_by(5) {
            let f = fd!(bias, i);
            check(f, db[i] as f64, "bias");
        }
        assert!(checked >= 30, "{kind:?}: {checked}");
    }
}

#[test]
fn t5_attention_at_tensor_parallel_2_matches_one_rank() {
    for kind in [T5AttentionKind::DecoderSelf, T5AttentionKind::Cross] {
        let s = shape(kind);
        let bias: Vec<f32> = (0..HEADS * s.tq * s.tk)
            .map(|i| ((i * 13 % 7) as f32 - 3.0) / 4.0)
            .collect();
        let go = move |rank: usize, size: usize, tp: &mut Tp| {
            let (a, params) = build(kind, rank, size);
            let x = tensor(B * s.tq * H, 1);
            let mem = (kind == T5AttentionKind::Cross).then(|| tensor(B * s.tk * H, 2));
            let per = HEADS / size * s.tq * s.tk;
            let local = &bias[rank * per..(rank + 1) * per];
            let mut grads = Grads::zeros_like(&params);
            let (loss, back) = run(
                &a,
                &params,
                Some(&mut grads),
                tp,
                &x,
                mem.as_ref(),
                local,
                s,
            );
            let (dx, dmem, dbias) = back.unwrap();
            (
                loss,
                dx.data().to_vec(),
                dmem.map(|t| t.data().to_vec()),
                dbias.unwrap(),
            )
        };
        let mut g = serial_group();
        let one = go(0, 1, &mut Tp::new(&mut g, false));
        let out = megatron_comm::run_ranks(2, move |r, c| go(r, 2, &mut Tp::new(c, false)));
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        for (rank, r) in out.into_iter().enumerate() {
            let r = r.unwrap();
            assert!(
                (r.0 - one.0).abs() < 1e-5 * one.0.abs().max(1.0),
                "{kind:?} rank {rank} loss"
            );
            assert!(close(&r.1, &one.1), "{kind:?} rank {rank} dx");
            if let (Some(a), Some(b)) = (&r.2, &one.2) {
                assert!(close(a, b), "{kind:?} rank {rank} dmemory");
            }
            let per = r.3.len();
            assert!(
                close(&r.3, &one.3[rank * per..(rank + 1) * per]),
                "{kind:?} rank {rank} dbias"
            );
        }
    }
}

mod layers {
    use megatron_core::models::t5::{T5AttentionShape, T5Layer, T5LayerInputs, T5Stack};
    use megatron_core::params::{Grads, Params};
    use megatron_core::tensor_parallel::{serial_group, Tp};
    use megatron_core::transformer::config::Normalization;
    use megatron_core::transformer::step::StepContext;
    use megatron_core::TransformerConfig;
    use megatron_tensor::Tensor;

    const H: usize = 8;

    fn cfg(dropout: f32) -> TransformerConfig {
        TransformerConfig {
            num_layers: 2,
            hidden_size: H,
            num_attention_heads: 4,
            ffn_hidden_size: 12,
            normalization: Normalization::RMSNorm,
            layernorm_epsilon: 1e-6,
            add_bias_linear: false,
            add_qkv_bias: false,
            hidden_dropout: dropout,
            attention_dropout: dropout,
            init_method_std: 0.4,
            ..Default::default()
        }
    }

    fn states(rows: usize, seed: usize) -> Tensor {
        Tensor::from_vec(
            &[rows, H],
            (0..rows * H)
                .map(|i| (((i * 29 + seed * 7) % 19) as f32 - 9.0) / 7.0)
                .collect(),
        )
        .unwrap()
    }

    #[test]
    fn t5_encoder_and_decoder_layers_match_finite_difference() {
        for (stack, dropout) in [
            (T5Stack::Encoder, 0.0),
            (T5Stack::Decoder, 0.0),
            (T5Stack::Decoder, 0.2),
        ] {
            let mut params = Params::for_tp_rank(0, 1);
            let mut inits = Vec::new();
            let layer = T5Layer::new(&cfg(dropout), stack, 0, 3, 1.0, &mut params, &mut inits);
            params.initialize(5, &inits);
            let (b, t, te) = (2, 5, 6);
            let s = T5AttentionShape { b, tq: t, tk: t };
            let x = states(b * t, 1);
            let mut mem = states(b * te, 2);
            let bias: Vec<f32> = (0..4 * t * t)
                .map(|i| ((i % 9) as f32 - 4.0) / 5.0)
                .collect();
            let self_lens = [t, t];
            let enc_lens = [te, te - 2];
            let ctx = if dropout > 0.0 {
                StepContext::train(3, 1, 0)
            } else {
                StepContext::eval()
            };
            let r = states(b * t, 3);
            let loss = |params: &Params, x: &Tensor, mem: &Tensor| -> f64 {
                let inp = T5LayerInputs {
                    shape: s,
                    bias: &bias,
                    self_lens: &self_lens,
                    memory: (stack == T5Stack::Decoder).then_some((mem, &enc_lens[..], te)),
                };
                let mut one = serial_group();
                let (y, _) = layer
                    .forward(params, &mut Tp::new(&mut one, false), x.clone(), &inp, &ctx)
                    .unwrap();
                y.data()
                    .iter()
                    .zip(r.data())
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum()
            };
            let inp = T5LayerInputs {
                shape: s,
                bias: &bias,
                self_lens: &self_lens,
                memory: (stack == T5Stack::Decoder).then_some((&mem, &enc_lens[..], te)),
            };
            let mut grads = Grads::zeros_like(&params);
            let mut one = serial_group();
            let mut tp = Tp::new(&mut one, false);
            let (_, saved) = layer
                .forward(&params, &mut tp, x.clone(), &inp, &ctx)
                .unwrap();
            let g = layer
                .backward(&params, &mut grads, &mut tp, saved, r.clone(), &inp, &ctx)
                .unwrap();
            let eps = 1e-2f32;
            let mut checked = 0;
            let mut check = |fd: f64, an: f64, what: &str| {
                assert!(
                    (fd - an).abs() <= 2e-3 + 4e-2 * an.abs(),
                    "{stack:?} p {dropout} {what}: {fd} vs {an}"
                );
                checked += 1;
            };
            for meta in params.metas.clone() {
                for k in 0..3 {
                    let i = meta.offset + (meta.numel * (2 * k + 1)) / 6;
                    let mut p2 = Params {
                        data: params.data.clone(),
                        ..params.clone()
                    };
                    p2.data[i] += eps;
                    let fp = loss(&p2, &x, &mem);
                    p2.data[i] -= 2.0 * eps;
                    let fm = loss(&p2, &x, &mem);
                    check(
                        (fp - fm) / (2.0 * eps as f64),
                        grads.data[i] as f64,
                        &meta.name,
                    );
                }
            }
            let mut x2 = x.clone();
            for i in (0..x.data().len()).step_by(5) {
                let o = x2.data()[i];
                x2.data_mut()[i] = o + eps;
                let fp = loss(&params, &x2, &mem);
                x2.data_mut()[i] = o - eps;
                let fm = loss(&params, &x2, &mem);
                x2.data_mut()[i] = o;
                check((fp - fm) / (2.0 * eps as f64), g.dx.data()[i] as f64, "x");
            }
            if let Some(dm) = &g.dmemory {
                for i in (0..mem.data().len()).step_by(5) {
                    let o = mem.data()[i];
                    mem.data_mut()[i] = o + eps;
                    let fp = loss(&params, &x, &mem);
                    mem.data_mut()[i] = o - eps;
                    let fm = loss(&params, &x, &mem);
                    mem.data_mut()[i] = o;
                    check(
                        (fp - fm) / (2.0 * eps as f64),
                        dm.data()[i] as f64,
                        "memory",
                    );
                }
            }
            assert_eq!(g.dbias.len(), bias.len());
            assert!(
                g.dbias.iter().any(|v| v.abs() > 1e-4),
                "the bias gets a gradient"
            );
            assert!(checked >= 30, "{stack:?}: {checked}");
        }
    }
}

mod whole_model {
    use megatron_core::models::t5::{T5Batch, T5Config, T5Model, T5Stacks};
    use megatron_core::params::{Grads, Params};
    use megatron_core::tensor_parallel::{serial_group, Tp};
    use megatron_core::transformer::config::Activation;
    use megatron_core::transformer::config::Normalization;
    use megatron_core::transformer::step::StepContext;
    use megatron_core::TransformerConfig;
    use megatron_tensor::cpu::IGNORE_INDEX;

    fn config(dropout: f32) -> T5Config {
        config_with(dropout, Activation::Gelu)
    }

    fn config_with(dropout: f32, activation: Activation) -> T5Config {
        T5Config {
            transformer: TransformerConfig {
                num_layers: 2,
                hidden_size: 8,
                num_attention_heads: 4,
                ffn_hidden_size: 12,
                padded_vocab_size: 24,
                normalization: Normalization::RMSNorm,
                layernorm_epsilon: 1e-6,
                add_bias_linear: false,
                add_qkv_bias: false,
                hidden_dropout: dropout,
                attention_dropout: dropout,
                init_method_std: 0.5,
                activation,
                ..Default::default()
            },
            stacks: T5Stacks {
                encoder_layers: 2,
                decoder_layers: 2,
                relative_buckets: 8,
                relative_max_distance: 12,
                softmax_scale: 1.0,
                scale_decoder_outputs: true,
            },
        }
    }

    struct Data {
        enc: Vec<u32>,
        dec: Vec<u32>,
        labels: Vec<u32>,
        mask: Vec<f32>,
    }

    const B: usize = 2;
    const TE: usize = 7;
    const TD: usize = 5;

    fn data() -> Data {
        let labels: Vec<u32> = (0..B * TD)
            .map(|i| {
                if i == 9 {
                    IGNORE_INDEX
                } else {
                    ((i * 5 + 3) % 24) as u32
                }
            })
            .collect();
        Data {
            enc: (0..B * TE).map(|i| ((i * 7 + 1) % 24) as u32).collect(),
            dec: (0..B * TD).map(|i| ((i * 11 + 2) % 24) as u32).collect(),
            mask: labels
                .iter()
                .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
                .collect(),
            labels,
        }
    }

    fn batch(d: &Data) -> T5Batch<'_> {
        T5Batch {
            enc_tokens: &d.enc,
            dec_tokens: &d.dec,
            labels: &d.labels,
            loss_mask: &d.mask,
            enc_lens: &[TE, TE - 3],
            dec_lens: &[TD, TD - 1],
            b: B,
            te: TE,
            td: TD,
        }
    }

    fn loss(m: &T5Model, params: &Params, tp: &mut Tp, ctx: &StepContext) -> f32 {
        let d = data();
        m.forward(params, None, tp, &batch(&d), 1.0, ctx)
            .unwrap()
            .loss()
    }

    fn grads_of(m: &T5Model, params: &Params, tp: &mut Tp, ctx: &StepContext) -> (f32, Grads) {
        let d = data();
        let mut g = Grads::zeros_like(params);
        let st = m
            .forward(params, Some(&mut g), tp, &batch(&d), 1.0, ctx)
            .unwrap();
        let l = st.loss();
        m.backward(params, &mut g, tp, st, &batch(&d), ctx).unwrap();
        (l, g)
    }

    #[test]
    fn whole_t5_gradients_match_finite_difference() {
        for dropout in [0.0, 0.1] {
            let (m, mut params) = T5Model::new_tp(config(dropout), 3, 0, 1);
            let ctx = if dropout > 0.0 {
                StepContext::train(5, 1, 0)
            } else {
                StepContext::eval()
            };
            let mut one = serial_group();
            let mut tp = Tp::new(&mut one, false);
            let (l, g) = grads_of(&m, &params, &mut tp, &ctx);
            assert!(
                (l - (24f32).ln()).abs() < 1.5,
                "an untrained T5 is near ln(vocab): {l}"
            );
            let eps = 1e-2f32;
            let mut checked = 0;
            for meta in params.metas.clone() {
                for k in 0..3 {
                    let i = meta.offset + (meta.numel * (2 * k + 1)) / 6;
                    let o = params.data[i];
                    params.data[i] = o + eps;
                    let fp = loss(&m, &params, &mut tp, &ctx) as f64;
                    params.data[i] = o - eps;
                    let fm = loss(&m, &params, &mut tp, &ctx) as f64;
                    params.data[i] = o;
                    let (fd, an) = ((fp - fm) / (2.0 * eps as f64), g.data[i] as f64);
                    assert!(
                        (fd - an).abs() <= 2e-3 + 5e-2 * an.abs(),
                        "p {dropout} {}[{}]: {fd} vs {an}",
                        meta.name,
                        i - meta.offset
                    );
                    checked += 1;
                }
            }
            assert!(checked >= 3 * 30, "{checked}");
            for name in [
                "encoder.relative_pos_emb.relative_attention_bias.weight",
                "decoder.relative_pos_emb.relative_attention_bias.weight",
                "decoder.layers.1.cross_attention.linear_kv.weight",
            ] {
                let id = params.find(name).unwrap();
                assert!(
                    g.get(id).iter().any(|v| v.abs() > 1e-4),
                    "{name} has a gradient"
                );
            }
        }
    }

    /// TP 2 without and with sequence parallelism (the residual stream, norms and dropout on
    /// each rank's block of rows; the norms' gradients then summed over TP).
    #[test]
    fn whole_t5_at_tensor_parallel_2_with_and_without_sp_matches_one_rank() {
        for sp in [false, true] {
            whole_t5_at_tensor_parallel_2_matches_one_rank(sp);
        }
    }

    fn whole_t5_at_tensor_parallel_2_matches_one_rank(sp: bool) {
        let go = |rank: usize, size: usize, tp: &mut Tp| {
            let (m, params) = T5Model::new_tp(config(0.1), 3, rank, size);
            let ctx = StepContext::train(5, 1, 0);
            let (l, mut g) = grads_of(&m, &params, tp, &ctx);
            megatron_core::tensor_parallel::allreduce_sequence_parallel_grads(&params, &mut g, tp)
                .unwrap();
            let pick = |n: &str| g.get(params.find(n).unwrap()).to_vec();
            (
                l,
                pick("encoder.layers.0.input_layernorm.weight"),
                pick("decoder.final_layernorm.weight"),
                pick("embedding.word_embeddings.weight"),
                pick("decoder.relative_pos_emb.relative_attention_bias.weight"),
            )
        };
        let mut s = serial_group();
        let one = go(0, 1, &mut Tp::new(&mut s, false));
        let out = megatron_comm::run_ranks(2, move |r, c| go(r, 2, &mut Tp::new(c, sp)));
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        for (rank, r) in out.into_iter().enumerate() {
            let r = r.unwrap();
            assert!(
                (r.0 - one.0).abs() < 1e-5 * one.0,
                "sp {sp} rank {rank}: {} vs {}",
                r.0,
                one.0
            );
            assert!(close(&r.1, &one.1), "sp {sp} rank {rank}: encoder norm");
            assert!(close(&r.2, &one.2), "sp {sp} rank {rank}: decoder norm");
            let per = r.3.len();
            assert!(
                close(&r.3, &one.3[rank * per..(rank + 1) * per]),
                "rank {rank}: embedding rows"
            );
            // The bias table is split by heads (columns of [buckets, heads]).
            let heads = 4;
            let local = heads / 2;
            for (bucket, row) in r.4.chunks(local).enumerate() {
                let want =
                    &one.4[bucket * heads + rank * local..bucket * heads + (rank + 1) * local];
                assert!(close(row, want), "rank {rank}: bias bucket {bucket}");
            }
        }
    }

    /// Megatron's encoder/decoder stage split: every stage's gradients, summed over the copies
    /// of the tied parameters (what the pipeline group's all-reduce does), equal one rank's,
    /// for 1 + 1, 1 + 2 and 2 + 1 encoder + decoder stages, dropout on, 3 micro-batches.
    #[test]
    fn t5_encoder_decoder_pipeline_split_matches_one_rank() {
        use megatron_core::models::ModelChunk;
        use megatron_core::pipeline_parallel::executor::Stage;
        use megatron_core::pipeline_parallel::partition::{EncoderStages, StagePartition};
        use megatron_core::pipeline_parallel::timers::Timers;
        use megatron_core::pipeline_parallel::{build_stage, schedule};
        let cfg = config(0.1);
        let m: usize = 3;
        let ctxs: Vec<StepContext> = (0..m as u64)
            .map(|mb| StepContext::train(7, 1, mb))
            .collect();
        let (model, params) = T5Model::new_tp(cfg.clone(), 3, 0, 1);
        let mut grads = Grads::zeros_like(&params);
        let mut one = serial_group();
        let d = data();
        let mut want_losses = Vec::new();
        for ctx in &ctxs {
            let mut tp = Tp::new(&mut one, false);
            let st = model
                .forward(&params, Some(&mut grads), &mut tp, &batch(&d), 0.5, ctx)
                .unwrap();
            want_losses.push(st.loss());
            model
                .backward(&params, &mut grads, &mut tp, st, &batch(&d), ctx)
                .unwrap();
        }
        for (p, split, copies) in [(2, 1, 1), (3, 1, 3), (3, 2, 2)] {
            let cfg = cfg.clone();
            let ctxs = ctxs.clone();
            let out = megatron_comm::run_ranks(p, move |rank, c| {
                let part = StagePartition {
                    num_layers: 4,
                    p,
                    v: 1,
                    first: None,
                    last: None,
                    encoder: Some(EncoderStages {
                        layers: 2,
                        stages: split,
                    }),
                    ..Default::default()
                };
                part.check().unwrap();
                let mut params = Params::for_tp_rank(0, 1);
                let mut inits = Vec::new();
                let (chunks, _) = build_stage(&cfg, &part, rank, &mut params, &mut inits);
                params.initialize(3, &inits);
                let tied = chunks[0].pipeline_tied();
                let mut grads = Grads::zeros_like(&params);
                let d = data();
                let bs: Vec<T5Batch> = (0..m).map(|_| batch(&d)).collect();
                let ops = schedule(p, rank, m, 1).unwrap();
                let mut one = serial_group();
                let mut tp = Tp::new(&mut one, false);
                let mut timers = Timers::new(std::time::Instant::now(), false);
                let run = Stage {
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
                let named = params
                    .metas
                    .iter()
                    .map(|meta| {
                        (
                            meta.name.clone(),
                            meta.shared,
                            grads.data[meta.offset..meta.offset + meta.numel].to_vec(),
                        )
                    })
                    .collect::<Vec<_>>();
                (
                    run.losses,
                    tied.len(),
                    tied.iter().map(|t| t.numel).collect::<Vec<_>>(),
                    named,
                )
            });
            let mut summed: std::collections::BTreeMap<String, Vec<f32>> = Default::default();
            let mut shared = 0;
            let mut numels = None;
            for (rank, r) in out.into_iter().enumerate() {
                let (losses, tied, n, named) = r.unwrap();
                assert_eq!(tied, 3, "p {p}: the embedding and both biases are tied");
                // Every stage lists the same sizes, so the all-reduces pair up.
                assert_eq!(*numels.get_or_insert(n.clone()), n, "p {p} rank {rank}");
                if rank == p - 1 {
                    let got: Vec<f32> = losses.iter().map(|l| l.0).collect();
                    assert_eq!(got.len(), m);
                    for (a, b) in got.iter().zip(&want_losses) {
                        assert!((a - b).abs() <= 1e-5 * b, "p {p}: loss {a} vs {b}");
                    }
                } else {
                    assert!(losses.is_empty(), "p {p}: only the last stage has losses");
                }
                for (name, sh, g) in named {
                    shared += usize::from(sh);
                    let acc = summed.entry(name).or_insert_with(|| vec![0.0; g.len()]);
                    acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                }
            }
            assert_eq!(
                shared, copies,
                "p {p} split {split}: copies of tied parameters"
            );
            assert_eq!(
                summed.len(),
                params.metas.len(),
                "p {p}: every parameter somewhere"
            );
            for (name, g) in summed {
                let want = grads.get(params.find(&name).unwrap());
                let err = g
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                let scale = want.iter().fold(0.0f32, |a, b| a.max(b.abs()));
                assert!(
                    scale > 0.0 && err <= 1e-5 * scale.max(1.0),
                    "p {p} split {split} {name}: {err}"
                );
            }
        }
    }

    /// Each decoding step's logits from the cache (encoder once, keys and values kept) equal
    /// the last row of the whole decoder run over the prefix, for two sequences of different
    /// encoder lengths.
    #[test]
    fn t5_cached_decoding_matches_recomputing_the_prefix() {
        let (m, params) = T5Model::new_tp(config(0.1), 3, 0, 1);
        let mut one = serial_group();
        let mut tp = Tp::new(&mut one, false);
        let d = data();
        let enc_lens = [TE, TE - 3];
        let steps = 6;
        let mut cache = m
            .start_decoding(&params, &mut tp, &d.enc, &enc_lens, steps)
            .unwrap();
        let mut prefix: Vec<Vec<u32>> = vec![vec![0], vec![5]];
        for step in 0..steps {
            let last: Vec<u32> = prefix.iter().map(|p| *p.last().unwrap()).collect();
            let got = m.decode_step(&params, &mut tp, &mut cache, &last).unwrap();
            let td = step + 1;
            let dec: Vec<u32> = prefix.iter().flatten().copied().collect();
            let labels = vec![IGNORE_INDEX; B * td];
            let mask = vec![0.0f32; B * td];
            let batch = T5Batch {
                enc_tokens: &d.enc,
                dec_tokens: &dec,
                labels: &labels,
                loss_mask: &mask,
                enc_lens: &enc_lens,
                dec_lens: &[td, td],
                b: B,
                te: TE,
                td,
            };
            let want = m.logits(&params, &mut tp, &batch).unwrap();
            let v = want.shape()[1];
            for s in 0..B {
                let w = &want.data()[(s * td + td - 1) * v..(s * td + td) * v];
                let g = &got.data()[s * v..(s + 1) * v];
                let err = w
                    .iter()
                    .zip(g)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-5, "step {step} sequence {s}: {err}");
            }
            for (s, p) in prefix.iter_mut().enumerate() {
                p.push(((step * 7 + s * 3 + 1) % 24) as u32);
            }
        }
    }

    /// The original T5's ReLU and T5 v1.1's gated GELU: gradients match finite differences
    /// (inputs of the ReLU away from its kink) and TP 2 + SP matches one rank.
    #[test]
    fn t5_relu_and_gated_gelu_mlps_match_finite_difference_and_tensor_parallel_2() {
        for act in [Activation::Relu, Activation::GeGLU] {
            let (m, mut params) = T5Model::new_tp(config_with(0.0, act), 3, 0, 1);
            let ctx = StepContext::eval();
            let mut one = serial_group();
            let mut tp = Tp::new(&mut one, false);
            let (_, g) = grads_of(&m, &params, &mut tp, &ctx);
            let eps = 1e-3f32;
            let mut checked = 0;
            for meta in params.metas.clone() {
                if !meta.name.contains("mlp") {
                    continue;
                }
                for k in 0..4 {
                    let i = meta.offset + (meta.numel * (2 * k + 1)) / 8;
                    let o = params.data[i];
                    params.data[i] = o + eps;
                    let fp = loss(&m, &params, &mut tp, &ctx) as f64;
                    params.data[i] = o - eps;
                    let fm = loss(&m, &params, &mut tp, &ctx) as f64;
                    params.data[i] = o;
                    let (fd, an) = ((fp - fm) / (2.0 * eps as f64), g.data[i] as f64);
                    assert!(
                        (fd - an).abs() <= 3e-3 + 5e-2 * an.abs(),
                        "{act:?} {}[{}]: {fd} vs {an}",
                        meta.name,
                        i - meta.offset
                    );
                    checked += 1;
                }
            }
            assert!(checked >= 4 * 8, "{act:?}: {checked}");
            let fc1 = params
                .find("decoder.layers.1.mlp.linear_fc1.weight")
                .unwrap();
            let rows = params.metas[fc1.0].shape[0];
            assert_eq!(
                rows,
                if act == Activation::GeGLU { 24 } else { 12 },
                "{act:?} fc1"
            );
            let go = move |rank: usize, size: usize, tp: &mut Tp| {
                let (m, params) = T5Model::new_tp(config_with(0.1, act), 3, rank, size);
                let ctx = StepContext::train(5, 1, 0);
                let (l, mut g) = grads_of(&m, &params, tp, &ctx);
                megatron_core::tensor_parallel::allreduce_sequence_parallel_grads(
                    &params, &mut g, tp,
                )
                .unwrap();
                let n = "encoder.layers.0.pre_mlp_layernorm.weight";
                (l, g.get(params.find(n).unwrap()).to_vec())
            };
            let mut s = serial_group();
            let want = go(0, 1, &mut Tp::new(&mut s, false));
            for r in megatron_comm::run_ranks(2, move |r, c| go(r, 2, &mut Tp::new(c, true))) {
                let r = r.unwrap();
                assert!((r.0 - want.0).abs() < 1e-5 * want.0, "{act:?} loss");
                let err =
                    r.1.iter()
                        .zip(&want.1)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                assert!(err < 1e-5, "{act:?} norm gradient {err}");
            }
        }
    }
}
