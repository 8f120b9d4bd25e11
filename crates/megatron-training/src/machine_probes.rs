//! Measurements of this machine that `megatron bench comm` prints and `megatron plan --cluster
//! this-machine` plans with: the memory system's copy bandwidth and the thread backend's
//! all-reduce time.

use megatron_comm::{run_ranks, Communicator, ReduceOp};
use std::time::Instant;

/// Median of `repeats` timings of `f` after one warm-up call, in seconds.
pub fn time_median(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Aggregate memcpy bandwidth of `threads` threads each copying its own 256 MiB / `threads`
/// (bytes/s, read + write counted): what the memory system gives all rank threads together.
pub fn memcpy_bandwidth_threads(threads: usize, repeats: usize) -> f64 {
    let threads = threads.max(1);
    let n = (64 << 20) / threads;
    let mut bufs: Vec<(Vec<f32>, Vec<f32>)> = (0..threads)
        .map(|_| (vec![1.0f32; n], vec![0.0f32; n]))
        .collect();
    let copy = || {
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                s.spawn(move || dst.copy_from_slice(src));
            }
        })
    };
    let t = time_median(repeats, copy);
    2.0 * (n * threads * 4) as f64 / t
}

/// Seconds of one all-reduce of `bytes` over `ranks` rank threads of the thread backend: per
/// call the slowest rank's time (each call starts from a barrier), the median over `repeats`.
pub fn thread_all_reduce_seconds(
    ranks: usize,
    bytes: usize,
    repeats: usize,
) -> Result<f64, String> {
    let n = bytes / 4;
    let repeats = repeats.max(1);
    let times = run_ranks(ranks, move |rank, c| -> Result<Vec<f64>, String> {
        let mut v = vec![rank as f32; n];
        c.all_reduce(&mut v, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let mut ts = Vec::new();
        for _ in 0..repeats {
            c.barrier().map_err(|e| e.to_string())?;
            let t = Instant::now();
            c.all_reduce(&mut v, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            ts.push(t.elapsed().as_secs_f64());
        }
        Ok(ts)
    });
    let per_rank: Vec<Vec<f64>> = times
        .into_iter()
        .map(|t| t.and_then(|r| r))
        .collect::<Result<_, _>>()?;
    let mut per_call: Vec<f64> = (0..repeats)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    per_call.sort_by(f64::total_cmp);
    Ok(per_call[per_call.len() / 2])
}
