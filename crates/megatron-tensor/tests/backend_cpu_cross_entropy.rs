mod common;
use common::*;
use megatron_tensor::cpu::matmul::Operand;
use megatron_tensor::cpu::{fused_classifier, ClassifierDims, IGNORE_INDEX};

fn naive_losses(x: &[f32], w: &[f32], tg: &[u32], n: usize, c: usize, v: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if tg[i] == IGNORE_INDEX {
                return 0.0;
            }
            let logits: Vec<f64> = (0..v)
                .map(|j| {
                    (0..c)
                        .map(|p| x[i * c + p] as f64 * w[j * c + p] as f64)
                        .sum()
                })
                .collect();
            let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + logits.iter().map(|z| (z - mx).exp()).sum::<f64>().ln();
            (lse - logits[tg[i] as usize]) as f32
        })
        .collect()
}

fn setup(n: usize, c: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let x = randn(n * c, seed, 1.0);
    let w = randn(v * c, seed + 1, 0.5);
    let tg: Vec<u32> = (0..n)
        .map(|i| {
            if i % 7 == 3 {
                IGNORE_INDEX
            } else {
                ((i * 13 + 5) % v) as u32
            }
        })
        .collect();
    (x, w, tg)
}

#[test]
fn fused_classifier_losses_match_naive_for_any_chunking() {
    let (n, c, v) = (23, 12, 37);
    let (x, w, tg) = setup(n, c, v, 1);
    let want = naive_losses(&x, &w, &tg, n, c, v);
    for chunk in [1, 5, 23, 64] {
        let mut losses = vec![0.0; n];
        let d = ClassifierDims {
            n,
            c,
            v,
            chunk_rows: chunk,
        };
        fused_classifier(
            &mut losses,
            None,
            &x,
            Operand::F32(&w),
            None,
            &tg,
            &vec![0.0; n],
            d,
        );
        assert_close(&losses, &want, 1e-4, 1e-4, &format!("chunk {chunk}"));
    }
}

#[test]
fn fused_classifier_backward_matches_finite_difference() {
    let (n, c, v) = (9, 6, 11);
    let (mut x, mut w, tg) = setup(n, c, v, 2);
    let dloss: Vec<f32> = (0..n).map(|i| 0.5 + 0.1 * i as f32).collect();
    let d = ClassifierDims {
        n,
        c,
        v,
        chunk_rows: 4,
    };
    let mut losses = vec![0.0; n];
    let mut dx = vec![0.0; n * c];
    let mut dw = vec![0.0; v * c];
    fused_classifier(
        &mut losses,
        Some((&mut dx, &mut dw)),
        &x,
        Operand::F32(&w),
        None,
        &tg,
        &dloss,
        d,
    );
    let f = |x: &[f32], w: &[f32]| -> f64 {
        naive_losses(x, w, &tg, n, c, v)
            .iter()
            .zip(&dloss)
            .map(|(l, g)| *l as f64 * *g as f64)
            .sum()
    };
    let wc = w.clone();
    check_grad(&mut x, &dx, |x| f(x, &wc), 1e-2, 1e-3, 1e-2, 54, "dx");
    let xc = x.clone();
    check_grad(&mut w, &dw, |w| f(&xc, w), 1e-2, 1e-3, 1e-2, 66, "dw");
}

#[test]
fn fused_classifier_accumulates_weight_gradient() {
    let (n, c, v) = (5, 4, 6);
    let (x, w, tg) = setup(n, c, v, 3);
    let d = ClassifierDims {
        n,
        c,
        v,
        chunk_rows: 2,
    };
    let dloss = vec![1.0; n];
    let mut l = vec![0.0; n];
    let (mut dx, mut dw1) = (vec![0.0; n * c], vec![0.0; v * c]);
    fused_classifier(
        &mut l,
        Some((&mut dx, &mut dw1)),
        &x,
        Operand::F32(&w),
        None,
        &tg,
        &dloss,
        d,
    );
    let mut dw2 = vec![1.0; v * c];
    fused_classifier(
        &mut l,
        Some((&mut dx, &mut dw2)),
        &x,
        Operand::F32(&w),
        None,
        &tg,
        &dloss,
        d,
    );
    let want: Vec<f32> = dw1.iter().map(|g| g + 1.0).collect();
    assert_close(&dw2, &want, 1e-6, 1e-6, "accumulate");
}

#[test]
fn fused_classifier_rows_with_zero_dloss_contribute_no_gradient() {
    let (n, c, v) = (6, 4, 9);
    let (x, w, mut tg) = setup(n, c, v, 4);
    tg.iter_mut().for_each(|t| *t %= v as u32);
    let d = ClassifierDims {
        n,
        c,
        v,
        chunk_rows: 4,
    };
    let mut dloss = vec![0.0; n];
    dloss[2] = 1.0;
    let mut l = vec![0.0; n];
    let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; v * c]);
    fused_classifier(
        &mut l,
        Some((&mut dx, &mut dw)),
        &x,
        Operand::F32(&w),
        None,
        &tg,
        &dloss,
        d,
    );
    for i in 0..n {
        let row_zero = dx[i * c..(i + 1) * c].iter().all(|g| *g == 0.0);
        assert_eq!(row_zero, i != 2, "row {i}");
        assert!(
            l[i] > 0.0,
            "loss is reported even where the gradient is zero"
        );
    }
    // The weight gradient is exactly the outer product contribution of row 2 alone.
    let mut only = vec![0.0; v * c];
    let mut dx1 = vec![0.0; c];
    let d1 = ClassifierDims {
        n: 1,
        c,
        v,
        chunk_rows: 1,
    };
    fused_classifier(
        &mut [0.0],
        Some((&mut dx1, &mut only)),
        &x[2 * c..3 * c],
        Operand::F32(&w),
        None,
        &tg[2..3],
        &[1.0],
        d1,
    );
    assert_close(&dw, &only, 1e-6, 1e-5, "dw");
}

