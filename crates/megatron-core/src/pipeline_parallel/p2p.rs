//! Point-to-point exchange between neighbouring (virtual) stages. Shapes come from the
//! configuration (`[tokens, h]`, or this rank's `[tokens / t, h]` block under sequence
//! parallelism), so there is no shape handshake. Sends do not wait for the receiver on either
//! backend (the thread backend's mailboxes, MPI's pending non-blocking sends), so a stage's
//! send overlaps with its next compute and neighbours cannot deadlock sending to each other.

use megatron_comm::{CommError, Communicator};
use megatron_tensor::{DType, Tensor};

/// Message tag of the activation (or, `backward`, the gradient) of micro-batch `mb` arriving at
/// virtual stage `vs` of `stages`.
pub fn tag(mb: usize, vs: usize, stages: usize, backward: bool) -> u64 {
    (((mb * stages + vs) * 2) + backward as usize) as u64
}

/// Sends `x` as f32: a bf16 activation (the residual stream under `--bf16`) is widened, which
/// is exact, and the receiving stage rounds it back to the same bits.
pub fn send(pp: &mut dyn Communicator, x: &Tensor, dst: usize, tag: u64) -> Result<(), CommError> {
    match x.dtype() {
        DType::F32 => pp.send(x.data(), dst, tag),
        _ => pp.send(x.to_dtype(DType::F32).data(), dst, tag),
    }
}

pub fn recv(
    pp: &mut dyn Communicator,
    shape: &[usize],
    src: usize,
    tag: u64,
) -> Result<Tensor, CommError> {
    let mut x = Tensor::for_overwrite(shape);
    pp.recv(x.data_mut(), src, tag)?;
    Ok(x)
}
