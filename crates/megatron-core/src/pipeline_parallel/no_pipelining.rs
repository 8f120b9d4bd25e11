//! No pipelining (Megatron's `forward_backward_no_pipelining`): gradient accumulation over the
//! micro-batches, one forward and its backward at a time.

use super::Op;

pub fn schedule(m: usize) -> Vec<Op> {
    (0..m)
        .flat_map(|mb| [Op::Forward { chunk: 0, mb }, Op::Backward { chunk: 0, mb }])
        .collect()
}
