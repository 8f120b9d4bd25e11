use crate::{GPTSampleSource, Split};
use megatron_tensor::RngKey;

/// Synthetic, learnable sequences for `--mock-data`: runs of consecutive ids starting at a random
/// offset (like Megatron's mock dataset), so the next token is always predictable and the loss
/// visibly falls.
pub struct MockGPTDataset {
    pub vocab_size: usize,
    pub seq_length: usize,
    pub seed: u64,
}

impl GPTSampleSource for MockGPTDataset {
    fn seq_length(&self) -> usize {
        self.seq_length
    }
    fn num_samples(&self, _split: Split) -> u64 {
        u64::MAX
    }
    fn sample(&self, split: Split, idx: u64, out: &mut [u32]) {
        let key = RngKey::new(self.seed).fold(split as u64 + 100);
        let start = key.bits(idx) % self.vocab_size as u64;
        for (i, o) in out.iter_mut().enumerate() {
            *o = ((start + i as u64) % self.vocab_size as u64) as u32;
        }
    }
    fn eod(&self) -> Option<u32> {
        None
    }
}
