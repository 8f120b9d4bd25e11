//! `pretrain`: Megatron's training loop on one rank.

use crate::arguments::{TrainArgs, TrainConfig};
use crate::checkpointing::{load_checkpoint, restore, save_checkpoint, CheckpointMeta};
use crate::flops::{num_floating_point_operations, peak_flops};
use crate::logging::{peak_rss_bytes, EvalMetrics, IterationMetrics, MetricsFile};
use crate::TrainError;
use megatron_comm::Communicator;
use megatron_core::distributed::overlap::{reduce_buckets, GradsPtr, OverlapGradReduce};
use megatron_core::distributed::overlap_param_gather::{gather_params, ParamGate, ParamsPtr};
use megatron_core::distributed::GradBuffer;
use megatron_core::optimizer::{
    clip_grads_by_norm, Adam, DistributedOptimizer, GradScaler, OptimizerParamScheduler,
};
use megatron_core::params::{HalfParams, ParamId};
use megatron_core::pipeline_parallel::executor::Stage;
use megatron_core::pipeline_parallel::partition::StagePartition;
use megatron_core::pipeline_parallel::timers::Timers;
use megatron_core::pipeline_parallel::{schedule, Op};
use megatron_core::tensor_parallel::{
    allreduce_sequence_parallel_grads, gather_to_full, grad_norm_squared_tp, serial_group, sum_f64,
    Tp,
};
use megatron_core::transformer::step::StepContext;
use megatron_core::{Batch, GPTModel, Grads, Params};
use megatron_data::data_samplers::MegatronPretrainingSampler;
use megatron_data::megatron_data::{is_indexed_blend, MegatronDataConfig, MegatronGPTData};
use megatron_data::{
    build_tokenizer_from, GPTSampleSource, MockGPTDataset, Split, TextDataset, Tokenizer,
};
use megatron_tensor::cpu::cast::Half;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Debug, Default)]
pub struct TrainSummary {
    pub start_iteration: u64,
    pub final_iteration: u64,
    /// `(iteration, lm loss)` of every iteration run.
    pub losses: Vec<(u64, f64)>,
    /// `(iteration, validation loss)` of every evaluation.
    pub val_losses: Vec<(u64, f64)>,
    pub last_checkpoint: Option<PathBuf>,
    pub peak_activation_bytes: usize,
    /// Most micro-batches (per model chunk) whose activations one pipeline stage held at once.
    pub peak_in_flight: usize,
    /// This stage's bubble over the last timed interval (`--timing-log-level`).
    pub bubble_fraction: f64,
    /// World rank and its trace events (`--profile-trace`).
    pub world_rank: usize,
    pub trace: Vec<megatron_core::pipeline_parallel::timers::TraceEvent>,
    /// Iterations skipped because the gradients overflowed (loss scaling).
    pub skipped_iterations: u64,
    /// Loss scale at the end (loss scaling).
    pub loss_scale: Option<f32>,
    /// Gradient norm of every iteration that stepped.
    pub grad_norms: Vec<(u64, f64)>,
    /// Weights + gradients + optimizer state per parameter on rank 0 (bytes).
    pub bytes_per_param: f64,
}

/// Where log lines go: through the progress bar on a terminal, else plain stdout.
struct Reporter {
    bar: Option<indicatif::ProgressBar>,
    /// Ranks other than 0 stay quiet.
    silent: bool,
}

impl Reporter {
    fn new(total: u64, start: u64, plain: bool, silent: bool) -> Self {
        let bar = if !silent && !plain && std::io::stderr().is_terminal() {
            let pb = indicatif::ProgressBar::new(total);
            pb.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} iters [{elapsed_precise}<{eta_precise}] {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            pb.set_position(start);
            Some(pb)
        } else {
            None
        };
        Reporter { bar, silent }
    }
    fn line(&self, s: &str) {
        if self.silent {
            return;
        }
        match &self.bar {
            Some(pb) => pb.println(s),
            None => println!("{s}"),
        }
    }
    fn tick(&self, iteration: u64, loss: f64) {
        if let Some(pb) = &self.bar {
            pb.set_position(iteration);
            pb.set_message(format!("lm loss {loss:.4}"));
        }
    }
    fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
    }
}

fn build_data(
    cfg: &TrainConfig,
    tok: &dyn Tokenizer,
    lead: bool,
) -> Result<Box<dyn GPTSampleSource>, TrainError> {
    let a = &cfg.args;
    if a.mock_data {
        return Ok(Box::new(MockGPTDataset {
            vocab_size: tok.vocab_size(),
            seq_length: a.seq_length,
            seed: a.seed,
        }));
    }
    if !a.train_data_path.is_empty() || is_indexed_blend(&a.data_path) {
        let gbs = cfg.global_batch_size as u64;
        let eval = a.eval_iters * gbs;
        let mcfg = MegatronDataConfig {
            data_path: a.data_path.clone(),
            per_split: [
                a.train_data_path.clone(),
                a.valid_data_path.clone(),
                a.test_data_path.clone(),
            ],
            split: a.split.clone(),
            seq_length: a.seq_length,
            seed: a.seed,
            // Megatron's sizes: every training sample, every evaluation, one test pass.
            num_samples: [
                cfg.train_iters * gbs,
                (cfg.train_iters / a.eval_interval + 1) * eval,
                eval,
            ],
            data_cache_path: a.data_cache_path.clone(),
            tokenizer: format!("{}:{}", tok.name(), tok.vocab_size()),
            eod: tok.eod(),
        };
        let data = MegatronGPTData::build(&mcfg)?;
        for line in data.report.iter().filter(|_| lead) {
            println!("data: {line}");
        }
        return Ok(Box::new(data));
    }
    let files: Vec<String> =
        megatron_data::inputs::expand_inputs(&a.data_path, &["txt"], "--data-path")?
            .iter()
            .map(|p| p.display().to_string())
            .collect();
    let ds = TextDataset::from_files(&files, tok, &a.split, a.seq_length, a.seed)?;
    if lead {
        println!(
        "data: {} files, {} tokens | samples train/valid/test {}/{}/{} | unigram entropy of the train split: {:.4} nats",
        files.len(),
        ds.num_tokens(),
        ds.num_samples(Split::Train),
        ds.num_samples(Split::Valid),
        ds.num_samples(Split::Test),
        ds.unigram_entropy()
    );
    }
    Ok(Box::new(ds))
}

fn scheduler(cfg: &TrainConfig) -> OptimizerParamScheduler {
    let gbs = cfg.global_batch_size as u64;
    OptimizerParamScheduler {
        init_lr: cfg.args.lr_warmup_init,
        max_lr: cfg.args.lr,
        min_lr: cfg.args.min_lr,
        warmup_steps: cfg.lr_warmup_iters * gbs,
        decay_steps: cfg.lr_decay_iters * gbs,
        decay_style: cfg.lr_decay_style,
        wsd_decay_steps: cfg.args.lr_wsd_decay_iters.unwrap_or(0) * gbs,
        wsd_decay_style: cfg.lr_wsd_decay_style,
        num_steps: 0,
    }
}

