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
/// Distinct lengths kept: a training step of a dense model uses a few dozen and reuses them
/// every step; lengths that vary from step to step (the token blocks of mixture-of-experts
/// layers) are never asked for again and would otherwise fill the pool up to its byte cap. The
/// least recently used length is released first.
const MAX_POOLED_LENGTHS: usize = 48;

#[derive(Default)]
struct Pool {
    /// Free buffers by length, with the clock of the length's last use.
    free: HashMap<usize, (Vec<Vec<f32>>, u64)>,
    /// Buffers of each length handed out by this thread's pool and not yet given back: only
    /// those come back (a buffer made elsewhere, e.g. by `Tensor::from_vec`, is freed, or the
    /// pool would grow by one of them per step).
    outstanding: HashMap<usize, usize>,
    bytes: usize,
    clock: u64,
}

impl Pool {
    fn touch(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Drops the least recently used lengths until at most [`MAX_POOLED_LENGTHS`] remain.
    fn evict(&mut self) {
        while self.free.len() > MAX_POOLED_LENGTHS {
            let Some((&len, _)) = self.free.iter().min_by_key(|(_, (_, t))| *t) else {
                return;
            };
            if let Some((bufs, _)) = self.free.remove(&len) {
                self.bytes -= bufs.len() * len * 4;
                crate::alloc::release_parked(bufs.len() * len * 4);
            }
        }
    }
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
            *p.outstanding.entry(len).or_default() += 1;
            let now = p.touch();
            let v = p.free.get_mut(&len).and_then(|(l, t)| {
                *t = now;
                l.pop()
            });
            if v.is_some() {
                p.bytes -= len * 4;
                crate::alloc::unpark(len * 4);
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
        match p.outstanding.get_mut(&len) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                p.outstanding.remove(&len);
            }
            None => return,
        }
        if p.bytes + len * 4 <= MAX_POOLED_BYTES {
            p.bytes += len * 4;
            crate::alloc::park(len * 4);
            let now = p.touch();
            let entry = p.free.entry(len).or_insert_with(|| (Vec::new(), now));
            entry.0.push(v);
            entry.1 = now;
            p.evict();
        }
    });
}

/// Distinct lengths parked in this thread's pool.
pub fn pooled_lengths() -> usize {
    POOL.with(|p| p.borrow().free.len())
}

/// Bytes currently parked in this thread's pool.
pub fn pooled_bytes() -> usize {
    POOL.with(|p| p.borrow().bytes)
}

/// Releases every parked buffer of this thread (e.g. after training, before generation).
pub fn clear() {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        crate::alloc::release_parked(p.bytes);
        p.free.clear();
        p.outstanding.clear();
        p.bytes = 0;
    });
}

/// bf16 elements kept in a pooled f32 buffer, two to a word: 16-bit activations (kept for
/// backward, or written for a matmul) reuse the pages the pool keeps resident, as f32 tensors
/// do, instead of a fresh zero-filled allocation every step.
pub(crate) struct Bf16Buf {
    words: Vec<f32>,
    len: usize,
}

impl Bf16Buf {
    /// `len` elements of arbitrary (stale, initialized) contents.
    pub(crate) fn take_any(len: usize) -> Bf16Buf {
        Bf16Buf {
            words: take_any(len.div_ceil(2)),
            len,
        }
    }

    /// A buffer of `ceil(len / 2)` words (from the pool, or a tensor's) holding `len` values.
    pub(crate) fn from_words(words: Vec<f32>, len: usize) -> Bf16Buf {
        assert_eq!(words.len(), len.div_ceil(2));
        Bf16Buf { words, len }
    }

    /// The values as words of two (the last one's upper half unused for an odd length).
    pub(crate) fn words(&self) -> &[f32] {
        &self.words
    }

    pub(crate) fn as_slice(&self) -> &[half::bf16] {
        // SAFETY: `bf16` is a `repr(transparent)` u16, so its alignment (2) divides f32's and
        // every bit pattern is a valid value; `words` holds `ceil(len / 2)` initialized f32,
        // at least `2 * len` bytes, and lives as long as the returned borrow of `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [half::bf16] {
        // SAFETY: as in `as_slice`; the borrow is unique because it borrows `self` mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

impl Clone for Bf16Buf {
    fn clone(&self) -> Bf16Buf {
        let mut b = Bf16Buf::take_any(self.len);
        b.words.copy_from_slice(&self.words);
        b
    }
}

impl Drop for Bf16Buf {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.words));
    }
}
