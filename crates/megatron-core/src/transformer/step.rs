use megatron_tensor::RngKey;

/// What varies per micro-batch and is not data: whether dropout is on and which random stream
/// it draws from. Keys are (seed, iteration, micro-batch) so a resumed run redraws the same masks.
#[derive(Clone, Copy, Debug)]
pub struct StepContext {
    pub training: bool,
    pub key: RngKey,
}

impl StepContext {
    pub fn train(seed: u64, iteration: u64, microbatch: u64) -> Self {
        StepContext {
            training: true,
            key: RngKey::new(seed)
                .fold(0xD0)
                .fold(iteration)
                .fold(microbatch),
        }
    }

    pub fn eval() -> Self {
        StepContext {
            training: false,
            key: RngKey::new(0),
        }
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
