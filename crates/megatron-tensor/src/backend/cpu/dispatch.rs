//! Which kernel runs on this machine, decided here and nowhere else: the vector level of the
//! elementwise kernels (`simd::level`), the f32 GEMM (own AVX-512 kernel or the gemm crate,
//! `matmul`), and the bf16 matmul instructions (measured once per process).

use super::matmul::Bf16Kernel;

/// The faster instructions for bf16 matmuls on this CPU, measured once per process: the bf16
/// dot-product instruction against the f32 FMA, one thread each, best of two. Both kernels
/// compute the same products (bf16 x bf16 is exact in f32) with f32 accumulation, so this
/// changes speed, never the model being trained (beyond summation order).
pub fn fastest_bf16_kernel() -> Bf16Kernel {
    static CHOICE: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let dot = (0..2)
            .filter_map(|_| super::matmul_bf16::bf16_dot_peak_gflops(1))
            .fold(0.0, f64::max);
        if dot == 0.0 {
            return Bf16Kernel::Fma;
        }
        let fma = (0..2)
            .map(|_| super::peak::fma_flops_per_sec(200_000_000) / 1e9)
            .fold(0.0, f64::max);
        // vdpbf16ps counts 2 multiply-adds per lane; it must beat the FMA to pay for itself.
        if dot > fma {
            Bf16Kernel::Dot
        } else {
            Bf16Kernel::Fma
        }
    })
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
