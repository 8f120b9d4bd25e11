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
use megatron_tensor::Tensor;

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
