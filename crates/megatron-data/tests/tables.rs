//! The synthetic-table prior: deterministic per seed and index whatever the thread or order,
//! shapes within the configured ranges, every post-processing and target kind occurring, and
//! targets that depend on the features (what the model is to learn).

use megatron_data::tables::postprocess::{kumaraswamy_warp, quantize};
use megatron_data::tables::{sample_table, PriorConfig, PriorLoader, Table, Target};

fn small() -> PriorConfig {
    PriorConfig {
        max_context_rows: 256,
        max_query_rows: 32,
        max_features: 30,
        ..PriorConfig::default()
    }
}

#[test]
fn same_seed_gives_the_same_tables_byte_for_byte_in_any_order_and_thread() {
    let cfg = small();
    let direct: Vec<Vec<u8>> = (0..12)
        .map(|i| sample_table(&cfg, 7, i).to_bytes())
        .collect();
    let backwards: Vec<Vec<u8>> = (0..12)
        .rev()
        .map(|i| sample_table(&cfg, 7, i).to_bytes())
        .collect();
    let mut loader = PriorLoader::new(cfg.clone(), 7, 0, 3, 2);
    let threaded: Vec<Vec<u8>> = (0..12).map(|_| loader.next_table().to_bytes()).collect();
    for i in 0..12 {
        assert_eq!(direct[i], backwards[11 - i], "table {i} depends on order");
        assert_eq!(
            direct[i], threaded[i],
            "table {i} depends on the worker thread"
        );
    }
    assert_ne!(direct[0], direct[1]);
    assert_ne!(
        direct[0],
        sample_table(&cfg, 8, 0).to_bytes(),
        "seed ignored"
    );
    // A loader started at 5 continues the same sequence (resume).
    let mut resumed = PriorLoader::new(cfg, 7, 5, 2, 1);
    assert_eq!(resumed.next_table().to_bytes(), direct[5]);
}

fn corr(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    if va <= 0.0 || vb <= 0.0 {
        0.0
    } else {
        cov / (va * vb).sqrt()
    }
}

/// The largest |correlation| of the target with a feature, over rows without missing cells.
fn best_feature_correlation(t: &Table) -> f64 {
    let y: Vec<f64> = match &t.target {
        Target::Values(v) => v.iter().map(|&x| x as f64).collect(),
        Target::Classes { labels, .. } => labels.iter().map(|&x| x as f64).collect(),
    };
    (0..t.cols)
        .map(|c| {
            let (xs, ys): (Vec<f64>, Vec<f64>) = (0..t.rows)
                .filter(|&r| t.values[r * t.cols + c].is_finite())
                .map(|r| (t.values[r * t.cols + c] as f64, y[r]))
                .unzip();
            if xs.len() < 10 {
                0.0
            } else {
                corr(&xs, &ys).abs()
            }
        })
        .fold(0.0, f64::max)
}

#[test]
fn tables_cover_the_configured_shapes_kinds_and_post_processing() {
    let cfg = PriorConfig::default();
    let (mut regression, mut classification, mut with_missing, mut with_categorical) = (0, 0, 0, 0);
    let (mut most_context, mut most_cols) = (0, 0);
    let mut class_counts = std::collections::BTreeSet::new();
    let mut correlations = Vec::new();
    for i in 0..120 {
        let t = sample_table(&cfg, 1, i);
        assert!(t.context_rows >= cfg.min_context_rows && t.context_rows <= cfg.max_context_rows);
        let queries = t.rows - t.context_rows;
        assert!((1..=cfg.max_query_rows).contains(&queries), "table {i}");
        assert!(t.cols >= 1 && t.cols <= cfg.max_features, "table {i}");
        assert_eq!(t.values.len(), t.rows * t.cols);
        assert_eq!(t.categories.len(), t.cols);
        most_context = most_context.max(t.context_rows);
        most_cols = most_cols.max(t.cols);
        for (c, &k) in t.categories.iter().enumerate() {
            for r in 0..t.rows {
                let v = t.values[r * t.cols + c];
                assert!(v.is_nan() || v.is_finite(), "table {i}: infinite cell");
                if k > 0 && !v.is_nan() {
                    assert!(v >= 0.0 && v < k as f32 && v.fract() == 0.0, "table {i}");
                }
            }
        }
        with_missing += usize::from(t.values.iter().any(|v| v.is_nan()));
        with_categorical += usize::from(t.categories.iter().any(|&k| k > 0));
        match &t.target {
            Target::Values(v) => {
                regression += 1;
                assert!(v.iter().all(|x| x.is_finite()));
            }
            Target::Classes { k, labels } => {
                classification += 1;
                assert!(
                    (2..=cfg.max_classes as u32).contains(k),
                    "table {i}: {k} classes"
                );
                assert!(labels.iter().all(|&l| l < *k));
                // Every class occurs among the context rows.
                for c in 0..*k {
                    assert!(
                        labels[..t.context_rows].contains(&c),
                        "table {i}: class {c}"
                    );
                }
                class_counts.insert(*k);
            }
        }
        correlations.push(best_feature_correlation(&t));
    }
    println!(
        "regression {regression}, classification {classification}, missing {with_missing}, categorical {with_categorical}, classes {class_counts:?}, most context {most_context}, most columns {most_cols}"
    );
    assert!(regression >= 15 && classification >= 50);
    assert!(with_missing >= 20 && with_categorical >= 10);
    assert!(class_counts.len() >= 5, "{class_counts:?}");
    assert!(most_context >= 600 && most_cols >= 50);
    correlations.sort_by(f64::total_cmp);
    let median = correlations[correlations.len() / 2];
    println!("median best |correlation| of target and a feature: {median:.3}");
    assert!(
        median > 0.3,
        "targets barely depend on the features: {median}"
    );
}

