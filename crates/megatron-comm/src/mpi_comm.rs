//! The MPI backend (cargo feature `mpi`): one process per rank, started by `mpirun`/`srun`;
//! the way past one machine. Groups come from communicator splits. Buffers above 2^30 elements
//! are sent in chunks (MPI counts are 32-bit). MPI calls block: the timeout set on this
//! communicator is not enforced here (MPI has no portable cancellation); the thread backend's
//! timeouts are the tested ones.

use crate::communicator::{CommError, CommStats, Communicator, ReduceOp};
use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Destination, Root, Source};
use std::time::Duration;

const CHUNK: usize = 1 << 30;

pub struct MpiCommunicator {
    comm: SimpleCommunicator,
    name: String,
    stats: CommStats,
    timeout: Duration,
}

/// True when this process was started by `mpirun`, `mpiexec` or `srun` with several ranks.
pub fn launched_by_mpi() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "SLURM_NTASKS",
    ]
    .iter()
    .any(|v| {
        std::env::var(v)
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .is_some_and(|n| n >= 1)
    })
}

// SAFETY: an MPI communicator handle is moved between threads, never shared (`&mut self` on
// every call); callers keep all MPI calls of a process on one thread at a time, which MPI allows
// from MPI_THREAD_SERIALIZED up (the launcher makes them from the thread that initialized MPI).
unsafe impl Send for MpiCommunicator {}

impl MpiCommunicator {
    pub fn world(universe: &mpi::environment::Universe) -> Self {
        MpiCommunicator {
            comm: universe.world(),
            name: "world".into(),
            stats: CommStats::default(),
            timeout: Duration::from_secs(300),
        }
    }

    fn count(&mut self, op: &'static str, bytes: usize) {
        *self.stats.calls.entry(op).or_default() += 1;
        *self.stats.bytes.entry(op).or_default() += bytes as u64;
    }

    fn usage(&self, op: &'static str, msg: String) -> CommError {
        CommError::Usage {
            group: self.name.clone(),
            op,
            msg,
        }
    }
}

/// Initializes MPI; the universe must outlive every communicator made from it.
pub fn initialize_world() -> Option<(mpi::environment::Universe, MpiCommunicator)> {
    let universe = mpi::initialize()?;
    let comm = MpiCommunicator::world(&universe);
    Some((universe, comm))
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }
    fn size(&self) -> usize {
        self.comm.size() as usize
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.count("all_reduce", buf.len() * 4);
        for chunk in buf.chunks_mut(CHUNK) {
            let send = chunk.to_vec();
            self.comm.all_reduce_into(&send[..], chunk, system_op(op));
        }
        if op == ReduceOp::Avg {
            let s = 1.0 / self.size() as f32;
            buf.iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        if out.len() != input.len() * self.size() {
            return Err(self.usage(
                "all_gather",
                format!(
                    "output holds {} elements, expected {}",
                    out.len(),
                    input.len() * self.size()
                ),
            ));
        }
        if input.len() > CHUNK {
            return Err(self.usage(
                "all_gather",
                "inputs above 2^30 elements are not supported".into(),
            ));
        }
        self.count("all_gather", out.len() * 4);
        self.comm.all_gather_into(input, out);
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        input: &[f32],
        out: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if input.len() != out.len() * self.size() {
            return Err(self.usage(
                "reduce_scatter",
                format!(
                    "input holds {} elements, expected {}",
                    input.len(),
                    out.len() * self.size()
                ),
            ));
        }
        self.count("reduce_scatter", input.len() * 4);
        self.comm
            .reduce_scatter_block_into(input, out, system_op(op));
        if op == ReduceOp::Avg {
            let s = 1.0 / self.size() as f32;
            out.iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.size() {
            return Err(self.usage(
                "broadcast",
                format!("root {root} outside the group of {}", self.size()),
            ));
        }
        self.count("broadcast", buf.len() * 4);
        for chunk in buf.chunks_mut(CHUNK) {
            self.comm.process_at_rank(root as i32).broadcast_into(chunk);
        }
        Ok(())
    }

    fn all_to_all(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        if !input.len().is_multiple_of(self.size()) || out.len() != input.len() {
            return Err(self.usage(
                "all_to_all",
                "input must split into equal parts; output of the same size".into(),
            ));
        }
        self.count("all_to_all", input.len() * 4);
        self.comm.all_to_all_into(input, out);
        Ok(())
    }

    fn all_to_all_v(
        &mut self,
        input: &[f32],
        send_counts: &[usize],
        out: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let p = self.size();
        if send_counts.len() != p
            || recv_counts.len() != p
            || send_counts.iter().sum::<usize>() != input.len()
            || recv_counts.iter().sum::<usize>() != out.len()
        {
            return Err(self.usage("all_to_all_v", "counts must match the buffers".into()));
        }
        self.count("all_to_all_v", input.len() * 4);
        let displs = |c: &[usize]| -> Vec<i32> {
            c.iter()
                .scan(0i32, |acc, &x| {
                    let d = *acc;
                    *acc += x as i32;
                    Some(d)
                })
                .collect()
        };
        let (sc, rc): (Vec<i32>, Vec<i32>) = (
            send_counts.iter().map(|&c| c as i32).collect(),
            recv_counts.iter().map(|&c| c as i32).collect(),
        );
        let (sd, rd) = (displs(send_counts), displs(recv_counts));
        let send = Partition::new(input, &sc[..], &sd[..]);
        let mut recv = PartitionMut::new(out, &rc[..], &rd[..]);
        self.comm.all_to_all_varcount_into(&send, &mut recv);
        Ok(())
    }

    fn send(&mut self, buf: &[f32], dst: usize, tag: u64) -> Result<(), CommError> {
        self.count("send", buf.len() * 4);
        self.comm
            .process_at_rank(dst as i32)
            .send_with_tag(buf, tag as i32);
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u64) -> Result<(), CommError> {
        self.count("recv", buf.len() * 4);
        self.comm
            .process_at_rank(src as i32)
            .receive_into_with_tag(buf, tag as i32);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.count("barrier", 0);
        self.comm.barrier();
        Ok(())
    }

    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        self.count("split", 0);
        let sub = self
            .comm
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| self.usage("split", "MPI returned no communicator".into()))?;
        Ok(Box::new(MpiCommunicator {
            comm: sub,
            name: format!("{}/{color}", self.name),
            stats: CommStats::default(),
            timeout: self.timeout,
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}
