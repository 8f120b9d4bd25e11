//! Ranks, groups and (next) the communicators of megatron-rs.

pub mod parallel_state;

pub use parallel_state::{Axis, Coords, ParallelError, ParallelState};
