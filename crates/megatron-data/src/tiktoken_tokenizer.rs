//! Megatron's `TikTokenizer` (`--tokenizer-type TikTokenizer --tokenizer-model vocab.json
//! --tiktoken-pattern v2`), the `CustomTikTokenizer` of Megatron-LM's tokenizer.py that NVIDIA's
//! Nemotron recipes train with: a tiktoken BPE (the `tiktoken-rs` crate, as `GPT2BPETokenizer`
//! uses) over a JSON list of `{rank, token_bytes (base64), token_str}`, whose ranks are shifted up
//! by `--tiktoken-num-special-tokens` (1000) to make room for the special tokens in front:
//! `--tokenizer-special-tokens` (default `<unk> <s> </s>`, which it must include), then
//! `<SPECIAL_k>` fillers. The vocabulary is exactly `--vocab-size` (default 2^17): the list is
//! cut to the size less the special tokens. Text is encoded as ordinary text (special-token text
//! included), documents end with `</s>`.

use crate::tokenizer::{SpecialToken, Tokenizer};
use crate::DataError;
use base64::Engine;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

/// Megatron's `PATTERN_TIKTOKEN` (`--tiktoken-pattern v1`).
const PATTERN_V1: &str =
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
/// Megatron's `PATTERN_TIKTOKEN_V2` (`--tiktoken-pattern v2`, GPT-4o's split).
const PATTERN_V2: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The vocabulary size when `--vocab-size` is not given (Megatron's fallback).
const DEFAULT_VOCAB_SIZE: usize = 1 << 17;
/// Megatron's default `--tiktoken-num-special-tokens`.
pub const DEFAULT_NUM_SPECIAL_TOKENS: usize = 1000;
/// The special tokens every TikTokenizer has (unknown, BOS, EOS), at ids 0, 1, 2 by default.
const REQUIRED_SPECIALS: [&str; 3] = ["<unk>", "<s>", "</s>"];

/// `--tiktoken-pattern`: which pre-tokenization split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TiktokenPattern {
    V1,
    V2,
}

impl std::str::FromStr for TiktokenPattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" => Ok(TiktokenPattern::V1),
            "v2" => Ok(TiktokenPattern::V2),
            other => Err(format!("expected v1 or v2, got {other:?}")),
        }
    }
}

impl TiktokenPattern {
    fn regex(self) -> &'static str {
        match self {
            TiktokenPattern::V1 => PATTERN_V1,
            TiktokenPattern::V2 => PATTERN_V2,
        }
    }
}

/// TikTokenizer's settings beyond the file (`--tiktoken-pattern`, `--tiktoken-num-special-tokens`,
/// `--tokenizer-special-tokens`), kept with a checkpoint so `generate` rebuilds the same ids.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TiktokenOptions {
    pub pattern: TiktokenPattern,
    pub num_special_tokens: usize,
    /// `None`: `<unk> <s> </s>`.
    pub special_tokens: Option<Vec<String>>,
}

pub struct TikTokenizer {
    bpe: CoreBPE,
    pattern: TiktokenPattern,
    /// Token bytes to id (ranks shifted past the special tokens).
    encoder: FxHashMap<Vec<u8>, u32>,
    specials: FxHashMap<String, u32>,
    vocab_size: usize,
    bos: u32,
    eos: u32,
}

impl TikTokenizer {
    pub fn from_file(
        path: &str,
        options: &TiktokenOptions,
        vocab_size: Option<usize>,
    ) -> Result<Self, DataError> {
        let err = |msg: String| DataError::Tokenizer {
            path: path.to_string(),
            msg,
        };
        let vocab_size = vocab_size.unwrap_or(DEFAULT_VOCAB_SIZE);
        let n_special = options.num_special_tokens;
        let mut specials: Vec<String> = match &options.special_tokens {
            Some(s) => s.clone(),
            None => REQUIRED_SPECIALS.iter().map(|s| s.to_string()).collect(),
        };
        for (k, s) in specials.iter().enumerate() {
            if specials[..k].contains(s) {
                return Err(err(format!("--tokenizer-special-tokens lists {s} twice")));
            }
        }
        if let Some(missing) = REQUIRED_SPECIALS
            .iter()
            .find(|r| !specials.iter().any(|s| s == *r))
        {
            return Err(err(format!(
                "--tokenizer-special-tokens must include <unk>, <s> and </s> (no {missing})"
            )));
        }
        if specials.len() > n_special || n_special >= vocab_size {
            return Err(err(format!(
                "{} special tokens, --tiktoken-num-special-tokens {n_special}, --vocab-size {vocab_size}: Megatron needs special tokens <= num-special-tokens < vocab size",
                specials.len()
            )));
        }
        for k in specials.len()..n_special {
            let filler = format!("<SPECIAL_{k}>");
            if specials.contains(&filler) {
                return Err(err(format!(
                    "--tokenizer-special-tokens lists {filler}, which is also the filler of id {k}"
                )));
            }
            specials.push(filler);
        }
        let inner = vocab_size - n_special;
        let encoder = read_ranks(path, inner)?;
        let specials: FxHashMap<String, u32> = specials
            .into_iter()
            .enumerate()
            .map(|(i, s)| (s, i as u32))
            .collect();
        let encoder: FxHashMap<Vec<u8>, u32> = encoder
            .into_iter()
            .map(|(b, r)| (b, r + n_special as u32))
            .collect();
        let bpe = CoreBPE::new(encoder.clone(), specials.clone(), options.pattern.regex())
            .map_err(|e| err(e.to_string()))?;
        Ok(TikTokenizer {
            bpe,
            pattern: options.pattern,
            bos: specials["<s>"],
            eos: specials["</s>"],
            encoder,
            specials,
            vocab_size,
        })
    }
}

