//! Megatron-core in Rust: transformer layers with explicit forward/backward pairs, models,
//! parameter storage and the optimizer.

pub mod context_parallel;
pub mod distributed;
pub mod inference;
pub mod models;
pub mod optimizer;
pub mod params;
pub mod pipeline_parallel;
pub mod tensor_parallel;
pub mod transformer;

pub use models::gpt::{Batch, GPTModel};
pub use params::{Grads, ParamId, ParamMeta, Params};
pub use transformer::config::{ConfigError, TransformerConfig};
