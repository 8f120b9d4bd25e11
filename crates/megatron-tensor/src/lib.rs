//! The tensor engine of megatron-rs: a small `Tensor` type, a buffer pool, counter-based random
//! numbers, and the device kernels. Models call kernels through [`backend::cpu`] entry points; no
//! model loops over raw floats.

pub mod alloc;
pub mod backend;
pub mod dtype;
pub mod pool;
pub mod rng;
pub mod tensor;
pub mod threads;

pub use backend::cpu;
pub use dtype::DType;
pub use rng::RngKey;
pub use tensor::{Device, Tensor, TensorError};
