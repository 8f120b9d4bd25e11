//! The shared expert's sigmoid gate against finite differences, and its backward on a bf16
//! kept output (what a `--bf16` layer keeps) bit for bit as on the widened f32 copy.

mod common;

use common::{assert_same_bits, in_pool, randn, to_bf16, widen};
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
    sigmoid_gate_backward(&mut dy, &mut dl, &w, &gate, &y[..], c);
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

#[test]
fn sigmoid_gate_backward_reads_a_bf16_output_as_its_widened_copy_bit_for_bit() {
    let (n, c) = (11, 37);
    let gate: Vec<f32> = randn(n, 1, 1.0)
        .iter()
        .map(|l| 1.0 / (1.0 + (-l).exp()))
        .collect();
    let dout = randn(n * c, 2, 1.0);
    let y16 = to_bf16(&randn(n * c, 3, 1.0));
    let y = widen(&y16);
    for threads in [1, 2, 3] {
        let (from32, from16) = in_pool(threads, || {
            let run = |y: &dyn Fn(&mut [f32], &mut [f32])| {
                let (mut dy, mut dl) = (vec![0.0f32; n * c], vec![0.0f32; n]);
                y(&mut dy, &mut dl);
                (dy, dl)
            };
            (
                run(&|dy, dl| sigmoid_gate_backward(dy, dl, &dout, &gate, &y[..], c)),
                run(&|dy, dl| sigmoid_gate_backward(dy, dl, &dout, &gate, &y16[..], c)),
            )
        });
        let what = format!("{threads} threads");
        assert_same_bits(&from16.0, &from32.0, &format!("dy, {what}"));
        assert_same_bits(&from16.1, &from32.1, &format!("dlogits, {what}"));
        // And the dot products are the f32 ones, not zeros or a stale buffer.
        let want: f32 = (0..c).map(|j| dout[j] * y[j]).sum::<f32>() * gate[0] * (1.0 - gate[0]);
        assert!((from32.1[0] - want).abs() <= 1e-5 * (1.0 + want.abs()));
    }
}
