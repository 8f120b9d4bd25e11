//! The Newton–Schulz iteration of Muon: on a matrix whose rows are orthogonal and of one length
//! it only rescales them, by the scalar polynomial iteration of that length (computed here
//! independently); it treats a tall matrix as the transpose of a wide one; it gives the same
//! bits for every GEMM thread count; bf16 precision keeps the iterate on the bf16 grid; and a
//! matrix split by columns over ranks, its partial Gram matrices summed, gives the whole one's
//! result.

mod common;

use common::randn;
use megatron_tensor::cpu::{
    newton_schulz, NewtonSchulz, NewtonSchulzDims, NsOrientation, NsPrecision,
};
use megatron_tensor::threads::set_gemm_threads;
use std::sync::{Arc, Barrier, Mutex};

const QUINTIC: [[f32; 3]; 5] = [
    [4.0848, -6.8946, 2.9270],
    [3.9505, -6.3029, 2.6377],
    [3.7418, -5.5913, 2.3037],
    [2.8769, -3.1427, 1.2046],
    [2.8366, -3.0525, 1.2012],
];

fn ns(precision: NsPrecision, orientation: NsOrientation) -> NewtonSchulz<'static> {
    NewtonSchulz {
        coefficients: &QUINTIC,
        precision,
        orientation,
        eps: 1e-7,
    }
}

fn run(x: &[f32], rows: usize, cols: usize, n: &NewtonSchulz<'_>) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    newton_schulz(&mut out, x, NewtonSchulzDims { rows, cols }, n, &mut |_| {});
    out
}

/// `rows` orthonormal rows of length `cols` (Gram–Schmidt in f64).
fn orthonormal_rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let g = randn(rows * cols, seed, 1.0);
    let mut q: Vec<Vec<f64>> = Vec::new();
    for r in 0..rows {
        let mut v: Vec<f64> = g[r * cols..(r + 1) * cols]
            .iter()
            .map(|&x| x as f64)
            .collect();
        for u in &q {
            let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(u).for_each(|(a, b)| *a -= d * b);
        }
        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        v.iter_mut().for_each(|a| *a /= n);
        q.push(v);
    }
    q.into_iter().flatten().map(|x| x as f32).collect()
}

#[test]
fn newton_schulz_rescales_orthogonal_rows_by_the_scalar_iteration() {
    // 300 rows: the symmetric products in panels (the last one short).
    for (rows, cols) in [(12, 40), (300, 420)] {
        rescales_orthogonal_rows(rows, cols);
    }
}

fn rescales_orthogonal_rows(rows: usize, cols: usize) {
    let q = orthonormal_rows(rows, cols, 7);
    // 3·Q: every singular value 3, normalized to 1/sqrt(rows) before the first step.
    let g: Vec<f32> = q.iter().map(|v| 3.0 * v).collect();
    let out = run(
        &g,
        rows,
        cols,
        &ns(NsPrecision::F32, NsOrientation::Smaller),
    );
    let mut s = 1.0 / (rows as f64).sqrt();
    for [a, b, c] in QUINTIC {
        let (a, b, c) = (a as f64, b as f64, c as f64);
        s = a * s + b * s.powi(3) + c * s.powi(5);
    }
    assert!((0.6..1.3).contains(&s), "the iteration lands near 1: {s}");
    for (o, v) in out.iter().zip(&q) {
        assert!(
            (*o as f64 - s * *v as f64).abs() < 1e-5,
            "{o} vs {}",
            s * *v as f64
        );
    }
}

#[test]
fn newton_schulz_of_a_tall_matrix_is_the_transpose_of_the_wide_one() {
    let (rows, cols) = (30, 11);
    let g = randn(rows * cols, 3, 1.0);
    let t = common::transpose(&g, rows, cols);
    for precision in [NsPrecision::F32, NsPrecision::Bf16] {
        let tall = run(&g, rows, cols, &ns(precision, NsOrientation::Smaller));
        let wide = run(&t, cols, rows, &ns(precision, NsOrientation::Smaller));
        assert_eq!(tall, common::transpose(&wide, cols, rows), "{precision:?}");
    }
}

#[test]
fn newton_schulz_is_bit_identical_for_every_thread_count() {
    for (rows, cols) in [(96, 160), (290, 310)] {
        let g = randn(rows * cols, 5, 1.0);
        let mut results = Vec::new();
        for threads in [1, 2, 3] {
            set_gemm_threads(threads);
            results.push(run(
                &g,
                rows,
                cols,
                &ns(NsPrecision::F32, NsOrientation::Smaller),
            ));
        }
        set_gemm_threads(1);
        assert_eq!(results[0], results[1], "{rows} x {cols}");
        assert_eq!(results[0], results[2], "{rows} x {cols}");
    }
}

#[test]
fn bf16_precision_keeps_the_iterate_on_the_bf16_grid() {
    let (rows, cols) = (16, 24);
    let g = randn(rows * cols, 9, 1.0);
    let out = run(
        &g,
        rows,
        cols,
        &ns(NsPrecision::Bf16, NsOrientation::Smaller),
    );
    assert!(out.iter().all(|v| v.to_bits() & 0xffff == 0));
    let f32s = run(
        &g,
        rows,
        cols,
        &ns(NsPrecision::F32, NsOrientation::Smaller),
    );
    assert!(common::max_abs_diff(&out, &f32s) < 0.05);
    assert_ne!(out, f32s);
}

#[test]
fn a_matrix_split_by_columns_with_summed_gram_matrices_gives_the_whole_result() {
    let (rows, cols, ranks) = (10, 36, 3);
    let g = randn(rows * cols, 11, 1.0);
    let whole = run(&g, rows, cols, &ns(NsPrecision::F32, NsOrientation::Rows));
    let local = cols / ranks;
    let barrier = Arc::new(Barrier::new(ranks));
    let slots = Arc::new(Mutex::new(vec![Vec::<f32>::new(); ranks]));
    let handles: Vec<_> = (0..ranks)
        .map(|r| {
            let shard: Vec<f32> = (0..rows)
                .flat_map(|i| g[i * cols + r * local..i * cols + (r + 1) * local].to_vec())
                .collect();
            let (barrier, slots) = (barrier.clone(), slots.clone());
            std::thread::spawn(move || {
                let mut sum = |x: &mut [f32]| {
                    slots.lock().unwrap()[r] = x.to_vec();
                    barrier.wait();
                    let total: Vec<f32> = {
                        let s = slots.lock().unwrap();
                        (0..x.len()).map(|i| s.iter().map(|v| v[i]).sum()).collect()
                    };
                    barrier.wait();
                    x.copy_from_slice(&total);
                };
                let mut out = vec![0.0f32; shard.len()];
                let d = NewtonSchulzDims { rows, cols: local };
                newton_schulz(
                    &mut out,
                    &shard,
                    d,
                    &ns(NsPrecision::F32, NsOrientation::Rows),
                    &mut sum,
                );
                out
            })
        })
        .collect();
    let parts: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for i in 0..rows {
        for (r, p) in parts.iter().enumerate() {
            for j in 0..local {
                let (a, b) = (p[i * local + j], whole[i * cols + r * local + j]);
                assert!((a - b).abs() < 1e-5, "row {i} rank {r} col {j}: {a} vs {b}");
            }
        }
    }
}
