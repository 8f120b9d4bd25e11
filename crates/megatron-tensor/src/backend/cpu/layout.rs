//! Copies that change how a `[rows, cols]` tensor is split into parts along its last dimension
//! (tensor-parallel scatter/gather of the last dim; collectives work on contiguous blocks).

use rayon::prelude::*;

/// `out [rows, cols / parts]` = columns `[part * cols / parts, (part + 1) * cols / parts)` of `x`.
pub fn split_columns(
    out: &mut [f32],
    x: &[f32],
    rows: usize,
    cols: usize,
    parts: usize,
    part: usize,
) {
    let w = cols / parts;
    assert_eq!(cols % parts, 0);
    assert_eq!(out.len(), rows * w);
    assert_eq!(x.len(), rows * cols);
    out.par_chunks_mut(w)
        .zip(x.par_chunks(cols))
        .for_each(|(o, r)| o.copy_from_slice(&r[part * w..(part + 1) * w]));
}

/// `blocks [parts, rows, w]` (what an all-gather of `[rows, w]` shards returns) to
/// `out [rows, parts * w]`.
pub fn concat_columns(out: &mut [f32], blocks: &[f32], rows: usize, w: usize, parts: usize) {
    assert_eq!(out.len(), rows * w * parts);
    assert_eq!(blocks.len(), rows * w * parts);
    out.par_chunks_mut(parts * w)
        .enumerate()
        .for_each(|(r, o)| {
            for p in 0..parts {
                o[p * w..(p + 1) * w]
                    .copy_from_slice(&blocks[(p * rows + r) * w..(p * rows + r + 1) * w]);
            }
        });
}

/// Rows of `[groups, blocks_per_group, width]` blocks (a fused QKV: per query group its query
/// heads, its key, its value), and the blocks `[lo, hi)` of each group to move.
#[derive(Clone, Copy, Debug)]
pub struct GroupBlocks {
    pub groups: usize,
    pub blocks_per_group: usize,
    pub width: usize,
    pub lo: usize,
    pub hi: usize,
}

impl GroupBlocks {
    fn row(&self) -> usize {
        self.groups * self.blocks_per_group * self.width
    }
    fn picked(&self) -> usize {
        self.groups * (self.hi - self.lo) * self.width
    }
}

/// `out [rows, groups, hi - lo, width]` = blocks `[lo, hi)` of every group of every row of `x`
/// (e.g. a fused QKV's query heads as `[rows * heads, head_dim]`).
pub fn gather_group_blocks(out: &mut [f32], x: &[f32], rows: usize, d: GroupBlocks) {
    assert!(d.lo <= d.hi && d.hi <= d.blocks_per_group);
    assert_eq!(x.len(), rows * d.row());
    assert_eq!(out.len(), rows * d.picked());
    if d.picked() == 0 {
        return;
    }
    let (gw, pw) = (d.blocks_per_group * d.width, (d.hi - d.lo) * d.width);
    out.par_chunks_mut(d.picked())
        .zip(x.par_chunks(d.row()))
        .for_each(|(o, r)| {
            for (og, rg) in o.chunks_exact_mut(pw).zip(r.chunks_exact(gw)) {
                og.copy_from_slice(&rg[d.lo * d.width..d.hi * d.width]);
            }
        });
}

/// The inverse of [`gather_group_blocks`]: writes `src [rows, groups, hi - lo, width]` back into
/// blocks `[lo, hi)` of every group of `x`; the other blocks are left as they are.
pub fn scatter_group_blocks(x: &mut [f32], src: &[f32], rows: usize, d: GroupBlocks) {
    assert!(d.lo <= d.hi && d.hi <= d.blocks_per_group);
    assert_eq!(x.len(), rows * d.row());
    assert_eq!(src.len(), rows * d.picked());
    if d.picked() == 0 {
        return;
    }
    let (gw, pw) = (d.blocks_per_group * d.width, (d.hi - d.lo) * d.width);
    x.par_chunks_mut(d.row())
        .zip(src.par_chunks(d.picked()))
        .for_each(|(r, s)| {
            for (rg, sg) in r.chunks_exact_mut(gw).zip(s.chunks_exact(pw)) {
                rg[d.lo * d.width..d.hi * d.width].copy_from_slice(sg);
            }
        });
}
