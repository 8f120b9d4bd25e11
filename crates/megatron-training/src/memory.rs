//! Per-rank memory accounting (`--log-memory`): what this rank holds, by kind, each log
//! interval, and at start-up the prediction beside Korthikanti et al.'s activation formula
//! (2022, Table 2: `sbh(34 + 5as/h)` per layer and its TP / SP / recomputation variants).

use crate::arguments::TrainConfig;
use megatron_core::models::gpt::{activation_bytes_formula_with, ActivationSplit};
use megatron_core::optimizer::MegatronOptimizer;
use megatron_core::transformer::step::Recompute;
use megatron_core::Params;
use megatron_tensor::cpu::cross_entropy::classifier_gradient_chunk_rows;
use megatron_tensor::cpu::matmul::{
    attention_block_kernel_of, matmul_workspace, product_block_kernel, Bf16Kernel, GemmWorkspace,
    MatmulDims, MatmulPrecision,
};
use megatron_tensor::cpu::matmul_packed::prepacked_b_bytes;
use serde::Serialize;

/// Bytes this rank holds, by kind.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct MemoryBreakdown {
    /// Parameters: fp32 values (or fp32 mains) and the 16-bit copy the model reads.
    pub parameters: u64,
    pub gradients: u64,
    /// Adam moments and, with the distributed optimizer under 16-bit parameters, fp32 mains.
    pub optimizer_state: u64,
    /// Saved activations at the step's peak, and how many micro-batches were in flight then.
    pub activations: u64,
    pub micro_batches_in_flight: usize,
    /// Buffers the tensor pool keeps for reuse on this rank's thread.
    pub pooled: u64,
    /// The distributed optimizer's reduce-scatter / all-gather staging buffer.
    pub communication: u64,
    /// Context parallelism (p2p): the most key/value (and, in backward, gradient) bytes on the
    /// ring at once.
    pub kv_ring: u64,
    /// The process's resident high-water mark (every rank thread of the process together).
    pub process_peak: u64,
    /// This rank's allocator high-water marks since training started (everything its threads
    /// allocated: the kinds above, transient buffers, messages), as PyTorch's
    /// `max_memory_allocated` (in use) and `max_memory_reserved` (with the buffers the tensor
    /// pool keeps for reuse); absent when the binary does not count allocations per rank
    /// (`megatron_tensor::alloc`).
    pub allocated_peak: Option<u64>,
    pub reserved_peak: Option<u64>,
    /// This rank's predicted `allocated_peak` ([`predict_peak`]).
    pub predicted_peak: u64,
    /// Over every rank: the smallest and largest measured / predicted peak.
    pub peak_over_predicted: Option<(f64, f64)>,
}

impl MemoryBreakdown {
    pub fn line(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        format!(
            " | memory (MiB) params: {:.1} grads: {:.1} optimizer: {:.1} activations: {:.1} ({} in flight) communication: {:.1} kv ring: {:.1} pool: {:.1}{} predicted: {:.1}{} process peak: {:.0}",
            mib(self.parameters),
            mib(self.gradients),
            mib(self.optimizer_state),
            mib(self.activations),
            self.micro_batches_in_flight,
            mib(self.communication),
            mib(self.kv_ring),
            mib(self.pooled),
            match (self.allocated_peak, self.reserved_peak) {
                (Some(a), Some(r)) => format!(
                    " max allocated: {:.1} max reserved: {:.1}",
                    mib(a),
                    mib(r)
                ),
                _ => String::new(),
            },
            mib(self.predicted_peak),
            self.peak_over_predicted
                .map(|(lo, hi)| format!(" (measured/predicted over ranks {lo:.3}-{hi:.3})"))
                .unwrap_or_default(),
            mib(self.process_peak)
        )
    }
}

