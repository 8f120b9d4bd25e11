//! The linear base under tabular regression (`tabular::linear_base`): the ridge fit recovers a
//! linear relation and extrapolates it, its leave-one-out residuals are those of refits
//! without each row, its penalty is the grid's with the least leave-one-out error, and a
//! positive target related to positive features by powers is fitted on the log scale; the
//! model's correction is weighted by how well it reads held-out context rows.

use megatron_training::tabular::inference::InferenceTable;
use megatron_training::tabular::linear_base::{LinearBase, TargetScale, PENALTIES};

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
    two_columns(context, values, targets)
}

/// A regression table of 2 feature columns, its first `context` rows the context.
fn two_columns(context: usize, values: Vec<f32>, targets: Vec<f32>) -> InferenceTable {
    InferenceTable {
        rows: targets.len(),
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

/// `rows` rows of 3 positive features and `y = 2 x0^2 sqrt(x1)` (x2 irrelevant), as radius,
/// perimeter and area relate in breast_cancer.
fn power_table(rows: usize, context: usize) -> InferenceTable {
    let mut values = Vec::new();
    let mut targets = Vec::new();
    for r in 0..rows {
        let x0 = 1.0 + (r as f32 * 0.37).sin().abs() * 2.0;
        let x1 = 0.5 + (r as f32 * 0.91).cos().abs() * 3.0;
        let x2 = 1.0 + (r % 5) as f32;
        values.extend([x0, x1, x2]);
        targets.push(2.0 * x0 * x0 * x1.sqrt());
    }
    InferenceTable {
        rows,
        cols: 3,
        context_rows: context,
        values,
        targets,
        classes: 0,
    }
}

fn is_log(scale: TargetScale) -> bool {
    matches!(scale, TargetScale::Log { .. })
}

#[test]
fn a_power_law_is_fitted_on_the_log_scale_and_extrapolated() {
    let mut t = power_table(160, 150);
    // A query with x0 twice the context's largest (3).
    t.values[155 * 3] = 6.0;
    let truth =
        |r: usize| 2.0 * (t.values[r * 3] as f64).powi(2) * (t.values[r * 3 + 1] as f64).sqrt();
    let (fit, loo) = LinearBase::fit(&t);
    assert!(is_log(fit.target_scale()), "{:?}", fit.target_scale());
    for r in 150..160 {
        let (got, want) = (fit.predict(&t, r), truth(r));
        assert!((got - want).abs() < 0.01 * want, "row {r}: {got} vs {want}");
    }
    // Leave-one-out residuals are in the target's units, and small.
    assert!(loo.iter().all(|e| e.abs() < 0.05), "{loo:?}");
    // The target's own scale misses the curvature: far off on the extrapolated row.
    let (raw, _) = LinearBase::fit_penalised(&t, PENALTIES[0]);
    let miss = (raw.predict(&t, 155) - truth(155)).abs();
    assert!(miss > 0.1 * truth(155), "raw fit misses by only {miss}");
}

#[test]
fn a_linear_relation_stays_on_the_targets_own_scale_though_all_is_positive() {
    let mut t = table(200, 190, 0.0);
    // Shift the features and the target positive: y = 3 x0 - 2 x1 + 30, x0 + 5 > 0, x1 + 2 > 0.
    for (i, v) in t.values.iter_mut().enumerate() {
        *v += if i % 2 == 0 { 5.0 } else { 2.0 };
    }
    for r in 0..200 {
        t.targets[r] = 3.0 * t.values[r * 2] - 2.0 * t.values[r * 2 + 1] + 19.0;
    }
    assert!(t.targets.iter().all(|&y| y > 0.0) && t.values.iter().all(|&v| v > 0.0));
    let (fit, _) = LinearBase::fit(&t);
    assert_eq!(fit.target_scale(), TargetScale::Identity);
}

#[test]
fn a_non_positive_target_or_feature_keeps_the_log_away_from_it() {
    // One context target at zero: no log scale at all.
    let mut zero = power_table(60, 50);
    zero.targets[7] = 0.0;
    let (fit, _) = LinearBase::fit(&zero);
    assert_eq!(fit.target_scale(), TargetScale::Identity);
    // An irrelevant feature negative in one query row: the log scale still fits the others,
    // that column is read as it is, and every prediction is finite and close.
    let mut t = power_table(60, 50);
    t.values[55 * 3 + 2] = -4.0;
    let (fit, _) = LinearBase::fit(&t);
    assert!(is_log(fit.target_scale()), "{:?}", fit.target_scale());
    for r in 50..60 {
        let want = 2.0 * (t.values[r * 3] as f64).powi(2) * (t.values[r * 3 + 1] as f64).sqrt();
        let got = fit.predict(&t, r);
        assert!(
            got.is_finite() && (got - want).abs() < 0.05 * want,
            "row {r}: {got} vs {want}"
        );
    }
}

#[test]
fn smearing_makes_the_log_fit_unbiased_in_the_targets_units() {
    // ln y = 0.5 x0 + e, e roughly normal with sd 0.8: exp of the fitted log is the median of
    // y, about exp(-0.32) = 0.73 of its mean; the smearing factor restores the mean.
    let (rows, context) = (4000, 2000);
    let mut state = 12345u64;
    let mut uniform = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut values = Vec::new();
    let mut targets = Vec::new();
    for _ in 0..rows {
        let x0 = 4.0 * uniform() - 2.0;
        // Sum of 12 uniforms minus 6: mean 0, sd 1.
        let e = 0.8 * ((0..12).map(|_| uniform()).sum::<f64>() - 6.0);
        values.push(x0 as f32);
        targets.push((0.5 * x0 + e).exp() as f32);
    }
    let t = InferenceTable {
        rows,
        cols: 1,
        context_rows: context,
        values,
        targets,
        classes: 0,
    };
    let (fit, _) = LinearBase::fit(&t);
    let TargetScale::Log { smear, .. } = fit.target_scale() else {
        panic!("log-normal target fitted on {:?}", fit.target_scale());
    };
    assert!((1.25..1.5).contains(&smear), "smear {smear}");
    let predicted: f64 = (context..rows).map(|r| fit.predict(&t, r)).sum();
    let actual: f64 = t.targets[context..].iter().map(|&y| y as f64).sum();
    assert!(
        (predicted / actual - 1.0).abs() < 0.08,
        "mean prediction {} vs mean target {}",
        predicted / (rows - context) as f64,
        actual / (rows - context) as f64
    );
}

#[test]
fn the_log_scale_needs_to_win_by_more_than_a_standard_error() {
    // y = x0^1.1 + noise on x0 in 1..3: the log scale fits the slight curvature, so its PRESS
    // is the lesser, but by far less than the noise's spread of squared residuals.
    let rows = 80;
    let x: Vec<f32> = (0..rows)
        .map(|r| 1.0 + 2.0 * (r as f32 * 0.618).fract())
        .collect();
    let t = InferenceTable {
        rows,
        cols: 1,
        context_rows: rows,
        values: x.clone(),
        targets: x
            .iter()
            .enumerate()
            .map(|(r, v)| v.powf(1.1) + 0.3 * ((r * 7919 % 101) as f32 / 50.0 - 1.0) + 1.0)
            .collect(),
        classes: 0,
    };
    let press = |loo: &[f64]| loo.iter().map(|e| e * e).sum::<f64>();
    let (_, identity) = LinearBase::fit_identity(&t);
    let (_, log) = LinearBase::fit_log(&t).expect("positive targets");
    assert!(
        press(&log) < press(&identity),
        "{} vs {}",
        press(&log),
        press(&identity)
    );
    let (fit, _) = LinearBase::fit(&t);
    assert_eq!(fit.target_scale(), TargetScale::Identity);
}

/// `rows` rows of 2 features from a fixed sequence and the target `f(x0, x1, noise)` with noise
/// uniform in -1..1.
fn table_of(rows: usize, context: usize, f: impl Fn(f32, f32, f32) -> f32) -> InferenceTable {
    let mut values = Vec::new();
    let mut targets = Vec::new();
    for r in 0..rows {
        let x0 = 6.0 * (r as f32 * 0.618_034).fract() - 3.0;
        let x1 = 4.0 * (r as f32 * 0.414_214).fract() - 2.0;
        // splitmix64 of the row: noise unrelated to the features.
        let mut z = (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let noise = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        values.extend([x0, x1]);
        targets.push(f(x0, x1, noise));
    }
    two_columns(context, values, targets)
}

#[test]
fn the_models_correction_is_weighted_by_how_well_it_reads_held_out_rows() {
    use megatron_training::tabular::commands::LoadedModel;
    use megatron_training::tabular::linear_base::{correction_weight, MIN_STACKING_ROWS};
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tabular/checkpoint");
    let lm = LoadedModel::load(&path).expect("the committed tabular checkpoint");
    let p = lm.predictor(usize::MAX);
    // A curve the ridge cannot follow: the trained model reads it from the residuals.
    let curve = table_of(160, 150, |x0, x1, _| 2.0 * (2.0 * x0).sin() + 0.3 * x1);
    let w_curve = correction_weight(&p, &curve, 1, 0).unwrap();
    // A linear relation plus noise: the ridge leaves only noise.
    let line = table_of(160, 150, |x0, x1, e| x0 - x1 + 0.5 * e);
    let w_line = correction_weight(&p, &line, 1, 0).unwrap();
    println!("weights: curve {w_curve}, line {w_line}");
    // (At iteration 11,000: 1 and 0.34.)
    assert!(w_curve > 0.9, "curve: {w_curve}");
    assert!(w_line < 0.5, "line: {w_line}");
    // Too few context rows to hold half out: the correction is taken whole.
    let small = table_of(MIN_STACKING_ROWS + 5, MIN_STACKING_ROWS - 1, |x0, _, _| {
        x0.sin()
    });
    assert_eq!(correction_weight(&p, &small, 1, 0).unwrap(), 1.0);
}