/// Micro-batch buffers: tokens, labels and loss mask for `b` samples.
struct MicroBatch {
    tokens: Vec<u32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    sample: Vec<u32>,
    /// `--reset-position-ids` / `--reset-attention-mask`, derived from end-of-document tokens.
    position_ids: Option<Vec<u32>>,
    doc_start: Option<Vec<u32>>,
}

impl MicroBatch {
    fn new(b: usize, t: usize, cfg: &TrainConfig) -> Self {
        MicroBatch {
            tokens: vec![0; b * t],
            labels: vec![0; b * t],
            mask: vec![1.0; b * t],
            sample: vec![0; t + 1],
            position_ids: cfg.args.reset_position_ids.then(|| vec![0; b * t]),
            doc_start: cfg.args.reset_attention_mask.then(|| vec![0; b * t]),
        }
    }

    fn fill(
        &mut self,
        data: &dyn GPTSampleSource,
        split: Split,
        first: u64,
        b: usize,
        t: usize,
        eod_mask: Option<u32>,
    ) {
        for j in 0..b {
            data.sample(split, first + j as u64, &mut self.sample);
            self.tokens[j * t..(j + 1) * t].copy_from_slice(&self.sample[..t]);
            self.labels[j * t..(j + 1) * t].copy_from_slice(&self.sample[1..]);
        }
        if let Some(eod) = eod_mask {
            for (m, l) in self.mask.iter_mut().zip(&self.labels) {
                *m = if *l == eod { 0.0 } else { 1.0 };
            }
        }
        if self.position_ids.is_some() || self.doc_start.is_some() {
            // Megatron's `_get_ltor_masks_and_position_ids`: a document starts after each
            // end-of-document token of the inputs.
            let eod = data.eod();
            for j in 0..b {
                let mut start = 0u32;
                for q in 0..t {
                    if let Some(p) = &mut self.position_ids {
                        p[j * t + q] = q as u32 - start;
                    }
                    if let Some(d) = &mut self.doc_start {
                        d[j * t + q] = start;
                    }
                    if Some(self.tokens[j * t + q]) == eod {
                        start = q as u32 + 1;
                    }
                }
            }
        }
    }

    fn batch(&self, b: usize, t: usize) -> Batch<'_> {
        Batch {
            tokens: &self.tokens,
            labels: &self.labels,
            loss_mask: &self.mask,
            b,
            t,
            position_ids: self.position_ids.as_deref(),
            doc_start: self.doc_start.as_deref(),
        }
    }
}

/// The label id excluded from the loss under `--eod-mask-loss`.
fn eod_mask(cfg: &TrainConfig, data: &dyn GPTSampleSource) -> Option<u32> {
    if cfg.args.eod_mask_loss {
        data.eod()
    } else {
        None
    }
}

/// Mean validation loss over `--eval-iters` global batches (the same samples every time, so
/// curves are comparable, and the same samples for every layout: data-parallel rank r takes
/// micro-batches r, r + d, ...; the sum is all-reduced over DP); forward only, through the
/// pipeline when there is one. Every rank calls it.
#[allow(clippy::too_many_arguments)]
fn evaluate(
    chunks: &[GPTModel],
    partition: StagePartition,
    pp: &mut dyn Communicator,
    params: &Params,
    tp: &mut Tp,
    data: &dyn GPTSampleSource,
    cfg: &TrainConfig,
    timers: &mut Timers,
    dp: Option<&mut dyn Communicator>,
) -> Result<Option<f64>, TrainError> {
    if data.num_samples(Split::Valid) == 0 || cfg.args.eval_iters == 0 {
        return Ok(None);
    }
    let (b, t) = (cfg.args.micro_batch_size, cfg.args.seq_length);
    let (dp_rank, dp_size) = dp.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    let global = cfg.args.eval_iters as usize * cfg.global_batch_size / b;
    let mine: Vec<usize> = (dp_rank..global).step_by(dp_size).collect();
    let count = mine.len();
    let mut mbs: Vec<MicroBatch> = (0..count).map(|_| MicroBatch::new(b, t, cfg)).collect();
    for (mb, &g) in mbs.iter_mut().zip(&mine) {
        mb.fill(
            data,
            Split::Valid,
            (g * b) as u64,
            b,
            t,
            eod_mask(cfg, data),
        );
    }
    let batches: Vec<Batch> = mbs.iter().map(|x| x.batch(b, t)).collect();
    let mean_over_dp = |local: f64, dp: Option<&mut dyn Communicator>| -> Result<f64, TrainError> {
        let total = match dp {
            Some(c) => sum_f64(c, local)?,
            None => local,
        };
        Ok(total / global as f64)
    };
    if partition.p == 1 {
        let mut total = 0.0f64;
        for batch in &batches {
            total += chunks[0].forward_loss(params, tp, batch)? as f64;
        }
        return Ok(Some(mean_over_dp(total, dp)?));
    }
    let ops: Vec<Op> = (0..count)
        .flat_map(|mb| (0..partition.v).map(move |chunk| Op::Forward { chunk, mb }))
        .collect();
    let ctxs = vec![StepContext::eval(); count];
    let rank = pp.rank();
    let r = Stage {
        chunks,
        partition,
        rank,
        pp: &mut *pp,
        tp,
        shape: [
            if tp_sequence_parallel_rows(cfg) {
                b * t / cfg.tp
            } else {
                b * t
            },
            cfg.model.hidden_size,
        ],
    }
    .run(params, None, &ops, &batches, &ctxs, 1.0, timers)?;
    let local: f64 = r.losses.iter().map(|l| l.0 as f64).sum();
    let stage_sum = sum_f64(pp, local)?;
    Ok(Some(mean_over_dp(stage_sum, dp)?))
}

/// Writes a Chrome trace (`chrome://tracing`, Perfetto): one row (thread) per world rank, one
/// complete event per forward, backward, receive wait and optimizer step.
fn write_trace(
    path: &str,
    ranks: &[(
        usize,
        Vec<megatron_core::pipeline_parallel::timers::TraceEvent>,
    )],
) -> Result<(), TrainError> {
    let mut events = Vec::new();
    for (rank, evs) in ranks {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
            "args": { "name": format!("rank {rank}") }
        }));
        for e in evs {
            events.push(serde_json::json!({
                "name": e.name, "ph": "X", "pid": 0, "tid": rank,
                "ts": e.start_us, "dur": e.dur_us
            }));
        }
    }
    let text = serde_json::json!({ "traceEvents": events }).to_string();
    std::fs::write(path, text).map_err(|e| TrainError::Io {
        path: path.to_string(),
        source: e,
    })
}

