//! Per-stage timers (Megatron's `--timing-log-level`) and an optional event list for a Chrome
//! trace (`--profile-trace`), so the pipeline bubble can be measured and seen.

use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct TraceEvent {
    pub name: String,
    pub start_us: f64,
    pub dur_us: f64,
}

#[derive(Debug)]
pub struct Timers {
    pub forward: Duration,
    pub backward: Duration,
    /// Time spent waiting in receives (includes the pipeline bubble).
    pub p2p_wait: Duration,
    pub optimizer: Duration,
    /// Wall time of the schedules run (forward-backward of whole steps).
    pub pipeline: Duration,
    origin: Instant,
    pub events: Option<Vec<TraceEvent>>,
}

impl Timers {
    pub fn new(origin: Instant, trace: bool) -> Self {
        Timers {
            forward: Duration::ZERO,
            backward: Duration::ZERO,
            p2p_wait: Duration::ZERO,
            optimizer: Duration::ZERO,
            pipeline: Duration::ZERO,
            origin,
            events: trace.then(Vec::new),
        }
    }

    pub fn reset(&mut self) {
        self.forward = Duration::ZERO;
        self.backward = Duration::ZERO;
        self.p2p_wait = Duration::ZERO;
        self.optimizer = Duration::ZERO;
        self.pipeline = Duration::ZERO;
    }

    /// Records an interval that started at `start` under `name`.
    pub fn record(&mut self, name: impl FnOnce() -> String, start: Instant) {
        if let Some(ev) = &mut self.events {
            let s = start.duration_since(self.origin).as_secs_f64() * 1e6;
            ev.push(TraceEvent {
                name: name(),
                start_us: s,
                dur_us: start.elapsed().as_secs_f64() * 1e6,
            });
        }
    }

    /// Fraction of the pipeline wall time this stage spent neither in forward nor backward.
    pub fn bubble_fraction(&self) -> f64 {
        let busy = (self.forward + self.backward).as_secs_f64();
        let total = self.pipeline.as_secs_f64();
        if total > 0.0 {
            (1.0 - busy / total).max(0.0)
        } else {
            0.0
        }
    }
}
