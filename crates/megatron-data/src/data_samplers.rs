//! Megatron's two pretraining samplers, each a function of the consumed-samples count so that
//! resuming is starting from it:
//! - `MegatronPretrainingSampler` (`--dataloader-type single`, the default): sequential over the
//!   dataset; each step takes `micro_batch_size * data_parallel_size` consecutive sample
//!   indices and data-parallel rank `r` gets the slice `[r * mbs, (r + 1) * mbs)`. All
//!   randomness lives in the dataset's shuffle index, and the global order of samples does not
//!   depend on the data-parallel size.
//! - `MegatronPretrainingRandomSampler` (`--dataloader-type cyclic`): a new random order each
//!   epoch, drawn by `torch.randperm` seeded with the epoch. With data sharding (the default)
//!   each data-parallel rank shuffles its own contiguous bucket of the dataset, so which samples
//!   a rank reads depends on the data-parallel size, as it does in Megatron-LM.

use crate::torch_randperm::torch_randperm;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegatronPretrainingSampler {
    pub total_samples: u64,
    pub consumed_samples: u64,
    pub micro_batch_size: u64,
    pub data_parallel_rank: u64,
    pub data_parallel_size: u64,
}

impl MegatronPretrainingSampler {
    /// Sample indices of the next micro-batch of this rank, advancing `consumed_samples` by the
    /// whole data-parallel micro-batch; `None` when the dataset is exhausted.
    pub fn next_micro_batch(&mut self) -> Option<Vec<u64>> {
        let global = self.micro_batch_size * self.data_parallel_size;
        if self.consumed_samples + global > self.total_samples {
            return None;
        }
        let start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size;
        self.consumed_samples += global;
        Some((start..start + self.micro_batch_size).collect())
    }
}

/// How the cyclic sampler spreads an epoch over the data-parallel ranks (`--no-data-sharding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataSharding {
    /// Megatron's default: rank `r` shuffles its own contiguous bucket of
    /// `(total / (mbs * dp)) * mbs` samples, starting at `r` buckets in.
    Buckets,
    /// One permutation of the whole dataset; rank `r` takes its elements `r, r + dp, ...`.
    Off,
}

/// Megatron's `MegatronPretrainingRandomSampler`, as the micro-batch of one rank at a consumed-
/// samples count. Megatron's iterator advances that count by `mbs * dp` per micro-batch and,
/// under `cyclic_iter`, starts the next epoch when one is spent; the micro-batch it yields at
/// count `c` depends on `c` alone, which is what [`Self::micro_batch`] computes. The epoch's
/// permutation is kept between calls (one `torch.randperm` an epoch).
#[derive(Clone, Debug)]
pub struct MegatronPretrainingRandomSampler {
    total_samples: u64,
    micro_batch_size: u64,
    data_parallel_rank: u64,
    data_parallel_size: u64,
    data_sharding: DataSharding,
    epoch_order: Option<(u64, Vec<u32>)>,
}

/// Why a dataset cannot be read by the cyclic sampler.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RandomSamplerError {
    #[error("{total} samples are fewer than one micro-batch on every data-parallel rank ({mbs} x {dp}): an epoch of Megatron's cyclic sampler would be empty")]
    TooFewSamples { total: u64, mbs: u64, dp: u64 },
    #[error("{0} samples in one shuffled bucket: more than torch.randperm's orders are kept for here (2^32)")]
    TooManySamples(u64),
}

impl MegatronPretrainingRandomSampler {
    pub fn new(
        total_samples: u64,
        micro_batch_size: u64,
        data_parallel_rank: u64,
        data_parallel_size: u64,
        data_sharding: DataSharding,
    ) -> Result<Self, RandomSamplerError> {
        assert!(micro_batch_size > 0 && data_parallel_rank < data_parallel_size);
        let global = micro_batch_size * data_parallel_size;
        if total_samples < global {
            return Err(RandomSamplerError::TooFewSamples {
                total: total_samples,
                mbs: micro_batch_size,
                dp: data_parallel_size,
            });
        }
        let s = MegatronPretrainingRandomSampler {
            total_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            data_sharding,
            epoch_order: None,
        };
        if s.bucket_size() > u32::MAX as u64 + 1 {
            return Err(RandomSamplerError::TooManySamples(s.bucket_size()));
        }
        Ok(s)
    }

    /// The samples of an epoch: the last partial global micro-batch is left out.
    fn active_total_samples(&self) -> u64 {
        let global = self.micro_batch_size * self.data_parallel_size;
        self.total_samples - self.total_samples % global
    }

    /// The length of the permutation drawn each epoch.
    fn bucket_size(&self) -> u64 {
        let global = self.micro_batch_size * self.data_parallel_size;
        match self.data_sharding {
            DataSharding::Buckets => (self.total_samples / global) * self.micro_batch_size,
            DataSharding::Off => {
                (self.total_samples / self.micro_batch_size) * self.micro_batch_size
            }
        }
    }

    /// The epoch a consumed-samples count falls in.
    pub fn epoch(&self, consumed_samples: u64) -> u64 {
        consumed_samples / self.active_total_samples()
    }

    /// Sample indices of this rank's micro-batch after `consumed_samples` samples, a multiple
    /// of `mbs * dp` (Megatron asserts the same).
    pub fn micro_batch(&mut self, consumed_samples: u64) -> Vec<u64> {
        let global = self.micro_batch_size * self.data_parallel_size;
        assert_eq!(
            consumed_samples % global,
            0,
            "consumed samples are counted in whole data-parallel micro-batches"
        );
        let active = self.active_total_samples();
        let (epoch, offset) = (consumed_samples / active, consumed_samples % active);
        let (mbs, rank, dp) = (
            self.micro_batch_size,
            self.data_parallel_rank,
            self.data_parallel_size,
        );
        let bucket = self.bucket_size();
        let order = match &self.epoch_order {
            Some((e, order)) if *e == epoch => order,
            _ => {
                &self
                    .epoch_order
                    .insert((epoch, torch_randperm(bucket, epoch)))
                    .1
            }
        };
        match self.data_sharding {
            DataSharding::Buckets => {
                let start = rank * bucket;
                let at = (offset / dp) as usize;
                order[at..at + mbs as usize]
                    .iter()
                    .map(|&x| start + x as u64)
                    .collect()
            }
            DataSharding::Off => (0..mbs)
                .map(|k| order[(offset + rank + dp * k) as usize] as u64)
                .collect(),
        }
    }
}
