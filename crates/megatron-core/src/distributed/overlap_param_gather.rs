//! `--overlap-param-gather`: with the distributed optimizer the updated parameter shards are
//! all-gathered over DP while the next step's forward already runs. A communication thread
//! gathers the buckets in the order forward reads them (lowest flat offsets first: the
//! embedding and first layers live in the last bucket) and raises a watermark; `Params::get`
//! waits until the watermark covers the parameter it returns (Megatron's forward pre-hooks).

use super::{Bucket, GradBuffer};
use crate::params::Params;
use megatron_comm::{CommError, Communicator};
use std::sync::{Condvar, Mutex};

/// Parameters below `ready` (a flat offset) hold this step's values.
#[derive(Debug, Default)]
pub struct ParamGate {
    ready: Mutex<usize>,
    cv: Condvar,
}

impl ParamGate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks until every element below `end` has been gathered.
    pub fn wait_for(&self, end: usize) {
        let mut r = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        while *r < end {
            r = self.cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn advance(&self, to: usize) {
        let mut r = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        *r = (*r).max(to);
        self.cv.notify_all();
    }
}

/// The parameter buffers as the communication thread sees them.
pub struct ParamsPtr {
    data: *mut f32,
    data_len: usize,
    half: *mut u16,
    half_len: usize,
}

// SAFETY: the thread writes only buckets above the gate's watermark, which the compute thread
// does not read until the watermark passes them (`Params::get` waits; it slices through raw
// pointers, never a reference to the whole buffer), and the buffers outlive the scoped thread.
unsafe impl Send for ParamsPtr {}

impl ParamsPtr {
    pub fn new(params: &mut Params) -> Self {
        let half = params.half.bits_mut();
        ParamsPtr {
            data: params.data.as_mut_ptr(),
            data_len: params.data.len(),
            half: half.as_mut_ptr(),
            half_len: half.len(),
        }
    }
}

/// Opens the gate whatever happens: a waiting forward must not hang on a failed gather (the
/// error is reported when the thread is joined and ends the run).
struct OpenOnDrop<'a>(&'a ParamGate);

impl Drop for OpenOnDrop<'_> {
    fn drop(&mut self) {
        self.0.advance(usize::MAX);
    }
}

/// The communication thread's part: all-gathers every bucket, lowest offsets first, raising
/// the gate after each. The 16-bit parameters are gathered when there are any (the fp32 main
/// parameters then live in the optimizer's shards), else the f32 ones.
pub fn gather_params(
    buffer: &GradBuffer,
    params: ParamsPtr,
    dp: &mut dyn Communicator,
    gate: &ParamGate,
) -> Result<(), CommError> {
    let _open = OpenOnDrop(gate);
    let mut scratch = Vec::new();
    for b in buffer.buckets.iter().rev() {
        // SAFETY: above the watermark, owned by this thread until `advance` (see above).
        unsafe {
            if params.half_len > 0 {
                let data = bucket_of(params.half, params.half_len, b);
                buffer.all_gather_bucket(b, data, dp, &mut scratch)?;
            } else {
                let data = bucket_of(params.data, params.data_len, b);
                buffer.all_gather_bucket(b, data, dp, &mut scratch)?;
            }
        }
        gate.advance(b.range.end);
    }
    Ok(())
}

/// Bucket `b`'s elements of a buffer of `len` elements at `ptr`.
///
/// # Safety
/// No other live reference may cover the bucket while the slice is used.
unsafe fn bucket_of<'a, T>(ptr: *mut T, len: usize, b: &Bucket) -> &'a mut [T] {
    assert!(b.range.end <= len);
    std::slice::from_raw_parts_mut(ptr.add(b.range.start), b.range.len())
}
