//! The collective suite every backend must pass, written once against `Communicator` so the
//! thread backend (`tests/thread_comm.rs`) and MPI (`tests/mpi_comm.rs`, under `mpirun`) run the
//! same checks. Every check compares with a closed form (Megatron style: inputs are rank ids) and
//! returns an error naming the world size, rank and check instead of panicking, so one failing
//! rank reports what it saw while its peers finish.

use crate::communicator::{CommError, Communicator, ReduceOp};
use crate::parallel_state::{Axis, ParallelState};
use crate::typed::TypedCollectives;
use half::{bf16, f16};
use std::time::{Duration, Instant};

fn check<T: PartialEq + std::fmt::Debug>(
    c: &dyn Communicator,
    what: &str,
    got: T,
    want: T,
) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "world {} rank {}: {what}: got {got:?}, expected {want:?}",
            c.size(),
            c.rank()
        ))
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn ok<T>(r: Result<T, CommError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Runs every closed-form check on `c` (all members of its group must call it). Returns the
/// number of checks passed.
pub fn collective_suite(c: &mut dyn Communicator) -> Result<usize, String> {
    let (rank, n) = (c.rank(), c.size());
    let tri = (n * (n - 1) / 2) as f32;
    let mut checks = 0;

    // all_reduce: sum, avg, max, min of rank ids.
    let mut sum = vec![rank as f32; 1001];
    ok(c.all_reduce(&mut sum, ReduceOp::Sum), "all_reduce sum")?;
    check(c, "all_reduce sum", sum, vec![tri; 1001])?;
    let mut avg = vec![rank as f32; 7];
    ok(c.all_reduce(&mut avg, ReduceOp::Avg), "all_reduce avg")?;
    let want = tri / n as f32;
    check(
        c,
        "all_reduce avg",
        avg.iter().all(|v| (v - want).abs() <= 1e-6 * want.max(1.0)),
        true,
    )?;
    let mut mx = vec![rank as f32, -(rank as f32)];
    ok(c.all_reduce(&mut mx, ReduceOp::Max), "all_reduce max")?;
    check(c, "all_reduce max", mx, vec![(n - 1) as f32, 0.0])?;
    let mut mn = vec![rank as f32, -(rank as f32)];
    ok(c.all_reduce(&mut mn, ReduceOp::Min), "all_reduce min")?;
    check(c, "all_reduce min", mn, vec![0.0, -((n - 1) as f32)])?;
    checks += 4;

    // Consecutive calls of different sizes reuse buffers correctly.
    for len in [1usize, 1000, 7, 50_000, 3] {
        let mut v = vec![(rank + 1) as f32; len];
        ok(c.all_reduce(&mut v, ReduceOp::Sum), "all_reduce sizes")?;
        check(
            c,
            &format!("all_reduce of {len} elements"),
            v,
            vec![tri + n as f32; len],
        )?;
    }
    checks += 1;

    // Above the MPI backend's staging piece (2^22 elements): every position reduced once.
    let big = (1 << 22) + 3;
    let mut v: Vec<f32> = (0..big).map(|i| (i % 1013 + rank) as f32).collect();
    ok(c.all_reduce(&mut v, ReduceOp::Sum), "all_reduce large")?;
    check(
        c,
        "all_reduce of 2^22 + 3 elements",
        v.iter()
            .enumerate()
            .all(|(i, x)| *x == (n * (i % 1013)) as f32 + tri),
        true,
    )?;
    let root = n - 1;
    v.iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = if rank == root { (i % 977) as f32 } else { -1.0 });
    ok(c.broadcast(&mut v, root), "broadcast large")?;
    check(
        c,
        "broadcast of 2^22 + 3 elements",
        v.iter().enumerate().all(|(i, x)| *x == (i % 977) as f32),
        true,
    )?;
    drop(v);
    checks += 2;

    // Sums are added in rank order, ((x0 + x1) + x2) + ..., on every backend, so runs give
    // the same bits on rank threads and under any MPI library. These values tell the orders
    // apart in f32: 1 + 1e8 rounds to 1e8, so the rank-order sum of [1, 1e8, -1e8, 1] is 1
    // while pairwise ((1 + 1e8) + (-1e8 + 1)) gives 0.
    let pattern = [1.0f32, 1e8, -1e8, 1.0, 3.0, -1e8, 1e8, 0.5];
    let value =
        |q: usize, i: usize| pattern[(q + i) % pattern.len()] * (1 + q / pattern.len()) as f32;
    let width = 3 * n + 1;
    let in_rank_order = |i: usize| (1..n).fold(value(0, i), |acc, q| acc + value(q, i));
    let mut v: Vec<f32> = (0..width).map(|i| value(rank, i)).collect();
    ok(c.all_reduce(&mut v, ReduceOp::Sum), "all_reduce rank order")?;
    let want: Vec<f32> = (0..width).map(in_rank_order).collect();
    check(c, "all_reduce sums in rank order", bits(&v), bits(&want))?;
    let input: Vec<f32> = (0..3 * n).map(|i| value(rank, i)).collect();
    let mut mine = vec![0.0; 3];
    ok(
        c.reduce_scatter(&input, &mut mine, ReduceOp::Sum),
        "reduce_scatter rank order",
    )?;
    let want: Vec<f32> = (3 * rank..3 * rank + 3).map(in_rank_order).collect();
    check(
        c,
        "reduce_scatter sums in rank order",
        bits(&mine),
        bits(&want),
    )?;
    checks += 2;

    // all_gather: rank order.
    let mine: Vec<f32> = (0..3).map(|i| (10 * rank + i) as f32).collect();
    let mut gathered = vec![0.0; 3 * n];
    ok(c.all_gather(&mine, &mut gathered), "all_gather")?;
    let want: Vec<f32> = (0..n)
        .flat_map(|q| (0..3).map(move |i| (10 * q + i) as f32))
        .collect();
    check(c, "all_gather order", gathered, want)?;
    checks += 1;

    // reduce_scatter: every rank contributes [0, 2n) + rank; rank r keeps slice r.
    let input: Vec<f32> = (0..2 * n).map(|i| (i + rank) as f32).collect();
    let mut slice = vec![0.0; 2];
    ok(
        c.reduce_scatter(&input, &mut slice, ReduceOp::Sum),
        "reduce_scatter",
    )?;
    let want = vec![
        (n * 2 * rank) as f32 + tri,
        (n * (2 * rank + 1)) as f32 + tri,
    ];
    check(c, "reduce_scatter slice", slice, want)?;
    checks += 1;

    // broadcast from the last rank.
    let mut b = vec![rank as f32; 4];
    ok(c.broadcast(&mut b, n - 1), "broadcast")?;
    check(c, "broadcast", b, vec![(n - 1) as f32; 4])?;
    checks += 1;

    // send/recv around a ring; even ranks send first so blocking backends cannot deadlock.
    if n > 1 {
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let mut got = [0.0f32; 2];
        if rank % 2 == 0 {
            ok(c.send(&[rank as f32, 7.0], next, 3), "send")?;
            ok(c.recv(&mut got, prev, 3), "recv")?;
        } else {
            ok(c.recv(&mut got, prev, 3), "recv")?;
            ok(c.send(&[rank as f32, 7.0], next, 3), "send")?;
        }
        check(c, "send/recv ring", got, [prev as f32, 7.0])?;
        checks += 1;
    }

    // all_to_all: a transpose of equal parts.
    let input: Vec<f32> = (0..2 * n).map(|i| (100 * rank + i) as f32).collect();
    let mut out = vec![0.0; 2 * n];
    ok(c.all_to_all(&input, &mut out), "all_to_all")?;
    let want: Vec<f32> = (0..n)
        .flat_map(|q| (0..2).map(move |k| (100 * q + 2 * rank + k) as f32))
        .collect();
    check(c, "all_to_all permutation", out, want)?;
    checks += 1;

    // all_to_all_v: rank r sends q + 1 copies of (100 r + q) to rank q.
    let send_counts: Vec<usize> = (0..n).map(|q| q + 1).collect();
    let input: Vec<f32> = (0..n)
        .flat_map(|q| std::iter::repeat_n((100 * rank + q) as f32, q + 1))
        .collect();
    let mut out = vec![0.0; n * (rank + 1)];
    ok(
        c.all_to_all_v(&input, &send_counts, &mut out, &vec![rank + 1; n]),
        "all_to_all_v",
    )?;
    let want: Vec<f32> = (0..n)
        .flat_map(|q| std::iter::repeat_n((100 * q + rank) as f32, rank + 1))
        .collect();
    check(c, "all_to_all_v routing", out, want)?;
    checks += 1;

    // Typed collectives: half types reduce in f32, integers exactly (beyond f32's 2^24).
    let mut hb = vec![bf16::from_f32(rank as f32 + 0.5); 5];
    ok(c.all_reduce_bf16(&mut hb, ReduceOp::Sum), "bf16 all_reduce")?;
    check(
        c,
        "bf16 all_reduce",
        hb,
        vec![bf16::from_f32(tri + 0.5 * n as f32); 5],
    )?;
    let mut hf = vec![f16::from_f32(rank as f32); 3];
    ok(c.all_reduce_f16(&mut hf, ReduceOp::Max), "f16 all_reduce")?;
    check(
        c,
        "f16 all_reduce",
        hf,
        vec![f16::from_f32((n - 1) as f32); 3],
    )?;
    let big = (1i64 << 40) + rank as i64;
    let itri = tri as i64;
    let mut i = vec![big, -(rank as i64)];
    ok(c.all_reduce_i64(&mut i, ReduceOp::Sum), "i64 all_reduce")?;
    check(
        c,
        "i64 all_reduce",
        i,
        vec![(n as i64) * (1i64 << 40) + itri, -itri],
    )?;
    let mut j = vec![rank as i32 * 3, 7];
    ok(c.all_reduce_i32(&mut j, ReduceOp::Min), "i32 all_reduce")?;
    check(c, "i32 all_reduce", j, vec![0, 7])?;
    let mut g = vec![0i64; 2 * n];
    ok(c.all_gather_i64(&[big, -big], &mut g), "i64 all_gather")?;
    let want: Vec<i64> = (0..n)
        .flat_map(|q| [(1i64 << 40) + q as i64, -((1i64 << 40) + q as i64)])
        .collect();
    check(c, "i64 all_gather", g, want)?;
    // bf16 travels as bit pairs: an odd length (padded in transit), a NaN's payload, a
    // subnormal and -0 arrive exact.
    let mine = |q: usize| {
        [
            bf16::from_f32(q as f32 + 0.5),
            bf16::from_bits(0x7fc1 + q as u16),
            bf16::from_bits(0x0001),
            bf16::from_bits(0x8000),
            bf16::from_f32(-(q as f32) * 3.0e38),
        ]
    };
    let mut g16 = vec![bf16::ZERO; 5 * n];
    ok(c.all_gather_bf16(&mine(rank), &mut g16), "bf16 all_gather")?;
    let bits = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    let want16: Vec<bf16> = (0..n).flat_map(mine).collect();
    check(c, "bf16 all_gather", bits(g16), bits(want16))?;
    let mut bytes = if rank == 0 {
        b"megatron-rs".to_vec()
    } else {
        vec![0u8; 11]
    };
    ok(c.broadcast_u8(&mut bytes, 0), "u8 broadcast")?;
    check(c, "u8 broadcast", bytes, b"megatron-rs".to_vec())?;
    checks += 7;

    checks += subgroup_suite(c)?;

    // Counters: at least the calls made above, bytes of the first all-reduce included.
    let stats = c.stats();
    check(
        c,
        "all_reduce calls counted",
        stats.calls.get("all_reduce").copied().unwrap_or(0) >= 9,
        true,
    )?;
    check(
        c,
        "all_reduce bytes counted",
        stats.bytes.get("all_reduce").copied().unwrap_or(0) >= 1001 * 4,
        true,
    )?;
    checks += 1;
    ok(c.barrier(), "barrier")?;
    Ok(checks + 1)
}

