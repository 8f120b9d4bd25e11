//! One rank's setup (Megatron's `setup_model_and_optimizer` and its helpers): the communicators
//! it trains with, the precision of every matmul it issues, the model chunks of its pipeline
//! stage, the optimizer behind the one interface, and a checkpoint restored into them. The
//! flags are read here, once, into typed settings; the loop below reads no raw flag strings.

use crate::arguments::{Bf16KernelArg, NoWeightDecayCond, OptimizerKind, Precision, TrainConfig};
use crate::checkpointing::{load_into, load_optimizer_state};
use crate::TrainError;
use megatron_comm::{Communicator, ProcessGroups, ReduceOp, ThreadCommunicator};
use megatron_core::distributed::{ExpertGrads, GradBuffer, ParamGroup};
use megatron_core::models::{ModelChunk, ModelFamily};
use megatron_core::optimizer::{
    layer_wise_placement, DistributedOptimizer, GradScaler, LayerWiseDistributedOptimizer,
    MegatronOptimizer, MuonOptimizer, OptimizerParamScheduler, PlainOptimizer,
};
use megatron_core::params::ExpertLayout;
use megatron_core::pipeline_parallel::build_stage;
use megatron_core::tensor_parallel::Tp;
use megatron_core::Params;
use megatron_tensor::cpu::matmul::{
    set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulPrecision,
};
use std::ops::Range;

/// This rank's communicators: its tensor-parallel group (as `Tp`), pipeline group, data-parallel
/// group (`None` on a single data-parallel rank) and embedding group (first and last stages of
/// a tied model).
pub(crate) struct RankComms<'a> {
    pub tp: Tp<'a>,
    pub pp: &'a mut dyn Communicator,
    pub dp: Option<&'a mut dyn Communicator>,
    pub embedding: Option<&'a mut dyn Communicator>,
    pub world_rank: usize,
    /// Context-parallel size: `dp` is then the data-and-context-parallel group.
    pub cp_size: usize,
    /// (rank, size) in the expert-parallel and expert-tensor-parallel groups.
    pub ep_rank_size: (usize, usize),
    pub etp_rank_size: (usize, usize),
    /// Expert-data-parallel group and the all-ranks group, when experts are laid out other
    /// than dense parameters (the optimizer takes them).
    pub expert_groups: Option<(Box<dyn Communicator>, Box<dyn Communicator>)>,
}

impl<'a> RankComms<'a> {
    /// From Megatron's process groups, or for one rank alone the two serial groups.
    pub fn new(
        groups: Option<&'a mut ProcessGroups>,
        serial_tp: &'a mut ThreadCommunicator,
        serial_pp: &'a mut ThreadCommunicator,
        sequence_parallel: bool,
        cp_comm: megatron_core::context_parallel::CpCommType,
    ) -> Self {
        match groups {
            Some(g) => {
                let world_rank = g.world_rank;
                let folded = g.state.experts_folded();
                let context_parallel = g.state.cp > 1;
                let cp_comm_type = cp_comm;
                let ProcessGroups {
                    tp,
                    dp,
                    pp,
                    cp,
                    dp_cp,
                    ep,
                    etp,
                    edp,
                    expert_norm,
                    embedding,
                    ..
                } = g;
                // Under context parallelism gradients and losses are reduced over the data-
                // and context-parallel ranks together (Megatron's `dp-cp` group), which the
                // distributed optimizer also shards over.
                let dp = if context_parallel { dp_cp } else { dp };
                let expert_groups = match (folded, edp.take(), expert_norm.take()) {
                    (true, Some(e), Some(a)) => Some((e.comm, a.comm)),
                    _ => None,
                };
                RankComms {
                    cp_size: if context_parallel { cp.comm.size() } else { 1 },
                    ep_rank_size: (ep.comm.rank(), ep.comm.size()),
                    etp_rank_size: (etp.comm.rank(), etp.comm.size()),
                    expert_groups,
                    tp: Tp::new(tp.comm.as_mut(), sequence_parallel)
                        .with_expert_parallel(ep.comm.as_mut(), etp.comm.as_mut())
                        .with_context_parallel(cp.comm.as_mut(), cp_comm_type),
                    pp: pp.comm.as_mut(),
                    dp: Some(dp.comm.as_mut()),
                    embedding: embedding
                        .as_mut()
                        .map(|e| e.comm.as_mut() as &mut dyn Communicator),
                    world_rank,
                }
            }
            None => RankComms {
                tp: Tp::new(serial_tp, sequence_parallel),
                pp: serial_pp,
                dp: None,
                embedding: None,
                world_rank: 0,
                cp_size: 1,
                ep_rank_size: (0, 1),
                etp_rank_size: (0, 1),
                expert_groups: None,
            },
        }
    }

