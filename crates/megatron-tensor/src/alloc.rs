//! Per-rank allocation counting: live bytes and high-water mark for each rank of the process.
//!
//! Thread ranks share one process, so its resident set says nothing about one rank, and a
//! buffer often dies on another thread than the one that made it (a message handed to a peer, a
//! tensor dropped by the communication thread). So each allocation carries its owner's slot in
//! a small header in front of it, and is subtracted from that slot when it is freed, wherever
//! that happens. A thread's slot is thread-local: rank threads, their GEMM workers and their
//! communication threads set it to their rank ([`set_rank`], [`current_slot`] / [`set_slot`]);
//! other threads count in slot 0.
//!
//! Counting happens only where a binary installs the allocator around the one it uses
//! (`megatron` wraps mimalloc; a test: `#[global_allocator] static A: RankAllocator<System> =
//! RankAllocator(System);`). Without it [`installed`] is false and the figures are absent. No
//! crate counts allocations per thread with a header that survives cross-thread frees
//! (`stats_alloc` and `cap` count per process), hence this file.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// Slots: 0 for threads of no rank, then rank `r` in slot `r + 1`; ranks beyond share the last
/// but one; the last is [`PROBE_SLOT`].
pub const SLOTS: usize = 257;
/// The slot a measuring probe counts in (`matmul::gemm_workspace`), which no rank shares.
pub const PROBE_SLOT: usize = SLOTS - 1;

/// Bytes in front of each allocation for the owner's slot (at least 16 so alignment up to 16,
/// the allocator's usual guarantee, keeps the realloc fast path).
const HEADER: usize = 16;

/// One slot's figures. `live` counts every byte allocated and not freed (PyTorch's "reserved",
/// since the tensor pool keeps freed buffers allocated); `parked` the part of it the tensor
/// pool holds for reuse; `live - parked` is what tensors use (PyTorch's "allocated").
/// `epoch` counts [`start_epoch`] calls: an allocation remembers the epoch it was made in and
/// is subtracted only if freed in the same one, so what a slot held before (a previous run's
/// buffers, freed late by exiting threads) never shows up as negative usage.
#[repr(align(64))]
struct Counter {
    live: AtomicI64,
    peak: AtomicI64,
    parked: AtomicI64,
    in_use_peak: AtomicI64,
    epoch: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: Counter = Counter {
    live: AtomicI64::new(0),
    peak: AtomicI64::new(0),
    parked: AtomicI64::new(0),
    in_use_peak: AtomicI64::new(0),
    epoch: AtomicU64::new(0),
};

static COUNTERS: [Counter; SLOTS] = [ZERO; SLOTS];
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static SLOT: Cell<u16> = const { Cell::new(0) };
}

/// A global allocator that counts bytes per rank slot around the allocator it wraps (see the
/// module documentation).
pub struct RankAllocator<A>(pub A);

fn slot_now() -> usize {
    // During thread teardown the thread-local may be gone: count that thread's last
    // allocations in slot 0 rather than failing.
    SLOT.try_with(|s| s.get() as usize).unwrap_or(0)
}

/// The header word of a new allocation by `slot`: the slot and its current epoch.
fn tag(slot: usize) -> u64 {
    slot as u64 | (COUNTERS[slot].epoch.load(Ordering::Relaxed) << 16)
}

/// Counts `bytes` against the allocation tagged `tag` if it belongs to its slot's epoch.
fn add_tagged(tag: u64, bytes: i64) {
    let slot = (tag & 0xffff) as usize;
    if tag >> 16 == COUNTERS[slot].epoch.load(Ordering::Relaxed) {
        add(slot, bytes);
    }
}

