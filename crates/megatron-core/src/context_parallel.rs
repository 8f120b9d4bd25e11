//! Context parallelism (megatron-core's `--context-parallel-size`): each sequence is cut into
//! `2C` chunks and rank `r` of the context-parallel group holds chunks `r` and `2C-1-r`, so
//! every rank gets an equal share of the causal attention's work (Megatron's
//! `get_batch_on_this_cp_rank`). Everything but attention is per token and runs on the local
//! chunks; attention sees the whole sequence through an all-to-all from sequence-split to
//! head-split and back (`--cp-comm-type a2a`, DeepSpeed-Ulysses).
//!
//! The row moves below are a fixed permutation of whole rows and column blocks (no
//! arithmetic), so they are written here with slice copies rather than as backend kernels.

use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::reduce::add_inplace;
use megatron_tensor::cpu::ring_attention::{
    add_kv_rows, attention_merge, block_doc_start, fuse_q_kv, kv_rows, split_q_kv_add, RingDims,
};
use megatron_tensor::cpu::{
    attention_backward, attention_forward, AttentionDims, AttentionMask, RngBlock,
};
use megatron_tensor::{RngKey, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `--cp-comm-type`: how attention sees the whole sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpCommType {
    /// Ring attention: keys and values pass around the ring (megatron-core's `p2p`).
    #[default]
    P2p,
    /// All-to-all to whole sequences of a share of the heads and back (Ulysses).
    A2a,
}

/// This rank's place in its context-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpLayout {
    pub rank: usize,
    pub size: usize,
}

impl CpLayout {
    /// Global chunk index of this rank's local chunk `k` (0 or 1).
    pub fn chunk(&self, k: usize) -> usize {
        self.chunk_of(self.rank, k)
    }

    /// Global chunk index of rank `r`'s local chunk `k`.
    pub fn chunk_of(&self, r: usize, k: usize) -> usize {
        if k == 0 {
            r
        } else {
            2 * self.size - 1 - r
        }
    }

    /// For each local row of a sequence of `t_local` rows: its position in the whole sequence.
    pub fn positions(&self, t_local: usize) -> Vec<usize> {
        let c = t_local / 2;
        (0..t_local)
            .map(|q| self.chunk(q / c) * c + q % c)
            .collect()
    }

    /// This rank's rows of `full` (`[b, t]`, row-major, any element type): per sequence its
    /// two chunks, in chunk order.
    pub fn batch_on_this_rank<T: Copy>(&self, full: &[T], b: usize, t: usize) -> Vec<T> {
        let c = t / (2 * self.size);
        let mut out = Vec::with_capacity(b * 2 * c);
        for s in 0..b {
            for k in 0..2 {
                let lo = s * t + self.chunk(k) * c;
                out.extend_from_slice(&full[lo..lo + c]);
            }
        }
        out
    }

    /// The inverse of [`CpLayout::batch_on_this_rank`] over the whole group: whole sequences
    /// (`[b, t_local * size]`) from `all`, every rank's rows (`[size, b, t_local]`, rank order,
    /// as an all-gather returns them).
    pub fn batch_from_ranks<T: Copy + Default>(
        &self,
        all: &[T],
        b: usize,
        t_local: usize,
    ) -> Vec<T> {
        let (n, t) = (b * t_local, t_local * self.size);
        assert_eq!(all.len(), n * self.size);
        let mut full = vec![T::default(); b * t];
        for r in 0..self.size {
            let positions = CpLayout {
                rank: r,
                size: self.size,
            }
            .positions(t_local);
            for s in 0..b {
                for (q, &p) in positions.iter().enumerate() {
                    full[s * t + p] = all[r * n + s * t_local + q];
                }
            }
        }
        full
    }
}

/// This rank's rows `lo..hi` (of sequences of `t_local` rows) as runs that are consecutive in
/// the micro-batch of whole sequences: (first local row, rows, its row in the micro-batch).
/// Dropout masks are numbered by micro-batch element, so each run draws the masks one rank
/// would (one run without context parallelism).
pub fn row_runs(lo: usize, hi: usize, t_local: usize, cp: CpLayout) -> Vec<(usize, usize, usize)> {
    if cp.size == 1 {
        return vec![(lo, hi - lo, lo)];
    }
    let c = t_local / 2;
    let t = t_local * cp.size;
    let mut runs = Vec::new();
    let mut r = lo;
    while r < hi {
        let (s, q) = (r / t_local, r % t_local);
        let end = (r - q % c + c).min(hi);
        runs.push((r, end - r, s * t + cp.chunk(q / c) * c + q % c));
        r = end;
    }
    runs
}

