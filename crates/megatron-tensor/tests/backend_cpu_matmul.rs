mod common;
use common::*;
use megatron_tensor::cpu::matmul::gemm_crate;
use megatron_tensor::cpu::{
    bias_backward, grouped_matmul, matmul, matmul_batched, matmul_with_threads, syrk_with_threads,
    BatchStrides, GemmProblem, MatmulDims,
};

#[test]
fn matmul_all_transposes_match_naive() {
    let (m, n, k) = (37, 53, 29);
    let a = randn(m * k, 1, 1.0);
    let b = randn(k * n, 2, 1.0);
    let want = naive_matmul(&a, &b, m, n, k);
    let at = transpose(&a, m, k);
    let bt = transpose(&b, k, n);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut out = vec![0.0; m * n];
        let mut d = MatmulDims::new(m, n, k);
        d.trans_a = ta;
        d.trans_b = tb;
        matmul(
            &mut out,
            if ta { &at } else { &a },
            if tb { &bt } else { &b },
            d,
        );
        assert_close(&out, &want, 1e-4, 1e-4, &format!("ta={ta} tb={tb}"));
    }
}

/// Shapes that cross every blocking boundary of the AVX-512 kernel (24-row and 16-column tiles,
/// 256-deep and 1024-wide packed blocks, 16-wide transposes) with partial tiles at each edge.
#[test]
fn matmul_block_edges_and_accumulation_match_naive_for_every_transpose() {
    let (m, n, k) = (53, 1061, 300);
    let a = randn(m * k, 11, 1.0);
    let b = randn(k * n, 12, 1.0);
    let init = randn(m * n, 13, 1.0);
    let prod = naive_matmul(&a, &b, m, n, k);
    let at = transpose(&a, m, k);
    let bt = transpose(&b, k, n);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        for acc in [false, true] {
            let mut out = if acc {
                init.clone()
            } else {
                vec![f32::NAN; m * n]
            };
            let mut d = MatmulDims::new(m, n, k);
            d.trans_a = ta;
            d.trans_b = tb;
            d.accumulate = acc;
            let (a, b) = (if ta { &at } else { &a }, if tb { &bt } else { &b });
            matmul_with_threads(&mut out, a, b, d, 2);
            let want: Vec<f32> = if acc {
                prod.iter().zip(&init).map(|(p, i)| p + i).collect()
            } else {
                prod.clone()
            };
            assert_close(
                &out,
                &want,
                1e-3,
                1e-4,
                &format!("ta={ta} tb={tb} acc={acc}"),
            );
            // The portable path (the `gemm` crate) agrees too.
            let mut fallback = if acc { init.clone() } else { vec![0.0; m * n] };
            gemm_crate(&mut fallback, a, b, d, 2);
            assert_close(&fallback, &want, 1e-3, 1e-4, "gemm crate");
        }
    }
}

/// Single rows, single columns, exact tiles and K = 0 (the output is zeroed, or left alone when
/// accumulating).
#[test]
fn matmul_degenerate_and_exact_tile_shapes_match_naive() {
    for (m, n, k) in [
        (1, 1, 1),
        (1, 17, 300),
        (25, 1, 33),
        (24, 16, 16),
        (48, 32, 512),
        (3, 4, 0),
    ] {
        let a = randn(m * k, 16, 1.0);
        let b = randn(k * n, 17, 1.0);
        let want = naive_matmul(&a, &b, m, n, k);
        let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut d = MatmulDims::new(m, n, k);
            d.trans_a = ta;
            d.trans_b = tb;
            let mut out = vec![f32::NAN; m * n];
            let (a, b) = (if ta { &at } else { &a }, if tb { &bt } else { &b });
            matmul_with_threads(&mut out, a, b, d, 2);
            assert_close(
                &out,
                &want,
                1e-3,
                1e-4,
                &format!("{m}x{n}x{k} ta={ta} tb={tb}"),
            );
            let mut acc = vec![1.0; m * n];
            matmul_with_threads(&mut acc, a, b, d.acc(), 2);
            let plus_one: Vec<f32> = want.iter().map(|w| w + 1.0).collect();
            assert_close(&acc, &plus_one, 1e-3, 1e-4, &format!("{m}x{n}x{k} acc"));
        }
    }
}

