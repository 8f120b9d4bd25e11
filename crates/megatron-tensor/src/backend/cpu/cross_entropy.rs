//! Output layer + softmax cross-entropy fused and chunked over tokens.
//!
//! Only a `[chunk_rows, vocab]` tile of logits exists at a time (never `[tokens, vocab]`). Because
//! the gradient of the loss with respect to each token's loss (`dloss`) is known before the
//! forward pass (mean over the micro-batch's unmasked tokens), the same tile is turned into
//! `dlogits` in place and consumed by the two backward GEMMs right away: three GEMMs, like an
//! unfused layer, and no recompute (llm.c's `fused_classifier`, Liger's fused linear CE).

use super::cast::{round_to_half_inplace, Half};
use super::matmul::{
    bias_backward, matmul, matmul_on_rounded, matmul_operands, matmul_precision, matmul_prepacked,
    prepack_b, rounded_operand, MatmulDims, Operand, RoundedOperand,
};
use super::matmul_packed::PackedB;
use super::simd::{exp, multiversion};
use half::bf16;
use rayon::prelude::*;

/// Target id that contributes neither loss nor gradient.
pub const IGNORE_INDEX: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub struct ClassifierDims {
    /// Tokens.
    pub n: usize,
    /// Hidden size.
    pub c: usize,
    /// (Padded) vocabulary size: rows of the output weight.
    pub v: usize,
    /// Tokens per logits tile.
    pub chunk_rows: usize,
}

/// The output layer's bias over the weight's vocabulary rows (BERT's `output_layer.bias`) and,
/// with gradients, where its gradient accumulates.
pub struct ClassifierBias<'a> {
    pub bias: &'a [f32],
    pub dbias: Option<&'a mut [f32]>,
}

impl ClassifierBias<'_> {
    /// Adds the bias to every logits row of `tile`.
    fn add(&self, tile: &mut [f32]) {
        let v = self.bias.len();
        tile.par_chunks_mut(v).for_each(|row| {
            for (z, b) in row.iter_mut().zip(self.bias) {
                *z += b;
            }
        });
    }

    /// Accumulates the bias gradient of a tile already turned into `dlogits`.
    fn backward(&mut self, dlogits: &[f32]) {
        if let Some(db) = self.dbias.as_deref_mut() {
            let v = db.len();
            bias_backward(db, dlogits, dlogits.len() / v, v);
        }
    }
}

/// `losses[i] = logsumexp(x_i W^T + b) - (x_i W^T + b)[target_i]` (0 for `IGNORE_INDEX`; the
/// bias `b` optional).
/// With `grads = Some((dx, dweight))`: writes `dx = dlogits · W` and accumulates
/// `dweight += dlogits^T · x`, where `dlogits_i = (softmax_i - onehot_i) · dloss[i]`.
#[allow(clippy::type_complexity)]
#[allow(clippy::too_many_arguments)]
pub fn fused_classifier(
    losses: &mut [f32],
    mut grads: Option<(&mut [f32], &mut [f32])>,
    x: &[f32],
    weight: Operand<'_>,
    mut bias: Option<ClassifierBias>,
    targets: &[u32],
    dloss: &[f32],
    d: ClassifierDims,
) {
    let ClassifierDims { n, c, v, .. } = d;
    assert_eq!(x.len(), n * c);
    assert_eq!(weight.len(), v * c);
    assert_eq!(targets.len(), n);
    assert_eq!(losses.len(), n);
    let weight = ClassifierWeight::new(weight, (n, c, v), grads.is_some());
    let (half, xh) = classifier_input(x);
    let x = &*xh;
    let rows = d.chunk_rows.max(1).min(n.max(1));
    let mut logits = crate::pool::take_any(rows * v);
    let mut backward = ClassifierBackward::new(&weight, (n, v, rows));
    let mut r0 = 0;
    while r0 < n {
        let nr = rows.min(n - r0);
        let tile = &mut logits[..nr * v];
        let xr = &x[r0 * c..(r0 + nr) * c];
        logits_matmul(tile, xr, &weight, (nr, c, v), half);
        if let Some(b) = &bias {
            b.add(tile);
        }
        let want_grad = grads.is_some();
        tile.par_chunks_mut(v)
            .zip(losses[r0..r0 + nr].par_iter_mut())
            .enumerate()
            .for_each(|(i, (row, loss))| {
                let tgt = targets[r0 + i];
                if tgt == IGNORE_INDEX {
                    *loss = 0.0;
                    if want_grad {
                        row.fill(0.0);
                    }
                    return;
                }
                let g = want_grad.then(|| dloss[r0 + i]);
                *loss = softmax_xent_row(row, tgt as usize, g);
            });
        if let Some((dx, dw)) = grads.as_mut() {
            if let Some(b) = bias.as_mut() {
                b.backward(tile);
            }
            backward.tile((dx, dw), tile, x, &weight, (r0, nr, n, c, v), half);
        }
        r0 += nr;
    }
    crate::pool::give_back(logits);
    backward.finish();
}

