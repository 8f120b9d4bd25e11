//! A per-thread pool of f32 buffers keyed by length.
//!
//! A training step allocates the same activation and gradient buffers every iteration. Fresh
//! allocations of many megabytes are served by `mmap` and page-fault on first touch, which costs
//! more than the elementwise kernels that fill them. Returning buffers to a pool on drop and
//! handing them out again the next iteration keeps the pages resident.

use std::cell::RefCell;
use std::collections::HashMap;

/// Buffers below this size come from the allocator's own free lists; pooling them buys nothing.
const MIN_POOLED_LEN: usize = 1 << 12;
/// Upper bound on bytes parked in one thread's pool, so an unusual step cannot pin memory forever.
const MAX_POOLED_BYTES: usize = 8 << 30;

#[derive(Default)]
struct Pool {
    free: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// A zero-filled buffer of exactly `len` elements, reused from the pool when one is free.
pub fn take_zeroed(len: usize) -> Vec<f32> {
    let mut v = take_any(len);
    v.fill(0.0);
    v
}

/// A buffer of exactly `len` elements with arbitrary (stale but initialized) contents, for
/// outputs that a kernel overwrites completely: it saves the memset of [`take_zeroed`].
pub fn take_any(len: usize) -> Vec<f32> {
    if len >= MIN_POOLED_LEN {
        if let Some(v) = POOL.with(|p| {
            let mut p = p.borrow_mut();
            let v = p.free.get_mut(&len).and_then(|l| l.pop());
            if v.is_some() {
                p.bytes -= len * 4;
            }
            v
        }) {
            return v;
        }
    }
    vec![0.0; len]
}

/// Hands a buffer back for reuse by a later `take_zeroed` of the same length on this thread.
pub fn give_back(v: Vec<f32>) {
    let len = v.len();
    if len < MIN_POOLED_LEN || v.capacity() != len {
        return;
    }
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.bytes + len * 4 <= MAX_POOLED_BYTES {
            p.bytes += len * 4;
            p.free.entry(len).or_default().push(v);
        }
    });
}

/// Bytes currently parked in this thread's pool.
pub fn pooled_bytes() -> usize {
    POOL.with(|p| p.borrow().bytes)
}

/// Releases every parked buffer of this thread (e.g. after training, before generation).
pub fn clear() {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        p.free.clear();
        p.bytes = 0;
    });
}
