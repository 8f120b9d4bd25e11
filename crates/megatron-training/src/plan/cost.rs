//! What a layout costs on a cluster: memory per device and time per iteration, from the
//! model's shapes alone (nothing is allocated, so a trillion-parameter model plans in
//! milliseconds).
//!
//! Time: every GEMM at the cluster's GEMM efficiency of peak, every memory-bound kernel
//! (norms, activation functions, bias-dropout-add, the dense softmax and its dropout) at its
//! memory efficiency, tensor-parallel collectives and pipeline sends on the critical path (as
//! in Megatron without communication overlap), the pipeline bubble `(p - 1) / v` stage-times,
//! the data-parallel gradient reduction after the last backward (hidden behind it with
//! `--overlap-grad-reduce`), and the optimizer step. Memory: Megatron's bytes per parameter
//! under mixed precision (18, or 6 + 12/d with the distributed optimizer) and Korthikanti et
//! al.'s activation terms (2022, Table 2) generalised to grouped-query attention, SwiGLU and
//! experts, times the micro-batches the schedule keeps in flight.

use super::cluster::{AttentionKernel, Cluster, Engine};
use super::muon_cost::{muon_moment_bytes, muon_share};
use crate::arguments::{OptimizerKind, Precision, TrainConfig};
use megatron_core::transformer::config::PositionEmbeddingType;
use megatron_core::transformer::step::Recompute;
use serde::Serialize;

/// One layout's predicted cost.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    /// Bytes on the device that holds the most (the first or the last pipeline stage).
    pub memory: MemoryCost,
    pub time: TimeCost,
    /// FLOPs executed per device per second (recomputation included, as Narayanan et al.
    /// count them), and model FLOPs (Megatron's `num_floating_point_operations`) per device
    /// per second.
    pub tflops_per_device: f64,
    pub model_tflops_per_device: f64,
    pub tokens_per_second: f64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct MemoryCost {
    pub weights_and_optimizer: f64,
    pub activations: f64,
    /// Micro-batches (model chunks x micro-batches) the first stage keeps at once.
    pub in_flight: usize,
    pub logits: f64,
    pub reserved: f64,
}

impl MemoryCost {
    pub fn total(&self) -> f64 {
        self.weights_and_optimizer + self.activations + self.logits + self.reserved
    }
}

/// Seconds per iteration, by where they go.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TimeCost {
    pub compute: f64,
    pub tensor_parallel: f64,
    pub context_parallel: f64,
    pub expert_parallel: f64,
    pub pipeline_bubble: f64,
    pub pipeline_p2p: f64,
    pub data_parallel: f64,
    pub optimizer: f64,
}

impl TimeCost {
    pub fn total(&self) -> f64 {
        self.compute
            + self.tensor_parallel
            + self.context_parallel
            + self.expert_parallel
            + self.pipeline_bubble
            + self.pipeline_p2p
            + self.data_parallel
            + self.optimizer
    }
}

/// A layer's widths, what every cost below multiplies. The attention kernel's operands over
/// all heads: queries and keys of `qk` features (keys `k` wide as kept: per query group),
/// values `v`, the context `ctx`; the projections' multiply-adds per token, those split over
/// tensor parallelism and those every rank runs whole on its rows (multi-latent attention's
/// down projections), and the latents MLA keeps; the MLP's matrices per FFN column (2, or 3
/// gated).
struct Widths {
    qk: f64,
    k: f64,
    v: f64,
    ctx: f64,
    sharded: f64,
    duplicated: f64,
    latent: f64,
    gated: f64,
}

