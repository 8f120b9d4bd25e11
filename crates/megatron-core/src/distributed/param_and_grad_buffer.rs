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

/// Which parameters a buffer's buckets cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGroup {
    All,
    /// Everything but the experts (reduced over data parallelism).
    Dense,
    /// The experts' weights (reduced over expert data parallelism).
    Expert,
}

impl ParamGroup {
    pub fn contains(self, m: &crate::ParamMeta) -> bool {
        match self {
            ParamGroup::All => true,
            ParamGroup::Dense => !m.expert,
            ParamGroup::Expert => m.expert,
        }
    }
}

impl GradBuffer {
    pub fn new(
        params: &Params,
        bucket_size: usize,
        dp: usize,
        dp_rank: usize,
        distributed: bool,
    ) -> Self {
        Self::new_for(
            params,
            ParamGroup::All,
            bucket_size,
            dp,
            dp_rank,
            distributed,
        )
    }

    /// Buckets over the parameters of `group` only (a bucket never spans another's).
    pub fn new_for(
        params: &Params,
        group: ParamGroup,
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
            if !group.contains(&metas[i]) {
                if let Some((lo, hi, _, _)) = cur.take() {
                    push(&mut buckets, lo, hi);
                }
                continue;
            }
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

    /// Elements of the staging buffer the distributed optimizer's reduce-scatter and
    /// all-gather use (the largest bucket padded to a multiple of DP); 0 without it.
    pub fn scratch_elements(&self) -> usize {
        if self.dp == 1 || !self.distributed {
            return 0;
        }
        self.buckets
            .iter()
            .map(|b| b.shard_len(self.dp) * self.dp)
            .max()
            .unwrap_or(0)
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
        // Exactly the largest bucket (`scratch_elements`), not the doubling of amortized growth.
        scratch.reserve_exact(s * self.dp);
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
    /// bucket so all ranks hold the whole buffer again (f32 values, or 16-bit parameters as
    /// their bit patterns).
    pub fn all_gather<T: Gathered>(
        &self,
        data: &mut [T],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        for b in &self.buckets {
            self.all_gather_bucket(b, &mut data[b.range.clone()], dp, scratch)?;
        }
        Ok(())
    }

    /// All-gathers bucket `b` whose values are `data` (the bucket's range of the buffer).
    pub fn all_gather_bucket<T: Gathered>(
        &self,
        b: &Bucket,
        data: &mut [T],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        if self.dp == 1 {
            return Ok(());
        }
        let s = b.shard_len(self.dp);
        let words = s.div_ceil(T::PER_WORD);
        let own = b.shard(self.dp, self.dp_rank);
        let lo = own.start - b.range.start;
        let mut mine = vec![0.0f32; words];
        T::pack(&data[lo..lo + own.len()], &mut mine);
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
            T::unpack(&scratch[r * words..(r + 1) * words], &mut data[lo..lo + n]);
        }
        Ok(())
    }
}

/// What the parameter all-gather moves: f32 values, or 16-bit patterns two to an f32 word
/// (the collectives only copy words; no arithmetic touches them).
pub trait Gathered: Copy {
    const PER_WORD: usize;
    /// Packs `x` into the first words of `out` (the rest stay zero).
    fn pack(x: &[Self], out: &mut [f32]);
    /// Fills `out` from the leading words of `w`.
    fn unpack(w: &[f32], out: &mut [Self]);
}

impl Gathered for f32 {
    const PER_WORD: usize = 1;
    fn pack(x: &[f32], out: &mut [f32]) {
        out[..x.len()].copy_from_slice(x);
    }
    fn unpack(w: &[f32], out: &mut [f32]) {
        let n = out.len();
        out.copy_from_slice(&w[..n]);
    }
}

impl Gathered for u16 {
    const PER_WORD: usize = 2;
    fn pack(x: &[u16], out: &mut [f32]) {
        for (o, p) in out.iter_mut().zip(x.chunks(2)) {
            let hi = p.get(1).copied().unwrap_or(0) as u32;
            *o = f32::from_bits(p[0] as u32 | hi << 16);
        }
    }
    fn unpack(w: &[f32], out: &mut [u16]) {
        let vals = w
            .iter()
            .flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16]);
        for (d, v) in out.iter_mut().zip(vals) {
            *d = v;
        }
    }
}
