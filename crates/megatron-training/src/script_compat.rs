//! Flags of Megatron launch scripts that choose GPU kernels, fusions, overlaps, checkpoint
//! formats, loggers or launchers: accepted so that a script's argument lists run unchanged, and
//! named once at start-up as having no effect here. None of them changes what is computed
//! (Megatron's fused and unfused paths compute the same function, except bias-GELU's: that
//! flag, `--no-bias-gelu-fusion`, is a model flag here); flags that would change the model or
//! the sample order are refused or implemented instead.

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

/// `--ckpt-format`: checkpoints here are always megatron-rs's sharded safetensors with a
/// manifest (`megatron convert --to hf` exports them).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CkptFormatArg {
    Torch,
    #[value(name = "torch_dist")]
    TorchDist,
    Zarr,
    #[value(name = "torch_dcp")]
    TorchDcp,
    #[value(name = "fsdp_dtensor")]
    FsdpDtensor,
}

/// `--timing-log-option`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimingLogOptionArg {
    Max,
    Minmax,
    All,
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
    /// Data-loader worker processes: samples are read on the rank here.
    #[arg(long)]
    pub num_workers: Option<usize>,
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
    pub no_bias_swiglu_fusion: bool,
    #[arg(long)]
    pub no_bias_dropout_fusion: bool,
    #[arg(long)]
    pub no_rope_fusion: bool,
    #[arg(long)]
    pub no_persist_layer_norm: bool,
    /// megatron-core's Triton kernel for Muon's symmetric `X·Xᵀ`: here the Newton–Schulz
    /// iteration always computes its symmetric products as upper triangles.
    #[arg(long)]
    pub muon_use_syrk: bool,
    #[arg(long)]
    pub cross_entropy_loss_fusion: bool,
    #[arg(long)]
    pub accumulate_allreduce_grads_in_fp32: bool,
    #[arg(long)]
    pub manual_gc: bool,
    #[arg(long)]
    pub manual_gc_interval: Option<u64>,
    /// GPU caching-allocator flushes.
    #[arg(long)]
    pub empty_unused_memory_level: Option<u8>,
    #[arg(long)]
    pub use_cpu_initialization: bool,
    #[arg(long, value_enum)]
    pub ckpt_format: Option<CkptFormatArg>,
    #[arg(long)]
    pub use_dist_ckpt: bool,
    /// Every rank already writes and reads its own shards.
    #[arg(long)]
    pub ckpt_fully_parallel_save: bool,
    #[arg(long)]
    pub ckpt_fully_parallel_load: bool,
    /// There is no RNG state to save: streams are counter-based.
    #[arg(long)]
    pub no_save_rng: bool,
    #[arg(long)]
    pub async_tensor_model_parallel_allreduce: bool,
    #[arg(long)]
    pub no_async_tensor_model_parallel_allreduce: bool,
    #[arg(long)]
    pub tp_comm_overlap: bool,
    #[arg(long)]
    pub overlap_p2p_communication: bool,
    #[arg(long)]
    pub no_overlap_p2p_communication: bool,
    /// Attention masks are never built by the data loader here.
    #[arg(long)]
    pub no_create_attention_mask_in_dataloader: bool,
    /// `.bin` files are memory-mapped; reading them gives the same tokens.
    #[arg(long)]
    pub no_mmap_bin_files: bool,
    /// Threads that build the dataset indices (the same indices for any count).
    #[arg(long)]
    pub num_dataset_builder_threads: Option<usize>,
    /// Read by no code path of current Megatron; the fused GELU is the tanh one already.
    #[arg(long)]
    pub openai_gelu: bool,
    #[arg(long, value_enum)]
    pub timing_log_option: Option<TimingLogOptionArg>,
    /// Weights & Biases logging (no client here; --tensorboard-dir and --metrics-file log).
    #[arg(long)]
    pub wandb_project: Option<String>,
    #[arg(long)]
    pub wandb_exp_name: Option<String>,
    #[arg(long)]
    pub wandb_save_dir: Option<String>,
    /// GPU profilers (nsys, the PyTorch profiler, CUDA memory history): `--profile-trace`
    /// writes this engine's own trace.
    #[arg(long)]
    pub profile: bool,
    #[arg(long)]
    pub profile_step_start: Option<u64>,
    #[arg(long)]
    pub profile_step_end: Option<u64>,
    #[arg(long, num_args = 1..)]
    pub profile_ranks: Vec<usize>,
    #[arg(long)]
    pub use_pytorch_profiler: bool,
    #[arg(long)]
    pub record_memory_history: bool,
    #[arg(long)]
    pub memory_snapshot_path: Option<String>,
    #[arg(long)]
    pub nvtx_ranges: bool,
    /// The fused MoE token permutation: the same permutation.
    #[arg(long)]
    pub moe_permute_fusion: bool,
    /// cuBLAS's reduced-precision bf16 reductions, disabled: bf16 products here are always
    /// summed in fp32, which is what the flag asks for.
    #[arg(long)]
    pub disable_bf16_reduced_precision_matmul: bool,
}

