//! The MPI backend (cargo feature `mpi`): one process per rank, started by `mpirun`/`srun`;
//! the way past one machine. Groups come from communicator splits. Buffers above 2^30 elements
//! are sent in chunks (MPI counts are 32-bit); all-reduce and broadcast stage 2^22 elements at a
//! time.
//!
//! Timeouts: MPI has no portable way to cancel a collective, so every operation is posted
//! non-blocking on buffers this communicator owns, then polled until it completes or the timeout
//! passes. On a timeout the pending operation and its buffers are leaked (MPI may still write
//! them if the missing rank arrives later; the caller's memory is never touched) and the
//! communicator refuses further calls, like an aborted NCCL communicator. Which ranks are missing
//! is learned from arrival notices: a rank that has waited a quarter of the timeout tells every
//! peer, on a duplicate communicator, which collective it is in; ranks from which no notice for
//! that collective came are the ones named.

use crate::communicator::{CommError, CommStats, Communicator, ReduceOp};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Source;
use std::ffi::c_void;
use std::time::{Duration, Instant};

const CHUNK: usize = 1 << 30;
/// Elements an all-reduce or broadcast stages per call: the staging buffers this communicator
/// keeps grow to the largest call, so element-wise collectives go in 16 MiB pieces instead of
/// holding two copies of the largest gradient bucket for the rest of the run.
const STAGE: usize = 1 << 22;
const NOTICE_TAG: i32 = 7;

/// MPI_Iallgather's and MPI_Ialltoall's shared signature.
type StagedCollective = unsafe extern "C" fn(
    *const c_void,
    std::ffi::c_int,
    ffi::MPI_Datatype,
    *mut c_void,
    std::ffi::c_int,
    ffi::MPI_Datatype,
    ffi::MPI_Comm,
    *mut ffi::MPI_Request,
) -> std::ffi::c_int;

/// Memory an in-flight MPI operation reads or writes; leaked if the operation times out.
#[derive(Default)]
struct Staging {
    send: Vec<f32>,
    recv: Vec<f32>,
    ints: Vec<i32>,
}

pub struct MpiCommunicator {
    comm: SimpleCommunicator,
    /// Duplicate of `comm` carrying arrival notices, so they never match user messages.
    side: SimpleCommunicator,
    name: String,
    stats: CommStats,
    timeout: Duration,
    /// Collectives started on this communicator (all members count the same sequence).
    seq: u64,
    /// Per group rank: the latest collective it said it was waiting in.
    arrived: Vec<u64>,
    /// Notice payloads MPI may still be sending; boxed so their addresses survive the vector
    /// growing.
    #[allow(clippy::vec_box)]
    notices: Vec<Box<[i64; 1]>>,
    staging: Staging,
    broken: Option<CommError>,
    /// Sends not yet delivered, with the buffers MPI reads them from: a send returns at once
    /// (like the thread backend's mailboxes), so pipeline neighbours can both send first.
    pending_sends: Vec<(ffi::MPI_Request, Vec<f32>)>,
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
// every call). The launcher initializes MPI with MPI_THREAD_SERIALIZED and keeps all calls on
// one thread, or with MPI_THREAD_MULTIPLE when `--overlap-grad-reduce` uses the data-parallel
// communicator from a second thread (each communicator still used by one thread at a time).
unsafe impl Send for MpiCommunicator {}

/// Initializes MPI; the universe must outlive every communicator made from it.
pub fn initialize_world() -> Option<(mpi::environment::Universe, MpiCommunicator)> {
    let universe = mpi::initialize()?;
    let comm = MpiCommunicator::world(&universe);
    Some((universe, comm))
}

fn system_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading MPI's predefined handles after initialization.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

fn float() -> ffi::MPI_Datatype {
    // SAFETY: a predefined handle.
    unsafe { ffi::RSMPI_FLOAT }
}

fn count(n: usize) -> i32 {
    i32::try_from(n).expect("chunked below 2^31 elements")
}

/// `out` = the first of `blocks`' `out.len()`-element blocks plus each later one, in order
/// (the blocks of ranks 0, 1, ...).
fn add_blocks_in_rank_order(out: &mut [f32], blocks: &[f32]) {
    let n = out.len();
    out.copy_from_slice(&blocks[..n]);
    for b in blocks.chunks_exact(n).skip(1) {
        out.iter_mut().zip(b).for_each(|(a, x)| *a += x);
    }
}

fn displacements(c: &[usize]) -> Vec<i32> {
    c.iter()
        .scan(0usize, |acc, &x| {
            let d = *acc;
            *acc += x;
            Some(count(d))
        })
        .collect()
}

impl MpiCommunicator {
    pub fn world(universe: &mpi::environment::Universe) -> Self {
        Self::wrap(universe.world(), "world".into(), Duration::from_secs(300))
    }