/// Zeros in the gradients the optimizer sees (Megatron's `--log-num-zeros-in-grad`), counted
/// once over TP, PP and (with the distributed optimizer) DP.
fn count_zeros(
    params: &Params,
    grads: &Grads,
    dist: Option<&DistributedOptimizer>,
    tp: &mut Tp,
    pp: &mut dyn Communicator,
    dp: Option<&mut dyn Communicator>,
) -> Result<u64, TrainError> {
    let tp_rank = tp.rank();
    let local = match dist {
        Some(d) => d.count_zeros_local(params, grads, tp_rank),
        None => params
            .metas
            .iter()
            .filter(|m| !m.shared && (!m.tp_replicated || tp_rank == 0))
            .map(|m| {
                grads.data[m.offset..m.offset + m.numel]
                    .iter()
                    .filter(|g| **g == 0.0)
                    .count() as u64
            })
            .sum(),
    };
    let mut v = [local as i64];
    use megatron_comm::TypedCollectives;
    tp.comm
        .all_reduce_i64(&mut v, megatron_comm::ReduceOp::Sum)?;
    pp.all_reduce_i64(&mut v, megatron_comm::ReduceOp::Sum)?;
    if let (Some(c), true) = (dp, dist.is_some()) {
        c.all_reduce_i64(&mut v, megatron_comm::ReduceOp::Sum)?;
    }
    Ok(v[0] as u64)
}

/// L2 norm of the whole model's parameters (`--log-params-norm`), each counted once.
fn params_norm(params: &Params, tp: &mut Tp, pp: &mut dyn Communicator) -> Result<f64, TrainError> {
    let tp_rank = tp.rank();
    let local: f64 = params
        .metas
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.shared && (!m.tp_replicated || tp_rank == 0))
        .map(|(i, _)| megatron_tensor::cpu::global_norm_squared(&params.get(ParamId(i))))
        .sum();
    let x = sum_f64(tp.comm, local)?;
    Ok(sum_f64(pp, x)?.sqrt())
}

/// Whether activations between stages are sequence-parallel token blocks.
fn tp_sequence_parallel_rows(cfg: &TrainConfig) -> bool {
    cfg.args.sequence_parallel && cfg.tp > 1
}

/// Trains as `megatron train` does; returns the per-iteration losses.
pub fn pretrain(args: &TrainArgs) -> Result<TrainSummary, TrainError> {
    let tok = build_tokenizer_from(&args.tokenizer.spec())?;
    let threads = args
        .num_threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    #[cfg(feature = "mpi")]
    if megatron_comm::mpi_comm::launched_by_mpi() {
        return pretrain_mpi(args, tok.vocab_size(), threads);
    }
    let cfg = args.validate(tok.vocab_size())?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Args(format!("--num-threads {threads}: {e}")))?;
    if cfg.dp * cfg.tp * cfg.pp == 1 {
        return pool.install(|| {
            megatron_tensor::threads::set_gemm_threads(threads);
            let mut s = run(&cfg, tok.as_ref(), threads, None, PeakOf::Threads(threads))?;
            if let Some(path) = &cfg.args.profile_trace {
                write_trace(path, &[(0, std::mem::take(&mut s.trace))])?;
            }
            Ok(s)
        });
    }
    drop(pool);
    pretrain_ranks(cfg, args.tokenizer.spec(), threads)
}

/// Under `mpirun`/`srun` (built with feature `mpi`): this process is one data-parallel rank of
/// the MPI world; `--nproc-per-node` must be 1 (one rank per process).
#[cfg(feature = "mpi")]
fn pretrain_mpi(
    args: &TrainArgs,
    vocab_size: usize,
    threads: usize,
) -> Result<TrainSummary, TrainError> {
    if args.nproc_per_node != 1 {
        return Err(TrainError::Args(
            "under mpirun use one rank per process (--nproc-per-node 1)".into(),
        ));
    }
    // --overlap-grad-reduce and --overlap-param-gather call MPI from a communication thread
    // beside the compute thread (on another communicator): that needs MPI_THREAD_MULTIPLE.
    let threaded = args.overlap_grad_reduce || args.overlap_param_gather;
    let want = if threaded {
        mpi::Threading::Multiple
    } else {
        mpi::Threading::Serialized
    };
    let (universe, provided) = mpi::initialize_with_threading(want)
        .ok_or_else(|| TrainError::Args("MPI could not be initialized".into()))?;
    if threaded && provided != mpi::Threading::Multiple {
        return Err(TrainError::Args(format!(
            "--overlap-grad-reduce / --overlap-param-gather need an MPI library with MPI_THREAD_MULTIPLE; this one provides {provided:?}"
        )));
    }
    let mut comm = megatron_comm::mpi_comm::MpiCommunicator::world(&universe);
    let n = comm.size();
    // The MPI world takes the place of --nproc-per-node in the layout checks.
    let mut a = args.clone();
    a.nproc_per_node = n;
    let cfg = a.validate(vocab_size)?;
    let tok = build_tokenizer_from(&cfg.args.tokenizer.spec())?;
    let mut groups = process_groups(&mut comm, n, cfg.tp, cfg.pp, "MPI")?;
    megatron_tensor::threads::set_gemm_threads(threads);
    let lead = comm.rank() == 0;
    let mut summary = run(
        &cfg,
        tok.as_ref(),
        threads,
        Some(&mut groups),
        PeakOf::Processes(n),
    )?;
    if let Some(path) = &cfg.args.profile_trace {
        // One file per process; each holds its rank's row (load them together in Perfetto).
        let r = comm.rank();
        write_trace(
            &format!("{path}.rank{r}.json"),
            &[(r, std::mem::take(&mut summary.trace))],
        )?;
    }
    if !lead {
        // Only rank 0 reports.
        summary.losses.clear();
    }
    Ok(summary)
}

/// Parameters and Adam state of the whole model in the TP = 1, PP = 1 layout (whole tensors of
/// every layer): shards are gathered over the TP group, stages combined over the pipeline group
/// (each stage contributes its own tensors, zeros elsewhere, summed). Every rank of both groups
/// takes part and receives the result.
fn gather_full_state(
    cfg: &TrainConfig,
    params: &Params,
    adam: &Adam,
    tp: &mut Tp,
    pp: &mut dyn Communicator,
) -> Result<(Params, Adam), TrainError> {
    let mut full = Params::default();
    GPTModel::build(cfg.model.clone(), &mut full, &mut Vec::new());
    let mut gather = |data: &[f32]| -> Result<Vec<f32>, TrainError> {
        let stage = if tp.size() > 1 {
            gather_to_full(params, data, tp)?
        } else {
            data.to_vec()
        };
        if pp.size() == 1 {
            return Ok(stage);
        }
        let mut out = vec![0.0f32; full.numel()];
        let mut at = 0;
        for m in &params.metas {
            let global: usize = m.shape.iter().product();
            if !m.shared {
                let id = full
                    .find(&m.name)
                    .expect("a stage parameter is a model parameter");
                let fm = &full.metas[id.0];
                out[fm.offset..fm.offset + fm.numel].copy_from_slice(&stage[at..at + global]);
            }
            at += global;
        }
        pp.all_reduce(&mut out, megatron_comm::ReduceOp::Sum)?;
        Ok(out)
    };
    let data = gather(&params.data)?;
    let exp_avg = gather(&adam.exp_avg)?;
    let exp_avg_sq = gather(&adam.exp_avg_sq)?;
    full.data = data;
    let mut full_adam = adam.clone();
    full_adam.exp_avg = exp_avg;
    full_adam.exp_avg_sq = exp_avg_sq;
    Ok((full, full_adam))
}

