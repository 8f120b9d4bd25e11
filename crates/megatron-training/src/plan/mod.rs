//! `megatron plan`: before a job is launched, every layout of the model on the cluster with
//! its predicted memory per device and time per iteration, ranked by throughput; layouts that
//! do not fit are refused with the reason. The cost model (`cost`) is checked against Table 1
//! of Narayanan et al. 2021 (tests/plan.rs) and, with `--measure K`, against this machine.

pub mod cluster;
pub mod cost;
pub mod layout;
pub mod machine;
pub mod measure;
pub mod muon_cost;

use crate::arguments::TrainArgs;
use crate::TrainError;
use clap::Args;
use cluster::{Cluster, ClusterArgs};
use cost::Prediction;
use layout::{Candidate, Pins};

#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Layouts to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Run the best K parallel layouts (the best of each TP x PP x VP x CP x EP) here for a few
    /// iterations on thread ranks (`--cluster this-machine`) and print the measured step time
    /// and peak memory beside the prediction.
    #[arg(long, default_value_t = 0)]
    pub measure: usize,
    /// Iterations each measured layout runs (the first is not timed).
    #[arg(long, default_value_t = 6)]
    pub measure_iters: u64,
    /// Search only layouts without the distributed optimizer (`--use-distributed-optimizer`
    /// fixes it on).
    #[arg(long)]
    pub no_distributed_optimizer: bool,
    /// Search only layouts without recomputation (`--recompute-granularity` or
    /// `--recompute-activations` fixes one).
    #[arg(long)]
    pub no_recompute: bool,
}

/// One ranked layout.
#[derive(Clone, Debug)]
pub struct Planned {
    pub layout: Candidate,
    pub prediction: Prediction,
}

/// The plan: layouts that fit, fastest first, and those that do not.
#[derive(Clone, Debug)]
pub struct Plan {
    pub cluster: Cluster,
    pub fits: Vec<Planned>,
    pub too_big: Vec<Planned>,
}

/// Ranks every layout of `template` (the training flags) on `cluster`.
pub fn plan(template: &TrainArgs, cluster: &Cluster, pins: &Pins) -> Result<Plan, TrainError> {
    let vocab = template.tokenizer.vocab_size.ok_or_else(|| {
        TrainError::Args("megatron plan needs --vocab-size (the tokenizer's vocabulary)".into())
    })?;
    if template.global_batch_size.is_none() {
        return Err(TrainError::Args(
            "megatron plan needs --global-batch-size (the layouts are compared at one batch)"
                .into(),
        ));
    }
    let devices = cluster.devices();
    let (candidates, refusal) =
        layout::enumerate(template, vocab, devices, cluster.gpus_per_node, pins);
    if candidates.is_empty() {
        return Err(TrainError::Args(format!(
            "no layout of {devices} devices is valid for these flags: {}",
            refusal.unwrap_or_else(|| "nothing to try".into())
        )));
    }
    let usable = cluster.memory_per_gpu;
    let (mut fits, mut too_big) = (Vec::new(), Vec::new());
    for layout in candidates {
        let prediction = cost::predict(&layout.config, cluster).map_err(TrainError::Args)?;
        let p = Planned { layout, prediction };
        if p.prediction.memory.total() <= usable {
            fits.push(p);
        } else {
            too_big.push(p);
        }
    }
    let by_speed = |a: &Planned, b: &Planned| {
        b.prediction
            .tokens_per_second
            .total_cmp(&a.prediction.tokens_per_second)
    };
    fits.sort_by(by_speed);
    too_big.sort_by(|a, b| {
        a.prediction
            .memory
            .total()
            .total_cmp(&b.prediction.memory.total())
    });
    Ok(Plan {
        cluster: cluster.clone(),
        fits,
        too_big,
    })
}

impl Planned {
    /// One table row: the layout, its memory and its speed.
    pub fn row(&self) -> String {
        let p = &self.prediction;
        format!(
            "{} | {:>8.2} | {:>9.3} {:>8.1} {:>11.0} | {}",
            self.layout.columns(),
            p.memory.total() / 1e9,
            p.time.total(),
            p.tflops_per_device,
            p.tokens_per_second,
            self.breakdown(),
        )
    }