fn widths(m: &megatron_core::TransformerConfig) -> Widths {
    let h = m.hidden_size as f64;
    let gated = if m.activation.is_gated() { 3.0 } else { 2.0 };
    match m.mla {
        None => {
            let q = m.query_projection_size() as f64;
            let kv = (m.query_groups() * m.head_dim()) as f64;
            Widths {
                qk: q,
                k: kv,
                v: kv,
                ctx: q,
                sharded: h * (q + 2.0 * kv) + q * h,
                duplicated: 0.0,
                latent: 0.0,
                gated,
            }
        }
        Some(x) => {
            let a = m.num_attention_heads as f64;
            let (qk, pe, v) = (
                x.qk_head_dim as f64,
                x.qk_pos_emb_head_dim as f64,
                x.v_head_dim as f64,
            );
            let kv_lora = x.kv_lora_rank as f64;
            let q_lora = x.q_lora_rank.map_or(0.0, |r| r as f64);
            let query = match x.q_lora_rank {
                Some(r) => r as f64 * a * (qk + pe),
                None => h * a * (qk + pe),
            };
            Widths {
                qk: a * (qk + pe),
                k: a * (qk + pe),
                v: a * v,
                ctx: a * v,
                sharded: query + kv_lora * a * (qk + v) + a * v * h,
                duplicated: h * q_lora + h * (kv_lora + pe),
                latent: q_lora + kv_lora + pe,
                gated,
            }
        }
    }
}

/// Forward passes a layer's GEMMs run per micro-batch (forward, backward counted as two, and
/// the recomputed forward), and those of the core attention (which selective recomputation
/// alone repeats).
fn passes(recompute: Recompute) -> (f64, f64) {
    match recompute {
        Recompute::Full { .. } => (4.0, 4.0),
        Recompute::Selective(sel) if sel.core_attn => (3.0, 4.0),
        _ => (3.0, 3.0),
    }
}

/// Keys a query multiplies against on average: the whole sequence under the dense kernel
/// (masked scores computed anyway), half of it under a causal blockwise kernel.
fn attention_keys(kernel: AttentionKernel, s: f64) -> f64 {
    match kernel {
        AttentionKernel::Dense => s,
        AttentionKernel::Flash => s / 2.0,
    }
}

/// Ring all-reduce time of `bytes` over `n` ranks at bus bandwidth `bw`.
fn all_reduce(bytes: f64, n: usize, bw: f64) -> f64 {
    if n <= 1 {
        0.0
    } else {
        2.0 * (n - 1) as f64 / n as f64 * bytes / bw
    }
}

/// The layers pipeline stage `stage` holds over its chunks, as the run splits them (evenly,
/// or by --decoder-first/last-pipeline-num-layers, the account-for flags or a layout).
fn stage_layers(cfg: &TrainConfig, stage: usize) -> Vec<usize> {
    (0..cfg.partition.v)
        .flat_map(|c| cfg.partition.layers(stage, c))
        .collect()
}

