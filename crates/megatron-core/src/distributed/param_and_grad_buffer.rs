//! Buckets of the flat gradient buffer. Parameters already live in one contiguous buffer per
//! rank (`Params`/`Grads`), so a bucket is a contiguous range of it at parameter boundaries.
//! Buckets are cut in reverse registration order (roughly the order backward produces the
//! gradients), each at least `bucket_size` elements; with the distributed optimizer the tied
//! embedding's copy gets its own bucket and every bucket splits into `dp` shards of
//! `ceil(len / dp)` elements (the last shard may be short: the padding is virtual), of which DP
//! rank r owns shard r.
//!
//! The layer-wise layout (megatron-core's `LayerWiseDistributedOptimizer`, `--optimizer muon
//! --use-distributed-optimizer`) shards a bucket differently: a Muon matrix must be stepped
//! whole on one rank, so each rank's shard is a list of segments of the bucket — whole matrices
//! placed by their Newton–Schulz cost, then the element-wise parameters split to even out the
//! shards' lengths. Shards then travel packed (each rank's segments one after another, padded to
//! the longest shard), so a reduce-scatter still hands every rank exactly the gradients it owns.

use crate::params::{Grads, Params};
use megatron_comm::{CommError, Communicator, ReduceOp};
use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Elements of the flat buffer.
    pub range: Range<usize>,
    /// Parameters (indices into `Params::metas`) in it.
    pub params: Range<usize>,
    /// The layer-wise layout: the flat-buffer segments each DP rank owns, in the order they
    /// travel (`None`: `dp` equal contiguous shards).
    pub layer_wise: Option<Vec<Vec<Range<usize>>>>,
}

/// How the layer-wise layout places a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// On one rank, whole; `cost` is what the ranks' loads are balanced by (Newton–Schulz's
    /// `max(m, n) · min(m, n)²`).
    Whole { cost: u128 },
    /// Anywhere, split at any element (an element-wise update rule).
    Split,
}

impl Bucket {
    /// Shard length: the bucket padded to a multiple of `dp`, divided by `dp` (layer-wise: the
    /// longest rank's segments).
    pub fn shard_len(&self, dp: usize) -> usize {
        match &self.layer_wise {
            Some(owners) => owners
                .iter()
                .map(|s| s.iter().map(Range::len).sum())
                .max()
                .unwrap_or(0),
            None => self.range.len().div_ceil(dp),
        }
    }

    /// The flat-buffer segments DP rank `r` owns.
    pub fn segments(&self, dp: usize, r: usize) -> Vec<Range<usize>> {
        match &self.layer_wise {
            Some(owners) => owners[r].clone(),
            None => {
                let s = self.shard(dp, r);
                if s.is_empty() {
                    Vec::new()
                } else {
                    vec![s]
                }
            }
        }
    }

    /// Elements of the flat buffer that DP rank `r` owns under equal contiguous shards
    /// (possibly empty at the end).
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
                layer_wise: None,
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

    /// This rank's segments of each bucket (flat-buffer ranges).
    pub fn owned(&self) -> Vec<Vec<Range<usize>>> {
        self.buckets
            .iter()
            .map(|b| b.segments(self.dp, self.dp_rank))
            .collect()
    }

