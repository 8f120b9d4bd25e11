//! The tabular model learns in context: trained on fresh tables whose label is a rule of the
//! row's features (a new table, new values, every step), its query loss falls well below chance.
//! This is what a prior-trained checkpoint relies on; a wiring fault (queries that cannot see the
//! context's labels, features that do not reach the target cell) leaves the loss at chance.

use megatron_core::models::tabular::{TabularBatch, TabularConfig, TabularModel, BINS};
use megatron_core::optimizer::Adam;
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_core::Grads;
use megatron_tensor::cpu::TableInputs;
use megatron_tensor::RngKey;

const CONTEXT: usize = 32;
const QUERIES: usize = 16;
const ROWS: usize = CONTEXT + QUERIES;
const COLS: usize = 2;
const TABLES: usize = 8;

struct Lcg(u64);
impl Lcg {
    fn normal(&mut self) -> f32 {
        let mut u = || {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (a, b) = (u(), u());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
}

/// Query-row loss of one step on fresh tables: label = [x_w > 0] for a column w drawn per table.
fn step(
    model: &TabularModel,
    params: &mut megatron_core::Params,
    adam: &mut Adam,
    rng: &mut Lcg,
    lr: f32,
) -> f64 {
    let mut values = vec![0.0f32; TABLES * ROWS * COLS];
    let mut targets = vec![0.0f32; TABLES * ROWS];
    for t in 0..TABLES {
        let w = (rng.normal() > 0.0) as usize;
        let shift = rng.normal();
        for r in 0..ROWS {
            for c in 0..COLS {
                values[(t * ROWS + r) * COLS + c] = rng.normal() + shift;
            }
            targets[t * ROWS + r] = (values[(t * ROWS + r) * COLS + w] > shift) as u32 as f32;
        }
    }
    let missing = vec![0.0f32; values.len()];
    let row_valid = vec![1.0f32; TABLES * ROWS];
    let col_valid = vec![1.0f32; TABLES * COLS];
    let borders: Vec<f32> = (1..BINS)
        .map(|i| -3.0 + 6.0 * i as f32 / BINS as f32)
        .collect();
    let context = [CONTEXT; TABLES];
    let classes = [2u32; TABLES];
    let batch = TabularBatch {
        inputs: TableInputs {
            b: TABLES,
            rows: ROWS,
            cols: COLS,
            values: &values,
            missing: &missing,
            row_valid: &row_valid,
            col_valid: &col_valid,
            targets: &targets,
            context_rows: &context,
            classes: &classes,
        },
        real_rows: &[ROWS; TABLES],
        real_cols: &[COLS; TABLES],
        ids: RngKey::new(rng.0),
        borders: &borders,
        step_tables: TABLES,
        hidden: &[],
        reconstruction_weight: 0.0,
    };
    let mut g = serial_group();
    let mut grads = Grads::zeros_like(params);
    let loss = model
        .forward_backward(
            params,
            Some(&mut grads),
            &mut Tp::new(&mut g, false),
            &batch,
            &StepContext::eval(),
        )
        .unwrap();
    adam.step(params, &grads, lr, 0.0);
    loss
}

#[test]
fn tabular_model_learns_a_threshold_rule_in_context() {
    let cfg = TabularConfig {
        emb: 32,
        heads: 4,
        ffn: 64,
        layers: 2,
        init_std: 0.02,
        eps: 1e-5,
    };
    let (model, mut params) = TabularModel::new(cfg, BINS, 1, 0, 1);
    let mut adam = Adam::new(&params, 0.9, 0.999, 1e-8);
    let mut rng = Lcg(7);
    let mut losses = Vec::new();
    for i in 0..400 {
        let l = step(&model, &mut params, &mut adam, &mut rng, 1e-3);
        if i % 25 == 0 {
            eprintln!("step {i} loss {l:.4}");
        }
        losses.push(l);
    }
    let last: f64 = losses[losses.len() - 50..].iter().sum::<f64>() / 50.0;
    assert!(
        last < 0.35,
        "last-50 mean query loss {last:.3} vs chance {:.3}",
        2f64.ln()
    );
}
