//! Buckets of the flat gradient buffer. Parameters already live in one contiguous buffer per
//! rank (`Params`/`Grads`), so a bucket is a contiguous range of it at parameter boundaries.
//! Buckets are cut in reverse registration order (roughly the order backward produces the
//! gradients), each at least `bucket_size` elements; with the distributed optimizer the tied
//! embedding's copy gets its own bucket and every bucket splits into `dp` shards of
//! `ceil(len / dp)` elements (the last shard may be short: the padding is virtual), of which DP
//! rank r owns shard r.

use crate::params::{Grads, Params};
use megatron_comm::{CommError, Communicator, ReduceOp};
use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Elements of the flat buffer.
    pub range: Range<usize>,
    /// Parameters (indices into `Params::metas`) in it.
    pub params: Range<usize>,
}

impl Bucket {
    /// Shard length: the bucket padded to a multiple of `dp`, divided by `dp`.
    pub fn shard_len(&self, dp: usize) -> usize {
        self.range.len().div_ceil(dp)
    }
    /// Elements of the flat buffer that DP rank `r` owns (possibly empty at the end).
    pub fn shard(&self, dp: usize, r: usize) -> Range<usize> {
        let s = self.shard_len(dp);
        let lo = (self.range.start + r * s).min(self.range.end);
        let hi = (self.range.start + (r + 1) * s).min(self.range.end);
        lo..hi
    }
}

#[derive(Clone, Debug)]
pub struct GradBuffer {
    pub buckets: Vec<Bucket>,
    pub dp: usize,
    pub dp_rank: usize,
    /// Reduce-scatter (distributed optimizer) instead of all-reduce.
    pub distributed: bool,
}

impl GradBuffer {
    pub fn new(
        params: &Params,
        bucket_size: usize,
        dp: usize,
        dp_rank: usize,
        distributed: bool,
    ) -> Self {
        let metas = &params.metas;
        let mut buckets = Vec::new();
        let push = |buckets: &mut Vec<Bucket>, lo: usize, hi: usize| {
            let range = metas[lo].offset..metas[hi - 1].offset + metas[hi - 1].numel;
            buckets.push(Bucket {
                range,
                params: lo..hi,
            });
        };
        // (first param, one past the last, elements, holds the shared copy)
        let mut cur: Option<(usize, usize, usize, bool)> = None;
        for i in (0..metas.len()).rev() {
            let alone = distributed && metas[i].shared;
            match cur {
                Some((_, hi, len, false)) if !alone && len < bucket_size.max(1) => {
                    cur = Some((i, hi, len + metas[i].numel, false));
                }
                _ => {
                    if let Some((lo, hi, _, _)) = cur.take() {
                        push(&mut buckets, lo, hi);
                    }
                    cur = Some((i, i + 1, metas[i].numel, alone));
                }
            }
        }
        if let Some((lo, hi, _, _)) = cur {
            push(&mut buckets, lo, hi);
        }
        GradBuffer {
            buckets,
            dp,
            dp_rank,
            distributed,
        }
    }

    /// This rank's shards, one per bucket (flat-buffer ranges).
    pub fn owned(&self) -> Vec<Range<usize>> {
        self.buckets
            .iter()
            .map(|b| b.shard(self.dp, self.dp_rank))
            .collect()
    }

    /// Averages the gradients over the data-parallel group, bucket by bucket: all-reduce, or
    /// with the distributed optimizer reduce-scatter, after which only this rank's shards hold
    /// the averaged gradient (the rest of the buffer is stale).
    pub fn reduce_gradients(
        &self,
        grads: &mut Grads,
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        if self.dp == 1 {
            return Ok(());
        }
        for b in &self.buckets {
            self.reduce_bucket(b, grads, dp, scratch)?;
        }
        Ok(())
    }

    /// Reduces only the buckets `which` (those an overlapped reduction left).
    pub fn reduce_some(
        &self,
        which: &[usize],
        grads: &mut Grads,
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        for &i in which {
            self.reduce_bucket(&self.buckets[i], grads, dp, scratch)?;
        }
        Ok(())
    }

