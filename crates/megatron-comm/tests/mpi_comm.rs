//! The shared collective suite (`megatron_comm::conformance`, also run on rank threads by
//! `tests/thread_comm.rs`) against the MPI backend. Run under MPI, e.g.
//! `mpirun --allow-run-as-root --oversubscribe -np 4 target/release/deps/mpi_comm-*`
//! (also correct as a single process). No test harness: MPI is initialized once per process.
//! A rank that dies is mpirun's to report (it aborts the job), so the panic check is threads-only.

use megatron_comm::conformance::{collective_suite, timeout_suite};
use megatron_comm::mpi_comm::MpiCommunicator;
use megatron_comm::Communicator;
use std::time::Duration;

fn main() {
    let universe = mpi::initialize().expect("MPI initializes");
    let mut c = MpiCommunicator::world(&universe);
    let n = c.size();
    let checks = collective_suite(&mut c).unwrap_or_else(|e| panic!("{e}"));
    let timeouts = timeout_suite(
        &mut c,
        Duration::from_millis(800),
        Duration::from_millis(1500),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    if c.rank() == 0 {
        println!(
            "mpi collective suite, world {n}: {} checks passed",
            checks + timeouts
        );
    }
}
