//! `--log-straggler`: every rank's compute time per iteration, gathered each log interval
//! ("a single slow GPU slows every step": with synchronous collectives every rank's wall time
//! is the slowest one's, so the comparison is of each rank's own work: its forward/backward
//! time less the time it waited for pipeline neighbours). A rank slower than the median by the
//! margin for `patience` intervals in a row is named. Inside a tensor-parallel group a slow
//! rank's peers wait for it in the layer collectives, so the group shows slow together; the
//! slow group is still named across data and pipeline parallelism.

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
    /// The rank persistently slower than the median: (rank, intervals in a row).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub straggler: Option<(usize, usize)>,
}

impl RankStepTimes {
    pub fn line(&self) -> String {
        let mut s = format!(
            " | compute per iteration across ranks (ms): min {:.1} (rank {}) median {:.1} max {:.1} (rank {})",
            self.min_ms, self.min_rank, self.median_ms, self.max_ms, self.max_rank
        );
        if let Some((rank, n)) = self.straggler {
            s += &format!(
                " | straggler: rank {rank} ({:+.0} % over the median for {n} intervals)",
                100.0 * (self.max_ms / self.median_ms - 1.0)
            );
        }
        s
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

/// `(world rank, value)` of every rank, on every rank: gathered over the tensor-, then the
/// data-(and context-), then the pipeline-parallel group, which together cover the world.
pub(crate) fn gather_world(
    comms: &mut RankComms,
    value: f64,
) -> Result<Vec<(usize, f64)>, CommError> {
    let mine = [comms.world_rank as f32, value as f32];
    let mut v = gather(&mut *comms.tp.comm, &mine)?;
    if let Some(dp) = comms.dp.as_deref_mut() {
        v = gather(dp, &v)?;
    }
    v = gather(&mut *comms.pp, &v)?;
    Ok(v.chunks_exact(2)
        .map(|p| (p[0] as usize, p[1] as f64))
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

    /// This interval's times (`(rank, ms)` of every rank), and the straggler if one has been
    /// slow long enough.
    pub fn observe(&mut self, mut times: Vec<(usize, f64)>) -> RankStepTimes {
        times.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let n = times.len();
        let median = if n % 2 == 1 {
            times[n / 2].1
        } else {
            0.5 * (times[n / 2 - 1].1 + times[n / 2].1)
        };
        let (min, max) = (times[0], times[n - 1]);
        let slow = n > 1 && max.1 > median * (1.0 + self.margin);
        self.streak = match (slow, self.streak) {
            (false, _) => None,
            (true, Some((r, k))) if r == max.0 => Some((r, k + 1)),
            (true, _) => Some((max.0, 1)),
        };
        RankStepTimes {
            min_ms: min.1,
            min_rank: min.0,
            median_ms: median,
            max_ms: max.1,
            max_rank: max.0,
            straggler: self.streak.filter(|&(_, k)| k >= self.patience),
        }
    }
}
