use crate::DataError;

/// Megatron's tokenizer interface, the part training and generation need.
pub trait Tokenizer: Send + Sync {
    fn name(&self) -> &'static str;
    fn vocab_size(&self) -> usize;
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError>;
    fn decode(&self, ids: &[u32]) -> String;
    /// End-of-document id.
    fn eod(&self) -> u32;
    /// The id of a (special) token given by its text, if the vocabulary has it.
    fn token_id(&self, _token: &str) -> Option<u32> {
        None
    }
    /// The text of `ids` without special tokens (Megatron's `ids_to_text(...,
    /// remove_special_tokens=True)`, which the FIM transform cuts).
    fn decode_without_special(&self, ids: &[u32]) -> String {
        self.decode(ids)
    }
    /// Megatron's named special tokens (`tokenizer.cls`, `.sep`, `.mask`, `.pad`, `.bos`,
    /// `.eos`), of which BERT's and T5's samples are built. By default they are found by the
    /// names of a BERT WordPiece vocabulary (`[CLS]`...; `[BOS]` and `[EOS]` are those
    /// Megatron's `_BertWordPieceTokenizer` appends), which Hugging Face's BERT tokenizers share.
    fn special_id(&self, which: SpecialToken) -> Option<u32> {
        self.token_id(which.wordpiece_text())
    }
    /// The text of token `id`, if the tokenizer has a vocabulary of strings.
    fn token_text(&self, _id: u32) -> Option<String> {
        None
    }
    /// An independent copy for one worker thread, where sharing would contend (tiktoken's
    /// regex keeps one scratch pool per regex, behind a lock). `None`: share `self`.
    fn for_worker(&self) -> Option<Box<dyn Tokenizer>> {
        None
    }
}

/// The special tokens BERT and T5 samples are built of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecialToken {
    Cls,
    Sep,
    Mask,
    Pad,
    Bos,
    Eos,
}

impl SpecialToken {
    /// Its text in a BERT WordPiece vocabulary.
    pub fn wordpiece_text(self) -> &'static str {
        match self {
            SpecialToken::Cls => "[CLS]",
            SpecialToken::Sep => "[SEP]",
            SpecialToken::Mask => "[MASK]",
            SpecialToken::Pad => "[PAD]",
            SpecialToken::Bos => "[BOS]",
            SpecialToken::Eos => "[EOS]",
        }
    }
}

/// Bytes as tokens (0..=255) plus an end-of-document id 256.
pub struct ByteLevelTokenizer;

impl Tokenizer for ByteLevelTokenizer {
    fn name(&self) -> &'static str {
        "ByteLevelTokenizer"
    }
    fn vocab_size(&self) -> usize {
        257
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    fn eod(&self) -> u32 {
        256
    }
}

/// Megatron's `NullTokenizer`: the text is whitespace-separated integer ids; the end-of-document
/// id is `vocab_size` (the vocabulary is one larger than given).
pub struct NullTokenizer {
    pub vocab_size: usize,
}

impl Tokenizer for NullTokenizer {
    fn name(&self) -> &'static str {
        "NullTokenizer"
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size + 1
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        text.split_whitespace()
            .map(|t| match t.parse::<u32>() {
                Ok(v) if (v as usize) < self.vocab_size() => Ok(v),
                _ => Err(DataError::BadNullToken {
                    token: t.to_string(),
                    vocab: self.vocab_size(),
                }),
            })
            .collect()
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }
    fn eod(&self) -> u32 {
        self.vocab_size as u32
    }
}

/// The tokenizer flags of Megatron (`--tokenizer-type`, `--vocab-file`, `--merge-file`,
/// `--tokenizer-model`, `--vocab-size`).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TokenizerSpec {
    pub tokenizer_type: String,
    pub vocab_file: Option<String>,
    pub merge_file: Option<String>,
    pub tokenizer_model: Option<String>,
    pub vocab_size: Option<usize>,
    /// `--vocab-extra-ids`: T5's sentinels `<extra_id_0>`... appended to a WordPiece
    /// vocabulary.
    pub vocab_extra_ids: usize,
    /// `TikTokenizer`'s settings (`None` without `--tiktoken-pattern`).
    #[serde(default)]
    pub tiktoken: Option<crate::tiktoken_tokenizer::TiktokenOptions>,
}