#[test]
fn warping_and_quantisation_keep_order_and_levels() {
    let col: Vec<f64> = (0..100).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
    let mut w = col.clone();
    kumaraswamy_warp(&mut w, 0.5, 2.0);
    for i in 0..col.len() {
        assert!((0.0..=1.0).contains(&w[i]));
        for j in 0..col.len() {
            if col[i] < col[j] {
                assert!(w[i] <= w[j], "warping is monotone");
            }
        }
    }
    let mut q = col.clone();
    quantize(&mut q, 5);
    let mut levels: Vec<u64> = q.iter().map(|v| v.to_bits()).collect();
    levels.sort_unstable();
    levels.dedup();
    assert!(levels.len() <= 5 && levels.len() >= 2);
}

#[test]
fn the_loader_keeps_ahead_of_a_consumer() {
    let mut loader = PriorLoader::new(small(), 3, 0, 2, 4);
    let t0 = std::time::Instant::now();
    for _ in 0..40 {
        let _ = loader.next_table();
    }
    println!(
        "40 tables in {:?}, waited {:?}",
        t0.elapsed(),
        loader.waited()
    );
    assert!(loader.waited() <= t0.elapsed());
}

mod batching {
    use super::small;
    use megatron_data::tables::batching::{
        collate, data_parallel_share, plan_micro_batches, table_view, COL_MULTIPLE, ROW_MULTIPLE,
    };
    use megatron_data::tables::{sample_table, Target};

    #[test]
    fn a_view_subsamples_context_rows_and_permutes_columns_consistently() {
        let t = sample_table(&small(), 5, 3);
        let max_context = t.context_rows / 2;
        let v = table_view(&t, 5, 3, max_context);
        assert_eq!(
            v.to_bytes(),
            table_view(&t, 5, 3, max_context).to_bytes(),
            "a view is deterministic"
        );
        assert_eq!(v.context_rows, max_context);
        assert_eq!(
            v.rows - v.context_rows,
            t.rows - t.context_rows,
            "queries all kept"
        );
        // Each view column is one table column: same cells (as bits) on the query rows.
        let q = t.rows - t.context_rows;
        for c in 0..v.cols {
            let col =
                |tab: &megatron_data::tables::Table, c: usize, rows: std::ops::Range<usize>| {
                    rows.map(|r| tab.values[r * tab.cols + c].to_bits())
                        .collect::<Vec<_>>()
                };
            let mine = col(&v, c, v.context_rows..v.context_rows + q);
            let src = (0..t.cols)
                .find(|&s| col(&t, s, t.context_rows..t.rows) == mine)
                .expect("a source column");
            assert_eq!(v.categories[c], t.categories[src]);
        }
        match (&t.target, &v.target) {
            (Target::Classes { labels: a, .. }, Target::Classes { labels: b, .. }) => {
                assert_eq!(&a[t.context_rows..], &b[v.context_rows..])
            }
            (Target::Values(a), Target::Values(b)) => {
                assert_eq!(&a[t.context_rows..], &b[v.context_rows..])
            }
            _ => panic!("the task changed"),
        }
    }