#[test]
fn fused_classifier_on_packed_bf16_kernels_matches_the_rounded_operand_f32_path() {
    use megatron_tensor::cpu::cross_entropy::set_classifier_gradient_chunk_bytes;
    use megatron_tensor::cpu::matmul::{
        bf16_block_kernel, set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulPrecision,
    };
    // Several tiles, so the weight packed once per call serves every tile; 70 tokens make
    // ragged tiles and chunks.
    let (n, c, v) = (70, 40, 150);
    let (x, w, tg) = setup(n, c, v, 5);
    let dloss = vec![1.0 / n as f32; n];
    let d = ClassifierDims {
        n,
        c,
        v,
        chunk_rows: 16,
    };
    let run = |kernel, chunk_bytes| {
        set_matmul_precision(MatmulPrecision::BF16);
        set_bf16_kernel(kernel);
        set_classifier_gradient_chunk_bytes(chunk_bytes);
        let packed = bf16_block_kernel();
        let (mut l, mut dx, mut dw) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; v * c]);
        fused_classifier(
            &mut l,
            Some((&mut dx, &mut dw)),
            &x,
            Operand::F32(&w),
            None,
            &tg,
            &dloss,
            d,
        );
        set_matmul_precision(MatmulPrecision::F32);
        set_bf16_kernel(Bf16Kernel::Dot);
        set_classifier_gradient_chunk_bytes(256 << 20);
        (packed, (l, dx, dw))
    };
    let (_, (l_fma, dx_fma, dw_fma)) = run(Bf16Kernel::Fma, 256 << 20);
    // One chunk of all tokens; chunks of two tiles (32 tokens: 2 x 16 x 150 x 2 bytes), the
    // last one partial; one tile per chunk.
    for chunk_bytes in [256 << 20, 2 * 16 * v * 2, 1] {
        for setting in [Bf16Kernel::Amx, Bf16Kernel::Dot] {
            let (packed, (l, dx, dw)) = run(setting, chunk_bytes);
            let Some(kernel) = packed else {
                eprintln!(
                    "skipped {setting:?}: no packed bf16 kernel on this CPU (no AVX512_BF16)"
                );
                continue;
            };
            eprintln!("{setting:?} setting runs {kernel:?}, chunks of {chunk_bytes} bytes");
            // The same bf16 products summed in another order: f32 summation error, far below
            // a bf16 unit; a kernel that skipped the rounding or a tile would be off by more.
            assert_close(&l, &l_fma, 1e-5, 1e-5, "losses");
            assert_close(&dx, &dx_fma, 1e-6, 1e-4, "dx");
            assert_close(&dw, &dw_fma, 1e-6, 1e-4, "dw");
        }
    }
}

#[test]
fn a_bf16_output_weight_gives_the_bits_of_its_widened_values() {
    // A `--bf16` model's output weight is packed from its 16-bit copy (or, below the packed
    // kernels' row minimum, widened once): the same losses and gradients, bit for bit, as the
    // same weight widened to f32 first, on every bf16 kernel setting.
    use half::bf16;
    use megatron_tensor::cpu::matmul::{
        set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulPrecision,
    };
    for (n, chunk_rows) in [(70, 16), (9, 4)] {
        let (c, v) = (40, 150);
        let (x, w, tg) = setup(n, c, v, 6);
        let w16: Vec<bf16> = w.iter().map(|&a| bf16::from_f32(a)).collect();
        let wide: Vec<f32> = w16.iter().map(|a| a.to_f32()).collect();
        let dloss = vec![1.0 / n as f32; n];
        let d = ClassifierDims {
            n,
            c,
            v,
            chunk_rows,
        };
        for setting in [Bf16Kernel::Amx, Bf16Kernel::Dot, Bf16Kernel::Fma] {
            set_matmul_precision(MatmulPrecision::BF16);
            set_bf16_kernel(setting);
            let run = |weight: Operand<'_>| {
                let (mut l, mut dx, mut dw) = (vec![0.0; n], vec![0.0; n * c], vec![0.0; v * c]);
                let g = Some((&mut dx[..], &mut dw[..]));
                fused_classifier(&mut l, g, &x, weight, None, &tg, &dloss, d);
                [l, dx, dw].map(|t| t.iter().map(|a| a.to_bits()).collect::<Vec<_>>())
            };
            let (got, want) = (run(Operand::BF16(&w16)), run(Operand::F32(&wide)));
            for (i, what) in ["losses", "dx", "dw"].iter().enumerate() {
                assert!(got[i] == want[i], "{setting:?}, {n} tokens: {what}");
            }
        }
        set_matmul_precision(MatmulPrecision::F32);
        set_bf16_kernel(Bf16Kernel::Dot);
    }
}
