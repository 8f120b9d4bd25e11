//! Megatron's `Llama2Tokenizer` and `GPTSentencePieceTokenizer` (`--tokenizer-model
//! tokenizer.model`): the sentencepiece library's `encode` and `decode`, on the `tokenizers`
//! crate. The model's vocabulary becomes the byte-fallback BPE of `spm_vocab.rs` (the same merges
//! in the same order as sentencepiece's BPE), with control tokens in the text read as text, as
//! sentencepiece reads them; `Llama2Tokenizer` puts BOS before every text, as Megatron's does
//! (`tokenize(s, bos=True)`). Both end documents with the model's EOS.

use crate::hf_tokenizer::HFTokenizer;
use crate::spm_vocab::{tokenizer_json_as, ControlTokensInText};
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
    inner: HFTokenizer,
    name: &'static str,
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
        let json = tokenizer_json_as(&m.vocab, None, None, ControlTokensInText::Text);
        let mut inner: tokenizers::Tokenizer = json
            .to_string()
            .parse()
            .map_err(|e| err(format!("as a tokenizer: {e}")))?;
        inner.set_encode_special_tokens(true);
        Ok(SentencePieceTokenizer {
            inner: HFTokenizer::with_eod(inner, name, eod),
            name,
            bos,
        })
    }

    /// The underlying `tokenizers` object (for saving).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        self.inner.inner()
    }
}

impl Tokenizer for SentencePieceTokenizer {
    fn name(&self) -> &'static str {
        self.name
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let ids = self.inner.encode(text)?;
        Ok(self.bos.into_iter().chain(ids).collect())
    }
    /// sentencepiece's `decode_ids`, which drops control tokens.
    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode_without_special(ids)
    }
    fn decode_without_special(&self, ids: &[u32]) -> String {
        self.inner.decode_without_special(ids)
    }
    fn eod(&self) -> u32 {
        self.inner.eod()
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_id(token)
    }
    fn token_text(&self, id: u32) -> Option<String> {
        self.inner.token_text(id)
    }
}
