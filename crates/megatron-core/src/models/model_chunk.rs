//! The engine's one contract with a model (Megatron's model-chunk / `forward_step_func`
//! contract): what the pipeline executor, evaluation, checkpoint gathering and the training loop
//! may know of a model. A model family is a [`ModelFamily`] that builds [`ModelChunk`]s — one
//! pipeline stage's slice of its layers — and nothing in the schedules or the loop names a
//! concrete model. GPT and the Llama family are one implementation (the config-driven decoder,
//! [`crate::GPTModel`]); encoders, encoder-decoders and the tabular model are further ones.

use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::Tp;
use crate::transformer::moe::MoEMetrics;
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::{DType, Tensor};
use std::ops::Range;

/// One entry of [`ModelChunk::pipeline_tied`]: the parameter's local size (the same on every
/// stage) and this chunk's copy, if it holds one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TiedParam {
    pub numel: usize,
    pub id: Option<ParamId>,
}

/// What a chunk keeps of one micro-batch between its forward and its backward.
pub trait ChunkState {
    /// Bytes of saved activations held for backward.
    fn activation_bytes(&self) -> usize;
    /// Last chunk: (mean loss over the micro-batch's counted labels, their number).
    fn loss(&self) -> Option<(f32, f32)>;
}

/// Which passes a logged loss comes from: training steps or evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossPhase {
    Training,
    Evaluation,
}

/// One pipeline chunk of a model: forward and backward of one micro-batch.
pub trait ModelChunk: Send + Sync {
    /// One micro-batch as this model reads it.
    type Batch<'b>: Sync;
    /// What backward needs of a forward.
    type State: ChunkState + Send;

    /// Holds the input layer (Megatron's `pre_process`): its forward takes no input tensor.
    fn pre_process(&self) -> bool;
    /// Holds the output layer and the loss (`post_process`): its backward takes no gradient.
    fn post_process(&self) -> bool;
    /// Shape of the tensor a non-first chunk receives from the previous stage for `batch`.
    fn input_shape(&self, batch: &Self::Batch<'_>, tp: &Tp) -> [usize; 2];
    /// Shape of the tensor a non-last chunk sends to the next stage for `batch`.
    fn output_shape(&self, batch: &Self::Batch<'_>, tp: &Tp) -> [usize; 2];
    /// How the activations between stages travel: the residual stream's storage (bf16 under
    /// `--bf16`, half the bytes, as Megatron's `pipeline_dtype`). Gradients travel in f32.
    fn activation_dtype(&self) -> DType {
        DType::F32
    }

    /// Forward of one micro-batch. `input` is the previous stage's output (`None` on the first
    /// chunk). Returns what to send on (`None` on the last) and what backward needs; without
    /// `grads` nothing is kept (evaluation). On the last chunk the loss gradient is scaled by
    /// `grad_scale` (1 / micro-batches, times the loss scale).
    #[allow(clippy::too_many_arguments)]
    fn forward_step(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        input: Option<Tensor>,
        batch: &Self::Batch<'_>,
        grad_scale: f32,
        ctx: &StepContext,
    ) -> Result<(Option<Tensor>, Self::State), CommError>;

    /// Backward of one micro-batch: `dy` is the gradient of this chunk's output (`None` on the
    /// last chunk). Returns the gradient of its input (`None` on the first). `on_ready(offset)`
    /// says that the gradients of this chunk's parameters at flat offsets `>= offset` are
    /// complete for this micro-batch (what overlapping the data-parallel reduction needs).
    #[allow(clippy::too_many_arguments)]
    fn backward_step(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        state: Self::State,
        dy: Option<Tensor>,
        batch: &Self::Batch<'_>,
        ctx: &StepContext,
        on_ready: &mut dyn FnMut(usize),
    ) -> Result<Option<Tensor>, CommError>;

    /// A parameter this chunk shares with another pipeline stage, whose gradients are summed
    /// over the embedding group every step (the tied word embedding on the first and last
    /// stages).
    fn shared_embedding(&self) -> Option<ParamId>;

    /// Parameters held on several pipeline stages other than the first and last stage's word
    /// embedding (a T5's word embedding on its decoder's first stage, its stacks' relative
    /// position biases on every stage of the stack): the same list, in the same order, on every
    /// stage of the pipeline, with this chunk's copy where it holds one. Their gradients are
    /// summed over the whole pipeline group every step (stages without a copy add zeros).
    fn pipeline_tied(&self) -> Vec<TiedParam> {
        Vec::new()
    }

    /// Routing statistics of this chunk's mixture-of-experts layers since the last call, by
    /// global layer number (none for dense models).
    fn take_moe_metrics(&self) -> Vec<(usize, MoEMetrics)> {
        Vec::new()
    }

    /// Multi-token prediction's losses since the last call, per depth: the sum of the
    /// micro-batches' mean losses and their number (none without `--mtp-num-layers`).
    fn take_mtp_losses(&self) -> Vec<(f64, f64)> {
        Vec::new()
    }

    /// A BERT's sentence-order loss over the micro-batches of `phase` since the last call: the
    /// sum of their means and their number (none without the binary head or its stage), for a
    /// log that shows it apart from the masked-LM loss, as Megatron's does.
    fn take_sop_losses(&self, _phase: LossPhase) -> Option<(f64, f64)> {
        None
    }

    /// Once per step after every micro-batch's backward, before the optimizer (Megatron's
    /// `finalize_model_grads` hooks that are not gradient reductions: the MoE routers' expert
    /// bias update). Collective over `tp` and `dp`.
    fn finalize_step(
        &self,
        _tp: &mut Tp,
        _dp: Option<&mut dyn megatron_comm::Communicator>,
    ) -> Result<(), CommError> {
        Ok(())
    }

    /// Persistent state that is not a parameter (torch's buffers, e.g. a router's expert
    /// bias): saved with checkpoints, the same on every rank of the stage.
    fn buffers(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }

    /// Restores buffer `name`; false if this chunk has no such buffer.
    fn load_buffer(&self, _name: &str, _values: &[f32]) -> bool {
        false
    }
}

/// Builds a model's pipeline chunks: the config of a model family.
pub trait ModelFamily {
    type Chunk: ModelChunk;
    /// Layers to split over pipeline stages.
    fn num_layers(&self) -> usize;
    /// The chunk of `layers` (global numbers), with the input layer if `pre_process` and the
    /// output layer and loss if `post_process`, its parameters registered into `params`.
    fn build_chunk(
        &self,
        params: &mut Params,
        inits: &mut Vec<Init>,
        layers: Range<usize>,
        pre_process: bool,
        post_process: bool,
    ) -> Self::Chunk;
}
