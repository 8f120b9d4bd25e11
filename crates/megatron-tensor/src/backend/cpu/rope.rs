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

/// Llama 3.1's frequency scaling (`--use-rope-scaling`): long wavelengths are divided by
/// `factor`, short ones kept, the band between blended smoothly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position: f64,
}

impl RopeScaling {
    /// Megatron's and Llama 3.1's constants with the given factor (Megatron's default 8).
    pub fn llama3(factor: f64) -> Self {
        RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        }
    }

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
        let inv: Vec<f64> = (0..half)
            .map(|i| {
                let f = base.powf(-((2 * i) as f64) / rot_dim as f64);
                scaling.map_or(f, |s| s.apply(f))
            })
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
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