/// Bytes of bf16 `dlogits` the output layer keeps for its backward GEMMs under a packed bf16
/// kernel (a gradient chunk of whole tiles: two 256-token tiles of GPT-2's vocabulary). The
/// packed copy of a chunk for the weight gradient takes as much again. GPT M on AMD Zen 5 ran
/// at the same step time with 64, 128 and 256 MiB chunks (within 3 %) and peak RSS 3.35,
/// 3.45 and 3.65 GB (BENCHMARKS.md).
const GRAD_CHUNK_BYTES: usize = 64 << 20;

thread_local! {
    /// The gradient chunk's buffer, kept between calls (fresh pages for it every micro-batch
    /// cost more than the conversion).
    static DLOGITS: std::cell::RefCell<Vec<bf16>> = const { std::cell::RefCell::new(Vec::new()) };
    static GRAD_CHUNK: std::cell::Cell<usize> = const { std::cell::Cell::new(GRAD_CHUNK_BYTES) };
}

/// Sets this thread's bytes of bf16 `dlogits` per gradient chunk (default 64 MiB; at least one
/// tile is always kept): a memory bound for huge vocabularies, and how tests make several
/// chunks of a tiny model.
pub fn set_classifier_gradient_chunk_bytes(bytes: usize) {
    GRAD_CHUNK.with(|c| c.set(bytes));
}

/// Tokens per gradient chunk of the output layer under a packed bf16 kernel, for `n` tokens
/// in logits tiles of `rows` over `v` vocabulary rows: this thread keeps a bf16 buffer of
/// that many rows of `v` between calls, and the weight gradient's product packs as much again.
pub fn classifier_gradient_chunk_rows(n: usize, v: usize, rows: usize) -> usize {
    if n == 0 || v == 0 {
        return 0;
    }
    let rows = rows.max(1).min(n);
    let tiles = (GRAD_CHUNK.with(|c| c.get()) / (2 * v * rows)).max(1);
    (tiles * rows).min(n)
}

/// How the output layer's backward GEMMs run: per logits tile, or, under a packed bf16 kernel,
/// once per gradient chunk of several tiles on their bf16 `dlogits`. Per tile, `dW += dlogitsᵀ
/// · x` reads and writes all of dW in f32 (vocabulary x hidden: 154 MB for GPT-2) for every
/// 256 tokens, which made the output layer memory-bound; a chunk pays that once. The packed
/// kernels read the bf16 values the per-tile path would have rounded to, and carry each block's
/// f32 sum through k blocks exactly, so only blocks on a ragged edge sum in another order.
enum ClassifierBackward {
    PerTile,
    Chunked {
        dlogits: Vec<bf16>,
        /// Tokens per chunk (whole tiles), the first token of the chunk being filled, and how
        /// many it holds.
        cap: usize,
        start: usize,
        filled: usize,
    },
}

impl ClassifierBackward {
    fn new(weight: &ClassifierWeight, (n, v, rows): (usize, usize, usize)) -> Self {
        let chunked = matches!(
            weight,
            ClassifierWeight::Packed {
                backward: Some(_),
                ..
            }
        );
        if !chunked || n == 0 || v == 0 {
            return ClassifierBackward::PerTile;
        }
        let cap = classifier_gradient_chunk_rows(n, v, rows);
        let mut dlogits = DLOGITS.with(|b| std::mem::take(&mut *b.borrow_mut()));
        if dlogits.len() < cap * v {
            dlogits = vec![bf16::ZERO; cap * v];
        }
        ClassifierBackward::Chunked {
            dlogits,
            cap,
            start: 0,
            filled: 0,
        }
    }