/// Megatron's `reload_mergeable_ranks`: the first `inner` entries of the JSON list, each rank its
/// index, the first 256 the single bytes; an error naming the entry otherwise, or when the list
/// is shorter than the vocabulary needs.
fn read_ranks(path: &str, inner: usize) -> Result<FxHashMap<Vec<u8>, u32>, DataError> {
    let err = |msg: String| DataError::Tokenizer {
        path: path.to_string(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_string(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
    let list = v.as_array().ok_or_else(|| {
        err("not Megatron's tiktoken vocabulary: expected a JSON list of {rank, token_bytes, token_str}".into())
    })?;
    if list.len() < inner {
        return Err(err(format!(
            "{} tokens, fewer than the {inner} that --vocab-size less --tiktoken-num-special-tokens needs",
            list.len()
        )));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut ranks = FxHashMap::default();
    for (i, x) in list.iter().take(inner).enumerate() {
        let rank = x["rank"].as_u64();
        let bytes = x["token_bytes"].as_str().map(|s| b64.decode(s));
        let bytes = match (rank, bytes) {
            (Some(r), Some(Ok(b))) if r == i as u64 => b,
            (Some(r), Some(Ok(_))) => {
                return Err(err(format!(
                    "entry {i} has rank {r}: ranks must be the entries' indices"
                )))
            }
            _ => {
                return Err(err(format!(
                    "entry {i} is not {{\"rank\": {i}, \"token_bytes\": <base64>, ...}}"
                )))
            }
        };
        if i < 256 && bytes != [i as u8] {
            return Err(err(format!(
                "entry {i} is not the single byte {i} (the first 256 are the bytes)"
            )));
        }
        if ranks.insert(bytes, i as u32).is_some() {
            return Err(err(format!("entry {i} repeats an earlier token's bytes")));
        }
    }
    Ok(ranks)
}

impl Tokenizer for TikTokenizer {
    fn name(&self) -> &'static str {
        "TikTokenizer"
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self.bpe.encode_ordinary(text))
    }
    /// tiktoken's `decode`: the tokens' bytes (special tokens as their text), invalid UTF-8
    /// replaced.
    fn decode(&self, ids: &[u32]) -> String {
        let known: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&i| (i as usize) < self.vocab_size)
            .collect();
        let bytes = self.bpe.decode_bytes(&known).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    fn decode_without_special(&self, ids: &[u32]) -> String {
        let n = self.specials.len() as u32;
        let kept: Vec<u32> = ids.iter().copied().filter(|&i| i >= n).collect();
        self.decode(&kept)
    }
    fn eod(&self) -> u32 {
        self.eos
    }
    fn special_id(&self, which: SpecialToken) -> Option<u32> {
        match which {
            SpecialToken::Bos => Some(self.bos),
            SpecialToken::Eos => Some(self.eos),
            _ => None,
        }
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        self.specials
            .get(token)
            .or_else(|| self.encoder.get(token.as_bytes()))
            .copied()
    }
    fn token_text(&self, id: u32) -> Option<String> {
        if id as usize >= self.vocab_size {
            return None;
        }
        let bytes = self.bpe.decode_bytes(&[id]).ok()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn for_worker(&self) -> Option<Box<dyn Tokenizer>> {
        let bpe = CoreBPE::new(
            self.encoder.clone(),
            self.specials.clone(),
            self.pattern.regex(),
        )
        .ok()?;
        Some(Box::new(TikTokenizer {
            bpe,
            pattern: self.pattern,
            encoder: self.encoder.clone(),
            specials: self.specials.clone(),
            vocab_size: self.vocab_size,
            bos: self.bos,
            eos: self.eos,
        }))
    }
}
