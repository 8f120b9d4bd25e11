//! The global batch size of each iteration: constant, ramped up over the first samples
//! (`--rampup-batch-size START INCREMENT SAMPLES`, as megatron-core's
//! `RampupBatchsizeNumMicroBatchesCalculator` computed it until it was replaced), or stepped by
//! the samples consumed (`--step-batch-size-schedule`, megatron-core's
//! `StepBatchsizeNumMicroBatchesCalculator`), always from the consumed-samples count, so a run
//! resumed mid-ramp continues with the batch sizes of the uninterrupted run.

use crate::TrainError;

/// `--rampup-batch-size`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rampup {
    pub start: u64,
    pub increment: u64,
    pub samples: u64,
}

/// The global batch size as a function of the samples consumed so far.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchSizeSchedule {
    /// The final (and, without ramp-up, only) global batch size.
    pub global: u64,
    /// `--micro-batch-size` x data-parallel size: every global batch size is a multiple.
    pub micro_times_dp: u64,
    pub rampup: Option<Rampup>,
    /// `--step-batch-size-schedule`: (from this many samples consumed, this global batch size),
    /// by increasing threshold, the first at 0; empty without one.
    pub steps: Vec<(u64, u64)>,
}

/// Parses `--step-batch-size-schedule` as megatron-core does: `THRESHOLD:BATCH_SIZE` entries
/// separated by spaces or commas, numbers with an optional K/M/B/T suffix (read as a float,
/// truncated), thresholds in tokens turned into samples by `// seq_length`, sorted; the first
/// threshold must be 0 and they must increase strictly, and every batch size be positive.
pub fn parse_step_schedule(text: &str, seq_length: u64) -> Result<Vec<(u64, u64)>, TrainError> {
    let bad = |m: String| TrainError::Args(format!("--step-batch-size-schedule: {m}"));
    let number = |v: &str| -> Result<u64, TrainError> {
        let v = v.trim().to_uppercase();
        let (digits, scale) = match v.chars().last() {
            Some('T') => (&v[..v.len() - 1], 1e12),
            Some('B') => (&v[..v.len() - 1], 1e9),
            Some('M') => (&v[..v.len() - 1], 1e6),
            Some('K') => (&v[..v.len() - 1], 1e3),
            _ => (v.as_str(), 1.0),
        };
        let x: f64 = digits
            .parse()
            .map_err(|_| bad(format!("'{v}' is not a number (with an optional K/M/B/T)")))?;
        let x = x * scale;
        if !(x.is_finite() && x >= 0.0) {
            return Err(bad(format!("'{v}' is not a non-negative number")));
        }
        Ok(x as u64)
    };
    let mut steps = Vec::new();
    for entry in text.replace(',', " ").split_whitespace() {
        let (t, b) = entry.split_once(':').ok_or_else(|| {
            bad(format!(
                "entry '{entry}' is not THRESHOLD:BATCH_SIZE (e.g. \"0:768 250B:1536\")"
            ))
        })?;
        steps.push((number(t)? / seq_length.max(1), number(b)?));
    }
    steps.sort_by_key(|s| s.0);
    match steps.first() {
        None => return Err(bad("no entries".into())),
        Some(&(t, _)) if t != 0 => {
            return Err(bad(format!(
                "the first threshold must be 0 (got {t} samples)"
            )))
        }
        _ => {}
    }
    if let Some(w) = steps.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!(
            "thresholds must increase strictly; two are {} samples",
            w[0].0
        )));
    }
    if let Some(&(t, _)) = steps.iter().find(|s| s.1 == 0) {
        return Err(bad(format!("the batch size from {t} samples is 0")));
    }
    Ok(steps)
}

impl BatchSizeSchedule {
    /// Checks the ramp-up against the final batch size and the layout: every batch size of the
    /// ramp must split into whole micro-batches on every data-parallel rank (megatron-core
    /// asserts this at the step that reaches a bad size; here it is refused before any work).
    pub fn new(
        global: u64,
        micro_times_dp: u64,
        rampup: Option<Rampup>,
    ) -> Result<Self, TrainError> {
        let bad = |m: String| Err(TrainError::Args(m));
        if let Some(r) = rampup {
            if r.start == 0 || r.increment == 0 {
                return bad(format!(
                    "--rampup-batch-size: the start batch size ({}) and the increment ({}) must be positive",
                    r.start, r.increment
                ));
            }
            if r.start > global || !(global - r.start).is_multiple_of(r.increment) {
                return bad(format!(
                    "--rampup-batch-size: --global-batch-size ({global}) must be the start batch size ({}) plus a whole number of increments ({})",
                    r.start, r.increment
                ));
            }
            let mut b = r.start;
            while b < global {
                if !b.is_multiple_of(micro_times_dp) {
                    return bad(format!(
                        "--rampup-batch-size: the ramp's global batch size {b} is not a multiple of --micro-batch-size times the data-parallel size ({micro_times_dp})"
                    ));
                }
                b += r.increment;
            }
        }
        Ok(BatchSizeSchedule {
            global,
            micro_times_dp,
            rampup,
            steps: Vec::new(),
        })
    }

    /// `--step-batch-size-schedule`'s parsed `steps`. The final batch size is the last entry's.
    /// A batch size need not split into whole micro-batches until a run reaches it (a schedule
    /// written for another data-parallel size): [`Self::check`] refuses it then.
    pub fn stepped(steps: Vec<(u64, u64)>, micro_times_dp: u64) -> Self {
        BatchSizeSchedule {
            global: steps.last().map_or(0, |s| s.1),
            micro_times_dp,
            rampup: None,
            steps,
        }
    }

