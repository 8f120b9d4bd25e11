//! The tabular model's per-cell input features: context-row standardisation, missing flags,
//! column identities, the target known on context rows only, zeros on padding.

use megatron_tensor::cpu::table_features::{FEATURES, ID, MAX_CLASSES};
use megatron_tensor::cpu::{table_features, TableInputs, TableStats};
use megatron_tensor::RngKey;

const ROWS: usize = 4;
const COLS: usize = 2;
const W: usize = 1 + COLS;

fn at(t: usize, r: usize, c: usize) -> usize {
    ((t * ROWS + r) * W + c) * FEATURES
}

#[test]
fn table_features_standardise_with_context_rows_and_hide_query_targets() {
    // Table 0: 3 real rows (2 context), 1 real column; classification with 3 classes.
    // Table 1: 4 real rows (3 context), 2 columns, row 1 column 1 missing; regression.
    let values = [
        1.0, 0.0, 3.0, 0.0, 100.0, 0.0, 0.0, 0.0, //
        2.0, 10.0, 4.0, 0.0, 6.0, 30.0, 50.0, 70.0,
    ];
    let mut missing = [0.0f32; 16];
    missing[8 + 3] = 1.0; // table 1, row 1, column 1
    let row_valid = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    let col_valid = [1.0, 0.0, 1.0, 1.0];
    let targets = [2.0, 0.0, 1.0, 0.0, 5.0, 7.0, 9.0, 100.0];
    let inputs = TableInputs {
        b: 2,
        rows: ROWS,
        cols: COLS,
        values: &values,
        missing: &missing,
        row_valid: &row_valid,
        col_valid: &col_valid,
        targets: &targets,
        context_rows: &[2, 3],
        classes: &[3, 0],
    };
    let mut out = vec![f32::NAN; 2 * ROWS * W * FEATURES];
    let mut stats = [(0.0f32, 0.0f32); 2];
    let mut columns = [(0.0f32, 0.0f32); 4];
    let s = TableStats {
        target: &mut stats,
        columns: &mut columns,
    };
    table_features(&mut out, s, inputs, RngKey::new(9));
    // Column statistics: table 1 column 1 from its present context values 10 and 30.
    assert_eq!(columns[3], (20.0, 10.0));
    assert_eq!(columns[1], (0.0, 1.0), "padding column");
    let close = |a: f32, b: f32| (a - b).abs() < 1e-5;
    // Table 0, column 0: context values 1, 3 -> mean 2, sd 1; the query row's 100 is clipped.
    assert!(close(out[at(0, 0, 1)], -1.0) && close(out[at(0, 1, 1)], 1.0));
    assert!(close(out[at(0, 2, 1)], 10.0), "clipped to 10");
    // Padding: column 1 of table 0 and row 3 of table 0 are all zeros.
    assert!(out[at(0, 0, 2)..at(0, 0, 2) + FEATURES]
        .iter()
        .all(|&v| v == 0.0));
    assert!(out[at(0, 3, 0)..at(0, 3, 0) + W * FEATURES]
        .iter()
        .all(|&v| v == 0.0));
    // Classification target: one-hot on context rows, unknown on the query row.
    let classes = 2 + ID + 1;
    let unknown = classes + MAX_CLASSES;
    assert_eq!(out[at(0, 0, 0) + classes + 2], 1.0);
    assert_eq!(out[at(0, 1, 0) + classes], 1.0);
    assert_eq!(out[at(0, 2, 0) + unknown], 1.0);
    assert!(out[at(0, 2, 0)..at(0, 2, 0) + unknown]
        .iter()
        .all(|&v| v == 0.0));
    // Table 1, column 1: row 1 missing, so the context mean/sd come from rows 0 and 2 (10, 30).
    assert_eq!(out[at(1, 1, 2) + 1], 1.0);
    assert_eq!(out[at(1, 1, 2)], 0.0);
    assert!(close(out[at(1, 0, 2)], -1.0) && close(out[at(1, 3, 2)], 5.0));
    // Regression target: context 5, 7, 9 -> mean 7, sd sqrt(8/3); the query row is unknown.
    let sd = (8.0f32 / 3.0).sqrt();
    assert!(close(stats[1].0, 7.0) && close(stats[1].1, sd));
    assert!(close(out[at(1, 0, 0) + 2 + ID], -2.0 / sd));
    assert_eq!(out[at(1, 3, 0) + unknown], 1.0);
    assert_eq!(
        out[at(1, 3, 0) + 2 + ID],
        0.0,
        "the query's target is never shown"
    );
    // Column identities: the same vector on every row of a column, different between columns.
    let id = |t, r, c| out[at(t, r, c) + 2..at(t, r, c) + 2 + ID].to_vec();
    assert_eq!(id(1, 0, 1), id(1, 3, 1));
    assert_ne!(id(1, 0, 1), id(1, 0, 2));
    assert!(id(1, 0, 1).iter().any(|&v| v != 0.0));
    let mut again = vec![0.0; out.len()];
    let s = TableStats {
        target: &mut stats,
        columns: &mut columns,
    };
    table_features(&mut again, s, inputs, RngKey::new(9));
    assert_eq!(
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}
