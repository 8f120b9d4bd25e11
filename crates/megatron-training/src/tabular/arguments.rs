//! `megatron train --model tabular`: its own flags, and the check that turns them (with the
//! shared ones: sizes, schedule, layout, checkpoints) into a typed [`TabularTrainConfig`] once,
//! refusing what the tabular trainer does not do rather than ignoring it.

use crate::arguments::TrainArgs;
use crate::TrainError;
use clap::Args;
use megatron_core::models::tabular::TabularConfig;
use megatron_core::optimizer::{LrDecayStyle, OptimizerParamScheduler, WsdDecayStyle};
use megatron_core::transformer::step::Recompute;
use megatron_data::tables::batching::{COL_MULTIPLE, ROW_MULTIPLE};
use megatron_data::tables::PriorConfig;
use std::path::PathBuf;

#[derive(Args, Clone, Debug)]
pub struct TabularArgs {
    /// Context rows a training view keeps at most (a random subset of the table's).
    #[arg(long, default_value_t = 1024)]
    pub tabular_max_context: usize,
    /// Padded cells (tables x rows x feature columns) per micro-batch.
    #[arg(long, default_value_t = 1 << 17)]
    pub tabular_cell_budget: usize,
    /// Share of observed feature cells hidden from the input and reconstructed.
    #[arg(long, default_value_t = 0.05)]
    pub tabular_hidden_share: f64,
    /// Weight of the masked-cell reconstruction loss beside the supervised one.
    #[arg(long, default_value_t = 0.5)]
    pub tabular_reconstruction_weight: f32,
    /// Borders of the regression and reconstruction bins beyond the prior's quantile bins, in
    /// standard deviations (mirrored below zero; comma-separated, increasing; the flag with no
    /// value: none). With --load of a checkpoint whose bins stop short of them, its outer bins
    /// are split at them and training goes on.
    #[arg(long, num_args = 0.., value_delimiter = ',', default_values_t = [2.25f32, 2.75, 3.5, 4.5, 6.0])]
    pub tabular_tail_borders: Vec<f32>,
    /// Real tables evaluated every --eval-interval iterations: CSV files whose last column is
    /// the target (classes when it holds text or at most 10 distinct integers).
    #[arg(long, num_args = 1..)]
    pub tabular_eval_data: Vec<PathBuf>,
    #[arg(long, default_value_t = 32)]
    pub prior_min_context_rows: usize,
    #[arg(long, default_value_t = 1024)]
    pub prior_max_context_rows: usize,
    #[arg(long, default_value_t = 128)]
    pub prior_max_query_rows: usize,
    #[arg(long, default_value_t = 2)]
    pub prior_min_features: usize,
    #[arg(long, default_value_t = 100)]
    pub prior_max_features: usize,
    /// Share of prior tables with a continuous target.
    #[arg(long, default_value_t = 0.3)]
    pub prior_regression_share: f64,
    /// Share of prior tables whose causal functions are mostly linear maps.
    #[arg(long, default_value_t = 0.3)]
    pub prior_linear_share: f64,
    /// Threads drawing prior tables ahead of the training step.
    #[arg(long, default_value_t = 1)]
    pub prior_workers: usize,
}

/// Whose learning-rate schedule a run resumed with `--load` follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResumeSchedule {
    /// The checkpoint's (Megatron's default).
    Checkpoint,
    /// These flags', at the checkpoint's step count (`--override-opt_param-scheduler`).
    Flags,
}

