//! The thread backend: the shared collective suite (`megatron_comm::conformance`, also run
//! against MPI by `tests/mpi_comm.rs`) plus what only threads can show in-process: bit-identical
//! reruns and a panicking or failing rank that does not hang its peers.

use megatron_comm::conformance::{collective_suite, timeout_suite};
use megatron_comm::{
    run_ranks, run_ranks_until_failure, CommError, Communicator, RankOutcome, ReduceOp,
};
use std::time::{Duration, Instant};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

#[test]
fn collective_suite_passes_on_worlds_1_2_3_4_8() {
    for n in WORLDS {
        let out = run_ranks(n, |_, c| collective_suite(c));
        for (rank, r) in out.into_iter().enumerate() {
            let checks = r.unwrap().unwrap_or_else(|e| panic!("world {n}: {e}"));
            assert!(checks >= 20, "world {n} rank {rank}: {checks} checks");
        }
    }
}

#[test]
fn a_missing_rank_times_out_with_an_error_naming_it() {
    for n in [2, 3, 4] {
        let out = run_ranks(n, |_, c| {
            // A failed check returns early; its peers then time out here instead of hanging.
            c.set_timeout(Duration::from_secs(10));
            timeout_suite(c, Duration::from_millis(300), Duration::from_millis(1200))
        });
        for r in out {
            assert_eq!(r, Ok(Ok(1)), "world {n}");
        }
    }
}

#[test]
fn a_group_that_timed_out_refuses_later_calls() {
    let out = run_ranks(2, |rank, c| {
        c.set_timeout(Duration::from_millis(100));
        let mut v = vec![1.0f32; 4];
        if rank == 0 {
            let first = c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            let again = c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            Some((first, again))
        } else {
            std::thread::sleep(Duration::from_millis(300));
            // Arrives after rank 0 gave up: must not read rank 0's (released) buffer.
            assert!(c.all_reduce(&mut v, ReduceOp::Sum).is_err());
            None
        }
    });
    let (first, again) = out[0].as_ref().unwrap().as_ref().unwrap();
    assert!(matches!(first, CommError::Timeout { .. }), "{first}");
    assert_eq!(first, again);
    assert!(out[1].is_ok());
}

#[test]
fn results_are_bit_identical_across_runs() {
    let run = || {
        run_ranks(4, |rank, c| {
            let mut v: Vec<f32> = (0..10_000)
                .map(|i| ((i * 7919 + rank * 104729) % 1000) as f32 * 1e-3 + 0.1)
                .collect();
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            v
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let a = run();
    assert!(
        a.iter().all(|v| v == &a[0]),
        "every rank holds the same result"
    );
    assert_eq!(a, run());
}

#[test]
fn a_panicking_rank_fails_its_peers_fast_instead_of_hanging() {
    let t = Instant::now();
    let out = run_ranks(4, |rank, c| {
        c.set_timeout(Duration::from_secs(60));
        if rank == 1 {
            panic!("rank one fails");
        }
        let mut v = vec![1.0f32; 4];
        c.all_reduce(&mut v, ReduceOp::Sum)
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "peers did not wait for the timeout"
    );
    assert!(out[1]
        .as_ref()
        .unwrap_err()
        .contains("rank 1 panicked: rank one fails"));
    for r in [0, 2, 3] {
        let e = out[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(matches!(e, CommError::PeerPanicked { rank: 1, .. }), "{e}");
    }
}

#[test]
fn a_rank_panicking_outside_a_subgroup_call_fails_that_subgroup_fast() {
    let t = Instant::now();
    let out = run_ranks(4, |rank, c| {
        c.set_timeout(Duration::from_secs(60));
        let mut sub = c.split(rank % 2, rank).unwrap();
        if rank == 3 {
            panic!("rank three fails");
        }
        let mut v = vec![1.0f32; 4];
        sub.all_reduce(&mut v, ReduceOp::Sum)
    });
    assert!(t.elapsed() < Duration::from_secs(10), "rank 1 hung");
    // Rank 1 shares the odd group with the panicked rank 3 (group rank 1 there); the even group,
    // which rank 3 is not part of, completes.
    let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        matches!(e, CommError::PeerPanicked { rank: 1, ref group, .. } if group == "world/1[1, 3]"),
        "{e}"
    );
    assert!(out[0].as_ref().unwrap().is_ok(), "{:?}", out[0]);
}

#[test]
fn a_rank_returning_an_error_fails_its_peers_fast_naming_it() {
    // Rank 2's work fails (say, a sample it cannot read) after a split: its peers' calls in the
    // world and in its subgroup end at once instead of waiting out the 60 s timeout.
    let t = Instant::now();
    let out = run_ranks_until_failure(4, Duration::from_secs(90), |rank, c| {
        c.set_timeout(Duration::from_secs(60));
        let mut sub = c.split(rank % 2, rank).unwrap();
        if rank == 2 {
            return Err(CommError::Usage {
                group: "data".into(),
                op: "fill",
                msg: "bad sample".into(),
            });
        }
        let mut v = vec![1.0f32; 4];
        sub.all_reduce(&mut v, ReduceOp::Sum)?;
        c.all_reduce(&mut v, ReduceOp::Sum)
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "peers waited for the timeout"
    );
    let err = |r: usize| match &out[r] {
        RankOutcome::Finished(Err(e)) => e.clone(),
        other => panic!("rank {r}: {other:?}"),
    };
    assert!(err(2).to_string().contains("bad sample"));
    // Rank 0 shares the even group with rank 2 (its rank 1 there); ranks 1 and 3 finish their
    // odd group and meet the failure in the world, where it is rank 2.
    assert!(
        matches!(err(0), CommError::PeerFailed { rank: 1, ref group, .. } if group == "world/0[0, 2]"),
        "{}",
        err(0)
    );
    for r in [1, 3] {
        assert!(
            matches!(err(r), CommError::PeerFailed { rank: 2, ref group, .. } if group == "world"),
            "{}",
            err(r)
        );
    }
}

#[test]
fn counters_record_calls_and_bytes_per_operation() {
    let out = run_ranks(2, |_, c| {
        let mut v = vec![0.0f32; 256];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        c.stats()
    });
    let s = out[0].as_ref().unwrap();
    assert_eq!(s.calls["all_reduce"], 2);
    assert_eq!(s.bytes["all_reduce"], 2 * 256 * 4);
    assert_eq!(s.calls["barrier"], 1);
}
