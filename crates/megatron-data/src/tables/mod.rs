//! Tables for the tabular foundation model: the synthetic prior it is pre-trained on
//! (random causal graphs, edge functions, post-processing, targets) its loader,
//! and real tables read from CSV files.

pub mod batching;
pub mod borders;
pub mod csv;
pub mod dag;
pub mod edge;
pub mod loader;
pub mod postprocess;
pub mod prior;
pub mod stream;

pub use csv::{CsvError, CsvTable};
pub use loader::PriorLoader;
pub use prior::{sample_table, PriorConfig, Table, Target};