/// Splits the world into Megatron's groups, prints the layout on rank 0 and health-checks every
/// group (small all-reduce with a known answer, 10 s timeout) before any work.
fn process_groups(
    world: &mut dyn Communicator,
    n: usize,
    tp: usize,
    pp: usize,
    backend: &str,
) -> Result<megatron_comm::ProcessGroups, TrainError> {
    let ps = megatron_comm::ParallelState::new(
        n,
        tp,
        pp,
        1,
        1,
        megatron_comm::ParallelState::DEFAULT_ORDER,
    )
    .map_err(|e| TrainError::Args(e.to_string()))?;
    if world.rank() == 0 {
        println!("layout ({backend}): {}", ps.describe());
    }
    let mut groups = megatron_comm::ProcessGroups::new(world, ps)?;
    groups
        .health_check(
            std::time::Duration::from_secs(10),
            megatron_comm::thread_comm::DEFAULT_TIMEOUT,
        )
        .map_err(|msg| TrainError::Rank {
            rank: world.rank(),
            msg,
        })?;
    Ok(groups)
}

/// Data-parallel training on `--nproc-per-node` rank threads: each rank owns a share of the cores,
/// runs its micro-batches, and gradients are averaged over the ranks before every step.
fn pretrain_ranks(
    cfg: TrainConfig,
    spec: megatron_data::TokenizerSpec,
    threads: usize,
) -> Result<TrainSummary, TrainError> {
    let n = cfg.dp * cfg.tp * cfg.pp;
    let (tp, pp) = (cfg.tp, cfg.pp);
    let trace_path = cfg.args.profile_trace.clone();
    let per_rank = (threads / n).max(1);
    let cfg = std::sync::Arc::new(cfg);
    let results =
        megatron_comm::run_ranks(n, move |rank, comm| -> Result<TrainSummary, TrainError> {
            let tok = build_tokenizer_from(&spec)?;
            let mut groups = process_groups(comm, n, tp, pp, "threads")?;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(per_rank)
                .build()
                .map_err(|e| TrainError::Rank {
                    rank,
                    msg: e.to_string(),
                })?;
            pool.install(|| {
                megatron_tensor::threads::set_gemm_threads(per_rank);
                run(
                    &cfg,
                    tok.as_ref(),
                    per_rank,
                    Some(&mut groups),
                    PeakOf::Threads(threads),
                )
            })
        });
    let mut first_err = None;
    let mut lead = None;
    let mut traces = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(mut s)) => {
                traces.push((s.world_rank, std::mem::take(&mut s.trace)));
                if rank == 0 {
                    lead = Some(s);
                }
            }
            // A peer's failure is the consequence; report the first root cause.
            Ok(Err(TrainError::Comm(megatron_comm::CommError::PeerPanicked { .. })))
                if first_err.is_some() => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(msg) => {
                first_err = Some(TrainError::Rank { rank, msg });
            }
        }
    }
    if let (Some(path), None) = (&trace_path, &first_err) {
        write_trace(path, &traces)?;
    }
    match (first_err, lead) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(TrainError::Rank {
            rank: 0,
            msg: "finished without a result".into(),
        }),
    }
}

/// What the MFU denominator covers.
#[derive(Clone, Copy)]
enum PeakOf {
    /// This many threads of this process (rank threads share them).
    Threads(usize),
    /// This many processes, each with the per-rank thread count.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Processes(usize),
}

