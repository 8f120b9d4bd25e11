//! One tensor-parallel rank's shard of a global tensor, and back: along dimension `d` the
//! global tensor is `c` equal blocks (SwiGLU's `[gate; up]` is two), and rank `r` of `ranks`
//! holds the `r`-th part of each, as Megatron-LM splits its parallel linear layers.

/// Where rank `r`'s shard lies: for each run of contiguous elements, its start in the global
/// tensor and in the shard, and its length.
fn runs(
    shape: &[usize],
    (d, c): (usize, usize),
    ranks: usize,
    r: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let inner: usize = shape[d + 1..].iter().product();
    let outer: usize = shape[..d].iter().product();
    let rows = shape[d];
    let part = rows / (ranks * c); // one rank's rows of one block
    let local_rows = rows / ranks;
    (0..outer).flat_map(move |o| {
        (0..c).map(move |b| {
            let global = (o * rows + b * part * ranks + r * part) * inner;
            let local = (o * local_rows + b * part) * inner;
            (global, local, part * inner)
        })
    })
}

/// Rank `r`'s shard of `global` (of `shape`, split `split` over `ranks`).
pub(crate) fn shard_of(
    global: &[f32],
    shape: &[usize],
    split: (usize, usize),
    ranks: usize,
    r: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; global.len() / ranks];
    for (g, l, n) in runs(shape, split, ranks, r) {
        out[l..l + n].copy_from_slice(&global[g..g + n]);
    }
    out
}

/// Writes rank `r`'s shard `local` into its place in `global`.
pub(crate) fn place_shard(
    global: &mut [f32],
    shape: &[usize],
    split: (usize, usize),
    ranks: usize,
    r: usize,
    local: &[f32],
) {
    for (g, l, n) in runs(shape, split, ranks, r) {
        global[g..g + n].copy_from_slice(&local[l..l + n]);
    }
}

/// Whether `shape` splits evenly into `ranks` shards of `split`'s blocks.
pub(crate) fn splits_evenly(shape: &[usize], (d, c): (usize, usize), ranks: usize) -> bool {
    shape.get(d).is_some_and(|n| n.is_multiple_of(ranks * c))
}

/// Rank `r`'s piece `local` of a tensor of `shape` kept in `ranks` pieces split `split` (none,
/// or one piece: the same on every rank, and `local` is the whole tensor), put in place in
/// `out`.
pub(crate) fn place_piece(
    out: &mut [f32],
    shape: &[usize],
    split: Option<(usize, usize)>,
    (ranks, r): (usize, usize),
    local: &[f32],
) {
    match split {
        Some(s) if ranks > 1 => place_shard(out, shape, s, ranks, r, local),
        _ => out.copy_from_slice(local),
    }
}
