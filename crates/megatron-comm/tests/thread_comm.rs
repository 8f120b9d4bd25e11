use megatron_comm::{run_ranks, Axis, CommError, Communicator, ParallelState, ReduceOp};
use std::time::{Duration, Instant};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

#[test]
fn all_reduce_of_rank_ids_has_the_closed_form_result() {
    for n in WORLDS {
        let out = run_ranks(n, move |rank, c| {
            let mut sum = vec![rank as f32; 1001];
            c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
            let mut avg = vec![rank as f32; 7];
            c.all_reduce(&mut avg, ReduceOp::Avg).unwrap();
            let mut mx = vec![rank as f32, -(rank as f32)];
            c.all_reduce(&mut mx, ReduceOp::Max).unwrap();
            let mut mn = vec![rank as f32, -(rank as f32)];
            c.all_reduce(&mut mn, ReduceOp::Min).unwrap();
            (sum, avg, mx, mn)
        });
        let total = (n * (n - 1) / 2) as f32;
        for r in out {
            let (sum, avg, mx, mn) = r.unwrap();
            assert!(sum.iter().all(|&v| v == total), "world {n}");
            assert!(avg.iter().all(|&v| (v - total / n as f32).abs() < 1e-6));
            assert_eq!(mx, vec![(n - 1) as f32, 0.0]);
            assert_eq!(mn, vec![0.0, -((n - 1) as f32)]);
        }
    }
}

