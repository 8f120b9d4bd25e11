//! Which layers each pipeline stage (and each of its virtual chunks) holds.

use std::ops::Range;

/// How the decoder is split: `p` stages, `v` chunks per stage; `first`/`last` override the
/// layer counts of the first and last stage (Megatron's `--decoder-first-pipeline-num-layers`
/// / `--decoder-last-pipeline-num-layers`, without interleaving).
#[derive(Clone, Copy, Debug)]
pub struct StagePartition {
    pub num_layers: usize,
    pub p: usize,
    pub v: usize,
    pub first: Option<usize>,
    pub last: Option<usize>,
}

impl StagePartition {
    /// Checks the split, naming the flags at fault.
    pub fn check(&self) -> Result<(), String> {
        let (l, p, v) = (self.num_layers, self.p, self.v);
        if p == 0 || v == 0 {
            return Err("--pipeline-model-parallel-size must be positive".into());
        }
        if v > 1 && (self.first.is_some() || self.last.is_some()) {
            return Err("--decoder-first/last-pipeline-num-layers cannot be combined with --num-layers-per-virtual-pipeline-stage".into());
        }
        let fixed = self.first.unwrap_or(0) + self.last.unwrap_or(0);
        let ends = self.first.is_some() as usize + self.last.is_some() as usize;
        if ends > 0 {
            if p < 2 || fixed > l {
                return Err(format!(
                    "--decoder-first/last-pipeline-num-layers ({fixed} layers) do not fit --num-layers {l} over {p} stages"
                ));
            }
            let middle = p - ends;
            let rest = l - fixed;
            if (middle == 0 && rest != 0) || (middle > 0 && !rest.is_multiple_of(middle)) {
                return Err(format!(
                    "the {rest} layers left by --decoder-first/last-pipeline-num-layers do not divide over the {middle} middle stages"
                ));
            }
            return Ok(());
        }
        if !l.is_multiple_of(p * v) {
            return Err(if v > 1 {
                format!("--num-layers ({l}) must be divisible by --pipeline-model-parallel-size ({p}) x virtual stages ({v})")
            } else {
                format!(
                    "--num-layers ({l}) must be divisible by --pipeline-model-parallel-size ({p})"
                )
            });
        }
        Ok(())
    }

    /// Layers of stage `rank`'s chunk `chunk` (global numbers); virtual stage `chunk * p + rank`.
    pub fn layers(&self, rank: usize, chunk: usize) -> Range<usize> {
        let (l, p) = (self.num_layers, self.p);
        if self.first.is_some() || self.last.is_some() {
            let first = self.first.unwrap_or(0);
            let last = self.last.unwrap_or(0);
            let ends = self.first.is_some() as usize + self.last.is_some() as usize;
            let middle = p - ends;
            let per = (l - first - last).checked_div(middle).unwrap_or(0);
            let count = |r: usize| -> usize {
                if r == 0 && self.first.is_some() {
                    first
                } else if r == p - 1 && self.last.is_some() {
                    last
                } else {
                    per
                }
            };
            let start: usize = (0..rank).map(count).sum();
            return start..start + count(rank);
        }
        let per = l / (p * self.v);
        let vs = chunk * p + rank;
        vs * per..(vs + 1) * per
    }

    /// Whether chunk `chunk` of stage `rank` is the first (embedding) or last (loss) virtual stage.
    pub fn is_first(&self, rank: usize, chunk: usize) -> bool {
        rank == 0 && chunk == 0
    }
    pub fn is_last(&self, rank: usize, chunk: usize) -> bool {
        rank == self.p - 1 && chunk == self.v - 1
    }
}