    pub fn dp_rank_size(&self) -> (usize, usize) {
        self.dp.as_ref().map_or((0, 1), |c| (c.rank(), c.size()))
    }

    /// (rank, size) among the data-parallel replicas, which read different samples (the
    /// context-parallel ranks of a replica read the same ones).
    pub fn data_rank_size(&self) -> (usize, usize) {
        let (r, n) = self.dp_rank_size();
        (r / self.cp_size, n / self.cp_size)
    }

    /// This rank's place in its context-parallel group.
    pub fn cp_layout(&self) -> megatron_core::context_parallel::CpLayout {
        self.tp.cp_layout()
    }

    /// Max of a flag over the whole world.
    pub fn world_max(&mut self, flag: f32) -> Result<f32, TrainError> {
        let mut v = [flag];
        self.world_reduce(&mut v, ReduceOp::Max)?;
        Ok(v[0])
    }

    /// `v` reduced by `op` over the whole world: over TP, then PP (every rank with this DP
    /// index), then DP (with CP); every rank calls it.
    pub fn world_reduce(&mut self, v: &mut [f32], op: ReduceOp) -> Result<(), TrainError> {
        self.tp.comm.all_reduce(v, op)?;
        self.pp.all_reduce(v, op)?;
        if let Some(dp) = self.dp.as_deref_mut() {
            dp.all_reduce(v, op)?;
        }
        Ok(())
    }

    /// Rank 0 of the data-, tensor- and pipeline-parallel groups: it reports and saves.
    pub fn lead(&self) -> bool {
        self.dp_rank_size().0 == 0 && self.tp.rank() == 0 && self.pp.rank() == 0
    }
}

/// The bf16 instructions `--bf16-matmul-kernel` asks for, `auto` measured in this process
/// (before the world agrees on the least capable choice).
pub(crate) fn requested_bf16_kernel(cfg: &TrainConfig) -> Bf16Kernel {
    match cfg.args.bf16_matmul_kernel {
        Bf16KernelArg::Dot => Bf16Kernel::Dot,
        Bf16KernelArg::Fma => Bf16Kernel::Fma,
        Bf16KernelArg::Amx => Bf16Kernel::Amx,
        Bf16KernelArg::Auto if cfg.precision == Precision::BF16 => {
            megatron_tensor::cpu::fastest_bf16_kernel()
        }
        Bf16KernelArg::Auto => Bf16Kernel::Fma,
    }
}

/// Sets the precision of every matmul this rank's thread issues, and the bf16 instructions:
/// measured per process under `auto`, then one choice for the whole world (processes measure
/// separately; one summation order keeps TP-replicated computations identical on every rank).
pub(crate) fn set_precision(cfg: &TrainConfig, comms: &mut RankComms) -> Result<(), TrainError> {
    set_matmul_precision(MatmulPrecision::of(cfg.precision.half()));
    let bf16 = cfg.precision == Precision::BF16;
    let mut kernel = requested_bf16_kernel(cfg);
    if cfg.args.sequence_parallel && comms.tp.size() == 1 && comms.world_rank == 0 {
        // As Megatron: sequence parallelism needs tensor-parallel ranks to split over.
        println!("note: --sequence-parallel has no effect with --tensor-model-parallel-size 1");
    }
    if bf16 && cfg.args.bf16_matmul_kernel == Bf16KernelArg::Auto {
        // The least capable choice of any process: a CPU with AMX has the dot-product
        // instruction, and every CPU has the FMA path.
        let rank = |k: Bf16Kernel| match k {
            Bf16Kernel::Fma => 0.0f32,
            Bf16Kernel::Dot => 1.0,
            Bf16Kernel::Amx => 2.0,
        };
        let mut choice = [rank(kernel)];
        comms.tp.comm.all_reduce(&mut choice, ReduceOp::Min)?;
        comms.pp.all_reduce(&mut choice, ReduceOp::Min)?;
        if let Some(c) = comms.dp.as_deref_mut() {
            c.all_reduce(&mut choice, ReduceOp::Min)?;
        }
        kernel = [Bf16Kernel::Fma, Bf16Kernel::Dot, Bf16Kernel::Amx]
            .into_iter()
            .find(|k| rank(*k) == choice[0])
            .unwrap_or(Bf16Kernel::Fma);
    }
    set_bf16_kernel(kernel);
    Ok(())
}

