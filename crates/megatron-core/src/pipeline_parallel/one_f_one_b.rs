//! 1F1B (Megatron's `forward_backward_pipelining_without_interleaving`): stage r of p runs
//! `min(p - r - 1, m)` warm-up forwards, then alternates one forward and one backward, then
//! runs the remaining backwards. A stage never holds more than `min(p - r, m)` micro-batches.

use super::Op;

pub fn warmup(p: usize, rank: usize, m: usize) -> usize {
    (p - rank - 1).min(m)
}

pub fn schedule(p: usize, rank: usize, m: usize) -> Vec<Op> {
    let w = warmup(p, rank, m);
    let steady = m - w;
    let mut ops = Vec::with_capacity(2 * m);
    ops.extend((0..w).map(|mb| Op::Forward { chunk: 0, mb }));
    for i in 0..steady {
        ops.push(Op::Forward {
            chunk: 0,
            mb: w + i,
        });
        ops.push(Op::Backward { chunk: 0, mb: i });
    }
    ops.extend((steady..m).map(|mb| Op::Backward { chunk: 0, mb }));
    ops
}
