//! Which layers each pipeline stage (and each of its virtual chunks) holds.

use std::ops::Range;

/// How the layers are split: `p` stages, `v` chunks per stage; `first`/`last` override the
/// layer counts of the first and last stage (Megatron's `--decoder-first-pipeline-num-layers`
/// / `--decoder-last-pipeline-num-layers`, without interleaving); `encoder` puts an
/// encoder-decoder's encoder layers on the first stages and its decoder's on the rest.
#[derive(Clone, Copy, Debug)]
pub struct StagePartition {
    pub num_layers: usize,
    pub p: usize,
    pub v: usize,
    pub first: Option<usize>,
    pub last: Option<usize>,
    pub encoder: Option<EncoderStages>,
}

/// Megatron's encoder/decoder stage split (`--pipeline-model-parallel-split-rank`): the first
/// `layers` of the model (its encoder) evenly over stages `0..stages`, the rest (its decoder)
/// evenly over the others, so that no stage holds layers of both stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderStages {
    pub layers: usize,
    pub stages: usize,
}

impl StagePartition {
    /// Checks the split, naming the flags at fault.
    pub fn check(&self) -> Result<(), String> {
        let (l, p, v) = (self.num_layers, self.p, self.v);
        if p == 0 || v == 0 {
            return Err("--pipeline-model-parallel-size must be positive".into());
        }
        if let Some(e) = self.encoder {
            if v > 1 || self.first.is_some() || self.last.is_some() {
                return Err("the encoder/decoder stage split cannot be combined with virtual stages or --decoder-first/last-pipeline-num-layers".into());
            }
            let (el, dl, ds) = (
                e.layers,
                l.saturating_sub(e.layers),
                p.saturating_sub(e.stages),
            );
            if e.stages == 0 || ds == 0 {
                return Err(format!(
                    "--pipeline-model-parallel-split-rank ({}) must leave encoder and decoder stages among --pipeline-model-parallel-size ({p})",
                    e.stages
                ));
            }
            if !el.is_multiple_of(e.stages) || !dl.is_multiple_of(ds) {
                return Err(format!(
                    "the encoder's {el} layers must divide over its {} stages and the decoder's {dl} over its {ds} (--encoder-num-layers, --decoder-num-layers, --pipeline-model-parallel-split-rank)",
                    e.stages
                ));
            }
            return Ok(());
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
        if let Some(e) = self.encoder {
            if rank < e.stages {
                let per = e.layers / e.stages;
                return rank * per..(rank + 1) * per;
            }
            let per = (l - e.layers) / (p - e.stages);
            let start = e.layers + (rank - e.stages) * per;
            return start..start + per;
        }
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
