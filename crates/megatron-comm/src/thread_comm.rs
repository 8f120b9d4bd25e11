//! The thread backend: ranks are OS threads of one process; collectives work on the ranks' own
//! buffers through shared memory. Each collective is a rendezvous (every rank publishes its
//! buffers), a phase in which rank r reduces or copies its 1/N share (so the arithmetic is spread
//! over ranks and summed in rank order: bit-identical from run to run), and a closing rendezvous
//! before anyone returns (so no buffer changes while another rank reads it). No lock is held
//! while data moves; the state mutex only guards the rendezvous counters.

use crate::communicator::{CommError, CommStats, Communicator, ReduceOp};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy)]
struct Ptr(usize, usize); // address, length (elements)

#[derive(Default)]
struct Slots {
    /// Per rank: the sequence number it has reached, and the buffers it published.
    arrived: Vec<u64>,
    bufs: Vec<Option<(Ptr, Ptr)>>,
    /// The first rank that left the group early (panicked, or returned an error), and how.
    left: Option<(usize, PeerExit)>,
    /// Set by the first timeout: the group is unusable, as an aborted NCCL communicator is;
    /// later calls fail with this error instead of reading buffers of ranks that gave up.
    broken: Option<CommError>,
    /// Per rank: the send counts of the current `all_to_all_v`.
    counts: Vec<Vec<usize>>,
    /// Point-to-point mailboxes keyed by (src, dst, tag).
    mail: HashMap<(usize, usize, u64), VecDeque<Vec<f32>>>,
    /// `split` proposals per sequence number: (rank, color, key).
    splits: HashMap<u64, Vec<(usize, usize, usize)>>,
    children: HashMap<(u64, usize), Arc<Shared>>,
}

struct Shared {
    name: String,
    size: usize,
    state: Mutex<Slots>,
    cv: Condvar,
}

pub struct ThreadCommunicator {
    shared: Arc<Shared>,
    rank: usize,
    seq: u64,
    timeout: Duration,
    stats: CommStats,
    memberships: Memberships,
}

/// Every group a rank belongs to (the world and the groups split from it) with its rank there;
/// shared by the rank's communicators so a split registers its new group.
type Memberships = Arc<Mutex<Vec<(Arc<Shared>, usize)>>>;

/// How a rank left its groups before the end of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerExit {
    Panicked,
    /// Its work returned an error (bad data, a checkpoint it could not write, ...).
    Failed,
}

/// Marks a rank as gone in every group it belongs to, so that its peers' calls fail at once
/// naming it instead of waiting out the distributed timeout: on drop during unwinding
/// (a panic), or when told that the rank's work failed ([`ExitGuard::failed`]).
pub struct ExitGuard(Memberships);

impl ExitGuard {
    fn leave(&self, how: PeerExit) {
        let groups = match self.0.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        for (s, r) in &groups {
            if let Ok(mut st) = s.state.lock() {
                st.left.get_or_insert((*r, how));
            }
            s.cv.notify_all();
        }
    }

    /// The rank's work returned an error: it will make no more calls.
    pub fn failed(&self) {
        self.leave(PeerExit::Failed);
    }
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.leave(PeerExit::Panicked);
        }
    }
}

impl ThreadCommunicator {
    /// A world of `n` communicators, one per rank thread.
    pub fn world(n: usize) -> Vec<ThreadCommunicator> {
        let shared = Arc::new(Shared::new("world".into(), n));
        (0..n)
            .map(|rank| ThreadCommunicator {
                shared: shared.clone(),
                rank,
                seq: 0,
                timeout: DEFAULT_TIMEOUT,
                stats: CommStats::default(),
                memberships: Arc::new(Mutex::new(vec![(shared.clone(), rank)])),
            })
            .collect()
    }

    /// A guard that, if this rank's thread panics, fails the waiting peers of every group this
    /// rank belongs to (the world and every group split from it, now or later) — and only them.
    pub fn exit_guard(&self) -> ExitGuard {
        ExitGuard(self.memberships.clone())
    }

    /// The error of a call that a peer's early exit aborted.
    fn peer_left(&self, op: &'static str, (rank, how): (usize, PeerExit)) -> CommError {
        let group = self.shared.name.clone();
        let seq = self.seq;
        match how {
            PeerExit::Panicked => CommError::PeerPanicked {
                group,
                op,
                seq,
                rank,
            },
            PeerExit::Failed => CommError::PeerFailed {
                group,
                op,
                seq,
                rank,
            },
        }
    }