    /// Takes the `dlogits` of tokens `r0..r0 + nr` (of `n`): their backward GEMMs run now
    /// (per tile) or when their chunk is full or the last tile is in.
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &mut self,
        (dx, dw): (&mut [f32], &mut [f32]),
        tile: &mut [f32],
        x: &[f32],
        weight: &ClassifierWeight,
        (r0, nr, n, c, v): (usize, usize, usize, usize, usize),
        half: Option<Half>,
    ) {
        let (
            ClassifierBackward::Chunked {
                dlogits,
                cap,
                start,
                filled,
            },
            ClassifierWeight::Packed {
                backward: Some(p), ..
            },
        ) = (self, weight)
        else {
            let ClassifierWeight::Values(w) = weight else {
                unreachable!("a packed weight with gradients goes by chunks");
            };
            return classifier_tile_backward(
                &mut dx[r0 * c..(r0 + nr) * c],
                dw,
                tile,
                (&x[r0 * c..(r0 + nr) * c], w),
                (nr, c, v),
                half,
            );
        };
        debug_assert_eq!(r0, *start + *filled);
        dlogits[*filled * v..(*filled + nr) * v]
            .par_chunks_mut(1 << 16)
            .zip(tile.par_chunks(1 << 16))
            .for_each(|(o, i)| super::cast::f32_to_bf16(o, i));
        *filled += nr;
        if *filled < *cap && r0 + nr < n {
            return;
        }
        let (t0, m) = (*start, *filled);
        let chunk = Operand::BF16(&dlogits[..m * v]);
        matmul_prepacked(
            &mut dx[t0 * c..(t0 + m) * c],
            chunk,
            p,
            MatmulDims::new(m, c, v),
        );
        let xs = Operand::F32(&x[t0 * c..(t0 + m) * c]);
        matmul_operands(dw, chunk, xs, MatmulDims::new(v, c, m).ta().acc());
        *start += m;
        *filled = 0;
    }

    /// Gives the chunk's buffer back to this thread.
    fn finish(self) {
        if let ClassifierBackward::Chunked { dlogits, .. } = self {
            DLOGITS.with(|b| *b.borrow_mut() = dlogits);
        }
    }
}

/// The two backward GEMMs of a logits tile turned into `dlogits`: `dx = dlogits · W` and
/// `dW += dlogits^T · x` (where the weight is not packed: a packed one goes by chunks).
fn classifier_tile_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dlogits: &mut [f32],
    (x, weight): (&[f32], &[f32]),
    (rows, c, v): (usize, usize, usize),
    half: Option<Half>,
) {
    if let Some(h) = half {
        dlogits
            .par_chunks_mut(1 << 16)
            .for_each(|t| round_to_half_inplace(t, h));
    }
    tile_matmul(dx, dlogits, weight, MatmulDims::new(rows, c, v), half);
    tile_matmul(dw, dlogits, x, MatmulDims::new(v, c, rows).ta().acc(), half);
}

/// The output weight as its products read it: packed once per call for the packed bf16
/// kernels (as the `b` of the logits `x · Wᵀ` and of the input gradient `dlogits · W`; a
/// `--bf16` weight packed from its 16-bit copy, never widened), or its values, under 16-bit
/// matmuls rounded once per call rather than once per tile (the output weight is the largest
/// operand in the model).
enum ClassifierWeight<'a> {
    Packed {
        forward: PackedB,
        backward: Option<PackedB>,
    },
    Values(RoundedOperand<'a>),
}