/// Korthikanti et al.'s activation bytes per layer (16-bit activations): `sbh(34 + 5as/h)`
/// without parallelism, `sbh(10 + 24/t + 5as/(ht))` with TP, `/t` of the whole with TP + SP;
/// selective recomputation drops the `5as/h` term, full recomputation keeps `2sbh`.
pub fn korthikanti_layer_bytes(cfg: &TrainConfig) -> f64 {
    let m = &cfg.model;
    let (s, b) = (
        (cfg.args.seq_length / cfg.cp) as f64,
        cfg.args.micro_batch_size as f64,
    );
    let (h, a, t) = (
        m.hidden_size as f64,
        m.num_attention_heads as f64,
        cfg.tp as f64,
    );
    let sbh = s * b * h;
    let sp = cfg.args.sequence_parallel && cfg.tp > 1;
    let attn = 5.0 * a * s / h;
    match cfg.recompute {
        Recompute::Full { .. } => 2.0 * sbh / if sp { t } else { 1.0 },
        Recompute::Selective(m) if m.core_attn => {
            if sp {
                34.0 * sbh / t
            } else {
                sbh * (10.0 + 24.0 / t)
            }
        }
        _ => {
            if sp {
                sbh * (34.0 + attn) / t
            } else {
                sbh * (10.0 + 24.0 / t + attn / t)
            }
        }
    }
}

/// The engine's formula for what one micro-batch keeps of `layers` layers on this rank (the
/// layers' saved tensors, without the final hidden state the last stage also keeps).
fn kept_activation_bytes(cfg: &TrainConfig, layers: usize, recompute: Recompute) -> usize {
    let a = &cfg.args;
    let sp = a.sequence_parallel && cfg.tp > 1;
    let s = a.seq_length / cfg.cp;
    let mut one = cfg.model.clone();
    one.num_layers = layers;
    // Multi-token prediction's depths sit on the last stage: counted only where the stage is
    // the whole model (the predictions here are the first stage's).
    one.mtp = one
        .mtp
        .filter(|_| cfg.pp == 1 && layers == cfg.model.num_layers);
    let half = cfg.precision.half().is_some();
    let rows = a.micro_batch_size * s / if sp { cfg.tp } else { 1 };
    let split = ActivationSplit {
        tp: cfg.tp,
        etp: cfg.etp,
        sequence_parallel: sp,
    };
    activation_bytes_formula_with(&one, a.micro_batch_size, s, split, half, recompute)
        - rows * cfg.model.hidden_size * residual_bytes(cfg)
}

/// Bytes per element of the residual stream (the last layer's output the final norm keeps).
fn residual_bytes(cfg: &TrainConfig) -> usize {
    cfg.model.residual.dtype().size_in_bytes()
}

/// The start-up lines: this rank's parameters, gradients and optimizer state (known once the
/// optimizer exists), and the activations of one micro-batch by the engine's formula beside
/// Korthikanti's, with the micro-batches a first pipeline stage keeps in flight.
pub fn predicted(cfg: &TrainConfig, state: &ModelStateBytes, peak: &PeakPrediction) -> String {
    let mib = |b: f64| b / (1 << 20) as f64;
    let ours = kept_activation_bytes(cfg, cfg.model.num_layers / cfg.pp, cfg.recompute) as f64;
    let layers = cfg.model.num_layers as f64 / cfg.pp as f64;
    let theirs = korthikanti_layer_bytes(cfg) * layers;
    let per_layer = kept_activation_bytes(cfg, 1, Recompute::None);
    let in_flight = peak.micro_batches_in_flight;
    format!(
        "memory per rank (predicted): params {:.1} MiB, grads {:.1} MiB, optimizer {:.1} MiB; activations per micro-batch {:.1} MiB ({:.2} MiB per layer without recomputation; engine; Korthikanti et al. with 16-bit activations: {:.1} MiB), up to {in_flight} in flight on the first pipeline stage (per model chunk); peak allocated {:.1} MiB on the first stage (model state {:.1}, communication {:.1}, GEMM workspace {:.1}, activations in flight {:.1}, transient {:.1} of which key/value ring {:.1})",
        mib(state.parameters as f64),
        mib(state.gradients as f64),
        mib(state.optimizer as f64),
        mib(ours),
        mib(per_layer as f64),
        mib(theirs),
        mib(peak.total() as f64),
        mib(peak.model_state as f64),
        mib(peak.communication as f64),
        mib(peak.gemm_workspace as f64),
        mib(peak.activations as f64),
        mib(peak.transient as f64),
        mib(peak.kv_ring as f64),
    )
}

