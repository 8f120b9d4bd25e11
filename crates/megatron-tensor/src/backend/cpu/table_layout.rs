//! Layout of a batch of tables for the tabular model: cells `[b, rows, cols, w]` (each row a
//! sequence, for attention across the cells of a row) and `[b, cols, rows, w]` (each column a
//! sequence, for attention down a column). Attention runs on contiguous sequences, so the
//! model swaps the two between its row and column attention.

use rayon::prelude::*;

/// Sizes of one batch of tables: `b` tables of `rows x cols` cells, `w` floats per cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableDims {
    pub b: usize,
    pub rows: usize,
    pub cols: usize,
    pub w: usize,
}

impl TableDims {
    /// The same batch seen column-major (rows and columns swapped).
    pub fn transposed(self) -> Self {
        TableDims {
            rows: self.cols,
            cols: self.rows,
            ..self
        }
    }

    pub fn len(self) -> usize {
        self.b * self.rows * self.cols * self.w
    }

    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
}

/// `out[b, c, r, :] = inp[b, r, c, :]`: `inp` laid out as `d`, `out` as `d.transposed()`.
pub fn swap_rows_cols(out: &mut [f32], inp: &[f32], d: TableDims) {
    assert_eq!(inp.len(), d.len());
    assert_eq!(out.len(), d.len());
    let TableDims { rows, cols, w, .. } = d;
    // One task per output sequence (a table's column): it reads one cell from every row.
    out.par_chunks_mut(rows * w)
        .enumerate()
        .for_each(|(bc, seq)| {
            let (t, c) = (bc / cols, bc % cols);
            for (r, cell) in seq.chunks_exact_mut(w).enumerate() {
                let at = ((t * rows + r) * cols + c) * w;
                cell.copy_from_slice(&inp[at..at + w]);
            }
        });
}
