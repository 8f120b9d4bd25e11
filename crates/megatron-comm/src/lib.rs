//! Ranks, groups and communicators of megatron-rs.

pub mod communicator;
pub mod conformance;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod parallel_state;
pub mod process_groups;
pub mod thread_comm;
pub mod typed;

pub use communicator::{reborrow, CommError, CommStats, Communicator, ReduceOp};
pub use parallel_state::{Axis, Coords, ParallelError, ParallelState};
pub use process_groups::{Group, ProcessGroups};
pub use thread_comm::{run_ranks, run_ranks_until_failure, RankOutcome, ThreadCommunicator};
pub use typed::TypedCollectives;
