//! Rank launch: one rank in this process, `--nproc-per-node` rank threads, or one MPI process
//! per rank; Megatron's process groups, health-checked before any work.

use crate::arguments::{TrainArgs, TrainConfig};
use crate::logging::write_trace;
use crate::training::{run, PeakOf, TrainSummary};
use crate::TrainError;
use megatron_comm::Communicator;
use megatron_data::build_tokenizer_from;

/// Trains as `megatron train` does; returns the per-iteration losses.
pub fn pretrain(args: &TrainArgs) -> Result<TrainSummary, TrainError> {
    if args.model == crate::arguments::ModelArg::Tabular {
        #[cfg(feature = "mpi")]
        if megatron_comm::mpi_comm::launched_by_mpi() {
            return Err(TrainError::Args(
                "--model tabular runs its ranks as threads (--nproc-per-node); under mpirun every process would train alone".into(),
            ));
        }
        let s = crate::tabular::pretrain_tabular(crate::tabular::validate(args)?)?;
        return Ok(TrainSummary {
            start_iteration: s.start_iteration,
            final_iteration: s.losses.last().map_or(s.start_iteration, |l| l.0),
            losses: s.losses,
            last_checkpoint: s.last_checkpoint,
            ..TrainSummary::default()
        });
    }
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
        .start_handler(|_| megatron_tensor::alloc::set_rank(0))
        .build()
        .map_err(|e| TrainError::Args(format!("--num-threads {threads}: {e}")))?;
    if cfg.world() == 1 {
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
    // A failed or panicking rank leaves through MPI_Abort, never MPI_Finalize: finalizing waits
    // for every rank, so a rank that stopped arriving (hung, SIGSTOPped) would hang the job with
    // nothing printed. The error (group, operation, sequence number, missing ranks) is printed
    // first; mpirun then ends every process with a non-zero status.
    let world_rank = {
        use mpi::traits::Communicator as _;
        universe.world().rank()
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train_mpi_process(&universe, args, vocab_size, threads)
    }));
    let msg = match result {
        Ok(Ok(summary)) => return Ok(summary),
        Ok(Err(e)) => format!("error: rank {world_rank}: {e}"),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            format!("error: rank {world_rank} panicked: {what}")
        }
    };
    eprintln!("{msg}; aborting the MPI job");
    use mpi::traits::Communicator as _;
    universe.world().abort(2)
}

/// One MPI process's training: groups over the MPI world, then the loop.
#[cfg(feature = "mpi")]
fn train_mpi_process(
    universe: &mpi::environment::Universe,
    args: &TrainArgs,
    vocab_size: usize,
    threads: usize,
) -> Result<TrainSummary, TrainError> {
    let mut comm = megatron_comm::mpi_comm::MpiCommunicator::world(universe);
    let n = comm.size();
    // The MPI world takes the place of --nproc-per-node in the layout checks.
    let mut a = args.clone();
    a.nproc_per_node = n;
    let cfg = a.validate(vocab_size)?;
    let tok = build_tokenizer_from(&cfg.args.tokenizer.spec())?;
    let mut groups = process_groups(&mut comm, &cfg, "MPI")?;
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

/// Splits the world into Megatron's groups, prints the layout on rank 0 and health-checks every
/// group (small all-reduce with a known answer, 10 s timeout) before any work.
/// Afterwards every group's operations time out after `--distributed-timeout-minutes`.
pub(crate) fn process_groups(
    world: &mut dyn Communicator,
    cfg: &TrainConfig,
    backend: &str,
) -> Result<megatron_comm::ProcessGroups, TrainError> {
    let (tp, pp) = (cfg.tp, cfg.pp);
    let n = cfg.world();
    let ps = megatron_comm::ParallelState::new(
        n,
        tp,
        pp,
        cfg.cp,
        cfg.ep,
        megatron_comm::ParallelState::DEFAULT_ORDER,
    )
    .and_then(|ps| ps.with_expert_tensor_parallel(cfg.etp))
    .map_err(|e| TrainError::Args(e.to_string()))?;
    if world.rank() == 0 {
        println!("layout ({backend}): {}", ps.describe());
    }
    let mut groups = megatron_comm::ProcessGroups::new(world, ps)?;
    groups
        .health_check(
            std::time::Duration::from_secs(10),
            std::time::Duration::from_secs_f64(cfg.args.distributed_timeout_minutes * 60.0),
        )
        .map_err(|msg| TrainError::Rank {
            rank: world.rank(),
            msg,
        })?;
    Ok(groups)
}

/// The worker threads of rank thread `rank`: their allocations count towards that rank.
pub(crate) fn rank_thread_pool(
    rank: usize,
    threads: usize,
) -> Result<rayon::ThreadPool, TrainError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .start_handler(move |_| megatron_tensor::alloc::set_rank(rank))
        .build()
        .map_err(|e| TrainError::Rank {
            rank,
            msg: e.to_string(),
        })
}

/// Data-parallel training on `--nproc-per-node` rank threads: each rank owns a share of the cores,
/// runs its micro-batches, and gradients are averaged over the ranks before every step.
fn pretrain_ranks(
    cfg: TrainConfig,
    spec: megatron_data::TokenizerSpec,
    threads: usize,
) -> Result<TrainSummary, TrainError> {
    let n = cfg.world();
    let trace_path = cfg.args.profile_trace.clone();
    let per_rank = (threads / n).max(1);
    // A rank that stops arriving makes its peers' operations time out after the distributed
    // timeout; give them that and a margin, then report instead of waiting for the stuck rank.
    let grace =
        std::time::Duration::from_secs_f64(cfg.args.distributed_timeout_minutes * 60.0 + 10.0);
    let cfg = std::sync::Arc::new(cfg);
    let results = megatron_comm::run_ranks_until_failure(
        n,
        grace,
        move |rank, comm| -> Result<TrainSummary, TrainError> {
            megatron_tensor::alloc::set_rank(rank);
            let tok = build_tokenizer_from(&spec)?;
            let mut groups = process_groups(comm, &cfg, "threads")?;
            rank_thread_pool(rank, per_rank)?.install(|| {
                megatron_tensor::threads::set_gemm_threads(per_rank);
                run(
                    &cfg,
                    tok.as_ref(),
                    per_rank,
                    Some(&mut groups),
                    PeakOf::Threads(threads),
                )
            })
        },
    );
    use megatron_comm::RankOutcome;
    let mut first_err = None;
    let mut consequence = None;
    let mut lead = None;
    let mut traces = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            RankOutcome::Finished(Ok(mut s)) => {
                traces.push((s.world_rank, std::mem::take(&mut s.trace)));
                if rank == 0 {
                    lead = Some(s);
                }
            }
            // A call aborted by a peer's exit is a consequence: report the first root cause,
            // whatever rank order the consequences came in.
            RankOutcome::Finished(Err(TrainError::Comm(
                e @ (megatron_comm::CommError::PeerPanicked { .. }
                | megatron_comm::CommError::PeerFailed { .. }),
            ))) => {
                consequence.get_or_insert(TrainError::Comm(e));
            }
            RankOutcome::Finished(Err(e)) => {
                first_err.get_or_insert(e);
            }
            RankOutcome::Panicked(msg) => {
                first_err = Some(TrainError::Rank { rank, msg });
            }
            RankOutcome::Stuck => {
                // Its peers' errors name it as the rank that did not arrive.
                eprintln!("rank {rank} stopped arriving; left running while the job ends");
                first_err.get_or_insert(TrainError::Rank {
                    rank,
                    msg: "stopped arriving (no result)".into(),
                });
            }
        }
    }
    let first_err = first_err.or(consequence);
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
