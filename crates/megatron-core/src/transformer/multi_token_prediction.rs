//! Multi-token prediction (megatron-core's `MultiTokenPredictionBlock`, DeepSeek-V3): after the
//! decoder, depth k (1-based) takes the previous depth's hidden state `h` (depth 0: the
//! decoder's output after its final norm) and the embedding `e` of the tokens shifted k places
//! left, and computes `final_layernorm(mtp_model_layer(eh_proj([enorm(e) | hnorm(h)])))`: its
//! own hidden state, whose logits (the shared output layer) predict the labels shifted k places.
//! Shifts are per sequence, the vacated positions filled with token 0 and masked out of the
//! loss, as `roll_tensor` does. Each depth's loss is the mean over its counted labels; their
//! mean over the depths times `--mtp-loss-scaling-factor` joins the training loss (the logged
//! `lm loss` stays the decoder's).
//!
//! Parameter names are megatron-core's current ones (`mtp.layers.{k}.mtp_model_layer.*`; its
//! releases before the hybrid-model MTP named that layer `transformer_layer`).
//!
//! Tensor parallelism as megatron-core: the norms run on this rank's rows, `eh_proj` is
//! column-parallel with its output gathered (then scattered to the token blocks under sequence
//! parallelism), the layer is a decoder layer built from the last decoder layer's settings.

use super::config::TransformerConfig;
use super::layer::{TransformerLayer, TransformerLayerSaved};
use super::norm::{LayerNormSaved, Norm};
use super::step::StepContext;
use crate::context_parallel::CpLayout;
use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::mappings::{
    scatter_to_sequence_parallel_region_backward, scatter_to_sequence_parallel_region_forward,
};
use crate::tensor_parallel::{ColumnParallelLinear, Tp};
use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::{concat_columns, split_columns, AttentionMask, RopeStyle, RopeTable};
use megatron_tensor::Tensor;
use std::sync::{Arc, Mutex};

/// One depth: `mtp.layers.{k}.{enorm, hnorm, eh_proj, mtp_model_layer, final_layernorm}`.
pub struct MultiTokenPredictionLayer {
    pub enorm: Norm,
    pub hnorm: Norm,
    pub eh_proj: ColumnParallelLinear,
    pub mtp_model_layer: TransformerLayer,
    pub final_layernorm: Norm,
}

/// The depths, their loss weight and the losses seen since the metrics were last taken.
pub struct MultiTokenPredictionBlock {
    pub layers: Vec<MultiTokenPredictionLayer>,
    pub loss_scaling_factor: f32,
    /// Per depth: the sum of micro-batch mean losses and the number of micro-batches.
    logged: Mutex<Vec<(f64, f64)>>,
}

/// The token-level inputs of one depth: the shifted tokens, positions, labels and loss mask
/// (`[b, t]` each).
#[derive(Clone)]
pub struct ShiftedBatch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub labels: Vec<u32>,
    pub loss_mask: Vec<f32>,
}

impl ShiftedBatch {
    /// The micro-batch as depth 0 sees it (positions `0..t` unless given).
    pub fn first(
        tokens: &[u32],
        positions: Option<&[u32]>,
        labels: &[u32],
        loss_mask: &[f32],
        t: usize,
    ) -> Self {
        ShiftedBatch {
            tokens: tokens.to_vec(),
            positions: match positions {
                Some(p) => p.to_vec(),
                None => (0..tokens.len()).map(|i| (i % t) as u32).collect(),
            },
            labels: labels.to_vec(),
            loss_mask: loss_mask.to_vec(),
        }
    }

    /// The whole sequences from every context-parallel rank's rows (`t_local` per sequence,
    /// this rank's two chunks): shifting crosses the chunks, so it runs on whole sequences.
    /// Token ids travel as f32 bit patterns (the gather copies, never computes).
    pub fn gathered(
        &self,
        comm: &mut dyn Communicator,
        cp: CpLayout,
        b: usize,
        t_local: usize,
    ) -> Result<Self, CommError> {
        let mut gather = |local: Vec<f32>| -> Result<Vec<f32>, CommError> {
            let mut all = vec![0.0f32; local.len() * cp.size];
            comm.all_gather(&local, &mut all)?;
            Ok(cp.batch_from_ranks(&all, b, t_local))
        };
        let ids = |v: &[u32]| v.iter().map(|&x| f32::from_bits(x)).collect::<Vec<f32>>();
        let back = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
        Ok(ShiftedBatch {
            tokens: back(gather(ids(&self.tokens))?),
            positions: back(gather(ids(&self.positions))?),
            labels: back(gather(ids(&self.labels))?),
            loss_mask: gather(self.loss_mask.clone())?,
        })
    }

