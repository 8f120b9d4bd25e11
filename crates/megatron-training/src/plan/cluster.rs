//! The machine a plan is for: devices, their memory and speeds, and how well the engine uses
//! them. Presets give published hardware numbers; every flag overrides its preset.

use crate::TrainError;
use clap::{Args, ValueEnum};

/// How attention runs, which decides its cost: the 2021 Megatron kernels materialise the
/// `s x s` scores (full `s²` FLOPs, softmax and dropout traffic in memory); a blockwise
/// (flash) kernel skips the masked half under a causal mask and keeps scores on chip. This
/// engine's CPU kernel is blockwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AttentionKernel {
    Dense,
    Flash,
}

/// Whose memory accounting applies: Megatron on GPUs (16-bit weights with fp32 main
/// gradients, weights and moments: 18 bytes per parameter; 16-bit activations), or this
/// engine's (f32 weights, gradients and activations; the per-rank peak `--log-memory`
/// predicts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Megatron,
    ThisEngine,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// NVIDIA DGX A100 (80 GB): 8 GPUs on NVSwitch, one 200 Gb/s HDR InfiniBand NIC per GPU, as
    /// in Narayanan et al. 2021 (Selene); with the Megatron of that paper (dense attention).
    DgxA100,
    /// NVIDIA DGX H100: 8 GPUs on NVLink 4, one 400 Gb/s NDR NIC per GPU; flash attention.
    DgxH100,
    /// This machine: one node whose "devices" are rank threads (`--nproc-per-node`), with its
    /// peak, memory and bandwidths measured by the engine's own benches.
    ThisMachine,
}

/// `megatron plan`'s cluster flags (bandwidths in GB/s, memory in GB = 1e9 bytes).
#[derive(Args, Clone, Debug, Default)]
pub struct ClusterArgs {
    /// Start from a preset: dgx-a100, dgx-h100 or this-machine.
    #[arg(long, value_enum)]
    pub cluster: Option<Preset>,
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    #[arg(long)]
    pub num_nodes: Option<usize>,
    /// Device memory in GB.
    #[arg(long)]
    pub memory_per_gpu: Option<f64>,
    /// All-reduce bus bandwidth between devices of a node, GB/s.
    #[arg(long)]
    pub intra_node_bandwidth: Option<f64>,
    /// Bandwidth each device has to other nodes, GB/s.
    #[arg(long)]
    pub inter_node_bandwidth: Option<f64>,
    /// Device memory bandwidth, GB/s (memory-bound kernels: norms, activations, softmax).
    #[arg(long)]
    pub memory_bandwidth: Option<f64>,
    /// Share of peak the matrix multiplications reach.
    #[arg(long)]
    pub gemm_efficiency: Option<f64>,
    /// Share of the memory bandwidth the memory-bound kernels reach.
    #[arg(long)]
    pub memory_efficiency: Option<f64>,
    #[arg(long, value_enum)]
    pub attention_kernel: Option<AttentionKernel>,
}

/// A validated cluster (SI units: bytes, FLOP/s, bytes/s).
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub gpus_per_node: usize,
    pub num_nodes: usize,
    pub memory_per_gpu: f64,
    /// Memory a device cannot give to the model (runtime, communication and GEMM workspaces).
    pub reserved_memory: f64,
    pub peak_flops: f64,
    pub intra_node_bandwidth: f64,
    pub inter_node_bandwidth: f64,
    pub memory_bandwidth: f64,
    pub gemm_efficiency: f64,
    pub memory_efficiency: f64,
    pub attention: AttentionKernel,
    /// Bytes per activation element (2 on GPUs under fp16/bf16; this engine keeps f32).
    pub activation_bytes: f64,
    pub engine: Engine,
    /// Seconds a context-parallel ring exchange waits for its peer beyond the bytes' time
    /// (negligible on GPUs; on an oversubscribed CPU, where the ring's communication thread
    /// shares cores with the ranks, a scheduler slice: measured for this machine).
    pub ring_exchange_latency: f64,
    /// Seconds each tensor-parallel collective waits beyond its bytes' time: tens of
    /// microseconds under NCCL against milliseconds of GEMMs per layer on the GPU presets (0
    /// there); on a CPU whose rank threads share cores, their rendezvous (measured for this
    /// machine).
    pub tp_collective_latency: f64,
    /// Bytes the optimizer step moves per parameter it updates (Adam with fp32 state: about
    /// 36 on a GPU; measured for this machine, whose element-wise loops run below bandwidth).
    pub optimizer_bytes_per_parameter: f64,
}

impl Cluster {
    pub fn devices(&self) -> usize {
        self.gpus_per_node * self.num_nodes
    }