    pub fn reduce_bucket(
        &self,
        b: &Bucket,
        grads: &mut Grads,
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        self.reduce_slice(b, &mut grads.data[b.range.clone()], dp, scratch)
    }

    /// Reduces bucket `b` whose gradients are `data` (the bucket's range of the buffer).
    pub fn reduce_slice(
        &self,
        b: &Bucket,
        data: &mut [f32],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        if self.dp == 1 {
            return Ok(());
        }
        if !self.distributed {
            return dp.all_reduce(data, ReduceOp::Avg);
        }
        let s = b.shard_len(self.dp);
        scratch.clear();
        scratch.extend_from_slice(data);
        scratch.resize(s * self.dp, 0.0);
        let mut out = vec![0.0f32; s];
        dp.reduce_scatter(scratch, &mut out, ReduceOp::Avg)?;
        let own = b.shard(self.dp, self.dp_rank);
        let lo = own.start - b.range.start;
        let n = own.len();
        data[lo..lo + n].copy_from_slice(&out[..n]);
        Ok(())
    }

    /// Distributed optimizer: after each rank updated its shards of `data`, all-gathers every
    /// bucket so all ranks hold the whole buffer again.
    pub fn all_gather(
        &self,
        data: &mut [f32],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        for b in &self.buckets {
            self.all_gather_bucket(b, &mut data[b.range.clone()], dp, scratch)?;
        }
        Ok(())
    }

    /// All-gathers bucket `b` whose values are `data` (the bucket's range of the buffer).
    pub fn all_gather_bucket(
        &self,
        b: &Bucket,
        data: &mut [f32],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        if self.dp == 1 {
            return Ok(());
        }
        let s = b.shard_len(self.dp);
        let own = b.shard(self.dp, self.dp_rank);
        let lo = own.start - b.range.start;
        let mut mine = vec![0.0f32; s];
        mine[..own.len()].copy_from_slice(&data[lo..lo + own.len()]);
        scratch.clear();
        scratch.resize(s * self.dp, 0.0);
        dp.all_gather(&mine, scratch)?;
        let len = b.range.len();
        data.copy_from_slice(&scratch[..len]);
        Ok(())
    }

    /// [`GradBuffer::all_gather`] of 16-bit values, moved as bit patterns two to an f32 word
    /// (the collectives only copy words; no arithmetic touches them).
    pub fn all_gather_bits(
        &self,
        data: &mut [u16],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        for b in &self.buckets {
            self.all_gather_bits_bucket(b, &mut data[b.range.clone()], dp, scratch)?;
        }
        Ok(())
    }

    /// [`GradBuffer::all_gather_bucket`] of 16-bit values.
    pub fn all_gather_bits_bucket(
        &self,
        b: &Bucket,
        data: &mut [u16],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        if self.dp == 1 {
            return Ok(());
        }
        let s = b.shard_len(self.dp);
        let words = s.div_ceil(2);
        let own = b.shard(self.dp, self.dp_rank);
        let lo = own.start - b.range.start;
        let mut bits = vec![0u16; 2 * words];
        bits[..own.len()].copy_from_slice(&data[lo..lo + own.len()]);
        let mine: Vec<f32> = bits
            .chunks_exact(2)
            .map(|p| f32::from_bits(p[0] as u32 | (p[1] as u32) << 16))
            .collect();
        scratch.clear();
        scratch.resize(words * self.dp, 0.0);
        dp.all_gather(&mine, scratch)?;
        let len = b.range.len();
        for r in 0..self.dp {
            let lo = r * s;
            if lo >= len {
                break;
            }
            let n = s.min(len - lo);
            let unpacked = scratch[r * words..(r + 1) * words]
                .iter()
                .flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16]);
            for (d, v) in data[lo..lo + n].iter_mut().zip(unpacked) {
                *d = v;
            }
        }
        Ok(())
    }
}
