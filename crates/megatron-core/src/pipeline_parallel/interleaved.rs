//! Interleaved 1F1B (Megatron's `forward_backward_pipelining_with_interleaving`): each stage
//! holds `v` model chunks (virtual stages `chunk * p + rank`); micro-batches go through the
//! chunks in groups of `p`. Warm-up `(p - r - 1) * 2 + (v - 1) * p` virtual micro-batches (all
//! of them when `m == p`), then 1F1B, then cool-down.

use super::Op;

/// Megatron's constraint for this schedule: the micro-batches split into groups of `p`.
pub fn check(p: usize, m: usize, v: usize) -> Result<(), String> {
    if v < 2 {
        return Err("the interleaved schedule needs at least 2 model chunks per stage".into());
    }
    if m == 0 || !m.is_multiple_of(p) {
        return Err(format!(
            "number of microbatches ({m}) is not divisible by pipeline-model-parallel-size ({p}) when using interleaved schedule"
        ));
    }
    Ok(())
}

pub fn warmup(p: usize, rank: usize, m: usize, v: usize) -> usize {
    let total = m * v;
    if m == p {
        total
    } else {
        ((p - rank - 1) * 2 + (v - 1) * p).min(total)
    }
}

/// Chunk of the `k`-th virtual micro-batch (forward order; backward runs the chunks in reverse).
fn chunk_id(k: usize, p: usize, v: usize, forward: bool) -> usize {
    let c = (k % (p * v)) / p;
    if forward {
        c
    } else {
        v - c - 1
    }
}

fn microbatch_id(k: usize, p: usize, v: usize) -> usize {
    (k / (p * v)) * p + k % p
}

pub fn schedule(p: usize, rank: usize, m: usize, v: usize) -> Result<Vec<Op>, String> {
    check(p, m, v)?;
    let total = m * v;
    let w = warmup(p, rank, m, v);
    let fwd = |k: usize| Op::Forward {
        chunk: chunk_id(k, p, v, true),
        mb: microbatch_id(k, p, v),
    };
    let bwd = |k: usize| Op::Backward {
        chunk: chunk_id(k, p, v, false),
        mb: microbatch_id(k, p, v),
    };
    let mut ops = Vec::with_capacity(2 * total);
    ops.extend((0..w).map(fwd));
    let steady = total - w;
    for i in 0..steady {
        ops.push(fwd(w + i));
        ops.push(bwd(i));
    }
    ops.extend((steady..total).map(bwd));
    Ok(ops)
}