#[test]
fn all_gather_reduce_scatter_and_broadcast_have_closed_form_results() {
    for n in WORLDS {
        let out = run_ranks(n, move |rank, c| {
            let mine: Vec<f32> = (0..3).map(|i| (10 * rank + i) as f32).collect();
            let mut gathered = vec![0.0; 3 * n];
            c.all_gather(&mine, &mut gathered).unwrap();
            // reduce-scatter: every rank contributes [0, 1, ..., 2n) + rank; rank r keeps slice r.
            let input: Vec<f32> = (0..2 * n).map(|i| (i + rank) as f32).collect();
            let mut slice = vec![0.0; 2];
            c.reduce_scatter(&input, &mut slice, ReduceOp::Sum).unwrap();
            let mut b = vec![rank as f32; 4];
            c.broadcast(&mut b, n - 1).unwrap();
            (gathered, slice, b)
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (gathered, slice, b) = r.unwrap();
            let want: Vec<f32> = (0..n)
                .flat_map(|q| (0..3).map(move |i| (10 * q + i) as f32))
                .collect();
            assert_eq!(gathered, want);
            let base = (n * (n - 1) / 2) as f32;
            assert_eq!(
                slice,
                vec![
                    (n * 2 * rank) as f32 + base,
                    (n * (2 * rank + 1)) as f32 + base
                ]
            );
            assert_eq!(b, vec![(n - 1) as f32; 4]);
        }
    }
}

#[test]
fn send_recv_around_a_ring() {
    for n in WORLDS {
        let out = run_ranks(n, move |rank, c| {
            let next = (rank + 1) % n;
            let prev = (rank + n - 1) % n;
            c.send(&[rank as f32, 7.0], next, 3).unwrap();
            let mut got = [0.0f32; 2];
            c.recv(&mut got, prev, 3).unwrap();
            got
        });
        for (rank, r) in out.into_iter().enumerate() {
            assert_eq!(r.unwrap(), [((rank + n - 1) % n) as f32, 7.0]);
        }
    }
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
fn split_by_parallel_state_groups_reduces_within_each_group() {
    // World 8 = TP2 x PP2 x DP2: all-reduce the rank id within TP, DP and PP groups.
    let out = run_ranks(8, |rank, c| {
        let ps = ParallelState::new(8, 2, 2, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
        let mut sums = Vec::new();
        for axis in [Axis::Tp, Axis::Dp, Axis::Pp] {
            let groups = ps.groups(&[axis]);
            let color = groups.iter().position(|g| g.contains(&rank)).unwrap();
            let mut sub = c.split(color, rank).unwrap();
            let (g, pos) = ParallelState::group_of(&groups, rank).unwrap();
            assert_eq!((sub.size(), sub.rank()), (g.len(), pos));
            let mut v = vec![rank as f32];
            sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            sums.push(v[0]);
        }
        sums
    });
    let expect = |rank: usize| -> Vec<f32> {
        let ps = ParallelState::new(8, 2, 2, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
        [Axis::Tp, Axis::Dp, Axis::Pp]
            .iter()
            .map(|&a| {
                ParallelState::group_of(&ps.groups(&[a]), rank)
                    .unwrap()
                    .0
                    .iter()
                    .sum::<usize>() as f32
            })
            .collect()
    };
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(r.unwrap(), expect(rank), "rank {rank}");
    }
}

#[test]
fn a_missing_rank_times_out_with_an_error_naming_it() {
    let out = run_ranks(3, |rank, c| {
        c.set_timeout(Duration::from_millis(300));
        if rank == 2 {
            return None; // never joins the collective
        }
        let t = Instant::now();
        let mut v = vec![1.0f32; 4];
        let e = c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        Some((e, t.elapsed()))
    });
    for r in out.into_iter().take(2) {
        let (e, took) = r.unwrap().unwrap();
        match &e {
            CommError::Timeout {
                group, op, missing, ..
            } => {
                assert_eq!(
                    (group.as_str(), *op, missing.as_slice()),
                    ("world", "all_reduce", &[2usize][..])
                );
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(e.to_string().contains("[2]"), "{e}");
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_millis(1500),
            "{took:?}"
        );
    }
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

#[test]
fn all_to_all_transposes_the_parts() {
    for n in WORLDS {
        let out = run_ranks(n, move |rank, c| {
            let input: Vec<f32> = (0..2 * n).map(|i| (100 * rank + i) as f32).collect();
            let mut out = vec![0.0; 2 * n];
            c.all_to_all(&input, &mut out).unwrap();
            out
        });
        for (rank, r) in out.into_iter().enumerate() {
            let want: Vec<f32> = (0..n)
                .flat_map(|q| (0..2).map(move |k| (100 * q + 2 * rank + k) as f32))
                .collect();
            assert_eq!(r.unwrap(), want, "world {n} rank {rank}");
        }
    }
}

#[test]
fn consecutive_all_reduces_of_different_sizes_stay_correct() {
    let out = run_ranks(3, |rank, c| {
        let mut total = 0.0f32;
        for len in [1usize, 1000, 7, 50_000, 3] {
            let mut v = vec![(rank + 1) as f32; len];
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == 6.0), "len {len}");
            total += v[0];
        }
        total
    });
    assert!(out.into_iter().all(|r| r.unwrap() == 30.0));
}

#[test]
fn typed_collectives_reduce_half_types_in_f32_and_integers_exactly() {
    use half::{bf16, f16};
    use megatron_comm::TypedCollectives;
    for n in WORLDS {
        let out = run_ranks(n, move |rank, c| {
            let mut b = vec![bf16::from_f32(rank as f32 + 0.5); 5];
            c.all_reduce_bf16(&mut b, ReduceOp::Sum).unwrap();
            let mut h = vec![f16::from_f32(rank as f32); 3];
            c.all_reduce_f16(&mut h, ReduceOp::Max).unwrap();
            // Beyond f32's exact integer range: exact only if reduced as integers.
            let big = (1i64 << 40) + rank as i64;
            let mut i = vec![big, -(rank as i64)];
            c.all_reduce_i64(&mut i, ReduceOp::Sum).unwrap();
            let mut j = vec![rank as i32 * 3, 7];
            c.all_reduce_i32(&mut j, ReduceOp::Min).unwrap();
            let mut g = vec![0i64; 2 * n];
            c.all_gather_i64(&[big, -big], &mut g).unwrap();
            let mut bytes = if rank == 0 {
                b"megatron-rs".to_vec()
            } else {
                vec![0u8; 11]
            };
            c.broadcast_u8(&mut bytes, 0).unwrap();
            (b, h, i, j, g, bytes)
        });
        let tri = (n * (n - 1) / 2) as i64;
        for r in out {
            let (b, h, i, j, g, bytes) = r.unwrap();
            let want_b = bf16::from_f32(tri as f32 + 0.5 * n as f32);
            assert!(b.iter().all(|v| *v == want_b), "bf16 world {n}");
            assert!(h.iter().all(|v| v.to_f32() == (n - 1) as f32));
            assert_eq!(i, vec![(n as i64) * (1i64 << 40) + tri, -tri]);
            assert_eq!(j, vec![0, 7]);
            let want_g: Vec<i64> = (0..n)
                .flat_map(|q| [(1i64 << 40) + q as i64, -((1i64 << 40) + q as i64)])
                .collect();
            assert_eq!(g, want_g);
            assert_eq!(bytes, b"megatron-rs".to_vec());
        }
    }
}

#[test]
fn all_to_all_v_routes_variable_splits() {
    for n in WORLDS {
        let out = run_ranks(n, move |rank, c| {
            // Rank r sends q + 1 copies of (100 r + q) to rank q.
            let send_counts: Vec<usize> = (0..n).map(|q| q + 1).collect();
            let input: Vec<f32> = (0..n)
                .flat_map(|q| std::iter::repeat_n((100 * rank + q) as f32, q + 1))
                .collect();
            let recv_counts = vec![rank + 1; n];
            let mut out = vec![0.0; n * (rank + 1)];
            c.all_to_all_v(&input, &send_counts, &mut out, &recv_counts)
                .unwrap();
            out
        });
        for (rank, r) in out.into_iter().enumerate() {
            let want: Vec<f32> = (0..n)
                .flat_map(|q| std::iter::repeat_n((100 * q + rank) as f32, rank + 1))
                .collect();
            assert_eq!(r.unwrap(), want, "world {n} rank {rank}");
        }
    }
}
