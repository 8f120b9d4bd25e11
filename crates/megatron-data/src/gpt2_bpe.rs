//! `GPT2BPETokenizer` on tiktoken's BPE (the `tiktoken-rs` crate), built from the user's GPT-2
//! `vocab.json` + `merges.txt`.
//!
//! tiktoken merges by the rank of the merged token, which equals merge order whenever token ids
//! rise with the merges (true of GPT-2's files and of files written by `train-tokenizer`); it
//! encodes several times faster than the Hugging Face BPE, with identical ids (checked in the
//! tests on the GPT-2 vocabulary). Files whose ids do not follow their merges fall back to the
//! Hugging Face implementation.

use crate::tokenizer::Tokenizer;
use crate::DataError;
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use tiktoken_rs::CoreBPE;

/// GPT-2's pre-tokenization pattern, as tiktoken writes it for `r50k_base`.
const GPT2_PATTERN: &str =
    r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s";
const EOD: &str = "<|endoftext|>";

pub struct Gpt2Bpe {
    bpe: CoreBPE,
    encoder: FxHashMap<Vec<u8>, u32>,
    specials: FxHashMap<String, u32>,
    eod: u32,
    vocab_size: usize,
}

/// GPT-2's reversible byte <-> printable character table (`bytes_to_unicode`).
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.iter()
        .zip(&cs)
        .map(|(&b, &c)| (char::from_u32(c).expect("valid char"), b as u8))
        .collect()
}

fn err(path: &str, msg: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer {
        path: path.to_string(),
        msg: msg.to_string(),
    }
}

impl Gpt2Bpe {
    /// `Ok(None)` when the files' ids do not follow their merge order.
    pub fn from_files(vocab: &str, merges: &str) -> Result<Option<Self>, DataError> {
        let v: HashMap<String, u32> =
            serde_json::from_str(&std::fs::read_to_string(vocab).map_err(|e| err(vocab, e))?)
                .map_err(|e| err(vocab, e))?;
        let m = std::fs::read_to_string(merges).map_err(|e| err(merges, e))?;
        let mut prev = None;
        for (i, line) in m
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.starts_with("#version") && !l.trim().is_empty())
        {
            let (a, b) = line
                .split_once(' ')
                .ok_or_else(|| err(merges, format!("line {}: expected two tokens", i + 1)))?;
            let Some(&id) = v.get(&format!("{a}{b}")) else {
                return Ok(None);
            };
            if prev.is_some_and(|p| id <= p) {
                return Ok(None);
            }
            prev = Some(id);
        }
        let table = unicode_to_byte();
        let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        let mut specials: FxHashMap<String, u32> = FxHashMap::default();
        for (tok, &id) in &v {
            if tok == EOD {
                specials.insert(tok.clone(), id);
                continue;
            }
            let bytes: Option<Vec<u8>> = tok.chars().map(|c| table.get(&c).copied()).collect();
            match bytes {
                Some(b) => {
                    encoder.insert(b, id);
                }
                None => return Ok(None),
            }
        }
        let eod = *specials
            .get(EOD)
            .ok_or_else(|| err(vocab, format!("no {EOD} token")))?;
        let vocab_size = v.len();
        let bpe = CoreBPE::new(encoder.clone(), specials.clone(), GPT2_PATTERN)
            .map_err(|e| err(vocab, e))?;
        Ok(Some(Gpt2Bpe {
            bpe,
            encoder,
            specials,
            eod,
            vocab_size,
        }))
    }
}

impl Tokenizer for Gpt2Bpe {
    fn name(&self) -> &'static str {
        "GPT2BPETokenizer"
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        // Like Megatron's GPT2BPETokenizer, special-token text is encoded as ordinary text.
        Ok(self.bpe.encode_ordinary(text))
    }
    fn decode(&self, ids: &[u32]) -> String {
        let bytes = self.bpe.decode_bytes(ids).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    fn eod(&self) -> u32 {
        self.eod
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        // Printable ASCII spells itself in GPT-2's byte alphabet: `<fim_prefix>` is its bytes.
        let table = unicode_to_byte();
        let bytes: Option<Vec<u8>> = token.chars().map(|c| table.get(&c).copied()).collect();
        self.specials
            .get(token)
            .or_else(|| bytes.and_then(|b| self.encoder.get(&b)))
            .copied()
    }
    fn decode_without_special(&self, ids: &[u32]) -> String {
        let kept: Vec<u32> = ids.iter().copied().filter(|&i| i != self.eod).collect();
        self.decode(&kept)
    }
    fn for_worker(&self) -> Option<Box<dyn Tokenizer>> {
        let bpe = CoreBPE::new(self.encoder.clone(), self.specials.clone(), GPT2_PATTERN).ok()?;
        Some(Box::new(Gpt2Bpe {
            bpe,
            encoder: self.encoder.clone(),
            specials: self.specials.clone(),
            eod: self.eod,
            vocab_size: self.vocab_size,
        }))
    }
}