/// A rank's predicted allocator high-water mark (`max allocated`), by kind.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct PeakPrediction {
    /// Parameters, gradients and optimizer state: sizes known once they exist.
    pub model_state: u64,
    /// The distributed optimizer's staging buffer for reduce-scatter / all-gather (one call of
    /// at most 2^22 elements over the ranks' slots, plus this rank's slot).
    pub communication: u64,
    /// Packing panels each GEMM thread keeps.
    pub gemm_workspace: u64,
    /// Saved activations of the micro-batches (per model chunk) this stage holds at once under
    /// its schedule (the engine's formula).
    pub activations: u64,
    /// The largest set of buffers alive only inside one layer's forward or backward or the
    /// output layer (with, under context parallelism, the key/value blocks on the ring).
    pub transient: u64,
    /// Of `transient`: the key/value ring's travelling blocks (context parallelism with p2p).
    pub kv_ring: u64,
    /// Micro-batches (per model chunk) the stage's schedule holds at once.
    pub micro_batches_in_flight: usize,
}

impl PeakPrediction {
    pub fn total(&self) -> u64 {
        self.model_state
            + self.communication
            + self.gemm_workspace
            + self.activations
            + self.transient
    }
}

/// Bytes of this rank's parameters (fp32 and 16-bit copies), gradients and optimizer state.
pub struct ModelStateBytes {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
}