/// Where a restored run continues.
pub(crate) struct Restored {
    pub iteration: u64,
    pub consumed_samples: u64,
    /// Validation samples read so far (the next evaluation reads on from here).
    pub consumed_valid_samples: u64,
    pub scheduler_steps: u64,
    /// The checkpoint's learning-rate schedule, where the run continues it (not under
    /// --finetune or --no-load-optim, nor from a converted checkpoint, which has none).
    pub scheduler: Option<megatron_core::optimizer::OptimizerParamScheduler>,
    /// The checkpoint's loss scaler (itself `None` where it saved none), where the run
    /// continues its optimizer state, as the schedule.
    pub grad_scaler: Option<Option<GradScaler>>,
    /// Whether the run continues the checkpoint's or starts anew from its weights.
    pub mode: crate::checkpoint_policy::LoadMode,
    /// The checkpoint directory, for errors.
    pub dir: String,
}

/// This rank's model chunks, their parameters and the optimizer.
pub(crate) struct ModelAndOptimizer<C> {
    pub params: Params,
    pub chunks: Vec<C>,
    /// Each chunk's parameter indices (what `--overlap-grad-reduce` tracks).
    pub chunk_params: Vec<Range<usize>>,
    pub optimizer: Box<dyn MegatronOptimizer>,
    pub restored: Option<Restored>,
}