    fn wrap(comm: SimpleCommunicator, name: String, timeout: Duration) -> Self {
        let side = comm.duplicate();
        let n = comm.size() as usize;
        MpiCommunicator {
            comm,
            side,
            name,
            stats: CommStats::default(),
            timeout,
            seq: 0,
            arrived: vec![0; n],
            notices: Vec::new(),
            staging: Staging::default(),
            broken: None,
            pending_sends: Vec::new(),
        }
    }

    fn count(&mut self, op: &'static str, bytes: usize) -> Result<(), CommError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        *self.stats.calls.entry(op).or_default() += 1;
        *self.stats.bytes.entry(op).or_default() += bytes as u64;
        Ok(())
    }

    fn usage(&self, op: &'static str, msg: String) -> CommError {
        CommError::Usage {
            group: self.name.clone(),
            op,
            msg,
        }
    }

    fn raw(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }

    /// Records arrival notices that peers sent (possibly for earlier collectives).
    fn drain_notices(&mut self) {
        while let Some(status) = self.side.any_process().immediate_probe_with_tag(NOTICE_TAG) {
            let src = status.source_rank();
            let mut seq = [0i64; 1];
            self.side
                .process_at_rank(src)
                .receive_into_with_tag(&mut seq[..], NOTICE_TAG);
            let a = &mut self.arrived[src as usize];
            *a = (*a).max(seq[0] as u64);
        }
    }

    /// Tells every peer that this rank is waiting in collective `seq`.
    fn announce(&mut self, seq: u64) {
        let me = self.rank();
        for peer in 0..self.size() {
            if peer == me {
                continue;
            }
            let payload = Box::new([seq as i64]);
            let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: the payload box is kept in `self.notices` for the communicator's lifetime,
            // so it outlives the send; the request is released to complete on its own.
            unsafe {
                ffi::MPI_Isend(
                    payload.as_ptr() as *const c_void,
                    1,
                    ffi::RSMPI_INT64_T,
                    peer as i32,
                    NOTICE_TAG,
                    self.side.as_raw(),
                    &mut req,
                );
                ffi::MPI_Request_free(&mut req);
            }
            self.notices.push(payload);
        }
    }

    /// Polls `req` until it completes or the timeout passes. `peer` names the other side of a
    /// point-to-point operation; collectives learn who is missing from arrival notices.
    fn wait(
        &mut self,
        op: &'static str,
        mut req: ffi::MPI_Request,
        peer: Option<usize>,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        let notice_after = self.timeout / 4;
        let mut announced = false;
        self.drain_notices();
        loop {
            let mut flag = 0;
            // SAFETY: `req` is a live request returned by MPI for buffers in `self.staging`.
            unsafe {
                ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE);
            }
            if flag != 0 {
                return Ok(());
            }
            let waited = start.elapsed();
            if peer.is_none() && !announced && waited >= notice_after {
                self.announce(self.seq);
                announced = true;
            }
            if announced {
                self.drain_notices();
            }
            if waited >= self.timeout {
                // MPI may still complete the operation: its memory must stay valid forever.
                std::mem::forget(std::mem::take(&mut self.staging));
                let me = self.rank();
                let missing = match peer {
                    Some(p) => vec![p],
                    None => (0..self.size())
                        .filter(|&r| r != me && self.arrived[r] < self.seq)
                        .collect(),
                };
                let e = CommError::Timeout {
                    group: self.name.clone(),
                    op,
                    seq: self.seq,
                    timeout: self.timeout,
                    missing,
                };
                self.broken = Some(e.clone());
                return Err(e);
            }
            std::thread::yield_now();
        }
    }

