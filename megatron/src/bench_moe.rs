//! `megatron bench moe`: one mixture-of-experts layer (forward + backward of `--tokens` rows)
//! against a dense SwiGLU MLP with the same active parameters (FFN width `topk x moe_ffn`),
//! the experts' GEMMs one after the other against grouped, and expert parallelism 2 against 1
//! on two rank threads (each rank its own tokens, as data-parallel replicas; EP 2 splits the
//! experts and dispatches rows with all-to-all or all-gather). Runs alternate within each
//! repeat; medians are printed.

use crate::bench::BenchArgs;
use megatron_comm::run_ranks;
use megatron_core::params::{ExpertLayout, Grads, Params};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::config::{
    Activation, MoEConfig, TokenDispatcherType, TransformerConfig,
};
use megatron_core::transformer::mlp::MLP;
use megatron_core::transformer::moe::{MoELayer, TokenRows};
use megatron_core::transformer::step::StepContext;
use megatron_tensor::Tensor;
use std::time::Instant;

fn config(a: &BenchArgs, grouped: bool, dispatcher: TokenDispatcherType) -> TransformerConfig {
    TransformerConfig {
        num_layers: 1,
        hidden_size: a.hidden,
        num_attention_heads: 1,
        ffn_hidden_size: a.topk * a.moe_ffn,
        seq_length: a.tokens,
        max_position_embeddings: a.tokens,
        padded_vocab_size: 64,
        activation: Activation::SwiGLU,
        add_bias_linear: false,
        moe: Some(MoEConfig {
            dispatcher,
            grouped_gemm: grouped,
            ..MoEConfig::new(a.experts, a.moe_ffn, a.topk)
        }),
        ..Default::default()
    }
}

