//! Fine-tuning a trained checkpoint with tail bins (`--tabular-tail-borders` on a checkpoint
//! whose borders stop short of them): each bin of the old head that the new borders cut is
//! split, every piece starting as a copy of the old bin's row (weights and Adam moments) with
//! its bias moved by the log of the piece's share of the prior's mass in the old bin. The grown
//! head gives every old bin the probability it had and divides a split one as the prior does,
//! so training goes on from the trained model rather than from a new head (function-preserving
//! growth, as in Net2Net: Chen et al. 2016).

use crate::checkpointing::ckpt_err;
use crate::TrainError;
use std::collections::HashMap;
use std::path::Path;

/// The head tensors over bins, each under its own name and Adam's moment prefixes.
const BIN_HEADS: [&str; 2] = ["tabular.head.bins", "tabular.head.cells"];

/// For each bin of `new` borders, the bin of `old` borders it lies in; `None` unless every old
/// border is a new one.
pub fn old_bin_of(old: &[f32], new: &[f32]) -> Option<Vec<usize>> {
    if !old.iter().all(|b| new.contains(b)) {
        return None;
    }
    Some(
        (0..=new.len())
            .map(|j| match new.get(j) {
                Some(&upper) => old.partition_point(|&b| b < upper),
                None => old.len(),
            })
            .collect(),
    )
}

/// Grows the bin heads in `tensors` (whole tensors by name; `moments` names the prefixes of
/// Adam's moments, which are copied where present) from `old` borders to `new` ones; `shares`
/// is the prior's mass in each new bin.
pub fn split_bins(
    tensors: &mut HashMap<String, (Vec<usize>, Vec<f32>)>,
    old: &[f32],
    new: &[f32],
    shares: &[f64],
    moments: &[&str],
    path: &Path,
) -> Result<(), TrainError> {
    let of = old_bin_of(old, new).ok_or_else(|| {
        ckpt_err(
            path,
            format!("its bin borders {old:?} are not all among the new borders {new:?}"),
        )
    })?;
    assert_eq!(shares.len(), of.len(), "one share per new bin");
    let mut within = vec![0.0f64; old.len() + 1];
    for (&o, &s) in of.iter().zip(shares) {
        within[o] += s;
    }
    let shift: Vec<f32> = of
        .iter()
        .zip(shares)
        .map(|(&o, &s)| (s / within[o]).ln() as f32)
        .collect();
    for head in BIN_HEADS {
        for prefix in std::iter::once("").chain(moments.iter().copied()) {
            for (part, shifted) in [("weight", false), ("bias", prefix.is_empty())] {
                let name = format!("{prefix}{head}.{part}");
                let Some((shape, data)) = tensors.get_mut(&name) else {
                    if prefix.is_empty() {
                        return Err(ckpt_err(path, format!("tensor {name} is missing")));
                    }
                    continue;
                };
                if shape.first() != Some(&(old.len() + 1)) {
                    return Err(ckpt_err(
                        path,
                        format!(
                            "tensor {name} has shape {shape:?}; its borders give {} bins",
                            old.len() + 1
                        ),
                    ));
                }
                let row = data.len() / (old.len() + 1);
                let mut grown = Vec::with_capacity(row * of.len());
                for (j, &o) in of.iter().enumerate() {
                    let src = &data[o * row..(o + 1) * row];
                    if shifted {
                        grown.extend(src.iter().map(|v| v + shift[j]));
                    } else {
                        grown.extend_from_slice(src);
                    }
                }
                shape[0] = of.len();
                *data = grown;
            }
        }
    }
    Ok(())
}
