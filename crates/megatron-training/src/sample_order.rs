//! Which samples each data-parallel rank reads, and in what order (`--dataloader-type`,
//! `--no-data-sharding`): Megatron's two pretraining samplers, as functions of the
//! consumed-samples count, so that a resumed run reads what an uninterrupted one would.
//!
//! Under `single` (the default) the global order of samples is the dataset's own, the same for
//! every layout. Under `cyclic` each epoch is reshuffled by `torch.randperm` seeded with the
//! epoch, and with data sharding each data-parallel rank shuffles its own contiguous part of the
//! dataset: as in Megatron-LM, which samples a step reads then depends on the data-parallel
//! size (tensor, pipeline, context and expert parallelism change nothing).

use crate::TrainError;
use clap::ValueEnum;
use megatron_data::data_samplers::{
    DataSharding, MegatronPretrainingRandomSampler, MegatronPretrainingSampler,
};
use megatron_data::Split;

/// `--dataloader-type`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataloaderTypeArg {
    Single,
    Cyclic,
    External,
}

/// The validated `--dataloader-type` with `--no-data-sharding`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleOrder {
    /// Megatron's `MegatronPretrainingSampler`: consecutive samples from the consumed count.
    Single,
    /// Megatron's `MegatronPretrainingRandomSampler`, reshuffled every epoch.
    Cyclic(DataSharding),
}

impl SampleOrder {
    pub fn from_args(
        dataloader_type: Option<DataloaderTypeArg>,
        no_data_sharding: bool,
    ) -> Result<Self, TrainError> {
        match dataloader_type.unwrap_or(DataloaderTypeArg::Single) {
            DataloaderTypeArg::Single => Ok(SampleOrder::Single),
            DataloaderTypeArg::Cyclic => Ok(SampleOrder::Cyclic(if no_data_sharding {
                DataSharding::Off
            } else {
                DataSharding::Buckets
            })),
            DataloaderTypeArg::External => Err(TrainError::Args(
                "--dataloader-type external hands Megatron a user's own Python data loader; \
                 megatron-rs reads its datasets with the `single` or `cyclic` sampler"
                    .into(),
            )),
        }
    }
}

/// A split's length as the samplers see it (Megatron's `len(dataset)`), from the data's
/// `num_samples`. Mock data has no end; there the samples the run asks of the split stand for
/// it.
pub(crate) fn split_length(
    cfg: &crate::arguments::TrainConfig,
    num_samples: u64,
    split: Split,
) -> u64 {
    if num_samples != u64::MAX {
        return num_samples;
    }
    let (valid, test) = cfg.eval_split_samples();
    match split {
        Split::Train => cfg.train_samples(),
        // (`--full-validation`'s one epoch needs data with an end: never mock data.)
        Split::Valid => valid.unwrap_or(num_samples),
        Split::Test => test,
    }
}

/// One rank's samplers, one per split (each split has its own dataset length and consumed
/// count, as Megatron builds a loader per split). The cyclic ones are built on first use.
pub(crate) struct RankSamplers {
    order: SampleOrder,
    /// Training's micro-batch size, and validation's and test's (`--eval-micro-batch-size`).
    micro_batch_size: [u64; 3],
    data_parallel_rank: u64,
    data_parallel_size: u64,
    cyclic: [Option<MegatronPretrainingRandomSampler>; 3],
}

impl RankSamplers {
    pub(crate) fn new(
        order: SampleOrder,
        (train_mbs, eval_mbs): (usize, usize),
        data_parallel_rank: usize,
        data_parallel_size: usize,
    ) -> Self {
        let (t, e) = (train_mbs as u64, eval_mbs as u64);
        RankSamplers {
            order,
            micro_batch_size: [t, e, e],
            data_parallel_rank: data_parallel_rank as u64,
            data_parallel_size: data_parallel_size as u64,
            cyclic: [None, None, None],
        }
    }

    /// This rank's micro-batch of `split` once `consumed` samples of it have been read by all
    /// data-parallel ranks together. `total` is the split's length as Megatron's `len(dataset)`
    /// (the cyclic sampler's epoch); only the cyclic sampler reads it.
    pub(crate) fn micro_batch(
        &mut self,
        split: Split,
        total: u64,
        consumed: u64,
    ) -> Result<Vec<u64>, TrainError> {
        let (mbs, rank, dp) = (
            self.micro_batch_size[crate::family::split_index(split)],
            self.data_parallel_rank,
            self.data_parallel_size,
        );
        let SampleOrder::Cyclic(sharding) = self.order else {
            // The dataset is sized for the run (and indices past it wrap in the sources).
            let mut single = MegatronPretrainingSampler {
                total_samples: u64::MAX,
                consumed_samples: consumed,
                micro_batch_size: mbs,
                data_parallel_rank: rank,
                data_parallel_size: dp,
            };
            return Ok(single
                .next_micro_batch()
                .expect("an unbounded sampler has a next micro-batch"));
        };
        let slot = &mut self.cyclic[crate::family::split_index(split)];
        let sampler = match slot {
            Some(s) => s,
            None => slot.insert(
                MegatronPretrainingRandomSampler::new(total, mbs, rank, dp, sharding).map_err(
                    |e| TrainError::Args(format!("--dataloader-type cyclic, {split:?} split: {e}")),
                )?,
            ),
        };
        Ok(sampler.micro_batch(consumed))
    }
}