/// Every layout of this world (both of Megatron's orders): split the communicator into each
/// group family of `ParallelState` and check an all-reduce and an all-gather of world ranks
/// against the group's member list.
pub fn subgroup_suite(c: &mut dyn Communicator) -> Result<usize, String> {
    let (rank, n) = (c.rank(), c.size());
    let mut checks = 0;
    let divisors: Vec<usize> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
    for order in [ParallelState::DEFAULT_ORDER, "tp-cp-ep-pp-dp"] {
        for &tp in &divisors {
            for &pp in &divisors {
                for &cp in &divisors {
                    if !n.is_multiple_of(tp * pp * cp) {
                        continue;
                    }
                    // Expert parallelism splits the data-parallel ranks.
                    for &ep in &divisors {
                        let Ok(ps) = ParallelState::new(n, tp, pp, cp, ep, order) else {
                            continue;
                        };
                        let families: Vec<(&str, Vec<Vec<usize>>)> = vec![
                            ("tp", ps.groups(&[Axis::Tp])),
                            ("pp", ps.groups(&[Axis::Pp])),
                            ("dp", ps.groups(&[Axis::Dp])),
                            ("cp", ps.groups(&[Axis::Cp])),
                            ("dp-cp", ps.groups(&[Axis::Cp, Axis::Dp])),
                            ("tp-pp", ps.groups(&[Axis::Tp, Axis::Pp])),
                            ("ep", ps.expert_groups(&[Axis::Ep])),
                        ];
                        for (family, groups) in families {
                            let (members, pos) = ParallelState::group_of(&groups, rank)
                                .ok_or_else(|| format!("rank {rank} in no {family} group"))?;
                            let members = members.to_vec();
                            let color = groups.iter().position(|g| *g == members).unwrap();
                            let what = format!("{} {family} group {members:?}", ps.describe());
                            let mut sub = ok(c.split(color, pos), &what)?;
                            check(
                                c,
                                &format!("{what}: size and rank"),
                                (sub.size(), sub.rank()),
                                (members.len(), pos),
                            )?;
                            let mut v = vec![rank as f32];
                            ok(sub.all_reduce(&mut v, ReduceOp::Sum), &what)?;
                            check(
                                c,
                                &format!("{what}: all_reduce of world ranks"),
                                v[0],
                                members.iter().sum::<usize>() as f32,
                            )?;
                            let mut g = vec![0.0; members.len()];
                            ok(sub.all_gather(&[rank as f32], &mut g), &what)?;
                            check(
                                c,
                                &format!("{what}: all_gather of world ranks"),
                                g,
                                members.iter().map(|&m| m as f32).collect(),
                            )?;
                            checks += 1;
                        }
                    }
                }
            }
        }
    }
    Ok(checks)
}

