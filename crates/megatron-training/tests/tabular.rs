//! `megatron train --model tabular`: every layout trains the same model as one rank, a resumed
//! run continues exactly, checkpoints refuse damage, and flags it cannot honour are refused.

mod common;

use common::{tabular_args, tmpdir};
use megatron_training::tabular::{pretrain_tabular, validate, TabularSummary};

fn train(extra: &[&str]) -> TabularSummary {
    pretrain_tabular(validate(&tabular_args(extra)).expect("valid flags")).expect("trains")
}

/// Losses within `tol` (relative, floor 1) and every parameter within `tol` (absolute).
fn assert_same_model(what: &str, a: &TabularSummary, b: &TabularSummary, tol: f64) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: iterations");
    for (x, y) in a.losses.iter().zip(&b.losses) {
        assert_eq!(x.0, y.0);
        assert!(
            (x.1 - y.1).abs() <= tol * x.1.abs().max(1.0),
            "{what} iteration {}: loss {} vs {}",
            x.0,
            x.1,
            y.1
        );
    }
    assert_eq!(a.params.len(), b.params.len());
    for ((n, p), (m, q)) in a.params.iter().zip(&b.params) {
        assert_eq!(n, m);
        let worst = p
            .iter()
            .zip(q)
            .map(|(u, v)| (u - v).abs() as f64)
            .fold(0.0, f64::max);
        assert!(worst <= tol, "{what}: {n} differs by {worst}");
    }
}

#[test]
fn tabular_training_lowers_the_loss_and_reports_every_iteration() {
    let s = train(&["--train-iters", "12", "--lr", "1e-2"]);
    assert_eq!(s.losses.len(), 12);
    let first: f64 = s.losses[..3].iter().map(|l| l.1).sum();
    let last: f64 = s.losses[9..].iter().map(|l| l.1).sum();
    assert!(
        last < first,
        "loss did not fall: first three {first}, last three {last}"
    );
}

#[test]
fn tabular_training_at_data_parallel_2_matches_one_rank() {
    let one = train(&[]);
    let two = train(&["--nproc-per-node", "2"]);
    assert_same_model("DP 2 vs 1", &one, &two, 2e-5);
}

