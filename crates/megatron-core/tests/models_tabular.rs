//! The tabular model's layer: gradients against central differences, and the attention pattern
//! it promises (padding never read; a query row's cells never reach another row).

use megatron_core::models::tabular::{TableShape, TabularConfig, TabularLayer};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_core::{Grads, Params};
use megatron_tensor::{RngKey, Tensor};

const E: usize = 8;
const ROWS: usize = 6;
const COLS: usize = 4;
const VALID_COLS: [usize; 2] = [3, 4];
const CONTEXT: [usize; 2] = [3, 4];
/// Real rows per table (context + queries); the rest is padding.
const REAL_ROWS: [usize; 2] = [5, 6];

/// Central differences (step 1e-2) on `coords` coordinates spread over each of `tensors` (every
/// parameter when empty) against `grads`, each within 1e-3 + 5 % of the analytic value;
/// returns how many were checked and how many exceed `significant` in magnitude.
fn check_parameter_gradients(
    params: &mut Params,
    grads: &Grads,
    tensors: &[megatron_core::ParamId],
    coords: usize,
    significant: f32,
    loss: impl Fn(&Params) -> f64,
) -> (usize, usize) {
    let eps = 1e-2f32;
    let metas: Vec<_> = if tensors.is_empty() {
        params.metas.clone()
    } else {
        tensors
            .iter()
            .map(|id| params.metas[id.0].clone())
            .collect()
    };
    let (mut checked, mut above) = (0, 0);
    for meta in metas {
        for k in 0..coords {
            let i = meta.offset + (meta.numel * (2 * k + 1)) / (2 * coords);
            let orig = params.data[i];
            params.data[i] = orig + eps;
            let fp = loss(params);
            params.data[i] = orig - eps;
            let fm = loss(params);
            params.data[i] = orig;
            let (fd, an) = ((fp - fm) / (2.0 * eps as f64), grads.data[i] as f64);
            assert!(
                (fd - an).abs() <= 1e-3 + 5e-2 * an.abs(),
                "{}[{}]: finite difference {fd} vs analytic {an}",
                meta.name,
                i - meta.offset
            );
            checked += 1;
            above += usize::from(an.abs() > significant as f64);
        }
    }
    (checked, above)
}

fn config() -> TabularConfig {
    TabularConfig {
        emb: E,
        heads: 2,
        ffn: 16,
        layers: 1,
        init_std: 0.3,
        eps: 1e-5,
    }
}

fn build() -> (TabularLayer, Params) {
    let mut params = Params::for_tp_rank(0, 1);
    let mut inits = Vec::new();
    let layer = TabularLayer::new(&config(), 0, &mut params, &mut inits);
    params.initialize(11, &inits);
    (layer, params)
}

fn shape() -> TableShape<'static> {
    TableShape {
        b: 2,
        rows: ROWS,
        cols: COLS,
        valid_cols: &VALID_COLS,
        context_rows: &CONTEXT,
    }
}

fn real(cell: usize) -> bool {
    let (t, r, c) = (cell / (ROWS * COLS), (cell / COLS) % ROWS, cell % COLS);
    r < REAL_ROWS[t] && c < VALID_COLS[t]
}

/// `n` standard normal values from `seed`.
fn normals(n: usize, seed: u64) -> Vec<f32> {
    let k = RngKey::new(seed);
    (0..n).map(|i| k.normal(i as u64)).collect()
}

fn input() -> Vec<f32> {
    normals(2 * ROWS * COLS * E, 5)
}

/// `sum(w * out)` over real cells, with `w` fixed random weights.
fn weights() -> Vec<f32> {
    let k = RngKey::new(6);
    (0..2 * ROWS * COLS * E)
        .map(|i| if real(i / E) { k.normal(i as u64) } else { 0.0 })
        .collect()
}

fn forward(layer: &TabularLayer, params: &Params, x: &[f32]) -> Vec<f32> {
    let mut g = serial_group();
    let mut tp = Tp::new(&mut g, false);
    let xt = Tensor::from_vec(&[x.len() / E, E], x.to_vec()).unwrap();
    let (y, _) = layer
        .forward(params, &mut tp, xt, &shape(), &StepContext::eval())
        .unwrap();
    y.data().to_vec()
}

fn loss(layer: &TabularLayer, params: &Params, x: &[f32]) -> f64 {
    let w = weights();
    forward(layer, params, x)
        .iter()
        .zip(&w)
        .map(|(a, b)| (*a as f64) * (*b as f64))
        .sum()
}

