use crate::tokenizer::Tokenizer;
use crate::{DataError, GPTSampleSource, Split};
use megatron_tensor::RngKey;

/// Parses Megatron's `--split` (e.g. `969,30,1`) into train/valid/test fractions.
pub fn parse_split(s: &str) -> Result<[f64; 3], DataError> {
    let parts: Vec<&str> = s.split([',', '/']).map(str::trim).collect();
    if parts.is_empty() || parts.len() > 3 {
        return Err(DataError::BadSplit(s.into()));
    }
    let mut w = [0.0f64; 3];
    for (i, p) in parts.iter().enumerate() {
        w[i] = p
            .parse::<f64>()
            .map_err(|_| DataError::BadSplit(s.into()))?;
        if !(w[i] >= 0.0 && w[i].is_finite()) {
            return Err(DataError::BadSplit(s.into()));
        }
    }
    let sum: f64 = w.iter().sum();
    if sum <= 0.0 {
        return Err(DataError::BadSplit(s.into()));
    }
    Ok(w.map(|x| x / sum))
}

/// Raw text files tokenized whole, split by `--split` into contiguous train/valid/test ranges,
/// cut into `seq_length + 1` windows overlapping by one token and visited in a seeded shuffle.
/// The stand-in for Megatron's GPTDataset until the `.bin/.idx` pipeline lands.
pub struct TextDataset {
    tokens: Vec<u32>,
    ranges: [(usize, usize); 3],
    perms: [Vec<u32>; 3],
    seq_length: usize,
    eod: u32,
}

impl TextDataset {
    pub fn from_files(
        paths: &[String],
        tokenizer: &dyn Tokenizer,
        split: &str,
        seq_length: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        let weights = parse_split(split)?;
        let mut tokens = Vec::new();
        for p in paths {
            let text = std::fs::read(p).map_err(|e| DataError::Io {
                path: p.clone(),
                source: e,
            })?;
            let text = String::from_utf8_lossy(&text);
            tokens.extend(tokenizer.encode(&text)?);
            tokens.push(tokenizer.eod());
        }
        let n = tokens.len();
        let mut ranges = [(0, 0); 3];
        let mut start = 0usize;
        let mut acc = 0.0;
        for (i, w) in weights.iter().enumerate() {
            acc += w;
            let end = if i == 2 {
                n
            } else {
                ((acc * n as f64).round() as usize).min(n)
            };
            ranges[i] = (start, end);
            start = end;
        }
        let name = paths.join(",");
        let key = RngKey::new(seed).fold(0x7e47);
        let mut perms: [Vec<u32>; 3] = Default::default();
        for (i, (s, e)) in ranges.iter().enumerate() {
            let len = e - s;
            let windows = if len > seq_length {
                (len - 1) / seq_length
            } else {
                0
            };
            if windows == 0 && weights[i] > 0.0 && i == 0 {
                return Err(DataError::TooSmall {
                    path: name,
                    split: "train",
                    tokens: len,
                    seq: seq_length,
                });
            }
            let mut perm: Vec<u32> = (0..windows as u32).collect();
            // Fisher-Yates with the counter-based RNG: the order depends only on the seed.
            let k = key.fold(i as u64);
            for j in (1..perm.len()).rev() {
                let r = (k.bits(j as u64) % (j as u64 + 1)) as usize;
                perm.swap(j, r);
            }
            perms[i] = perm;
        }
        Ok(TextDataset {
            tokens,
            ranges,
            perms,
            seq_length,
            eod: tokenizer.eod(),
        })
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Entropy (nats) of the training split's unigram distribution: the loss of a model that
    /// ignores context, the first bar a language model must clear.
    pub fn unigram_entropy(&self) -> f64 {
        let (s, e) = self.ranges[0];
        let mut counts = std::collections::HashMap::<u32, u64>::new();
        for &t in &self.tokens[s..e] {
            *counts.entry(t).or_default() += 1;
        }
        let n = (e - s) as f64;
        counts
            .values()
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }
}

impl GPTSampleSource for TextDataset {
    fn seq_length(&self) -> usize {
        self.seq_length
    }
    fn num_samples(&self, split: Split) -> u64 {
        self.perms[split as usize].len() as u64
    }
    fn sample(&self, split: Split, idx: u64, out: &mut [u32]) {
        let perm = &self.perms[split as usize];
        assert!(!perm.is_empty(), "{split:?} split is empty");
        let w = perm[(idx % perm.len() as u64) as usize] as usize;
        let start = self.ranges[split as usize].0 + w * self.seq_length;
        out.copy_from_slice(&self.tokens[start..start + self.seq_length + 1]);
    }
    fn eod(&self) -> Option<u32> {
        Some(self.eod)
    }
}
