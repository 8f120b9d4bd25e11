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

/// Sends `x` as `dtype`: f32 words, or bf16 values two to a word (an activation of the bf16
/// residual stream; rounded here if it arrives in f32, as the receiving stage's layers would
/// round it). An odd element count travels as f32 (the receiver derives the same choice from
/// the shape).
pub fn send(
    pp: &mut dyn Communicator,
    x: &Tensor,
    dtype: DType,
    dst: usize,
    tag: u64,
) -> Result<(), CommError> {
    if dtype == DType::BF16 && x.numel().is_multiple_of(2) {
        let narrowed;
        let x = match x.dtype() {
            DType::BF16 => x,
            _ => {
                narrowed = x.to_dtype(DType::BF16);
                &narrowed
            }
        };
        let words = x.bf16_words().expect("an even count of bf16 values");
        return pp.send(words, dst, tag);
    }
    match x.dtype() {
        DType::F32 => pp.send(x.data(), dst, tag),
        _ => pp.send(x.to_dtype(DType::F32).data(), dst, tag),
    }
}

/// Receives what [`send`] sent with the same `shape` and `dtype`.
pub fn recv(
    pp: &mut dyn Communicator,
    shape: &[usize],
    dtype: DType,
    src: usize,
    tag: u64,
) -> Result<Tensor, CommError> {
    let n: usize = shape.iter().product();
    if dtype == DType::BF16 && n.is_multiple_of(2) {
        let mut words = Tensor::for_overwrite(&[n / 2]);
        pp.recv(words.data_mut(), src, tag)?;
        return Ok(Tensor::bf16_from_words(words, shape));
    }
    let mut x = Tensor::for_overwrite(shape);
    pp.recv(x.data_mut(), src, tag)?;
    Ok(x)
}