    #[test]
    fn micro_batches_cover_every_table_once_within_the_cell_budget() {
        let tables: Vec<_> = (0..200).map(|i| sample_table(&small(), 9, i)).collect();
        let shapes: Vec<(usize, usize)> = tables.iter().map(|t| (t.rows, t.cols)).collect();
        let budget = 64 * 1024;
        let plan = plan_micro_batches(&shapes, budget).unwrap();
        assert_eq!(plan, plan_micro_batches(&shapes, budget).unwrap());
        let mut seen: Vec<usize> = plan.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        let (mut real, mut padded) = (0usize, 0usize);
        for mb in &plan {
            let refs: Vec<_> = mb.iter().map(|&i| &tables[i]).collect();
            let b = collate(&refs);
            assert!(b.b * b.rows * b.cols <= budget);
            assert_eq!(b.rows % ROW_MULTIPLE, 0);
            assert_eq!(b.cols % COL_MULTIPLE, 0);
            padded += b.b * b.rows * b.cols;
            for (k, t) in refs.iter().enumerate() {
                real += t.rows * t.cols;
                // Size classes keep each table within twice its padded rows and columns.
                assert!(b.rows < 2 * t.rows.next_multiple_of(ROW_MULTIPLE));
                assert!(b.cols < 2 * t.cols.next_multiple_of(COL_MULTIPLE));
                let rows: f32 = b.row_valid[k * b.rows..(k + 1) * b.rows].iter().sum();
                let cols: f32 = b.col_valid[k * b.cols..(k + 1) * b.cols].iter().sum();
                assert_eq!((rows as usize, cols as usize), (t.rows, t.cols));
                let missing = t.values.iter().filter(|v| v.is_nan()).count();
                let marked: f32 = b.missing[k * b.rows * b.cols..(k + 1) * b.rows * b.cols]
                    .iter()
                    .sum();
                assert_eq!(marked as usize, missing);
            }
        }
        println!(
            "{} tables in {} micro-batches; padding {:.1} % of cells",
            tables.len(),
            plan.len(),
            100.0 * (1.0 - real as f64 / padded as f64)
        );
        let err = plan_micro_batches(&[(10, 3), (5000, 90)], budget).unwrap_err();
        assert!(
            err.contains("table 1") && err.contains("cell budget"),
            "{err}"
        );
    }

    #[test]
    fn data_parallel_ranks_split_the_micro_batches_without_overlap() {
        let mbs: Vec<usize> = (0..7).collect();
        let shares: Vec<Vec<usize>> = (0..3).map(|r| data_parallel_share(&mbs, r, 3)).collect();
        assert_eq!(shares[0], vec![0, 3, 6]);
        let mut all: Vec<usize> = shares.concat();
        all.sort_unstable();
        assert_eq!(all, mbs);
    }
}

#[test]
fn regression_borders_split_prior_targets_into_equal_shares() {
    use megatron_data::tables::borders::regression_borders;
    let cfg = small();
    let borders = regression_borders(&cfg, 1, 200, 16);
    assert_eq!(borders.len(), 15);
    assert!(borders.windows(2).all(|w| w[0] < w[1]), "{borders:?}");
    assert_eq!(
        borders,
        regression_borders(&cfg, 1, 200, 16),
        "deterministic"
    );
    // Standardised targets: the middle border sits near 0, the outer ones a few sd out.
    assert!(borders[7].abs() < 0.5, "{borders:?}");
    assert!(borders[0] < -0.5 && borders[14] > 0.5, "{borders:?}");
}