/// Every element is summed in one order whatever the thread count (each thread owns whole rows
/// or columns of the output), so results are bit-identical across thread budgets.
#[test]
fn matmul_is_bit_identical_across_thread_counts() {
    for (m, n, k) in [(300, 70, 96), (40, 900, 64), (256, 256, 64)] {
        let a = randn(m * k, 14, 1.0);
        let b = randn(k * n, 15, 1.0);
        let d = MatmulDims::new(m, n, k).tb();
        let mut o1 = vec![0.0; m * n];
        matmul_with_threads(&mut o1, &a, &b, d, 1);
        for t in [2, 3] {
            let mut o = vec![0.0; m * n];
            matmul_with_threads(&mut o, &a, &b, d, t);
            assert!(
                o.iter().zip(&o1).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}x{n}x{k} with {t} threads differs from 1 thread"
            );
        }
    }
}

#[test]
fn grouped_matmul_gives_each_product_the_bits_of_matmul() {
    megatron_tensor::threads::set_gemm_threads(2);
    // Expert-like blocks: uneven rows (one empty-ish), both transposes, accumulation.
    let shapes = [(37, 48, 32), (1, 48, 32), (200, 48, 32), (64, 48, 32)];
    let data: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(m, n, k))| {
            (
                randn(m * k, 20 + i as u64, 1.0),
                randn(k * n, 30 + i as u64, 1.0),
                randn(m * n, 40 + i as u64, 1.0),
            )
        })
        .collect();
    for dims in [
        |m, n, k| MatmulDims::new(m, n, k).tb(),
        |m, n, k| MatmulDims::new(m, n, k).acc(),
    ] {
        let mut grouped: Vec<Vec<f32>> = data.iter().map(|d| d.2.clone()).collect();
        let mut problems: Vec<GemmProblem> = grouped
            .iter_mut()
            .zip(&data)
            .zip(shapes)
            .map(|((out, d), (m, n, k))| GemmProblem {
                out,
                a: (&d.0).into(),
                b: (&d.1).into(),
                dims: dims(m, n, k),
            })
            .collect();
        grouped_matmul(&mut problems);
        for ((d, g), (m, n, k)) in data.iter().zip(&grouped).zip(shapes) {
            let mut one = d.2.clone();
            matmul(&mut one, &d.0, &d.1, dims(m, n, k));
            assert!(
                one.iter().zip(g).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}x{n}x{k}: grouped differs from matmul"
            );
        }
    }
}

#[test]
fn matmul_accumulate_adds_to_output() {
    let (m, n, k) = (64, 96, 128);
    let a = randn(m * k, 3, 1.0);
    let b = randn(k * n, 4, 1.0);
    let prod = naive_matmul(&a, &b, m, n, k);
    let init = randn(m * n, 5, 1.0);
    let mut out = init.clone();
    matmul(&mut out, &a, &b, MatmulDims::new(m, n, k).acc());
    let want: Vec<f32> = prod.iter().zip(&init).map(|(p, i)| p + i).collect();
    assert_close(&out, &want, 1e-3, 1e-4, "accumulate");
}

#[test]
fn matmul_thread_count_does_not_change_result_beyond_rounding() {
    let (m, n, k) = (256, 192, 160);
    let a = randn(m * k, 6, 1.0);
    let b = randn(k * n, 7, 1.0);
    let mut o1 = vec![0.0; m * n];
    let mut o2 = vec![0.0; m * n];
    matmul_with_threads(&mut o1, &a, &b, MatmulDims::new(m, n, k), 1);
    matmul_with_threads(&mut o2, &a, &b, MatmulDims::new(m, n, k), 2);
    assert_close(&o1, &o2, 1e-4, 1e-5, "threads");
}

#[test]
fn batched_matmul_matches_naive_and_broadcasts_a_shared_operand() {
    let (bsz, m, n, k) = (3, 8, 5, 7);
    let a = randn(bsz * m * k, 8, 1.0);
    let b = randn(bsz * k * n, 9, 1.0);
    let mut out = vec![0.0; bsz * m * n];
    let d = MatmulDims::new(m, n, k);
    matmul_batched(
        &mut out,
        &a,
        &b,
        d,
        bsz,
        BatchStrides {
            out: m * n,
            a: m * k,
            b: k * n,
        },
    );
    for i in 0..bsz {
        let want = naive_matmul(
            &a[i * m * k..(i + 1) * m * k],
            &b[i * k * n..(i + 1) * k * n],
            m,
            n,
            k,
        );
        assert_close(&out[i * m * n..(i + 1) * m * n], &want, 1e-4, 1e-4, "batch");
    }
    // Stride 0 on b: every batch entry multiplies by the same matrix.
    matmul_batched(
        &mut out,
        &a,
        &b[..k * n],
        d,
        bsz,
        BatchStrides {
            out: m * n,
            a: m * k,
            b: 0,
        },
    );
    for i in 0..bsz {
        let want = naive_matmul(&a[i * m * k..(i + 1) * m * k], &b[..k * n], m, n, k);
        assert_close(
            &out[i * m * n..(i + 1) * m * n],
            &want,
            1e-4,
            1e-4,
            "broadcast",
        );
    }
}