#[test]
fn tabular_layer_backward_matches_finite_difference() {
    let (layer, mut params) = build();
    let x = input();
    let mut g = serial_group();
    let mut tp = Tp::new(&mut g, false);
    let mut grads = Grads::zeros_like(&params);
    let xt = Tensor::from_vec(&[x.len() / E, E], x.clone()).unwrap();
    let ctx = StepContext::eval();
    let (_, saved) = layer.forward(&params, &mut tp, xt, &shape(), &ctx).unwrap();
    let w = weights();
    let dy = Tensor::from_vec(&[x.len() / E, E], w.clone()).unwrap();
    let dx = layer
        .backward(&params, &mut grads, &mut tp, saved, dy, &shape())
        .unwrap();
    let eps = 1e-2f32;
    let check = |name: &str, fd: f64, an: f64| {
        assert!(
            (fd - an).abs() <= 1e-3 + 5e-2 * an.abs(),
            "{name}: finite difference {fd} vs analytic {an}"
        );
    };
    let (checked, significant) =
        check_parameter_gradients(&mut params, &grads, &[], 3, 0.05, |p| loss(&layer, p, &x));
    assert!(checked >= 3 * 10, "{checked} coordinates");
    // The check sees real gradients, not a pile of zeros passing on the absolute tolerance.
    assert!(
        significant * 2 >= checked,
        "{significant} of {checked} gradients above 0.05"
    );
    // Input gradient: cells of context rows, query rows and both tables.
    for cell in [0usize, 5, 13, 17, 30, 41, 46] {
        for j in [0, E - 1] {
            let i = cell * E + j;
            let mut xp = x.clone();
            xp[i] += eps;
            let mut xm = x.clone();
            xm[i] -= eps;
            let fd = (loss(&layer, &params, &xp) - loss(&layer, &params, &xm)) / (2.0 * eps as f64);
            check(&format!("input cell {cell}[{j}]"), fd, dx.data()[i] as f64);
        }
    }
}

#[test]
fn padding_is_never_read_and_query_rows_reach_only_themselves() {
    let (layer, params) = build();
    let x = input();
    let base = forward(&layer, &params, &x);
    let changed_cells = |x2: &[f32]| -> Vec<usize> {
        let y = forward(&layer, &params, x2);
        (0..y.len() / E)
            .filter(|&c| real(c) && (0..E).any(|j| y[c * E + j] != base[c * E + j]))
            .collect()
    };
    // A padding column and a padding row of table 0.
    for cell in [3usize, 5 * COLS + 1] {
        assert!(!real(cell));
        let mut x2 = x.clone();
        x2[cell * E] += 10.0;
        assert!(
            changed_cells(&x2).is_empty(),
            "padding cell {cell} was read"
        );
    }
    // A query cell of table 1 (row 5): only its own row changes.
    let cell = ROWS * COLS + 5 * COLS + 2;
    let mut x2 = x.clone();
    x2[cell * E] += 1.0;
    let changed = changed_cells(&x2);
    assert!(!changed.is_empty());
    assert!(
        changed.iter().all(|&c| c / COLS == cell / COLS),
        "a query row reached other rows: {changed:?}"
    );
    // A context cell of table 1 reaches other rows (through column attention), never table 0.
    let cell = ROWS * COLS + COLS + 1;
    let mut x2 = x.clone();
    x2[cell * E] += 1.0;
    let changed = changed_cells(&x2);
    assert!(changed.iter().any(|&c| c / COLS != cell / COLS));
    assert!(changed.iter().all(|&c| c >= ROWS * COLS), "table 0 changed");
}

