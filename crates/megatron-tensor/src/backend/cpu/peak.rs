//! The hardware's fp32 FMA peak, measured with a tight loop on the widest vector unit present:
//! the MFU denominator and the yardstick kernel selection compares against.

use std::time::Instant;

/// Peak fp32 FLOP/s of this CPU on `threads` threads, measured with a tight FMA loop on the
/// widest vector unit present (AVX-512, else AVX2+FMA, else scalar).
pub fn measure_peak_flops(threads: usize) -> f64 {
    // About 0.1-0.3 s per thread: long enough that thread start-up does not count.
    fma_flops_threads(threads, 1_000_000_000)
}

/// FLOP/s of `threads` threads each running `iters` iterations of the FMA loop.
pub fn fma_flops_threads(threads: usize, iters: u64) -> f64 {
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| std::thread::spawn(move || fma_flops_per_sec(iters)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
}

/// FLOP/s of one thread running `iters` iterations of the FMA loop.
pub fn fma_flops_per_sec(iters: u64) -> f64 {
    let t = Instant::now();
    let flops = fma_loop(iters);
    flops / t.elapsed().as_secs_f64()
}

fn fma_loop(iters: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected at run time.
            return unsafe { x86::fma_avx512(iters) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: as above.
            return unsafe { x86::fma_avx2(iters) };
        }
    }
    let mut acc = [1.0f32; 8];
    let m = std::hint::black_box(0.999_999f32);
    let a = std::hint::black_box(1e-7f32);
    for _ in 0..iters / 8 {
        for x in acc.iter_mut() {
            *x = x.mul_add(m, a);
        }
    }
    std::hint::black_box(acc);
    (iters / 8 * 8 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Twelve independent accumulators in registers hide the FMA latency on two FMA ports.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(iters: u64) -> f64 {
        let m = _mm512_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm512_set1_ps(std::hint::black_box(1e-7));
        let (mut r0, mut r1, mut r2, mut r3) = (
            _mm512_set1_ps(1.0),
            _mm512_set1_ps(1.1),
            _mm512_set1_ps(1.2),
            _mm512_set1_ps(1.3),
        );
        let (mut r4, mut r5, mut r6, mut r7) = (
            _mm512_set1_ps(1.4),
            _mm512_set1_ps(1.5),
            _mm512_set1_ps(1.6),
            _mm512_set1_ps(1.7),
        );
        let (mut r8, mut r9, mut r10, mut r11) = (
            _mm512_set1_ps(1.8),
            _mm512_set1_ps(1.9),
            _mm512_set1_ps(2.0),
            _mm512_set1_ps(2.1),
        );
        let n = iters / 12;
        for _ in 0..n {
            r0 = _mm512_fmadd_ps(r0, m, a);
            r1 = _mm512_fmadd_ps(r1, m, a);
            r2 = _mm512_fmadd_ps(r2, m, a);
            r3 = _mm512_fmadd_ps(r3, m, a);
            r4 = _mm512_fmadd_ps(r4, m, a);
            r5 = _mm512_fmadd_ps(r5, m, a);
            r6 = _mm512_fmadd_ps(r6, m, a);
            r7 = _mm512_fmadd_ps(r7, m, a);
            r8 = _mm512_fmadd_ps(r8, m, a);
            r9 = _mm512_fmadd_ps(r9, m, a);
            r10 = _mm512_fmadd_ps(r10, m, a);
            r11 = _mm512_fmadd_ps(r11, m, a);
        }
        std::hint::black_box([r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11]);
        (n * 12 * 16 * 2) as f64
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(iters: u64) -> f64 {
        let m = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let a = _mm256_set1_ps(std::hint::black_box(1e-7));
        let (mut r0, mut r1, mut r2, mut r3) = (
            _mm256_set1_ps(1.0),
            _mm256_set1_ps(1.1),
            _mm256_set1_ps(1.2),
            _mm256_set1_ps(1.3),
        );
        let (mut r4, mut r5, mut r6, mut r7) = (
            _mm256_set1_ps(1.4),
            _mm256_set1_ps(1.5),
            _mm256_set1_ps(1.6),
            _mm256_set1_ps(1.7),
        );
        let n = iters / 8;
        for _ in 0..n {
            r0 = _mm256_fmadd_ps(r0, m, a);
            r1 = _mm256_fmadd_ps(r1, m, a);
            r2 = _mm256_fmadd_ps(r2, m, a);
            r3 = _mm256_fmadd_ps(r3, m, a);
            r4 = _mm256_fmadd_ps(r4, m, a);
            r5 = _mm256_fmadd_ps(r5, m, a);
            r6 = _mm256_fmadd_ps(r6, m, a);
            r7 = _mm256_fmadd_ps(r7, m, a);
        }
        std::hint::black_box([r0, r1, r2, r3, r4, r5, r6, r7]);
        (n * 8 * 8 * 2) as f64
    }
}
