//! Rotary position embeddings (Su et al. 2021) applied to the queries and keys inside
//! megatron-core's fused QKV rows (`[groups, q heads of the group + k + v, head_dim]`), in place.
//!
//! Pairs of the first `rot_dim` features of each head are rotated by `position * inv_freq[i]`
//! with `inv_freq[i] = base^(-2i / rot_dim)`; the rest of the head passes through
//! (`--rotary-percent`). [`RopeStyle::RotateHalf`] pairs feature `i` with `i + rot_dim/2`
//! (Megatron's default, Hugging Face Llama's `rotate_half`); [`RopeStyle::Interleaved`] pairs
//! `2i` with `2i + 1` (`--rotary-interleaved`, GPT-J/Meta's original). A rotation's transpose
//! is the rotation by the opposite angle, so backward rotates the gradients back.

use super::ROWS_PER_TASK;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    RotateHalf,
    Interleaved,
}

/// Context extension of the rotary frequencies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1's (`--use-rope-scaling`): long wavelengths divided by `factor`, short ones
    /// kept, the band between blended smoothly.
    Llama3(Llama3Scaling),
    /// YaRN (Peng et al. 2023; `--position-embedding-type yarn`).
    Yarn(YarnScaling),
    /// Linear position interpolation (Chen et al. 2023; `--rotary-seq-len-interpolation-factor`,
    /// transformers' `rope_type: "linear"`): positions divided by the factor, that is every
    /// frequency.
    Linear(f64),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position: f64,
}

/// YaRN as megatron-core's `YarnRotaryEmbedding` and transformers' `_compute_yarn_parameters`
/// define it: frequency `i` is interpolated (divided by `factor`) below the dimension that
/// completes `beta_slow` rotations over `original_max_position`, kept above the one completing
/// `beta_fast`, blended linearly between (the bounds rounded outward when `round_to_int`);
/// cos and sin are multiplied by the concentration factor `0.1 mscale ln(factor) + 1`, over the
/// same with `mscale_all_dim` when that is non-zero.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    pub round_to_int: bool,
}

impl YarnScaling {
    fn get_mscale(&self, m: f64) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * m * self.factor.ln() + 1.0
        }
    }

    /// The factor on cos and sin.
    pub fn concentration(&self) -> f64 {
        if self.mscale_all_dim == 0.0 {
            self.get_mscale(1.0)
        } else {
            self.get_mscale(self.mscale) / self.get_mscale(self.mscale_all_dim)
        }
    }

    /// The rotary frequencies of a `dim`-wide rotation at `base` under this scaling, as the
    /// tables rotate by them (exporters compare two readings of a configuration with it).
    pub fn frequencies(&self, dim: usize, base: f64) -> Vec<f64> {
        let mut inv: Vec<f64> = (0..dim / 2)
            .map(|i| base.powf(-((2 * i) as f64) / dim as f64))
            .collect();
        self.apply(&mut inv, dim, base);
        inv
    }

    fn correction_dim(&self, rotations: f64, dim: f64, base: f64) -> f64 {
        dim * (self.original_max_position / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    }

    /// Frequencies `inv` (`base^(-2i/dim)`) after interpolation and the ramp between.
    fn apply(&self, inv: &mut [f64], dim: usize, base: f64) {
        let d = dim as f64;
        let (mut low, mut high) = (
            self.correction_dim(self.beta_fast, d, base),
            self.correction_dim(self.beta_slow, d, base),
        );
        if self.round_to_int {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        for (i, f) in inv.iter_mut().enumerate() {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolate = 1.0 - ramp;
            *f = *f / self.factor * (1.0 - extrapolate) + *f * extrapolate;
        }
    }
}

impl RopeScaling {
    /// Megatron's and Llama 3.1's constants with the given factor (Megatron's default 8).
    pub fn llama3(factor: f64) -> Self {
        RopeScaling::Llama3(Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        })
    }
}