/// Builds this rank's chunks (its pipeline stage, its tensor-parallel shard), initializes them,
/// restores `--load`, then sets up 16-bit parameters and the optimizer, which takes its state
/// (moments, fp32 mains) from what was restored.
pub(crate) fn setup_model_and_optimizer<F: ModelFamily>(
    cfg: &TrainConfig,
    family: &F,
    comms: &mut RankComms,
    lead: bool,
) -> Result<ModelAndOptimizer<F::Chunk>, TrainError> {
    let a = &cfg.args;
    let (dp_rank, dp) = comms.dp_rank_size();
    let mut params = Params::for_tp_rank(comms.tp.rank(), comms.tp.size());
    params.experts = ExpertLayout {
        ep: comms.ep_rank_size.1,
        ep_rank: comms.ep_rank_size.0,
        etp: comms.etp_rank_size.1,
        etp_rank: comms.etp_rank_size.0,
    };
    let mut inits = Vec::new();
    let (chunks, chunk_params) = build_stage(
        family,
        &cfg.partition,
        comms.pp.rank(),
        &mut params,
        &mut inits,
    );
    params.initialize(a.seed, &inits);
    if cfg.no_weight_decay_cond == NoWeightDecayCond::OneDimAndBiasesExceptQkLayernorm {
        params.apply_weight_decay_to_qk_layernorm();
    }
    let distributed = cfg.optimizer == OptimizerKind::Distributed;
    let bucket_size = a.ddp_bucket_size.unwrap_or_else(|| {
        if a.overlap_grad_reduce || distributed {
            // Megatron's default bucket for overlapped communication.
            40_000_000usize.max(1_000_000 * dp)
        } else {
            usize::MAX
        }
    });
    // Under expert parallelism the experts get their own buckets over their own group.
    let expert = comms
        .expert_groups
        .take()
        .map(|(edp, all)| ExpertGrads::new(&params, bucket_size, distributed, dp, edp, all));
    let group = if expert.is_some() {
        ParamGroup::Dense
    } else {
        ParamGroup::All
    };
    let buffer = GradBuffer::new_for(&params, group, bucket_size, dp, dp_rank, distributed);
    // Parameters first (each rank reads its shards), then 16-bit copies and the optimizer,
    // which takes its fp32 mains from them and reads the moments it holds.
    let load_started = std::time::Instant::now();
    let (restored, mut reader) = match cfg.checkpoints.load.resolve(lead)? {
        Some(choice) => {
            let (r, reader) = load_into(cfg, choice, &mut params, lead)?;
            (Some(r), Some(reader))
        }
        None => (None, None),
    };
    if let Some(r) = reader.as_mut() {
        // Buffers (router expert biases) a checkpoint without them leaves at their start.
        for c in &chunks {
            for (name, _) in c.buffers() {
                if r.has(&name) {
                    c.load_buffer(&name, &r.read_whole(&name)?);
                }
            }
        }
    }
    // Under --bf16 / --fp16 the model reads a 16-bit copy; `params.data` becomes the fp32 main
    // parameters, which the distributed optimizer shards (then `params.data` is freed).
    let half = cfg.precision.half();
    params.set_half(half);
    let rule = cfg.update_rule;
    let mut optimizer: Box<dyn MegatronOptimizer> = match (cfg.optimizer, cfg.muon) {
        (_, Some(muon)) => {
            // Muon gathers (or reduces) whole matrices over TP in its step, on its own copies
            // of the groups.
            let own = |c: &mut dyn Communicator| -> Result<_, TrainError> {
                Ok((c.size() > 1)
                    .then(|| {
                        let name = format!("{}.muon", c.name());
                        c.split_named(0, c.rank(), &name)
                    })
                    .transpose()?)
            };
            let tp = own(comms.tp.comm)?;
            let etp = match comms.tp.etp.as_deref_mut() {
                Some(c) => own(c)?,
                None => None,
            };
            if distributed {
                // megatron-core's layer-wise distributed optimizer: whole matrices per DP rank.
                let buffer = buffer.into_layer_wise(&params, layer_wise_placement);
                let expert = expert.map(|mut e| {
                    e.buffer = e.buffer.into_layer_wise(&params, layer_wise_placement);
                    e
                });
                Box::new(LayerWiseDistributedOptimizer::new(
                    &params, muon, buffer, expert, tp, etp,
                ))
            } else {
                let muon = MuonOptimizer::new(&params, muon, buffer, tp, etp);
                Box::new(match expert {
                    Some(e) => muon.with_experts(e),
                    None => muon,
                })
            }
        }
        (OptimizerKind::Replicated, None) => {
            let plain = PlainOptimizer::new(&params, rule, buffer);
            Box::new(match expert {
                Some(e) => plain.with_experts(e),
                None => plain,
            })
        }
        (OptimizerKind::Distributed, None) => Box::new(
            DistributedOptimizer::new_with_experts(&params, buffer, expert, rule)
                .with_moment_dtypes(cfg.moment_dtypes),
        ),
    };
    let continues = restored
        .as_ref()
        .is_some_and(|r| r.mode == crate::checkpoint_policy::LoadMode::Resume);
    if let Some(r) = reader.as_mut().filter(|_| continues && !a.no_load_optim) {
        load_optimizer_state(r, &params, optimizer.as_mut())?;
        if lead {
            // Values of this rank's shards plus the moments it holds, 4 bytes each.
            let bytes = (params.numel() + optimizer.state_elements()) * 4;
            let secs = load_started.elapsed().as_secs_f64();
            println!(
                "read this rank's shards of the checkpoint in {secs:.2} s ({:.1} MB, {:.2} GB/s)",
                bytes as f64 / 1e6,
                bytes as f64 / secs / 1e9
            );
        }
    }
    if distributed && half.is_some() {
        params.data = Vec::new();
    }
    Ok(ModelAndOptimizer {
        params,
        chunks,
        chunk_params,
        optimizer,
        restored,
    })
}

