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
//! shards' lengths.
//!
//! Either way a collective packs each rank's segments one after another into its slot (padded
//! to the longest shard), so a reduce-scatter hands every rank exactly the gradients it owns;
//! slots travel in chunks ([`COLLECTIVE_CHUNK_ELEMENTS`]) so the staging stays small.

use crate::params::{Grads, Params};
use megatron_comm::{CommError, Communicator, ReduceOp};
use std::borrow::Cow;
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

    /// Every DP rank's segments, in the order they travel in its slot of a collective.
    pub fn owners(&self, dp: usize) -> Cow<'_, [Vec<Range<usize>>]> {
        match &self.layer_wise {
            Some(owners) => Cow::Borrowed(owners),
            None => Cow::Owned((0..dp).map(|r| self.segments(dp, r)).collect()),
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
    /// Elements of one reduce-scatter or all-gather call over every rank's slot
    /// ([`COLLECTIVE_CHUNK_ELEMENTS`]; tests set it small to cross many chunk edges).
    pub collective_chunk: usize,
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
            collective_chunk: COLLECTIVE_CHUNK_ELEMENTS,
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
    /// all-gather use: one chunk of every rank's slot plus this rank's (see
    /// [`COLLECTIVE_CHUNK_ELEMENTS`]); 0 without it.
    pub fn scratch_elements(&self) -> usize {
        if self.dp == 1 || !self.distributed {
            return 0;
        }
        self.buckets
            .iter()
            .map(|b| (self.dp + 1) * self.chunk_len(b))
            .max()
            .unwrap_or(0)
    }

    /// Elements per rank slot of one collective call on bucket `b`.
    fn chunk_len(&self, b: &Bucket) -> usize {
        chunk_len(b.shard_len(self.dp), self.dp, self.collective_chunk)
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
        let owners = b.owners(self.dp);
        let (s, base) = (b.shard_len(self.dp), b.range.start);
        let k = self.chunk_len(b);
        let (send, recv) = staging(scratch, (self.dp + 1) * k).split_at_mut(self.dp * k);
        let mut lo = 0;
        while lo < s {
            let hi = (lo + k).min(s);
            let n = hi - lo;
            let send = &mut send[..self.dp * n];
            for (slot, segs) in send.chunks_exact_mut(n).zip(owners.iter()) {
                let mut at = 0;
                for g in slot_ranges(segs, lo, hi) {
                    slot[at..at + g.len()].copy_from_slice(&data[g.start - base..g.end - base]);
                    at += g.len();
                }
                slot[at..].fill(0.0);
            }
            dp.reduce_scatter(send, &mut recv[..n], ReduceOp::Avg)?;
            let mut at = 0;
            for g in slot_ranges(&owners[self.dp_rank], lo, hi) {
                data[g.start - base..g.end - base].copy_from_slice(&recv[at..at + g.len()]);
                at += g.len();
            }
            lo = hi;
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
        let owners = b.owners(self.dp);
        let (s, base) = (b.shard_len(self.dp), b.range.start);
        let k = self.chunk_len(b);
        let per = T::PER_WORD;
        let kw = k.div_ceil(per);
        let (recv, mine) = staging(scratch, (self.dp + 1) * kw).split_at_mut(self.dp * kw);
        let mut lo = 0;
        while lo < s {
            let hi = (lo + k).min(s);
            let w = (hi - lo).div_ceil(per);
            let own: &mut [T] = bytemuck::cast_slice_mut(&mut mine[..w]);
            let mut at = 0;
            for g in slot_ranges(&owners[self.dp_rank], lo, hi) {
                own[at..at + g.len()].copy_from_slice(&data[g.start - base..g.end - base]);
                at += g.len();
            }
            own[at..].fill(T::zeroed());
            let recv = &mut recv[..self.dp * w];
            dp.all_gather(&mine[..w], recv)?;
            for (r, (slot, segs)) in recv.chunks_exact_mut(w).zip(owners.iter()).enumerate() {
                if r == self.dp_rank {
                    continue;
                }
                let theirs: &[T] = bytemuck::cast_slice(slot);
                let mut at = 0;
                for g in slot_ranges(segs, lo, hi) {
                    data[g.start - base..g.end - base].copy_from_slice(&theirs[at..at + g.len()]);
                    at += g.len();
                }
            }
            lo = hi;
        }
        Ok(())
    }
}

/// Elements of one collective call over all ranks' slots: the reduce-scatter and all-gather of
/// a bucket travel in chunks of this many, so their staging is bounded (16 MiB) instead of a
/// copy of the largest bucket (Megatron's default bucket is 40 M elements; the MPI backend
/// stages each call once more). Every element is reduced in the same rank order whatever the
/// chunk, so results do not depend on it.
pub const COLLECTIVE_CHUNK_ELEMENTS: usize = 1 << 22;

/// Elements per rank slot of one chunk, `total` elements over `dp` slots, for shards
/// `shard_len` long: even (16-bit patterns pair up in words).
fn chunk_len(shard_len: usize, dp: usize, total: usize) -> usize {
    let k = (total / dp.max(1)).max(2) & !1;
    k.min(shard_len).max(1)
}

/// The staging elements ([`GradBuffer::scratch_elements`]) of a bucket whose shards are
/// `shard_len` long: a chunk of every rank's slot and the chunk this rank receives or sends.
pub fn collective_scratch_elements(shard_len: usize, dp: usize) -> usize {
    if dp <= 1 {
        return 0;
    }
    (dp + 1) * chunk_len(shard_len, dp, COLLECTIVE_CHUNK_ELEMENTS)
}

/// `scratch` as `n` elements, allocated exactly (not the doubling of amortized growth).
fn staging(scratch: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if scratch.len() < n {
        scratch.reserve_exact(n - scratch.len());
        scratch.resize(n, 0.0);
    }
    &mut scratch[..n]
}

/// The flat-buffer ranges at positions `lo..hi` of a slot that packs `segs` one after another.
fn slot_ranges(
    segs: &[Range<usize>],
    lo: usize,
    hi: usize,
) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut at = 0;
    segs.iter().filter_map(move |g| {
        let (a, b) = (at, at + g.len());
        at = b;
        let (x, y) = (lo.max(a), hi.min(b));
        (x < y).then(|| g.start + (x - a)..g.start + (y - a))
    })
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
pub trait Gathered: bytemuck::Pod {
    const PER_WORD: usize = 4 / std::mem::size_of::<Self>();
}

impl Gathered for f32 {}

impl Gathered for u16 {}
