//! `megatron bench gemm`: GFLOP/s of the engine's matmul on the three GEMMs of a transformer
//! linear layer (forward, input gradient, weight gradient), median of repeated calls.

use clap::Args;
use megatron_tensor::cpu::{matmul_with_threads, MatmulDims};
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// `gemm` (the three GEMMs of a linear layer), `peak` (the FMA-loop peak), `kernels` (every kernel of one GPT layer
    /// at --tokens x --hidden with --seq-length and --heads, plus the output layer at --vocab), `comm` (all-reduce bus
    /// bandwidth), `index` (GPTDataset index build), `tp` (a GPT micro-batch at each --ranks tensor-parallel size) or `pipeline`
    /// (the bubble of 1F1B and interleaved schedules at P = the first of --ranks, M = 4..32), `moe` (an MoE layer against
    /// a dense MLP of the same active parameters, sequential against grouped expert GEMMs, and expert parallelism 2
    /// against 1 on two rank threads), `cp` (a Llama-style model at --seq-length with context parallelism 1 and each
    /// of --ranks, ring and all-to-all attention) or `prior` (tables/s of the synthetic-table prior with 1 and each of
    /// --ranks worker threads, --num-samples tables per run) or `attention` (causal attention forward/backward on the f32
    /// kernel and on the packed bf16 kernel: AMX tiles, else the dot-product instruction; alternated) or `muon` (Muon's
    /// Newton-Schulz iteration on one GPT layer's matrices at --hidden/--ffn, f32 and bf16 products, beside the GEMM rate,
    /// and its seconds per optimizer step for --layers layers).
    #[arg(default_value = "gemm")]
    pub what: String,
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    #[arg(long, default_value_t = 768)]
    pub hidden: usize,
    #[arg(long, default_value_t = 3072)]
    pub ffn: usize,
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
    #[arg(long)]
    pub threads: Option<usize>,
    /// GEMM implementation for `bench gemm`: `gemm` (the engine's matmul), `gemm-crate` (the
    /// `gemm` crate, the portable fallback), `versus` (engine and crate alternating call by
    /// call), `matrixmultiply` (for comparison; threads through MATMUL_NUM_THREADS), `bf16`
    /// (the engine's bf16-operand GEMM on the dot-product instruction), `amx` (on AMX tiles) or
    /// `bf16-versus` (AMX, dot-product and rounded-operand f32 kernels alternating call by call).
    #[arg(long, default_value = "gemm")]
    pub gemm_impl: String,
    #[arg(long, default_value_t = 512)]
    pub seq_length: usize,
    #[arg(long, default_value_t = 12)]
    pub heads: usize,
    #[arg(long, default_value_t = 50304)]
    pub vocab: usize,
    /// For `bench index`: the dataset prefix and the number of samples to index.
    #[arg(long)]
    pub data_path: Option<String>,
    #[arg(long, default_value_t = 10_000_000)]
    pub num_samples: u64,
    /// For `bench kernels`: tokens per logits tile of the fused output layer.
    #[arg(long, default_value_t = 256)]
    pub chunk_rows: usize,
    /// For `bench kernels`: matmuls, attention and the output layer on bf16 operands, on the
    /// bf16 kernel `train --bf16` picks here (`--bf16-matmul-kernel auto`).
    #[arg(long)]
    pub bf16: bool,
    /// For `bench kernels --bf16`: MiB of bf16 output-layer gradients kept per gradient chunk
    /// (the engine's default 64; smaller chunks read and write the weight gradient more often).
    #[arg(long)]
    pub grad_chunk_mib: Option<usize>,
    /// For `bench comm`: rank counts to measure; for `bench tp`: tensor-parallel sizes.
    #[arg(long, num_args = 1.., default_values_t = vec![2usize, 4, 8])]
    pub ranks: Vec<usize>,
    /// For `bench tp`: transformer layers and sequences per micro-batch.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 1)]
    pub micro_batch: usize,
    /// For `bench moe`: experts, experts per token, and each expert's FFN width.
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    #[arg(long, default_value_t = 2)]
    pub topk: usize,
    #[arg(long, default_value_t = 512)]
    pub moe_ffn: usize,
}