/// Parameters per rank on the first and on the last pipeline stage (the same with one stage).
pub fn parameters_per_rank(cfg: &TrainConfig) -> (f64, f64) {
    let m = &cfg.model;
    let (h, t) = (m.hidden_size as f64, cfg.tp as f64);
    let w = widths(m);
    let gated = w.gated;
    let bias = if m.add_bias_linear { 1.0 } else { 0.0 };
    // A norm's parameters: its weight, and a LayerNorm's bias.
    let norm = match m.normalization {
        megatron_core::transformer::config::Normalization::LayerNorm => 2.0 * h,
        megatron_core::transformer::config::Normalization::RMSNorm => h,
    };
    // gpt-oss's learned sinks: one logit per head, split with the heads.
    let sinks = match m.softmax_type {
        megatron_core::transformer::config::SoftmaxType::Learnable => {
            m.num_attention_heads as f64 / t
        }
        _ => 0.0,
    };
    let attention = sinks
        + match m.mla {
            None => w.sharded / t + bias * ((w.qk + w.k + w.v) / t + h) + 2.0 * norm,
            // MLA's projections have no biases but the output's; its latents' norms (under
            // --qk-layernorm) sit on every rank with the down projections.
            Some(x) => {
                let norms = if m.qk_layernorm {
                    let per = match m.normalization {
                        megatron_core::transformer::config::Normalization::LayerNorm => 2.0,
                        megatron_core::transformer::config::Normalization::RMSNorm => 1.0,
                    };
                    per * (x.q_lora_rank.unwrap_or(0) + x.kv_lora_rank) as f64
                } else {
                    0.0
                };
                w.sharded / t + w.duplicated + bias * h + 2.0 * norm + norms
            }
        };
    let ffn = m.ffn_hidden_size as f64;
    let dense_mlp = h * ffn * gated / t + bias * (ffn * (gated - 1.0) / t + h);
    let moe_mlp = m.moe.as_ref().map_or(0.0, |e| {
        let local = e.num_experts as f64 / cfg.ep as f64;
        let experts = local * h * e.ffn_hidden_size as f64 * gated / cfg.etp as f64;
        let shared = e
            .shared_expert_ffn
            .map_or(0.0, |f| h * f as f64 * gated / t);
        // The router's and the experts' biases: fc1's rows (gate and up where gated) and
        // fc2's outputs, both split over the expert-tensor-parallel ranks.
        let biases = if e.biases {
            e.num_experts as f64
                + local * (e.ffn_hidden_size as f64 * (gated - 1.0) + h) / cfg.etp as f64
        } else {
            0.0
        };
        experts + shared + h * e.num_experts as f64 + biases
    });
    let stage = |s: usize| -> f64 {
        stage_layers(cfg, s)
            .into_iter()
            .map(|l| {
                attention
                    + if m.is_moe_layer(l) {
                        moe_mlp
                    } else {
                        dense_mlp
                    }
            })
            .sum()
    };
    let v = m.padded_vocab_size as f64;
    let positions = match m.position_embedding_type {
        PositionEmbeddingType::LearnedAbsolute => m.max_position_embeddings as f64 * h,
        _ => 0.0,
    };
    let embedding = v * h / t + positions;
    // The output layer: its own weight, or (tied, pipeline > 1) a copy of the embedding's.
    let output = if m.untie_embeddings_and_output_weights || cfg.pp > 1 {
        v * h / t
    } else {
        0.0
    };
    // Multi-token prediction's depths on the last stage: each a layer like the last decoder
    // layer (numbered after it), `eh_proj` (column-parallel, 2h -> h) and three norms, and
    // under pipeline parallelism a copy of the word embedding where the output layer is not one.
    let depths = m.mtp.as_ref().map_or(0, |x| x.num_layers);
    let mtp: f64 = (0..depths)
        .map(|k| {
            let layer = attention
                + if m.is_moe_layer(m.num_layers + k) {
                    moe_mlp
                } else {
                    dense_mlp
                };
            layer + 2.0 * h * h / t + 3.0 * norm
        })
        .sum::<f64>()
        + if depths > 0 && cfg.pp > 1 && m.untie_embeddings_and_output_weights {
            v * h / t
        } else {
            0.0
        };
    let last = stage(cfg.pp - 1) + output + norm + mtp;
    if cfg.pp == 1 {
        let whole = stage(0) + embedding + output + norm + mtp;
        (whole, whole)
    } else {
        (stage(0) + embedding, last)
    }
}

/// What sequence parallelism divides the h-wide activations by (1 without it).
fn sequence_parallel_divisor(cfg: &TrainConfig) -> f64 {
    if cfg.args.sequence_parallel && cfg.tp > 1 {
        cfg.tp as f64
    } else {
        1.0
    }
}

/// Bytes of the update rule's moments per parameter, as stored (`--exp-avg-dtype` and
/// `--exp-avg-sq-dtype`: 2 bytes each in bf16).
fn moment_bytes(cfg: &TrainConfig) -> f64 {
    cfg.update_rule
        .moments()
        .iter()
        .map(|&m| cfg.moment_dtypes.of(m).bytes() as f64)
        .sum()
}

/// Bytes of weights, gradients and optimizer state of `params` parameters of which `muon` are
/// Muon's matrices (Megatron's accounting: with Adam's two moments 18 per parameter, or
/// 6 + 12/d distributed, under 16-bit weights; 16 or 8 + 8/d in fp32; SGD keeps one moment, or
/// none without momentum; a Muon matrix one momentum of 4 bytes instead of the scalar rule's,
/// two under `adaptive_muon`).
fn state_bytes(cfg: &TrainConfig, params: f64, muon: f64) -> f64 {
    let d = (cfg.dp * cfg.cp) as f64;
    let half = cfg.precision != Precision::F32;
    let moments = moment_bytes(cfg) * (params - muon) + muon_moment_bytes(cfg) * muon;
    // The fp32 main weight joins the sharded state under 16-bit weights.
    let (weight_and_grad, sharded) = if half {
        (6.0 * params, 4.0 * params + moments)
    } else {
        (8.0 * params, moments)
    };
    match cfg.optimizer {
        OptimizerKind::Replicated => weight_and_grad + sharded,
        OptimizerKind::Distributed => weight_and_grad + sharded / d,
    }
}

