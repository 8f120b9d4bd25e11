//! Device backends. Only the CPU exists today; a CUDA backend slots in beside it.
pub mod cpu;
