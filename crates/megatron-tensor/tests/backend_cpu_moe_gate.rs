//! The shared expert's sigmoid gate against finite differences.

use megatron_tensor::cpu::moe_gate::{sigmoid_gate_backward, sigmoid_gate_forward};

fn loss(logits: &[f32], y: &[f32], w: &[f32], cols: usize) -> f64 {
    let mut out = vec![0.0f32; y.len()];
    let mut gate = vec![0.0f32; logits.len()];
    sigmoid_gate_forward(&mut out, &mut gate, logits, y, cols);
    out.iter()
        .zip(w)
        .map(|(a, b)| (*a as f64) * (*b as f64))
        .sum()
}

#[test]
fn sigmoid_gate_backward_matches_finite_difference() {
    let (n, c) = (5, 7);
    let logits: Vec<f32> = (0..n).map(|i| (i as f32 - 2.0) * 0.7).collect();
    let y: Vec<f32> = (0..n * c)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
        .collect();
    let w: Vec<f32> = (0..n * c)
        .map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.25)
        .collect();
    let mut gate = vec![0.0f32; n];
    let mut out = vec![0.0f32; n * c];
    sigmoid_gate_forward(&mut out, &mut gate, &logits, &y, c);
    let (mut dy, mut dl) = (vec![0.0f32; n * c], vec![0.0f32; n]);
    sigmoid_gate_backward(&mut dy, &mut dl, &w, &gate, &y, c);
    let eps = 1e-2f32;
    for i in 0..n {
        let (mut p, mut m) = (logits.clone(), logits.clone());
        p[i] += eps;
        m[i] -= eps;
        let fd = (loss(&p, &y, &w, c) - loss(&m, &y, &w, c)) / (2.0 * eps as f64);
        assert!(
            (fd - dl[i] as f64).abs() < 1e-3,
            "dlogit {i}: {fd} vs {}",
            dl[i]
        );
    }
    for i in 0..n * c {
        let (mut p, mut m) = (y.clone(), y.clone());
        p[i] += eps;
        m[i] -= eps;
        let fd = (loss(&logits, &p, &w, c) - loss(&logits, &m, &w, c)) / (2.0 * eps as f64);
        assert!(
            (fd - dy[i] as f64).abs() < 1e-3,
            "dy {i}: {fd} vs {}",
            dy[i]
        );
    }
}
