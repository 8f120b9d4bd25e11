//! Swapping a batch of tables between row-major and column-major cells.

use megatron_tensor::cpu::{swap_rows_cols, TableDims};

#[test]
fn swap_rows_cols_moves_each_cell_and_twice_is_the_identity() {
    let d = TableDims {
        b: 2,
        rows: 5,
        cols: 3,
        w: 4,
    };
    let x: Vec<f32> = (0..d.len()).map(|i| i as f32).collect();
    let mut y = vec![0.0; d.len()];
    swap_rows_cols(&mut y, &x, d);
    for t in 0..d.b {
        for r in 0..d.rows {
            for c in 0..d.cols {
                for k in 0..d.w {
                    let src = ((t * d.rows + r) * d.cols + c) * d.w + k;
                    let dst = ((t * d.cols + c) * d.rows + r) * d.w + k;
                    assert_eq!(y[dst], x[src], "table {t} row {r} col {c} [{k}]");
                }
            }
        }
    }
    let mut back = vec![0.0; d.len()];
    swap_rows_cols(&mut back, &y, d.transposed());
    assert_eq!(back, x);
}