impl<'a> ClassifierWeight<'a> {
    /// `n` tokens in all (the tiles together): too few and nothing is packed.
    fn new(weight: Operand<'a>, (n, c, v): (usize, usize, usize), with_grads: bool) -> Self {
        if let Some(forward) = prepack_b(weight, MatmulDims::new(n, v, c).tb()) {
            let backward = if with_grads {
                prepack_b(weight, MatmulDims::new(n, c, v))
            } else {
                None
            };
            return ClassifierWeight::Packed { forward, backward };
        }
        let half = matmul_precision().half();
        ClassifierWeight::Values(match (weight, half) {
            (Operand::F32(w), Some(h)) => rounded_operand(w, h),
            (Operand::F32(w), None) => RoundedOperand::Exact(w),
            // Widened exactly; rounded again only for a narrower 16-bit format.
            (Operand::BF16(_), _) => match weight.widened() {
                RoundedOperand::Rounded(mut t) if half.is_some_and(|h| h != Half::BF16) => {
                    round_to_half_inplace(t.data_mut(), half.expect("checked"));
                    RoundedOperand::Rounded(t)
                }
                w => w,
            },
        })
    }
}

/// A logits tile `x · Wᵀ`, on the packed weight where there is one.
fn logits_matmul(
    tile: &mut [f32],
    x: &[f32],
    weight: &ClassifierWeight,
    (rows, c, v): (usize, usize, usize),
    half: Option<Half>,
) {
    let d = MatmulDims::new(rows, v, c).tb();
    match weight {
        ClassifierWeight::Packed { forward, .. } => {
            matmul_prepacked(tile, Operand::F32(x), forward, d)
        }
        ClassifierWeight::Values(w) => tile_matmul(tile, x, w, d, half),
    }
}

/// Under 16-bit matmuls the classifier's input, rounded once per call rather than once per
/// tile (a packed kernel rounds while packing; the rounding is the same).
fn classifier_input(x: &[f32]) -> (Option<Half>, RoundedOperand<'_>) {
    match matmul_precision().half() {
        Some(h) => (Some(h), rounded_operand(x, h)),
        None => (None, RoundedOperand::Exact(x)),
    }
}

/// A tile GEMM whose operands are already rounded when `half` is set.
fn tile_matmul(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims, half: Option<Half>) {
    if half.is_some() {
        matmul_on_rounded(out, a, b, d);
    } else {
        matmul(out, a, b, d);
    }
}

/// One row: `exp(z - max)` in place (one exp per logit), the loss `lse - z[target]`, and, when
/// `g` is given, the row turned into `(softmax - onehot) * g`.
#[inline(always)]
fn xent_row_impl(row: &mut [f32], tgt: usize, g: Option<f32>) -> f32 {
    let z_t = row[tgt];
    let mut m = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for k in 0..16 {
            m[k] = m[k].max(c[k]);
        }
    }
    let mut mx = f32::NEG_INFINITY;
    for &v in m.iter().chain(chunks.remainder()) {
        mx = mx.max(v);
    }
    let mut s = [0.0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for k in 0..16 {
            c[k] = exp(c[k] - mx);
            s[k] += c[k];
        }
    }
    let mut sum: f32 = s.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp(*v - mx);
        sum += *v;
    }
    if let Some(g) = g {
        let scale = g / sum;
        for v in row.iter_mut() {
            *v *= scale;
        }
        row[tgt] -= g;
    }
    mx + sum.ln() - z_t
}

multiversion! {
    fn softmax_xent_row_into(loss: &mut f32, row: &mut [f32], tgt: usize, g: Option<f32>) {
        *loss = xent_row_impl(row, tgt, g);
    }
}

fn softmax_xent_row(row: &mut [f32], tgt: usize, g: Option<f32>) -> f32 {
    let mut l = 0.0;
    softmax_xent_row_into(&mut l, row, tgt, g);
    l
}

/// Which all-reduce over the tensor-parallel group a step of [`vocab_parallel_classifier`] needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClassifierReduce {
    Max,
    Sum,
}