/// Everything the tabular trainer reads, validated.
#[derive(Clone, Debug)]
pub struct TabularTrainConfig {
    pub model: TabularConfig,
    pub prior: PriorConfig,
    pub tp: usize,
    /// Context parallelism: each table's rows split over this many ranks.
    pub cp: usize,
    pub dp: usize,
    pub train_iters: u64,
    /// Tables per optimizer step (`--global-batch-size`).
    pub tables_per_step: usize,
    pub scheduler: OptimizerParamScheduler,
    /// Whose learning-rate schedule a resumed run follows.
    pub resume_schedule: ResumeSchedule,
    pub weight_decay: f32,
    pub adam: (f32, f32, f32),
    pub clip_grad: f32,
    pub seed: u64,
    pub max_context: usize,
    pub cell_budget: usize,
    pub hidden_share: f64,
    pub reconstruction_weight: f32,
    /// Bin borders beyond the prior's quantiles, positive and increasing (mirrored below zero).
    pub tail_borders: Vec<f32>,
    pub prior_workers: usize,
    pub eval_data: Vec<PathBuf>,
    pub eval_interval: u64,
    pub log_interval: u64,
    pub save: Option<PathBuf>,
    pub save_interval: Option<u64>,
    pub load: Option<PathBuf>,
    pub metrics_file: Option<String>,
    pub threads: usize,
    /// `--recompute-granularity full` (uniform or block): layers run again in backward.
    pub recompute: Recompute,
}

impl TabularTrainConfig {
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp
    }
}

fn refuse(flag: &str, why: &str) -> TrainError {
    TrainError::Args(format!("--model tabular: {flag} {why}"))
}

impl TabularArgs {
    pub fn prior_config(&self) -> PriorConfig {
        PriorConfig {
            min_context_rows: self.prior_min_context_rows,
            max_context_rows: self.prior_max_context_rows,
            max_query_rows: self.prior_max_query_rows,
            min_features: self.prior_min_features,
            max_features: self.prior_max_features,
            regression_share: self.prior_regression_share,
            linear_table_share: self.prior_linear_share,
            ..PriorConfig::default()
        }
    }
}