    fn count(&mut self, op: &'static str, bytes: usize) {
        *self.stats.calls.entry(op).or_default() += 1;
        *self.stats.bytes.entry(op).or_default() += bytes as u64;
    }

    /// Waits until every rank reached `target` (or a peer left early, or, if `timed`, the timeout
    /// passed: the group is then marked broken under the same lock, so a rank arriving later
    /// cannot read this rank's buffers).
    fn wait_all(
        &self,
        op: &'static str,
        target: u64,
        timed: bool,
    ) -> Result<std::sync::MutexGuard<'_, Slots>, CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.shared.state.lock().expect("comm state");
        loop {
            if let Some(e) = &st.broken {
                return Err(e.clone());
            }
            // Completion first: a peer that finished this call and panicked later must not
            // fail it.
            if st.arrived.iter().all(|&a| a >= target) {
                return Ok(st);
            }
            if let Some(left) = st.left {
                return Err(self.peer_left(op, left));
            }
            let now = Instant::now();
            if timed && now >= deadline {
                let missing = st
                    .arrived
                    .iter()
                    .enumerate()
                    .filter(|(_, &a)| a < target)
                    .map(|(r, _)| r)
                    .collect();
                let e = CommError::Timeout {
                    group: self.shared.name.clone(),
                    op,
                    seq: self.seq,
                    timeout: self.timeout,
                    missing,
                };
                st.broken = Some(e.clone());
                st.bufs[self.rank] = None;
                self.shared.cv.notify_all();
                return Err(e);
            }
            let wait = if timed {
                (deadline - now).min(Duration::from_millis(50))
            } else {
                Duration::from_millis(50)
            };
            let (g, _) = self.shared.cv.wait_timeout(st, wait).expect("comm state");
            st = g;
        }
    }

    /// One rendezvous: publish `(input, output)`, wait for all; returns everyone's buffers.
    fn rendezvous(
        &mut self,
        op: &'static str,
        input: Ptr,
        output: Ptr,
    ) -> Result<Vec<(Ptr, Ptr)>, CommError> {
        self.seq += 1;
        let target = 2 * self.seq - 1;
        {
            let mut st = self.shared.state.lock().expect("comm state");
            st.bufs[self.rank] = Some((input, output));
            st.arrived[self.rank] = target;
        }
        self.shared.cv.notify_all();
        let st = self.wait_all(op, target, true)?;
        Ok(st.bufs.iter().map(|b| b.expect("published")).collect())
    }

    /// The closing rendezvous of a collective.
    fn finish(&mut self, op: &'static str) -> Result<(), CommError> {
        let target = 2 * self.seq;
        {
            let mut st = self.shared.state.lock().expect("comm state");
            st.arrived[self.rank] = target;
        }
        self.shared.cv.notify_all();
        // Every peer is past the opening rendezvous and only moving data: no timeout here, so
        // no rank returns while another may still read its buffers.
        self.wait_all(op, target, false).map(|_| ())
    }

    fn usage(&self, op: &'static str, msg: String) -> CommError {
        CommError::Usage {
            group: self.shared.name.clone(),
            op,
            msg,
        }
    }

    /// Rank r's share `[lo, hi)` of `n` elements.
    fn share(&self, n: usize) -> (usize, usize) {
        let p = self.shared.size;
        (self.rank * n / p, (self.rank + 1) * n / p)
    }
}

impl Shared {
    fn new(name: String, size: usize) -> Self {
        Shared {
            name,
            size,
            state: Mutex::new(Slots {
                arrived: vec![0; size],
                bufs: vec![None; size],
                counts: vec![Vec::new(); size],
                ..Default::default()
            }),
            cv: Condvar::new(),
        }
    }
}

fn combine(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, b)| *a += b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
        ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.min(*b)),
    }
}

/// # Safety
/// `p` must point to `p.1` live f32s that no one writes during the read.
unsafe fn view<'a>(p: Ptr) -> &'a [f32] {
    std::slice::from_raw_parts(p.0 as *const f32, p.1)
}

