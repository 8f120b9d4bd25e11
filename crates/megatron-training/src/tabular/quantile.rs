//! The quantile-to-normal feature transform of TabPFN's ensemble (Hollmann et al. 2025,
//! "Accurate predictions on small data with a tabular foundation model", methods: each
//! ensemble member sees the features either as they are or through a quantile transform):
//! every value becomes `Φ⁻¹` of its rank among the column's context values, so skewed and
//! heavy-tailed columns reach the model on the normal scale the prior mostly draws. Fitted on
//! the context rows only (the queries are placed by interpolation), missing cells stay missing.

/// `values` (`rows x cols`, row-major) with each column's values replaced by the normal
/// quantile of their position among the first `context` rows' observed values.
pub fn quantile_normal(values: &[f32], rows: usize, cols: usize, context: usize) -> Vec<f32> {
    let mut out = values.to_vec();
    for c in 0..cols {
        let mut seen: Vec<f32> = (0..context)
            .map(|r| values[r * cols + c])
            .filter(|v| !v.is_nan())
            .collect();
        if seen.len() < 2 {
            continue;
        }
        seen.sort_by(f32::total_cmp);
        let n = seen.len() as f64;
        for r in 0..rows {
            let v = values[r * cols + c];
            if v.is_nan() {
                continue;
            }
            // Mid-rank of v: below + half of the ties, as a fraction in (0, 1).
            let below = seen.partition_point(|&s| s < v) as f64;
            let upto = seen.partition_point(|&s| s <= v) as f64;
            let p = ((below + upto) / 2.0 + 0.5) / (n + 1.0);
            out[r * cols + c] =
                normal_quantile(p.clamp(0.5 / (n + 1.0), 1.0 - 0.5 / (n + 1.0))) as f32;
        }
    }
    out
}

/// `Φ⁻¹(p)` for `p` in (0, 1): Acklam's rational approximation (relative error below 1.2e-9),
/// written out because no maintained crate we depend on has it and it is a dozen constants.
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}
