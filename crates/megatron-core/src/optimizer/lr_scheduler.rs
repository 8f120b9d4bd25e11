//! Megatron's `OptimizerParamScheduler` (learning rate part). Steps are counted in samples, like
//! Megatron: each successful iteration adds the global batch size.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LrDecayStyle {
    Constant,
    Linear,
    Cosine,
    InverseSquareRoot,
    WSD,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WsdDecayStyle {
    Linear,
    Cosine,
    Exponential,
    MinusSqrt,
}

impl LrDecayStyle {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "constant" => Self::Constant,
            "linear" => Self::Linear,
            "cosine" => Self::Cosine,
            "inverse-square-root" => Self::InverseSquareRoot,
            "WSD" | "wsd" => Self::WSD,
            _ => return None,
        })
    }
}

impl WsdDecayStyle {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "linear" => Self::Linear,
            "cosine" => Self::Cosine,
            "exponential" => Self::Exponential,
            "minus_sqrt" => Self::MinusSqrt,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerParamScheduler {
    pub init_lr: f64,
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub decay_style: LrDecayStyle,
    pub wsd_decay_steps: u64,
    pub wsd_decay_style: WsdDecayStyle,
    pub num_steps: u64,
}

impl OptimizerParamScheduler {
    pub fn get_lr(&self) -> f64 {
        self.get_lr_in(self.max_lr, self.min_lr)
    }

    /// The learning rate of a parameter group with its own peak and floor on this schedule's
    /// warm-up and decay (Megatron's `get_lr(param_group)`: `--decoupled-lr`).
    pub fn get_lr_in(&self, max_lr: f64, min_lr: f64) -> f64 {
        let n = self.num_steps as f64;
        let warm = self.warmup_steps as f64;
        if self.warmup_steps > 0 && self.num_steps <= self.warmup_steps {
            return self.init_lr + (max_lr - self.init_lr) * n / warm;
        }
        if self.decay_style == LrDecayStyle::Constant {
            return max_lr;
        }
        if self.num_steps > self.decay_steps {
            return min_lr;
        }
        if self.decay_style == LrDecayStyle::InverseSquareRoot {
            let w = warm.max(1.0);
            let lr = max_lr * w.sqrt() / n.max(1.0).sqrt();
            return lr.max(min_lr);
        }
        let decay = (self.decay_steps - self.warmup_steps) as f64;
        let ratio = if decay > 0.0 { (n - warm) / decay } else { 1.0 };
        let delta = max_lr - min_lr;
        let coeff = match self.decay_style {
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
            LrDecayStyle::WSD => {
                let anneal_start = self.decay_steps.saturating_sub(self.wsd_decay_steps);
                if self.num_steps <= anneal_start {
                    1.0
                } else {
                    let r = (n - anneal_start as f64) / self.wsd_decay_steps.max(1) as f64;
                    match self.wsd_decay_style {
                        WsdDecayStyle::Linear => 1.0 - r,
                        WsdDecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * r).cos() + 1.0),
                        WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
                        WsdDecayStyle::MinusSqrt => 1.0 - r.sqrt(),
                    }
                }
            }
            LrDecayStyle::Constant | LrDecayStyle::InverseSquareRoot => unreachable!(),
        };
        min_lr + coeff * delta
    }

    pub fn step(&mut self, increment: u64) {
        self.num_steps += increment;
    }
}