    /// This context-parallel rank's rows of whole sequences of `t`.
    pub fn on_rank(&self, cp: CpLayout, b: usize, t: usize) -> Self {
        ShiftedBatch {
            tokens: cp.batch_on_this_rank(&self.tokens, b, t),
            positions: cp.batch_on_this_rank(&self.positions, b, t),
            labels: cp.batch_on_this_rank(&self.labels, b, t),
            loss_mask: cp.batch_on_this_rank(&self.loss_mask, b, t),
        }
    }

    /// Everything one more place left within each sequence of `t`, the last place filled
    /// with 0 (megatron-core's `roll_tensor(shifts=-1)`).
    pub fn shifted(&self, t: usize) -> Self {
        fn roll<T: Copy + Default>(v: &[T], t: usize) -> Vec<T> {
            v.chunks(t)
                .flat_map(|s| s[1..].iter().copied().chain([T::default()]))
                .collect()
        }
        ShiftedBatch {
            tokens: roll(&self.tokens, t),
            positions: roll(&self.positions, t),
            labels: roll(&self.labels, t),
            loss_mask: roll(&self.loss_mask, t),
        }
    }
}

/// What one depth keeps for backward.
pub struct MtpDepthSaved {
    pub batch: ShiftedBatch,
    embedded: Tensor,
    enorm: LayerNormSaved,
    hidden_in: Tensor,
    hnorm: LayerNormSaved,
    concat: Tensor,
    layer: TransformerLayerSaved,
    layer_out: Tensor,
    final_norm: LayerNormSaved,
    /// The loss's gradient of this depth's hidden state (known in the forward: the output
    /// layer and cross entropy run their backward at once).
    pub dhidden: Tensor,
}

impl MtpDepthSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.embedded.size_in_bytes()
            + self.enorm.size_in_bytes()
            + self.hidden_in.size_in_bytes()
            + self.hnorm.size_in_bytes()
            + self.concat.size_in_bytes()
            + self.layer.size_in_bytes()
            + self.layer_out.size_in_bytes()
            + self.final_norm.size_in_bytes()
            + self.dhidden.size_in_bytes()
    }
}

/// One depth's forward: its hidden state (this rank's rows, normed) and what backward keeps
/// (the loss gradient is filled in by the caller).
pub struct MtpDepthOutput {
    pub hidden: Tensor,
    pub saved: MtpDepthSaved,
}

impl MultiTokenPredictionBlock {
    pub fn new(
        cfg: &TransformerConfig,
        rope: Option<(Arc<RopeTable>, RopeStyle)>,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let m = cfg.mtp.expect("an MTP config");
        let h = cfg.hidden_size;
        let norm = |params: &mut Params, inits: &mut Vec<Init>, name: &str| {
            Norm::new(
                cfg.normalization,
                name,
                h,
                cfg.layernorm_epsilon,
                params,
                inits,
            )
        };
        let layers = (0..m.num_layers)
            .map(|k| {
                let p = format!("mtp.layers.{k}");
                let enorm = norm(params, inits, &format!("{p}.enorm"));
                let hnorm = norm(params, inits, &format!("{p}.hnorm"));
                let eh_proj = ColumnParallelLinear::new(
                    params,
                    inits,
                    &format!("{p}.eh_proj"),
                    2 * h,
                    h,
                    false,
                    cfg.init_method_std,
                    true,
                    false,
                );
                let mtp_model_layer = TransformerLayer::new_named(
                    cfg,
                    &format!("{p}.mtp_model_layer"),
                    cfg.num_layers + k,
                    rope.clone(),
                    params,
                    inits,
                );
                let final_layernorm = norm(params, inits, &format!("{p}.final_layernorm"));
                MultiTokenPredictionLayer {
                    enorm,
                    hnorm,
                    eh_proj,
                    mtp_model_layer,
                    final_layernorm,
                }
            })
            .collect();
        MultiTokenPredictionBlock {
            layers,
            loss_scaling_factor: m.loss_scaling_factor,
            logged: Mutex::new(vec![(0.0, 0.0); m.num_layers]),
        }
    }

