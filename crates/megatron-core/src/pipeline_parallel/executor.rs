//! Runs a stage's schedule: for each forward, receive the input from the previous virtual stage
//! (unless this is the first), run the chunk, send the output on; for each backward, receive the
//! output gradient (unless last), run the chunk's backward, send the input gradient back.
//! A micro-batch's saved activations are freed as soon as its backward ran. The executor knows
//! a model only through [`ModelChunk`]; one stage without pipelining runs here too, under
//! `no_pipelining::schedule`.

use super::p2p;
use super::partition::StagePartition;
use super::timers::Timers;
use super::Op;
use crate::distributed::overlap::OverlapGradReduce;
use crate::models::model_chunk::{ChunkState, ModelChunk};
use crate::params::{Grads, Params};
use crate::tensor_parallel::Tp;
use crate::transformer::step::StepContext;
use megatron_comm::{CommError, Communicator};
use megatron_tensor::DType;
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

/// What one pass of a schedule produced on this stage.
#[derive(Clone, Debug, Default)]
pub struct PipelineRun {
    /// Last stage: (mean loss, unmasked tokens) of each micro-batch.
    pub losses: Vec<(f32, f32)>,
    /// Most micro-batches (per chunk) whose activations were held at once.
    pub peak_in_flight: usize,
    /// Most saved-activation bytes held at once.
    pub peak_activation_bytes: usize,
    /// Saved-activation bytes of one micro-batch, per model chunk.
    pub chunk_bytes: Vec<usize>,
}

/// The pieces of a stage: its chunks, where they sit, and its groups.
pub struct Stage<'a, 'g, M: ModelChunk> {
    pub chunks: &'a [M],
    pub partition: StagePartition,
    pub rank: usize,
    pub pp: &'a mut dyn Communicator,
    pub tp: &'a mut Tp<'g>,
}

impl<M: ModelChunk> Stage<'_, '_, M> {
    fn vs(&self, chunk: usize) -> usize {
        chunk * self.partition.p + self.rank
    }
    fn stages(&self) -> usize {
        self.partition.p * self.partition.v
    }

    /// A receive, timed as p2p wait (it includes the bubble) and traced.
    fn recv(
        &mut self,
        timers: &mut Timers,
        (shape, dtype): ([usize; 2], DType),
        src: usize,
        tag: u64,
        label: impl FnOnce() -> String,
    ) -> Result<megatron_tensor::Tensor, CommError> {
        let t0 = Instant::now();
        let x = p2p::recv(self.pp, &shape, dtype, src, tag)?;
        timers.p2p_wait += t0.elapsed();
        timers.record(label, t0);
        Ok(x)
    }

    /// Runs `ops` (with gradients into `grads`, or forward only when `grads` is `None`, in
    /// which case every op must be a forward).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        params: &Params,
        grads: Option<&mut Grads>,
        ops: &[Op],
        batches: &[M::Batch<'_>],
        ctxs: &[StepContext],
        grad_scale: f32,
        timers: &mut Timers,
    ) -> Result<PipelineRun, CommError> {
        self.run_overlapped(params, grads, ops, batches, ctxs, grad_scale, timers, None)
    }