#[test]
fn tabular_layer_at_tensor_parallel_2_matches_one_rank() {
    let x = input();
    let w = weights();
    let run = move |tp_rank: usize, tp_size: usize, tp: &mut Tp| {
        let mut params = Params::for_tp_rank(tp_rank, tp_size);
        let mut inits = Vec::new();
        let layer = TabularLayer::new(&config(), 0, &mut params, &mut inits);
        params.initialize(11, &inits);
        let xt = Tensor::from_vec(&[x.len() / E, E], x.clone()).unwrap();
        let ctx = StepContext::eval();
        let (y, saved) = layer.forward(&params, tp, xt, &shape(), &ctx).unwrap();
        let mut grads = Grads::zeros_like(&params);
        let dy = Tensor::from_vec(&[x.len() / E, E], w.clone()).unwrap();
        let dx = layer
            .backward(&params, &mut grads, tp, saved, dy, &shape())
            .unwrap();
        let norm = params
            .find("tabular.layers.0.column_attention.norm.weight")
            .unwrap();
        (
            y.data().to_vec(),
            dx.data().to_vec(),
            grads.get(norm).to_vec(),
        )
    };
    let mut g = serial_group();
    let one = run(0, 1, &mut Tp::new(&mut g, false));
    let out = megatron_comm::run_ranks(2, move |rank, c| run(rank, 2, &mut Tp::new(c, false)));
    for (rank, r) in out.into_iter().enumerate() {
        let r = r.unwrap();
        for (what, a, b) in [
            ("output", &one.0, &r.0),
            ("input gradient", &one.1, &r.1),
            ("norm gradient", &one.2, &r.2),
        ] {
            let err = a
                .iter()
                .zip(b)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0f32, f32::max);
            assert!(err < 1e-5, "rank {rank} {what}: max difference {err}");
        }
    }
}

#[test]
fn cell_embedding_gradient_through_a_layer_matches_finite_difference() {
    use megatron_core::models::tabular::CellEmbedding;
    use megatron_tensor::cpu::table_features::FEATURES;
    let mut params = Params::for_tp_rank(0, 1);
    let mut inits = Vec::new();
    let emb = CellEmbedding::new(E, 0.3, &mut params, &mut inits);
    let layer = TabularLayer::new(&config(), 0, &mut params, &mut inits);
    params.initialize(3, &inits);
    let cells = 2 * ROWS * COLS;
    let feats = Tensor::from_vec(&[cells, FEATURES], normals(cells * FEATURES, 8)).unwrap();
    let w = weights();
    let ctx = StepContext::eval();
    let loss = |params: &Params| -> f64 {
        let mut g = serial_group();
        let mut tp = Tp::new(&mut g, false);
        let x = emb.forward(params, &feats);
        let (y, _) = layer.forward(params, &mut tp, x, &shape(), &ctx).unwrap();
        y.data()
            .iter()
            .zip(&w)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum()
    };
    let mut g = serial_group();
    let mut tp = Tp::new(&mut g, false);
    let x = emb.forward(&params, &feats);
    let (_, saved) = layer.forward(&params, &mut tp, x, &shape(), &ctx).unwrap();
    let mut grads = Grads::zeros_like(&params);
    let dy = Tensor::from_vec(&[cells, E], w.clone()).unwrap();
    let dx = layer
        .backward(&params, &mut grads, &mut tp, saved, dy, &shape())
        .unwrap();
    emb.backward(&params, &mut grads, &feats, &dx);
    let (checked, _) =
        check_parameter_gradients(&mut params, &grads, &[emb.weight, emb.bias], 4, 0.0, loss);
    assert_eq!(checked, 8);
}

