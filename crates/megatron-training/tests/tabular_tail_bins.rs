//! Growing a trained head's bins at tail borders (`tabular::tail_bins`): every old bin keeps its
//! probability, a split one is divided as the prior's shares say, Adam's moments follow their
//! rows, and a run resumed with tail borders trains on with the grown head.

mod common;

use common::{tabular_args, tmpdir};
use megatron_core::models::tabular::{TabularHead, Task};
use megatron_core::Params;
use megatron_data::tables::borders::with_tails;
use megatron_tensor::Tensor;
use megatron_training::tabular::checkpoint::scatter_whole;
use megatron_training::tabular::tail_bins::{old_bin_of, split_bins};
use megatron_training::tabular::{pretrain_tabular, validate};
use std::collections::HashMap;
use std::path::Path;

const E: usize = 8;

fn head(bins: usize) -> (TabularHead, Params) {
    let mut params = Params::for_tp_rank(0, 1);
    let mut inits = Vec::new();
    let head = TabularHead::new(E, bins, 0.7, 1e-5, &mut params, &mut inits);
    params.initialize(9, &inits);
    (head, params)
}

fn softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

#[test]
fn split_bins_keep_every_old_bin_probability_and_divide_a_split_one_by_the_shares() {
    let old = [-1.0f32, -0.5, 0.0, 0.5, 1.0];
    let new = with_tails(&old, &[0.75, 1.5, 2.5]);
    assert_eq!(new, vec![-2.5, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.5]);
    let of = old_bin_of(&old, &new).unwrap();
    assert_eq!(of, vec![0, 0, 0, 1, 2, 3, 4, 5, 5, 5]);

    let (old_head, mut old_params) = head(old.len() + 1);
    // Biases start at zero: give them values so that the shift is visible.
    for (i, m) in old_params.metas.clone().iter().enumerate() {
        if m.name.ends_with(".bias") {
            for (k, v) in old_params.data[m.offset..m.offset + m.numel]
                .iter_mut()
                .enumerate()
            {
                *v = ((i * 7 + k * 3) % 11) as f32 * 0.3 - 1.5;
            }
        }
    }
    let mut tensors: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
    for m in &old_params.metas {
        let w = old_params.data[m.offset..m.offset + m.numel].to_vec();
        let moment: Vec<f32> = w.iter().map(|v| v * 10.0 + 1.0).collect();
        tensors.insert(
            format!("optimizer.exp_avg.{}", m.name),
            (m.shape.clone(), moment),
        );
        tensors.insert(m.name.clone(), (m.shape.clone(), w));
    }
    let shares: Vec<f64> = (0..new.len() + 1).map(|j| 0.02 + 0.01 * j as f64).collect();
    let path = Path::new("ckpt");
    split_bins(
        &mut tensors,
        &old,
        &new,
        &shares,
        &["optimizer.exp_avg."],
        path,
    )
    .unwrap();

    let (new_head, mut new_params) = head(new.len() + 1);
    let mut local = new_params.data.clone();
    scatter_whole(&new_params, &tensors, "", &mut local, path).unwrap();
    new_params.data = local;

    let rows = 5;
    let y: Vec<f32> = (0..rows * E)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.4)
        .collect();
    let y = Tensor::from_vec(&[rows, E], y).unwrap();
    let cells: Vec<u32> = (0..rows as u32).collect();
    for task in [Task::Regression, Task::Reconstruction] {
        let lo = old_head.logits(&old_params, &y, &cells, task);
        let ln = new_head.logits(&new_params, &y, &cells, task);
        for r in 0..rows {
            let p_old = softmax(&lo.data()[r * (old.len() + 1)..][..old.len() + 1]);
            let p_new = softmax(&ln.data()[r * (new.len() + 1)..][..new.len() + 1]);
            for (o, &po) in p_old.iter().enumerate() {
                let pieces: Vec<usize> = (0..of.len()).filter(|&j| of[j] == o).collect();
                let sum: f64 = pieces.iter().map(|&j| p_new[j]).sum();
                assert!(
                    (sum - po).abs() < 1e-5,
                    "row {r} old bin {o}: {sum} vs {po}"
                );
                for &j in &pieces {
                    let within: f64 = pieces.iter().map(|&k| shares[k]).sum();
                    let want = po * shares[j] / within;
                    assert!(
                        (p_new[j] - want).abs() < 1e-5,
                        "row {r} new bin {j}: {} vs {want}",
                        p_new[j]
                    );
                }
            }
        }
    }
    // Adam's moments: each new row is its old bin's row, unshifted.
    let (shape, m) = &tensors["optimizer.exp_avg.tabular.head.bins.bias"];
    assert_eq!(shape, &vec![new.len() + 1]);
    let w = old_params
        .metas
        .iter()
        .find(|m| m.name == "tabular.head.bins.bias");
    let w = w.unwrap();
    let old_bias = &old_params.data[w.offset..w.offset + w.numel];
    for (j, &o) in of.iter().enumerate() {
        assert_eq!(m[j], old_bias[o] * 10.0 + 1.0, "moment row {j}");
    }
}