impl Llama3Scaling {
    fn apply(&self, inv_freq: f64) -> f64 {
        let low_wavelen = self.original_max_position / self.low_freq_factor;
        let high_wavelen = self.original_max_position / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen < high_wavelen {
            inv_freq
        } else if wavelen > low_wavelen {
            inv_freq / self.factor
        } else {
            let smooth = (self.original_max_position / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

/// `cos` and `sin` of every (position, frequency): `[positions, rot_dim / 2]`, computed in f64
/// and rounded once.
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub rot_dim: usize,
    pub positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(rot_dim: usize, base: f64, positions: usize, scaling: Option<RopeScaling>) -> Self {
        assert!(
            rot_dim >= 2 && rot_dim.is_multiple_of(2),
            "rotary dim {rot_dim}"
        );
        let half = rot_dim / 2;
        let mut inv: Vec<f64> = (0..half)
            .map(|i| base.powf(-((2 * i) as f64) / rot_dim as f64))
            .collect();
        let mut scale = 1.0;
        match scaling {
            None => {}
            Some(RopeScaling::Llama3(s)) => inv.iter_mut().for_each(|f| *f = s.apply(*f)),
            Some(RopeScaling::Yarn(y)) => {
                y.apply(&mut inv, rot_dim, base);
                scale = y.concentration();
            }
            Some(RopeScaling::Linear(factor)) => inv.iter_mut().for_each(|f| *f /= factor),
        }
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv {
                let a = p as f64 * f;
                cos.push((a.cos() * scale) as f32);
                sin.push((a.sin() * scale) as f32);
            }
        }
        RopeTable {
            rot_dim,
            positions,
            cos,
            sin,
        }
    }
}

/// Layout of the fused QKV rows and the positions of the tokens.
#[derive(Clone, Copy, Debug)]
pub struct RopeDims {
    /// Tokens per sequence: row `r` holds position `first_pos + r % t`.
    pub t: usize,
    pub groups: usize,
    pub q_per_group: usize,
    pub head_dim: usize,
    pub first_pos: usize,
    pub style: RopeStyle,
}

impl RopeDims {
    fn row(&self) -> usize {
        self.groups * (self.q_per_group + 2) * self.head_dim
    }
}

/// Rotates the queries and keys of `qkv` (`[rows, groups * (q_per_group + 2) * head_dim]`).
pub fn rope_forward(qkv: &mut [f32], table: &RopeTable, d: RopeDims) {
    rope_apply(qkv, table, d, 1.0)
}

/// Rotates the query and key gradients of `dqkv` back (the transpose of [`rope_forward`]); the
/// value gradients are untouched.
pub fn rope_backward(dqkv: &mut [f32], table: &RopeTable, d: RopeDims) {
    rope_apply(dqkv, table, d, -1.0)
}

fn rope_apply(qkv: &mut [f32], table: &RopeTable, d: RopeDims, sign: f32) {
    let row = d.row();
    assert_eq!(qkv.len() % row, 0);
    assert!(table.rot_dim <= d.head_dim);
    let rows = qkv.len() / row;
    if rows > 0 {
        assert!(
            d.first_pos + d.t.min(rows) <= table.positions,
            "rotary table holds {} positions, rows need {}",
            table.positions,
            d.first_pos + d.t.min(rows)
        );
    }
    let half = table.rot_dim / 2;
    qkv.par_chunks_mut(ROWS_PER_TASK * row)
        .enumerate()
        .for_each(|(task, chunk)| {
            for (i, r) in chunk.chunks_exact_mut(row).enumerate() {
                let pos = d.first_pos + (task * ROWS_PER_TASK + i) % d.t;
                let cos = &table.cos[pos * half..(pos + 1) * half];
                let sin = &table.sin[pos * half..(pos + 1) * half];
                for g in r.chunks_exact_mut((d.q_per_group + 2) * d.head_dim) {
                    // The group's query heads and its key head; not its value head.
                    for head in g[..(d.q_per_group + 1) * d.head_dim].chunks_exact_mut(d.head_dim) {
                        rotate(head, cos, sin, sign, d.style);
                    }
                }
            }
        });
}

#[inline(always)]
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], sign: f32, style: RopeStyle) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = match style {
            RopeStyle::RotateHalf => (i, i + half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let (c, s) = (cos[i], sign * sin[i]);
        let (xa, xb) = (x[a], x[b]);
        x[a] = xa * c - xb * s;
        x[b] = xb * c + xa * s;
    }
}