#[test]
fn head_gradients_match_finite_difference_for_classes_and_bins() {
    use megatron_core::models::tabular::{bin_of, HeadRows, TabularHead, Task, BINS};
    let mut params = Params::for_tp_rank(0, 1);
    let mut inits = Vec::new();
    let head = TabularHead::new(E, BINS, 0.5, 1e-5, &mut params, &mut inits);
    params.initialize(4, &inits);
    let cells = 2 * ROWS * COLS;
    let y = Tensor::from_vec(&[cells, E], normals(cells * E, 12)).unwrap();
    // Table 0 (classification, 3 classes): query rows 3 and 4; table 1 (regression): row 5.
    let class_rows = HeadRows {
        cells: &[(3 * COLS) as u32, (4 * COLS) as u32],
        targets: &[2, 0],
        valid: &[3, 3],
        weights: &[0.25, 0.25],
    };
    let borders: Vec<f32> = (1..BINS)
        .map(|i| -2.0 + 4.0 * i as f32 / BINS as f32)
        .collect();
    let bin = bin_of(0.3, &borders);
    assert!(bin > 0 && (bin as usize) < BINS);
    let reg_rows = HeadRows {
        cells: &[((ROWS + 5) * COLS) as u32],
        targets: &[bin],
        valid: &[0],
        weights: &[0.5],
    };
    let mut grads = Grads::zeros_like(&params);
    let mut dy = Tensor::zeros(&[cells, E]);
    let backward = Some((&mut grads, &mut dy));
    let l = head.loss(&params, &y, &class_rows, Task::Classification, backward);
    let backward = Some((&mut grads, &mut dy));
    let l = l + head.loss(&params, &y, &reg_rows, Task::Regression, backward);
    let loss_only = |params: &Params, y: &Tensor| {
        head.loss(params, y, &class_rows, Task::Classification, None)
            + head.loss(params, y, &reg_rows, Task::Regression, None)
    };
    assert_eq!(l.to_bits(), loss_only(&params, &y).to_bits());
    let eps = 1e-2f32;
    let check = |name: &str, fd: f64, an: f64| {
        assert!(
            (fd - an).abs() <= 1e-3 + 5e-2 * an.abs(),
            "{name}: finite difference {fd} vs analytic {an}"
        );
    };
    check_parameter_gradients(&mut params, &grads, &[], 3, 0.0, |p| loss_only(p, &y));
    for i in [3 * COLS * E, 4 * COLS * E + 3, (ROWS + 5) * COLS * E + 7, 0] {
        let mut yp = y.clone();
        yp.data_mut()[i] += eps;
        let mut ym = y.clone();
        ym.data_mut()[i] -= eps;
        let fd = (loss_only(&params, &yp) - loss_only(&params, &ym)) / (2.0 * eps as f64);
        check(&format!("output cell element {i}"), fd, dy.data()[i] as f64);
    }
    // Cells the head does not read get no gradient.
    assert!(dy.data()[..3 * COLS * E].iter().all(|&v| v == 0.0));
}

mod whole_model {
    use super::*;
    use megatron_core::models::tabular::{HiddenCell, TabularBatch, TabularModel, BINS};
    use megatron_tensor::cpu::TableInputs;

    const R: usize = 6;
    const C: usize = 3;

    const HIDDEN: [HiddenCell; 2] = [
        HiddenCell {
            table: 0,
            row: 1,
            col: 0,
            value: 0.7,
        },
        HiddenCell {
            table: 1,
            row: 4,
            col: 2,
            value: -1.1,
        },
    ];

    struct Data {
        values: Vec<f32>,
        missing: Vec<f32>,
        row_valid: Vec<f32>,
        col_valid: Vec<f32>,
        targets: Vec<f32>,
        borders: Vec<f32>,
    }

    /// Table 0: 3 classes, 3 context and 2 query rows, 2 columns. Table 1: regression, 4 context
    /// and 2 query rows, 3 columns, one cell missing. Two cells hidden for reconstruction
    /// (marked missing; their true values in `HIDDEN`).
    fn data() -> Data {
        let mut values = normals(2 * R * C, 21);
        let mut missing = vec![0.0; 2 * R * C];
        missing[R * C + 2 * C + 1] = 1.0;
        values[R * C + 2 * C + 1] = 0.0;
        for h in HIDDEN {
            missing[(h.table * R + h.row) * C + h.col] = 1.0;
            values[(h.table * R + h.row) * C + h.col] = 0.0;
        }
        let mut row_valid = vec![1.0; 2 * R];
        row_valid[5] = 0.0;
        let col_valid = vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
        let targets = vec![0.0, 2.0, 1.0, 1.0, 2.0, 0.0, 0.3, -1.2, 2.5, 0.9, 1.7, -0.4];
        let borders = (1..BINS)
            .map(|i| -2.0 + 4.0 * i as f32 / BINS as f32)
            .collect();
        Data {
            values,
            missing,
            row_valid,
            col_valid,
            targets,
            borders,
        }
    }

