//! The tabular foundation model's trainer and its use on real tables (issue 18): flags, the
//! step's micro-batches, checkpoints, evaluation, and prediction / imputation / anomaly scores.

pub mod arguments;
pub mod batch;
pub mod checkpoint;
pub mod commands;
pub mod evaluate;
pub mod frame;
pub mod impute;
pub mod inference;
pub mod linear_base;
pub mod tail_bins;
pub mod trainer;

pub use arguments::{validate, ResumeSchedule, TabularArgs, TabularTrainConfig};
pub use trainer::{pretrain_tabular, TabularSummary};