use megatron_training::machine_probes::time_median;

fn kernels(a: &BenchArgs) -> anyhow::Result<()> {
    use megatron_tensor::cpu::layernorm::LayerNormDims;
    use megatron_tensor::cpu::*;
    use megatron_tensor::RngKey;
    let threads = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    pool.install(|| {
        megatron_tensor::threads::set_gemm_threads(threads);
        if a.bf16 {
            use megatron_tensor::cpu::matmul::{set_bf16_kernel, set_matmul_precision};
            set_matmul_precision(megatron_tensor::cpu::matmul::MatmulPrecision::BF16);
            set_bf16_kernel(megatron_tensor::cpu::fastest_bf16_kernel());
        }
        if let Some(mib) = a.grad_chunk_mib {
            megatron_tensor::cpu::cross_entropy::set_classifier_gradient_chunk_bytes(mib << 20);
        }
        let (n, h, f, t, v) = (a.tokens, a.hidden, a.ffn, a.seq_length, a.vocab);
        let b = n / t;
        let r = a.repeats;
        let x = vec![0.01f32; n * h];
        let mut y = vec![0.0f32; n * h];
        let w = vec![0.01f32; f * h];
        let mut big = vec![0.0f32; n * f];
        let big2 = vec![0.01f32; n * f];
        let bias = vec![0.0f32; f];
        let mut total = 0.0;
        let mut report = |name: &str, secs: f64| {
            total += secs;
            println!("{name:<34} {:>9.2} ms", secs * 1e3);
        };
        report(
            "matmul fwd  [N,h]x[f,h]^T",
            time_median(r, || {
                matmul_forward(&mut big, &x, matmul::Operand::F32(&w), None, n, h, f)
            }),
        );
        let mut dw = vec![0.0f32; f * h];
        report(
            "matmul wgrad [N,f]^T[N,h]",
            time_median(r, || {
                matmul(&mut dw, &big2, &x, MatmulDims::new(f, h, n).ta().acc())
            }),
        );
        report(
            "matmul dgrad [N,f]x[f,h]",
            time_median(r, || matmul(&mut y, &big2, &w, MatmulDims::new(n, h, f))),
        );
        report(
            "bias_gelu_forward [N,f]",
            time_median(r, || {
                bias_gelu_forward(&mut big, &big2, &bias, GeluApprox::Tanh)
            }),
        );
        report(
            "bias_gelu_backward [N,f]",
            time_median(r, || {
                bias_gelu_backward(&mut big, &big2, &big2, &bias, GeluApprox::Tanh)
            }),
        );
        let mut mean = vec![0.0f32; n];
        let mut rstd = vec![0.0f32; n];
        let ones = vec![1.0f32; h];
        let zeros = vec![0.0f32; h];
        let d = LayerNormDims {
            rows: n,
            cols: h,
            eps: 1e-5,
        };
        report(
            "layernorm_forward [N,h]",
            time_median(r, || {
                layernorm_forward(&mut y, &mut mean, &mut rstd, &x, &ones, &zeros, d)
            }),
        );
        let (mut dwl, mut dbl) = (vec![0.0f32; h], vec![0.0f32; h]);
        let mut dx = vec![0.0f32; n * h];
        report(
            "layernorm_backward [N,h]",
            time_median(r, || {
                layernorm_backward(&mut dx, &mut dwl, &mut dbl, &y, &x, &ones, &mean, &rstd, d)
            }),
        );
        let rd = megatron_tensor::cpu::RMSNormDims {
            rows: n,
            cols: h,
            eps: 1e-5,
        };
        report(
            "rmsnorm_forward [N,h]",
            time_median(r, || {
                megatron_tensor::cpu::rmsnorm_forward(&mut y, &mut rstd, &x, &ones, rd)
            }),
        );
        report(
            "rmsnorm_backward [N,h]",
            time_median(r, || {
                megatron_tensor::cpu::rmsnorm_backward(&mut dx, &mut dwl, &y, &x, &ones, &rstd, rd)
            }),
        );
        // SwiGLU reads [N, 2 * f/2] (gate | up) and writes [N, f/2]: the same fc1 width as GELU.
        let half_f = f / 2;
        let mut act = vec![0.0f32; n * half_f];
        report(
            "swiglu_forward [N,f]->[N,f/2]",
            time_median(r, || {
                megatron_tensor::cpu::swiglu_forward(&mut act, &big2, half_f)
            }),
        );
        report(
            "swiglu_backward [N,f/2]->[N,f]",
            time_median(r, || {
                megatron_tensor::cpu::swiglu_backward(&mut big, &act, &big2, half_f)
            }),
        );
        {
            let hd = h / a.heads;
            let table = megatron_tensor::cpu::RopeTable::new(hd, 10000.0, t, None);
            let rope = megatron_tensor::cpu::RopeDims {
                t,
                groups: a.heads,
                q_per_group: 1,
                head_dim: hd,
                first_pos: 0,
                style: megatron_tensor::cpu::RopeStyle::RotateHalf,
            };
            let mut q = vec![0.01f32; n * 3 * h];
            report(
                "rope_forward (q and k of [N,3h])",
                time_median(r, || {
                    megatron_tensor::cpu::rope_forward(&mut q, &table, rope)
                }),
            );
        }
        let mut res = vec![0.0f32; n * h];
        report(
            "bias_dropout_add_forward [N,h]",
            time_median(r, || {
                bias_dropout_add_forward(&mut res, &x, &zeros, &y, 0.0, RngKey::new(1))
            }),
        );
        let qkv = vec![0.01f32; n * 3 * h];
        let mut dqkv = vec![0.0f32; n * 3 * h];
        let mut lse = vec![0.0f32; b * a.heads * t];
        let ad = AttentionDims {
            b,
            t,
            heads: a.heads,
            groups: a.heads,
            head_dim: h / a.heads,
            causal: true,
            dropout: 0.0,
            rng_heads: (0, 0),
            rng_block: None,
        };
        report(
            "attention_forward",
            time_median(r, || {
                attention_forward(
                    &mut y,
                    &mut lse,
                    &qkv,
                    AttentionMask::NONE,
                    ad,
                    RngKey::new(1),
                )
            }),
        );
        report(
            "attention_backward",
            time_median(r, || {
                attention_backward(
                    &mut dqkv,
                    &x,
                    &y,
                    &lse,
                    &qkv,
                    AttentionMask::NONE,
                    ad,
                    RngKey::new(1),
                )
            }),
        );
        let wv = vec![0.01f32; v * h];
        // Under `--bf16` the output weight is read as a bf16 model stores it.
        let wv16 = vec![half::bf16::from_f32(0.01); if a.bf16 { v * h } else { 0 }];
        let wop = if a.bf16 {
            matmul::Operand::BF16(&wv16)
        } else {
            matmul::Operand::F32(&wv)
        };
        let mut dwv = vec![0.0f32; v * h];
        let tg: Vec<u32> = (0..n as u32).map(|i| i % v as u32).collect();
        let dl = vec![1.0f32 / n as f32; n];
        let mut losses = vec![0.0f32; n];
        let chunk = a.chunk_rows;
        let cd = ClassifierDims {
            n,
            c: h,
            v,
            chunk_rows: chunk,
        };
        report(
            "fused_classifier fwd+bwd",
            time_median(r, || {
                fused_classifier(
                    &mut losses,
                    Some((&mut dx, &mut dwv)),
                    &x,
                    wop,
                    None,
                    &tg,
                    &dl,
                    cd,
                )
            }),
        );
        println!("{:<34} {:>9.2} ms", "sum", total * 1e3);
    });
    Ok(())
}

