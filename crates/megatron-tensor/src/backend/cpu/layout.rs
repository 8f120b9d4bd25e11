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