    /// Drops the buffers of sends MPI has completed.
    fn retire_sends(&mut self) {
        self.pending_sends.retain_mut(|(req, _)| {
            let mut flag = 0;
            // SAFETY: a live request of a pending send.
            unsafe {
                ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE);
            }
            flag == 0
        });
    }

    /// `chunk` summed over the group in rank order, `((x0 + x1) + x2) + ...` as the thread
    /// backend adds, so a run gives the same bits under MPI as on rank threads and under any MPI
    /// library (an Allreduce adds in an order of the library's choosing: pairwise, in a ring,
    /// changing with the message size). An all-to-all of equal blocks, each rank's block summed
    /// in rank order, and an all-gather of the sums: the bytes a ring all-reduce moves.
    fn sum_in_rank_order(&mut self, chunk: &mut [f32]) -> Result<(), CommError> {
        let p = self.size();
        let blk = chunk.len().div_ceil(p);
        self.begin(blk * p, blk * p);
        self.staging.send[..chunk.len()].copy_from_slice(chunk);
        self.all_to_all_staged("all_reduce", blk)?;
        let Staging { send, recv, .. } = &mut self.staging;
        add_blocks_in_rank_order(&mut send[..blk], recv);
        // The all-gather counts as a collective of its own for the arrival notices.
        self.seq += 1;
        self.all_gather_staged("all_reduce", blk)?;
        chunk.copy_from_slice(&self.staging.recv[..chunk.len()]);
        Ok(())
    }

    /// An all-gather of the first `blk` elements of `staging.send` into `staging.recv`.
    fn all_gather_staged(&mut self, op: &'static str, blk: usize) -> Result<(), CommError> {
        self.staged(op, blk, ffi::MPI_Iallgather)
    }

    /// An all-to-all of `blk` elements per rank from `staging.send` into `staging.recv`
    /// (prepared by [`Self::begin`]).
    fn all_to_all_staged(&mut self, op: &'static str, blk: usize) -> Result<(), CommError> {
        self.staged(op, blk, ffi::MPI_Ialltoall)
    }

    /// `collective` (MPI's nonblocking all-gather or all-to-all, which take the same
    /// arguments) of `blk` f32 per rank from `staging.send` into `staging.recv`.
    fn staged(
        &mut self,
        op: &'static str,
        blk: usize,
        collective: StagedCollective,
    ) -> Result<(), CommError> {
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the staging buffers live until completion (or forever after a timeout), and
        // the send and receive buffers do not overlap.
        unsafe {
            collective(
                self.staging.send.as_ptr() as *const c_void,
                count(blk),
                float(),
                self.staging.recv.as_mut_ptr() as *mut c_void,
                count(blk),
                float(),
                self.raw(),
                &mut req,
            );
        }
        self.wait(op, req, None)
    }

    /// Starts a collective: the next sequence number, and a staging area of the given sizes.
    fn begin(&mut self, send: usize, recv: usize) {
        self.seq += 1;
        let s = &mut self.staging;
        s.send.clear();
        s.send.resize(send, 0.0);
        s.recv.clear();
        s.recv.resize(recv, 0.0);
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
        self.count("all_reduce", buf.len() * 4)?;
        for chunk in buf.chunks_mut(STAGE) {
            if matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
                self.sum_in_rank_order(chunk)?;
                continue;
            }
            self.begin(chunk.len(), chunk.len());
            self.staging.send.copy_from_slice(chunk);
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: staging buffers live until completion (or forever after a timeout).
            unsafe {
                ffi::MPI_Iallreduce(
                    self.staging.send.as_ptr() as *const c_void,
                    self.staging.recv.as_mut_ptr() as *mut c_void,
                    count(chunk.len()),
                    float(),
                    system_op(op),
                    self.raw(),
                    &mut req,
                );
            }
            self.wait("all_reduce", req, None)?;
            chunk.copy_from_slice(&self.staging.recv);
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
        if out.len() > CHUNK {
            return Err(self.usage(
                "all_gather",
                "outputs above 2^30 elements are not supported".into(),
            ));
        }
        self.count("all_gather", out.len() * 4)?;
        self.begin(input.len(), out.len());
        self.staging.send.copy_from_slice(input);
        self.all_gather_staged("all_gather", input.len())?;
        out.copy_from_slice(&self.staging.recv);
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
        if input.len() > CHUNK {
            return Err(self.usage(
                "reduce_scatter",
                "inputs above 2^30 elements are not supported".into(),
            ));
        }
        self.count("reduce_scatter", input.len() * 4)?;
        if matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            if !out.is_empty() {
                self.begin(input.len(), input.len());
                self.staging.send.copy_from_slice(input);
                self.all_to_all_staged("reduce_scatter", out.len())?;
                add_blocks_in_rank_order(out, &self.staging.recv);
            }
            if op == ReduceOp::Avg {
                let s = 1.0 / self.size() as f32;
                out.iter_mut().for_each(|v| *v *= s);
            }
            return Ok(());
        }
        self.begin(input.len(), out.len());
        self.staging.send.copy_from_slice(input);
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: as in `all_reduce`.
        unsafe {
            ffi::MPI_Ireduce_scatter_block(
                self.staging.send.as_ptr() as *const c_void,
                self.staging.recv.as_mut_ptr() as *mut c_void,
                count(out.len()),
                float(),
                system_op(op),
                self.raw(),
                &mut req,
            );
        }
        self.wait("reduce_scatter", req, None)?;
        out.copy_from_slice(&self.staging.recv);
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
        self.count("broadcast", buf.len() * 4)?;
        for chunk in buf.chunks_mut(STAGE) {
            self.begin(0, chunk.len());
            self.staging.recv.copy_from_slice(chunk);
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: as in `all_reduce`.
            unsafe {
                ffi::MPI_Ibcast(
                    self.staging.recv.as_mut_ptr() as *mut c_void,
                    count(chunk.len()),
                    float(),
                    root as i32,
                    self.raw(),
                    &mut req,
                );
            }
            self.wait("broadcast", req, None)?;
            chunk.copy_from_slice(&self.staging.recv);
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
        if input.len() > CHUNK {
            return Err(self.usage(
                "all_to_all",
                "inputs above 2^30 elements are not supported".into(),
            ));
        }
        self.count("all_to_all", input.len() * 4)?;
        self.begin(input.len(), out.len());
        self.staging.send.copy_from_slice(input);
        self.all_to_all_staged("all_to_all", input.len() / self.size())?;
        out.copy_from_slice(&self.staging.recv);
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
        if input.len() > CHUNK || out.len() > CHUNK {
            return Err(self.usage(
                "all_to_all_v",
                "buffers above 2^30 elements are not supported".into(),
            ));
        }
        self.count("all_to_all_v", input.len() * 4)?;
        self.begin(input.len(), out.len());
        self.staging.send.copy_from_slice(input);
        // Counts and displacements must also stay valid while the operation runs.
        let ints = &mut self.staging.ints;
        ints.clear();
        ints.extend(send_counts.iter().map(|&c| count(c)));
        ints.extend(displacements(send_counts));
        ints.extend(recv_counts.iter().map(|&c| count(c)));
        ints.extend(displacements(recv_counts));
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: as in `all_reduce`; `ints` holds 4 arrays of `p` entries.
        unsafe {
            let ip = self.staging.ints.as_ptr();
            ffi::MPI_Ialltoallv(
                self.staging.send.as_ptr() as *const c_void,
                ip,
                ip.add(p),
                float(),
                self.staging.recv.as_mut_ptr() as *mut c_void,
                ip.add(2 * p),
                ip.add(3 * p),
                float(),
                self.raw(),
                &mut req,
            );
        }
        self.wait("all_to_all_v", req, None)?;
        out.copy_from_slice(&self.staging.recv);
        Ok(())
    }

    fn send(&mut self, buf: &[f32], dst: usize, tag: u64) -> Result<(), CommError> {
        self.count("send", buf.len() * 4)?;
        self.retire_sends();
        for chunk in buf.chunks(CHUNK) {
            let owned = chunk.to_vec();
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: `owned` moves into `pending_sends` (its heap buffer does not move) and is
            // dropped only after MPI reports the send complete.
            unsafe {
                ffi::MPI_Isend(
                    owned.as_ptr() as *const c_void,
                    count(chunk.len()),
                    float(),
                    dst as i32,
                    tag as i32,
                    self.raw(),
                    &mut req,
                );
            }
            self.pending_sends.push((req, owned));
        }
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u64) -> Result<(), CommError> {
        self.count("recv", buf.len() * 4)?;
        self.retire_sends();
        for chunk in buf.chunks_mut(CHUNK) {
            self.staging.recv.clear();
            self.staging.recv.resize(chunk.len(), 0.0);
            let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: as in `all_reduce`.
            unsafe {
                ffi::MPI_Irecv(
                    self.staging.recv.as_mut_ptr() as *mut c_void,
                    count(chunk.len()),
                    float(),
                    src as i32,
                    tag as i32,
                    self.raw(),
                    &mut req,
                );
            }
            self.wait("recv", req, Some(src))?;
            chunk.copy_from_slice(&self.staging.recv);
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.count("barrier", 0)?;
        self.begin(0, 0);
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: no buffers.
        unsafe {
            ffi::MPI_Ibarrier(self.raw(), &mut req);
        }
        self.wait("barrier", req, None)
    }

    fn split_named(
        &mut self,
        color: usize,
        key: usize,
        name: &str,
    ) -> Result<Box<dyn Communicator>, CommError> {
        // MPI_Comm_split blocks without a timeout: a barrier under the timeout first reports
        // a missing rank instead of hanging in it.
        self.barrier()?;
        self.count("split", 0)?;
        let sub = self
            .comm
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| self.usage("split", "MPI returned no communicator".into()))?;
        Ok(Box::new(MpiCommunicator::wrap(
            sub,
            name.to_string(),
            self.timeout,
        )))
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}

impl Drop for MpiCommunicator {
    /// Waits (up to the timeout) for sends still in flight; if they never complete their
    /// buffers are leaked rather than freed under MPI.
    fn drop(&mut self) {
        let deadline = std::time::Instant::now() + self.timeout;
        while !self.pending_sends.is_empty() && std::time::Instant::now() < deadline {
            self.retire_sends();
            std::thread::yield_now();
        }
        std::mem::forget(std::mem::take(&mut self.pending_sends));
    }
}