impl ModelStateBytes {
    pub fn of(params: &Params, optimizer: &dyn MegatronOptimizer) -> Self {
        ModelStateBytes {
            parameters: (params.data.len() * 4 + params.half.size_in_bytes()) as u64,
            gradients: (params.numel() * 4) as u64,
            optimizer: optimizer.state_bytes() as u64,
        }
    }

    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// This rank's model state and its predicted peak ([`predict_rank_peak`]), as start-up and
/// every log interval report them.
pub fn rank_memory(
    cfg: &TrainConfig,
    params: &Params,
    optimizer: &dyn MegatronOptimizer,
    pp_rank: usize,
) -> Result<(ModelStateBytes, PeakPrediction), String> {
    let state = ModelStateBytes::of(params, optimizer);
    let communication = (optimizer.grad_buffer().scratch_elements() * 4) as u64;
    let peak = predict_rank_peak(cfg, state.total(), communication, pp_rank)?;
    Ok((state, peak))
}

/// [`predict_peak`] for pipeline stage `pp_rank` of this layout: the micro-batches in flight
/// from its schedule, the GEMM threads of the calling rank thread.
pub fn predict_rank_peak(
    cfg: &TrainConfig,
    model_state: u64,
    communication: u64,
    pp_rank: usize,
) -> Result<PeakPrediction, String> {
    let threads = megatron_tensor::threads::gemm_threads();
    let kernel = megatron_tensor::cpu::matmul::bf16_kernel();
    predict_rank_peak_with(cfg, model_state, communication, pp_rank, (threads, kernel))
}

/// The GEMM threads each rank of `cfg`'s layout gets when its ranks run as threads of one
/// process: `--num-threads` (or the cores) split over the world, as the launcher splits them.
pub fn rank_gemm_threads(cfg: &TrainConfig) -> usize {
    let threads = cfg
        .args
        .num_threads
        .unwrap_or_else(megatron_tensor::threads::available_cores);
    match cfg.world() {
        1 => threads,
        n => (threads / n).max(1),
    }
}

/// [`predict_rank_peak`] for ranks with `gemm_threads` GEMM threads each (the packing panels
/// are per thread) whose bf16 matmuls run on `bf16_kernel` (`--bf16-matmul-kernel` as the
/// ranks would set it): what a planner predicts for a layout before its ranks exist.
pub fn predict_rank_peak_with(
    cfg: &TrainConfig,
    model_state: u64,
    communication: u64,
    pp_rank: usize,
    (gemm_threads, bf16_kernel): (usize, Bf16Kernel),
) -> Result<PeakPrediction, String> {
    let ops = megatron_core::pipeline_parallel::schedule(
        cfg.pp,
        pp_rank,
        cfg.num_microbatches(),
        cfg.partition.v,
    )?;
    Ok(predict_peak(
        cfg,
        model_state,
        communication,
        (gemm_threads, bf16_kernel),
        pp_rank,
        megatron_core::pipeline_parallel::peak_in_flight(&ops),
    ))
}

/// What this rank's allocations should peak at, from the layout alone: the model state,
/// the saved activations of the micro-batches in flight on its stage and the largest transient
/// working set. Transients follow the dense layer's kernels (fp32 working buffers): one layer's
/// forward holds its normalized input (gathered under SP) and the MLP's activation beside its
/// saved tensors; its backward the incoming and outgoing gradients and two MLP-wide buffers
/// (activation and its gradient); the output layer one logits tile and two hidden-sized
/// buffers (and under 16-bit matmuls its weight's and input's rounded copies); full
/// recomputation re-creates one group's saved tensors during backward. Attention's backward and
/// a mixture-of-experts layer's routed rows (balanced routing) are phases of their own.
pub fn predict_peak(
    cfg: &TrainConfig,
    model_state: u64,
    communication: u64,
    (gemm_threads, bf16_kernel): (usize, Bf16Kernel),
    pp_rank: usize,
    in_flight: usize,
) -> PeakPrediction {
    let a = &cfg.args;
    let m = &cfg.model;
    let (tp, pp) = (cfg.tp, cfg.pp);
    let sp = a.sequence_parallel && tp > 1;
    let tok = a.micro_batch_size * a.seq_length / cfg.cp;
    let rows = if sp { tok / tp } else { tok };
    let h = m.hidden_size;
    let ffn = m.ffn_hidden_size / tp;
    let fc1 = if m.activation.is_gated() {
        2 * ffn
    } else {
        ffn
    };
    let last = pp_rank + 1 == pp;
    // The most layers one of this stage's chunks holds (an uneven or accounted split gives
    // the end stages fewer).
    let layers = (0..cfg.partition.v)
        .map(|c| cfg.partition.layers(pp_rank, c).len())
        .max()
        .unwrap_or(0);
    let per_mb = kept_activation_bytes(cfg, layers, cfg.recompute)
        + if last {
            rows * h * residual_bytes(cfg)
        } else {
            0
        };
    let layer = kept_activation_bytes(cfg, 1, Recompute::None);
    let gathered = if sp { tok * h } else { 0 };
    // Keys and values of this rank's heads for its two chunks, and the query / output widths.
    let kv = tok * 2 * m.query_groups() * m.head_dim() / tp;
    let (qw, ow) = (m.qkv_size() / tp, m.query_projection_size() / tp);
    let ring = cfg.cp > 1 && cfg.cp_comm_type == megatron_core::context_parallel::CpCommType::P2p;
    // Forward holds the block in use and the one arriving; backward also the gradient
    // accumulator leaving and the one arriving (both at once from four ranks up).
    let kv_ring = match (ring, cfg.cp) {
        (false, _) => 0,
        (true, 2) => 2 * kv * 4,
        (true, _) => 4 * kv * 4,
    };
    let ring_forward = if ring { 2 * kv * 4 } else { 0 };
    let precision = MatmulPrecision::of(cfg.precision.half());
    // What the layer phase holds besides the GEMMs' own buffers, once while a GEMM runs and once
    // between GEMMs (the MLP activation's backward).
    let (forward, backward_in_gemm, backward) = if precision == MatmulPrecision::BF16 {
        // Under `--bf16` the norms' outputs (and their all-gather under SP) and the MLP
        // activation are written in bf16 for the matmuls, and the kept residuals and fc1 output
        // are read as kept (`saved::linear_input_dtype`). Forward: fc1's f32 output beside the
        // activation. Backward, beside the output gradient and the recomputed norm output:
        // during fc2's products the activation and its gradient; then that gradient and fc1's
        // output gradient (the activation freed); during fc1's products that gradient, the
        // gathered norm output and the input gradient before its reduction.
        let base = 4 * rows * h + 2 * rows * h;
        let fc2_products = base + (2 + 4) * tok * ffn;
        let fc1_products = base + 4 * tok * fc1 + 2 * gathered + 4 * tok * h;
        (
            2 * (rows * h + gathered + tok * ffn) + 4 * tok * fc1 + ring_forward,
            fc2_products.max(fc1_products),
            base + 4 * tok * (ffn + fc1),
        )
    } else {
        // Under `--fp16` the MLP's backward widens its saved fc1 output to an f32 copy
        // (`saved::readable`; the residual it reads is kept in f32); in f32 it reads it as kept.
        let restored = match cfg.precision.half() {
            Some(_) => tok * fc1,
            None => 0,
        };
        let backward = 4 * (2 * rows * h + gathered + tok * (ffn + fc1) + restored);
        (
            4 * (rows * h + gathered + tok * ffn) + ring_forward,
            backward,
            backward,
        )
    };
    // Attention's backward, between its products: the layer's incoming and residual gradients
    // and the recomputed norm output, the attention output (copied back from its kept form)
    // and its gradient, the fused QKV gradient, and the QKV widened from its 16-bit kept form
    // where the attention kernel reads f32. Multi-latent attention's kernel output is its padded width (`ow` for the
    // fused-QKV attention).
    let e_in = if precision == MatmulPrecision::BF16 {
        2
    } else {
        4
    };
    // The fused QKV gradient, and the kept QKV widened to f32 where the attention kernel
    // reads f32 (a packed bf16 kernel packs the kept bf16 QKV as it is).
    let widened_qkv = cfg.precision.half().is_some()
        && attention_block_kernel_of(precision, bf16_kernel).is_none();
    let qkv_copies = if widened_qkv { 2 } else { 1 };
    let kernel_ow = match m.mla {
        Some(_) => m.num_attention_heads * m.head_dim() / tp,
        None => ow,
    };
    let attention_backward =
        8 * rows * h + e_in * rows * h + 4 * tok * (qkv_copies * qw + 2 * kernel_ow);
    let backward = backward.max(attention_backward);
    // A mixture-of-experts layer works on its routed rows (expected `k` per token, each
    // expert-tensor-parallel rank gathering its group's): forward holds the dispatched input,
    // the experts' f32 fc1 output, activation and output at once;
    // backward the output gradient, the activation and its gradient and fc1's output gradient
    // (and, under `--fp16`, the widened rows combine kept).
    let moe_layers = (0..layers).any(|l| m.is_moe_layer(l));
    let (moe_in_gemm, backward) = match m.moe.as_ref().filter(|_| moe_layers) {
        Some(x) => {
            let routed = rows * x.topk * cfg.etp;
            let f = x.ffn_hidden_size / cfg.etp;
            let f1 = if m.activation.is_gated() { 2 * f } else { f };
            // The kept expert outputs widened for the combine's backward: under `--fp16` only
            // (bf16 rows are read as stored).
            let widened = if precision == MatmulPrecision::F16 {
                routed * h
            } else {
                0
            };
            // Under `--bf16` the rows are dispatched (and their input kept) in bf16.
            let dispatched = if precision == MatmulPrecision::BF16 {
                2 * (rows * h + routed * h)
            } else {
                4 * routed * h
            };
            let moe_forward = 4 * (rows * h + routed * (h + f1 + f)) + dispatched;
            let moe_backward = 4 * (2 * rows * h + routed * (h + f + f1) + widened);
            (
                Some((moe_forward, moe_backward)),
                backward.max(moe_backward),
            )
        }
        None => (None, backward),
    };
    // Ring attention's backward works on its own copies: queries and their gradient, the
    // incoming output gradient and the output, the fused query/key/value gradient it returns
    // and the half-size block pair; keys and values five times (in use, arriving, the
    // accumulator leaving and arriving, this step's share) and one chunk of them.
    let ring_backward = if ring {
        4 * (2 * rows * h + tok * (4 * qw + 2 * ow) + kv * 11 / 2)
    } else {
        0
    };
    // The last layers' backward comes first: under uniform recomputation it re-creates the
    // last group's saved tensors on top of everything kept; under block recomputation the last
    // layers keep theirs unless every layer is recomputed.
    let recomputed = match cfg.recompute {
        Recompute::Full {
            method: megatron_core::transformer::step::RecomputeMethod::Uniform,
            num_layers,
        } => num_layers.clamp(1, layers) * layer,
        Recompute::Full { num_layers, .. } if num_layers >= layers => layer,
        _ => 0,
    };
    let classifier_rows = |v: usize| tok.min(megatron_core::models::gpt::classifier_tile_rows(v));
    let v = m.padded_vocab_size / tp;
    // The output layer's weight packed once per call for a packed bf16 kernel (as the `b` of
    // the logits and of the input gradient), its backward GEMMs run per gradient chunk of bf16
    // `dlogits` (`cross_entropy::fused_classifier`).
    let packed_classifier = last
        && product_block_kernel(precision, bf16_kernel, MatmulDims::new(tok, v, h).tb()).is_some();
    let tile_rows = classifier_rows(v);
    let chunk = if packed_classifier {
        classifier_gradient_chunk_rows(tok, v, tile_rows)
    } else {
        0
    };
    // Under 16-bit matmuls the output layer multiplies by a copy of its weight made once per
    // call — rounded (or widened from bf16) to f32, or, for a packed kernel, the two packings,
    // which stay allocated for the next call and so are counted with the kept workspace — and
    // by its input rounded once.
    let classifier_copy = match cfg.precision.half() {
        Some(_) if packed_classifier => 4 * tok * h,
        Some(_) => 4 * (v * h + tok * h),
        None => 0,
    };
    // What a packed output layer keeps between calls: its weight's two packings and the bf16
    // gradient chunk.
    let classifier_kept = if packed_classifier {
        prepacked_b_bytes(MatmulDims::new(tok, v, h).tb())
            + prepacked_b_bytes(MatmulDims::new(tok, h, v))
            + 2 * chunk * v
    } else {
        0
    };
    let output = if last {
        4 * (tile_rows * v + 2 * tok * h) + classifier_copy
    } else {
        0
    };
    // The products the layers run: attention's, and the MLP's where a layer is dense; an MoE
    // layer's shared expert on every token and each local expert on its share of the routed
    // rows (one expert's block at a time, balanced routing).
    let mut widths = vec![(tok, h, qw), (tok, ow, h)];
    let moe = m.moe.as_ref().filter(|_| moe_layers);
    if moe.is_none() || (0..layers).any(|l| !m.is_moe_layer(l)) {
        widths.extend([(tok, h, fc1), (tok, ffn, h)]);
    }
    if let Some(x) = moe {
        let gated = |f: usize| if m.activation.is_gated() { 2 * f } else { f };
        if let Some(s) = x.shared_expert_ffn {
            let s = s / tp;
            widths.extend([(tok, h, gated(s)), (tok, s, h)]);
        }
    }
    let expert_widths: Vec<(usize, usize, usize)> = moe
        .map(|x| {
            let f = x.ffn_hidden_size / cfg.etp;
            let gated = if m.activation.is_gated() { 2 * f } else { f };
            let local_experts = (x.num_experts / cfg.ep).max(1);
            let per_expert = (rows * x.topk * cfg.etp).div_ceil(local_experts);
            vec![(per_expert, h, gated), (per_expert, f, h)]
        })
        .unwrap_or_default();
    let layer_linears = linear_gemm_shapes(&widths);
    let expert_linears = linear_gemm_shapes(&expert_widths);
    let linears = [&layer_linears[..], &expert_linears[..]].concat();
    let classifier = if !last {
        Vec::new()
    } else if packed_classifier {
        // Logits per tile; both backward products per chunk (the weight gradient's `a` is the
        // chunk's `dlogitsᵀ`, packed whole).
        let mut shapes = vec![
            MatmulDims::new(tile_rows, v, h).tb(),
            MatmulDims::new(chunk, h, v),
            MatmulDims::new(v, h, chunk).ta(),
        ];
        if !tok.is_multiple_of(tile_rows) {
            shapes.push(MatmulDims::new(tok % tile_rows, v, h).tb());
        }
        shapes
    } else {
        let mut shapes = classifier_gemm_shapes(tile_rows, h, v);
        // The last, partial logits tile is its own shape to the `gemm` crate, whose blocking
        // (and so packing) follows the row count.
        if !tok.is_multiple_of(tile_rows) {
            shapes.extend(classifier_gemm_shapes(tok % tile_rows, h, v));
        }
        shapes
    };
    let calls = matmul_workspace(
        &[&linears[..], &classifier[..]].concat(),
        precision,
        bf16_kernel,
    );
    let (in_layers, in_output) = calls.split_at(linears.len());
    let packing = |c: &[GemmWorkspace]| c.iter().map(|c| c.in_flight).max().unwrap_or(0);
    // A 16-bit layer product on the f32 GEMM multiplies copies of its operands rounded (or
    // widened from bf16) to f32, alive while it runs: at most both operands (an operand already
    // exact is not copied). The output layer's operands are rounded once per call (above).
    let half_on_f32 = |d: MatmulDims| {
        cfg.precision.half().is_some() && product_block_kernel(precision, bf16_kernel, d).is_none()
    };
    let products: Vec<(MatmulDims, usize)> = in_layers
        .iter()
        .zip(&linears)
        .map(|(c, &d)| {
            let copies = if half_on_f32(d) {
                4 * (d.m * d.k + d.k * d.n)
            } else {
                0
            };
            (d, c.in_flight + copies)
        })
        .collect();
    let (layer_products, expert_products) = products.split_at(layer_linears.len());
    // The most a product holds: any, or only forward's `x Wᵀ` (the others belong to backward).
    let most = |p: &[(MatmulDims, usize)], forward_only: bool| {
        p.iter()
            .filter(|(d, _)| !forward_only || (d.trans_b && !d.trans_a))
            .map(|&(_, b)| b)
            .max()
            .unwrap_or(0)
    };
    let layer_packing = most(products.as_slice(), false);
    // The layer phase with its GEMM buffers: a GEMM's packing (or rounded copies) is alive
    // beside what forward holds and what backward holds during a product, not beside the
    // MLP activation's backward between products. An MoE layer's routed working set is alive
    // during its experts' products (the shared expert's run after it is freed).
    let mut in_gemm = (forward + most(layer_products, true))
        .max(recomputed + backward_in_gemm.max(ring_backward) + most(layer_products, false));
    if let Some((moe_forward, moe_backward)) = moe_in_gemm {
        in_gemm = in_gemm
            .max(moe_forward + most(expert_products, true))
            .max(recomputed + moe_backward + most(expert_products, false));
    }
    // The slabs every thread keeps are there throughout; the packed operands of the products
    // in flight belong to the phase they run in: the layers' or the output layer's.
    let kept: usize = calls.iter().map(|c| c.kept).sum();
    let kept_by_caller: usize =
        calls.iter().map(|c| c.kept_by_caller).sum::<usize>() + classifier_kept;
    let layers = in_gemm.max(recomputed + backward);
    let (transient, packed) = if output + packing(in_output) > layers {
        (output, packing(in_output))
    } else {
        (layers - layer_packing, layer_packing)
    };
    PeakPrediction {
        model_state,
        communication,
        gemm_workspace: (gemm_threads * kept + kept_by_caller + packed) as u64,
        activations: (per_mb * in_flight) as u64,
        transient: transient as u64,
        kv_ring: kv_ring as u64,
        micro_batches_in_flight: in_flight,
    }
}

/// The f32 products of linear layers of (rows, input, output) widths `linears` on this rank
/// (forward `x Wᵀ`, input gradient `dy W`, weight gradient `dyᵀ x`): what the `gemm` crate
/// sizes its workspace by.
fn linear_gemm_shapes(linears: &[(usize, usize, usize)]) -> Vec<MatmulDims> {
    linears
        .iter()
        .filter(|&&(tok, i, o)| tok > 0 && i > 0 && o > 0)
        .flat_map(|&(tok, i, o)| {
            [
                MatmulDims::new(tok, o, i).tb(),
                MatmulDims::new(tok, i, o),
                MatmulDims::new(o, i, tok).ta(),
            ]
        })
        .collect()
}

/// The fused output layer's three products on one logits tile of `rows` tokens, hidden `h`
/// and `v` vocabulary rows on this rank (`cross_entropy::fused_classifier`): logits `x Wᵀ`,
/// input gradient `dlogits W`, weight gradient `dlogitsᵀ x`.
fn classifier_gemm_shapes(rows: usize, h: usize, v: usize) -> Vec<MatmulDims> {
    if rows == 0 || h == 0 || v == 0 {
        return Vec::new();
    }
    vec![
        MatmulDims::new(rows, v, h).tb(),
        MatmulDims::new(rows, h, v),
        MatmulDims::new(v, h, rows).ta(),
    ]
}
