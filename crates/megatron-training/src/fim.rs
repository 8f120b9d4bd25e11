//! `--fim-data` and its flags (Megatron's names and defaults), checked once against the
//! tokenizer into `FimSettings` for `megatron_data::fim_dataset::GPTFIMDataset`.

use crate::TrainError;
use clap::Args;
use megatron_data::fim_dataset::{FimSettings, FimTokens};
use megatron_data::Tokenizer;

#[derive(Args, Clone, Debug, Default)]
pub struct FimArgs {
    /// Fill-in-the-middle samples (Megatron's GPTFIMDataset): each document of a GPT sample
    /// is, at --fim-rate, cut at two random characters and re-tokenized as prefix / suffix /
    /// middle behind the FIM tokens.
    #[arg(long)]
    pub fim_data: bool,
    /// Probability that a document (or, with --fim-split-sample, a sample) is transformed.
    #[arg(long, default_value_t = 0.5)]
    pub fim_rate: f64,
    /// Probability that a transformed piece is suffix-prefix-middle (else prefix-suffix-middle).
    #[arg(long, default_value_t = 0.5)]
    pub fim_spm_rate: f64,
    /// A token (a repository's file separator) around which each transformed sample is cut
    /// into fragments, each transformed at --fim-fragment-rate.
    #[arg(long)]
    pub fim_split_sample: Option<String>,
    #[arg(long)]
    pub fim_fragment_rate: Option<f64>,
    /// Pieces whose text starts with this string are never transformed.
    #[arg(long)]
    pub fim_no_prefix: Option<String>,
    #[arg(long, default_value = "<fim_prefix>")]
    pub fim_prefix_token: String,
    #[arg(long, default_value = "<fim_middle>")]
    pub fim_middle_token: String,
    #[arg(long, default_value = "<fim_suffix>")]
    pub fim_suffix_token: String,
    #[arg(long, default_value = "<fim_pad>")]
    pub fim_pad_token: String,
    /// The token between documents (Megatron's default `<|endoftext|>`).
    #[arg(long, default_value = "<|endoftext|>")]
    pub fim_eod_token: String,
}

impl FimArgs {
    /// The settings of `--fim-data` (None without it): rates in [0, 1], every FIM token in
    /// `tok`'s vocabulary, each error naming its flag.
    pub fn settings(&self, tok: &dyn Tokenizer) -> Result<Option<FimSettings>, TrainError> {
        if !self.fim_data {
            return Ok(None);
        }
        let bad = |m: String| TrainError::Args(m);
        let rate = |flag: &str, r: f64| {
            if (0.0..=1.0).contains(&r) {
                Ok(r)
            } else {
                Err(bad(format!("{flag} must be in [0, 1], got {r}")))
            }
        };
        let id = |flag: &str, token: &str| {
            tok.token_id(token).ok_or_else(|| {
                bad(format!(
                    "{flag} {token:?}: not a token of the {} vocabulary (--fim-data needs its FIM tokens; \
                     add them to the tokenizer or name others)",
                    tok.name()
                ))
            })
        };
        let split_sample = match (&self.fim_split_sample, self.fim_fragment_rate) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(bad(
                    "--fim-fragment-rate applies with --fim-split-sample".into()
                ))
            }
            (Some(_), None) => {
                return Err(bad(
                    "--fim-split-sample needs --fim-fragment-rate (each fragment's FIM rate)"
                        .into(),
                ))
            }
            (Some(t), Some(r)) => Some((
                id("--fim-split-sample", t)?,
                rate("--fim-fragment-rate", r)?,
            )),
        };
        Ok(Some(FimSettings {
            rate: rate("--fim-rate", self.fim_rate)?,
            spm_rate: rate("--fim-spm-rate", self.fim_spm_rate)?,
            split_sample,
            no_prefix: self.fim_no_prefix.clone(),
            tokens: FimTokens {
                prefix: id("--fim-prefix-token", &self.fim_prefix_token)?,
                middle: id("--fim-middle-token", &self.fim_middle_token)?,
                suffix: id("--fim-suffix-token", &self.fim_suffix_token)?,
                pad: id("--fim-pad-token", &self.fim_pad_token)?,
                eod: id("--fim-eod-token", &self.fim_eod_token)?,
            },
        }))
    }
}