    /// Where the step's time goes (shares of it).
    pub fn breakdown(&self) -> String {
        let t = &self.prediction.time;
        let total = t.total();
        let parts = [
            ("compute", t.compute),
            ("tp", t.tensor_parallel),
            ("cp", t.context_parallel),
            ("ep", t.expert_parallel),
            ("bubble", t.pipeline_bubble),
            ("p2p", t.pipeline_p2p),
            ("dp", t.data_parallel),
            ("optim", t.optimizer),
        ];
        parts
            .iter()
            .filter(|(_, v)| *v / total >= 0.005)
            .map(|(n, v)| format!("{n} {:.0}%", 100.0 * v / total))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

pub const HEADER: &str = " TP  PP  VP  CP  EP    DP  MBS recompute dist. | mem (GB) |  step (s) TFLOP/s    tokens/s | time";

impl Plan {
    /// The report `megatron plan` prints.
    pub fn report(&self, top: usize) -> String {
        let c = &self.cluster;
        let mut s = format!(
            "cluster: {} nodes x {} devices, {:.0} GB each, peak {:.1} TFLOP/s, memory {:.0} GB/s, intra-node {:.0} GB/s, inter-node {:.0} GB/s; GEMMs at {:.0} % of peak, memory-bound kernels at {:.0} % of bandwidth",
            c.num_nodes,
            c.gpus_per_node,
            c.memory_per_gpu / 1e9,
            c.peak_flops / 1e12,
            c.memory_bandwidth / 1e9,
            c.intra_node_bandwidth / 1e9,
            c.inter_node_bandwidth / 1e9,
            c.gemm_efficiency * 100.0,
            c.memory_efficiency * 100.0,
        );
        if c.engine == cluster::Engine::ThisEngine {
            s += &format!(
                "; the optimizer moves {:.0} bytes per parameter",
                c.optimizer_bytes_per_parameter
            );
        }
        if c.ring_exchange_latency > 0.0 {
            s += &format!(
                "; a context-parallel ring exchange waits {:.2} ms",
                c.ring_exchange_latency * 1e3
            );
        }
        if c.tp_collective_latency > 0.0 {
            s += &format!(
                "; a tensor-parallel collective waits {:.2} ms",
                c.tp_collective_latency * 1e3
            );
        }
        s.push('\n');
        if self.fits.is_empty() {
            s += &format!(
                "no layout fits in {:.0} GB per device",
                c.memory_per_gpu / 1e9
            );
            if let Some(best) = self.too_big.first() {
                let m = &best.prediction.memory;
                s += &format!(
                    "; the smallest needs {:.1} GB ({:.1} GB weights, gradients and optimizer state, {:.1} GB activations of {} micro-batches in flight, {:.1} GB logits, {:.1} GB reserved): {}",
                    m.total() / 1e9,
                    m.weights_and_optimizer / 1e9,
                    m.activations / 1e9,
                    m.in_flight,
                    m.logits / 1e9,
                    m.reserved / 1e9,
                    best.layout.flags()
                );
            }
            s.push('\n');
            return s;
        }
        s += &format!(
            "{} layouts fit, {} do not; the {} fastest (TFLOP/s per device, recomputation counted):\n{HEADER}\n",
            self.fits.len(),
            self.too_big.len(),
            top.min(self.fits.len())
        );
        for p in self.fits.iter().take(top) {
            s += &p.row();
            s.push('\n');
        }
        s += &format!("best: {}\n", self.fits[0].layout.flags());
        s
    }
}

impl Pins {
    /// The layout flags the user gave (`given(id)`: the flag with that clap id was on the
    /// command line), fixed in the search.
    pub fn from_flags(a: &PlanArgs, given: impl Fn(&str) -> bool) -> Self {
        let t = &a.train;
        let pick = |id: &str, v: usize| given(id).then_some(v);
        let recompute = if a.no_recompute {
            Some(layout::RecomputeChoice::None)
        } else if t.recompute_granularity == Some(crate::arguments::RecomputeGranularityArg::Full) {
            Some(layout::RecomputeChoice::Full)
        } else if t.recompute_activations || t.recompute_granularity.is_some() {
            Some(layout::RecomputeChoice::Selective)
        } else {
            None
        };
        let distributed_optimizer = if a.no_distributed_optimizer {
            Some(false)
        } else {
            t.use_distributed_optimizer.then_some(true)
        };
        Pins {
            tp: pick("tensor_model_parallel_size", t.tensor_model_parallel_size),
            pp: pick(
                "pipeline_model_parallel_size",
                t.pipeline_model_parallel_size,
            ),
            vp_layers: t.num_layers_per_virtual_pipeline_stage,
            cp: pick("context_parallel_size", t.context_parallel_size),
            ep: pick("expert_model_parallel_size", t.expert_model_parallel_size),
            micro_batch_size: pick("micro_batch_size", t.micro_batch_size),
            recompute,
            distributed_optimizer,
        }
    }
}

/// `megatron plan`: the report, and with `--measure K` the measured beside the predicted.
pub fn run_plan(a: &PlanArgs, pins: &Pins) -> Result<String, TrainError> {
    if a.no_recompute && (a.train.recompute_granularity.is_some() || a.train.recompute_activations)
    {
        return Err(TrainError::Args(
            "--no-recompute contradicts --recompute-granularity / --recompute-activations".into(),
        ));
    }
    if a.no_distributed_optimizer && a.train.use_distributed_optimizer {
        return Err(TrainError::Args(
            "--no-distributed-optimizer contradicts --use-distributed-optimizer".into(),
        ));
    }
    let cluster = a
        .cluster
        .cluster(a.train.peak_tflops, || machine::this_machine(&a.train))?;
    let p = plan(&a.train, &cluster, pins)?;
    let mut out = p.report(a.top);
    if a.measure > 0 {
        if a.cluster.cluster != Some(cluster::Preset::ThisMachine) {
            return Err(TrainError::Args(
                "--measure runs layouts here: it needs --cluster this-machine".into(),
            ));
        }
        out += &measure::measure(&p, a.measure, a.measure_iters)?;
    }
    Ok(out)
}