/// [`row_runs`] of rows of `h` elements: (element range in this rank's rows `lo..hi`, element
/// offset in the micro-batch) — where dropout masks are drawn from.
pub fn element_runs(
    lo: usize,
    hi: usize,
    t_local: usize,
    cp: CpLayout,
    h: usize,
) -> Vec<(std::ops::Range<usize>, u64)> {
    row_runs(lo, hi, t_local, cp)
        .into_iter()
        .map(|(r, n, g)| ((r - lo) * h..(r - lo + n) * h, (g * h) as u64))
        .collect()
}

/// Rows of each source rank's local layout mapped to the whole sequence: for rank `i`,
/// sequence `s`, local row `q`: (row in `i`'s local buffer, row in the whole sequence).
fn row_pairs(
    cp: CpLayout,
    b: usize,
    t_local: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let c = t_local / 2;
    let t = t_local * cp.size;
    (0..cp.size).flat_map(move |i| {
        (0..b).flat_map(move |s| {
            (0..t_local).map(move |q| {
                let whole = s * t + cp.chunk_of(i, q / c) * c + q % c;
                (i, s * t_local + q, whole)
            })
        })
    })
}

/// `x` (`[b * t_local, w]`, this rank's chunks, every head) to `[b * t, w / C]`: the whole
/// sequence, this rank's block of `w / C` columns (its heads or query groups).
pub fn sequence_to_heads(
    x: &Tensor,
    b: usize,
    cp: CpLayout,
    comm: &mut dyn Communicator,
) -> Result<Tensor, CommError> {
    let (n, w) = (x.shape()[0], x.shape()[1]);
    let (p, wc) = (cp.size, w / cp.size);
    let t_local = n / b;
    let mut send = vec![0.0f32; n * w];
    for j in 0..p {
        for row in 0..n {
            let dst = (j * n + row) * wc;
            send[dst..dst + wc]
                .copy_from_slice(&x.data()[row * w + j * wc..row * w + (j + 1) * wc]);
        }
    }
    let mut recv = vec![0.0f32; n * w];
    comm.all_to_all(&send, &mut recv)?;
    drop(send);
    let mut out = Tensor::for_overwrite(&[n * p, wc]);
    for (i, local, whole) in row_pairs(cp, b, t_local) {
        let src = (i * n + local) * wc;
        out.data_mut()[whole * wc..(whole + 1) * wc].copy_from_slice(&recv[src..src + wc]);
    }
    Ok(out)
}

/// The inverse of [`sequence_to_heads`]: `y` (`[b * t, wc]`, the whole sequence, this rank's
/// columns) to `[b * t_local, wc * C]` (this rank's chunks, every rank's columns in order).
pub fn heads_to_sequence(
    y: &Tensor,
    b: usize,
    cp: CpLayout,
    comm: &mut dyn Communicator,
) -> Result<Tensor, CommError> {
    let wc = y.shape()[1];
    let p = cp.size;
    let n = y.shape()[0] / p;
    let t_local = n / b;
    let mut send = vec![0.0f32; n * p * wc];
    for (j, local, whole) in row_pairs(cp, b, t_local) {
        let dst = (j * n + local) * wc;
        send[dst..dst + wc].copy_from_slice(&y.data()[whole * wc..(whole + 1) * wc]);
    }
    let mut recv = vec![0.0f32; n * p * wc];
    comm.all_to_all(&send, &mut recv)?;
    drop(send);
    let w = wc * p;
    let mut out = Tensor::for_overwrite(&[n, w]);
    for i in 0..p {
        for row in 0..n {
            let src = (i * n + row) * wc;
            out.data_mut()[row * w + i * wc..row * w + (i + 1) * wc]
                .copy_from_slice(&recv[src..src + wc]);
        }
    }
    Ok(out)
}

/// Rows of local chunk `k` of every sequence (`x` is `[b * t_local, w]`): `[b * c, w]`.
fn chunk_rows(x: &[f32], b: usize, t_local: usize, w: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; b * (t_local / 2) * w];
    chunk_rows_into(&mut out, x, b, t_local, w, k);
    out
}

