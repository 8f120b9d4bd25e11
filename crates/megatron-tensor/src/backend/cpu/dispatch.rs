//! Which kernel runs on this machine, decided here and nowhere else: the vector level of the
//! elementwise kernels (`simd::level`), the f32 GEMM (own AVX-512 kernel or the gemm crate,
//! `matmul`), and the bf16 matmul instructions (measured once per process).

use super::matmul::Bf16Kernel;

/// The faster instructions for bf16 matmuls on this CPU, measured once per process on the
/// kernels themselves: one GEMM of a transformer-like shape (256 x 512 x 512, one thread) on
/// the bf16 dot-product kernel and on the f32 GEMM with its operands rounded (that rounding
/// pass included), alternated, best of three each. Both compute the same products (bf16 x bf16
/// is exact in f32) with f32 accumulation, so this changes speed, never the model being
/// trained (beyond summation order). Peak loops do not predict this: on an AMD Zen 4 the
/// `vdpbf16ps` loop measured 60 GFLOP/s against the FMA loop's 109, while the dot-product GEMM
/// ran 1.2-1.4x the f32 GEMM (BENCHMARKS.md).
///
/// Where AMX is usable its tile kernel is measured on the same GEMM and joins the choice.
pub fn fastest_bf16_kernel() -> Bf16Kernel {
    static CHOICE: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        if !super::matmul_bf16::bf16_gemm_available() {
            return Bf16Kernel::Fma;
        }
        let (dot, fma) = bf16_gemm_seconds();
        let amx = amx_gemm_seconds().unwrap_or(f64::INFINITY);
        if amx < dot.min(fma) {
            Bf16Kernel::Amx
        } else if dot < fma {
            Bf16Kernel::Dot
        } else {
            Bf16Kernel::Fma
        }
    })
}

/// The probe GEMM: 256 x 512 x 512, a transformer-like shape small enough to time in
/// milliseconds; random operands (constant ones would round exactly and skip the rounding copy).
struct Probe {
    a: Vec<f32>,
    b: Vec<f32>,
    out: Vec<f32>,
    d: super::matmul::MatmulDims,
}

impl Probe {
    fn new() -> Self {
        let (m, n, k) = (256, 512, 512);
        let key = crate::RngKey::new(7);
        Probe {
            a: (0..m * k).map(|i| key.normal(i as u64)).collect(),
            b: (0..k * n).map(|i| key.normal((m * k + i) as u64)).collect(),
            out: vec![0.0f32; m * n],
            d: super::matmul::MatmulDims::new(m, n, k),
        }
    }

    /// Seconds of one call of `kernel` on the probe, one thread.
    fn seconds(
        &mut self,
        kernel: fn(&mut [f32], &[f32], &[f32], super::matmul::MatmulDims),
    ) -> f64 {
        let t = std::time::Instant::now();
        kernel(&mut self.out, &self.a, &self.b, self.d);
        t.elapsed().as_secs_f64()
    }
}

/// Best-of-three seconds of the probe GEMM on AMX tiles, one thread; `None` where AMX is not
/// usable.
pub fn amx_gemm_seconds() -> Option<f64> {
    if !super::amx::amx_available() {
        return None;
    }
    let mut p = Probe::new();
    let amx = |o: &mut [f32], a: &[f32], b: &[f32], d| {
        super::matmul_amx::matmul_amx_with_threads(o, a, b, d, 1)
    };
    Some((0..3).map(|_| p.seconds(amx)).fold(f64::INFINITY, f64::min))
}

/// Best-of-three seconds of the probe GEMM (256 x 512 x 512) on the dot-product kernel and on
/// the rounded-operand f32 GEMM, one thread each, alternated.
pub fn bf16_gemm_seconds() -> (f64, f64) {
    use super::cast::Half;
    use super::matmul::{matmul_with_threads, rounded_operand};
    let mut p = Probe::new();
    let dot = |o: &mut [f32], a: &[f32], b: &[f32], d| {
        super::matmul_bf16::matmul_bf16_with_threads(o, a, b, d, 1)
    };
    let fma = |o: &mut [f32], a: &[f32], b: &[f32], d| {
        let ar = rounded_operand(a, Half::BF16);
        let br = rounded_operand(b, Half::BF16);
        matmul_with_threads(o, &ar, &br, d, 1)
    };
    let (mut t_dot, mut t_fma) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        t_dot = t_dot.min(p.seconds(dot));
        t_fma = t_fma.min(p.seconds(fma));
    }
    (t_dot, t_fma)
}

/// Which kernels this machine runs (vector level and f32 GEMM): two machines with the same
/// fingerprint compute bit-identical results, so golden files record it.
pub fn kernel_fingerprint() -> String {
    #[cfg(target_arch = "x86_64")]
    let gemm = if super::sgemm::available() {
        "own-sgemm"
    } else {
        "gemm-crate"
    };
    #[cfg(not(target_arch = "x86_64"))]
    let gemm = "gemm-crate";
    format!("{:?}/{gemm}", super::simd::level())
}