/// The last rank of the group stays away from one all-reduce on a split copy of `c`: the others
/// must get a timeout naming it, after `timeout` and within `timeout + margin`. Then the late
/// rank makes its call (so no operation is left pending) and must not hang either.
pub fn timeout_suite(
    c: &mut dyn Communicator,
    timeout: Duration,
    margin: Duration,
) -> Result<usize, String> {
    let (rank, n) = (c.rank(), c.size());
    if n < 2 {
        return Ok(0);
    }
    let mut t = ok(c.split_named(0, rank, "timeout-probe"), "split")?;
    t.set_timeout(timeout);
    let late = n - 1;
    if rank != late {
        let start = Instant::now();
        let mut v = vec![1.0f32; 4];
        let e = t.all_reduce(&mut v, ReduceOp::Sum);
        let took = start.elapsed();
        match e {
            Err(CommError::Timeout {
                ref group,
                op,
                ref missing,
                ..
            }) => {
                check(
                    c,
                    "timeout error",
                    (group.starts_with("timeout-probe"), op, missing.as_slice()),
                    (true, "all_reduce", &[late][..]),
                )?;
                let msg = e.unwrap_err().to_string();
                check(
                    c,
                    "timeout message names the rank",
                    msg.contains(&format!("[{late}]")),
                    true,
                )?;
            }
            other => return Err(format!("rank {rank}: expected a timeout, got {other:?}")),
        }
        // The first rank to time out marks the group broken; the others may see that a little
        // before their own deadline (they started waiting a little later).
        check(
            c,
            &format!("timed out after {took:?}"),
            took + timeout / 4 >= timeout && took < timeout + margin,
            true,
        )?;
    }
    ok(c.barrier(), "barrier after the timeout")?;
    if rank == late {
        let start = Instant::now();
        let mut v = vec![1.0f32; 4];
        // Either outcome is fine; hanging is not.
        let _ = t.all_reduce(&mut v, ReduceOp::Sum);
        check(
            c,
            "the late rank returned",
            start.elapsed() < timeout + margin,
            true,
        )?;
    }
    ok(c.barrier(), "barrier after the late call")?;
    Ok(1)
}