/// [`chunk_rows`] into a buffer the ring reuses from block to block.
fn chunk_rows_into(out: &mut [f32], x: &[f32], b: usize, t_local: usize, w: usize, k: usize) {
    let c = t_local / 2;
    for s in 0..b {
        let lo = (s * t_local + k * c) * w;
        out[s * c * w..(s + 1) * c * w].copy_from_slice(&x[lo..lo + c * w]);
    }
}

/// Writes `[b * c, w]` rows back as local chunk `k` of every sequence.
fn set_chunk_rows(x: &mut [f32], rows: &[f32], b: usize, t_local: usize, w: usize, k: usize) {
    let c = t_local / 2;
    for s in 0..b {
        let lo = (s * t_local + k * c) * w;
        x[lo..lo + c * w].copy_from_slice(&rows[s * c * w..(s + 1) * c * w]);
    }
}

/// The log-sum-exp of local chunk `k` (`lse` is `[b, heads, t_local]`): `[b, heads, c]`.
fn chunk_lse(lse: &[f32], b: usize, heads: usize, t_local: usize, k: usize) -> Vec<f32> {
    let c = t_local / 2;
    (0..b * heads)
        .flat_map(|sh| {
            lse[sh * t_local + k * c..sh * t_local + (k + 1) * c]
                .iter()
                .copied()
        })
        .collect()
}

fn set_chunk_lse(lse: &mut [f32], part: &[f32], b: usize, heads: usize, t_local: usize, k: usize) {
    let c = t_local / 2;
    for sh in 0..b * heads {
        lse[sh * t_local + k * c..sh * t_local + (k + 1) * c]
            .copy_from_slice(&part[sh * c..(sh + 1) * c]);
    }
}

/// The (query chunk, key/value chunk, causal) blocks rank `cp.rank` computes with the keys and
/// values of rank `src` (local chunk numbers): with its own, both diagonal blocks (causal)
/// and its late queries against its early keys; with an earlier rank's, both query chunks
/// against that rank's early chunk ("half KV"); with a later rank's, its late query chunk
/// against both of that rank's chunks ("half Q"). Every other block is masked out entirely.
fn ring_blocks(cp: CpLayout, src: usize) -> &'static [(usize, usize, bool)] {
    if src == cp.rank {
        &[(0, 0, true), (1, 1, true), (1, 0, false)]
    } else if src < cp.rank {
        &[(0, 0, false), (1, 0, false)]
    } else {
        &[(1, 0, false), (1, 1, false)]
    }
}

const RING_TAG: u64 = 0x5249_4e47;
/// Backward's key/value gradients travelling around the ring.
const RING_GRAD_TAG: u64 = 0x5249_4e48;

/// Document starts (`--reset-attention-mask`) of the block of rank `q.0`'s chunk `q.1` of
/// queries against rank `k.0`'s chunk `k.1` of keys, in the block's key positions.
fn block_starts(
    doc_start: Option<&[u32]>,
    b: usize,
    c: usize,
    cp: CpLayout,
    q: (usize, usize),
    k: (usize, usize),
) -> Option<Vec<u32>> {
    let starts = doc_start?;
    let mut out = vec![0u32; b * c];
    let (q0, k0) = (cp.chunk_of(q.0, q.1) * c, cp.chunk_of(k.0, k.1) * c);
    block_doc_start(&mut out, starts, 2 * cp.size * c, q0, k0, c);
    Some(out)
}

/// The sizes ring attention works in: `n` local rows of `w` fused QKV columns, `t_local` rows
/// per sequence in two chunks of `c`, `ow` output columns, and the blocks' kernel shapes.
struct RingShape {
    n: usize,
    w: usize,
    t_local: usize,
    c: usize,
    ow: usize,
    rd: RingDims,
}

impl RingShape {
    fn of(qkv: &Tensor, b: usize, d: AttentionDims) -> Self {
        let (n, w) = (qkv.shape()[0], qkv.shape()[1]);
        let t_local = n / b;
        let c = t_local / 2;
        RingShape {
            n,
            w,
            t_local,
            c,
            ow: d.heads * d.head_dim,
            rd: RingDims {
                b,
                rows: c,
                heads: d.heads,
                groups: d.groups,
                head_dim: d.head_dim,
            },
        }
    }
}

