//! Which layers each pipeline stage (and each of its virtual chunks) holds.

use std::ops::Range;

/// How the layers are split: `p` stages, `v` chunks per stage; `first`/`last` override the
/// layer counts of the first and last stage (Megatron's `--decoder-first-pipeline-num-layers`
/// / `--decoder-last-pipeline-num-layers`, without interleaving); `encoder` puts an
/// encoder-decoder's encoder layers on the first stages and its decoder's on the rest;
/// `account_for_embedding` / `account_for_loss` count the embedding (the loss) as one layer of
/// the first (last) virtual stage, which then holds one transformer layer fewer (Megatron's
/// `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`, for
/// vocabularies whose embedding or output layer costs as much as a layer).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagePartition {
    pub num_layers: usize,
    pub p: usize,
    pub v: usize,
    pub first: Option<usize>,
    pub last: Option<usize>,
    pub encoder: Option<EncoderStages>,
    pub account_for_embedding: bool,
    pub account_for_loss: bool,
    /// `--pipeline-model-parallel-layout`: the transformer layers of each virtual stage, in
    /// virtual-stage order (stage `chunk * p + rank`); overrides the rules above.
    pub layout: Option<Vec<usize>>,
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
        if let Some(counts) = &self.layout {
            let others = self.encoder.is_some()
                || self.first.is_some()
                || self.last.is_some()
                || self.accounted() > 0;
            if others {
                return Err("--pipeline-model-parallel-layout cannot be combined with --decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split or an encoder/decoder stage split (as in Megatron)".into());
            }
            let held: usize = counts.iter().sum();
            if counts.len() != p * v || held != l {
                return Err(format!(
                    "--pipeline-model-parallel-layout: {} stages holding {held} layers, the model has {p} x {v} virtual stages and {l} layers",
                    counts.len()
                ));
            }
            return Ok(());
        }
        let accounted = self.accounted();
        if accounted > 0 && (self.encoder.is_some() || self.first.is_some() || self.last.is_some())
        {
            return Err("--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split cannot be combined with --decoder-first/last-pipeline-num-layers or an encoder/decoder stage split (as in Megatron)".into());
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
        if accounted > 0 {
            let slots = l + accounted;
            if !slots.is_multiple_of(p * v) {
                return Err(format!(
                    "--num-layers ({l}) plus the {accounted} accounted for by --account-for-embedding/loss-in-pipeline-split must be divisible by --pipeline-model-parallel-size ({p}){}",
                    if v > 1 { format!(" x virtual stages ({v})") } else { String::new() }
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
        if let Some(counts) = &self.layout {
            let vs = chunk * p + rank;
            let start: usize = counts[..vs].iter().sum();
            return start..start + counts[vs];
        }
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
        // Virtual stage vs holds slots [vs * per, (vs + 1) * per) of the embedding (where
        // accounted), the layers and the loss (where accounted).
        let e = usize::from(self.account_for_embedding);
        let per = (l + self.accounted()) / (p * self.v);
        let vs = chunk * p + rank;
        let start = (vs * per).saturating_sub(e).min(l);
        let end = ((vs + 1) * per).saturating_sub(e).min(l);
        start..end
    }

    /// Which layers each stage holds, for the start-up log: `stage 0: embedding + layers 0-1 |
    /// stage 1: layers 2-3 + loss`, each virtual chunk in brackets under interleaving.
    pub fn describe(&self) -> String {
        let chunk = |rank: usize, c: usize| {
            let r = self.layers(rank, c);
            let mut parts = Vec::new();
            if self.is_first(rank, c) {
                parts.push("embedding".to_string());
            }
            match r.len() {
                0 => {}
                1 => parts.push(format!("layer {}", r.start)),
                _ => parts.push(format!("layers {}-{}", r.start, r.end - 1)),
            }
            if self.is_last(rank, c) {
                parts.push("loss".to_string());
            }
            parts.join(" + ")
        };
        (0..self.p)
            .map(|rank| {
                let chunks: Vec<String> = (0..self.v).map(|c| chunk(rank, c)).collect();
                if self.v == 1 {
                    format!("stage {rank}: {}", chunks[0])
                } else {
                    format!("stage {rank}: [{}]", chunks.join("] ["))
                }
            })
            .collect::<Vec<_>>()
            .join(" | ")
    }

    /// Pipeline slots the embedding and the loss take (0 to 2).
    fn accounted(&self) -> usize {
        usize::from(self.account_for_embedding) + usize::from(self.account_for_loss)
    }

    /// Whether chunk `chunk` of stage `rank` is the first (embedding) or last (loss) virtual stage.
    pub fn is_first(&self, rank: usize, chunk: usize) -> bool {
        rank == 0 && chunk == 0
    }
    pub fn is_last(&self, rank: usize, chunk: usize) -> bool {
        rank == self.p - 1 && chunk == self.v - 1
    }
}