impl ScriptCompatArgs {
    /// The flags given, as they were spelled, for the start-up note.
    pub fn given(&self) -> Vec<&'static str> {
        let options = [
            ("--attention-backend", self.attention_backend.is_some()),
            ("--transformer-impl", self.transformer_impl.is_some()),
            ("--distributed-backend", self.distributed_backend.is_some()),
            ("--num-workers", self.num_workers.is_some()),
            ("--use-mcore-models", self.use_mcore_models),
            ("--use-flash-attn", self.use_flash_attn),
            ("--log-throughput", self.log_throughput),
            (
                "--no-gradient-accumulation-fusion",
                self.no_gradient_accumulation_fusion,
            ),
            ("--no-masked-softmax-fusion", self.no_masked_softmax_fusion),
            ("--no-bias-swiglu-fusion", self.no_bias_swiglu_fusion),
            (
                "--no-overlap-p2p-communication",
                self.no_overlap_p2p_communication,
            ),
            (
                "--no-create-attention-mask-in-dataloader",
                self.no_create_attention_mask_in_dataloader,
            ),
            ("--no-mmap-bin-files", self.no_mmap_bin_files),
            (
                "--num-dataset-builder-threads",
                self.num_dataset_builder_threads.is_some(),
            ),
            ("--openai-gelu", self.openai_gelu),
            ("--no-bias-dropout-fusion", self.no_bias_dropout_fusion),
            ("--no-rope-fusion", self.no_rope_fusion),
            ("--no-persist-layer-norm", self.no_persist_layer_norm),
            ("--muon-use-syrk", self.muon_use_syrk),
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
            (
                "--empty-unused-memory-level",
                self.empty_unused_memory_level.is_some(),
            ),
            ("--use-cpu-initialization", self.use_cpu_initialization),
            ("--ckpt-format", self.ckpt_format.is_some()),
            ("--use-dist-ckpt", self.use_dist_ckpt),
            ("--ckpt-fully-parallel-save", self.ckpt_fully_parallel_save),
            ("--ckpt-fully-parallel-load", self.ckpt_fully_parallel_load),
            ("--no-save-rng", self.no_save_rng),
            (
                "--async-tensor-model-parallel-allreduce",
                self.async_tensor_model_parallel_allreduce,
            ),
            (
                "--no-async-tensor-model-parallel-allreduce",
                self.no_async_tensor_model_parallel_allreduce,
            ),
            ("--tp-comm-overlap", self.tp_comm_overlap),
            (
                "--overlap-p2p-communication",
                self.overlap_p2p_communication,
            ),
            ("--timing-log-option", self.timing_log_option.is_some()),
            ("--wandb-project", self.wandb_project.is_some()),
            ("--wandb-exp-name", self.wandb_exp_name.is_some()),
            ("--wandb-save-dir", self.wandb_save_dir.is_some()),
            ("--profile", self.profile),
            ("--profile-step-start", self.profile_step_start.is_some()),
            ("--profile-step-end", self.profile_step_end.is_some()),
            ("--profile-ranks", !self.profile_ranks.is_empty()),
            ("--use-pytorch-profiler", self.use_pytorch_profiler),
            ("--record-memory-history", self.record_memory_history),
            (
                "--memory-snapshot-path",
                self.memory_snapshot_path.is_some(),
            ),
            ("--nvtx-ranges", self.nvtx_ranges),
            ("--moe-permute-fusion", self.moe_permute_fusion),
            (
                "--disable-bf16-reduced-precision-matmul",
                self.disable_bf16_reduced_precision_matmul,
            ),
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
                 GPU kernels, fusions, overlaps or launchers, and the computation is the same; \
                 gradients are always reduced in fp32, \
                 throughput always logged, every rank \
                 writes its own checkpoint shards in megatron-rs's format, random streams have \
                 no state to save, data is memory-mapped, a non-finite loss or gradient norm \
                 always stops the run, bf16 products are summed in fp32, there are no GPU \
                 profilers (--profile-trace writes this engine's trace) and no Weights & Biases \
                 client: --tensorboard-dir and --metrics-file log)",
                given.join(", ")
            )
        })
    }
}
