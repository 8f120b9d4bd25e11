//! Loss scaling for fp16 (Megatron's `grad_scaler.py`): the loss is multiplied by the scale
//! before backward and the gradients divided by it after; a step whose gradients overflowed is
//! skipped (optimizer and LR scheduler) and the scale backs off.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum GradScaler {
    /// `--loss-scale S`.
    Constant { scale: f32 },
    /// Megatron's `DynamicGradScaler`.
    Dynamic {
        scale: f32,
        min_scale: f32,
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: u32,
        hysteresis: u32,
        growth_tracker: u32,
        hysteresis_tracker: u32,
    },
}

impl GradScaler {
    pub fn dynamic(initial: f32, min_scale: f32, window: u32, hysteresis: u32) -> Self {
        GradScaler::Dynamic {
            scale: initial,
            min_scale,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: window,
            hysteresis,
            growth_tracker: 0,
            hysteresis_tracker: hysteresis,
        }
    }

    pub fn scale(&self) -> f32 {
        match self {
            GradScaler::Constant { scale } | GradScaler::Dynamic { scale, .. } => *scale,
        }
    }

    /// After a step: `found_inf` if any gradient overflowed (that step is skipped).
    pub fn update(&mut self, found_inf: bool) {
        let GradScaler::Dynamic {
            scale,
            min_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            growth_tracker,
            hysteresis_tracker,
        } = self
        else {
            return;
        };
        if found_inf {
            *growth_tracker = 0;
            *hysteresis_tracker = hysteresis_tracker.saturating_sub(1);
            if *hysteresis_tracker == 0 {
                *scale = (*scale * *backoff_factor).max(*min_scale);
            }
        } else {
            *growth_tracker += 1;
            if *growth_tracker == *growth_interval {
                *growth_tracker = 0;
                *hysteresis_tracker = *hysteresis;
                *scale *= *growth_factor;
            }
        }
    }
}
