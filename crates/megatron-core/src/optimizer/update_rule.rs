//! Megatron's `--optimizer`: the element-wise update both the replicated and the distributed
//! optimizer apply to the values they own, and the moments it keeps per element. The optimizers
//! own the buckets, shards and gathers; which update runs is chosen here, once.

use megatron_tensor::cpu::{
    adamw_update, lion_update, sgd_update, AdamWParams, LionParams, SgdParams,
};

/// A per-element state tensor an update rule keeps, named as torch's optimizer state (and so in
/// checkpoints: `optimizer.{name}.{parameter}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    ExpAvg,
    ExpAvgSq,
    MomentumBuffer,
    /// AdaMuon's EMA of the orthogonalized update's squares (`--optimizer adaptive_muon`).
    Moment2Buffer,
}

impl Moment {
    pub fn name(self) -> &'static str {
        match self {
            Moment::ExpAvg => "exp_avg",
            Moment::ExpAvgSq => "exp_avg_sq",
            Moment::MomentumBuffer => "momentum_buffer",
            Moment::Moment2Buffer => "moment2_buffer",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UpdateRule {
    /// AdamW (megatron-core's `adam`): decoupled weight decay, bias correction.
    Adam { beta1: f32, beta2: f32, eps: f32 },
    /// torch's SGD with momentum (megatron-core's `sgd`): L2 weight decay.
    Sgd { momentum: f32 },
    /// Lion (megatron-core's `lion`): sign updates, one moment, decoupled weight decay.
    Lion { beta1: f32, beta2: f32 },
}

impl UpdateRule {
    /// The state kept per element, in the order [`UpdateRule::apply`] takes it.
    pub fn moments(self) -> &'static [Moment] {
        match self {
            UpdateRule::Adam { .. } => &[Moment::ExpAvg, Moment::ExpAvgSq],
            UpdateRule::Sgd { momentum: 0.0 } => &[],
            UpdateRule::Sgd { .. } => &[Moment::MomentumBuffer],
            UpdateRule::Lion { .. } => &[Moment::ExpAvg],
        }
    }

    /// Megatron's name (`--optimizer`).
    pub fn name(self) -> &'static str {
        match self {
            UpdateRule::Adam { .. } => "adam",
            UpdateRule::Sgd { .. } => "sgd",
            UpdateRule::Lion { .. } => "lion",
        }
    }

    /// Zeroed state for `n` elements: one vector per moment.
    pub fn new_state(self, n: usize) -> Vec<Vec<f32>> {
        self.moments().iter().map(|_| vec![0.0; n]).collect()
    }

    /// Updates `values` from `grads`, with `state` the same elements of each moment and `step`
    /// the 1-based optimizer step.
    pub fn apply(
        self,
        values: &mut [f32],
        grads: &[f32],
        state: &mut [&mut [f32]],
        lr: f32,
        weight_decay: f32,
        step: u64,
    ) {
        match (self, state) {
            (UpdateRule::Adam { beta1, beta2, eps }, [m, v]) => adamw_update(
                values,
                grads,
                m,
                v,
                AdamWParams {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    step,
                },
            ),
            (UpdateRule::Sgd { momentum }, state) => {
                let mut none: [f32; 0] = [];
                let buf = match state {
                    [b] => &mut **b,
                    [] => &mut none[..],
                    _ => panic!("SGD keeps at most one moment"),
                };
                sgd_update(
                    values,
                    grads,
                    buf,
                    SgdParams {
                        lr,
                        momentum,
                        weight_decay,
                    },
                )
            }
            (UpdateRule::Lion { beta1, beta2 }, [m]) => lion_update(
                values,
                grads,
                m,
                LionParams {
                    lr,
                    beta1,
                    beta2,
                    weight_decay,
                },
            ),
            (rule, state) => panic!("{rule:?} given {} moments", state.len()),
        }
    }
}
