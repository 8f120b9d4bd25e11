//! Vector-friendly math and runtime dispatch for the elementwise kernels.
//!
//! The crate is compiled for baseline x86-64, where loops auto-vectorize to SSE2 only and libm's
//! scalar `expf`/`tanhf` dominate a training step. [`multiversion!`] compiles a row kernel three
//! times (AVX-512, AVX2+FMA, baseline) and picks one at run time; [`exp`] and [`tanh`] are
//! branch-free polynomials that vectorize inside those kernels.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Level {
    Baseline = 1,
    V3 = 2,
    V4 = 3,
}

static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The widest instruction set this CPU supports (detected once).
pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        3 => Level::V4,
        2 => Level::V3,
        1 => Level::Baseline,
        _ => {
            let l = detect();
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("fma")
        {
            return Level::V4;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Level::V3;
        }
    }
    Level::Baseline
}

/// Defines `fn name(args)` whose body is compiled for AVX-512, AVX2+FMA and baseline x86-64,
/// dispatched at run time. The body must only call `#[inline(always)]` helpers to benefit.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn inner($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v4($($arg: $ty),*) { inner($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v3($($arg: $ty),*) { inner($($arg),*) }
                match $crate::backend::cpu::simd::level() {
                    // SAFETY: the level was detected on this CPU.
                    $crate::backend::cpu::simd::Level::V4 => return unsafe { v4($($arg),*) },
                    $crate::backend::cpu::simd::Level::V3 => return unsafe { v3($($arg),*) },
                    $crate::backend::cpu::simd::Level::Baseline => {}
                }
            }
            inner($($arg),*)
        }
    };
}
pub(crate) use multiversion;

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// `e^x` to about 2 ulp (Cephes' polynomial); 0 below -87.3, `f32::MAX`-ish clamp above 88.7.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = p * r * r + r + 1.0;
    // SAFETY: after the clamp, n is within [-126, 128], so the conversion cannot overflow. The
    // unchecked conversion (unlike `as`, which saturates) vectorizes.
    let ni: i32 = unsafe { n.to_int_unchecked() };
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    let v = y * scale;
    if x < -87.3 {
        0.0
    } else {
        v
    }
}

/// `tanh(x) = sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|})`; absolute error about 1e-7.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let t = exp(-2.0 * x.abs());
    let v = (1.0 - t) / (1.0 + t);
    v.copysign(x)
}
