//! Megatron's `BlendedDataset` indices (`helpers.cpp: build_blending_indices`): sample `i` comes
//! from the dataset furthest below its share, `argmax_d(w_d * max(i, 1) - count_d)` (first
//! maximum wins), so the blend interleaves datasets at their ratios deterministically.

/// `(dataset_index, dataset_sample_index)` for `size` samples.
pub fn build_blending_indices(weights: &[f64], size: usize) -> (Vec<i16>, Vec<i64>) {
    let mut counts = vec![0i64; weights.len()];
    let mut di = Vec::with_capacity(size);
    let mut si = Vec::with_capacity(size);
    for i in 0..size {
        let x = (i.max(1)) as f64;
        let mut best = 0;
        let mut best_err = f64::NEG_INFINITY;
        for (d, w) in weights.iter().enumerate() {
            let err = w * x - counts[d] as f64;
            if err > best_err {
                best_err = err;
                best = d;
            }
        }
        di.push(best as i16);
        si.push(counts[best]);
        counts[best] += 1;
    }
    (di, si)
}

/// Megatron's `build_exhaustive_blending_indices`: every sample of each dataset (`sizes`), in
/// proportion to the sizes, for a blend without a size (an unweighted `--data-path` under
/// `num_samples=None`); a dataset leaves the choice once it is spent.
pub fn build_exhaustive_blending_indices(sizes: &[u64]) -> (Vec<i16>, Vec<i64>) {
    let total: u64 = sizes.iter().sum();
    let weights: Vec<f64> = sizes.iter().map(|&n| n as f64 / total as f64).collect();
    let mut counts = vec![0u64; sizes.len()];
    let mut di = Vec::with_capacity(total as usize);
    let mut si = Vec::with_capacity(total as usize);
    for i in 0..total {
        let x = (i as f64).max(1.0);
        let mut best = None;
        let mut best_err = f64::NEG_INFINITY;
        for (d, w) in weights.iter().enumerate() {
            if counts[d] == sizes[d] {
                continue;
            }
            let err = w * x - counts[d] as f64;
            if err > best_err {
                best_err = err;
                best = Some(d);
            }
        }
        let best = best.expect("a dataset with samples left while the total is not reached");
        di.push(best as i16);
        si.push(counts[best] as i64);
        counts[best] += 1;
    }
    (di, si)
}

/// Whether a `--data-path`-style list gives weights (`w1 p1 w2 p2 ...`); Megatron infers an
/// unweighted list's weights from the datasets' lengths.
pub fn blend_is_weighted(args: &[String]) -> bool {
    args.len().is_multiple_of(2) && args.first().is_some_and(|a| a.parse::<f64>().is_ok())
}

/// Samples each dataset must provide for a blend of `size`: `ceil(ceil(size * w) * (1 + surplus))`
/// (Megatron's `--mid-level-dataset-surplus`, default 0.005).
pub fn per_dataset_samples(weights: &[f64], size: usize, surplus: f64) -> Vec<u64> {
    weights
        .iter()
        .map(|w| ((size as f64 * w).ceil() * (1.0 + surplus)).ceil() as u64)
        .collect()
}

/// Parses `--data-path`: `A B` (equal weights) or `0.3 A 0.7 B`; weights are normalized.
pub fn parse_blend(args: &[String]) -> Result<Vec<(f64, String)>, crate::DataError> {
    let bad = |m: String| crate::DataError::Format {
        path: "--data-path".into(),
        msg: m,
    };
    if args.is_empty() {
        return Err(bad("no dataset given".into()));
    }
    let weighted = args.len().is_multiple_of(2) && args[0].parse::<f64>().is_ok();
    let pairs: Vec<(f64, String)> = if weighted {
        args.chunks(2)
            .map(|c| {
                let w = c[0].parse::<f64>().map_err(|_| {
                    bad(format!(
                        "'{}' is not a weight (expected weight prefix pairs)",
                        c[0]
                    ))
                })?;
                if !(w >= 0.0 && w.is_finite()) {
                    return Err(bad(format!("weight {w} must be non-negative")));
                }
                Ok((w, c[1].clone()))
            })
            .collect::<Result<_, _>>()?
    } else {
        args.iter().map(|p| (1.0, p.clone())).collect()
    };
    let sum: f64 = pairs.iter().map(|p| p.0).sum();
    if sum <= 0.0 {
        return Err(bad("weights must sum to something positive".into()));
    }
    Ok(pairs.into_iter().map(|(w, p)| (w / sum, p)).collect())
}
