//! `--overlap-grad-reduce`: while the last micro-batch's backward still runs, a communication
//! thread reduces each gradient bucket over the data-parallel group as soon as every gradient
//! in it is final. Backward reports progress as a flat offset (gradients at and above it are
//! final, since backward runs in reverse registration order); the bucket is handed to the thread
//! and the compute thread never touches those gradients again in this step.

use super::GradBuffer;
use crate::params::{Grads, Params};
use megatron_comm::{CommError, Communicator};
use std::ops::Range;
use std::sync::mpsc::{Receiver, Sender};

/// Tracks which parameters' gradients are final and launches complete buckets.
pub struct OverlapGradReduce<'a> {
    buffer: &'a GradBuffer,
    params: &'a Params,
    done: Vec<bool>,
    launched: Vec<bool>,
    /// Buckets left for after the step (they need another reduction first, e.g. the tied
    /// embedding's all-reduce over the embedding group).
    deferred: Vec<bool>,
    tx: Sender<usize>,
}

impl<'a> OverlapGradReduce<'a> {
    pub fn new(
        buffer: &'a GradBuffer,
        params: &'a Params,
        defer: impl Fn(usize) -> bool,
        tx: Sender<usize>,
    ) -> Self {
        let n = buffer.buckets.len();
        OverlapGradReduce {
            buffer,
            params,
            done: vec![false; params.metas.len()],
            launched: vec![false; n],
            deferred: (0..n)
                .map(|b| buffer.buckets[b].params.clone().any(&defer))
                .collect(),
            tx,
        }
    }

    /// Gradients of parameters `chunk` (indices) at flat offsets `>= offset` are final.
    pub fn ready(&mut self, chunk: Range<usize>, offset: usize) {
        for p in chunk {
            if self.params.metas[p].offset >= offset {
                self.done[p] = true;
            }
        }
        for (i, b) in self.buffer.buckets.iter().enumerate() {
            if !self.launched[i] && !self.deferred[i] && b.params.clone().all(|p| self.done[p]) {
                self.launched[i] = true;
                // The thread may have stopped on an error; it reports it when joined.
                let _ = self.tx.send(i);
            }
        }
    }

    /// Buckets not reduced by the thread (deferred or never completed), to reduce now.
    pub fn remaining(&self) -> Vec<usize> {
        (0..self.launched.len())
            .filter(|&i| !self.launched[i])
            .collect()
    }
}

/// The gradient buffer as the communication thread sees it.
pub struct GradsPtr {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the thread only touches buckets the compute thread has handed over and no longer
// writes (see `OverlapGradReduce`); the buffer outlives the scoped thread.
unsafe impl Send for GradsPtr {}

impl GradsPtr {
    pub fn new(grads: &mut Grads) -> Self {
        GradsPtr {
            ptr: grads.data.as_mut_ptr(),
            len: grads.data.len(),
        }
    }
}

/// The communication thread: reduces the buckets it receives until the channel closes.
pub fn reduce_buckets(
    rx: Receiver<usize>,
    buffer: &GradBuffer,
    grads: GradsPtr,
    dp: &mut dyn Communicator,
) -> Result<(), CommError> {
    let mut scratch = Vec::new();
    for i in rx {
        let b = &buffer.buckets[i];
        assert!(b.range.end <= grads.len);
        // SAFETY: bucket `i` belongs to this thread from now on (see above).
        let data =
            unsafe { std::slice::from_raw_parts_mut(grads.ptr.add(b.range.start), b.range.len()) };
        buffer.reduce_slice(b, data, dp, &mut scratch)?;
    }
    Ok(())
}