    /// The same buckets with the layer-wise layout: in each bucket, the `Whole` parameters go to
    /// one rank each, largest cost first to the rank with the least cost so far over the whole
    /// buffer (so the costly matrices spread over every rank), as long as that keeps the rank
    /// within 1.3 times an even share of the bucket's elements (megatron-core's cap), else to
    /// the rank with the fewest elements; the `Split` parameters then fill the shorter shards
    /// up to an even length. The same answer on every rank (it depends only on the metas).
    pub fn into_layer_wise(
        mut self,
        params: &Params,
        place: impl Fn(&crate::ParamMeta) -> Placement,
    ) -> Self {
        assert!(self.distributed, "the layer-wise layout shards the buckets");
        if self.dp == 1 {
            return self;
        }
        let dp = self.dp;
        self.buckets = merge_for_whole(std::mem::take(&mut self.buckets), params, dp, &place);
        let mut cost_load = vec![0u128; dp];
        for b in &mut self.buckets {
            let mut owners: Vec<Vec<Range<usize>>> = vec![Vec::new(); dp];
            let mut len = vec![0usize; dp];
            let mut whole: Vec<(u128, usize)> = Vec::new();
            let mut split: Vec<usize> = Vec::new();
            for p in b.params.clone() {
                match place(&params.metas[p]) {
                    Placement::Whole { cost } => whole.push((cost, p)),
                    Placement::Split => split.push(p),
                }
            }
            whole.sort_by_key(|&(cost, p)| (std::cmp::Reverse(cost), p));
            let cap = b.range.len() as f64 / dp as f64 * 1.3;
            for (cost, p) in whole {
                let m = &params.metas[p];
                let r = (0..dp)
                    .filter(|&r| (len[r] + m.numel) as f64 <= cap)
                    .min_by_key(|&r| (cost_load[r], r))
                    .unwrap_or_else(|| {
                        (0..dp)
                            .min_by_key(|&r| (len[r], cost_load[r], r))
                            .unwrap_or(0)
                    });
                owners[r].push(m.offset..m.offset + m.numel);
                len[r] += m.numel;
                cost_load[r] += cost;
            }
            // Water-fill: the split elements raise the shortest shards to a common level.
            let total: usize = split.iter().map(|&p| params.metas[p].numel).sum();
            let fill = water_fill(&len, total);
            let mut stream = split.iter().map(|&p| {
                let m = &params.metas[p];
                m.offset..m.offset + m.numel
            });
            let mut cur: Option<Range<usize>> = stream.next();
            for (r, mut want) in fill.into_iter().enumerate() {
                while want > 0 {
                    let seg = cur.as_mut().expect("the fill covers the split elements");
                    let n = want.min(seg.len());
                    owners[r].push(seg.start..seg.start + n);
                    seg.start += n;
                    want -= n;
                    if seg.start == seg.end {
                        cur = stream.next();
                    }
                }
            }
            for o in &mut owners {
                o.sort_by_key(|s| s.start);
                *o = merge_adjacent(o);
            }
            b.layer_wise = Some(owners);
        }
        self
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
        if let Some(owners) = &b.layer_wise {
            return self.reduce_scatter_segments(b, owners, data, dp, scratch);
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

    /// Reduce-scatter of a layer-wise bucket: each rank's segments packed into its slot.
    fn reduce_scatter_segments(
        &self,
        b: &Bucket,
        owners: &[Vec<Range<usize>>],
        data: &mut [f32],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        let s = b.shard_len(self.dp);
        let base = b.range.start;
        scratch.clear();
        scratch.reserve_exact(s * self.dp);
        for segs in owners {
            let slot = scratch.len();
            for seg in segs {
                scratch.extend_from_slice(&data[seg.start - base..seg.end - base]);
            }
            scratch.resize(slot + s, 0.0);
        }
        let mut out = vec![0.0f32; s];
        dp.reduce_scatter(scratch, &mut out, ReduceOp::Avg)?;
        let mut at = 0;
        for seg in &owners[self.dp_rank] {
            data[seg.start - base..seg.end - base].copy_from_slice(&out[at..at + seg.len()]);
            at += seg.len();
        }
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
        if let Some(owners) = &b.layer_wise {
            return self.all_gather_segments(b, owners, data, dp, scratch);
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

impl GradBuffer {
    /// All-gather of a layer-wise bucket: each rank's segments travel packed in its slot.
    fn all_gather_segments<T: Gathered>(
        &self,
        b: &Bucket,
        owners: &[Vec<Range<usize>>],
        data: &mut [T],
        dp: &mut dyn Communicator,
        scratch: &mut Vec<f32>,
    ) -> Result<(), CommError> {
        let s = b.shard_len(self.dp);
        let words = s.div_ceil(T::PER_WORD);
        let base = b.range.start;
        let packed: Vec<T> = owners[self.dp_rank]
            .iter()
            .flat_map(|seg| data[seg.start - base..seg.end - base].iter().copied())
            .collect();
        let mut mine = vec![0.0f32; words];
        T::pack(&packed, &mut mine);
        scratch.clear();
        scratch.resize(words * self.dp, 0.0);
        dp.all_gather(&mine, scratch)?;
        let mut theirs = packed;
        for (r, segs) in owners.iter().enumerate() {
            if r == self.dp_rank {
                continue;
            }
            let n: usize = segs.iter().map(Range::len).sum();
            theirs.clear();
            theirs.resize(n, T::default());
            T::unpack(&scratch[r * words..(r + 1) * words], &mut theirs);
            let mut at = 0;
            for seg in segs {
                data[seg.start - base..seg.end - base].copy_from_slice(&theirs[at..at + seg.len()]);
                at += seg.len();
            }
        }
        Ok(())
    }
}

/// Joins consecutive buckets until each holds at least 0.9 · `dp` times its largest whole
/// parameter (megatron-core's padding floor): a bucket with one matrix would otherwise travel
/// as `dp` shards of that matrix's length, all but one of them padding. The tied embedding's
/// bucket stays alone.
fn merge_for_whole(
    buckets: Vec<Bucket>,
    params: &Params,
    dp: usize,
    place: &impl Fn(&crate::ParamMeta) -> Placement,
) -> Vec<Bucket> {
    let largest = |b: &Bucket| -> usize {
        b.params
            .clone()
            .filter(|&p| matches!(place(&params.metas[p]), Placement::Whole { .. }))
            .map(|p| params.metas[p].numel)
            .max()
            .unwrap_or(0)
    };
    let alone = |b: &Bucket| b.params.clone().any(|p| params.metas[p].shared);
    let mut out: Vec<Bucket> = Vec::with_capacity(buckets.len());
    for b in buckets {
        match out.last_mut() {
            // Buckets run backwards through the buffer: `b` may sit just before the last one
            // (or with another group's parameters between them, then they stay apart).
            Some(last)
                if b.params.end == last.params.start
                    && !alone(last)
                    && !alone(&b)
                    && (last.range.len() as f64) < 0.9 * (dp * largest(last)) as f64 =>
            {
                last.range.start = b.range.start;
                last.params.start = b.params.start;
            }
            _ => out.push(b),
        }
    }
    out
}

/// How many split elements each rank takes so that the shards, `len` long before, come out as
/// even as possible: the shortest are raised to a common level, the remainder going to the
/// lowest ranks at that level.
fn water_fill(len: &[usize], total: usize) -> Vec<usize> {
    let need = |level: usize| -> usize { len.iter().map(|&l| level.saturating_sub(l)).sum() };
    // The lowest level that absorbs every split element.
    let (mut lo, mut hi) = (0usize, len.iter().copied().max().unwrap_or(0) + total);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if need(mid) >= total {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let mut fill: Vec<usize> = len.iter().map(|&l| lo.saturating_sub(l)).collect();
    // Raising to `lo` may overshoot: take the excess back from the highest ranks at the level.
    let mut excess = fill.iter().sum::<usize>() - total;
    for f in fill.iter_mut().rev() {
        if excess == 0 {
            break;
        }
        if *f > 0 {
            *f -= 1;
            excess -= 1;
        }
    }
    fill
}

/// Joins segments that touch (sorted by start).
fn merge_adjacent(segs: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::with_capacity(segs.len());
    for s in segs.iter().filter(|s| !s.is_empty()) {
        match out.last_mut() {
            Some(last) if last.end == s.start => last.end = s.end,
            _ => out.push(s.clone()),
        }
    }
    out
}

/// What the parameter all-gather moves: f32 values, or 16-bit patterns two to an f32 word
/// (the collectives only copy words; no arithmetic touches them).
pub trait Gathered: Copy + Default {
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