/// Activation bytes one layer keeps for backward per token of a micro-batch on this rank,
/// without recomputation (Korthikanti et al.'s `34h + 5as` with 16-bit activations, for
/// general query/key-value widths, gated MLPs and experts; divided over tensor parallelism
/// as they divide, and wholly with sequence parallelism).
fn layer_activation_bytes_per_token(cfg: &TrainConfig, cluster: &Cluster, moe: bool) -> f64 {
    let m = &cfg.model;
    let e = cluster.activation_bytes;
    let (h, t) = (m.hidden_size as f64, cfg.tp as f64);
    let w = widths(m);
    let gated = w.gated;
    let sp = sequence_parallel_divisor(cfg);
    // fc1's output is 1 (or 2 gated) FFN widths.
    let fc1_factor = gated - 1.0;
    let s = (cfg.args.seq_length / cfg.cp) as f64;
    let a = m.num_attention_heads as f64;
    let scores = match (cluster.attention, cfg.recompute) {
        (AttentionKernel::Flash, _) => 0.0,
        (_, Recompute::Selective(sel)) if sel.core_attn => 0.0,
        // Softmax output, dropout mask and dropout output per score (16-bit + 1 byte).
        _ => (2.0 * e + 1.0) * a * s / t,
    };
    // Per token: two norm inputs, the QKV input, the output projection's dropout mask (1 byte)
    // are h-wide and replicated (split by sequence parallelism).
    let replicated = (4.0 * h * e / 2.0 + e * h + h + e * h + h) / sp;
    // Queries and keys (the scores' inputs), values, the context; MLA's latents before and
    // after their norms, on this rank's rows.
    let attention = (e * (w.qk + w.k) + e * w.v + e * w.ctx) / t + scores + 2.0 * e * w.latent / sp;
    let mlp = if moe {
        let x = m.moe.as_ref().expect("an expert layer has a MoE config");
        let f = x.ffn_hidden_size as f64;
        x.topk as f64 * (e * h + e * f * fc1_factor + e * f) / cfg.etp as f64
    } else {
        let f = m.ffn_hidden_size as f64;
        (e * f * fc1_factor + e * f) / t
    };
    replicated + attention + mlp
}

/// The first stage's peak as this engine allocates it (`--log-memory`'s prediction): f32
/// weights (and their 16-bit copy), f32 gradients, Adam moments (sharded, with fp32 mains under
/// 16-bit weights, by the distributed optimizer) and its staging buffer.
fn this_engine_memory(cfg: &TrainConfig, params: f64) -> Result<MemoryCost, String> {
    let half = cfg.precision.half().is_some();
    let d = (cfg.dp * cfg.cp) as f64;
    let weights = params * if half { 6.0 } else { 4.0 };
    let muon = muon_share(cfg, 0).params;
    let moments = moment_bytes(cfg) * (params - muon) + muon_moment_bytes(cfg) * muon;
    let (optimizer, staging) = match cfg.optimizer {
        OptimizerKind::Replicated => (moments, 0.0),
        OptimizerKind::Distributed => {
            let bucket = cfg
                .args
                .ddp_bucket_size
                .map_or((40e6f64).max(1e6 * d), |b| b as f64);
            (
                (moments + if half { 4.0 * params } else { 0.0 }) / d,
                4.0 * megatron_core::distributed::collective_scratch_elements(
                    (params.min(bucket) / d).ceil() as usize,
                    d as usize,
                ) as f64,
            )
        }
    };
    let state = weights + 4.0 * params + optimizer;
    // The layout's ranks will each have their share of the GEMM threads (not the planner's).
    let threads = crate::memory::rank_gemm_threads(cfg);
    let kernel = crate::setup::requested_bf16_kernel(cfg);
    let peak = crate::memory::predict_rank_peak_with(
        cfg,
        state as u64,
        staging as u64,
        0,
        (threads, kernel),
    )?;
    Ok(MemoryCost {
        weights_and_optimizer: state,
        activations: (peak.total() as f64 - state).max(0.0),
        in_flight: peak.micro_batches_in_flight,
        logits: 0.0,
        reserved: 0.0,
    })
}