    /// Refuses the batch size of the iteration after `consumed` where it does not split into
    /// whole micro-batches on every data-parallel rank (megatron-core's consistency check).
    pub fn check(&self, consumed: u64) -> Result<(), TrainError> {
        let b = self.global_batch_size(consumed);
        if b.is_multiple_of(self.micro_times_dp) {
            return Ok(());
        }
        Err(TrainError::Args(format!(
            "the global batch size {b} (after {consumed} samples) is not a multiple of --micro-batch-size times the data-parallel size ({}); see --step-batch-size-schedule",
            self.micro_times_dp
        )))
    }

    /// Every global batch size an iteration may have, smallest first.
    pub fn batch_sizes(&self) -> Vec<u64> {
        if !self.steps.is_empty() {
            let mut v: Vec<u64> = self.steps.iter().map(|s| s.1).collect();
            v.sort_unstable();
            v.dedup();
            return v;
        }
        match self.rampup {
            Some(r) => (r.start..=self.global)
                .step_by(r.increment as usize)
                .collect(),
            None => vec![self.global],
        }
    }

    /// The global batch size of the iteration that starts after `consumed` samples: the start
    /// size plus one increment per `samples / increments` consumed, the final size once more
    /// than the ramp's samples are consumed.
    pub fn global_batch_size(&self, consumed: u64) -> u64 {
        if let Some(&(_, b)) = self.steps.iter().rev().find(|s| s.0 <= consumed) {
            return b;
        }
        match self.rampup {
            Some(r) if r.start < self.global && consumed <= r.samples => {
                let increments = (self.global - r.start) / r.increment;
                let per_increment = r.samples as f64 / increments as f64;
                let steps = (consumed as f64 / per_increment) as u64;
                (r.start + steps * r.increment).min(self.global)
            }
            _ => self.global,
        }
    }

    /// Micro-batches per data-parallel rank in the iteration that starts after `consumed`.
    pub fn num_microbatches(&self, consumed: u64) -> usize {
        (self.global_batch_size(consumed) / self.micro_times_dp) as usize
    }

    /// Iterations of `--train-samples` training (Megatron's `update_train_iters`): the ramp's
    /// iterations while no more than its samples (and the run's) are consumed, then whole final
    /// batches; a partial last batch is not trained.
    pub fn train_iters(&self, train_samples: u64) -> u64 {
        let (mut iterations, mut consumed) = (0, 0);
        if !self.steps.is_empty() {
            // Megatron's loop under a step schedule: iterations until the samples are reached
            // (the last batch may pass them).
            while consumed < train_samples {
                consumed += self.global_batch_size(consumed);
                iterations += 1;
            }
            return iterations;
        }
        if let Some(r) = self.rampup {
            while consumed <= r.samples && consumed <= train_samples {
                consumed += self.global_batch_size(consumed);
                iterations += 1;
            }
        }
        if train_samples > consumed {
            iterations += (train_samples - consumed) / self.global;
        }
        iterations
    }

    /// The samples consumed after `iterations` iterations from the start.
    pub fn consumed_after(&self, iterations: u64) -> u64 {
        (0..iterations).fold(0, |c, _| c + self.global_batch_size(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(start: u64, increment: u64, samples: u64) -> Option<Rampup> {
        Some(Rampup {
            start,
            increment,
            samples,
        })
    }

    #[test]
    fn gpt3_ramp_grows_by_one_increment_per_share_of_the_ramp_samples() {
        // GPT-3's 16 16 5859375 towards 1536: 95 increments of 61,677.6 samples each.
        let s = BatchSizeSchedule::new(1536, 16, ramp(16, 16, 5_859_375)).unwrap();
        assert_eq!(s.global_batch_size(0), 16);
        assert_eq!(s.global_batch_size(61_677), 16);
        assert_eq!(s.global_batch_size(61_678), 32);
        assert_eq!(s.global_batch_size(5_859_375), 1536);
        assert_eq!(s.global_batch_size(5_859_376), 1536);
        assert_eq!(s.num_microbatches(61_678), 2);
    }

    #[test]
    fn train_iters_count_the_ramp_then_whole_final_batches() {
        // Start 2, +2 up to 8 over 12 samples (4 samples per increment): at 0, 2, 4 and 8
        // samples consumed the batch is 2, 2, 4 and 6; past 12 (at 14) it is 8. 30 samples: 4
        // ramp iterations reach 14, then (30 - 14) / 8 = 2 whole final batches.
        let s = BatchSizeSchedule::new(8, 2, ramp(2, 2, 12)).unwrap();
        let sizes: Vec<u64> = (0..6)
            .scan(0, |c, _| {
                let b = s.global_batch_size(*c);
                *c += b;
                Some(b)
            })
            .collect();
        assert_eq!(sizes, [2, 2, 4, 6, 8, 8]);
        assert_eq!(s.train_iters(30), 6);
        assert_eq!(s.consumed_after(6), 30);
        // Without ramp-up: whole batches, the partial one dropped (Megatron's floor).
        let c = BatchSizeSchedule::new(8, 2, None).unwrap();
        assert_eq!(c.train_iters(30), 3);
    }

    #[test]
    fn ramps_that_do_not_split_into_micro_batches_are_refused() {
        let e = BatchSizeSchedule::new(12, 4, ramp(2, 2, 100)).unwrap_err();
        assert!(e.to_string().contains("global batch size 2"), "{e}");
        let e = BatchSizeSchedule::new(9, 1, ramp(2, 2, 100)).unwrap_err();
        assert!(e.to_string().contains("whole number of increments"), "{e}");
        let e = BatchSizeSchedule::new(8, 1, ramp(0, 2, 100)).unwrap_err();
        assert!(e.to_string().contains("must be positive"), "{e}");
    }
}
