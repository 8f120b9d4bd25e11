//! Flags of Megatron launch scripts that choose GPU kernels, fusions or launchers: accepted so
//! that a script's argument lists run unchanged, and named once at start-up as having no effect
//! here. None of them changes what is computed (Megatron's fused and unfused paths compute the
//! same function); flags that would change the model or the sample order are refused instead.

use crate::TrainError;
use clap::{Args, ValueEnum};

/// `--attention-backend` (megatron-core's `AttnBackend`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionBackendArg {
    Flash,
    Fused,
    Unfused,
    Local,
    Auto,
}

/// `--transformer-impl`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransformerImplArg {
    Local,
    #[value(name = "transformer_engine")]
    TransformerEngine,
    #[value(name = "inference_optimized")]
    InferenceOptimized,
}

/// `--distributed-backend`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DistributedBackendArg {
    Nccl,
    Gloo,
    Ccl,
}

/// `--dataloader-type`: megatron-rs reads samples as Megatron's `single` sampler does.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataloaderTypeArg {
    Single,
    Cyclic,
    External,
}

/// The accepted flags (see the module doc).
#[derive(Args, Clone, Debug, Default)]
pub struct ScriptCompatArgs {
    #[arg(long, value_enum)]
    pub attention_backend: Option<AttentionBackendArg>,
    #[arg(long, value_enum)]
    pub transformer_impl: Option<TransformerImplArg>,
    #[arg(long, value_enum)]
    pub distributed_backend: Option<DistributedBackendArg>,
    #[arg(long, value_enum)]
    pub dataloader_type: Option<DataloaderTypeArg>,
    /// Data-loader worker processes: samples are read on the rank here.
    #[arg(long)]
    pub num_workers: Option<usize>,
    /// TensorBoard scalars are written at every --log-interval here.
    #[arg(long)]
    pub tensorboard_log_interval: Option<u64>,
    #[arg(long)]
    pub use_mcore_models: bool,
    #[arg(long)]
    pub use_flash_attn: bool,
    #[arg(long)]
    pub log_throughput: bool,
    #[arg(long)]
    pub no_gradient_accumulation_fusion: bool,
    #[arg(long)]
    pub no_masked_softmax_fusion: bool,
    #[arg(long)]
    pub no_bias_gelu_fusion: bool,
    #[arg(long)]
    pub no_bias_swiglu_fusion: bool,
    #[arg(long)]
    pub no_bias_dropout_fusion: bool,
    #[arg(long)]
    pub no_rope_fusion: bool,
    #[arg(long)]
    pub no_persist_layer_norm: bool,
    #[arg(long)]
    pub cross_entropy_loss_fusion: bool,
    #[arg(long)]
    pub accumulate_allreduce_grads_in_fp32: bool,
    #[arg(long)]
    pub manual_gc: bool,
    #[arg(long)]
    pub manual_gc_interval: Option<u64>,
}

impl ScriptCompatArgs {
    /// Refuses the values whose meaning megatron-rs does not implement.
    pub fn check(&self) -> Result<(), TrainError> {
        match self.dataloader_type {
            Some(DataloaderTypeArg::Cyclic) | Some(DataloaderTypeArg::External) => {
                Err(TrainError::Args(format!(
                    "--dataloader-type {}: megatron-rs reads samples in the order of Megatron's \
                     `single` sampler (the default); cyclic and external loaders are not implemented",
                    self.dataloader_type
                        .and_then(|t| t.to_possible_value())
                        .map_or_else(String::new, |v| v.get_name().to_string())
                )))
            }
            _ => Ok(()),
        }
    }

    /// The flags given, as they were spelled, for the start-up note.
    pub fn given(&self) -> Vec<&'static str> {
        let options = [
            ("--attention-backend", self.attention_backend.is_some()),
            ("--transformer-impl", self.transformer_impl.is_some()),
            ("--distributed-backend", self.distributed_backend.is_some()),
            ("--dataloader-type", self.dataloader_type.is_some()),
            ("--num-workers", self.num_workers.is_some()),
            (
                "--tensorboard-log-interval",
                self.tensorboard_log_interval.is_some(),
            ),
            ("--use-mcore-models", self.use_mcore_models),
            ("--use-flash-attn", self.use_flash_attn),
            ("--log-throughput", self.log_throughput),
            (
                "--no-gradient-accumulation-fusion",
                self.no_gradient_accumulation_fusion,
            ),
            ("--no-masked-softmax-fusion", self.no_masked_softmax_fusion),
            ("--no-bias-gelu-fusion", self.no_bias_gelu_fusion),
            ("--no-bias-swiglu-fusion", self.no_bias_swiglu_fusion),
            ("--no-bias-dropout-fusion", self.no_bias_dropout_fusion),
            ("--no-rope-fusion", self.no_rope_fusion),
            ("--no-persist-layer-norm", self.no_persist_layer_norm),
            (
                "--cross-entropy-loss-fusion",
                self.cross_entropy_loss_fusion,
            ),
            (
                "--accumulate-allreduce-grads-in-fp32",
                self.accumulate_allreduce_grads_in_fp32,
            ),
            ("--manual-gc", self.manual_gc),
            ("--manual-gc-interval", self.manual_gc_interval.is_some()),
        ];
        options
            .into_iter()
            .filter_map(|(flag, on)| on.then_some(flag))
            .collect()
    }

    /// The start-up note, if any flag of this kind was given.
    pub fn note(&self) -> Option<String> {
        let given = self.given();
        (!given.is_empty()).then(|| {
            format!(
                "note: {} accepted from Megatron's scripts and without effect here (they choose \
                 GPU kernels, fusions or launchers; the computation is the same; gradients are \
                 always reduced in fp32 and throughput always logged)",
                given.join(", ")
            )
        })
    }
}
