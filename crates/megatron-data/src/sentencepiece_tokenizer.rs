//! Megatron's `Llama2Tokenizer` and `GPTSentencePieceTokenizer` (`--tokenizer-model
//! tokenizer.model`): the sentencepiece library's `encode` (`sentencepiece_encoder.rs`) and `decode_ids`.
//! `Llama2Tokenizer` puts BOS before every text, as Megatron's does (`tokenize(s, bos=True)`).
//! Both end documents with the model's EOS.

use crate::sentencepiece_encoder::SentencePieceEncoder;
use crate::spm_vocab::{SpmVocab, BYTE, CONTROL, UNKNOWN};
use crate::tokenizer::Tokenizer;
use crate::DataError;

/// Which of Megatron's sentencepiece tokenizers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SentencePieceKind {
    /// `Llama2Tokenizer`: BOS, then the text's pieces.
    Llama2,
    /// `GPTSentencePieceTokenizer`: the text's pieces.
    Gpt,
}

pub struct SentencePieceTokenizer {
    encoder: SentencePieceEncoder,
    vocab: SpmVocab,
    unk_surface: String,
    name: &'static str,
    eod: u32,
    /// Put before every text (`Llama2Tokenizer`).
    bos: Option<u32>,
}

impl SentencePieceTokenizer {
    pub fn from_file(path: &str, kind: SentencePieceKind) -> Result<Self, DataError> {
        let m = crate::sentencepiece_model::load(path)?;
        let err = |msg: String| DataError::Tokenizer {
            path: path.to_string(),
            msg,
        };
        let name = match kind {
            SentencePieceKind::Llama2 => "Llama2Tokenizer",
            SentencePieceKind::Gpt => "GPTSentencePieceTokenizer",
        };
        let eod = m.eos.ok_or_else(|| {
            err(format!(
                "no EOS piece (trainer_spec.eos_id is -1): {name} ends documents with it"
            ))
        })?;
        let bos = match kind {
            SentencePieceKind::Llama2 => Some(m.bos.ok_or_else(|| {
                err("no BOS piece (trainer_spec.bos_id is -1): Llama2Tokenizer begins texts with it".into())
            })?),
            SentencePieceKind::Gpt => None,
        };
        let bpe = SentencePieceEncoder::new(&m.vocab, &m).map_err(err)?;
        Ok(SentencePieceTokenizer {
            encoder: bpe,
            vocab: m.vocab,
            unk_surface: m.unk_surface,
            name,
            eod,
            bos,
        })
    }
}

impl Tokenizer for SentencePieceTokenizer {
    fn name(&self) -> &'static str {
        self.name
    }
    fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self
            .bos
            .into_iter()
            .chain(self.encoder.encode(text))
            .collect())
    }
    fn decode(&self, ids: &[u32]) -> String {
        decode_ids(&self.vocab, &self.unk_surface, ids)
    }
    fn decode_without_special(&self, ids: &[u32]) -> String {
        self.decode(ids)
    }
    fn eod(&self) -> u32 {
        self.eod
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        self.encoder.piece_id(token)
    }
    fn token_text(&self, id: u32) -> Option<String> {
        self.vocab.tokens.get(id as usize).cloned()
    }
}

/// sentencepiece's `decode_ids`: control pieces dropped, the unknown piece as its surface
/// (` ⁇ `), runs of byte pieces as the UTF-8 they spell, `▁` as a space, and the dummy
/// prefix's space dropped from the first piece. Ids past the vocabulary are skipped.
pub(crate) fn decode_ids(v: &SpmVocab, unk_surface: &str, ids: &[u32]) -> String {
    let mut out: Vec<u8> = Vec::new();
    let mut first = true;
    for &id in ids {
        let (Some(piece), Some(&ty)) = (v.tokens.get(id as usize), v.types.get(id as usize)) else {
            continue;
        };
        match ty {
            CONTROL => continue,
            UNKNOWN => out.extend(unk_surface.bytes()),
            BYTE => out.push(u8::from_str_radix(&piece[3..5], 16).unwrap_or(b'?')),
            _ => {
                let p = match first && v.add_space_prefix {
                    true => piece.strip_prefix('\u{2581}').unwrap_or(piece),
                    false => piece,
                };
                out.extend(p.replace('\u{2581}', " ").bytes());
            }
        }
        first = false;
    }
    String::from_utf8_lossy(&out).into_owned()
}
