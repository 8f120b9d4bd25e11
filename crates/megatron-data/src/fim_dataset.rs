//! Megatron's fill-in-the-middle data (`GPTFIMDataset`, `--fim-data`): each document of a GPT
//! sample (the pieces between end-of-document tokens) is, with probability `rate`, cut at two
//! character positions drawn uniformly and re-tokenized as prefix / suffix / middle behind the
//! FIM sentinel tokens (PSM), or suffix / prefix / middle (SPM, with probability `spm_rate`);
//! the sample is then cut or padded back to its length. Megatron's quirks are kept: a document
//! of no tokens loses its end-of-document token, the piece after the last one is transformed
//! even when empty, and `split_sample` (a repository's file separator) transforms each file at
//! `fragment_rate` once the whole sample was chosen at `rate`.
//!
//! Megatron draws from one NumPy generator per dataset object, in the order a rank's loader
//! reads, so its choices depend on the layout and the loader workers. Here every sample draws
//! from its own counter-based stream (seed, split, sample index): the same FIM samples at every
//! layout, on resume, and in `inspect-data`.

use crate::{GPTSampleSource, Split, Tokenizer};
use megatron_tensor::RngKey;

/// The FIM sentinel ids (`--fim-prefix-token` ... `--fim-eod-token`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub middle: u32,
    pub suffix: u32,
    pub pad: u32,
    pub eod: u32,
}

/// Validated `--fim-*` settings.
#[derive(Clone, Debug, PartialEq)]
pub struct FimSettings {
    pub rate: f64,
    pub spm_rate: f64,
    /// `--fim-split-sample`'s token id and `--fim-fragment-rate`.
    pub split_sample: Option<(u32, f64)>,
    /// `--fim-no-prefix`: a piece whose text starts with it is left alone.
    pub no_prefix: Option<String>,
    pub tokens: FimTokens,
}

/// A GPT sample source whose samples go through the FIM transform.
pub struct GPTFIMDataset {
    pub inner: Box<dyn GPTSampleSource>,
    pub tokenizer: Box<dyn Tokenizer>,
    pub settings: FimSettings,
    pub seed: u64,
}

/// One sample's random stream.
struct SampleRng {
    key: RngKey,
    next: u64,
}

impl SampleRng {
    fn draw(&mut self) -> u64 {
        self.next += 1;
        self.key.bits(self.next - 1)
    }
    /// True with probability `p` (53 random bits).
    fn bernoulli(&mut self, p: f64) -> bool {
        ((self.draw() >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < p
    }
    /// Uniform in `0..n` (`n` ≤ 2^32: the modulo bias is below 2^-32).
    fn below(&mut self, n: usize) -> usize {
        (self.draw() % n as u64) as usize
    }
}

impl GPTFIMDataset {
    /// The FIM transform of `sample`, cut or padded to its length.
    pub fn transform(&self, sample: &[u32], rng_key: RngKey) -> Vec<u32> {
        let mut rng = SampleRng {
            key: rng_key,
            next: 0,
        };
        let t = self.settings.tokens;
        let mut out = Vec::with_capacity(sample.len() + 8);
        if sample.contains(&t.eod) {
            let mut start = 0;
            for (loc, _) in sample.iter().enumerate().filter(|(_, &x)| x == t.eod) {
                if loc > start {
                    out.extend(self.split_and_permute(&sample[start..loc], &mut rng));
                    out.push(t.eod);
                }
                start = loc + 1;
            }
            out.extend(self.split_and_permute(&sample[start..], &mut rng));
        } else {
            out = self.split_and_permute(sample, &mut rng);
        }
        out.resize(sample.len(), t.pad);
        out
    }

    fn split_and_permute(&self, seq: &[u32], rng: &mut SampleRng) -> Vec<u32> {
        let s = &self.settings;
        let Some((split, fragment_rate)) = s.split_sample.filter(|(id, _)| seq.contains(id)) else {
            return self.permute(seq, s.rate, rng);
        };
        if !rng.bernoulli(s.rate) {
            return seq.to_vec();
        }
        let mut out = Vec::with_capacity(seq.len() + 8);
        let mut start = 0;
        for (loc, _) in seq.iter().enumerate().filter(|(_, &x)| x == split) {
            if loc > start {
                out.extend(self.permute(&seq[start..loc], fragment_rate, rng));
                out.push(split);
            }
            start = loc + 1;
        }
        out.extend(self.permute(&seq[start..], fragment_rate, rng));
        out
    }

    /// Megatron's `_permute` (without its truncate-or-pad, which `GPTFIMDataset` turns off).
    fn permute(&self, seq: &[u32], rate: f64, rng: &mut SampleRng) -> Vec<u32> {
        if !rng.bernoulli(rate) {
            return seq.to_vec();
        }
        let s = &self.settings;
        let text = self.tokenizer.decode_without_special(seq);
        if s.no_prefix
            .as_ref()
            .is_some_and(|p| text.starts_with(p.as_str()))
        {
            return seq.to_vec();
        }
        // Boundaries are character positions in 0..=len, as Python indexes the string.
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let n = chars.len();
        let mut b = [rng.below(n + 1), rng.below(n + 1)];
        b.sort_unstable();
        let byte = |c: usize| chars.get(c).map_or(text.len(), |(i, _)| *i);
        let (b0, b1) = (byte(b[0]), byte(b[1]));
        let encode = |piece: &str| self.tokenizer.encode(piece).unwrap_or_default();
        let (prefix, middle, suffix) = (
            encode(&text[..b0]),
            encode(&text[b0..b1]),
            encode(&text[b1..]),
        );
        let t = s.tokens;
        let mut out = Vec::with_capacity(prefix.len() + middle.len() + suffix.len() + 3);
        if rng.bernoulli(s.spm_rate) {
            out.extend([t.prefix, t.suffix]);
            out.extend(suffix);
            out.push(t.middle);
            out.extend(prefix);
            out.extend(middle);
        } else {
            out.push(t.prefix);
            out.extend(prefix);
            out.push(t.suffix);
            out.extend(suffix);
            out.push(t.middle);
            out.extend(middle);
        }
        out
    }
}

impl GPTSampleSource for GPTFIMDataset {
    fn seq_length(&self) -> usize {
        self.inner.seq_length()
    }
    fn num_samples(&self, split: Split) -> u64 {
        self.inner.num_samples(split)
    }
    fn sample(&self, split: Split, idx: u64, out: &mut [u32]) {
        self.inner.sample(split, idx, out);
        let key = RngKey::new(self.seed)
            .fold(0x00F1_4D00 + split as u64)
            .fold(idx);
        let t = self.transform(out, key);
        out.copy_from_slice(&t);
    }
    fn eod(&self) -> Option<u32> {
        self.inner.eod()
    }
    fn validation_sets(&self) -> Vec<u64> {
        self.inner.validation_sets()
    }
}