    /// [`Stage::run`] that reports, during each chunk's last backward, which gradients are
    /// final (`--overlap-grad-reduce`); `chunk_params[c]` are chunk c's parameter indices.
    #[allow(clippy::too_many_arguments)]
    pub fn run_overlapped(
        &mut self,
        params: &Params,
        mut grads: Option<&mut Grads>,
        ops: &[Op],
        batches: &[M::Batch<'_>],
        ctxs: &[StepContext],
        grad_scale: f32,
        timers: &mut Timers,
        mut overlap: Option<(&mut OverlapGradReduce, &[Range<usize>])>,
    ) -> Result<PipelineRun, CommError> {
        // Index in `ops` of each chunk's last backward.
        let mut last_backward = vec![usize::MAX; self.chunks.len()];
        for (i, op) in ops.iter().enumerate() {
            if let Op::Backward { chunk, .. } = op {
                last_backward[*chunk] = i;
            }
        }
        let p = self.partition.p;
        let stages = self.stages();
        let mut states: HashMap<(usize, usize), M::State> = HashMap::new();
        let mut out = PipelineRun {
            chunk_bytes: vec![0; self.chunks.len()],
            ..Default::default()
        };
        let mut losses: Vec<Option<(f32, f32)>> = vec![None; batches.len()];
        let mut live_bytes = 0usize;
        let started = Instant::now();
        for (i, &op) in ops.iter().enumerate() {
            match op {
                Op::Forward { chunk, mb } => {
                    let vs = self.vs(chunk);
                    let input = if self.partition.is_first(self.rank, chunk) {
                        None
                    } else {
                        let shape = self.chunks[chunk].input_shape(&batches[mb], self.tp);
                        let dtype = self.chunks[chunk].activation_dtype();
                        Some(self.recv(
                            timers,
                            (shape, dtype),
                            (vs - 1) % p,
                            p2p::tag(mb, vs, stages, false),
                            || format!("recv fwd mb{mb}"),
                        )?)
                    };
                    let t0 = Instant::now();
                    let (y, state) = self.chunks[chunk].forward_step(
                        params,
                        grads.as_deref_mut(),
                        self.tp,
                        input,
                        &batches[mb],
                        grad_scale,
                        &ctxs[mb],
                    )?;
                    timers.forward += t0.elapsed();
                    timers.record(|| format!("F{mb}.{chunk}"), t0);
                    if let Some(l) = state.loss() {
                        losses[mb] = Some(l);
                    }
                    if let Some(y) = y {
                        p2p::send(
                            self.pp,
                            &y,
                            self.chunks[chunk].activation_dtype(),
                            (vs + 1) % p,
                            p2p::tag(mb, vs + 1, stages, false),
                        )?;
                    }
                    if grads.is_some() {
                        out.chunk_bytes[chunk] = state.activation_bytes();
                        live_bytes += state.activation_bytes();
                        out.peak_activation_bytes = out.peak_activation_bytes.max(live_bytes);
                        states.insert((chunk, mb), state);
                        out.peak_in_flight = out.peak_in_flight.max(states.len());
                    }
                }
                Op::Backward { chunk, mb } => {
                    let vs = self.vs(chunk);
                    let grads = grads.as_deref_mut().expect("a backward needs gradients");
                    let state = states
                        .remove(&(chunk, mb))
                        .expect("the schedule runs a forward before its backward");
                    let bytes = state.activation_bytes();
                    let dy = if self.partition.is_last(self.rank, chunk) {
                        None
                    } else {
                        let shape = self.chunks[chunk].output_shape(&batches[mb], self.tp);
                        Some(self.recv(
                            timers,
                            (shape, DType::F32),
                            (vs + 1) % p,
                            p2p::tag(mb, vs, stages, true),
                            || format!("recv bwd mb{mb}"),
                        )?)
                    };
                    let t0 = Instant::now();
                    let dx = match overlap.as_mut() {
                        Some((ov, chunk_params)) if last_backward[chunk] == i => {
                            let mine = chunk_params[chunk].clone();
                            self.chunks[chunk].backward_step(
                                params,
                                grads,
                                self.tp,
                                state,
                                dy,
                                &batches[mb],
                                &ctxs[mb],
                                &mut |offset| ov.ready(mine.clone(), offset),
                            )?
                        }
                        _ => self.chunks[chunk].backward_step(
                            params,
                            grads,
                            self.tp,
                            state,
                            dy,
                            &batches[mb],
                            &ctxs[mb],
                            &mut |_| {},
                        )?,
                    };
                    timers.backward += t0.elapsed();
                    timers.record(|| format!("B{mb}.{chunk}"), t0);
                    live_bytes -= bytes;
                    if let Some(dx) = dx {
                        p2p::send(
                            self.pp,
                            &dx,
                            DType::F32,
                            (vs + p - 1) % p,
                            p2p::tag(mb, vs - 1, stages, true),
                        )?;
                    }
                }
            }
        }
        timers.pipeline += started.elapsed();
        out.losses = losses.into_iter().flatten().collect();
        Ok(out)
    }
}
