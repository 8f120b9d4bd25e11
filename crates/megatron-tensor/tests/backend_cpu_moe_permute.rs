//! Moving token rows to and from experts: the per-row dot products that give the routing
//! probabilities' gradients, against a naive f64 reference, and on bf16 expert outputs (what a
//! `--bf16` layer keeps) bit for bit as on their widened f32 copy, in 1, 2 and 3 threads.

mod common;

use common::{assert_same_bits, in_pool, randn, to_bf16, widen};
use megatron_tensor::cpu::moe_permute::rows_dot;

#[test]
fn rows_dot_is_each_rows_dot_product_and_reads_bf16_rows_as_their_f32_copy() {
    let (tokens, cols) = (9, 37);
    let x = randn(tokens * cols, 1, 1.0);
    // Slots in dispatch order: tokens repeated (top-2) and out of order.
    let rows: Vec<u32> = vec![3, 0, 8, 3, 5, 1, 7, 2, 6, 4, 0, 8];
    let y16 = to_bf16(&randn(rows.len() * cols, 2, 1.0));
    let y = widen(&y16);
    let naive: Vec<f64> = rows
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            (0..cols)
                .map(|c| x[r as usize * cols + c] as f64 * y[i * cols + c] as f64)
                .sum()
        })
        .collect();
    for threads in [1, 2, 3] {
        let (from32, from16) = in_pool(threads, || {
            let mut a = vec![0.0f32; rows.len()];
            rows_dot(&mut a, &x, &rows, &y[..], cols);
            let mut b = vec![0.0f32; rows.len()];
            rows_dot(&mut b, &x, &rows, &y16[..], cols);
            (a, b)
        });
        for (i, (got, want)) in from32.iter().zip(&naive).enumerate() {
            assert!(
                (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "slot {i}: {got} vs {want}"
            );
        }
        assert_same_bits(&from16, &from32, &format!("bf16 rows, {threads} threads"));
    }
}