#[test]
fn matmul_backward_matches_finite_difference() {
    // y = x W^T (Megatron linear); dx = dy W, dW = dy^T x.
    let (n, i, o) = (6, 5, 4);
    let mut x = randn(n * i, 10, 1.0);
    let mut w = randn(o * i, 11, 1.0);
    let r = randn(n * o, 12, 1.0);
    let mut dx = vec![0.0; n * i];
    let mut dw = vec![0.0; o * i];
    matmul(&mut dx, &r, &w, MatmulDims::new(n, i, o));
    matmul(&mut dw, &r, &x, MatmulDims::new(o, i, n).ta());
    let wc = w.clone();
    check_grad(
        &mut x,
        &dx,
        |x| {
            let mut y = vec![0.0; n * o];
            matmul(&mut y, x, &wc, MatmulDims::new(n, o, i).tb());
            dot(&y, &r)
        },
        1e-2,
        1e-3,
        1e-3,
        30,
        "dx",
    );
    let xc = x.clone();
    check_grad(
        &mut w,
        &dw,
        |w| {
            let mut y = vec![0.0; n * o];
            matmul(&mut y, &xc, w, MatmulDims::new(n, o, i).tb());
            dot(&y, &r)
        },
        1e-2,
        1e-3,
        1e-3,
        20,
        "dW",
    );
}

#[test]
fn bias_backward_sums_rows() {
    let (rows, cols) = (300, 7);
    let dout = randn(rows * cols, 13, 1.0);
    let mut db = vec![1.0; cols];
    bias_backward(&mut db, &dout, rows, cols);
    for j in 0..cols {
        let s: f64 = (0..rows).map(|r| dout[r * cols + j] as f64).sum();
        assert!((db[j] as f64 - 1.0 - s).abs() < 1e-3, "col {j}");
    }
}

/// The symmetric product (Newton–Schulz's `X·Xᵀ` and `A·A`) computes upper panels only: below,
/// at and past the two-panel threshold, with a short last panel, it is the product, exactly
/// symmetric, and the same for every thread count.
#[test]
fn syrk_matches_the_full_product_exactly_symmetric_for_every_thread_count() {
    let k = 37;
    for m in [5usize, 255, 256, 300, 513] {
        let x = randn(m * k, m as u64, 1.0);
        let want = naive_matmul(&x, &transpose(&x, m, k), m, m, k);
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 3] {
            let mut out = vec![f32::NAN; m * m];
            syrk_with_threads(&mut out, &x, m, k, threads);
            assert_close(&out, &want, 1e-4, 1e-4, &format!("m {m} threads {threads}"));
            for r in 0..m {
                for c in 0..r {
                    assert_eq!(out[r * m + c], out[c * m + r], "m {m}: ({r}, {c})");
                }
            }
            match &first {
                Some(f) => assert_eq!(f, &out, "m {m}: {threads} threads"),
                None => first = Some(out),
            }
        }
    }
}

/// More output rows than one call into the `gemm` crate takes: the row slabs (the last one
/// partial) add up to the whole product, for every transposition, overwriting and
/// accumulating.
#[test]
fn gemm_crate_split_into_row_slabs_matches_naive() {
    use megatron_tensor::cpu::matmul::GEMM_CRATE_MAX_ROWS;
    let (m, n, k) = (2 * GEMM_CRATE_MAX_ROWS + 37, 19, 23);
    let a = randn(m * k, 31, 1.0);
    let b = randn(k * n, 32, 1.0);
    let init = randn(m * n, 33, 1.0);
    let prod = naive_matmul(&a, &b, m, n, k);
    let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        for acc in [false, true] {
            let mut d = MatmulDims::new(m, n, k);
            d.trans_a = ta;
            d.trans_b = tb;
            d.accumulate = acc;
            let want: Vec<f32> = if acc {
                prod.iter().zip(&init).map(|(p, i)| p + i).collect()
            } else {
                prod.clone()
            };
            let mut out = if acc {
                init.clone()
            } else {
                vec![f32::NAN; m * n]
            };
            let (a, b) = (if ta { &at } else { &a }, if tb { &bt } else { &b });
            gemm_crate(&mut out, a, b, d, 2);
            assert_close(
                &out,
                &want,
                1e-4,
                1e-4,
                &format!("ta={ta} tb={tb} acc={acc}"),
            );
        }
    }
}
