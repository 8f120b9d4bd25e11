//! The `Communicator` trait: MPI/NCCL verbs on element slices, with timeouts that name what did
//! not arrive and per-operation counters of calls and bytes.

use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CommError {
    #[error("group {group}: {op} #{seq} timed out after {timeout:?}; ranks {missing:?} of the group did not arrive")]
    Timeout {
        group: String,
        op: &'static str,
        seq: u64,
        timeout: Duration,
        missing: Vec<usize>,
    },
    #[error("group {group}: {op} #{seq} aborted: rank {rank} panicked")]
    PeerPanicked {
        group: String,
        op: &'static str,
        seq: u64,
        rank: usize,
    },
    #[error("group {group}: {op} #{seq} aborted: rank {rank} stopped with an error")]
    PeerFailed {
        group: String,
        op: &'static str,
        seq: u64,
        rank: usize,
    },
    #[error("group {group}: {op}: {msg}")]
    Usage {
        group: String,
        op: &'static str,
        msg: String,
    },
}

/// Calls and bytes moved per operation name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommStats {
    pub calls: BTreeMap<&'static str, u64>,
    pub bytes: BTreeMap<&'static str, u64>,
}

/// MPI/NCCL-style collectives over f32 slices (other element types reduce through f32).
/// All members of a group must call the same operations in the same order.
pub trait Communicator: Send {
    /// Rank within this group.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Name used in errors and statistics (e.g. `world`, `tp[0,1]`).
    fn name(&self) -> &str;
    fn set_timeout(&mut self, timeout: Duration);

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;
    /// `out` (`size * input.len()`) receives every rank's input in rank order.
    fn all_gather(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError>;
    /// Reduces `input` (`size * out.len()`) over ranks; rank r keeps slice r.
    fn reduce_scatter(
        &mut self,
        input: &[f32],
        out: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError>;
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Equal splits: part q of this rank's input goes to rank q; part q of the output came
    /// from rank q.
    fn all_to_all(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError>;
    /// Variable splits: `send_counts[q]` elements (in rank order) go to rank q; `recv_counts[q]`
    /// elements arrive from rank q, in rank order in `out`.
    fn all_to_all_v(
        &mut self,
        input: &[f32],
        send_counts: &[usize],
        out: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError>;
    fn send(&mut self, buf: &[f32], dst: usize, tag: u64) -> Result<(), CommError>;
    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u64) -> Result<(), CommError>;
    fn barrier(&mut self) -> Result<(), CommError>;
    /// Ranks calling with the same `color` form a new group, ordered by `key` then rank.
    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        let name = format!("{}/{color}", self.name());
        self.split_named(color, key, &name)
    }
    /// `split`, naming the new group (e.g. `tp[0, 1]`) for errors and statistics.
    fn split_named(
        &mut self,
        color: usize,
        key: usize,
        name: &str,
    ) -> Result<Box<dyn Communicator>, CommError>;
    fn stats(&self) -> CommStats;
}

/// Reborrows an optional group for one operation. (`Option::as_deref_mut` cannot: the trait
/// object's lifetime is invariant behind `&mut`, so it would keep the whole borrow alive.)
pub fn reborrow<'s>(
    comm: &'s mut Option<&mut dyn Communicator>,
) -> Option<&'s mut dyn Communicator> {
    match comm {
        Some(c) => Some(&mut **c),
        None => None,
    }
}
