//! Megatron's `--pipeline-model-parallel-layout` (`PipelineParallelLayerLayout`): the layers of
//! every virtual pipeline stage spelled out, e.g. `Et*3|(tt|)*29,m|L` — `E` the embedding, `t` a
//! transformer layer, `m` a multi-token-prediction layer, `L` the loss, `|` between virtual
//! stages (listed in virtual-stage order, stage `chunk * P + rank`), `X*n` and `(...)*n`
//! repeat, commas are cosmetic. Parsed here into the transformer layers of each virtual stage.

/// One entry of a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    Embedding,
    Decoder,
    Mtp,
    Loss,
}

impl LayerKind {
    fn of(c: char) -> Option<Self> {
        match c {
            'E' => Some(LayerKind::Embedding),
            't' => Some(LayerKind::Decoder),
            'm' => Some(LayerKind::Mtp),
            'L' => Some(LayerKind::Loss),
            _ => None,
        }
    }
}

/// A parsed layout: the entries of each virtual stage, in virtual-stage order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineParallelLayerLayout {
    pub stages: Vec<Vec<LayerKind>>,
}

/// One item of the layout string before unrolling.
enum Item {
    Char(char),
    Group(Vec<(Item, usize)>),
}

impl PipelineParallelLayerLayout {
    /// Parses `s` (Megatron's syntax; parentheses may nest, whitespace is ignored).
    pub fn parse(s: &str) -> Result<Self, String> {
        let chars: Vec<char> = s
            .chars()
            .filter(|c| !c.is_whitespace() && *c != ',')
            .collect();
        let mut pos = 0;
        let items = parse_seq(&chars, &mut pos, s)?;
        if pos != chars.len() {
            return Err(format!("unbalanced ')' in '{s}'"));
        }
        let mut flat = String::new();
        unroll(&items, &mut flat);
        let mut stages = vec![Vec::new()];
        for c in flat.chars() {
            if c == '|' {
                stages.push(Vec::new());
                continue;
            }
            let kind = LayerKind::of(c).ok_or_else(|| {
                format!("'{c}' in '{s}' is not a layer: use E (embedding), t (transformer layer), m (multi-token prediction), L (loss), | between stages")
            })?;
            stages.last_mut().expect("one stage at least").push(kind);
        }
        Ok(PipelineParallelLayerLayout { stages })
    }

    /// The transformer layers of each virtual stage, after checking the layout against `p`
    /// pipeline stages, `num_layers` layers and `mtp_layers` prediction layers: Megatron's
    /// rules (the stages a multiple of `p`, one embedding first, one loss last, every layer
    /// once, prediction layers after the transformer layers) and this engine's (the embedding
    /// in the first virtual stage, prediction layers and the loss in the last, where their
    /// model chunk runs them).
    pub fn decoder_counts(
        &self,
        p: usize,
        num_layers: usize,
        mtp_layers: usize,
    ) -> Result<Vec<usize>, String> {
        let n = self.stages.len();
        if p == 0 || !n.is_multiple_of(p) {
            return Err(format!(
                "its {n} stages are not a multiple of --pipeline-model-parallel-size ({p})"
            ));
        }
        let count = |k: LayerKind| self.stages.iter().flatten().filter(|x| **x == k).count();
        for (k, what) in [(LayerKind::Embedding, "E"), (LayerKind::Loss, "L")] {
            if count(k) != 1 {
                return Err(format!("it must hold exactly one {what}, not {}", count(k)));
            }
        }
        if self.stages[0].first() != Some(&LayerKind::Embedding) {
            return Err("the embedding (E) must open the first stage".into());
        }
        if self.stages[n - 1].last() != Some(&LayerKind::Loss) {
            return Err("the loss (L) must close the last stage".into());
        }
        if count(LayerKind::Decoder) != num_layers {
            return Err(format!(
                "it holds {} transformer layers (t), --num-layers is {num_layers}",
                count(LayerKind::Decoder)
            ));
        }
        if count(LayerKind::Mtp) != mtp_layers {
            return Err(format!(
                "it holds {} multi-token prediction layers (m), --mtp-num-layers is {mtp_layers}",
                count(LayerKind::Mtp)
            ));
        }
        let outside_last = self.stages[..n - 1]
            .iter()
            .flatten()
            .any(|k| *k == LayerKind::Mtp);
        let last = &self.stages[n - 1];
        let first_mtp = last.iter().position(|k| *k == LayerKind::Mtp);
        let decoder_after = first_mtp.is_some_and(|i| last[i..].contains(&LayerKind::Decoder));
        if outside_last || decoder_after {
            return Err(
                "multi-token prediction layers (m) must follow every transformer layer, in the last stage with the loss".into(),
            );
        }
        Ok(self
            .stages
            .iter()
            .map(|s| s.iter().filter(|k| **k == LayerKind::Decoder).count())
            .collect())
    }
}

/// Items up to the end or a `)`, each with its repeat count.
fn parse_seq(chars: &[char], pos: &mut usize, s: &str) -> Result<Vec<(Item, usize)>, String> {
    let mut items = Vec::new();
    while let Some(&c) = chars.get(*pos) {
        let item = match c {
            ')' => break,
            '(' => {
                *pos += 1;
                let inner = parse_seq(chars, pos, s)?;
                if chars.get(*pos) != Some(&')') {
                    return Err(format!("unclosed '(' in '{s}'"));
                }
                *pos += 1;
                Item::Group(inner)
            }
            '*' => return Err(format!("'*' with nothing to repeat in '{s}'")),
            c => {
                *pos += 1;
                Item::Char(c)
            }
        };
        let mut times = 1;
        if chars.get(*pos) == Some(&'*') {
            *pos += 1;
            let start = *pos;
            while chars.get(*pos).is_some_and(|c| c.is_ascii_digit()) {
                *pos += 1;
            }
            let digits: String = chars[start..*pos].iter().collect();
            times = digits
                .parse()
                .map_err(|_| format!("'*' must be followed by a count in '{s}'"))?;
        }
        items.push((item, times));
    }
    Ok(items)
}

fn unroll(items: &[(Item, usize)], out: &mut String) {
    for (item, times) in items {
        for _ in 0..*times {
            match item {
                Item::Char(c) => out.push(*c),
                Item::Group(inner) => unroll(inner, out),
            }
        }
    }
}
