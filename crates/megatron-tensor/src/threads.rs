//! GEMM thread budget per rank thread.
//!
//! Ranks are OS threads; each may use at most its budget of cores for GEMM so that N ranks on C
//! cores never oversubscribe. The budget is thread-local so every rank thread sets its own.

use std::cell::Cell;

thread_local! {
    static GEMM_THREADS: Cell<usize> = Cell::new(default_threads());
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Caps the GEMM threads of the calling thread (1 = single-threaded GEMM).
pub fn set_gemm_threads(n: usize) {
    GEMM_THREADS.with(|c| c.set(n.max(1)));
}

pub fn gemm_threads() -> usize {
    GEMM_THREADS.with(|c| c.get())
}

pub fn available_cores() -> usize {
    default_threads()
}