    fn batch(d: &Data) -> TabularBatch<'_> {
        TabularBatch {
            inputs: TableInputs {
                b: 2,
                rows: R,
                cols: C,
                values: &d.values,
                missing: &d.missing,
                row_valid: &d.row_valid,
                col_valid: &d.col_valid,
                targets: &d.targets,
                context_rows: &[3, 4],
                classes: &[3, 0],
            },
            real_rows: &[5, 6],
            real_cols: &[2, 3],
            ids: RngKey::new(2),
            borders: &d.borders,
            step_tables: 2,
            hidden: &HIDDEN,
            reconstruction_weight: 0.5,
        }
    }

    #[test]
    fn tabular_model_gradient_matches_finite_difference() {
        let cfg = TabularConfig {
            layers: 2,
            ..config()
        };
        let (model, mut params) = TabularModel::new(cfg, BINS, 5, 0, 1);
        let d = data();
        let b = batch(&d);
        let ctx = StepContext::eval();
        let loss = |params: &Params| {
            let mut g = serial_group();
            model
                .forward_backward(params, None, &mut Tp::new(&mut g, false), &b, &ctx)
                .unwrap()
        };
        let mut g = serial_group();
        let mut grads = Grads::zeros_like(&params);
        let l = model
            .forward_backward(
                &params,
                Some(&mut grads),
                &mut Tp::new(&mut g, false),
                &b,
                &ctx,
            )
            .unwrap();
        assert!(
            (l - loss(&params)).abs() < 1e-9,
            "loss with and without gradients"
        );
        // An untrained model's loss is near chance: log(classes) and log(bins) averaged over the
        // tables, plus half of log(bins) for the reconstruction.
        let chance = 0.5 * (3f64.ln() + (BINS as f64).ln()) + 0.5 * (BINS as f64).ln();
        assert!((l - chance).abs() < 1.0, "loss {l} vs chance {chance}");
        let (checked, significant) =
            check_parameter_gradients(&mut params, &grads, &[], 3, 0.01, loss);
        assert!(checked >= 3 * 25, "{checked}");
        // A hidden cell's stored value is never read (only its missing flag is): no leak.
        let mut leaky = data();
        let h = HIDDEN[1];
        leaky.values[(h.table * R + h.row) * C + h.col] = 123.0;
        let mut g = serial_group();
        let l2 = model
            .forward_backward(
                &params,
                None,
                &mut Tp::new(&mut g, false),
                &batch(&leaky),
                &ctx,
            )
            .unwrap();
        assert_eq!(l2.to_bits(), loss(&params).to_bits());
        // Most checked gradients are well above the absolute tolerance.
        assert!(
            significant * 2 >= checked,
            "{significant} of {checked} above 0.01"
        );
    }

    #[test]
    fn tabular_model_at_tensor_parallel_2_matches_one_rank() {
        let cfg = TabularConfig {
            layers: 2,
            ..config()
        };
        let run = move |rank: usize, size: usize, tp: &mut Tp| {
            let (model, params) = TabularModel::new(cfg, BINS, 5, rank, size);
            let d = data();
            let mut grads = Grads::zeros_like(&params);
            let loss = model
                .forward_backward(
                    &params,
                    Some(&mut grads),
                    tp,
                    &batch(&d),
                    &StepContext::eval(),
                )
                .unwrap();
            // Replicated parameters: the embedding and the head's class weights.
            let pick = |name: &str| grads.get(params.find(name).unwrap()).to_vec();
            (
                loss,
                pick("tabular.embedding.weight"),
                pick("tabular.head.classes.weight"),
            )
        };
        let mut g = serial_group();
        let one = run(0, 1, &mut Tp::new(&mut g, false));
        let out = megatron_comm::run_ranks(2, move |r, c| run(r, 2, &mut Tp::new(c, false)));
        for (rank, r) in out.into_iter().enumerate() {
            let r = r.unwrap();
            assert!(
                (r.0 - one.0).abs() <= 1e-5 * one.0.abs(),
                "rank {rank} loss {} vs {}",
                r.0,
                one.0
            );
            for (what, a, b) in [("embedding", &one.1, &r.1), ("head", &one.2, &r.2)] {
                let err = a
                    .iter()
                    .zip(b)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    err < 1e-5,
                    "rank {rank} {what} gradient: max difference {err}"
                );
            }
        }
    }
}

#[test]
fn full_recomputation_groups_layers_as_megatrons_methods_do() {
    use megatron_core::models::tabular::layer_groups;
    use megatron_core::transformer::step::{Recompute, RecomputeMethod};
    let full = |method, num_layers| Recompute::Full { method, num_layers };
    // uniform: every group of num_layers layers keeps only its input and runs again.
    assert_eq!(
        layer_groups(full(RecomputeMethod::Uniform, 2), 5),
        vec![(0..2, true), (2..4, true), (4..5, true)]
    );
    // block: the first num_layers layers are recomputed one by one, the rest keep everything.
    assert_eq!(
        layer_groups(full(RecomputeMethod::Block, 2), 4),
        vec![(0..1, true), (1..2, true), (2..3, false), (3..4, false)]
    );
    assert_eq!(
        layer_groups(Recompute::None, 2),
        vec![(0..1, false), (1..2, false)]
    );
}
