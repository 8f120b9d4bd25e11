mod common;
use common::*;
use megatron_tensor::cpu::reduce::all_finite;
use megatron_tensor::cpu::{global_norm_squared, scale_inplace};
use megatron_tensor::{DType, Tensor};

#[test]
fn global_norm_squared_matches_naive_sum() {
    let x = randn(300_001, 1, 1.0);
    let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    assert!((global_norm_squared(&x) - want).abs() < 1e-6 * want);
}

#[test]
fn scale_and_finiteness() {
    let mut x = vec![2.0f32; 10];
    scale_inplace(&mut x, 0.5);
    assert_eq!(x, vec![1.0; 10]);
    assert!(all_finite(&x));
    x[3] = f32::NAN;
    assert!(!all_finite(&x));
}

#[test]
fn casts_round_trip_within_half_precision() {
    let x = randn(1000, 2, 3.0);
    let t = Tensor::from_vec(&[10, 100], x.clone()).unwrap();
    for (dt, rel) in [(DType::BF16, 1.0 / 128.0), (DType::F16, 1.0 / 1024.0)] {
        let h = t.to_dtype(dt);
        assert_eq!(h.dtype(), dt);
        assert_eq!(h.size_in_bytes(), 2000);
        let back = h.to_dtype(DType::F32);
        for (a, b) in back.data().iter().zip(&x) {
            assert!((a - b).abs() <= rel * b.abs() + 1e-4, "{dt}: {a} vs {b}");
        }
    }
}

#[test]
fn pooled_tensors_are_zeroed_when_reused() {
    let n = 1 << 14;
    {
        let mut t = Tensor::zeros(&[n]);
        t.data_mut().fill(7.0);
    }
    assert!(megatron_tensor::pool::pooled_bytes() >= n * 4);
    let t = Tensor::zeros(&[n]);
    assert!(t.data().iter().all(|&v| v == 0.0));
}

#[test]
fn fast_exp_and_tanh_match_libm() {
    use megatron_tensor::cpu::simd::{exp, tanh};
    let mut x = -100.0f32;
    while x < 88.0 {
        let want = x.exp();
        let got = exp(x);
        assert!(
            (got - want).abs() <= 4.0 * f32::EPSILON * want + 1e-37,
            "exp({x}) = {got}, libm {want}"
        );
        let tw = x.tanh();
        assert!(
            (tanh(x) - tw).abs() <= 2e-7 + 2.0 * f32::EPSILON * tw.abs(),
            "tanh({x})"
        );
        x += 0.0137;
    }
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(tanh(0.0), 0.0);
}

#[test]
fn the_pool_keeps_only_buffers_it_handed_out_and_a_bounded_number_of_lengths() {
    use megatron_tensor::pool;
    std::thread::spawn(|| {
        // Made outside the pool: freed on drop, never parked (else one more per step).
        drop(Tensor::from_vec(&[1 << 13], vec![1.0; 1 << 13]).unwrap());
        assert_eq!(pool::pooled_bytes(), 0);
        // Handed out and given back: parked, and reused.
        drop(Tensor::zeros(&[1 << 13]));
        assert_eq!(pool::pooled_bytes(), 4 << 13);
        drop(Tensor::zeros(&[1 << 13]));
        assert_eq!(pool::pooled_bytes(), 4 << 13);
        // Lengths that never recur (mixture-of-experts token blocks) do not pile up.
        for len in 0..500 {
            drop(Tensor::zeros(&[(1 << 12) + len]));
        }
        let lengths = pool::pooled_lengths();
        assert!((1..=64).contains(&lengths), "{lengths} lengths parked");
    })
    .join()
    .unwrap();
}

#[test]
fn first_non_finite_finds_the_first_nan_or_infinity_across_chunks() {
    use megatron_tensor::cpu::first_non_finite;
    let n = (1 << 16) * 3 + 17;
    let mut x: Vec<f32> = (0..n).map(|i| (i as f32).sin() * 1e30).collect();
    assert_eq!(first_non_finite(&x), None);
    x[n - 1] = f32::NEG_INFINITY;
    assert_eq!(first_non_finite(&x), Some(n - 1));
    x[(1 << 16) * 2 + 5] = f32::NAN;
    assert_eq!(first_non_finite(&x), Some((1 << 16) * 2 + 5));
    x[3] = f32::INFINITY;
    assert_eq!(first_non_finite(&x), Some(3));
    assert_eq!(first_non_finite(&[]), None);
}
