//! Cross-entropy over the first k logits of each row.

use megatron_tensor::cpu::masked_cross_entropy;

#[test]
fn masked_cross_entropy_ignores_logits_beyond_each_rows_classes() {
    let width = 4;
    let logits = [1.0f32, 2.0, 0.5, 9.0, 0.0, 0.0, 3.0, -1.0];
    let (targets, valid, dloss) = ([1u32, 2], [3u32, 4], [0.5f32, 2.0]);
    let mut losses = [0.0f32; 2];
    let mut d = [f32::NAN; 8];
    masked_cross_entropy(
        &mut losses,
        Some(&mut d),
        &logits,
        &targets,
        &valid,
        &dloss,
        width,
    );
    // Row 0: softmax over [1, 2, 0.5] only; the 9 is not a class of this table.
    let lse0 = (1f64.exp() + 2f64.exp() + 0.5f64.exp()).ln();
    assert!((losses[0] as f64 - (lse0 - 2.0)).abs() < 1e-6);
    assert_eq!(d[3], 0.0);
    let p1 = (2.0 - lse0).exp() as f32;
    assert!((d[1] - (p1 - 1.0) * 0.5).abs() < 1e-6);
    // Gradients of a row sum to zero (softmax minus one-hot), scaled by dloss.
    let s1: f32 = d[4..8].iter().sum();
    assert!(s1.abs() < 1e-6);
    let lse1 = (2.0 * 0f64.exp() + 3f64.exp() + (-1f64).exp()).ln();
    assert!((losses[1] as f64 - (lse1 - 3.0)).abs() < 1e-6);
}
