//! The quantile-to-normal transform of the tabular model's ensemble members.

use megatron_training::tabular::quantile::{normal_quantile, quantile_normal};

#[test]
fn normal_quantile_matches_known_values() {
    for (p, z) in [
        (0.5, 0.0),
        (0.975, 1.959_963_984_540_054),
        (0.841_344_746_068_543, 1.0),
        (0.001, -3.090_232_306_167_813),
        (1e-6, -4.753_424_308_822_899),
    ] {
        assert!(
            (normal_quantile(p) - z).abs() < 1e-8,
            "{p}: {}",
            normal_quantile(p)
        );
        assert!((normal_quantile(1.0 - p) + z).abs() < 1e-8, "1 - {p}");
    }
}

#[test]
fn quantile_normal_keeps_order_and_missing_cells_fitted_on_context_rows() {
    // 2 columns, 6 rows: the first 4 the context. Column 0 heavily skewed, column 1 with a
    // missing cell and ties.
    let v = [
        1.0,
        3.0, //
        1000.0,
        f32::NAN, //
        2.0,
        3.0, //
        5.0,
        1.0, //
        3.0,
        2.0, // query between context values
        1e6,
        9.0, // query beyond them
    ];
    let q = quantile_normal(&v, 6, 2, 4);
    let col = |c: usize| (0..6).map(|r| q[r * 2 + c]).collect::<Vec<f32>>();
    let c0 = col(0);
    // Ranks among the context values 1, 2, 5, 1000: symmetric around 0, order kept.
    assert!(c0[0] < c0[2] && c0[2] < c0[4] && c0[4] < c0[3] && c0[3] < c0[1]);
    assert!(
        (c0[0] + c0[1]).abs() < 1e-6,
        "the smallest and largest mirror: {c0:?}"
    );
    assert!(c0[5] > c0[1], "beyond the context: above its largest value");
    assert!(
        (c0[5] - normal_quantile(0.9) as f32).abs() < 1e-6,
        "clamped at 1 - 0.5/(n+1)"
    );
    assert!(c0.iter().all(|z| z.abs() < 2.0), "no skew left: {c0:?}");
    let c1 = col(1);
    assert!(c1[1].is_nan(), "a missing cell stays missing");
    assert_eq!(c1[0], c1[2], "ties share a quantile");
    assert!(c1[3] < c1[4] && c1[4] < c1[0]);
}
