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

/// How the logged loss (training and validation) averages a global batch's micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LossAveraging {
    /// The mean of the micro-batches' means (Megatron's BERT and T5 report this way).
    MicroBatches,
    /// The global batch's summed loss over its counted tokens (Megatron's GPT: its loss
    /// function reports `(loss sum, tokens)`). The same as the other when every micro-batch
    /// counts as many tokens; not under `--eod-mask-loss`.
    Tokens,
}

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
    /// The validation split's sets end to end (`--multiple-validation-sets`): their lengths.
    fn validation_sets(data: &Self::Data) -> Vec<u64> {
        vec![Self::num_samples(data, Split::Valid)]
    }
    fn micro_batch(cfg: &TrainConfig, cp: CpLayout) -> Self::MicroBatch;
    /// Samples `samples` (a micro-batch's worth, in the sampler's order) of `split` into `mb`.
    fn fill(
        cfg: &TrainConfig,
        data: &Self::Data,
        mb: &mut Self::MicroBatch,
        split: Split,
        samples: &[u64],
    ) -> Result<(), TrainError>;
    fn batch<'m>(
        cfg: &TrainConfig,
        mb: &'m Self::MicroBatch,
    ) -> <Self::Chunk as ModelChunk>::Batch<'m>;
    /// Model FLOPs of one iteration of `batch` samples (the logged TFLOP/s and MFU).
    fn flops(cfg: &TrainConfig, batch: usize) -> f64 {
        crate::flops::num_floating_point_operations(&cfg.model, batch)
    }
    /// The activation formulas printed beside the measured bytes (the decoder's; none for the
    /// families they do not describe).
    fn activation_formulas(
        cfg: &TrainConfig,
        tp: &megatron_core::tensor_parallel::Tp,
    ) -> Option<(f64, f64)> {
        Some(crate::logging::decoder_activation_formulas(cfg, tp))
    }
    /// The layers, as the start-up line names them.
    fn describe_layers(cfg: &TrainConfig) -> String {
        format!("{} layers", cfg.model.num_layers)
    }
    /// What checkpoints record beside the transformer config (a BERT's heads).
    fn bert_heads(_cfg: &TrainConfig) -> Option<BertHeads> {
        None
    }
    /// Whether the log shows a sentence-order loss apart from `lm loss` (a BERT with its
    /// binary head, as Megatron's `pretrain_bert.py`); the same on every rank, so the gathers
    /// it asks for are collective.
    fn logs_sop_apart(_cfg: &TrainConfig) -> bool {
        false
    }
    /// A T5's stacks, recorded in checkpoints.
    fn t5_stacks(_cfg: &TrainConfig) -> Option<megatron_core::models::t5::T5Stacks> {
        None
    }
    /// How the logged loss averages micro-batches.
    fn loss_averaging() -> LossAveraging {
        LossAveraging::MicroBatches
    }
    /// The tokens of `mb` the language-model loss counts, as this rank holds them (its part of
    /// the sequence under context parallelism): `--calculate-per-token-loss` divides by their
    /// sum over the global batch. Only families that support that flag count them.
    fn counted_tokens(_mb: &Self::MicroBatch) -> f64 {
        0.0
    }
}

/// The sentence-split dataset of `--data-path PREFIX` and, per split (train, validation,
/// test), the samples `build(document ids, samples wanted)` makes of its documents, with
/// Megatron's sample counts (every training sample, every evaluation, one test pass). Shared
/// by the masked-language families (BERT, T5); `what` names the family in errors.
pub(crate) fn sentence_splits<D>(
    cfg: &TrainConfig,
    what: &str,
    lead: bool,
    mut build: impl FnMut(
        std::sync::Arc<megatron_data::indexed_dataset::IndexedDataset>,
        &[i32],
        u64,
    ) -> D,
    len: impl Fn(&D) -> usize,
) -> Result<[Option<D>; 3], TrainError> {
    use megatron_data::gpt_dataset::{split_indices, split_matrix};
    let a = &cfg.args;
    let blend = megatron_data::blended_dataset::parse_blend(&a.data_path)?;
    let [(_, prefix)] = blend.as_slice() else {
        return Err(TrainError::Args(format!(
            "--model {what} reads one sentence-split dataset (--data-path PREFIX); got {} prefixes",
            blend.len()
        )));
    };
    let ds = std::sync::Arc::new(megatron_data::indexed_dataset::IndexedDataset::open(
        prefix,
    )?);
    let (valid, test) = cfg.eval_split_samples();
    // (`--full-validation` is refused for BERT and T5 with the flags.)
    let want = [cfg.train_samples(), valid.unwrap_or(0), test];
    let matrix = split_matrix(&megatron_data::text_dataset::parse_split(&a.split)?);
    let names = ["train", "validation", "test"];
    let mut splits: [Option<D>; 3] = [None, None, None];
    for k in 0..3 {
        let (Some(bounds), n) = (matrix[k], want[k]) else {
            continue;
        };
        let docs = split_indices(bounds, ds.num_documents());
        if n == 0 || docs.is_empty() {
            continue;
        }
        let d = build(ds.clone(), &docs, n);
        if len(&d) == 0 {
            return Err(TrainError::Args(format!(
                "{prefix}: the {} split's {} documents make no {what} sample (preprocess with --split-sentences; BERT's binary head needs 2 sentences per document)",
                names[k],
                docs.len()
            )));
        }
        if lead {
            println!(
                "data: {} split, {prefix}: {} documents, {} {what} samples",
                names[k],
                docs.len(),
                len(&d)
            );
        }
        splits[k] = Some(d);
    }
    if splits[0].is_none() {
        return Err(TrainError::Args(format!(
            "--split {}: the training split of {prefix} is empty",
            a.split
        )));
    }
    Ok(splits)
}

/// The index of a split in [`sentence_splits`]' array.
pub(crate) fn split_index(s: Split) -> usize {
    match s {
        Split::Train => 0,
        Split::Valid => 1,
        Split::Test => 2,
    }
}