/// The device that holds the most (the first stage: most micro-batches in flight; or the last:
/// the logits) under Megatron's accounting.
fn megatron_memory(
    cfg: &TrainConfig,
    cluster: &Cluster,
    first_params: f64,
    last_params: f64,
) -> Result<MemoryCost, String> {
    let m = &cfg.model;
    let (t, p, v) = (cfg.tp, cfg.pp, cfg.partition.v);
    let tok = (cfg.args.micro_batch_size * cfg.args.seq_length / cfg.cp) as f64;
    let h = m.hidden_size as f64;
    let e = cluster.activation_bytes;
    let first_layers = stage_layers(cfg, 0);
    let first_state = state_bytes(cfg, first_params, muon_share(cfg, 0).params);
    let last_state = state_bytes(cfg, last_params, muon_share(cfg, p - 1).params);
    let ops = megatron_core::pipeline_parallel::schedule(p, 0, cfg.num_microbatches(), v)?;
    let in_flight = megatron_core::pipeline_parallel::peak_in_flight(&ops);
    let per_layer: f64 = tok
        * first_layers
            .iter()
            .map(|&l| layer_activation_bytes_per_token(cfg, cluster, m.is_moe_layer(l)))
            .fold(0.0, f64::max);
    let sp = sequence_parallel_divisor(cfg);
    // The first stage's largest chunk (its chunks are in flight alike).
    let chunk_layers = (0..v)
        .map(|c| cfg.partition.layers(0, c).len())
        .max()
        .unwrap_or(0) as f64;
    let kept_per_chunk = match cfg.recompute {
        // Each recomputed group keeps its input; one layer's activations live in its backward.
        Recompute::Full { num_layers, .. } => {
            let groups = (chunk_layers / num_layers.max(1) as f64).ceil();
            groups * tok * h * e / sp
        }
        _ => chunk_layers * per_layer,
    };
    let transient = if matches!(cfg.recompute, Recompute::Full { .. }) {
        per_layer
    } else {
        0.0
    };
    // Multi-token prediction's depths on the last stage keep their layers' activations (not
    // recomputed) and the 2h-wide input of `eh_proj`, for the micro-batch the last chunk holds.
    let depths = m.mtp.as_ref().map_or(0, |x| x.num_layers);
    let mtp_kept: f64 = (0..depths)
        .map(|k| {
            let l = m.num_layers + k;
            tok * (layer_activation_bytes_per_token(cfg, cluster, m.is_moe_layer(l))
                + 2.0 * h * e / sp)
        })
        .sum();
    let activations = in_flight as f64 * kept_per_chunk
        + transient
        + if p == 1 {
            in_flight as f64 * mtp_kept
        } else {
            0.0
        };
    let vocab = m.padded_vocab_size as f64;
    // fp32 logits and their gradient for one micro-batch on the last stage, once more per MTP
    // depth.
    let logits = 2.0 * 4.0 * tok * vocab / t as f64 * (1 + depths) as f64;
    let first = first_state + activations + if p == 1 { logits } else { 0.0 };
    let last = last_state
        + if p == 1 {
            activations
        } else {
            // The last stage keeps one micro-batch per chunk in flight at a time (1F1B).
            v as f64 * kept_per_chunk + transient + mtp_kept
        }
        + logits;
    Ok(if first >= last {
        MemoryCost {
            weights_and_optimizer: first_state,
            activations,
            in_flight,
            logits: if p == 1 { logits } else { 0.0 },
            reserved: cluster.reserved_memory,
        }
    } else {
        MemoryCost {
            weights_and_optimizer: last_state,
            activations: last - last_state - logits,
            in_flight: v,
            logits,
            reserved: cluster.reserved_memory,
        }
    })
}