/// The schedule a resumed run continues: the flags' where they agree with the checkpoint's, or
/// as `--override-opt_param-scheduler` / `--use-checkpoint-opt_param-scheduler` say; a
/// difference is refused otherwise, naming each field (Megatron's `_check_and_set`).
pub(crate) fn resumed_scheduler(
    cfg: &TrainConfig,
    r: &Restored,
) -> Result<OptimizerParamScheduler, TrainError> {
    use crate::arguments::SchedulerOnLoad;
    let mut flags = scheduler(cfg);
    flags.num_steps = r.scheduler_steps;
    let Some(saved) = &r.scheduler else {
        return Ok(flags);
    };
    match cfg.scheduler_on_load {
        SchedulerOnLoad::Override => Ok(flags),
        SchedulerOnLoad::UseCheckpoint => Ok(saved.clone()),
        SchedulerOnLoad::Check => {
            let fields = [
                ("initial learning rate", flags.init_lr, saved.init_lr),
                ("learning rate", flags.max_lr, saved.max_lr),
                ("minimum learning rate", flags.min_lr, saved.min_lr),
                (
                    "warm-up samples",
                    flags.warmup_steps as f64,
                    saved.warmup_steps as f64,
                ),
                (
                    "decay samples",
                    flags.decay_steps as f64,
                    saved.decay_steps as f64,
                ),
                (
                    "WSD decay samples",
                    flags.wsd_decay_steps as f64,
                    saved.wsd_decay_steps as f64,
                ),
            ];
            let mut diffs: Vec<String> = fields
                .iter()
                .filter(|(_, f, s)| f != s)
                .map(|(name, f, s)| format!("{name} {f} from the flags, {s} in the checkpoint"))
                .collect();
            if flags.decay_style != saved.decay_style {
                diffs.push(format!(
                    "decay style {:?} from the flags, {:?} in the checkpoint",
                    flags.decay_style, saved.decay_style
                ));
            }
            if flags.wsd_decay_style != saved.wsd_decay_style {
                diffs.push(format!(
                    "WSD decay style {:?} from the flags, {:?} in the checkpoint",
                    flags.wsd_decay_style, saved.wsd_decay_style
                ));
            }
            if diffs.is_empty() {
                Ok(flags)
            } else {
                Err(TrainError::Checkpoint {
                    path: r.dir.clone(),
                    msg: format!(
                        "the learning-rate schedule differs from the one saved: {}; pass \
                         --override-opt_param-scheduler to follow the flags or \
                         --use-checkpoint-opt_param-scheduler to keep the checkpoint's",
                        diffs.join("; ")
                    ),
                })
            }
        }
    }
}

/// The learning-rate schedule in samples, as Megatron's `OptimizerParamScheduler`.
pub(crate) fn scheduler(cfg: &TrainConfig) -> OptimizerParamScheduler {
    OptimizerParamScheduler {
        init_lr: cfg.args.lr_warmup_init,
        max_lr: cfg.args.lr,
        min_lr: cfg.args.min_lr,
        warmup_steps: cfg.lr_warmup_samples,
        decay_steps: cfg.lr_decay_samples,
        decay_style: cfg.lr_decay_style,
        wsd_decay_steps: cfg.lr_wsd_decay_samples,
        wsd_decay_style: cfg.lr_wsd_decay_style,
        num_steps: 0,
    }
}

/// The loss scaler a run starts with: the flags' ([`grad_scaler`]), continuing a resumed
/// dynamic scaler's scale and trackers as Megatron's `DynamicGradScaler.load_state_dict` does
/// (the window, hysteresis and bounds stay the flags'). A checkpoint that holds none (saved by
/// a bf16/fp32 run, with a constant `--loss-scale`, or by an older megatron-rs) leaves the
/// scale at `--initial-loss-scale`, and the lead rank says so.
pub(crate) fn resumed_grad_scaler(
    cfg: &TrainConfig,
    restored: Option<&Restored>,
    lead: bool,
) -> Option<GradScaler> {
    let mut scaler = grad_scaler(cfg);
    let Some(GradScaler::Dynamic {
        scale,
        growth_tracker,
        hysteresis_tracker,
        ..
    }) = scaler.as_mut()
    else {
        return scaler;
    };
    // Only where the run continues the checkpoint's optimizer state.
    let Some((r, saved)) = restored.and_then(|r| r.grad_scaler.as_ref().map(|s| (r, s))) else {
        return scaler;
    };
    match saved {
        Some(GradScaler::Dynamic {
            scale: s,
            growth_tracker: g,
            hysteresis_tracker: h,
            ..
        }) => (*scale, *growth_tracker, *hysteresis_tracker) = (*s, *g, *h),
        _ if lead => println!(
            "checkpoint {} holds no dynamic loss-scaler state (saved without --fp16's dynamic \
             scaler, or by an older megatron-rs): the loss scale starts at \
             --initial-loss-scale {scale}",
            r.dir
        ),
        _ => {}
    }
    scaler
}

/// Loss scaling: a constant `--loss-scale`, Megatron's dynamic scaler under `--fp16`, or none.
pub(crate) fn grad_scaler(cfg: &TrainConfig) -> Option<GradScaler> {
    let a = &cfg.args;
    match (a.loss_scale, cfg.precision) {
        (Some(s), _) => Some(GradScaler::Constant { scale: s }),
        (None, Precision::F16) => Some(GradScaler::dynamic(
            a.initial_loss_scale,
            a.min_loss_scale,
            a.loss_scale_window,
            a.hysteresis,
        )),
        (None, _) => None,
    }
}