pub fn run(a: &BenchArgs) -> anyhow::Result<()> {
    if a.what == "kernels" {
        return kernels(a);
    }
    if a.what == "comm" {
        return comm(a);
    }
    if a.what == "tp" {
        return crate::bench_tp::tp(a);
    }
    if a.what == "pipeline" {
        return crate::bench_pipeline::pipeline(a);
    }
    if a.what == "moe" {
        return crate::bench_moe::moe(a);
    }
    if a.what == "cp" {
        return crate::bench_cp::cp(a);
    }
    if a.what == "attention" {
        return crate::bench_attention::attention(a);
    }
    if a.what == "muon" {
        return crate::bench_muon::muon(a);
    }
    if a.what == "prior" {
        return crate::bench_prior::prior(a);
    }
    if a.what == "index" {
        let prefix = a
            .data_path
            .as_deref()
            .ok_or_else(|| anyhow::anyhow!("bench index needs --data-path PREFIX"))?;
        let ds = megatron_data::indexed_dataset::IndexedDataset::open(prefix)?;
        let docs: Vec<i32> = (0..ds.len() as i32).collect();
        let t = Instant::now();
        let ix = megatron_data::gpt_dataset::build_indices(
            &ds.lengths(),
            &docs,
            Some(a.num_samples),
            a.seq_length,
            1234,
            1,
            true,
        )?;
        println!(
            "GPTDataset indices for {} samples (seq {}): {:.2} s ({} epochs, {} documents per epoch)",
            a.num_samples,
            a.seq_length,
            t.elapsed().as_secs_f64(),
            ix.num_epochs,
            docs.len()
        );
        return Ok(());
    }
    if a.what == "peak" {
        let threads = a
            .threads
            .unwrap_or_else(megatron_tensor::threads::available_cores);
        let mut v: Vec<f64> = (0..a.repeats)
            .map(|_| megatron_tensor::cpu::peak::measure_peak_flops(threads))
            .collect();
        v.sort_by(f64::total_cmp);
        match megatron_tensor::cpu::matmul_amx::amx_peak_gflops(threads) {
            Some(g) => println!("AMX tile (TDPBF16PS) peak, {threads} threads: {g:.1} GFLOP/s"),
            None => println!(
                "AMX: not used ({})",
                megatron_tensor::cpu::amx::amx_unavailable_reason().unwrap_or("")
            ),
        }
        if let Some(g) = megatron_tensor::cpu::matmul_bf16::bf16_dot_peak_gflops(threads) {
            println!("bf16 dot-product (VDPBF16PS) peak, {threads} threads: {g:.1} GFLOP/s");
            let (dot, fma) = megatron_tensor::cpu::dispatch::bf16_gemm_seconds();
            let gf = |s: f64| 2.0 * 256.0 * 512.0 * 512.0 / s / 1e9;
            println!(
                "bf16 GEMM 256x512x512, 1 thread: dot-product kernel {:.1} GFLOP/s, rounded operands on the f32 GEMM {:.1} GFLOP/s; --bf16-matmul-kernel auto picks {:?}",
                gf(dot),
                gf(fma),
                megatron_tensor::cpu::fastest_bf16_kernel()
            );
        }
        println!(
            "FMA peak, {threads} threads, {} runs: median {:.1} GFLOP/s, max {:.1} GFLOP/s",
            v.len(),
            v[v.len() / 2] / 1e9,
            v[v.len() - 1] / 1e9
        );
        return Ok(());
    }
    if a.what != "gemm" {
        anyhow::bail!(
            "bench {}: expected `gemm`, `kernels`, `peak` or `index`",
            a.what
        );
    }
    let threads = a
        .threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    let (n, h, f) = (a.tokens, a.hidden, a.ffn);
    // (label, m, n, k, trans_a, trans_b): y = x W^T, dx = dy W, dW = dy^T x.
    let cases = [
        ("fwd   x[N,h]·W[f,h]^T", n, f, h, false, true),
        ("dgrad dy[N,f]·W[f,h]", n, h, f, false, false),
        ("wgrad dy[N,f]^T·x[N,h]", f, h, n, true, false),
    ];
    if a.gemm_impl == "bf16-versus" {
        return bf16_versus(a, threads, &cases);
    }
    let use_amx = a.gemm_impl == "amx";
    let (use_mm, use_bf16, use_crate) = match a.gemm_impl.as_str() {
        "gemm" | "amx" => (false, false, false),
        "gemm-crate" | "versus" => (false, false, true),
        "matrixmultiply" => (true, false, false),
        "bf16" => (false, true, false),
        other => anyhow::bail!(
            "--gemm-impl {other}: expected gemm, gemm-crate, versus, matrixmultiply, bf16, amx or bf16-versus"
        ),
    };
    if use_mm {
        // matrixmultiply reads its thread count from the environment.
        std::env::set_var("MATMUL_NUM_THREADS", threads.to_string());
    }
    let label_impl = if use_amx {
        match megatron_tensor::cpu::amx::amx_unavailable_reason() {
            None => "bf16 operands, f32 accumulation (AMX tiles)",
            Some(_) => "bf16 operands (no AMX: dot-product fallback)",
        }
    } else if use_mm {
        "matrixmultiply 0.3 (threading)"
    } else if use_bf16 {
        if megatron_tensor::cpu::matmul_bf16::bf16_gemm_available() {
            "bf16 operands, f32 accumulation (vdpbf16ps)"
        } else {
            "bf16 operands (no AVX512_BF16: f32 fallback)"
        }
    } else if a.gemm_impl == "versus" {
        if std::arch::is_x86_feature_detected!("avx512f") {
            "engine matmul vs gemm crate (its AVX-512 kernel), alternating"
        } else {
            "engine matmul vs gemm crate (its AVX2/FMA kernel), alternating"
        }
    } else if use_crate {
        if std::arch::is_x86_feature_detected!("avx512f") {
            "gemm crate (its AVX-512 kernel)"
        } else {
            "gemm crate (its AVX2/FMA kernel)"
        }
    } else {
        "engine matmul"
    };
    println!(
        "{label_impl}, {threads} threads, median of {} calls",
        a.repeats
    );
    for (label, m, nn, k, ta, tb) in cases {
        let x = vec![0.5f32; m * k];
        let w = vec![0.25f32; k * nn];
        let mut out = vec![0.0f32; m * nn];
        let mut d = MatmulDims::new(m, nn, k);
        d.trans_a = ta;
        d.trans_b = tb;
        let run = |out: &mut [f32]| {
            if use_amx {
                megatron_tensor::cpu::matmul_amx::matmul_amx_with_threads(out, &x, &w, d, threads);
            } else if use_mm {
                mm_sgemm(out, &x, &w, d);
            } else if use_bf16 {
                megatron_tensor::cpu::matmul_bf16::matmul_bf16_with_threads(
                    out, &x, &w, d, threads,
                );
            } else if use_crate {
                megatron_tensor::cpu::matmul::gemm_crate(out, &x, &w, d, threads);
            } else {
                matmul_with_threads(out, &x, &w, d, threads);
            }
        };
        if a.gemm_impl == "versus" {
            // Engine and crate alternate call by call, so both see the same neighbours.
            let engine = |out: &mut [f32]| matmul_with_threads(out, &x, &w, d, threads);
            engine(&mut out);
            run(&mut out);
            let (mut te, mut tc) = (Vec::new(), Vec::new());
            for _ in 0..a.repeats {
                let t = Instant::now();
                engine(&mut out);
                te.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                run(&mut out);
                tc.push(t.elapsed().as_secs_f64());
            }
            te.sort_by(f64::total_cmp);
            tc.sort_by(f64::total_cmp);
            let (me, mc) = (te[te.len() / 2], tc[tc.len() / 2]);
            let f = 2.0 * (m * nn * k) as f64 / 1e9;
            println!(
                "{label:<26} {m}x{nn}x{k}: engine {:.1} / gemm crate {:.1} GFLOP/s = {:.2}x",
                f / me,
                f / mc,
                mc / me
            );
            continue;
        }
        run(&mut out);
        let mut times: Vec<f64> = (0..a.repeats)
            .map(|_| {
                let t = Instant::now();
                run(&mut out);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "{label:<26} {m}x{nn}x{k}: {:.1} GFLOP/s",
            2.0 * (m * nn * k) as f64 / med / 1e9
        );
    }
    Ok(())
}

/// The three bf16 kernels on each case, alternating call by call so all see the same load:
/// AMX tiles, the dot-product instruction, and operands rounded onto the f32 GEMM (rounding
/// included, as `--bf16-matmul-kernel fma` pays it).
fn bf16_versus(
    a: &BenchArgs,
    threads: usize,
    cases: &[(&str, usize, usize, usize, bool, bool)],
) -> anyhow::Result<()> {
    use megatron_tensor::cpu::cast::Half;
    use megatron_tensor::cpu::matmul::rounded_operand;
    println!(
        "bf16 operands, f32 accumulation: AMX / dot-product / rounded f32 GEMM, alternating, {threads} threads, median of {} calls{}",
        a.repeats,
        match megatron_tensor::cpu::amx::amx_unavailable_reason() {
            None => String::new(),
            Some(why) => format!(" (AMX column runs the fallback: {why})"),
        }
    );
    let key = megatron_tensor::RngKey::new(3);
    for &(label, m, nn, k, ta, tb) in cases {
        // Random operands: constant ones would round exactly and skip the rounding copy.
        let x: Vec<f32> = (0..m * k).map(|i| key.normal(i as u64)).collect();
        let w: Vec<f32> = (0..k * nn)
            .map(|i| key.normal((m * k + i) as u64))
            .collect();
        let mut out = vec![0.0f32; m * nn];
        let mut d = MatmulDims::new(m, nn, k);
        d.trans_a = ta;
        d.trans_b = tb;
        type Kernel<'a> = &'a dyn Fn(&mut [f32]);
        let kernels: [Kernel; 3] = [
            &|o| megatron_tensor::cpu::matmul_amx::matmul_amx_with_threads(o, &x, &w, d, threads),
            &|o| megatron_tensor::cpu::matmul_bf16::matmul_bf16_with_threads(o, &x, &w, d, threads),
            &|o| {
                let xr = rounded_operand(&x, Half::BF16);
                let wr = rounded_operand(&w, Half::BF16);
                matmul_with_threads(o, &xr, &wr, d, threads)
            },
        ];
        let mut times = vec![Vec::new(); 3];
        for round in 0..=a.repeats {
            for (kernel, t) in kernels.iter().zip(times.iter_mut()) {
                let s = Instant::now();
                kernel(&mut out);
                if round > 0 {
                    t.push(s.elapsed().as_secs_f64());
                }
            }
        }
        let f = 2.0 * (m * nn * k) as f64 / 1e9;
        let gf: Vec<f64> = times
            .iter_mut()
            .map(|t| {
                t.sort_by(f64::total_cmp);
                f / t[t.len() / 2]
            })
            .collect();
        println!(
            "{label:<26} {m}x{nn}x{k}: AMX {:.1} / dot {:.1} / fma {:.1} GFLOP/s",
            gf[0], gf[1], gf[2]
        );
    }
    Ok(())
}

/// The same product through matrixmultiply's sgemm (BLAS semantics, explicit strides).
fn mm_sgemm(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims) {
    let (m, n, k) = (d.m, d.n, d.k);
    let (rsa, csa) = if d.trans_a {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (rsb, csb) = if d.trans_b {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    // SAFETY: the strides describe exactly the buffers' sizes.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Single-thread memcpy bandwidth (GB/s, read + write bytes counted once each: 2 x size / time),
/// median of `repeats` copies of 256 MiB.
fn memcpy_bandwidth(repeats: usize) -> f64 {
    let n = 64 << 20; // f32 elements = 256 MiB
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    dst.copy_from_slice(&src);
    let t = time_median(repeats, || dst.copy_from_slice(&src));
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / t / 1e9
}

/// nccl-tests' bus bandwidth of the thread backend's all-reduce: algbw x 2(n-1)/n.
///
/// Bound printed beside it: any shared-memory all-reduce that leaves the result in each of the
/// n ranks' own buffers reads n x S bytes and writes n x S, so at aggregate memory bandwidth B
/// (read + write) it takes at least 2nS/B and its bus bandwidth is at most B (n-1)/n^2.
fn comm(a: &BenchArgs) -> anyhow::Result<()> {
    #[cfg(feature = "mpi")]
    if megatron_comm::mpi_comm::launched_by_mpi() {
        return comm_mpi(a);
    }
    let mem = memcpy_bandwidth(a.repeats.max(3));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let agg =
        megatron_training::machine_probes::memcpy_bandwidth_threads(cores, a.repeats.max(3)) / 1e9;
    println!(
        "memcpy, 256 MiB: 1 thread {mem:.1} GB/s, {cores} threads {agg:.1} GB/s (read + write)"
    );
    for &p in &a.ranks {
        let bound = agg * (p - 1) as f64 / (p * p) as f64;
        println!(
            "  {p} ranks: bus-bandwidth bound of a shared-memory all-reduce B(n-1)/n^2 = {bound:.2} GB/s ({:.0} % of 1-thread memcpy counted read + write)",
            100.0 * bound / mem
        );
    }
    println!(
        "{:>6} {:>10} {:>12} {:>12} {:>14}",
        "ranks", "size", "time (ms)", "algbw GB/s", "busbw GB/s"
    );
    for &p in &a.ranks {
        for &bytes in &[
            1usize << 10,
            1 << 16,
            1 << 20,
            16 << 20,
            64 << 20,
            256 << 20,
        ] {
            let t = megatron_training::machine_probes::thread_all_reduce_seconds(
                p,
                bytes,
                a.repeats.max(3),
            )
            .map_err(anyhow::Error::msg)?;
            print_bus_row(p, bytes, t);
        }
    }
    Ok(())
}

/// The same figures for the MPI backend, one rank per process (run under `mpirun`).
#[cfg(feature = "mpi")]
fn comm_mpi(a: &BenchArgs) -> anyhow::Result<()> {
    use megatron_comm::{Communicator, ReduceOp};
    let (_universe, mut c) = megatron_comm::mpi_comm::initialize_world()
        .ok_or_else(|| anyhow::anyhow!("MPI could not be initialized"))?;
    let (rank, p) = (c.rank(), c.size());
    if rank == 0 {
        println!("MPI backend, {p} ranks (processes)");
        println!(
            "{:>6} {:>10} {:>12} {:>12} {:>14}",
            "ranks", "size", "time (ms)", "algbw GB/s", "busbw GB/s"
        );
    }
    for &bytes in &[
        1usize << 10,
        1 << 16,
        1 << 20,
        16 << 20,
        64 << 20,
        256 << 20,
    ] {
        let n = bytes / 4;
        let mut v = vec![rank as f32; n];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        let mut ts = Vec::new();
        for _ in 0..a.repeats.max(3) {
            c.barrier()?;
            let t = Instant::now();
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            let mut dt = [t.elapsed().as_secs_f64() as f32];
            c.all_reduce(&mut dt, ReduceOp::Max)?;
            ts.push(dt[0] as f64);
        }
        ts.sort_by(f64::total_cmp);
        let t = ts[ts.len() / 2];
        if rank == 0 {
            print_bus_row(p, bytes, t);
        }
    }
    Ok(())
}

/// One row of `bench comm`: nccl-tests' algorithm and bus bandwidth of an all-reduce.
fn print_bus_row(p: usize, bytes: usize, t: f64) {
    let algbw = bytes as f64 / t / 1e9;
    let busbw = algbw * 2.0 * (p - 1) as f64 / p as f64;
    let size = if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    };
    println!(
        "{p:>6} {size:>10} {:>12.3} {algbw:>12.2} {busbw:>14.2}",
        t * 1e3
    );
}