fn add(slot: usize, bytes: i64) {
    let c = &COUNTERS[slot];
    let now = c.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
    if bytes > 0 {
        c.peak.fetch_max(now, Ordering::Relaxed);
        c.in_use_peak
            .fetch_max(now - c.parked.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

fn padded(layout: Layout) -> Option<(Layout, usize)> {
    let head = HEADER.max(layout.align());
    let l =
        Layout::from_size_align(layout.size().checked_add(head)?, layout.align().max(8)).ok()?;
    Some((l, head))
}

// SAFETY: every block handed out is `head` bytes into a block the inner allocator allocated with the
// padded layout; the slot lives in the 8 bytes just before the returned pointer, inside that
// block; dealloc and realloc recompute the same `head` from the caller's layout (the
// `GlobalAlloc` contract makes it the layout of the allocation) and hand the inner allocator back its own
// pointer and layout.
unsafe impl<A: GlobalAlloc> GlobalAlloc for RankAllocator<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some((l, head)) = padded(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `l` has a non-zero size (it includes the header).
        let base = unsafe { self.0.alloc(l) };
        if base.is_null() {
            return base;
        }
        let slot = slot_now();
        // SAFETY: `head >= 16` bytes of the block precede the returned pointer; the slot is
        // written 8 bytes before it, 8-aligned because `head` is a multiple of 8 and the block
        // at least 8-aligned.
        unsafe {
            let p = base.add(head);
            let tag = tag(slot);
            (p.sub(8) as *mut u64).write(tag);
            INSTALLED.store(true, Ordering::Relaxed);
            add_tagged(tag, layout.size() as i64);
            p
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let (l, head) = padded(layout).expect("layout was valid at allocation");
        // SAFETY: `ptr` came from `alloc`/`realloc` above with this layout: the header precedes
        // it and the block starts `head` bytes before it.
        unsafe {
            let tag = (ptr.sub(8) as *const u64).read();
            add_tagged(tag, -(layout.size() as i64));
            self.0.dealloc(ptr.sub(head), l);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (l, head) = padded(layout).expect("layout was valid at allocation");
        if head != HEADER || new_size.checked_add(head).is_none() {
            // SAFETY: the caller's contract for realloc covers alloc + copy + dealloc.
            unsafe {
                let new = self.alloc(Layout::from_size_align_unchecked(new_size, layout.align()));
                if !new.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                return new;
            }
        }
        // SAFETY: the block starts `head` bytes before `ptr` with layout `l`; `self.0.realloc`
        // keeps its first bytes, so the header moves with it.
        unsafe {
            let tag = (ptr.sub(8) as *const u64).read();
            let base = self.0.realloc(ptr.sub(head), l, new_size + head);
            if base.is_null() {
                return base;
            }
            add_tagged(tag, new_size as i64 - layout.size() as i64);
            base.add(head)
        }
    }
}

/// Counts this thread's later allocations as rank `rank`'s.
pub fn set_rank(rank: usize) {
    set_slot(rank + 1);
}

/// This thread's slot, to hand to a helper thread the rank spawns ([`set_slot`]).
pub fn current_slot() -> usize {
    slot_now()
}

pub fn set_slot(slot: usize) {
    SLOT.with(|s| s.set(slot.min(SLOTS - 2) as u16));
}

/// Counts this thread's later allocations in [`PROBE_SLOT`].
pub fn set_probe_slot() {
    SLOT.with(|s| s.set(PROBE_SLOT as u16));
}

/// Whether the running binary counts allocations (installed [`RankAllocator`] and allocated).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Bytes the calling thread's slot holds: in use by tensors and other values, and parked in
/// its threads' tensor pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotBytes {
    pub in_use: i64,
    pub reserved: i64,
}

/// What the calling thread's slot holds now.
pub fn current() -> SlotBytes {
    let c = &COUNTERS[slot_now()];
    let live = c.live.load(Ordering::Relaxed);
    SlotBytes {
        in_use: live - c.parked.load(Ordering::Relaxed),
        reserved: live,
    }
}

/// The calling thread's slot's high-water marks since the last [`start_epoch`].
pub fn peak() -> SlotBytes {
    let c = &COUNTERS[slot_now()];
    SlotBytes {
        in_use: c.in_use_peak.load(Ordering::Relaxed),
        reserved: c.peak.load(Ordering::Relaxed),
    }
}

/// Starts counting the calling thread's slot afresh: nothing held, no peak; what was allocated
/// before is not counted when freed. Call when no other thread of the slot allocates and its
/// threads' tensor pools hold nothing from before (at the start of a run, on fresh rank
/// threads): a buffer parked earlier and handed out again would count as in use without
/// counting as allocated.
pub fn start_epoch() {
    let c = &COUNTERS[slot_now()];
    c.epoch.fetch_add(1, Ordering::Relaxed);
    for v in [&c.live, &c.peak, &c.parked, &c.in_use_peak] {
        v.store(0, Ordering::Relaxed);
    }
}

/// The tensor pool parked `bytes` of freed buffers (still allocated, no longer in use).
pub fn park(bytes: usize) {
    COUNTERS[slot_now()]
        .parked
        .fetch_add(bytes as i64, Ordering::Relaxed);
}

/// The tensor pool handed `bytes` of parked buffers out again: in use from now on.
pub fn unpark(bytes: usize) {
    let c = &COUNTERS[slot_now()];
    let parked = c.parked.fetch_sub(bytes as i64, Ordering::Relaxed) - bytes as i64;
    c.in_use_peak
        .fetch_max(c.live.load(Ordering::Relaxed) - parked, Ordering::Relaxed);
}

/// The tensor pool is about to free `bytes` of parked buffers (no longer parked, never in use).
pub fn release_parked(bytes: usize) {
    COUNTERS[slot_now()]
        .parked
        .fetch_sub(bytes as i64, Ordering::Relaxed);
}