impl Communicator for ThreadCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn name(&self) -> &str {
        &self.shared.name
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let n = buf.len();
        self.count("all_reduce", n * 4);
        let me = Ptr(buf.as_mut_ptr() as usize, n);
        let bufs = self.rendezvous("all_reduce", me, me)?;
        if bufs.iter().any(|b| b.0 .1 != n) {
            return Err(self.usage(
                "all_reduce",
                "ranks passed buffers of different lengths".into(),
            ));
        }
        // Rank r owns elements [lo, hi) of every rank's buffer: it reads them from all ranks,
        // reduces in rank order and writes the result back into all of them. No other rank
        // touches that range, so one rendezvous and one closing barrier suffice; working in
        // small chunks keeps the partial sums in cache.
        const CHUNK: usize = 16 << 10;
        let (lo, hi) = self.share(n);
        let mut acc = vec![0.0f32; CHUNK.min(hi - lo)];
        let scale = 1.0 / self.shared.size as f32;
        let mut c0 = lo;
        while c0 < hi {
            let c1 = (c0 + CHUNK).min(hi);
            let part = &mut acc[..c1 - c0];
            // SAFETY: [c0, c1) lies in this rank's range, which no other rank reads or writes
            // during this collective, and every owner is parked in the protocol.
            part.copy_from_slice(&unsafe { view(bufs[0].0) }[c0..c1]);
            for b in &bufs[1..] {
                combine(part, &unsafe { view(b.0) }[c0..c1], op);
            }
            if op == ReduceOp::Avg {
                part.iter_mut().for_each(|v| *v *= scale);
            }
            for b in &bufs {
                let dst = unsafe { std::slice::from_raw_parts_mut(b.0 .0 as *mut f32, n) };
                dst[c0..c1].copy_from_slice(part);
            }
            c0 = c1;
        }
        self.finish("all_reduce")
    }

    fn all_to_all(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let p = self.shared.size;
        if !input.len().is_multiple_of(p) || out.len() != input.len() {
            return Err(self.usage(
                "all_to_all",
                format!(
                    "input of {} elements must split into {p} equal parts, output of the same size",
                    input.len()
                ),
            ));
        }
        let n = input.len() / p;
        self.count("all_to_all", input.len() * 4);
        let bufs = self.rendezvous(
            "all_to_all",
            Ptr(input.as_ptr() as usize, input.len()),
            Ptr(out.as_mut_ptr() as usize, out.len()),
        )?;
        let r = self.rank;
        for (q, b) in bufs.iter().enumerate() {
            if b.0 .1 != input.len() {
                return Err(self.usage(
                    "all_to_all",
                    format!(
                        "rank {q} passed {} elements, this rank {}",
                        b.0 .1,
                        input.len()
                    ),
                ));
            }
            // Part r of rank q's input becomes part q of this rank's output.
            out[q * n..(q + 1) * n].copy_from_slice(&unsafe { view(b.0) }[r * n..(r + 1) * n]);
        }
        self.finish("all_to_all")
    }

    fn all_gather(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let (n, p) = (input.len(), self.shared.size);
        self.count("all_gather", n * 4 * p);
        if out.len() != n * p {
            return Err(self.usage(
                "all_gather",
                format!("output holds {} elements, expected {}", out.len(), n * p),
            ));
        }
        let bufs = self.rendezvous(
            "all_gather",
            Ptr(input.as_ptr() as usize, n),
            Ptr(out.as_mut_ptr() as usize, out.len()),
        )?;
        for (r, b) in bufs.iter().enumerate() {
            if b.0 .1 != n {
                return Err(self.usage(
                    "all_gather",
                    format!("rank {r} contributes {} elements, this rank {n}", b.0 .1),
                ));
            }
            out[r * n..(r + 1) * n].copy_from_slice(unsafe { view(b.0) });
        }
        self.finish("all_gather")
    }

    fn reduce_scatter(
        &mut self,
        input: &[f32],
        out: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (n, p) = (out.len(), self.shared.size);
        self.count("reduce_scatter", n * 4 * p);
        if input.len() != n * p {
            return Err(self.usage(
                "reduce_scatter",
                format!("input holds {} elements, expected {}", input.len(), n * p),
            ));
        }
        let bufs = self.rendezvous(
            "reduce_scatter",
            Ptr(input.as_ptr() as usize, input.len()),
            Ptr(out.as_mut_ptr() as usize, n),
        )?;
        let r = self.rank;
        out.copy_from_slice(&unsafe { view(bufs[0].0) }[r * n..(r + 1) * n]);
        for b in &bufs[1..] {
            combine(out, &unsafe { view(b.0) }[r * n..(r + 1) * n], op);
        }
        if op == ReduceOp::Avg {
            let s = 1.0 / p as f32;
            out.iter_mut().for_each(|v| *v *= s);
        }
        self.finish("reduce_scatter")
    }

    fn all_to_all_v(
        &mut self,
        input: &[f32],
        send_counts: &[usize],
        out: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let p = self.shared.size;
        if send_counts.len() != p
            || recv_counts.len() != p
            || send_counts.iter().sum::<usize>() != input.len()
            || recv_counts.iter().sum::<usize>() != out.len()
        {
            return Err(self.usage("all_to_all_v", format!("{p} send and receive counts must sum to the input ({}) and output ({}) lengths", input.len(), out.len())));
        }
        self.count("all_to_all_v", input.len() * 4);
        {
            let mut st = self.shared.state.lock().expect("comm state");
            st.counts[self.rank] = send_counts.to_vec();
        }
        let bufs = self.rendezvous(
            "all_to_all_v",
            Ptr(input.as_ptr() as usize, input.len()),
            Ptr(out.as_mut_ptr() as usize, out.len()),
        )?;
        let counts: Vec<Vec<usize>> = self.shared.state.lock().expect("comm state").counts.clone();
        let r = self.rank;
        let mut dst = 0;
        for (q, b) in bufs.iter().enumerate() {
            let n = counts[q][r];
            if n != recv_counts[q] {
                return Err(self.usage(
                    "all_to_all_v",
                    format!(
                        "rank {q} sends {n} elements, this rank expects {}",
                        recv_counts[q]
                    ),
                ));
            }
            let src = counts[q][..r].iter().sum::<usize>();
            out[dst..dst + n].copy_from_slice(&unsafe { view(b.0) }[src..src + n]);
            dst += n;
        }
        self.finish("all_to_all_v")
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.shared.size {
            return Err(self.usage(
                "broadcast",
                format!("root {root} outside the group of {}", self.shared.size),
            ));
        }
        self.count("broadcast", buf.len() * 4);
        let me = Ptr(buf.as_mut_ptr() as usize, buf.len());
        let bufs = self.rendezvous("broadcast", me, me)?;
        if self.rank != root {
            let src = bufs[root].0;
            if src.1 != buf.len() {
                return Err(self.usage("broadcast", "buffers of different lengths".into()));
            }
            buf.copy_from_slice(unsafe { view(src) });
        }
        self.finish("broadcast")
    }

    fn send(&mut self, buf: &[f32], dst: usize, tag: u64) -> Result<(), CommError> {
        if dst >= self.shared.size {
            return Err(self.usage("send", format!("destination {dst} outside the group")));
        }
        self.count("send", buf.len() * 4);
        let mut st = self.shared.state.lock().expect("comm state");
        st.mail
            .entry((self.rank, dst, tag))
            .or_default()
            .push_back(buf.to_vec());
        drop(st);
        self.shared.cv.notify_all();
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], src: usize, tag: u64) -> Result<(), CommError> {
        self.count("recv", buf.len() * 4);
        let deadline = Instant::now() + self.timeout;
        let mut st = self.shared.state.lock().expect("comm state");
        loop {
            if let Some(msg) = st
                .mail
                .get_mut(&(src, self.rank, tag))
                .and_then(|q| q.pop_front())
            {
                if msg.len() != buf.len() {
                    return Err(self.usage(
                        "recv",
                        format!(
                            "message of {} elements from rank {src}, buffer holds {}",
                            msg.len(),
                            buf.len()
                        ),
                    ));
                }
                buf.copy_from_slice(&msg);
                return Ok(());
            }
            if let Some(left) = st.left {
                return Err(self.peer_left("recv", left));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    group: self.shared.name.clone(),
                    op: "recv",
                    seq: self.seq,
                    timeout: self.timeout,
                    missing: vec![src],
                });
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, (deadline - now).min(Duration::from_millis(50)))
                .expect("comm state")
                .0;
        }
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.count("barrier", 0);
        let none = Ptr(0, 0);
        self.rendezvous("barrier", none, none)?;
        self.finish("barrier")
    }

    fn split(&mut self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        let name = format!("{}/{color}", self.shared.name);
        self.split_named(color, key, &name)
    }

    fn split_named(
        &mut self,
        color: usize,
        key: usize,
        name: &str,
    ) -> Result<Box<dyn Communicator>, CommError> {
        self.count("split", 0);
        let seq = self.seq + 1;
        {
            let mut st = self.shared.state.lock().expect("comm state");
            st.splits
                .entry(seq)
                .or_default()
                .push((self.rank, color, key));
        }
        let none = Ptr(0, 0);
        self.rendezvous("split", none, none)?;
        let (members, child) = {
            let mut st = self.shared.state.lock().expect("comm state");
            let mut members: Vec<(usize, usize)> = st.splits[&seq]
                .iter()
                .filter(|m| m.1 == color)
                .map(|m| (m.2, m.0))
                .collect();
            members.sort();
            let ranks: Vec<usize> = members.iter().map(|m| m.1).collect();
            let name = if name.contains('[') {
                name.to_string()
            } else {
                format!("{name}{ranks:?}")
            };
            let child = st
                .children
                .entry((seq, color))
                .or_insert_with(|| Arc::new(Shared::new(name, ranks.len())))
                .clone();
            (ranks, child)
        };
        self.finish("split")?;
        let new_rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("member of its color");
        if let Ok(mut m) = self.memberships.lock() {
            m.push((child.clone(), new_rank));
        }
        Ok(Box::new(ThreadCommunicator {
            shared: child,
            rank: new_rank,
            seq: 0,
            timeout: self.timeout,
            stats: CommStats::default(),
            memberships: self.memberships.clone(),
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}

/// Runs `f(rank, communicator)` on `n` rank threads and collects the results in rank order. A
/// rank that panics makes its peers' collectives fail fast (`PeerPanicked`) instead of hanging;
/// its panic is returned as an `Err` naming the rank.
pub fn run_ranks<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize, &mut ThreadCommunicator) -> T + Send + Sync + 'static,
) -> Vec<Result<T, String>> {
    let f = Arc::new(f);
    let handles: Vec<_> = ThreadCommunicator::world(n)
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let f = f.clone();
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let _guard = comm.exit_guard();
                    f(rank, &mut comm)
                })
                .expect("spawn rank thread")
        })
        .collect();
    handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| {
            h.join().map_err(|e| {
                let msg = e
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| e.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                format!("rank {rank} panicked: {msg}")
            })
        })
        .collect()
}

