//! Counter-based random numbers.
//!
//! Every random number is a pure function of a key (seed, stream, layer, micro-batch, ...) and an
//! element index, so dropout masks can be regenerated in backward instead of stored, and results
//! do not depend on how work is split across threads or ranks.

/// A stream key plus an element offset: `key.offset(o).bits(i) == key.bits(o + i)`, so a kernel
/// that numbers elements from 0 can draw the numbers of a slice that starts at `o` of a larger,
/// globally numbered tensor (e.g. the samples of one data-parallel rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RngKey(pub u64, pub u64);

#[inline(always)]
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl RngKey {
    pub fn new(seed: u64) -> Self {
        RngKey(splitmix64(seed ^ 0x6D65_6761_7472_6F6E), 0)
    }

    /// Derives a sub-key; `key.fold(a).fold(b)` names an independent stream per (a, b). The
    /// new stream starts at offset 0.
    pub fn fold(self, x: u64) -> Self {
        RngKey(
            splitmix64(self.0 ^ splitmix64(x.wrapping_add(0x1234_5678_9ABC_DEF1))),
            0,
        )
    }

    /// The same stream, with element numbers shifted by `o`.
    pub fn offset(self, o: u64) -> Self {
        RngKey(self.0, self.1.wrapping_add(o))
    }

    #[inline(always)]
    pub fn bits(self, idx: u64) -> u64 {
        splitmix64(self.0 ^ idx.wrapping_add(self.1).wrapping_mul(0xD6E8_FEB8_6659_FD93))
    }

    /// Uniform in [0, 1) with 24 random bits.
    #[inline(always)]
    pub fn uniform(self, idx: u64) -> f32 {
        (self.bits(idx) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Standard normal by Box-Muller over two independent uniforms.
    #[inline]
    pub fn normal(self, idx: u64) -> f32 {
        let b = self.bits(idx);
        let u1 = (((b >> 40) as f64) + 1.0) / ((1u64 << 24) as f64 + 1.0);
        let u2 = ((b & 0xFF_FFFF) as f64) / ((1u64 << 24) as f64);
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// Dropout keep decision for element `idx` at drop probability `p`.
    #[inline(always)]
    pub fn keep(self, idx: u64, p: f32) -> bool {
        self.uniform(idx) >= p
    }
}