/// Query accuracy of the 5 nearest context rows' majority vote (features standardised with
/// the context's statistics, missing cells at the mean), and of always guessing the context's
/// most frequent class.
fn knn_and_majority_accuracy(t: &Table) -> Option<(f64, f64)> {
    let Target::Classes { k, labels } = &t.target else {
        return None;
    };
    let (ctx, cols) = (t.context_rows, t.cols);
    // Column-major standardised values.
    let mut z = vec![0.0f64; cols * t.rows];
    for c in 0..cols {
        let v = |r: usize| t.values[r * cols + c] as f64;
        let seen: Vec<f64> = (0..ctx).map(v).filter(|x| !x.is_nan()).collect();
        let n = seen.len().max(1) as f64;
        let mean = seen.iter().sum::<f64>() / n;
        let sd = (seen.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        let sd = if sd > 1e-9 { sd } else { 1.0 };
        for r in 0..t.rows {
            z[c * t.rows + r] = if v(r).is_nan() {
                0.0
            } else {
                (v(r) - mean) / sd
            };
        }
    }
    let at = |r: usize, c: usize| z[c * t.rows + r];
    let mut counts = vec![0usize; *k as usize];
    for &l in &labels[..ctx] {
        counts[l as usize] += 1;
    }
    let majority = (0..*k as usize).max_by_key(|&c| counts[c]).unwrap() as u32;
    let (mut knn_hits, mut majority_hits) = (0usize, 0usize);
    for q in ctx..t.rows {
        let mut d: Vec<(f64, u32)> = (0..ctx)
            .map(|r| {
                let dist = (0..cols).map(|c| (at(r, c) - at(q, c)).powi(2)).sum();
                (dist, labels[r])
            })
            .collect();
        d.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut votes = vec![0usize; *k as usize];
        for &(_, l) in d.iter().take(5) {
            votes[l as usize] += 1;
        }
        let vote = (0..*k as usize)
            .max_by_key(|&c| (votes[c], counts[c]))
            .unwrap() as u32;
        knn_hits += usize::from(vote == labels[q]);
        majority_hits += usize::from(majority == labels[q]);
    }
    let n = (t.rows - ctx) as f64;
    Some((knn_hits as f64 / n, majority_hits as f64 / n))
}

/// The prior is only worth learning from if a table's features tell about its target: a
/// 5-nearest-neighbour vote on the context rows must beat the majority class clearly on
/// average. (Features drawn anywhere in the graph with noise up to half a node's spread gave
/// tables a random forest hardly did better on than the majority class.)
#[test]
fn classification_targets_are_predictable_from_the_features() {
    let cfg = PriorConfig {
        max_context_rows: 128,
        max_query_rows: 32,
        max_features: 8,
        regression_share: 0.0,
        ..PriorConfig::default()
    };
    let (mut knn, mut majority, mut n) = (0.0, 0.0, 0.0);
    for i in 0..300 {
        if let Some((a, m)) = knn_and_majority_accuracy(&sample_table(&cfg, 1234, i)) {
            knn += a;
            majority += m;
            n += 1.0;
        }
    }
    let (knn, majority) = (knn / n, majority / n);
    println!("{n} tables: 5-NN accuracy {knn:.3}, majority class {majority:.3}");
    assert!(n >= 250.0);
    assert!(
        knn - majority > 0.12,
        "5-NN {knn:.3} vs majority {majority:.3}"
    );
}

/// R^2 of the least-squares fit of a regression table's target on its complete numeric
/// feature columns (with an intercept; ridge 1e-6 for collinear columns), over all rows.
/// (Index loops: it is the normal equations written as they read.)
#[allow(clippy::needless_range_loop)]
fn linear_fit_r2(t: &Table) -> Option<f64> {
    let Target::Values(y) = &t.target else {
        return None;
    };
    let cols: Vec<usize> = (0..t.cols)
        .filter(|&c| {
            t.categories[c] == 0 && (0..t.rows).all(|r| !t.values[r * t.cols + c].is_nan())
        })
        .collect();
    let p = cols.len() + 1;
    if cols.is_empty() || t.rows < 4 * p {
        return None;
    }
    let x = |r: usize, j: usize| -> f64 {
        if j == 0 {
            1.0
        } else {
            f64::from(t.values[r * t.cols + cols[j - 1]])
        }
    };
    // Normal equations [X'X + eps I | X'y], solved by Gaussian elimination with pivoting.
    let mut a = vec![vec![0.0f64; p + 1]; p];
    for r in 0..t.rows {
        for i in 0..p {
            for j in 0..p {
                a[i][j] += x(r, i) * x(r, j);
            }
            a[i][p] += x(r, i) * f64::from(y[r]);
        }
    }
    for (i, row) in a.iter_mut().enumerate() {
        row[i] += 1e-6 * t.rows as f64;
    }
    for c in 0..p {
        let piv = (c..p).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        a.swap(c, piv);
        for r in 0..p {
            if r != c {
                let f = a[r][c] / a[c][c];
                for k in c..=p {
                    a[r][k] -= f * a[c][k];
                }
            }
        }
    }
    let w: Vec<f64> = (0..p).map(|i| a[i][p] / a[i][i]).collect();
    let mean = y.iter().map(|&v| f64::from(v)).sum::<f64>() / t.rows as f64;
    let (mut ss_res, mut ss_tot) = (0.0, 0.0);
    for r in 0..t.rows {
        let pred: f64 = (0..p).map(|j| w[j] * x(r, j)).sum();
        ss_res += (f64::from(y[r]) - pred).powi(2);
        ss_tot += (f64::from(y[r]) - mean).powi(2);
    }
    (ss_tot > 0.0).then(|| 1.0 - ss_res / ss_tot)
}

/// Real tables are full of near-linear dependencies; the prior's linear tables are what teach
/// the model to read them: there a linear fit of the target on the features must explain far
/// more than in tables of random nonlinear functions (without linear tables the model fell
/// behind logistic regression and IterativeImputer on breast_cancer).
#[test]
fn linear_tables_have_targets_a_linear_fit_explains() {
    let mean_r2 = |linear_table_share: f64| {
        let cfg = PriorConfig {
            max_context_rows: 128,
            max_query_rows: 32,
            max_features: 8,
            regression_share: 1.0,
            max_missing: 0.0,
            linear_table_share,
            ..PriorConfig::default()
        };
        let r2: Vec<f64> = (0..200)
            .filter_map(|i| linear_fit_r2(&sample_table(&cfg, 99, i)))
            .collect();
        assert!(r2.len() >= 100, "{} tables fitted", r2.len());
        r2.iter().sum::<f64>() / r2.len() as f64
    };
    let (linear, nonlinear) = (mean_r2(1.0), mean_r2(0.0));
    println!(
        "mean R^2 of a linear fit: linear tables {linear:.3}, nonlinear tables {nonlinear:.3}"
    );
    assert!(
        linear - nonlinear > 0.15,
        "linear {linear:.3} vs nonlinear {nonlinear:.3}"
    );
}

#[test]
fn tail_borders_extend_only_beyond_the_quantile_bins_and_every_bin_gets_a_share() {
    use megatron_data::tables::borders::{bin_shares, regression_borders, with_tails};
    let cfg = small();
    let body = regression_borders(&cfg, 1, 200, 16);
    let tails = [0.1, 2.5, 4.0, 8.0];
    let borders = with_tails(&body, &tails);
    assert_eq!(&borders[3..3 + body.len()], &body[..], "the body is kept");
    assert_eq!(&borders[..3], &[-8.0, -4.0, -2.5]);
    assert_eq!(&borders[3 + body.len()..], &[2.5, 4.0, 8.0]);
    assert_eq!(
        with_tails(&borders, &tails),
        borders,
        "extending twice adds nothing"
    );
    let shares = bin_shares(&cfg, 1, 200, &borders);
    assert_eq!(shares.len(), borders.len() + 1);
    assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    assert!(shares.iter().all(|&s| s > 0.0));
    // The body's bins hold about 1/16 each; the tails, beyond 2.5 sd, far less.
    for s in &shares[4..3 + body.len()] {
        assert!((s - 1.0 / 16.0).abs() < 0.02, "{shares:?}");
    }
    assert!(shares[..3].iter().sum::<f64>() < 1.0 / 16.0, "{shares:?}");
}

/// Real tables have skewed columns reaching 5-10 standard deviations (breast_cancer's
/// "error" columns reach 12); a normal or uniform root through standardised nodes rarely
/// does. Log-normal roots give the prior such columns, and linear tables keep them related.
#[test]
fn the_prior_draws_heavy_tailed_columns() {
    let cfg = PriorConfig {
        max_missing: 0.0,
        linear_table_share: 1.0,
        ..small()
    };
    let (mut cells, mut beyond4, mut tables_beyond6) = (0usize, 0usize, 0usize);
    for i in 0..300 {
        let t = sample_table(&cfg, 5, i);
        let mut widest = 0.0f64;
        for c in 0..t.cols {
            if t.categories[c] > 0 {
                continue;
            }
            let col: Vec<f64> = (0..t.rows)
                .map(|r| t.values[r * t.cols + c] as f64)
                .collect();
            let n = col.len() as f64;
            let mean = col.iter().sum::<f64>() / n;
            let sd = (col.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
            if sd < 1e-9 {
                continue;
            }
            for v in &col {
                let z = ((v - mean) / sd).abs();
                cells += 1;
                beyond4 += usize::from(z > 4.0);
                widest = widest.max(z);
            }
        }
        tables_beyond6 += usize::from(widest > 6.0);
    }
    let share = beyond4 as f64 / cells as f64;
    println!("cells beyond 4 sd: {share:.5}; tables with a cell beyond 6 sd: {tables_beyond6}/300");
    // A normal column has 0.006 % of its cells beyond 4 sd; without log-normal roots this
    // prior had 0.11 % and 78 such tables, with them 0.31 % and 122.
    assert!(share > 0.002, "{share}");
    assert!(tables_beyond6 >= 100, "{tables_beyond6}");
}