/// The kernel's dimensions for the block of rank `q.0`'s local chunk `q.1` of queries against
/// rank `k.0`'s chunk `k.1` of keys: `c` rows each, dropout masks numbered by the blocks'
/// places in the whole sequence (the masks one rank draws).
fn block_dims(
    d: AttentionDims,
    b: usize,
    c: usize,
    causal: bool,
    cp: CpLayout,
    q: (usize, usize),
    k: (usize, usize),
) -> AttentionDims {
    AttentionDims {
        b,
        t: c,
        causal,
        rng_block: Some(RngBlock {
            q0: cp.chunk_of(q.0, q.1) * c,
            k0: cp.chunk_of(k.0, k.1) * c,
            t: 2 * cp.size * c,
        }),
        ..d
    }
}

/// Sends `buf` to the next rank of the ring and receives the previous rank's into `got` (even
/// ranks send first, odd ranks receive first, so blocking sends cannot deadlock).
fn exchange(
    buf: &[f32],
    got: &mut [f32],
    cp: CpLayout,
    comm: &mut dyn Communicator,
    tag: u64,
) -> Result<(), CommError> {
    let (next, prev) = ((cp.rank + 1) % cp.size, (cp.rank + cp.size - 1) % cp.size);
    if cp.rank.is_multiple_of(2) {
        comm.send(buf, next, tag)?;
        comm.recv(got, prev, tag)?;
    } else {
        comm.recv(got, prev, tag)?;
        comm.send(buf, next, tag)?;
    }
    Ok(())
}

/// Nanoseconds the ring exchanges took on their thread, and nanoseconds compute then waited
/// for them (the part of the exchange not hidden), summed over every rank of the process.
static RING_EXCHANGE_NS: AtomicU64 = AtomicU64::new(0);
static RING_WAIT_NS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The most bytes travelling on this rank's ring at once: keys and values leaving and
    /// arriving, and in backward their gradient accumulators leaving and arriving.
    static RING_PEAK_BYTES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// [`RING_PEAK_BYTES`] since the last call; resets it.
pub fn take_ring_peak_bytes() -> usize {
    RING_PEAK_BYTES.with(|c| c.replace(0))
}

/// (exchange time, time compute waited for it) since the last call, and resets both.
pub fn take_ring_stats() -> (Duration, Duration) {
    let e = RING_EXCHANGE_NS.swap(0, Ordering::Relaxed);
    let w = RING_WAIT_NS.swap(0, Ordering::Relaxed);
    (Duration::from_nanos(e), Duration::from_nanos(w))
}

/// One step of the ring: `work` runs on the keys and values in hand while, when another step
/// follows, they travel on to the next rank on a communication thread (the exchange hides
/// behind the blocks' compute). Returns `work`'s result and the previous rank's keys and values.
fn ring_step<R>(
    kv: Vec<f32>,
    more: bool,
    cp: CpLayout,
    comm: &mut dyn Communicator,
    work: impl FnOnce(&[f32]) -> R,
) -> Result<(R, Vec<f32>), CommError> {
    let (r, arrived) = ring_step_with(kv, more, None, cp, comm, work)?;
    Ok((r, arrived.kv))
}

/// What a backward ring step hands on: the keys and values for the next step and the previous
/// rank's key/value gradient accumulator.
struct Arrived {
    kv: Vec<f32>,
    grads: Option<Vec<f32>>,
}

/// [`ring_step`] that also passes `acc` (backward's key/value gradients accumulated so far) to
/// the next rank on the same thread and returns the previous rank's.
fn ring_step_with<R>(
    kv: Vec<f32>,
    more: bool,
    acc: Option<&[f32]>,
    cp: CpLayout,
    comm: &mut dyn Communicator,
    work: impl FnOnce(&[f32]) -> R,
) -> Result<(R, Arrived), CommError> {
    if !more && acc.is_none() {
        let r = work(&kv);
        return Ok((r, Arrived { kv, grads: None }));
    }
    let (r, got, got_acc) = std::thread::scope(|s| {
        let held = &kv;
        let travelling = if more { 2 * held.len() } else { 0 } + 2 * acc.map_or(0, |a| a.len());
        RING_PEAK_BYTES.with(|c| c.set(c.get().max(travelling * 4)));
        let slot = megatron_tensor::alloc::current_slot();
        let exchanging = s.spawn(move || -> Result<_, CommError> {
            megatron_tensor::alloc::set_slot(slot);
            let started = Instant::now();
            let mut got = Vec::new();
            if more {
                got = vec![0.0f32; held.len()];
                exchange(held, &mut got, cp, comm, RING_TAG)?;
            }
            let got_acc = match acc {
                Some(a) => {
                    let mut g = vec![0.0f32; a.len()];
                    exchange(a, &mut g, cp, comm, RING_GRAD_TAG)?;
                    Some(g)
                }
                None => None,
            };
            let ns = started.elapsed().as_nanos() as u64;
            RING_EXCHANGE_NS.fetch_add(ns, Ordering::Relaxed);
            Ok((got, got_acc))
        });
        let r = work(held);
        let waiting = Instant::now();
        let (got, got_acc) = exchanging
            .join()
            .expect("the ring exchange thread does not panic")?;
        let ns = waiting.elapsed().as_nanos() as u64;
        RING_WAIT_NS.fetch_add(ns, Ordering::Relaxed);
        Ok::<_, CommError>((r, got, got_acc))
    })?;
    let kv = if more { got } else { kv };
    Ok((r, Arrived { kv, grads: got_acc }))
}