fn run(
    cfg: &TrainConfig,
    tok: &dyn Tokenizer,
    threads: usize,
    groups: Option<&mut megatron_comm::ProcessGroups>,
    world_peak: PeakOf,
) -> Result<TrainSummary, TrainError> {
    let a = &cfg.args;
    // Every matmul this rank issues runs on this thread.
    use megatron_tensor::cpu::matmul::{
        set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulPrecision,
    };
    let half = if a.bf16 {
        Some(Half::BF16)
    } else if a.fp16 {
        Some(Half::F16)
    } else {
        None
    };
    set_matmul_precision(MatmulPrecision::of(half));
    let mut bf16_kernel = match a.bf16_matmul_kernel.as_str() {
        "dot" => Bf16Kernel::Dot,
        "fma" => Bf16Kernel::Fma,
        _ if a.bf16 => crate::flops::fastest_bf16_kernel(),
        _ => Bf16Kernel::Fma,
    };
    let mut serial = serial_group();
    let mut serial_pp = serial_group();
    let mut serial_dp = serial_group();
    type Comm<'x> = &'x mut dyn Communicator;
    let (tp_comm, mut comm, pp_comm, mut emb_comm, world_rank): (
        Comm,
        Option<Comm>,
        Comm,
        Option<Comm>,
        usize,
    ) = match groups {
        Some(g) => {
            let world_rank = g.world_rank;
            let megatron_comm::ProcessGroups {
                tp,
                dp,
                pp,
                embedding,
                ..
            } = g;
            (
                tp.comm.as_mut(),
                Some(dp.comm.as_mut()),
                pp.comm.as_mut(),
                embedding.as_mut().map(|e| e.comm.as_mut() as Comm),
                world_rank,
            )
        }
        None => (&mut serial, None, &mut serial_pp, None, 0),
    };
    if a.sequence_parallel && tp_comm.size() == 1 && world_rank == 0 {
        // As Megatron: sequence parallelism needs tensor-parallel ranks to split over.
        println!("note: --sequence-parallel has no effect with --tensor-model-parallel-size 1");
    }
    if a.bf16 && a.bf16_matmul_kernel == "auto" {
        // Processes measure separately; one choice for the whole world keeps the summation
        // order, and so the TP-replicated computations, identical on every rank.
        let mut dot = [if bf16_kernel == Bf16Kernel::Dot {
            1.0f32
        } else {
            0.0
        }];
        tp_comm.all_reduce(&mut dot, megatron_comm::ReduceOp::Min)?;
        pp_comm.all_reduce(&mut dot, megatron_comm::ReduceOp::Min)?;
        if let Some(c) = comm.as_deref_mut() {
            c.all_reduce(&mut dot, megatron_comm::ReduceOp::Min)?;
        }
        if dot[0] == 0.0 {
            bf16_kernel = Bf16Kernel::Fma;
        }
    }
    set_bf16_kernel(bf16_kernel);
    let mut tp = Tp::new(tp_comm, a.sequence_parallel);
    let (dp_rank, dp) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    let (pp_rank, pp_size) = (pp_comm.rank(), pp_comm.size());
    // Rank 0 of the data-, tensor- and pipeline-parallel groups reports and saves; the loss,
    // known on the last stage, is summed over the pipeline group so it has it.
    let lead = dp_rank == 0 && tp.rank() == 0 && pp_rank == 0;
    let (b, t) = (a.micro_batch_size, a.seq_length);
    let gbs = cfg.global_batch_size as u64;
    let partition = cfg.partition;
    let mut params = Params::for_tp_rank(tp.rank(), tp.size());
    let mut inits = Vec::new();
    let (chunks, chunk_params) = megatron_core::pipeline_parallel::build_stage(
        &cfg.model,
        &partition,
        pp_rank,
        &mut params,
        &mut inits,
    );
    params.initialize(a.seed, &inits);
    let last_stage = pp_rank == pp_size - 1;
    let rows_local = if tp.sequence_parallel {
        b * t / tp.size()
    } else {
        b * t
    };
    // One origin for every rank thread of the process, so trace rows line up.
    static TRACE_ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let mut timers = Timers::new(
        *TRACE_ORIGIN.get_or_init(Instant::now),
        a.profile_trace.is_some(),
    );
    let mut adam = Adam::new(&params, a.adam_beta1, a.adam_beta2, a.adam_eps);
    // Gradient buckets over the data-parallel group; with the distributed optimizer Adam state
    // lives only for this rank's shards (the full `adam` above is then only a staging area for
    // checkpoints and is freed right away).
    let bucket_size = a.ddp_bucket_size.unwrap_or_else(|| {
        if a.overlap_grad_reduce || a.use_distributed_optimizer {
            // Megatron's default bucket for overlapped communication.
            40_000_000usize.max(1_000_000 * dp)
        } else {
            usize::MAX
        }
    });
    let buffer = GradBuffer::new(
        &params,
        bucket_size,
        dp,
        dp_rank,
        a.use_distributed_optimizer,
    );
    let mut scaler = match (a.loss_scale, a.fp16) {
        (Some(s), _) => Some(GradScaler::Constant { scale: s }),
        (None, true) => Some(GradScaler::dynamic(
            a.initial_loss_scale,
            a.min_loss_scale,
            a.loss_scale_window,
            a.hysteresis,
        )),
        (None, false) => None,
    };
    let mut skipped_iterations = 0u64;
    let overlap_grad = a.overlap_grad_reduce && dp > 1;
    let mut bucket_scratch = Vec::new();
    let mut sched = scheduler(cfg);
    let mut iteration = 0u64;
    let mut consumed = 0u64;
    if let Some(load) = &a.load {
        let ck = load_checkpoint(Path::new(load), None)?;
        if ck.meta.model != cfg.model {
            return Err(TrainError::Checkpoint {
                path: ck.dir.display().to_string(),
                msg: format!(
                    "was saved for another model configuration ({:?}); the flags give {:?}",
                    ck.meta.model, cfg.model
                ),
            });
        }
        restore(&ck, &mut params, Some(&mut adam))?;
        iteration = ck.meta.iteration;
        consumed = ck.meta.consumed_train_samples;
        sched.num_steps = ck.meta.scheduler.num_steps;
        if lead {
            println!(
                "loaded checkpoint {} at iteration {iteration} ({consumed} consumed samples)",
                ck.dir.display()
            );
        }
    }
    // Under --bf16 / --fp16 the model reads a 16-bit copy; `params.data` becomes the fp32 main
    // parameters, which the distributed optimizer shards (then `params.data` is freed).
    params.set_half(half);
    let mut dist_opt = a.use_distributed_optimizer.then(|| {
        let mut d = DistributedOptimizer::new(
            &params,
            buffer.clone(),
            a.adam_beta1,
            a.adam_beta2,
            a.adam_eps,
        );
        d.load_moments(&adam.exp_avg, &adam.exp_avg_sq, adam.step);
        d
    });
    if dist_opt.is_some() {
        adam.exp_avg = Vec::new();
        adam.exp_avg_sq = Vec::new();
        if half.is_some() {
            params.data = Vec::new();
        }
    }
    let overlap_param_gather = a.overlap_param_gather && dist_opt.is_some() && dp > 1;
    let mut pending_gather = false;
    // Evaluation, checkpoints, the parameter norm and the end of training need every
    // parameter: an all-gather still pending from `--overlap-param-gather` runs first.
    macro_rules! finish_param_gather {
        () => {
            if pending_gather {
                if let (Some(d), Some(c)) = (dist_opt.as_mut(), comm.as_deref_mut()) {
                    d.gather(&mut params, c)?;
                }
                #[allow(unused_assignments)] // not read again after the last step
                {
                    pending_gather = false;
                }
            }
        };
    }
    let data = build_data(cfg, tok, lead)?;
    let mut grads = Grads::zeros_like(&params);
    let flops_per_iter = num_floating_point_operations(&cfg.model, cfg.global_batch_size);
    // MFU is against the whole job's peak: the process's thread budget for rank threads (they
    // share its cores), the per-process peak times the world under MPI.
    let peak = match world_peak {
        PeakOf::Threads(n) => peak_flops(a.peak_tflops, n),
        PeakOf::Processes(n) => peak_flops(a.peak_tflops, threads) * n as f64,
    };
    let mut metrics =
        MetricsFile::open(a.metrics_file.as_deref().filter(|_| lead)).map_err(|e| {
            TrainError::Io {
                path: a.metrics_file.clone().unwrap_or_default(),
                source: e,
            }
        })?;
    if lead {
        println!(
        "model: {} parameters, {} layers, hidden {}, heads {}, seq {}, padded vocab {} | global batch {} = {} micro-batches of {} | {} threads | peak {:.1} GFLOP/s",
        params.numel(),
        cfg.model.num_layers,
        cfg.model.hidden_size,
        cfg.model.num_attention_heads,
        t,
        cfg.model.padded_vocab_size,
        gbs,
        cfg.num_microbatches,
        b,
        threads,
        peak / 1e9
    );
    }
    // Bytes this rank holds per parameter of its shard for weights, gradients and optimizer
    // state, from the buffers' allocations (Megatron's table: fp32 16, distributed 8 + 8/d).
    let state_bytes = match dist_opt.as_ref() {
        Some(d) => (d.exp_avg.capacity() + d.exp_avg_sq.capacity() + d.main.capacity()) * 4,
        None => (adam.exp_avg.capacity() + adam.exp_avg_sq.capacity()) * 4,
    };
    let per_param = (params.data.capacity() * 4
        + params.half.size_in_bytes()
        + grads.data.capacity() * 4
        + state_bytes) as f64
        / params.numel() as f64;
    if lead {
        println!(
            "weights + gradients + optimizer state: {per_param:.2} bytes per parameter on this rank ({:.1} MiB)",
            per_param * params.numel() as f64 / (1 << 20) as f64
        );
    }
    let rep = Reporter::new(cfg.train_iters, iteration, a.no_progress_bar, !lead);
    let mut summary = TrainSummary {
        bytes_per_param: per_param,
        start_iteration: iteration,
        ..Default::default()
    };
    let mut mb = MicroBatch::new(b, t, cfg);
    // Pipelined schedules hold every micro-batch of the step at once.
    let mut mbs: Vec<MicroBatch> = (0..if pp_size > 1 { cfg.num_microbatches } else { 0 })
        .map(|_| MicroBatch::new(b, t, cfg))
        .collect();
    let (mut interval_loss, mut interval_iters, mut interval_time) = (0.0f64, 0u64, 0.0f64);
    let base_grad_scale = 1.0 / cfg.num_microbatches as f32;
    let save_dir = a.save.as_ref().map(PathBuf::from);
    while iteration < cfg.train_iters {
        let started = Instant::now();
        iteration += 1;
        grads.zero();
        if dist_opt.is_some() && !adam.exp_avg.is_empty() {
            // Staging for the last checkpoint only.
            adam.exp_avg = Vec::new();
            adam.exp_avg_sq = Vec::new();
        }
        // fp16 loss scaling: the loss gradient is multiplied by the scale, the gradients divided
        // by it before the optimizer.
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale());
        let grad_scale = base_grad_scale * loss_scale;
        let mut loss_sum = 0.0f64;
        // One data-parallel rank today: the sampler hands out consecutive indices from the
        // consumed-samples count, as Megatron's does for rank 0 of 1.
        let mut sampler = MegatronPretrainingSampler {
            total_samples: u64::MAX,
            consumed_samples: consumed,
            micro_batch_size: b as u64,
            data_parallel_rank: dp_rank as u64,
            data_parallel_size: dp as u64,
        };
        let m = cfg.num_microbatches;
        let starts: Vec<u64> = (0..m)
            .map(|_| {
                sampler
                    .next_micro_batch()
                    .expect("the sampler never runs dry")[0]
            })
            .collect();
        // `--overlap-grad-reduce`: a communication thread reduces each bucket over DP as soon
        // as the last micro-batch's backward has finished its gradients.
        // `--overlap-param-gather`: the same thread first all-gathers the parameters the last
        // optimizer step updated, while forward waits bucket by bucket (`Params::get`).
        let gather = pending_gather.then(|| {
            let gate = std::sync::Arc::new(ParamGate::new());
            params.gate = Some(gate.clone());
            (ParamsPtr::new(&mut params), gate)
        });
        pending_gather = false;
        let overlap_dp = if overlap_grad || gather.is_some() {
            comm.as_deref_mut()
        } else {
            None
        };
        let active: &GradBuffer = dist_opt.as_ref().map_or(&buffer, |d| &d.buffer);
        let remaining: Option<Vec<usize>> = std::thread::scope(|sc| -> Result<_, TrainError> {
            let mut overlap = None;
            let mut comm_thread = None;
            if let Some(dpc) = overlap_dp {
                let (tx, rx) = std::sync::mpsc::channel();
                let ptr = GradsPtr::new(&mut grads);
                comm_thread = Some(sc.spawn(move || -> Result<(), megatron_comm::CommError> {
                    if let Some((p, gate)) = gather {
                        gather_params(active, p, &mut *dpc, &gate)?;
                    }
                    reduce_buckets(rx, active, ptr, dpc)
                }));
                if overlap_grad {
                    // The tied embedding is all-reduced over the embedding group first: its
                    // bucket waits for the end of the step.
                    let tied_pp = pp_size > 1 && !cfg.model.untie_embeddings_and_output_weights;
                    let metas = &params.metas;
                    overlap = Some(OverlapGradReduce::new(
                        active,
                        &params,
                        |p| tied_pp && metas[p].name == "embedding.word_embeddings.weight",
                        tx,
                    ));
                }
            }
            if pp_size == 1 {
                // No pipelining: gradient accumulation, one micro-batch at a time.
                let t0 = Instant::now();
                for (k, &start) in starts.iter().enumerate() {
                    mb.fill(
                        data.as_ref(),
                        Split::Train,
                        start,
                        b,
                        t,
                        eod_mask(cfg, data.as_ref()),
                    );
                    let ctx = StepContext::train(a.seed, iteration, start);
                    let batch = mb.batch(b, t);
                    let (_, state) = chunks[0].forward_step(
                        &params,
                        Some(&mut grads),
                        &mut tp,
                        None,
                        &batch,
                        grad_scale,
                        &ctx,
                    )?;
                    summary.peak_activation_bytes =
                        summary.peak_activation_bytes.max(state.activation_bytes);
                    loss_sum += state.loss.expect("a whole model computes the loss").0 as f64;
                    match overlap.as_mut() {
                        Some(ov) if k + 1 == m => {
                            let all = 0..params.metas.len();
                            chunks[0].backward_step_hooked(
                                &params,
                                &mut grads,
                                &mut tp,
                                state,
                                None,
                                &batch,
                                &ctx,
                                &mut |offset| ov.ready(all.clone(), offset),
                            )?;
                        }
                        _ => {
                            chunks[0].backward_step(
                                &params, &mut grads, &mut tp, state, None, &batch, &ctx,
                            )?;
                        }
                    }
                }
                timers.pipeline += t0.elapsed();
            } else {
                for (k, &start) in starts.iter().enumerate() {
                    mbs[k].fill(
                        data.as_ref(),
                        Split::Train,
                        start,
                        b,
                        t,
                        eod_mask(cfg, data.as_ref()),
                    );
                }
                let batches: Vec<Batch> = mbs[..m].iter().map(|x| x.batch(b, t)).collect();
                let ctxs: Vec<StepContext> = starts
                    .iter()
                    .map(|&s| StepContext::train(a.seed, iteration, s))
                    .collect();
                let ops = schedule(pp_size, pp_rank, m, partition.v).map_err(TrainError::Args)?;
                let r = Stage {
                    chunks: &chunks,
                    partition,
                    rank: pp_rank,
                    pp: &mut *pp_comm,
                    tp: &mut tp,
                    shape: [rows_local, cfg.model.hidden_size],
                }
                .run_overlapped(
                    &params,
                    Some(&mut grads),
                    &ops,
                    &batches,
                    &ctxs,
                    grad_scale,
                    &mut timers,
                    overlap.as_mut().map(|ov| (ov, &chunk_params[..])),
                )?;
                summary.peak_activation_bytes =
                    summary.peak_activation_bytes.max(r.peak_activation_bytes);
                summary.peak_in_flight = summary.peak_in_flight.max(r.peak_in_flight);
                let local: f64 = r.losses.iter().map(|l| l.0 as f64).sum();
                loss_sum = sum_f64(&mut *pp_comm, if last_stage { local } else { 0.0 })?;
            }
            let remaining = overlap.map(|ov| ov.remaining());
            if let Some(h) = comm_thread {
                // Without `--overlap-grad-reduce` the channel's sender is gone: the thread ends
                // once the parameters are gathered.
                h.join().map_err(|_| TrainError::Rank {
                    rank: world_rank,
                    msg: "the data-parallel communication thread panicked".into(),
                })??;
            }
            Ok(remaining)
        })?;
        params.gate = None;
        let opt_start = Instant::now();
        let mut loss = loss_sum / m as f64;
        allreduce_sequence_parallel_grads(&params, &mut grads, &mut tp)?;
        if let (Some(e), false, true) = (
            emb_comm.as_deref_mut(),
            cfg.model.untie_embeddings_and_output_weights,
            pp_size > 1,
        ) {
            // The first stage's word embedding and the last stage's copy: one gradient.
            let id = chunks
                .iter()
                .find_map(|c| c.word_embeddings())
                .expect("first and last stages hold the word embedding");
            e.all_reduce(grads.get_mut(id), megatron_comm::ReduceOp::Sum)?;
        }
        if a.inject_grad_overflow.contains(&iteration) {
            grads.data[0] = f32::INFINITY;
        }
        if let Some(c) = comm.as_deref_mut() {
            // Data parallelism: the mean gradient (all-reduced, or reduce-scattered to the
            // distributed optimizer's shards) and loss over all ranks' micro-batches.
            match (&remaining, dist_opt.as_mut()) {
                (Some(rest), Some(d)) => {
                    d.buffer
                        .reduce_some(rest, &mut grads, &mut *c, &mut bucket_scratch)?
                }
                (Some(rest), None) => {
                    buffer.reduce_some(rest, &mut grads, &mut *c, &mut bucket_scratch)?
                }
                (None, Some(d)) => d.reduce_gradients(&mut grads, &mut *c)?,
                (None, None) => {
                    buffer.reduce_gradients(&mut grads, &mut *c, &mut bucket_scratch)?
                }
            }
            let mut l = [loss as f32];
            c.all_reduce(&mut l, megatron_comm::ReduceOp::Avg)?;
            loss = l[0] as f64;
        }
        // Which gradients this rank holds for the optimizer: its shards, or all of them.
        let mut skip = false;
        if let Some(sc) = &scaler {
            let inv = 1.0 / sc.scale();
            // The squared norm of the unscaled gradients this rank holds: finite unless some
            // gradient overflowed.
            let sum_sq = match dist_opt.as_ref() {
                Some(d) => {
                    d.scale_grads(&mut grads, inv);
                    d.grad_norm_squared_local(&params, &grads, 0)
                }
                None => {
                    megatron_tensor::cpu::scale_inplace(&mut grads.data, inv);
                    megatron_tensor::cpu::global_norm_squared(&grads.data)
                }
            };
            // Overflow anywhere skips the step everywhere.
            let mut flag = [if sum_sq.is_finite() { 0.0f32 } else { 1.0 }];
            tp.comm
                .all_reduce(&mut flag, megatron_comm::ReduceOp::Max)?;
            pp_comm.all_reduce(&mut flag, megatron_comm::ReduceOp::Max)?;
            if let Some(c) = comm.as_deref_mut() {
                c.all_reduce(&mut flag, megatron_comm::ReduceOp::Max)?;
            }
            skip = flag[0] > 0.0;
        }
        if !loss.is_finite() && scaler.is_none() {
            rep.finish();
            return Err(TrainError::NonFinite {
                iteration,
                what: "lm loss",
                value: loss,
            });
        }
        let mut grad_norm = f64::NAN;
        let mut num_zeros = None;
        let lr = sched.get_lr();
        if !skip {
            let norm2 = match dist_opt.as_ref() {
                // Each element is owned by one DP rank: sum over TP, PP and DP.
                Some(d) => {
                    let local = d.grad_norm_squared_local(&params, &grads, tp.rank());
                    let mut x = sum_f64(tp.comm, local)?;
                    x = sum_f64(&mut *pp_comm, x)?;
                    if let Some(c) = comm.as_deref_mut() {
                        x = sum_f64(c, x)?;
                    }
                    x
                }
                // DP replicas hold the same gradients: sum over TP and PP only.
                None => {
                    let x = grad_norm_squared_tp(&params, &grads, &mut tp)?;
                    if pp_size > 1 {
                        sum_f64(&mut *pp_comm, x)?
                    } else {
                        x
                    }
                }
            };
            grad_norm = norm2.sqrt();
            if !grad_norm.is_finite() {
                rep.finish();
                return Err(TrainError::NonFinite {
                    iteration,
                    what: "grad norm",
                    value: grad_norm,
                });
            }
            let coeff = a.clip_grad as f64 / (grad_norm + 1e-6);
            if a.log_num_zeros_in_grad {
                num_zeros = Some(count_zeros(
                    &params,
                    &grads,
                    dist_opt.as_ref(),
                    &mut tp,
                    &mut *pp_comm,
                    match comm.as_deref_mut() {
                        Some(c) => Some(c as &mut dyn Communicator),
                        None => None,
                    },
                )?);
            }
            match dist_opt.as_mut() {
                Some(d) => {
                    if a.clip_grad > 0.0 && coeff < 1.0 {
                        d.scale_grads(&mut grads, coeff as f32);
                    }
                    if overlap_param_gather {
                        // The all-gather runs during the next step's forward.
                        d.update(&mut params, &grads, lr as f32, a.weight_decay);
                        pending_gather = true;
                    } else {
                        match comm.as_deref_mut() {
                            Some(c) => d.step(&mut params, &grads, lr as f32, a.weight_decay, c)?,
                            None => d.step(
                                &mut params,
                                &grads,
                                lr as f32,
                                a.weight_decay,
                                &mut serial_dp,
                            )?,
                        }
                    }
                }
                None => {
                    clip_grads_by_norm(&mut grads, grad_norm, a.clip_grad);
                    adam.step(&mut params, &grads, lr as f32, a.weight_decay);
                }
            }
        } else {
            skipped_iterations += 1;
            rep.line(&format!(
                " iteration {iteration}: gradients overflowed at loss scale {}; step skipped",
                loss_scale
            ));
        }
        if let Some(sc) = scaler.as_mut() {
            sc.update(skip);
        }
        timers.optimizer += opt_start.elapsed();
        timers.record(|| "optimizer".into(), opt_start);
        // Megatron skips the LR scheduler step of a skipped iteration too; its samples are
        // consumed all the same.
        if !skip {
            sched.step(gbs);
            summary.grad_norms.push((iteration, grad_norm));
        }
        summary.skipped_iterations = skipped_iterations;
        summary.loss_scale = scaler.as_ref().map(|s| s.scale());
        consumed += gbs;
        let secs = started.elapsed().as_secs_f64();
        summary.losses.push((iteration, loss));
        interval_loss += loss;
        interval_iters += 1;
        interval_time += secs;
        rep.tick(iteration, loss);
        if iteration.is_multiple_of(a.log_interval) || iteration == cfg.train_iters {
            if a.log_params_norm {
                finish_param_gather!();
            }
            let per_iter = interval_time / interval_iters as f64;
            let m = IterationMetrics {
                iteration,
                consumed_samples: consumed,
                lm_loss: interval_loss / interval_iters as f64,
                lr,
                grad_norm,
                ms_per_iter: per_iter * 1e3,
                tokens_per_sec: (gbs as f64 * t as f64) / per_iter,
                tflops: flops_per_iter / per_iter / 1e12,
                mfu: flops_per_iter / per_iter / peak,
                peak_mem_bytes: peak_rss_bytes(),
                loss_scale: scaler.as_ref().map(|s| s.scale()),
                skipped_iterations,
                num_zeros,
                params_norm: if a.log_params_norm {
                    Some(params_norm(&params, &mut tp, &mut *pp_comm)?)
                } else {
                    None
                },
            };
            rep.line(&m.line(cfg.train_iters));
            if a.timing_log_level > 0 && dp_rank == 0 && tp.rank() == 0 {
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / interval_iters as f64;
                rep.line(&format!(
                    " stage {pp_rank}: forward {:.1} ms | backward {:.1} ms | p2p wait {:.1} ms | optimizer {:.1} ms | pipeline {:.1} ms | bubble {:.1} % (per iteration)",
                    ms(timers.forward),
                    ms(timers.backward),
                    ms(timers.p2p_wait),
                    ms(timers.optimizer),
                    ms(timers.pipeline),
                    100.0 * timers.bubble_fraction()
                ));
                summary.bubble_fraction = timers.bubble_fraction();
                timers.reset();
            }
            metrics.write(&m).map_err(|e| TrainError::Io {
                path: a.metrics_file.clone().unwrap_or_default(),
                source: e,
            })?;
            (interval_loss, interval_iters, interval_time) = (0.0, 0, 0.0);
        }
        if iteration.is_multiple_of(a.eval_interval) || iteration == cfg.train_iters {
            finish_param_gather!();
            let val = evaluate(
                &chunks,
                partition,
                &mut *pp_comm,
                &params,
                &mut tp,
                data.as_ref(),
                cfg,
                &mut timers,
                match comm.as_deref_mut() {
                    Some(c) => Some(c as &mut dyn Communicator),
                    None => None,
                },
            )?;
            if let (Some(val), true) = (val, lead) {
                rep.line(&format!(" validation loss at iteration {iteration} | lm loss value: {val:.6E} | lm loss PPL: {:.3E}", val.exp()));
                metrics
                    .write(&EvalMetrics {
                        iteration,
                        val_loss: val,
                    })
                    .map_err(|e| TrainError::Io {
                        path: a.metrics_file.clone().unwrap_or_default(),
                        source: e,
                    })?;
                summary.val_losses.push((iteration, val));
            }
        }
        let due = a.save_interval.is_some_and(|s| iteration.is_multiple_of(s))
            || iteration == cfg.train_iters;
        let mut staged_main = None;
        if due && save_dir.is_some() {
            finish_param_gather!();
        }
        if let (Some(d), true, true) = (dist_opt.as_mut(), save_dir.is_some(), due) {
            // The distributed optimizer's moments are all-gathered over DP first (every DP
            // rank takes part), into the staging `adam`.
            let numel = params.numel();
            let (m, v) = match comm.as_deref_mut() {
                Some(c) => d.full_moments(numel, c)?,
                None => d.full_moments(numel, &mut serial_dp)?,
            };
            adam.exp_avg = m;
            adam.exp_avg_sq = v;
            adam.step = d.step;
            if !d.main.is_empty() {
                // 16-bit parameters: the fp32 main copy is saved, gathered from the shards.
                let main = match comm.as_deref_mut() {
                    Some(c) => d.full_main(numel, c)?,
                    None => d.full_main(numel, &mut serial_dp)?,
                };
                staged_main = Some(Params {
                    data: main,
                    half: HalfParams::None,
                    metas: params.metas.clone(),
                    tp: params.tp,
                    gate: None,
                });
            }
        }
        let saving: &Params = staged_main.as_ref().unwrap_or(&params);
        if let (Some(dir), true, true) = (&save_dir, due, dp_rank == 0) {
            // Shards are gathered into the TP = 1 layout: the checkpoint loads under any TP size.
            let gathered = if tp.size() > 1 || pp_size > 1 {
                Some(gather_full_state(
                    cfg,
                    saving,
                    &adam,
                    &mut tp,
                    &mut *pp_comm,
                )?)
            } else {
                None
            };
            if !lead {
                continue;
            }
            let (full, full_adam) = gathered.as_ref().map_or((saving, &adam), |(p, a)| (p, a));
            let meta = CheckpointMeta {
                format: String::new(),
                iteration,
                consumed_train_samples: consumed,
                scheduler: sched.clone(),
                optimizer_step: adam.step,
                adam_beta1: a.adam_beta1,
                adam_beta2: a.adam_beta2,
                adam_eps: a.adam_eps,
                seed: a.seed,
                model: cfg.model.clone(),
                tokenizer_type: tok.name().to_string(),
                vocab_size: a.tokenizer.vocab_size.unwrap_or(tok.vocab_size()),
                vocab_file: a.tokenizer.vocab_file.clone(),
                merge_file: a.tokenizer.merge_file.clone(),
                tokenizer_model: a.tokenizer.tokenizer_model.clone(),
                tensors: Vec::new(),
                shard_bytes: 0,
            };
            let path = save_checkpoint(dir, meta, full, full_adam)?;
            rep.line(&format!(
                " saved checkpoint at iteration {iteration} to {}",
                path.display()
            ));
            summary.last_checkpoint = Some(path);
        }
    }
    finish_param_gather!();
    rep.finish();
    summary.final_iteration = iteration;
    summary.world_rank = world_rank;
    if let Some(ev) = timers.events.take() {
        summary.trace = ev;
    }
    if summary.peak_activation_bytes > 0 {
        // Korthikanti et al.'s per-layer activation bytes for 16-bit activations, doubled for f32.
        let (s_, b_, h_, a_) = (
            t as f64,
            b as f64,
            cfg.model.hidden_size as f64,
            cfg.model.num_attention_heads as f64,
        );
        let formula =
            2.0 * s_ * b_ * h_ * (34.0 + 5.0 * a_ * s_ / h_) * cfg.model.num_layers as f64;
        let engine = megatron_core::models::gpt::activation_bytes_formula(
            &cfg.model,
            b,
            t,
            tp.size(),
            tp.sequence_parallel,
            a.bf16 || a.fp16,
        );
        if lead && pp_size > 1 {
            println!(
                "saved activations on pipeline stage 0 at the peak: {:.2} MiB ({} micro-batch chunks in flight)",
                summary.peak_activation_bytes as f64 / (1 << 20) as f64,
                summary.peak_in_flight
            );
        } else if lead {
            println!(
            "activations held per micro-batch and rank: {:.2} MiB measured, engine formula {:.2} MiB; Megatron's sbh(34 + 5as/h){} per layer would be {:.2} MiB in f32",
            summary.peak_activation_bytes as f64 / (1 << 20) as f64,
            engine as f64 / (1 << 20) as f64,
            if tp.sequence_parallel { "/t" } else { "" },
            formula / (1 << 20) as f64 / if tp.sequence_parallel { tp.size() as f64 } else { 1.0 }
        );
        }
    }
    Ok(summary)
}

/// Token ids of samples `start..start + count` of a split, in the order training consumes them
/// (`megatron inspect-data`).
pub fn inspect_data(args: &crate::arguments::InspectArgs) -> Result<Vec<Vec<u32>>, TrainError> {
    let tok = build_tokenizer_from(&args.train.tokenizer.spec())?;
    let cfg = args.train.validate(tok.vocab_size())?;
    let split = match args.split_name.as_str() {
        "train" => Split::Train,
        "valid" => Split::Valid,
        "test" => Split::Test,
        other => {
            return Err(TrainError::Args(format!(
                "--split-name {other}: expected train, valid or test"
            )))
        }
    };
    let data = build_data(&cfg, tok.as_ref(), true)?;
    let n = data.num_samples(split);
    if n == 0 {
        return Err(TrainError::Args(format!(
            "the {} split is empty",
            args.split_name
        )));
    }
    let mut buf = vec![0u32; cfg.args.seq_length + 1];
    Ok((args.start..args.start + args.count)
        .map(|i| {
            data.sample(split, i, &mut buf);
            buf.clone()
        })
        .collect())
}