pub fn build_tokenizer(
    kind: &str,
    vocab_size: Option<usize>,
) -> Result<Box<dyn Tokenizer>, DataError> {
    build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: kind.to_string(),
        vocab_size,
        ..Default::default()
    })
}

pub fn build_tokenizer_from(spec: &TokenizerSpec) -> Result<Box<dyn Tokenizer>, DataError> {
    let need = |f: &Option<String>, flag: &'static str, tokenizer: &'static str| {
        f.clone().ok_or(DataError::MissingFlag { flag, tokenizer })
    };
    match spec.tokenizer_type.as_str() {
        "ByteLevelTokenizer" => Ok(Box::new(ByteLevelTokenizer)),
        "NullTokenizer" => Ok(Box::new(NullTokenizer {
            vocab_size: spec
                .vocab_size
                .filter(|&v| v > 0)
                .ok_or(DataError::NullNeedsVocab)?,
        })),
        "GPT2BPETokenizer" => {
            let v = need(&spec.vocab_file, "--vocab-file", "GPT2BPETokenizer")?;
            let m = need(&spec.merge_file, "--merge-file", "GPT2BPETokenizer")?;
            match crate::gpt2_bpe::Gpt2Bpe::from_files(&v, &m)? {
                Some(fast) => Ok(Box::new(fast)),
                None => Ok(Box::new(crate::hf_tokenizer::HFTokenizer::gpt2(&v, &m)?)),
            }
        }
        "BertWordPieceLowerCase" | "BertWordPieceCase" => {
            let name = if spec.tokenizer_type == "BertWordPieceCase" {
                "BertWordPieceCase"
            } else {
                "BertWordPieceLowerCase"
            };
            let v = need(&spec.vocab_file, "--vocab-file", name)?;
            Ok(Box::new(crate::hf_tokenizer::HFTokenizer::bert_wordpiece(
                &v,
                name == "BertWordPieceLowerCase",
                spec.vocab_extra_ids,
            )?))
        }
        "Llama2Tokenizer" | "GPTSentencePieceTokenizer" => {
            use crate::sentencepiece_tokenizer::{SentencePieceKind, SentencePieceTokenizer};
            let (kind, name) = if spec.tokenizer_type == "Llama2Tokenizer" {
                (SentencePieceKind::Llama2, "Llama2Tokenizer")
            } else {
                (SentencePieceKind::Gpt, "GPTSentencePieceTokenizer")
            };
            let m = need(&spec.tokenizer_model, "--tokenizer-model", name)?;
            Ok(Box::new(SentencePieceTokenizer::from_file(&m, kind)?))
        }
        "SentencePieceTokenizer" => {
            let m = need(
                &spec.tokenizer_model,
                "--tokenizer-model",
                "SentencePieceTokenizer",
            )?;
            Ok(Box::new(
                crate::sentencepiece_megatron::MegatronSentencePieceTokenizer::from_file(
                    &m,
                    spec.vocab_extra_ids,
                )?,
            ))
        }
        "TikTokenizer" => {
            let m = need(&spec.tokenizer_model, "--tokenizer-model", "TikTokenizer")?;
            let options = spec.tiktoken.as_ref().ok_or(DataError::MissingFlag {
                flag: "--tiktoken-pattern (v1 or v2)",
                tokenizer: "TikTokenizer",
            })?;
            Ok(Box::new(
                crate::tiktoken_tokenizer::TikTokenizer::from_file(&m, options, spec.vocab_size)?,
            ))
        }
        "HuggingFaceTokenizer" => {
            let t = need(
                &spec.tokenizer_model,
                "--tokenizer-model",
                "HuggingFaceTokenizer",
            )?;
            Ok(Box::new(crate::hf_tokenizer::HFTokenizer::from_file(&t)?))
        }
        other => Err(DataError::UnknownTokenizer(other.to_string())),
    }
}