/// What became of one rank thread of [`run_ranks_until_failure`].
#[derive(Debug)]
pub enum RankOutcome<T, E> {
    Finished(Result<T, E>),
    Panicked(String),
    /// Still running `grace` after another rank failed: stuck (it stopped arriving). Its thread
    /// is left detached.
    Stuck,
}

/// [`run_ranks`] for fallible work that never waits forever for a stuck rank: once some rank
/// has failed (returned `Err` or panicked), the others get `grace` to finish (their collectives
/// time out on the failed rank, or complete), and those still running then are reported as
/// [`RankOutcome::Stuck`] instead of being joined. So a rank thread that stops arriving ends the
/// job with its peers' errors, not a hang.
pub fn run_ranks_until_failure<T: Send + 'static, E: Send + 'static>(
    n: usize,
    grace: Duration,
    f: impl Fn(usize, &mut ThreadCommunicator) -> Result<T, E> + Send + Sync + 'static,
) -> Vec<RankOutcome<T, E>> {
    let f = Arc::new(f);
    let (tx, rx) = std::sync::mpsc::channel();
    for (rank, mut comm) in ThreadCommunicator::world(n).into_iter().enumerate() {
        let (f, tx) = (f.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                // The guard drops during the unwind, inside the catch: peers see the panic.
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let guard = comm.exit_guard();
                    let r = f(rank, &mut comm);
                    if r.is_err() {
                        guard.failed();
                    }
                    r
                }));
                let outcome = match out {
                    Ok(r) => RankOutcome::Finished(r),
                    Err(e) => RankOutcome::Panicked(format!(
                        "rank {rank} panicked: {}",
                        e.downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| e.downcast_ref::<String>().cloned())
                            .unwrap_or_default()
                    )),
                };
                let _ = tx.send((rank, outcome));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let mut outcomes: Vec<Option<RankOutcome<T, E>>> = (0..n).map(|_| None).collect();
    let mut deadline: Option<std::time::Instant> = None;
    let mut done = 0;
    while done < n {
        let msg = match deadline {
            None => rx.recv().ok(),
            Some(d) => rx
                .recv_timeout(d.saturating_duration_since(std::time::Instant::now()))
                .ok(),
        };
        let Some((rank, outcome)) = msg else { break };
        let failed = !matches!(outcome, RankOutcome::Finished(Ok(_)));
        if failed && deadline.is_none() {
            deadline = Some(std::time::Instant::now() + grace);
        }
        outcomes[rank] = Some(outcome);
        done += 1;
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or(RankOutcome::Stuck))
        .collect()
}

/// Bytes moved per group name, merged over communicators (for reports).
pub fn merge_stats(all: &[CommStats]) -> BTreeMap<&'static str, u64> {
    let mut m = BTreeMap::new();
    for s in all {
        for (k, v) in &s.bytes {
            *m.entry(*k).or_default() += v;
        }
    }
    m
}
