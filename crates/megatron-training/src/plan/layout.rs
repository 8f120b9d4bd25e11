//! The layouts a plan considers: every combination of tensor, pipeline (and virtual),
//! context, expert and data parallelism, micro-batch size, recomputation and optimizer sharding
//! that the engine's own flag checks accept for the device count, with tensor parallelism
//! inside a node. Each candidate is the training flags with the layout written in, validated
//! exactly as `megatron train` validates them, so the plan never proposes a layout training
//! would refuse.

use crate::arguments::{RecomputeGranularityArg, RecomputeMethodArg, TrainArgs, TrainConfig};

/// Layout choices the user fixed (a flag given on the command line); the rest are searched.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pins {
    pub tp: Option<usize>,
    pub pp: Option<usize>,
    /// Layers per virtual pipeline stage.
    pub vp_layers: Option<usize>,
    pub cp: Option<usize>,
    pub ep: Option<usize>,
    pub micro_batch_size: Option<usize>,
    pub recompute: Option<RecomputeChoice>,
    pub distributed_optimizer: Option<bool>,
}

/// Recomputation as the planner varies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RecomputeChoice {
    None,
    /// Core attention (Megatron's `--recompute-activations`).
    Selective,
    /// Every layer (`--recompute-granularity full --recompute-method uniform
    /// --recompute-num-layers 1`).
    Full,
}

impl RecomputeChoice {
    pub fn name(self) -> &'static str {
        match self {
            RecomputeChoice::None => "none",
            RecomputeChoice::Selective => "selective",
            RecomputeChoice::Full => "full",
        }
    }
}

/// One layout: the flags it sets and the validated configuration.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub tp: usize,
    pub pp: usize,
    pub vp_layers: Option<usize>,
    pub cp: usize,
    pub ep: usize,
    pub dp: usize,
    pub micro_batch_size: usize,
    pub recompute: RecomputeChoice,
    pub distributed_optimizer: bool,
    pub config: TrainConfig,
}

impl Candidate {
    /// Model chunks per pipeline stage.
    pub fn virtual_stages(&self) -> usize {
        self.config.partition.v
    }

    /// The layout's table columns: TP PP VP CP EP DP MBS recompute dist.
    pub fn columns(&self) -> String {
        let vp = match self.virtual_stages() {
            1 => "-".to_string(),
            v => v.to_string(),
        };
        format!(
            "{:>3} {:>3} {:>3} {:>3} {:>3} {:>5} {:>4} {:>9} {:>5}",
            self.tp,
            self.pp,
            vp,
            self.cp,
            self.ep,
            self.dp,
            self.micro_batch_size,
            self.recompute.name(),
            if self.distributed_optimizer {
                "yes"
            } else {
                "no"
            }
        )
    }

    /// The flags that select this layout in `megatron train`.
    pub fn flags(&self) -> String {
        let mut f = format!(
            "--tensor-model-parallel-size {} --pipeline-model-parallel-size {}",
            self.tp, self.pp
        );
        if let Some(l) = self.vp_layers {
            f += &format!(" --num-layers-per-virtual-pipeline-stage {l}");
        }
        if self.cp > 1 {
            f += &format!(" --context-parallel-size {}", self.cp);
        }
        if self.ep > 1 {
            f += &format!(" --expert-model-parallel-size {}", self.ep);
        }
        f += &format!(" --micro-batch-size {}", self.micro_batch_size);
        f += match self.recompute {
            RecomputeChoice::None => "",
            RecomputeChoice::Selective => " --recompute-activations",
            RecomputeChoice::Full => {
                " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
            }
        };
        if self.distributed_optimizer {
            f += " --use-distributed-optimizer";
        }
        f
    }
}

/// One combination of the searched choices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub tp: usize,
    pub pp: usize,
    pub vp_layers: Option<usize>,
    pub cp: usize,
    pub ep: usize,
    pub micro_batch_size: usize,
    pub recompute: RecomputeChoice,
    pub distributed_optimizer: bool,
}

