//! The linear base under tabular regression (`tabular::linear_base`): the ridge fit recovers a
//! linear relation and extrapolates it, its leave-one-out residuals are those of refits
//! without each row, and its penalty is the grid's with the least leave-one-out error.

use megatron_training::tabular::inference::InferenceTable;
use megatron_training::tabular::linear_base::{LinearBase, PENALTIES};

/// `rows` rows of 2 features (one missing now and then) and `y = 3 x0 - 2 x1 + 5 + noise`.
fn table(rows: usize, context: usize, noise: f32) -> InferenceTable {
    let mut values = Vec::new();
    let mut targets = Vec::new();
    for r in 0..rows {
        let x0 = (r as f32 * 0.37).sin() * 2.0 + r as f32 * 0.01;
        let x1 = (r as f32 * 0.91).cos();
        values.extend([x0, x1]);
        let e = noise * ((r * 7919 % 13) as f32 / 6.0 - 1.0);
        targets.push(3.0 * x0 - 2.0 * x1 + 5.0 + e);
    }
    InferenceTable {
        rows,
        cols: 2,
        context_rows: context,
        values,
        targets,
        classes: 0,
    }
}

#[test]
fn the_ridge_base_recovers_a_linear_relation_and_extrapolates_it() {
    let mut t = table(200, 190, 0.0);
    // A query row far outside the context's range of x0 (which stays within about +-4).
    t.values[195 * 2] = 40.0;
    let (fit, loo) = LinearBase::fit(&t);
    for r in 190..200 {
        let want = 3.0 * t.values[r * 2] as f64 - 2.0 * t.values[r * 2 + 1] as f64 + 5.0;
        let got = fit.predict(&t, r);
        // Noiseless: the least penalty of the grid (0.01 on 190 standardised rows).
        assert!(
            (got - want).abs() < 0.01 * want.abs().max(1.0),
            "row {r}: {got} vs {want}"
        );
    }
    assert!(loo.iter().all(|e| e.abs() < 0.1), "{loo:?}");
}

#[test]
fn leave_one_out_residuals_equal_refits_without_the_row() {
    let mut t = table(40, 40, 0.5);
    t.values[3 * 2 + 1] = f32::NAN;
    let (_, loo) = LinearBase::fit_penalised(&t, 1.0);
    for left in [0usize, 3, 17, 39] {
        // The same fit on the other 39 rows (the held-out row moved past the context).
        let keep: Vec<usize> = (0..40).filter(|&r| r != left).chain([left]).collect();
        let moved = InferenceTable {
            rows: 40,
            cols: 2,
            context_rows: 39,
            values: keep
                .iter()
                .flat_map(|&r| [t.values[r * 2], t.values[r * 2 + 1]])
                .collect(),
            targets: keep.iter().map(|&r| t.targets[r]).collect(),
            classes: 0,
        };
        let (refit, _) = LinearBase::fit_penalised(&moved, 1.0);
        let want = t.targets[left] as f64 - refit.predict(&moved, 39);
        // The refit standardises with 39 rows' statistics, so the penalty differs slightly.
        assert!(
            (loo[left] - want).abs() < 0.02 * want.abs().max(0.1),
            "row {left}: {} vs {want}",
            loo[left]
        );
    }
}

/// `rows` rows of `cols` features and a target that is 0.3 x0 plus noise as large as it: most
/// features are noise to the target, so a small context over-fits them without a penalty.
fn noisy_table(rows: usize, cols: usize) -> InferenceTable {
    let cell =
        |r: usize, c: usize| ((r * 31 + c * 17) as f32 * 0.77).sin() + (r * c % 7) as f32 * 0.1;
    InferenceTable {
        rows,
        cols,
        context_rows: rows,
        values: (0..rows)
            .flat_map(|r| (0..cols).map(move |c| cell(r, c)))
            .collect(),
        targets: (0..rows)
            .map(|r| 0.3 * cell(r, 0) + ((r * 7919 % 101) as f32 / 50.0 - 1.0))
            .collect(),
        classes: 0,
    }
}

#[test]
fn the_penalty_is_the_one_with_the_least_leave_one_out_error() {
    let press = |loo: &[f64]| loo.iter().map(|e| e * e).sum::<f64>();
    let noisy = noisy_table(30, 12);
    let (fit, loo) = LinearBase::fit(&noisy);
    for &p in &PENALTIES {
        let (_, other) = LinearBase::fit_penalised(&noisy, p);
        assert!(
            press(&loo) <= press(&other),
            "penalty {p} beats {}",
            fit.penalty()
        );
    }
    // Twelve features, one weakly relevant, thirty rows: the fit is pulled well above the
    // fixed penalty of 1 it used to have; the noiseless table of the first test takes the least.
    assert!(fit.penalty() >= 10.0, "penalty {}", fit.penalty());
    let (clean, _) = LinearBase::fit(&table(200, 190, 0.0));
    assert_eq!(clean.penalty(), PENALTIES[0]);
}