/// Ring attention forward (`--cp-comm-type p2p`): this rank's queries (`qkv`, `[b * t_local,
/// w]`, its two chunks of every sequence) against every rank's keys and values, which pass
/// around the ring one rank's at a time; partial outputs merged by log-sum-exp. `d` gives the
/// heads (its `t` and `causal` are set per block). Returns the output `[b * t_local, heads *
/// head_dim]` and log-sum-exp `[b, heads, t_local]`, as the whole-sequence kernel would.
pub fn ring_attention_forward(
    qkv: &Tensor,
    b: usize,
    cp: CpLayout,
    comm: &mut dyn Communicator,
    d: AttentionDims,
    doc_start: Option<&[u32]>,
    key: RngKey,
) -> Result<(Tensor, Tensor), CommError> {
    let RingShape {
        n,
        w,
        t_local,
        c,
        ow,
        rd,
    } = RingShape::of(qkv, b, d);
    let q: [Vec<f32>; 2] = [0, 1].map(|k| chunk_rows(qkv.data(), b, t_local, w, k));
    let mut acc: [Option<(Vec<f32>, Vec<f32>)>; 2] = [None, None];
    // Only keys and values travel.
    let kvw = rd.kv_row();
    let mut kv = vec![0.0f32; n * kvw];
    kv_rows(&mut kv, qkv.data(), rd);
    // One block's buffers, reused by every block of every step.
    let mut kvc = vec![0.0f32; b * c * kvw];
    let mut pair = vec![0.0f32; b * c * w];
    let (mut o, mut l) = (vec![0.0f32; b * c * ow], vec![0.0f32; b * d.heads * c]);
    for step in 0..cp.size {
        let src = (cp.rank + cp.size - step) % cp.size;
        let (acc, kvc, pair, o, l) = (&mut acc, &mut kvc, &mut pair, &mut o, &mut l);
        let ((), next) = ring_step(kv, step + 1 < cp.size, cp, comm, |kv| {
            for &(kq, kk, causal) in ring_blocks(cp, src) {
                chunk_rows_into(kvc, kv, b, t_local, kvw, kk);
                fuse_q_kv(pair, &q[kq], kvc, rd);
                let bd = block_dims(d, b, c, causal, cp, (cp.rank, kq), (src, kk));
                let starts = block_starts(doc_start, b, c, cp, (cp.rank, kq), (src, kk));
                let m = starts
                    .as_deref()
                    .map_or_else(AttentionMask::default, AttentionMask::documents);
                attention_forward(o, l, &pair[..], m, bd, key);
                match &mut acc[kq] {
                    None => acc[kq] = Some((o.clone(), l.clone())),
                    Some((ao, al)) => attention_merge(ao, al, o, l, rd),
                }
            }
        })?;
        kv = next;
    }
    let mut out = Tensor::for_overwrite(&[n, ow]);
    let mut lse = Tensor::for_overwrite(&[b, d.heads, t_local]);
    for (k, a) in acc.iter().enumerate() {
        let (o, l) = a
            .as_ref()
            .expect("every query chunk meets its own diagonal block");
        set_chunk_rows(out.data_mut(), o, b, t_local, ow, k);
        set_chunk_lse(lse.data_mut(), l, b, d.heads, t_local, k);
    }
    Ok((out, lse))
}

