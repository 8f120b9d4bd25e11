//! The per-rank allocator counts each allocation against the rank whose thread made it, even
//! when another thread frees it, and separates what the tensor pool parks from what is in use.

use megatron_tensor::alloc::{self, RankAllocator};
use std::alloc::System;

#[global_allocator]
static ALLOCATOR: RankAllocator<System> = RankAllocator(System);

fn on_rank<T: Send + 'static>(rank: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        alloc::set_rank(rank);
        f()
    })
    .join()
    .unwrap()
}

#[test]
fn a_buffer_freed_on_another_thread_is_subtracted_from_its_owner() {
    const MB: usize = 1 << 20;
    let (buf, before, after) = on_rank(40, || {
        alloc::start_epoch();
        let before = alloc::current();
        let buf = vec![1u8; 3 * MB];
        (buf, before, alloc::current())
    });
    assert!(alloc::installed());
    assert_eq!(after.in_use - before.in_use, 3 * MB as i64);
    // Freed by a thread of another rank: rank 40 gets the bytes back, rank 41 is untouched.
    let (r41_before, r41_after) = on_rank(41, move || {
        let b = alloc::current();
        drop(buf);
        (b, alloc::current())
    });
    assert_eq!(r41_before, r41_after);
    let (now, peak) = on_rank(40, || (alloc::current(), alloc::peak()));
    assert_eq!(now.in_use, before.in_use);
    assert!(peak.in_use >= before.in_use + 3 * MB as i64);
}

#[test]
fn growing_a_buffer_counts_only_the_difference() {
    let (start, grown, end) = on_rank(42, || {
        let start = alloc::current().in_use;
        let mut v: Vec<u8> = Vec::with_capacity(1000);
        v.reserve_exact(5000);
        let grown = alloc::current().in_use;
        drop(v);
        (start, grown, alloc::current().in_use)
    });
    assert_eq!(grown - start, 5000);
    assert_eq!(end, start);
}

#[test]
fn pooled_buffers_count_as_reserved_not_in_use() {
    let (a, b, c) = on_rank(43, || {
        let len = 1 << 16;
        let a = alloc::current();
        let v = megatron_tensor::pool::take_any(len);
        let b = alloc::current();
        megatron_tensor::pool::give_back(v);
        let c = alloc::current();
        megatron_tensor::pool::clear();
        (a, b, c)
    });
    let bytes = (1 << 16) * 4;
    // The pool's own bookkeeping (a map entry or two) is allocated beside the buffer.
    let book = 0..1024;
    assert!(book.contains(&(b.in_use - a.in_use - bytes)), "{a:?} {b:?}");
    assert!(
        book.contains(&(c.in_use - a.in_use)),
        "a parked buffer is not in use: {a:?} {c:?}"
    );
    assert!(
        book.contains(&(c.reserved - a.reserved - bytes)),
        "but still allocated: {a:?} {c:?}"
    );
}

#[test]
fn buffers_from_before_an_epoch_are_not_counted_when_freed() {
    let (start, after_free, peak) = on_rank(44, || {
        let old = vec![7u8; 1 << 20];
        alloc::start_epoch();
        let start = alloc::current();
        let fresh = vec![1u8; 1000];
        drop(old);
        let after_free = alloc::current();
        drop(fresh);
        (start, after_free, alloc::peak())
    });
    assert_eq!(start.in_use, 0);
    assert_eq!(
        after_free.in_use, 1000,
        "the old megabyte is not subtracted"
    );
    assert_eq!(peak.in_use, 1000);
}