fn input(n: usize, h: usize, seed: usize) -> Tensor {
    let mut x = Tensor::for_overwrite(&[n, h]);
    for (i, v) in x.data_mut().iter_mut().enumerate() {
        *v = (((i * 7919 + seed * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0;
    }
    x
}

/// An MoE layer of `cfg` for expert-parallel rank `ep_rank` of `ep`, initialized.
fn moe_layer(cfg: &TransformerConfig, ep: usize, ep_rank: usize) -> (MoELayer, Params) {
    let mut params = Params {
        experts: ExpertLayout {
            ep,
            ep_rank,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut inits = Vec::new();
    let m = MoELayer::new(cfg, 0, "decoder.layers.0", &mut params, &mut inits);
    params.initialize(1, &inits);
    (m, params)
}

/// Seconds of one forward + backward of the MoE layer.
fn moe_step(m: &MoELayer, params: &Params, grads: &mut Grads, tp: &mut Tp, x: &Tensor) -> f64 {
    let ctx = StepContext::train(1, 0, 0);
    let rows = TokenRows {
        first: 0,
        seq_length: x.shape()[0],
    };
    let s = Instant::now();
    let (y, saved) = m.forward(params, tp, x, rows, &ctx).expect("collectives");
    let dx = m
        .backward(params, grads, tp, &saved, x, &y, &ctx)
        .expect("collectives");
    drop((dx, saved, y));
    s.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn moe(a: &BenchArgs) -> anyhow::Result<()> {
    let (n, h) = (a.tokens, a.hidden);
    let threads = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    megatron_tensor::threads::set_gemm_threads(threads);
    println!(
        "MoE layer: {n} tokens, hidden {h}, {} experts of FFN {} (SwiGLU), top-{}; dense MLP of FFN {} (same active parameters); {threads} threads, {} repeats (medians)",
        a.experts,
        a.moe_ffn,
        a.topk,
        a.topk * a.moe_ffn,
        a.repeats
    );
    // One rank: dense MLP, MoE sequential, MoE grouped, alternating.
    let x = input(n, h, 1);
    let dense_cfg = config(a, false, TokenDispatcherType::AllToAll);
    let mut dparams = Params::default();
    let mut inits = Vec::new();
    let mlp = MLP::new(&dense_cfg, 0, &mut dparams, &mut inits);
    dparams.initialize(1, &inits);
    let mut dgrads = Grads::zeros_like(&dparams);
    let (seq, sparams) = moe_layer(&config(a, false, TokenDispatcherType::AllToAll), 1, 0);
    let (grp, gparams) = moe_layer(&config(a, true, TokenDispatcherType::AllToAll), 1, 0);
    let (mut sgrads, mut ggrads) = (Grads::zeros_like(&sparams), Grads::zeros_like(&gparams));
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    let (mut td, mut ts, mut tg) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..=a.repeats {
        let s = Instant::now();
        let (y, saved) = mlp
            .forward(&dparams, &mut tp, &x, &StepContext::train(1, 0, 0))
            .expect("serial");
        let dy = Tensor::from_vec(y.shape(), y.data().to_vec()).expect("shape");
        let dx = mlp
            .backward(&dparams, &mut dgrads, &mut tp, &saved, &x, dy)
            .expect("serial");
        drop((dx, y));
        let d = s.elapsed().as_secs_f64();
        let sq = moe_step(&seq, &sparams, &mut sgrads, &mut tp, &x);
        let gr = moe_step(&grp, &gparams, &mut ggrads, &mut tp, &x);
        if r > 0 {
            td.push(d);
            ts.push(sq);
            tg.push(gr);
        }
    }
    let tok = |t: f64| n as f64 / t;
    println!("| layer (forward + backward) | ms | tokens/s |");
    println!("|---|---:|---:|");
    for (name, t) in [
        ("dense MLP, same active parameters", median(td)),
        ("MoE, experts' GEMMs one after the other", median(ts)),
        ("MoE, grouped expert GEMM", median(tg)),
    ] {
        println!("| {name} | {:.1} | {:.0} |", t * 1e3, tok(t));
    }
    // Two rank threads, each with its own tokens: EP 1 (every rank all experts) against EP 2.
    let per_rank = (threads / 2).max(1);
    println!("\nTwo rank threads ({per_rank} thread(s) each), {n} tokens per rank:");
    println!("| experts | ms per step (slowest rank) | tokens/s (both ranks) | bytes moved per step | MoE parameters per rank |");
    println!("|---|---:|---:|---:|---:|");
    for (name, ep, kind) in [
        (
            "EP 1 (all experts on each rank)",
            1,
            TokenDispatcherType::AllToAll,
        ),
        (
            "EP 2, all-to-all dispatcher",
            2,
            TokenDispatcherType::AllToAll,
        ),
        (
            "EP 2, all-gather dispatcher",
            2,
            TokenDispatcherType::AllGather,
        ),
    ] {
        let cfg = config(a, false, kind);
        let repeats = a.repeats;
        let res = run_ranks(2, move |rank, c| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(per_rank)
                .build()
                .expect("rank pool");
            pool.install(|| {
                megatron_tensor::threads::set_gemm_threads(per_rank);
                let (m, params) = moe_layer(&cfg, ep, if ep > 1 { rank } else { 0 });
                let mut grads = Grads::zeros_like(&params);
                let x = input(n, h, 2 + rank);
                let (mut serial, mut etp) = (serial_group(), serial_group());
                let mut tp = if ep > 1 {
                    Tp::new(&mut serial, false).with_expert_parallel(c, &mut etp)
                } else {
                    Tp::new(&mut serial, false)
                };
                let mut times = Vec::new();
                for r in 0..=repeats {
                    let t = moe_step(&m, &params, &mut grads, &mut tp, &x);
                    if r > 0 {
                        times.push(t);
                    }
                }
                let bytes: u64 = tp
                    .ep
                    .as_ref()
                    .map_or(0, |c| c.stats().bytes.values().sum::<u64>());
                (times, bytes / (repeats as u64 + 1), params.numel() * 4)
            })
        });
        let rows: Vec<_> = res.into_iter().map(|r| r.expect("rank ok")).collect();
        let per_step: Vec<f64> = (0..a.repeats)
            .map(|i| rows.iter().map(|r| r.0[i]).fold(0.0, f64::max))
            .collect();
        let t = median(per_step);
        println!(
            "| {name} | {:.1} | {:.0} | {:.1} MB | {:.1} MiB |",
            t * 1e3,
            2.0 * n as f64 / t,
            rows[0].1 as f64 / 1e6,
            rows[0].2 as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
