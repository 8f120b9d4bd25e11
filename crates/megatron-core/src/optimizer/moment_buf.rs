//! Megatron's precision-aware optimizer state (`--use-precision-aware-optimizer
//! --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`): a moment kept in bf16 takes half the bytes
//! of f32. As in Transformer Engine's FusedAdam, the dtype is storage only: every step reads the
//! stored values widened to f32, runs the f32 update, and rounds the new values back (to
//! nearest, ties to even). Checkpoints hold the widened f32 values, so a resumed run reads back
//! exactly what it stored and the checkpoint format does not change.

use super::UpdateRule;
use half::bf16;
use megatron_tensor::cpu::{adamw_update_bf16_moments, AdamWParams};
use std::borrow::Cow;
use std::ops::Range;

/// How one moment is stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MomentDtype {
    #[default]
    F32,
    Bf16,
}

impl MomentDtype {
    pub fn bytes(self) -> usize {
        match self {
            MomentDtype::F32 => 4,
            MomentDtype::Bf16 => 2,
        }
    }
}

/// The storage of each moment of the update rule: Adam's `exp_avg` and `exp_avg_sq`
/// (`--exp-avg-dtype`, `--exp-avg-sq-dtype`); SGD's momentum buffer follows `exp_avg`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MomentDtypes {
    pub exp_avg: MomentDtype,
    pub exp_avg_sq: MomentDtype,
}

impl MomentDtypes {
    pub fn of(self, m: super::Moment) -> MomentDtype {
        match m {
            super::Moment::ExpAvgSq | super::Moment::Moment2Buffer => self.exp_avg_sq,
            super::Moment::ExpAvg | super::Moment::MomentumBuffer => self.exp_avg,
        }
    }

    /// Zeroed state for `n` elements, one buffer per moment of `rule`.
    pub fn new_state(self, rule: UpdateRule, n: usize) -> Vec<MomentBuf> {
        rule.moments()
            .iter()
            .map(|&m| MomentBuf::zeros(n, self.of(m)))
            .collect()
    }
}

/// One moment over a rank's elements.
#[derive(Clone, Debug)]
pub enum MomentBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl MomentBuf {
    pub fn zeros(n: usize, dtype: MomentDtype) -> Self {
        match dtype {
            MomentDtype::F32 => MomentBuf::F32(vec![0.0; n]),
            MomentDtype::Bf16 => MomentBuf::Bf16(vec![bf16::ZERO; n]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            MomentBuf::F32(v) => v.len(),
            MomentBuf::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        match self {
            MomentBuf::F32(v) => v.capacity() * 4,
            MomentBuf::Bf16(v) => v.capacity() * 2,
        }
    }

    /// Elements `r` as f32: borrowed when stored so, widened otherwise (checkpoints).
    pub fn f32s(&self, r: Range<usize>) -> Cow<'_, [f32]> {
        match self {
            MomentBuf::F32(v) => Cow::Borrowed(&v[r]),
            MomentBuf::Bf16(v) => Cow::Owned(v[r].iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// Stores `src` (f32) at elements starting at `at`, rounding when stored in bf16.
    pub fn store(&mut self, at: usize, src: &[f32]) {
        match self {
            MomentBuf::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            MomentBuf::Bf16(v) => {
                for (d, s) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = bf16::from_f32(*s);
                }
            }
        }
    }

    /// The f32 storage of every buffer, when all are stored in f32 (the update's fast path).
    fn all_f32(bufs: &mut [MomentBuf]) -> Option<Vec<&mut Vec<f32>>> {
        bufs.iter_mut()
            .map(|b| match b {
                MomentBuf::F32(v) => Some(v),
                MomentBuf::Bf16(_) => None,
            })
            .collect()
    }
}

/// Elements the bf16 path widens at a time: a little scratch (never the whole shard in f32,
/// which would undo the saving), and several of the update kernel's parallel chunks inside.
const WIDEN: usize = 1 << 18;

/// Runs `rule` on `values` and `grads` with `state` the moments at elements `s` (the same
/// length), whatever their storage. Element by element the same arithmetic as the f32 path:
/// only the stored moments are rounded. Adam with both moments in bf16 runs the backend's fused
/// kernel; any other mix widens a block at a time.
#[allow(clippy::too_many_arguments)]
pub fn apply_rule(
    rule: UpdateRule,
    values: &mut [f32],
    grads: &[f32],
    state: &mut [MomentBuf],
    s: Range<usize>,
    lr: f32,
    weight_decay: f32,
    step: u64,
) {
    if let Some(f32s) = MomentBuf::all_f32(state) {
        let mut slices: Vec<&mut [f32]> = f32s.into_iter().map(|v| &mut v[s.clone()]).collect();
        rule.apply(values, grads, &mut slices, lr, weight_decay, step);
        return;
    }
    // Both of Adam's moments in bf16 (the flags' usual pair): the backend's fused pass.
    if let (UpdateRule::Adam { beta1, beta2, eps }, [MomentBuf::Bf16(m), MomentBuf::Bf16(v)]) =
        (rule, &mut *state)
    {
        let h = AdamWParams {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
        };
        adamw_update_bf16_moments(values, grads, &mut m[s.clone()], &mut v[s], h);
        return;
    }
    let mut scratch: Vec<Vec<f32>> = vec![Vec::with_capacity(WIDEN.min(values.len())); state.len()];
    for (b, (v, g)) in values
        .chunks_mut(WIDEN)
        .zip(grads.chunks(WIDEN))
        .enumerate()
    {
        let at = s.start + b * WIDEN;
        for (m, buf) in scratch.iter_mut().zip(state.iter()) {
            m.clear();
            match buf {
                MomentBuf::F32(x) => m.extend_from_slice(&x[at..at + v.len()]),
                MomentBuf::Bf16(x) => m.extend(x[at..at + v.len()].iter().map(|y| y.to_f32())),
            }
        }
        let mut slices: Vec<&mut [f32]> = scratch.iter_mut().map(|m| &mut m[..]).collect();
        rule.apply(v, g, &mut slices, lr, weight_decay, step);
        for (buf, m) in state.iter_mut().zip(&scratch) {
            buf.store(at, m);
        }
    }
}
