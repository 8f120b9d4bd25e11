//! Tables generated on worker threads while training runs: worker `w` makes tables
//! `w, w + W, w + 2W, ...` into its own bounded queue, and the consumer takes them round-robin,
//! so the order is the index order whatever the thread timing, and each worker runs at most
//! `depth` tables ahead. The time the consumer waited is kept, to show the loader never
//! stalls a step.

use super::prior::{sample_table, PriorConfig, Table};
use std::sync::mpsc::{sync_channel, Receiver};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct PriorLoader {
    queues: Vec<Receiver<Table>>,
    workers: Vec<JoinHandle<()>>,
    start: u64,
    next: u64,
    waited: Duration,
}

impl PriorLoader {
    /// Tables `start, start + 1, ...` of the prior `(cfg, seed)` on `workers` threads.
    pub fn new(cfg: PriorConfig, seed: u64, start: u64, workers: usize, depth: usize) -> Self {
        let w = workers.max(1) as u64;
        let mut queues = Vec::new();
        let mut handles = Vec::new();
        for k in 0..w {
            let (tx, rx) = sync_channel(depth.max(1));
            let cfg = cfg.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("table-prior-{k}"))
                    .spawn(move || {
                        let mut i = start + k;
                        // Ends when the loader is dropped (the receiver hangs up).
                        while tx.send(sample_table(&cfg, seed, i)).is_ok() {
                            i += w;
                        }
                    })
                    .expect("spawn a table prior worker"),
            );
            queues.push(rx);
        }
        PriorLoader {
            queues,
            workers: handles,
            start,
            next: start,
            waited: Duration::ZERO,
        }
    }

    /// The next table in index order.
    pub fn next_table(&mut self) -> Table {
        let q = &self.queues[((self.next - self.start) % self.queues.len() as u64) as usize];
        self.next += 1;
        let t0 = Instant::now();
        let t = q
            .recv()
            .expect("table prior workers run until the loader is dropped");
        self.waited += t0.elapsed();
        t
    }

    /// Total time [`Self::next_table`] waited for a worker.
    pub fn waited(&self) -> Duration {
        self.waited
    }
}

impl Drop for PriorLoader {
    fn drop(&mut self) {
        // Hang up first so workers blocked on a full queue return, then join them.
        self.queues.clear();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}