    /// Each depth's loss weight: the factor shared over the depths.
    pub fn depth_weight(&self) -> f32 {
        self.loss_scaling_factor / self.layers.len() as f32
    }

    /// Records depth `k`'s mean loss of one micro-batch for the log.
    pub fn record_loss(&self, k: usize, loss: f64) {
        let mut l = self.logged.lock().expect("MTP loss log");
        l[k].0 += loss;
        l[k].1 += 1.0;
    }

    /// The losses recorded since the last call (sum, micro-batches per depth).
    pub fn take_losses(&self) -> Vec<(f64, f64)> {
        let mut l = self.logged.lock().expect("MTP loss log");
        let n = l.len();
        std::mem::replace(&mut *l, vec![(0.0, 0.0); n])
    }
}

impl MultiTokenPredictionLayer {
    /// Depth `k`'s hidden state from the previous one (`hidden_in`, this rank's rows) and the
    /// embedding of its shifted tokens (`embedded`, the same rows).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: ShiftedBatch,
        embedded: Tensor,
        hidden_in: Tensor,
        (b, t): (usize, usize),
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<MtpDepthOutput, CommError> {
        let (rows, h) = (hidden_in.shape()[0], hidden_in.shape()[1]);
        let (en, enorm) = self.enorm.forward(params, &embedded);
        let (hn, hnorm) = self.hnorm.forward(params, &hidden_in);
        let mut concat = Tensor::for_overwrite(&[rows, 2 * h]);
        concat_columns(
            concat.data_mut(),
            Tensor::cat_rows(&en, &hn).data(),
            rows,
            h,
            2,
        );
        drop((en, hn));
        let x = self.eh_proj.forward(params, tp, &concat)?;
        let x = if tp.sequence_parallel {
            scatter_to_sequence_parallel_region_forward(tp, &x)
        } else {
            x
        };
        let x = self.mtp_model_layer.into_stream(x);
        let (layer_out, layer) = self
            .mtp_model_layer
            .forward(params, tp, x, b, t, ctx, mask)?;
        let (hidden, final_norm) = self.final_layernorm.forward(params, &layer_out);
        let saved = MtpDepthSaved {
            batch,
            embedded,
            enorm,
            hidden_in,
            hnorm,
            concat,
            layer,
            layer_out,
            final_norm,
            dhidden: Tensor::zeros(&[0]),
        };
        Ok(MtpDepthOutput { hidden, saved })
    }

    /// From the gradient of this depth's hidden state: the gradients of its embedding (its
    /// rows) and of the previous depth's hidden state.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: MtpDepthSaved,
        dhidden: &Tensor,
        (b, t): (usize, usize),
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<(Tensor, Tensor, ShiftedBatch), CommError> {
        let dy = self.final_layernorm.backward(
            params,
            grads,
            &saved.final_norm,
            &saved.layer_out,
            dhidden,
        );
        drop(saved.layer_out);
        let dx =
            self.mtp_model_layer
                .backward(params, grads, tp, saved.layer, dy, b, t, ctx, mask)?;
        let dx = if tp.sequence_parallel {
            scatter_to_sequence_parallel_region_backward(tp, &dx)?
        } else {
            dx
        };
        let dconcat = self
            .eh_proj
            .backward(params, grads, tp, &saved.concat, dx)?;
        let (rows, h) = (saved.hidden_in.shape()[0], saved.hidden_in.shape()[1]);
        let mut den = Tensor::for_overwrite(&[rows, h]);
        let mut dhn = Tensor::for_overwrite(&[rows, h]);
        split_columns(den.data_mut(), dconcat.data(), rows, 2 * h, 2, 0);
        split_columns(dhn.data_mut(), dconcat.data(), rows, 2 * h, 2, 1);
        let de = self
            .enorm
            .backward(params, grads, &saved.enorm, &saved.embedded, &den);
        let dh = self
            .hnorm
            .backward(params, grads, &saved.hnorm, &saved.hidden_in, &dhn);
        Ok((de, dh, saved.batch))
    }
}
