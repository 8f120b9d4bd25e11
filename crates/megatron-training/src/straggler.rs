//! `--log-straggler`: every rank's compute time per iteration, gathered each log interval
//! ("a single slow GPU slows every step": with synchronous collectives every rank's wall time
//! is the slowest one's, so the comparison is of each rank's own work: its forward/backward
//! time less the time it waited for pipeline neighbours).
//!
//! A rank is compared with the ranks that do the same work: those of its pipeline stage (its
//! data- and context-parallel replicas and tensor-parallel peers). Stages do not do the same
//! work (the first holds the embedding, the last the output layer and the loss, and layers
//! need not divide evenly), so a comparison across stages would name the last stage of every
//! pipeline. A rank slower than the median of its stage's other ranks by the margin for
//! `patience` intervals in a row is named; a stage of one rank has no one to compare with.
//! Inside a tensor-parallel group a slow rank's peers wait for it in the layer collectives, so
//! the group shows slow together; the slow group is still named against its stage's other
//! replicas.

use crate::setup::RankComms;
use megatron_comm::{CommError, Communicator};
use serde::Serialize;

/// One interval across ranks (milliseconds of compute per iteration).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RankStepTimes {
    pub min_ms: f64,
    pub min_rank: usize,
    pub median_ms: f64,
    pub max_ms: f64,
    pub max_rank: usize,
    /// The rank furthest behind the other ranks of its pipeline stage (the most milliseconds
    /// over their median: what it costs every step), and its time over that median (1.1: 10 %
    /// slower); absent when no stage has two ranks. Chosen by time, not ratio, so a rank whose
    /// sub-millisecond compute was descheduled for a moment does not outrank one that is
    /// really behind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slowest_against_stage: Option<(usize, f64)>,
    /// The rank persistently slower than its stage by the margin: (rank, intervals in a row).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub straggler: Option<(usize, usize)>,
}

impl RankStepTimes {
    pub fn line(&self) -> String {
        let mut s = format!(
            " | compute per iteration across ranks (ms): min {:.1} (rank {}) median {:.1} max {:.1} (rank {})",
            self.min_ms, self.min_rank, self.median_ms, self.max_ms, self.max_rank
        );
        if let (Some((rank, n)), Some((_, ratio))) = (self.straggler, self.slowest_against_stage) {
            s += &format!(
                " | straggler: rank {rank} ({:+.0} % over the median of its pipeline stage for {n} intervals)",
                100.0 * (ratio - 1.0)
            );
        }
        s
    }
}

/// One rank's compute time in an interval, and the pipeline stage it works for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankTime {
    pub rank: usize,
    pub stage: usize,
    pub ms: f64,
}

/// The median of a sorted, non-empty slice.
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
    }
}

/// Tracks which rank has been slow, and for how long.
#[derive(Debug)]
pub struct StragglerWatch {
    margin: f64,
    patience: usize,
    streak: Option<(usize, usize)>,
}

fn gather(comm: &mut dyn Communicator, mine: &[f32]) -> Result<Vec<f32>, CommError> {
    let mut out = vec![0.0f32; mine.len() * comm.size()];
    comm.all_gather(mine, &mut out)?;
    Ok(out)
}

/// Every rank's [`RankTime`], on every rank: gathered over the tensor-, then the
/// data-(and context-), then the pipeline-parallel group, which together cover the world.
pub(crate) fn gather_world(comms: &mut RankComms, ms: f64) -> Result<Vec<RankTime>, CommError> {
    let mine = [comms.world_rank as f32, comms.pp.rank() as f32, ms as f32];
    let mut v = gather(&mut *comms.tp.comm, &mine)?;
    if let Some(dp) = comms.dp.as_deref_mut() {
        v = gather(dp, &v)?;
    }
    v = gather(&mut *comms.pp, &v)?;
    Ok(v.chunks_exact(3)
        .map(|p| RankTime {
            rank: p[0] as usize,
            stage: p[1] as usize,
            ms: p[2] as f64,
        })
        .collect())
}

impl StragglerWatch {
    pub fn new(margin: f64, patience: usize) -> Self {
        StragglerWatch {
            margin,
            patience,
            streak: None,
        }
    }

    /// This interval's times (every rank's), and the straggler if one has been slow long
    /// enough.
    pub fn observe(&mut self, times: &[RankTime]) -> RankStepTimes {
        let mut all: Vec<(usize, f64)> = times.iter().map(|t| (t.rank, t.ms)).collect();
        all.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let ms: Vec<f64> = all.iter().map(|a| a.1).collect();
        let (min, max) = (all[0], all[all.len() - 1]);
        // Each rank against the median of the other ranks of its stage; the one furthest
        // behind in milliseconds (ties to the lower rank), with its ratio.
        let slowest = times
            .iter()
            .filter_map(|t| {
                let mut others: Vec<f64> = times
                    .iter()
                    .filter(|o| o.stage == t.stage && o.rank != t.rank)
                    .map(|o| o.ms)
                    .collect();
                if others.is_empty() {
                    return None;
                }
                others.sort_by(f64::total_cmp);
                let m = median(&others);
                Some((t.rank, t.ms - m, t.ms / m.max(f64::MIN_POSITIVE)))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
            .map(|(rank, _, ratio)| (rank, ratio));
        let slow = slowest.filter(|&(_, ratio)| ratio > 1.0 + self.margin);
        self.streak = match (slow, self.streak) {
            (None, _) => None,
            (Some((r, _)), Some((s, k))) if r == s => Some((r, k + 1)),
            (Some((r, _)), _) => Some((r, 1)),
        };
        RankStepTimes {
            min_ms: min.1,
            min_rank: min.0,
            median_ms: median(&ms),
            max_ms: max.1,
            max_rank: max.0,
            slowest_against_stage: slowest,
            straggler: self.streak.filter(|&(_, k)| k >= self.patience),
        }
    }
}
