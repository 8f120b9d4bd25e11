//! Memory of saving and loading, measured with a counting allocator (this test binary's global
//! allocator): a synchronous save and a load add only bounded buffers (ranks write their pieces
//! straight from their shards, and read straight into them from mapped files); `--async-save`
//! adds the staged copies of the pieces each rank writes, i.e. its own shard once. The old
//! whole-model format gathered every tensor and its moments on one rank.

mod common;

use common::*;
use megatron_training::pretrain;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: delegates every call to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed through.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak live heap bytes during `f`, above what was live before.
fn peak_during(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed) - base
}

#[test]
fn saves_and_loads_add_bounded_buffers_and_async_saves_one_staged_shard() {
    let dir = tmpdir("ckpt-mem");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap().to_string();
    // ~3.4 M parameters: checkpoint (values + 2 moments, f32) ~41 MB; DP 2, distributed optimizer.
    let model = [
        "--vocab-size",
        "1000",
        "--num-layers",
        "4",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--nproc-per-node",
        "2",
        "--use-distributed-optimizer",
        "--train-iters",
        "2",
        "--eval-iters",
        "0",
        "--lr-decay-iters",
        "4",
    ];
    let run = |more: &[&str]| {
        let v = [&model[..], more].concat();
        peak_during(|| {
            pretrain(&args(&v)).unwrap();
        })
    };
    let plain = run(&[]);
    let saving = run(&["--save", &s]);
    let async_dir = dir.join("async");
    let a = async_dir.to_str().unwrap().to_string();
    let saving_async = run(&["--save", &a, "--async-save"]);
    let ck = megatron_training::checkpointing::find_checkpoint(&save, false).unwrap();
    let ckpt_bytes: u64 = ck.meta.files.iter().map(|f| f.bytes).sum();
    let loading = run(&["--load", &s, "--train-iters", "4"]);
    let mb = |x: f64| x / 1e6;
    eprintln!(
        "peak heap: training {:.1} MB, with a save {:.1} MB, with an async save {:.1} MB, resuming {:.1} MB; checkpoint {:.1} MB",
        mb(plain as f64),
        mb(saving as f64),
        mb(saving_async as f64),
        mb(loading as f64),
        mb(ckpt_bytes as f64)
    );
    let bound = 8e6;
    let extra_save = saving as f64 - plain as f64;
    assert!(
        extra_save <= 0.1 * ckpt_bytes as f64 + bound,
        "a save added {:.1} MB for a {:.1} MB checkpoint",
        mb(extra_save),
        mb(ckpt_bytes as f64)
    );
    let extra_async = saving_async as f64 - plain as f64;
    assert!(
        extra_async <= 1.1 * ckpt_bytes as f64 + bound,
        "an async save added {:.1} MB for a {:.1} MB checkpoint",
        mb(extra_async),
        mb(ckpt_bytes as f64)
    );
    let extra_load = loading as f64 - plain as f64;
    assert!(
        extra_load <= 0.1 * ckpt_bytes as f64 + bound,
        "a load added {:.1} MB for a {:.1} MB checkpoint",
        mb(extra_load),
        mb(ckpt_bytes as f64)
    );
    let _ = std::fs::remove_dir_all(dir);
}
