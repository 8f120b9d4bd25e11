//! What `megatron train` needs of a model family beyond the engine's `ModelFamily`: the
//! family's config from the run's validated flags, its samples, and its micro-batch buffers.
//! The step, evaluation, checkpoints and logging are written once, over this trait; GPT (and
//! the Llama family) and BERT are its implementations.

use crate::arguments::TrainConfig;
use crate::TrainError;
use megatron_core::context_parallel::CpLayout;
use megatron_core::models::bert::BertHeads;
use megatron_core::models::{ModelChunk, ModelFamily};
use megatron_data::{Split, Tokenizer};

/// A model family as the training loop drives it.
pub(crate) trait TrainFamily: 'static {
    /// The engine's family (it builds the chunks).
    type Config: ModelFamily<Chunk = Self::Chunk>;
    type Chunk: ModelChunk;
    /// The run's samples, every split.
    type Data: Send + Sync;
    /// One micro-batch's buffers, refilled every step.
    type MicroBatch: Send;

    fn config(cfg: &TrainConfig) -> Self::Config;
    fn build_data(
        cfg: &TrainConfig,
        tok: &dyn Tokenizer,
        lead: bool,
    ) -> Result<Self::Data, TrainError>;
    fn num_samples(data: &Self::Data, split: Split) -> u64;
    fn micro_batch(cfg: &TrainConfig, cp: CpLayout) -> Self::MicroBatch;
    /// Samples `first..first + micro_batch_size` of `split` into `mb`.
    fn fill(
        cfg: &TrainConfig,
        data: &Self::Data,
        mb: &mut Self::MicroBatch,
        split: Split,
        first: u64,
    );
    fn batch<'m>(
        cfg: &TrainConfig,
        mb: &'m Self::MicroBatch,
    ) -> <Self::Chunk as ModelChunk>::Batch<'m>;
    /// What checkpoints record beside the transformer config (a BERT's heads).
    fn bert_heads(_cfg: &TrainConfig) -> Option<BertHeads> {
        None
    }
    /// A T5's stacks, recorded in checkpoints.
    fn t5_stacks(_cfg: &TrainConfig) -> Option<megatron_core::models::t5::T5Stacks> {
        None
    }
}