/// The training flags `template` with the layout `c` of `devices` ranks written in (mock data:
/// a plan and its measurements do not read the corpus).
pub fn layout_args(template: &TrainArgs, devices: usize, c: &Choice) -> TrainArgs {
    let mut a = template.clone();
    a.tensor_model_parallel_size = c.tp;
    a.pipeline_model_parallel_size = c.pp;
    a.num_layers_per_virtual_pipeline_stage = c.vp_layers;
    a.context_parallel_size = c.cp;
    a.expert_model_parallel_size = c.ep;
    a.micro_batch_size = c.micro_batch_size;
    a.nproc_per_node = devices;
    a.use_distributed_optimizer = c.distributed_optimizer;
    a.overlap_param_gather = a.overlap_param_gather && c.distributed_optimizer;
    a.mock_data = true;
    a.recompute_activations = false;
    (
        a.recompute_granularity,
        a.recompute_method,
        a.recompute_num_layers,
    ) = match c.recompute {
        RecomputeChoice::None => (None, None, None),
        RecomputeChoice::Selective => (Some(RecomputeGranularityArg::Selective), None, None),
        RecomputeChoice::Full => (
            Some(RecomputeGranularityArg::Full),
            Some(RecomputeMethodArg::Uniform),
            Some(1),
        ),
    };
    if a.train_iters.is_none() && a.train_samples.is_none() {
        // A schedule long enough for the warm-up: the plan does not depend on it.
        a.train_iters = Some(a.lr_warmup_iters.unwrap_or(0) + 1);
    }
    a
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn choose<T: Copy>(pin: Option<T>, all: Vec<T>) -> Vec<T> {
    match pin {
        Some(v) => vec![v],
        None => all,
    }
}

/// Every layout of `devices` devices (`per_node` to a node) the flags allow, with the reason
/// the first refused combination gave when none is accepted.
pub fn enumerate(
    template: &TrainArgs,
    vocab_size: usize,
    devices: usize,
    per_node: usize,
    pins: &Pins,
) -> (Vec<Candidate>, Option<String>) {
    let layers = template.num_layers;
    let experts = template.num_experts.unwrap_or(1);
    let mut out = Vec::new();
    let mut first_refusal = None;
    let tps: Vec<usize> = divisors(devices)
        .into_iter()
        .filter(|&t| t <= per_node)
        .collect();
    for tp in choose(pins.tp, tps) {
        if !devices.is_multiple_of(tp) {
            continue;
        }
        let pps: Vec<usize> = divisors(devices / tp)
            .into_iter()
            .filter(|&p| layers.is_multiple_of(p))
            .collect();
        for pp in choose(pins.pp, pps) {
            if !(devices / tp).is_multiple_of(pp) {
                continue;
            }
            let mut vps: Vec<Option<usize>> = vec![None];
            if pp > 2 {
                let per_stage = layers / pp;
                vps.extend(
                    divisors(per_stage)
                        .into_iter()
                        .filter(|&l| l < per_stage)
                        .map(Some),
                );
            }
            let vps = match pins.vp_layers {
                Some(l) => vec![Some(l)],
                None => vps,
            };
            let cps: Vec<usize> = divisors(devices / (tp * pp))
                .into_iter()
                .filter(|&c| c <= 16 && template.seq_length.is_multiple_of(2 * c))
                .collect();
            for vp in vps {
                for &cp in &choose(pins.cp, cps.clone()) {
                    if !(devices / (tp * pp)).is_multiple_of(cp) {
                        continue;
                    }
                    let dp = devices / (tp * pp * cp);
                    let eps: Vec<usize> = if template.num_experts.is_some() {
                        divisors(experts)
                            .into_iter()
                            .filter(|e| (dp * cp).is_multiple_of(*e))
                            .collect()
                    } else {
                        vec![1]
                    };
                    for ep in choose(pins.ep, eps) {
                        for mbs in choose(pins.micro_batch_size, vec![1, 2, 4, 8, 16]) {
                            for rc in choose(
                                pins.recompute,
                                vec![
                                    RecomputeChoice::None,
                                    RecomputeChoice::Selective,
                                    RecomputeChoice::Full,
                                ],
                            ) {
                                for dist in choose(pins.distributed_optimizer, vec![false, true]) {
                                    if dist && dp * cp == 1 {
                                        continue;
                                    }
                                    let choice = Choice {
                                        tp,
                                        pp,
                                        vp_layers: vp,
                                        cp,
                                        ep,
                                        micro_batch_size: mbs,
                                        recompute: rc,
                                        distributed_optimizer: dist,
                                    };
                                    let a = layout_args(template, devices, &choice);
                                    match a.validate(vocab_size) {
                                        Ok(config) => out.push(Candidate {
                                            tp,
                                            pp,
                                            vp_layers: vp,
                                            cp,
                                            ep,
                                            dp,
                                            micro_batch_size: mbs,
                                            recompute: rc,
                                            distributed_optimizer: dist,
                                            config,
                                        }),
                                        Err(e) => {
                                            first_refusal.get_or_insert_with(|| e.to_string());
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if out.is_empty() && first_refusal.is_none() {
        first_refusal = Some(why_no_split(template, devices, pins));
    }
    (out, first_refusal)
}

/// Why no tensor x pipeline x context x expert split reached the flag checks: a fixed size that
/// does not divide what it must, or, with none fixed, the divisibility rules themselves.
fn why_no_split(template: &TrainArgs, devices: usize, pins: &Pins) -> String {
    let layers = template.num_layers;
    match (pins.tp, pins.pp) {
        (Some(tp), _) if !devices.is_multiple_of(tp) => {
            format!("--tensor-model-parallel-size {tp} does not divide the {devices} devices")
        }
        (_, Some(pp)) if !layers.is_multiple_of(pp) => {
            format!("--pipeline-model-parallel-size {pp} does not divide --num-layers {layers}")
        }
        (tp, Some(pp)) if !(devices / tp.unwrap_or(1)).is_multiple_of(pp) => format!(
            "--pipeline-model-parallel-size {pp} does not divide the {} devices each tensor-parallel group leaves",
            devices / tp.unwrap_or(1)
        ),
        _ => format!(
            "no split of the {devices} devices passes the divisibility rules (tensor-parallel \
             sizes within a node, pipeline stages dividing --num-layers {layers}, context \
             parallelism up to 16 dividing --seq-length / 2, expert parallelism dividing \
             --num-experts and data x context parallelism) with the sizes fixed by flags"
        ),
    }
}