#[test]
fn split_bins_refuse_borders_that_drop_an_old_one_by_checkpoint() {
    let old = [-1.0f32, 0.0, 1.0];
    let new = [-2.0f32, -1.0, 0.5, 1.0, 2.0];
    assert!(old_bin_of(&old, &new).is_none());
    let (_, params) = head(old.len() + 1);
    let mut tensors: HashMap<String, (Vec<usize>, Vec<f32>)> = params
        .metas
        .iter()
        .map(|m| {
            let w = params.data[m.offset..m.offset + m.numel].to_vec();
            (m.name.clone(), (m.shape.clone(), w))
        })
        .collect();
    let err = split_bins(
        &mut tensors,
        &old,
        &new,
        &[0.2; 6],
        &[],
        Path::new("runs/ck/iter_0000002"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("runs/ck/iter_0000002") && err.contains("borders"),
        "{err}"
    );
}

fn bins_of(s: &megatron_training::tabular::TabularSummary) -> usize {
    s.params
        .iter()
        .find(|(n, _)| n == "tabular.head.bins.bias")
        .map(|(_, v)| v.len())
        .expect("a bins head")
}

#[test]
fn a_run_resumed_with_tail_borders_grows_the_checkpoint_s_bins_and_trains_on() {
    let dir = tmpdir("tabular-tail-bins");
    let (first, second) = (dir.join("first"), dir.join("second"));
    let train = |extra: &[&str]| {
        pretrain_tabular(validate(&tabular_args(extra)).expect("valid flags")).expect("trains")
    };
    let body = train(&[
        "--train-iters",
        "2",
        "--tabular-tail-borders",
        "--save",
        first.to_str().unwrap(),
    ]);
    assert_eq!(bins_of(&body), 32, "no tail bins without tail borders");
    let grown = train(&[
        "--train-iters",
        "4",
        "--tabular-tail-borders",
        "2.5,3.5,5",
        "--load",
        first.to_str().unwrap(),
        "--save",
        second.to_str().unwrap(),
    ]);
    assert_eq!(grown.start_iteration, 2);
    assert_eq!(bins_of(&grown), 38, "three tail borders on each side");
    assert!(grown.losses.iter().all(|(_, l)| l.is_finite()));
    // Resumed again with the same tails, the grown checkpoint is already wide enough.
    let again = train(&[
        "--train-iters",
        "5",
        "--tabular-tail-borders",
        "2.5,3.5,5",
        "--load",
        second.to_str().unwrap(),
    ]);
    assert_eq!(bins_of(&again), 38);
    let bad = validate(&tabular_args(&["--tabular-tail-borders", "3,2"]))
        .unwrap_err()
        .to_string();
    assert!(bad.contains("--tabular-tail-borders"), "{bad}");
}