#[test]
fn tabular_training_at_tensor_parallel_2_matches_one_rank() {
    let one = train(&[]);
    let two = train(&["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]);
    assert_same_model("TP 2 vs 1", &one, &two, 2e-5);
}

#[test]
fn tabular_training_with_rows_split_over_2_context_parallel_ranks_matches_one_rank() {
    let one = train(&[]);
    let two = train(&["--nproc-per-node", "2", "--context-parallel-size", "2"]);
    assert_same_model("CP 2 vs 1", &one, &two, 2e-5);
}

#[test]
fn tabular_training_at_tp_2_cp_2_dp_2_matches_one_rank() {
    let one = train(&[]);
    let eight = train(&[
        "--nproc-per-node",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--num-threads",
        "8",
    ]);
    assert_same_model("TP 2 x CP 2 x DP 2 vs 1", &one, &eight, 2e-5);
}

#[test]
fn full_recomputation_trains_the_tabular_model_bit_identically() {
    // Recomputed layers run the same forward again: the same losses and parameters, bit for
    // bit, with uniform groups of 2 and with the first layer recomputed alone (block); also
    // with the rows split over context-parallel ranks, whose collectives run again.
    let one = train(&["--num-layers", "3"]);
    for flags in [
        &[
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "2",
        ][..],
        &["--recompute-method", "block", "--recompute-num-layers", "1"][..],
    ] {
        let mut v = vec!["--num-layers", "3", "--recompute-granularity", "full"];
        v.extend_from_slice(flags);
        assert_same_model(&format!("{flags:?}"), &one, &train(&v), 0.0);
    }
    let cp = [
        "--num-layers",
        "3",
        "--nproc-per-node",
        "2",
        "--context-parallel-size",
        "2",
    ];
    let plain = train(&cp);
    let mut v = cp.to_vec();
    v.extend_from_slice(&["--recompute-granularity", "full"]);
    assert_same_model("CP 2 with recomputation", &plain, &train(&v), 0.0);
}

#[test]
fn tabular_resume_from_a_checkpoint_continues_exactly() {
    let dir = tmpdir("tabular-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let whole = train(&["--save", s, "--save-interval", "2"]);
    // Resume from iteration 2 (the tracker names 4: point it back at 2).
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "2\n").unwrap();
    let resumed = train(&["--load", s]);
    assert_eq!(resumed.start_iteration, 2);
    assert_eq!(resumed.losses, whole.losses[2..].to_vec());
    assert_eq!(resumed.params, whole.params);
}

/// A resumed run keeps the checkpoint's learning-rate schedule, unless
/// `--override-opt_param-scheduler` takes it from the flags, at the checkpoint's step count.
#[test]
fn override_opt_param_scheduler_takes_the_flags_schedule_on_resume() {
    let dir = tmpdir("tabular-override-scheduler");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let sched = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine"];
    let mut first = sched.to_vec();
    first.extend_from_slice(&["--save", s, "--save-interval", "2"]);
    let whole = train(&first);
    let resume = |extra: &[&str]| {
        std::fs::write(save.join("latest_checkpointed_iteration.txt"), "2\n").unwrap();
        let mut v = sched.to_vec();
        v.extend_from_slice(&["--load", s]);
        v.extend_from_slice(extra);
        train(&v)
    };
    let kept = resume(&["--lr", "5e-2"]);
    assert_eq!(
        kept.params, whole.params,
        "the checkpoint's schedule was not kept"
    );
    let same = resume(&["--override-opt_param-scheduler"]);
    assert_eq!(
        same.params, whole.params,
        "the step count was not carried over"
    );
    let other = resume(&["--lr", "5e-2", "--override-opt_param-scheduler"]);
    assert_eq!(
        other.losses[0], whole.losses[2],
        "the first resumed step reads the saved model"
    );
    assert_ne!(
        other.params, whole.params,
        "the flags' learning rate was not used"
    );
}

#[test]
fn a_damaged_tabular_checkpoint_is_refused_by_name() {
    let dir = tmpdir("tabular-damage");
    let save = dir.join("ckpt");
    train(&["--train-iters", "1", "--save", save.to_str().unwrap()]);
    let file = save.join("iter_0000001/model_optim.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    std::fs::write(&file, bytes).unwrap();
    let cfg = validate(&tabular_args(&["--load", save.to_str().unwrap()])).unwrap();
    let err = pretrain_tabular(cfg).unwrap_err().to_string();
    assert!(
        err.contains("model_optim.safetensors") && err.contains("damaged"),
        "{err}"
    );
    // Nothing looks complete that is not: no partial directory is left behind either.
    assert!(!save.join("iter_0000001.partial").exists());
}

#[test]
fn tabular_flags_it_cannot_honour_are_refused_by_name() {
    for (flags, named) in [
        (
            vec!["--pipeline-model-parallel-size", "2"],
            "--pipeline-model-parallel-size",
        ),
        (vec!["--bf16"], "--bf16"),
        (
            vec!["--context-parallel-size", "2"],
            "--context-parallel-size",
        ),
        (vec!["--tabular-cell-budget", "64"], "--tabular-cell-budget"),
        (vec!["--hidden-size", "0"], "--hidden-size must be positive"),
        (vec!["--num-layers", "0"], "--num-layers must be positive"),
        (vec!["--recompute-activations"], "--recompute-granularity"),
        (
            vec!["--override-opt_param-scheduler"],
            "--override-opt_param-scheduler",
        ),
        (vec!["--prior-linear-share", "1.5"], "--prior-linear-share"),
        (vec!["--optimizer", "sgd"], "--optimizer sgd"),
        (vec!["--squared-relu"], "--squared-relu"),
        (
            vec!["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
            "--nproc-per-node",
        ),
    ] {
        let err = validate(&tabular_args(&flags)).unwrap_err().to_string();
        assert!(err.contains(named), "{flags:?}: {err}");
    }
}

/// The predictor reads the model as training scores it: on a prior table, minus the mean log
/// probability it gives the query rows' classes equals the training loss of that table (with
/// the same column identities and nothing hidden).
#[test]
fn predicted_probabilities_match_the_training_loss() {
    use megatron_core::models::tabular::{TabularBatch, TabularConfig, TabularModel, BINS};
    use megatron_core::tensor_parallel::{serial_group, Tp};
    use megatron_core::transformer::step::StepContext;
    use megatron_data::tables::batching::collate;
    use megatron_data::tables::{sample_table, PriorConfig, Target};
    use megatron_tensor::RngKey;
    use megatron_training::tabular::inference::{InferenceTable, Predictor};

    let cfg = TabularConfig {
        emb: 16,
        heads: 4,
        ffn: 32,
        layers: 2,
        init_std: 0.2,
        eps: 1e-5,
    };
    let (model, params) = TabularModel::new(cfg, BINS, 3, 0, 1);
    let prior = PriorConfig {
        max_context_rows: 40,
        max_query_rows: 12,
        max_features: 5,
        regression_share: 0.0,
        ..PriorConfig::default()
    };
    let borders: Vec<f32> = (0..BINS - 1).map(|i| i as f32 * 0.2 - 3.0).collect();
    let mut checked = 0;
    for index in 0..8 {
        let t = sample_table(&prior, 9, index);
        let Target::Classes { k, labels } = &t.target else {
            continue;
        };
        let seed = 77;
        let b = collate(&[&t]);
        let batch = TabularBatch {
            inputs: b.inputs(),
            real_rows: &[t.rows],
            real_cols: &[t.cols],
            ids: RngKey::new(seed).fold(0),
            borders: &borders,
            step_tables: 1,
            hidden: &[],
            reconstruction_weight: 0.0,
        };
        let mut g = serial_group();
        let mut tp = Tp::new(&mut g, false);
        let loss = model
            .forward_backward(&params, None, &mut tp, &batch, &StepContext::eval())
            .unwrap();
        let table = InferenceTable {
            rows: t.rows,
            cols: t.cols,
            context_rows: t.context_rows,
            values: t.values.clone(),
            targets: labels.iter().map(|&l| l as f32).collect(),
            classes: *k,
        };
        let p = Predictor {
            model: &model,
            params: &params,
            borders: &borders,
            max_context: usize::MAX,
        };
        let r = p.read(&table, &[], 1, seed).unwrap();
        let nll: f64 = r
            .queries
            .iter()
            .zip(&labels[t.context_rows..])
            .map(|(p, &l)| -(p[l as usize] as f64).ln())
            .sum::<f64>()
            / (t.rows - t.context_rows) as f64;
        assert!(
            (nll - loss).abs() < 1e-4 * loss.max(1.0),
            "table {index}: predictor {nll} vs training loss {loss}"
        );
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} classification tables drawn");
}

/// `--tabular-eval-data`: each real table's metrics at every evaluation, classes or values,
/// also when the prior draws no regression tables (the bins still exist for reconstruction).
#[test]
fn real_tables_are_evaluated_like_validation_loss() {
    let dir = tmpdir("tabular-eval");
    let (cls, reg) = (dir.join("cls.csv"), dir.join("reg.csv"));
    let (mut a, mut b) = (String::from("x,y,label\n"), String::from("x,y,value\n"));
    for i in 0..40 {
        let (x, y) = ((i % 9) as f32 - 4.0, (i % 4) as f32);
        a += &format!("{x},{y},{}\n", u8::from(x > 0.0));
        b += &format!("{x},{y},{}\n", 2.0 * x + y + 0.5);
    }
    std::fs::write(&cls, a).unwrap();
    std::fs::write(&reg, b).unwrap();
    let s = train(&[
        "--prior-regression-share",
        "0",
        "--eval-interval",
        "2",
        "--tabular-eval-data",
        cls.to_str().unwrap(),
        reg.to_str().unwrap(),
    ]);
    assert_eq!(s.evals.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 4]);
    for (_, tables) in &s.evals {
        let (c, r) = (&tables[0], &tables[1]);
        assert_eq!((c.name.as_str(), r.name.as_str()), ("cls.csv", "reg.csv"));
        let acc = c.accuracy.expect("classes give an accuracy");
        assert!((0.0..=1.0).contains(&acc) && c.log_loss.unwrap() > 0.0);
        assert!(c.rmse.is_none() && r.accuracy.is_none());
        assert!(r.rmse.unwrap() > 0.0 && r.r2.unwrap() <= 1.0);
        assert!(c.reconstruction_rmse.is_finite() && r.reconstruction_rmse > 0.0);
    }
}

/// A context larger than the model's training context is subsampled per ensemble member: the
/// reading keeps one answer per query row, is the same for the same seed, and with the limit
/// at the context's size equals the reading of the whole table.
#[test]
fn predictor_subsamples_a_context_larger_than_training_s() {
    use megatron_core::models::tabular::{TabularConfig, TabularModel, BINS};
    use megatron_training::tabular::inference::{InferenceTable, Predictor};
    let cfg = TabularConfig {
        emb: 16,
        heads: 4,
        ffn: 32,
        layers: 2,
        init_std: 0.2,
        eps: 1e-5,
    };
    let (model, params) = TabularModel::new(cfg, BINS, 3, 0, 1);
    let borders: Vec<f32> = (0..BINS - 1).map(|i| i as f32 * 0.2 - 3.0).collect();
    let (rows, cols, context) = (50, 3, 40);
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37) % 11) as f32 - 5.0)
        .collect();
    let table = InferenceTable {
        rows,
        cols,
        context_rows: context,
        values,
        targets: (0..rows).map(|r| (r % 3) as f32).collect(),
        classes: 3,
    };
    let read = |max_context: usize, seed: u64| {
        Predictor {
            model: &model,
            params: &params,
            borders: &borders,
            max_context,
        }
        .read(&table, &[], 2, seed)
        .unwrap()
        .queries
    };
    let whole = read(context, 5);
    assert_eq!(whole, read(usize::MAX, 5), "no subsampling at the limit");
    let sub = read(16, 5);
    assert_eq!(sub.len(), rows - context);
    assert!(sub
        .iter()
        .all(|p| (p.iter().sum::<f32>() - 1.0).abs() < 1e-5));
    assert_eq!(sub, read(16, 5), "one seed, one reading");
    assert_ne!(sub, whole, "a 16-row context reads differently");
}
