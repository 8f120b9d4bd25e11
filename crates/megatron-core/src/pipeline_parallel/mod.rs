//! Pipeline parallelism (Megatron's `megatron/core/pipeline_parallel/`): how layers are split
//! into stages, the schedules (which forward and backward a stage runs next), point-to-point
//! exchange between neighbouring stages, and the executor that runs a schedule.

pub mod executor;
pub mod interleaved;
pub mod layer_layout;
pub mod no_pipelining;
pub mod one_f_one_b;
pub mod p2p;
pub mod partition;
pub mod timers;

/// One step of a stage's schedule: a forward or backward of micro-batch `mb` on model chunk
/// `chunk` (always 0 without interleaving).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Forward { chunk: usize, mb: usize },
    Backward { chunk: usize, mb: usize },
}

/// Largest number of micro-batches (counted per chunk) whose activations a stage holds at once
/// under a schedule: the running maximum of forwards minus backwards.
pub fn peak_in_flight(ops: &[Op]) -> usize {
    let (mut live, mut peak) = (0i64, 0i64);
    for op in ops {
        match op {
            Op::Forward { .. } => live += 1,
            Op::Backward { .. } => live -= 1,
        }
        peak = peak.max(live);
    }
    peak as usize
}

/// The schedule of stage `rank` of `p` for `m` micro-batches and `v` model chunks per stage:
/// no pipelining for `p == 1`, 1F1B for `v == 1`, interleaved 1F1B otherwise.
pub fn schedule(p: usize, rank: usize, m: usize, v: usize) -> Result<Vec<Op>, String> {
    if p == 1 {
        if v != 1 {
            return Err("virtual pipeline stages need --pipeline-model-parallel-size > 1".into());
        }
        Ok(no_pipelining::schedule(m))
    } else if v == 1 {
        Ok(one_f_one_b::schedule(p, rank, m))
    } else {
        interleaved::schedule(p, rank, m, v)
    }
}

/// The model chunks stage `rank` holds under `partition`, registered into `params`, and each
/// chunk's parameter indices (what `--overlap-grad-reduce` tracks). Any model family.
pub fn build_stage<F: crate::models::ModelFamily>(
    family: &F,
    partition: &partition::StagePartition,
    rank: usize,
    params: &mut crate::Params,
    inits: &mut Vec<crate::params::Init>,
) -> (Vec<F::Chunk>, Vec<std::ops::Range<usize>>) {
    let mut chunk_params = Vec::with_capacity(partition.v);
    let chunks = (0..partition.v)
        .map(|c| {
            let first = params.metas.len();
            let chunk = family.build_chunk(
                params,
                inits,
                partition.layers(rank, c),
                partition.is_first(rank, c),
                partition.is_last(rank, c),
            );
            chunk_params.push(first..params.metas.len());
            chunk
        })
        .collect();
    (chunks, chunk_params)
}