/// Ring attention backward: the same blocks again, each through the kernel's backward with the
/// merged output and log-sum-exp; query gradients stay here, key/value gradients are returned
/// to the rank that holds those keys and values (one all-to-all at the end). Returns `dqkv`.
#[allow(clippy::too_many_arguments)]
pub fn ring_attention_backward(
    dout: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    qkv: &Tensor,
    b: usize,
    cp: CpLayout,
    comm: &mut dyn Communicator,
    d: AttentionDims,
    doc_start: Option<&[u32]>,
    key: RngKey,
) -> Result<Tensor, CommError> {
    let RingShape {
        n,
        w,
        t_local,
        c,
        ow,
        rd,
    } = RingShape::of(qkv, b, d);
    let q: [Vec<f32>; 2] = [0, 1].map(|k| chunk_rows(qkv.data(), b, t_local, w, k));
    let dq_in: [Vec<f32>; 2] = [0, 1].map(|k| chunk_rows(dout.data(), b, t_local, ow, k));
    let o: [Vec<f32>; 2] = [0, 1].map(|k| chunk_rows(out.data(), b, t_local, ow, k));
    let l: [Vec<f32>; 2] = [0, 1].map(|k| chunk_lse(lse.data(), b, d.heads, t_local, k));
    let mut dq: [Vec<f32>; 2] = [vec![0.0f32; b * c * w], vec![0.0f32; b * c * w]];
    // Only keys and values travel, and their gradients travel with them (megatron-core /
    // TransformerEngine): the accumulator for the keys and values in hand at a step arrives from
    // the previous rank (which used them one step earlier) while this step's blocks compute
    // their share into `local`; one last exchange brings each rank its own chunks' gradients.
    let kvw = rd.kv_row();
    let chunk = b * c * kvw;
    let mut kv = vec![0.0f32; n * kvw];
    kv_rows(&mut kv, qkv.data(), rd);
    // One block's buffers, reused by every block of every step.
    let mut kvc = vec![0.0f32; chunk];
    let (mut pair, mut dpair) = (vec![0.0f32; b * c * w], vec![0.0f32; b * c * w]);
    let mut local = vec![0.0f32; 2 * chunk];
    let mut acc: Option<Vec<f32>> = None;
    for step in 0..cp.size {
        let src = (cp.rank + cp.size - step) % cp.size;
        let (dq, kvc, pair, dpair, local) = (&mut dq, &mut kvc, &mut pair, &mut dpair, &mut local);
        local.fill(0.0);
        let more = step + 1 < cp.size;
        let (_, arrived) = ring_step_with(kv, more, acc.as_deref(), cp, comm, |kv| {
            for &(kq, kk, causal) in ring_blocks(cp, src) {
                chunk_rows_into(kvc, kv, b, t_local, kvw, kk);
                fuse_q_kv(pair, &q[kq], kvc, rd);
                let bd = block_dims(d, b, c, causal, cp, (cp.rank, kq), (src, kk));
                let starts = block_starts(doc_start, b, c, cp, (cp.rank, kq), (src, kk));
                let m = starts
                    .as_deref()
                    .map_or_else(AttentionMask::default, AttentionMask::documents);
                attention_backward(dpair, &dq_in[kq], &o[kq], &l[kq], &pair[..], m, bd, key);
                split_q_kv_add(
                    &mut dq[kq],
                    &mut local[kk * chunk..(kk + 1) * chunk],
                    dpair,
                    rd,
                );
            }
        })?;
        kv = arrived.kv;
        acc = Some(match arrived.grads {
            Some(mut a) => {
                add_inplace(&mut a, local);
                a
            }
            None => local.clone(),
        });
    }
    // The accumulator in hand belongs to the next rank; this rank's arrives from the previous.
    let last = acc.expect("at least one ring step");
    let mut own = vec![0.0f32; last.len()];
    exchange(&last, &mut own, cp, comm, RING_GRAD_TAG)?;
    let mut dqkv = Tensor::zeros(&[n, w]);
    for (k, dqk) in dq.iter().enumerate() {
        // Queries' gradients from here, keys' and values' summed around the ring.
        let mut rows = dqk.clone();
        add_kv_rows(&mut rows, &own[k * chunk..(k + 1) * chunk], rd);
        set_chunk_rows(dqkv.data_mut(), &rows, b, t_local, w, k);
    }
    Ok(dqkv)
}