/// Predicts memory and time of `cfg` on `cluster`.
pub fn predict(cfg: &TrainConfig, cluster: &Cluster) -> Result<Prediction, String> {
    let m = &cfg.model;
    let (t, p, v, cp, d) = (cfg.tp, cfg.pp, cfg.partition.v, cfg.cp, cfg.dp);
    let b = cfg.args.micro_batch_size;
    let s = cfg.args.seq_length;
    let tok = (b * s / cp) as f64;
    let mb = cfg.num_microbatches();
    let h = m.hidden_size as f64;
    let e = cluster.activation_bytes;
    let node = cluster.gpus_per_node;

    let (first_params, last_params) = parameters_per_rank(cfg);
    let memory = match cluster.engine {
        Engine::Megatron => megatron_memory(cfg, cluster, first_params, last_params)?,
        Engine::ThisEngine => this_engine_memory(cfg, first_params)?,
    };
    let vocab = m.padded_vocab_size as f64;

    // --- Time of one micro-batch through one pipeline stage.
    let gemm = |flops: f64| flops / (cluster.peak_flops * cluster.gemm_efficiency);
    let memory_bound = |bytes: f64| bytes / (cluster.memory_bandwidth * cluster.memory_efficiency);
    let w = widths(m);
    let gated = w.gated;
    let sp = sequence_parallel_divisor(cfg);
    let tf = t as f64;
    let (passes, attention_passes) = passes(cfg.recompute);
    let keys = attention_keys(cluster.attention, s as f64);
    // MLA's down projections run whole on each rank's rows (its token block under sequence
    // parallelism).
    let projections = 2.0 * tok * (w.sharded / tf + w.duplicated / sp);
    let core_attention = 2.0 * tok * keys * (w.qk + w.ctx) / tf;
    let mlp_flops = |moe: bool| -> f64 {
        if moe {
            let x = m.moe.as_ref().expect("MoE config");
            let shared = x.shared_expert_ffn.unwrap_or(0) as f64;
            2.0 * tok
                * h
                * gated
                * (x.topk as f64 * x.ffn_hidden_size as f64 / cfg.etp as f64 + shared / tf)
                + 2.0 * tok * h * x.num_experts as f64
        } else {
            2.0 * tok * h * gated * m.ffn_hidden_size as f64 / tf
        }
    };
    let layer_flops =
        |moe: bool| passes * (projections + mlp_flops(moe)) + attention_passes * core_attention;
    // Memory-bound traffic of one forward (bytes per token): norms, bias-dropout-adds and the
    // QKV/context re-layouts (h-wide, replicated without sequence parallelism), the activation
    // function, and with dense attention the scaled-masked softmax and its dropout.
    // The activation function reads fc1's output and writes its input to fc2: 2 (or 3
    // gated) FFN-wide passes, `gated`.
    let fc1 = gated;
    let a = m.num_attention_heads as f64;
    let elementwise = tok
        * ((11.0 * h * e) / sp
            + (e * (w.qk + w.k + w.v) + 2.0 * e * w.ctx) / tf
            + fc1 * e * m.ffn_hidden_size as f64 / tf
            + match cluster.attention {
                AttentionKernel::Dense => (4.0 * e + 1.0) * a * s as f64 / tf,
                AttentionKernel::Flash => 0.0,
            });
    // Backward moves twice the forward's bytes: `passes` forwards' worth in all.
    let layer_memory = memory_bound(elementwise * passes);
    let tp_bw = if t <= node {
        cluster.intra_node_bandwidth
    } else {
        cluster.inter_node_bandwidth
    };
    // Two all-reduces (or reduce-scatter + all-gather) per forward and per backward.
    let tp_layer = if t > 1 {
        (passes - 1.0) * 2.0 * (all_reduce(tok * h * e, t, tp_bw) + cluster.tp_collective_latency)
    } else {
        0.0
    };
    let cp_bw = if t * cp <= node {
        cluster.intra_node_bandwidth
    } else {
        cluster.inter_node_bandwidth
    };
    // Key/value ring: (cp - 1) blocks each way per forward, twice that in backward; hidden
    // behind the attention it feeds when that is longer.
    let cp_layer = if cp > 1 {
        let ring = (cp - 1) as f64 * tok * (w.k + w.v) * e / tf / cp_bw * passes;
        // Each exchange also waits for the peer: (cp - 1) per forward pass, cp per backward
        // (the gradients' last hop home).
        let exchanges = (passes - 2.0) * (cp - 1) as f64 + cp as f64;
        (ring - gemm(attention_passes * core_attention)).max(0.0)
            + exchanges * cluster.ring_exchange_latency
    } else {
        0.0
    };
    let ep_bw = if t * cfg.ep <= node {
        cluster.intra_node_bandwidth
    } else {
        cluster.inter_node_bandwidth
    };
    let ep_layer = |moe: bool| -> f64 {
        match (moe, m.moe.as_ref()) {
            (true, Some(x)) if cfg.ep > 1 => {
                let share = (cfg.ep - 1) as f64 / cfg.ep as f64;
                // Dispatch and combine all-to-alls in each forward and backward.
                2.0 * (passes - 1.0) * tok * x.topk as f64 * h * e * share / ep_bw
            }
            _ => 0.0,
        }
    };
    // The output layer and the cross entropy run on the last stage (forward and backward).
    let head = gemm(3.0 * 2.0 * tok * h * vocab / tf) + memory_bound(3.0 * 4.0 * tok * vocab / tf);
    // Every stage waits for the slowest: each stage's layers, the last's with the head (an
    // even split makes the last the slowest; the account-for flags and layouts move layers
    // off it).
    let (stage_compute, tp_time, cp_time, ep_time) = (0..p)
        .map(|r| {
            let (mut compute, mut tp_time, mut cp_time, mut ep_time) = (0.0, 0.0, 0.0, 0.0);
            for l in stage_layers(cfg, r) {
                let moe = m.is_moe_layer(l);
                compute += gemm(layer_flops(moe)) + layer_memory;
                tp_time += tp_layer;
                cp_time += cp_layer;
                ep_time += ep_layer(moe);
            }
            if r == p - 1 {
                compute += head;
                // Each MTP depth: its layer, `eh_proj` (2h -> h) and one more output layer.
                for k in 0..m.mtp.as_ref().map_or(0, |x| x.num_layers) {
                    let moe = m.is_moe_layer(m.num_layers + k);
                    compute += gemm(layer_flops(moe) + passes * 2.0 * tok * 2.0 * h * h / tf)
                        + layer_memory
                        + head;
                    tp_time += tp_layer;
                    cp_time += cp_layer;
                    ep_time += ep_layer(moe);
                }
            }
            (compute, tp_time, cp_time, ep_time)
        })
        .fold((0.0, 0.0, 0.0, 0.0), |slowest, x| {
            let total = |y: (f64, f64, f64, f64)| y.0 + y.1 + y.2 + y.3;
            if total(x) > total(slowest) {
                x
            } else {
                slowest
            }
        });
    let stage = stage_compute + tp_time + cp_time + ep_time;
    let mbf = mb as f64;
    let bubble = if p > 1 {
        (p - 1) as f64 / v as f64 * stage
    } else {
        0.0
    };
    // Pipeline sends: one activation forward and one gradient back per micro-batch and model
    // chunk, over the network when the stages sit on different nodes (scatter/gather: 1/t of
    // it per device, then an all-gather inside the node).
    let p2p = if p > 1 {
        let bytes = tok * h * e;
        // Neighbouring stages are t x cp x d ranks apart (pipeline outermost).
        let across = t * cp * d >= node;
        let one = if across {
            bytes / tf / cluster.inter_node_bandwidth
                + bytes * (tf - 1.0) / tf / cluster.intra_node_bandwidth
        } else {
            bytes / cluster.intra_node_bandwidth
        };
        mbf * v as f64 * 2.0 * one
    } else {
        0.0
    };
    // Gradient reduction over data (and context) parallel ranks: fp16 gradients under
    // --fp16 (Megatron reduces them as they are), fp32 main gradients otherwise.
    let grad_bytes = if cfg.precision == Precision::F16 {
        2.0
    } else {
        4.0
    };
    let params = first_params.max(last_params);
    let dp_ranks = d * cp;
    // The reducing ranks are t apart: all on one node, or spread over nodes with node / t of
    // them on each, whose network links the collective uses together (NCCL's rings over
    // every NIC of a node), up to the node's internal bandwidth.
    let dp_bw = if t * cp * d <= node {
        cluster.intra_node_bandwidth
    } else {
        let per_node = (node / t).max(1) as f64;
        (cluster.inter_node_bandwidth * per_node).min(cluster.intra_node_bandwidth)
    };
    let mut reduce = all_reduce(params * grad_bytes, dp_ranks, dp_bw);
    if cfg.args.overlap_grad_reduce {
        // Hidden behind the last micro-batch's backward, but for its last bucket.
        let backward = stage_compute * 2.0 / passes;
        reduce = (reduce - backward).max(reduce / 10.0);
    }
    let optimizer_params = match cfg.optimizer {
        OptimizerKind::Replicated => params,
        OptimizerKind::Distributed => params / dp_ranks as f64,
    };
    // Muon: the Newton-Schulz GEMMs and `duplicated`'s all-gathers of the slowest stage.
    let muon = (0..p)
        .map(|stage| {
            let m = muon_share(cfg, stage);
            gemm(m.ns_flops) + m.tp_gather_bytes / tp_bw
        })
        .fold(0.0, f64::max);
    let optimizer = memory_bound(optimizer_params * cluster.optimizer_bytes_per_parameter) + muon;
    let time = TimeCost {
        compute: mbf * stage_compute,
        tensor_parallel: mbf * tp_time,
        context_parallel: mbf * cp_time,
        expert_parallel: mbf * ep_time,
        pipeline_bubble: bubble,
        pipeline_p2p: p2p,
        data_parallel: reduce,
        optimizer,
    };
    let devices = (t * p * cp * d) as f64;
    let total = time.total();
    let gbs = cfg.global_batch_size as f64;
    let executed = executed_flops(cfg, cluster.attention);
    let model = crate::flops::num_floating_point_operations(m, cfg.global_batch_size);
    Ok(Prediction {
        memory,
        time,
        tflops_per_device: executed / total / devices / 1e12,
        model_tflops_per_device: model / total / devices / 1e12,
        tokens_per_second: gbs * s as f64 / total,
    })
}

