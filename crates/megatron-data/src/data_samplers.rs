//! Megatron's `MegatronPretrainingSampler`: sequential over the dataset from `consumed_samples`;
//! each step takes `micro_batch_size * data_parallel_size` consecutive sample indices and data-
//! parallel rank `r` gets the slice `[r * mbs, (r + 1) * mbs)`. All randomness lives in the
//! dataset's shuffle index, so resuming is skipping `consumed_samples`, and the global order of
//! samples does not depend on the data-parallel size.

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
