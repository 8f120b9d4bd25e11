//! The collective suite against the MPI backend. Run under MPI, e.g.
//! `mpirun --allow-run-as-root --oversubscribe -np 4 target/release/deps/mpi_comm-*`
//! (also correct as a single process). No test harness: MPI is initialized once per process.

use megatron_comm::mpi_comm::MpiCommunicator;
use megatron_comm::{Communicator, ReduceOp, TypedCollectives};

fn main() {
    let universe = mpi::initialize().expect("MPI initializes");
    let mut c = MpiCommunicator::world(&universe);
    let (rank, n) = (c.rank(), c.size());
    let tri = (n * (n - 1) / 2) as f32;

    let mut v = vec![rank as f32; 1001];
    c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert!(v.iter().all(|&x| x == tri), "all_reduce sum");
    let mut m = vec![rank as f32, -(rank as f32)];
    c.all_reduce(&mut m, ReduceOp::Max).unwrap();
    assert_eq!(m, vec![(n - 1) as f32, 0.0]);

    let mine: Vec<f32> = (0..3).map(|i| (10 * rank + i) as f32).collect();
    let mut g = vec![0.0; 3 * n];
    c.all_gather(&mine, &mut g).unwrap();
    assert_eq!(
        g,
        (0..n)
            .flat_map(|q| (0..3).map(move |i| (10 * q + i) as f32))
            .collect::<Vec<_>>()
    );

    let input: Vec<f32> = (0..2 * n).map(|i| (i + rank) as f32).collect();
    let mut s = vec![0.0; 2];
    c.reduce_scatter(&input, &mut s, ReduceOp::Sum).unwrap();
    assert_eq!(
        s,
        vec![
            (n * 2 * rank) as f32 + tri,
            (n * (2 * rank + 1)) as f32 + tri
        ]
    );

    let mut b = vec![rank as f32; 4];
    c.broadcast(&mut b, n - 1).unwrap();
    assert_eq!(b, vec![(n - 1) as f32; 4]);

    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;
    let mut got = [0.0f32; 2];
    if n > 1 {
        // Even ranks send first, odd receive first: no deadlock with blocking calls.
        if rank % 2 == 0 {
            c.send(&[rank as f32, 7.0], next, 3).unwrap();
            c.recv(&mut got, prev, 3).unwrap();
        } else {
            c.recv(&mut got, prev, 3).unwrap();
            c.send(&[rank as f32, 7.0], next, 3).unwrap();
        }
        assert_eq!(got, [prev as f32, 7.0]);
    }

    let input: Vec<f32> = (0..2 * n).map(|i| (100 * rank + i) as f32).collect();
    let mut out = vec![0.0; 2 * n];
    c.all_to_all(&input, &mut out).unwrap();
    assert_eq!(
        out,
        (0..n)
            .flat_map(|q| (0..2).map(move |k| (100 * q + 2 * rank + k) as f32))
            .collect::<Vec<_>>()
    );

    let send_counts: Vec<usize> = (0..n).map(|q| q + 1).collect();
    let input: Vec<f32> = (0..n)
        .flat_map(|q| std::iter::repeat_n((100 * rank + q) as f32, q + 1))
        .collect();
    let mut out = vec![0.0; n * (rank + 1)];
    c.all_to_all_v(&input, &send_counts, &mut out, &vec![rank + 1; n])
        .unwrap();
    assert_eq!(
        out,
        (0..n)
            .flat_map(|q| std::iter::repeat_n((100 * q + rank) as f32, rank + 1))
            .collect::<Vec<_>>()
    );

    let mut i = vec![(1i64 << 40) + rank as i64];
    c.all_reduce_i64(&mut i, ReduceOp::Sum).unwrap();
    assert_eq!(i[0], (n as i64) * (1i64 << 40) + tri as i64);

    // Sub-groups by split: even and odd ranks.
    let mut sub = c.split(rank % 2, rank).unwrap();
    let mut x = vec![rank as f32];
    sub.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    let want: usize = (0..n).filter(|q| q % 2 == rank % 2).sum();
    assert_eq!(x[0], want as f32);
    c.barrier().unwrap();
    assert!(c.stats().calls["all_reduce"] >= 2);
    if rank == 0 {
        println!("mpi collective suite, world {n}: 12 checks passed");
    }
}
