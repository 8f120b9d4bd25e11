use crate::params::Grads;
use megatron_tensor::cpu::{global_norm_squared, scale_inplace};

/// Global L2 norm of all gradients.
pub fn get_grad_norm(grads: &Grads) -> f64 {
    global_norm_squared(&grads.data).sqrt()
}

/// Megatron's `clip_grad_norm_fp32`: scales gradients by `max_norm / (norm + 1e-6)` when that
/// is below one. Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut Grads, max_norm: f32) -> f64 {
    let norm = get_grad_norm(grads);
    if max_norm > 0.0 {
        let coeff = max_norm as f64 / (norm + 1e-6);
        if coeff < 1.0 {
            scale_inplace(&mut grads.data, coeff as f32);
        }
    }
    norm
}

/// Scales gradients by `max_norm / (norm + 1e-6)` when that is below one, for a norm computed
/// elsewhere (over tensor-parallel shards: `tensor_parallel::grad_norm_tp`).
pub fn clip_grads_by_norm(grads: &mut Grads, norm: f64, max_norm: f32) {
    if max_norm > 0.0 {
        let coeff = max_norm as f64 / (norm + 1e-6);
        if coeff < 1.0 {
            scale_inplace(&mut grads.data, coeff as f32);
        }
    }
}
