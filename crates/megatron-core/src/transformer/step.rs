use megatron_tensor::RngKey;

/// What varies per micro-batch and is not data: whether dropout is on and which random stream
/// it draws from. Streams are keyed by (seed, iteration) and numbered by the global index of the
/// micro-batch's first sample, so a sample gets the same dropout masks however the global batch
/// is split into micro-batches and data-parallel ranks, and a resumed run redraws them exactly.
#[derive(Clone, Copy, Debug)]
pub struct StepContext {
    pub training: bool,
    pub key: RngKey,
    /// Global index of this micro-batch's first sample (samples are consecutive).
    pub first_sample: u64,
    /// The factor the loss gradient is scaled by (1 / micro-batches, times the loss scale):
    /// auxiliary losses inside the model (MoE load balancing) scale theirs the same.
    pub grad_scale: f32,
}

impl StepContext {
    pub fn train(seed: u64, iteration: u64, first_sample: u64) -> Self {
        StepContext {
            training: true,
            key: RngKey::new(seed).fold(0xD0).fold(iteration),
            first_sample,
            grad_scale: 1.0,
        }
    }

    pub fn eval() -> Self {
        StepContext {
            training: false,
            key: RngKey::new(0),
            first_sample: 0,
            grad_scale: 1.0,
        }
    }

    /// The same context with the loss gradient's scale.
    pub fn with_grad_scale(self, grad_scale: f32) -> Self {
        StepContext { grad_scale, ..self }
    }

    /// Key for one dropout site of one layer whose tensor holds `per_sample` elements per sample.
    pub fn site_for(&self, layer: usize, site: u64, per_sample: usize) -> RngKey {
        self.site(layer, site)
            .offset(self.first_sample * per_sample as u64)
    }

    /// Dropout probability to use: zero outside training.
    pub fn p(&self, p: f32) -> f32 {
        if self.training {
            p
        } else {
            0.0
        }
    }

    /// Key for one dropout site of one layer.
    pub fn site(&self, layer: usize, site: u64) -> RngKey {
        self.key.fold(layer as u64).fold(site)
    }
}