    /// A100 SXM4 80 GB: 312 TFLOP/s dense fp16/bf16, 2.04 TB/s HBM2e; NVSwitch all-reduce
    /// bus bandwidth ~240 GB/s (nccl-tests on DGX A100); HDR 200 Gb/s = 25 GB/s per GPU.
    /// The efficiencies (GEMMs at 70 % of peak, memory-bound kernels at 70 % of bandwidth) are
    /// what makes this model reproduce Table 1 of Narayanan et al. 2021 within 6 % on all ten
    /// rows (tests/plan.rs); both are typical of large fp16 GEMMs and fused elementwise
    /// kernels on A100.
    pub fn dgx_a100(num_nodes: usize) -> Self {
        Cluster {
            gpus_per_node: 8,
            num_nodes,
            memory_per_gpu: 80e9,
            reserved_memory: 3e9,
            peak_flops: 312e12,
            intra_node_bandwidth: 240e9,
            inter_node_bandwidth: 25e9,
            memory_bandwidth: 2039e9,
            gemm_efficiency: 0.7,
            memory_efficiency: 0.7,
            attention: AttentionKernel::Dense,
            activation_bytes: 2.0,
            engine: Engine::Megatron,
            ring_exchange_latency: 0.0,
            tp_collective_latency: 0.0,
            optimizer_bytes_per_parameter: 36.0,
        }
    }

    /// H100 SXM5 80 GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; NVLink 4 all-reduce bus
    /// bandwidth ~360 GB/s; NDR 400 Gb/s = 50 GB/s per GPU. Efficiencies as for A100 (not
    /// validated against a published table).
    pub fn dgx_h100(num_nodes: usize) -> Self {
        Cluster {
            memory_per_gpu: 80e9,
            peak_flops: 989e12,
            intra_node_bandwidth: 360e9,
            inter_node_bandwidth: 50e9,
            memory_bandwidth: 3350e9,
            attention: AttentionKernel::Flash,
            ..Cluster::dgx_a100(num_nodes)
        }
    }
}

impl ClusterArgs {
    /// The preset (measured for `this-machine`, with `ranks` rank threads of `threads` in
    /// all), then every given flag over it.
    pub fn cluster(
        &self,
        peak_tflops: Option<f64>,
        measured: impl FnOnce() -> Result<Cluster, TrainError>,
    ) -> Result<Cluster, TrainError> {
        let nodes = self.num_nodes.unwrap_or(1);
        let mut c = match self.cluster {
            Some(Preset::DgxA100) => Cluster::dgx_a100(nodes),
            Some(Preset::DgxH100) => Cluster::dgx_h100(nodes),
            Some(Preset::ThisMachine) => measured()?,
            None => {
                let missing: Vec<&str> = [
                    ("--gpus-per-node", self.gpus_per_node.is_none()),
                    ("--memory-per-gpu", self.memory_per_gpu.is_none()),
                    ("--peak-tflops", peak_tflops.is_none()),
                    (
                        "--intra-node-bandwidth",
                        self.intra_node_bandwidth.is_none(),
                    ),
                    (
                        "--inter-node-bandwidth",
                        self.inter_node_bandwidth.is_none(),
                    ),
                    ("--memory-bandwidth", self.memory_bandwidth.is_none()),
                ]
                .into_iter()
                .filter_map(|(f, m)| m.then_some(f))
                .collect();
                if !missing.is_empty() {
                    return Err(TrainError::Args(format!(
                        "megatron plan: give --cluster dgx-a100|dgx-h100|this-machine, or every one of {}",
                        missing.join(", ")
                    )));
                }
                Cluster::dgx_a100(nodes)
            }
        };
        let positive = |flag: &str, v: f64| -> Result<f64, TrainError> {
            if v > 0.0 && v.is_finite() {
                Ok(v)
            } else {
                Err(TrainError::Args(format!(
                    "{flag} must be positive, got {v}"
                )))
            }
        };
        if let Some(n) = self.gpus_per_node {
            c.gpus_per_node = positive("--gpus-per-node", n as f64)? as usize;
        }
        if let Some(n) = self.num_nodes {
            c.num_nodes = positive("--num-nodes", n as f64)? as usize;
        }
        if let Some(v) = self.memory_per_gpu {
            c.memory_per_gpu = positive("--memory-per-gpu", v)? * 1e9;
        }
        if let Some(v) = peak_tflops {
            c.peak_flops = positive("--peak-tflops", v)? * 1e12;
        }
        for (flag, v, slot) in [
            (
                "--intra-node-bandwidth",
                self.intra_node_bandwidth,
                &mut c.intra_node_bandwidth,
            ),
            (
                "--inter-node-bandwidth",
                self.inter_node_bandwidth,
                &mut c.inter_node_bandwidth,
            ),
            (
                "--memory-bandwidth",
                self.memory_bandwidth,
                &mut c.memory_bandwidth,
            ),
        ] {
            if let Some(v) = v {
                *slot = positive(flag, v)? * 1e9;
            }
        }
        for (flag, v, slot) in [
            (
                "--gemm-efficiency",
                self.gemm_efficiency,
                &mut c.gemm_efficiency,
            ),
            (
                "--memory-efficiency",
                self.memory_efficiency,
                &mut c.memory_efficiency,
            ),
        ] {
            if let Some(v) = v {
                if !(v > 0.0 && v <= 1.0) {
                    return Err(TrainError::Args(format!(
                        "{flag} must be in (0, 1], got {v}"
                    )));
                }
                *slot = v;
            }
        }
        if let Some(k) = self.attention_kernel {
            c.attention = k;
        }
        Ok(c)
    }
}