/// FLOPs an iteration executes (recomputation included; the attention scores in full under
/// the dense kernel, as Narayanan et al. 2021 count them: `96 B s l h² (1 + s/6h + V/16lh)`
/// for GPT under full recomputation).
pub fn executed_flops(cfg: &TrainConfig, attention: AttentionKernel) -> f64 {
    let m = &cfg.model;
    let (h, s) = (m.hidden_size as f64, cfg.args.seq_length as f64);
    let tokens = cfg.global_batch_size as f64 * s;
    let w = widths(m);
    let gated = w.gated;
    // MLA's down projections run once per rank's rows: t times over without sequence
    // parallelism.
    let repeats = if cfg.args.sequence_parallel {
        1.0
    } else {
        cfg.tp as f64
    };
    let (passes, attention_passes) = passes(cfg.recompute);
    let keys = attention_keys(attention, s);
    let per_layer = |l: usize| -> f64 {
        let mlp = match (&m.moe, m.is_moe_layer(l)) {
            (Some(x), true) => {
                h * gated
                    * (x.topk as f64 * x.ffn_hidden_size as f64
                        + x.shared_expert_ffn.unwrap_or(0) as f64)
                    + h * x.num_experts as f64
            }
            _ => h * gated * m.ffn_hidden_size as f64,
        };
        passes * 2.0 * (w.sharded + w.duplicated * repeats + mlp)
            + attention_passes * 2.0 * keys * (w.qk + w.ctx)
    };
    // Multi-token prediction's depths: a layer, `eh_proj` and an output layer each.
    let depths = m.mtp.as_ref().map_or(0, |x| x.num_layers);
    let mtp: f64 = (0..depths)
        .map(|k| per_layer(m.num_layers + k) + passes * 2.0 * 2.0 * h * h)
        .sum();
    let layers: f64 = (0..m.num_layers).map(per_layer).sum();
    tokens * (layers + mtp + 6.0 * h * m.padded_vocab_size as f64 * (1 + depths) as f64)
}
