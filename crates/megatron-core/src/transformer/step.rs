use megatron_tensor::RngKey;

/// Activation recomputation (Megatron's `--recompute-granularity`, `--recompute-method`,
/// `--recompute-num-layers`, `--recompute-modules`): what a training forward does not keep,
/// and backward recomputes from what it kept. An execution policy, not part of the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    #[default]
    None,
    /// Whole layers: only the input of each group of layers is kept.
    Full {
        method: RecomputeMethod,
        num_layers: usize,
    },
    /// Parts of each layer.
    Selective(SelectiveModules),
}

/// `--recompute-method`: `uniform` keeps the input of every `num_layers` consecutive layers
/// of a chunk and recomputes each group whole; `block` recomputes the first `num_layers`
/// layers of the chunk one by one and keeps the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeMethod {
    Uniform,
    Block,
}

/// `--recompute-modules` that change what is kept (`layernorm` and `moe_act` outputs are
/// never kept here: they are recomputed by design).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SelectiveModules {
    /// The attention output and its log-sum-exp: recomputed from the kept QKV.
    pub core_attn: bool,
    /// The dense MLP's fc1 output: recomputed from the (recomputed) LayerNorm output.
    pub mlp: bool,
}

/// How a micro-batch's language-model loss turns into its gradient (Megatron's
/// `--calculate-per-token-loss`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LossReduction {
    /// Each micro-batch's mean over its counted tokens (Megatron's default): a micro-batch
    /// with few counted tokens weighs as much as a full one.
    #[default]
    MicroBatchMean,
    /// The sum over counted tokens; the trainer's `grad_scale` divides by the global batch's
    /// token count, so every token of the global batch weighs the same.
    TokenSum,
}

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
    pub recompute: Recompute,
    pub loss_reduction: LossReduction,
    /// A forward run again in backward (full recomputation): the same results, without side
    /// effects that must happen once per step (MoE routing statistics).
    pub recomputing: bool,
}

impl StepContext {
    pub fn train(seed: u64, iteration: u64, first_sample: u64) -> Self {
        StepContext {
            training: true,
            key: RngKey::new(seed).fold(0xD0).fold(iteration),
            first_sample,
            grad_scale: 1.0,
            recompute: Recompute::None,
            loss_reduction: LossReduction::MicroBatchMean,
            recomputing: false,
        }
    }

    pub fn eval() -> Self {
        StepContext {
            training: false,
            key: RngKey::new(0),
            first_sample: 0,
            grad_scale: 1.0,
            recompute: Recompute::None,
            loss_reduction: LossReduction::MicroBatchMean,
            recomputing: false,
        }
    }

    /// The same context with the language-model loss reduced as `loss_reduction` says.
    pub fn with_loss_reduction(self, loss_reduction: LossReduction) -> Self {
        StepContext {
            loss_reduction,
            ..self
        }
    }

    /// The same context with the loss gradient's scale.
    pub fn with_grad_scale(self, grad_scale: f32) -> Self {
        StepContext { grad_scale, ..self }
    }

    /// The same context recomputing activations as `recompute` says.
    pub fn with_recompute(self, recompute: Recompute) -> Self {
        StepContext { recompute, ..self }
    }

    /// The context of a forward run again in backward.
    pub fn recomputing(self) -> Self {
        StepContext {
            recomputing: true,
            ..self
        }
    }

    /// Selective recomputation of these modules applies to this forward (not to a forward
    /// that is itself a recomputation, whose results backward uses right away).
    pub fn drops(&self, which: fn(&SelectiveModules) -> bool) -> bool {
        match self.recompute {
            Recompute::Selective(m) => self.training && !self.recomputing && which(&m),
            _ => false,
        }
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