/// Checks `a` for `--model tabular` and types it.
pub fn validate(a: &TrainArgs) -> Result<TabularTrainConfig, TrainError> {
    let t = &a.tabular;
    let unsupported: [(&str, bool, &str); 15] = [
        (
            "--pipeline-model-parallel-size",
            a.pipeline_model_parallel_size > 1,
            "above 1 is not supported (the model is small per table; use data parallelism)",
        ),
        (
            "--expert-model-parallel-size",
            a.expert_model_parallel_size > 1,
            "does not apply (the tabular model has no experts)",
        ),
        (
            "--num-experts",
            a.num_experts.is_some(),
            "does not apply (the tabular model has no experts)",
        ),
        ("--bf16", a.bf16, "is not supported yet (fp32 only)"),
        ("--fp16", a.fp16, "is not supported yet (fp32 only)"),
        (
            "--sequence-parallel",
            a.sequence_parallel,
            "does not apply (a table has no token sequence)",
        ),
        (
            "--data-path",
            !a.data_path.is_empty() || a.mock_data,
            "does not apply: the tabular model trains on tables drawn from the synthetic prior",
        ),
        (
            "--use-distributed-optimizer",
            a.use_distributed_optimizer,
            "is not supported yet for the tabular model",
        ),
        (
            "--decoupled-lr",
            a.decoupled_lr.is_some(),
            "does not apply (the tabular model has no word embedding or output layer)",
        ),
        (
            "--optimizer sgd / lion / muon",
            a.optimizer != crate::arguments::OptimizerArg::Adam,
            "is not supported yet for the tabular model (Adam only)",
        ),
        (
            "--window-size",
            a.window_size.is_some(),
            "does not apply (the tabular model's attention is over a table's rows and columns)",
        ),
        (
            "--use-precision-aware-optimizer",
            a.use_precision_aware_optimizer,
            "is not supported for the tabular model (its optimizer keeps fp32 moments)",
        ),
        (
            "--calculate-per-token-loss",
            a.calculate_per_token_loss,
            "does not apply (the tabular model's loss is over a table's query cells)",
        ),
        (
            "--qk-layernorm / --apply-wd-to-qk-layernorm",
            a.qk_layernorm || a.apply_wd_to_qk_layernorm || a.no_weight_decay_cond_type.is_some(),
            "does not apply (the tabular model's attention has no query and key norms)",
        ),
        (
            "--swiglu / --squared-relu / --quick-geglu / --no-bias-gelu-fusion",
            a.swiglu || a.squared_relu || a.quick_geglu || a.no_bias_gelu_fusion,
            "does not apply (the tabular model's MLP is its own GELU)",
        ),
    ];
    if let Some((flag, _, why)) = unsupported.iter().find(|u| u.1) {
        return Err(refuse(flag, why));
    }
    let recompute = a.recompute()?;
    if let Recompute::Selective(_) = recompute {
        return Err(refuse(
            "--recompute-granularity",
            "selective (or --recompute-activations) is not supported for the tabular model; use --recompute-granularity full",
        ));
    }
    let tp = a.tensor_model_parallel_size.max(1);
    let cp = a.context_parallel_size.max(1);
    let world = a.nproc_per_node.max(1);
    if !world.is_multiple_of(tp * cp) {
        return Err(TrainError::Args(format!(
            "--nproc-per-node {world} is not a multiple of --tensor-model-parallel-size {tp} x --context-parallel-size {cp}"
        )));
    }
    // Each table's padded rows are cut into 2 x CP chunks (rows pad to a multiple of 16).
    if !ROW_MULTIPLE.is_multiple_of(2 * cp) {
        return Err(refuse(
            "--context-parallel-size",
            &format!("must be 1, 2, 4 or 8 (rows are padded to multiples of {ROW_MULTIPLE} and cut into 2 x CP chunks), got {cp}"),
        ));
    }
    for (flag, v) in [
        ("--hidden-size", a.hidden_size),
        ("--num-attention-heads", a.num_attention_heads),
        ("--num-layers", a.num_layers),
        ("--ffn-hidden-size", a.ffn_hidden_size.unwrap_or(1)),
    ] {
        if v == 0 {
            return Err(refuse(flag, "must be positive, got 0"));
        }
    }
    let heads = a.num_attention_heads;
    if !a.hidden_size.is_multiple_of(heads) {
        return Err(TrainError::Args(format!(
            "--hidden-size {} must be a multiple of --num-attention-heads {heads}",
            a.hidden_size
        )));
    }
    let ffn = a.ffn_hidden_size.unwrap_or(4 * a.hidden_size);
    if !heads.is_multiple_of(tp) || !ffn.is_multiple_of(tp) {
        return Err(TrainError::Args(format!(
            "--tensor-model-parallel-size {tp} must divide --num-attention-heads {heads} and --ffn-hidden-size {ffn}"
        )));
    }
    if !(heads / tp).is_multiple_of(cp) {
        return Err(TrainError::Args(format!(
            "--context-parallel-size {cp} must divide the {} attention heads of a tensor-parallel rank (column attention runs on whole columns of a share of the heads)",
            heads / tp
        )));
    }
    let train_iters = a
        .train_iters
        .ok_or_else(|| refuse("--train-iters", "is required"))?;
    let tables_per_step = a.global_batch_size.unwrap_or(16);
    let dp = world / (tp * cp);
    if tables_per_step == 0 {
        return Err(refuse("--global-batch-size", "must be at least 1"));
    }
    let prior = t.prior_config();
    if prior.min_context_rows < 2 || prior.min_context_rows > prior.max_context_rows {
        return Err(refuse(
            "--prior-min-context-rows",
            "must be at least 2 and at most --prior-max-context-rows",
        ));
    }
    if prior.min_features == 0 || prior.min_features > prior.max_features {
        return Err(refuse(
            "--prior-min-features",
            "must be at least 1 and at most --prior-max-features",
        ));
    }
    if prior.max_query_rows == 0 {
        return Err(refuse("--prior-max-query-rows", "must be at least 1"));
    }
    if !(0.0..=1.0).contains(&prior.regression_share) {
        return Err(refuse("--prior-regression-share", "must be in [0, 1]"));
    }
    if !(0.0..=1.0).contains(&prior.linear_table_share) {
        return Err(refuse("--prior-linear-share", "must be in [0, 1]"));
    }
    if a.override_opt_param_scheduler && a.load.is_none() {
        return Err(refuse("--override-opt_param-scheduler", "needs --load"));
    }
    let tails = &t.tabular_tail_borders;
    if !tails.iter().all(|v| v.is_finite() && *v > 0.0) || !tails.windows(2).all(|w| w[0] < w[1]) {
        return Err(refuse(
            "--tabular-tail-borders",
            "must be positive, finite and increasing",
        ));
    }
    if !(0.0..0.5).contains(&t.tabular_hidden_share) {
        return Err(refuse("--tabular-hidden-share", "must be in [0, 0.5)"));
    }
    let max_context = t.tabular_max_context.min(prior.max_context_rows);
    if max_context < 2 {
        return Err(refuse("--tabular-max-context", "must be at least 2"));
    }
    // The largest table a view can hold must fit a micro-batch on its own.
    let rows = (max_context + prior.max_query_rows).next_multiple_of(ROW_MULTIPLE);
    let cols = prior.max_features.next_multiple_of(COL_MULTIPLE);
    if rows * cols > t.tabular_cell_budget {
        return Err(refuse(
            "--tabular-cell-budget",
            &format!(
                "{} is smaller than the largest table a view can hold ({rows} padded rows x {cols} padded columns = {} cells)",
                t.tabular_cell_budget,
                rows * cols
            ),
        ));
    }
    let decay_style = LrDecayStyle::parse(&a.lr_decay_style).ok_or_else(|| {
        TrainError::Args(format!(
            "--lr-decay-style {:?}: expected constant, linear, cosine, inverse-square-root or WSD",
            a.lr_decay_style
        ))
    })?;
    let warmup = match (a.lr_warmup_iters, a.lr_warmup_fraction) {
        (Some(w), _) => w,
        (None, Some(f)) => (f * train_iters as f64) as u64,
        (None, None) => 0,
    };
    let decay = a.lr_decay_iters.unwrap_or(train_iters);
    let per = tables_per_step as u64;
    let scheduler = OptimizerParamScheduler {
        init_lr: a.lr_warmup_init,
        max_lr: a.lr,
        min_lr: a.min_lr,
        warmup_steps: warmup * per,
        decay_steps: decay * per,
        decay_style,
        wsd_decay_steps: 0,
        wsd_decay_style: WsdDecayStyle::Linear,
        num_steps: 0,
    };
    for p in &t.tabular_eval_data {
        if !p.is_file() {
            return Err(refuse(
                "--tabular-eval-data",
                &format!("{}: no such file", p.display()),
            ));
        }
    }
    Ok(TabularTrainConfig {
        model: TabularConfig {
            emb: a.hidden_size,
            heads,
            ffn,
            layers: a.num_layers,
            init_std: a.init_method_std,
            eps: a.norm_epsilon,
        },
        prior,
        tp,
        cp,
        dp,
        train_iters,
        tables_per_step,
        scheduler,
        resume_schedule: if a.override_opt_param_scheduler {
            ResumeSchedule::Flags
        } else {
            ResumeSchedule::Checkpoint
        },
        weight_decay: a.weight_decay,
        adam: (a.adam_beta1, a.adam_beta2, a.adam_eps),
        clip_grad: a.clip_grad,
        seed: a.seed,
        max_context,
        cell_budget: t.tabular_cell_budget,
        hidden_share: t.tabular_hidden_share,
        reconstruction_weight: t.tabular_reconstruction_weight,
        tail_borders: tails.clone(),
        prior_workers: t.prior_workers.max(1),
        eval_data: t.tabular_eval_data.clone(),
        eval_interval: a.eval_interval,
        log_interval: a.log_interval.max(1),
        save: a.save.as_ref().map(PathBuf::from),
        save_interval: a.save_interval,
        load: a.load.as_ref().map(PathBuf::from),
        metrics_file: a.metrics_file.clone(),
        threads: a
            .num_threads
            .unwrap_or_else(megatron_tensor::threads::available_cores),
        recompute,
    })
}