/// [`fused_classifier`] for one rank of a vocabulary-parallel output layer (Megatron's
/// `vocab_parallel_cross_entropy`, fused with the logits GEMM and tiled over tokens): `weight`
/// holds vocabulary rows `[vocab_start, vocab_start + d.v)`. Per tile, three `[rows]`-sized
/// reductions over the ranks go through `reduce` (the caller's communicator; kernels do not
/// communicate): the row max, the target logit (owned by one rank) and the sum of exponentials.
/// The full-vocabulary logits never exist anywhere. With `grads`, `dx` receives this rank's
/// partial `dlogits · W` (the caller sums it over ranks) and `dweight` accumulates the shard's
/// gradient.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn vocab_parallel_classifier<E>(
    losses: &mut [f32],
    mut grads: Option<(&mut [f32], &mut [f32])>,
    x: &[f32],
    weight: Operand<'_>,
    mut bias: Option<ClassifierBias>,
    targets: &[u32],
    dloss: &[f32],
    d: ClassifierDims,
    vocab_start: usize,
    reduce: &mut dyn FnMut(&mut [f32], ClassifierReduce) -> Result<(), E>,
) -> Result<(), E> {
    let ClassifierDims { n, c, v, .. } = d;
    assert_eq!(x.len(), n * c);
    assert_eq!(weight.len(), v * c);
    assert_eq!(targets.len(), n);
    assert_eq!(losses.len(), n);
    let weight = ClassifierWeight::new(weight, (n, c, v), grads.is_some());
    let (half, xh) = classifier_input(x);
    let x = &*xh;
    let rows = d.chunk_rows.max(1).min(n.max(1));
    let mut logits = crate::pool::take_any(rows * v);
    let mut backward = ClassifierBackward::new(&weight, (n, v, rows));
    let owned = |tgt: u32| -> Option<usize> {
        let t = tgt as usize;
        (tgt != IGNORE_INDEX && t >= vocab_start && t < vocab_start + v).then(|| t - vocab_start)
    };
    let mut r0 = 0;
    while r0 < n {
        let nr = rows.min(n - r0);
        let tile = &mut logits[..nr * v];
        let xr = &x[r0 * c..(r0 + nr) * c];
        let tg = &targets[r0..r0 + nr];
        logits_matmul(tile, xr, &weight, (nr, c, v), half);
        if let Some(b) = &bias {
            b.add(tile);
        }
        let mut mx: Vec<f32> = tile
            .par_chunks(v)
            .map(|row| row.iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        reduce(&mut mx, ClassifierReduce::Max)?;
        let mut z_t: Vec<f32> = tile
            .chunks(v)
            .zip(tg)
            .map(|(row, &t)| owned(t).map_or(0.0, |k| row[k]))
            .collect();
        reduce(&mut z_t, ClassifierReduce::Sum)?;
        let mut sum: Vec<f32> = tile
            .par_chunks_mut(v)
            .zip(mx.par_iter())
            .map(|(row, &m)| exp_shift_sum(row, m))
            .collect();
        reduce(&mut sum, ClassifierReduce::Sum)?;
        let want_grad = grads.is_some();
        tile.par_chunks_mut(v)
            .zip(losses[r0..r0 + nr].par_iter_mut())
            .enumerate()
            .for_each(|(i, (row, loss))| {
                if tg[i] == IGNORE_INDEX {
                    *loss = 0.0;
                    if want_grad {
                        row.fill(0.0);
                    }
                    return;
                }
                *loss = mx[i] + sum[i].ln() - z_t[i];
                if want_grad {
                    let g = dloss[r0 + i];
                    let scale = g / sum[i];
                    row.iter_mut().for_each(|e| *e *= scale);
                    if let Some(k) = owned(tg[i]) {
                        row[k] -= g;
                    }
                }
            });
        if let Some((dx, dw)) = grads.as_mut() {
            if let Some(b) = bias.as_mut() {
                b.backward(tile);
            }
            backward.tile((dx, dw), tile, x, &weight, (r0, nr, n, c, v), half);
        }
        r0 += nr;
    }
    crate::pool::give_back(logits);
    backward.finish();
    Ok(())
}

multiversion! {
    fn exp_shift_sum_into(sum: &mut f32, row: &mut [f32], m: f32) {
        let mut s = 0.0f32;
        for e in row.iter_mut() {
            *e = exp(*e - m);
            s += *e;
        }
        *sum = s;
    }
}

/// `row = exp(row - m)` in place; returns the sum.
fn exp_shift_sum(row: &mut [f32], m: f32) -> f32 {
    let mut s = 0.0;
    exp_shift_sum_into(&mut s, row, m);
    s
}
