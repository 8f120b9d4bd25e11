//! GPT and the Llama family under `megatron train`: token samples (mock, indexed datasets and
//! blends, or raw text) into `[b, t]` inputs and shifted labels.

use crate::arguments::TrainConfig;
use crate::data::{build_data, eod_mask, MicroBatch};
use crate::family::{LossAveraging, TrainFamily};
use crate::TrainError;
use megatron_core::context_parallel::CpLayout;
use megatron_core::{Batch, GPTModel, TransformerConfig};
use megatron_data::{GPTSampleSource, Split, Tokenizer};

pub(crate) struct Gpt;

impl TrainFamily for Gpt {
    type Config = TransformerConfig;
    type Chunk = GPTModel;
    type Data = Box<dyn GPTSampleSource>;
    type MicroBatch = MicroBatch;

    fn config(cfg: &TrainConfig) -> TransformerConfig {
        cfg.model.clone()
    }

    fn build_data(
        cfg: &TrainConfig,
        tok: &dyn Tokenizer,
        lead: bool,
    ) -> Result<Self::Data, TrainError> {
        build_data(cfg, tok, lead)
    }

    fn num_samples(data: &Self::Data, split: Split) -> u64 {
        data.num_samples(split)
    }

    fn validation_sets(data: &Self::Data) -> Vec<u64> {
        data.validation_sets()
    }

    fn micro_batch(cfg: &TrainConfig, cp: CpLayout) -> MicroBatch {
        MicroBatch::new(cfg.args.micro_batch_size, cfg.args.seq_length, cfg)
            .on_context_parallel_rank(cp)
    }

    fn fill(
        cfg: &TrainConfig,
        data: &Self::Data,
        mb: &mut MicroBatch,
        split: Split,
        samples: &[u64],
    ) -> Result<(), TrainError> {
        mb.fill(
            data.as_ref(),
            split,
            samples,
            cfg.args.seq_length,
            eod_mask(cfg, data.as_ref()),
        )
    }

    fn batch<'m>(cfg: &TrainConfig, mb: &'m MicroBatch) -> Batch<'m> {
        mb.batch(cfg.args.micro_batch_size, cfg.args.seq_length)
    }

    fn loss_averaging() -> LossAveraging {
        LossAveraging::Tokens
    }

    fn counted_tokens(mb: &MicroBatch) -> f64 {
        mb.counted_tokens()
    }
}
