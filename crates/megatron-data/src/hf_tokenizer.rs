//! BPE tokenizers on the Hugging Face `tokenizers` crate: Megatron's `GPT2BPETokenizer` (GPT-2
//! `vocab.json` + `merges.txt`, byte-level, no prefix space) and `HuggingFaceTokenizer` (any
//! `tokenizer.json`).

use crate::tokenizer::Tokenizer;
use crate::DataError;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

pub struct HFTokenizer {
    inner: tokenizers::Tokenizer,
    name: &'static str,
    eod: u32,
    vocab_size: usize,
}

/// End-of-document tokens tried in order (GPT-2 / Llama-3, SentencePiece, others).
const EOD_TOKENS: [&str; 6] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eot_id|>",
    "[SEP]",
];

fn err(path: &str, e: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer {
        path: path.to_string(),
        msg: e.to_string(),
    }
}

impl HFTokenizer {
    pub fn gpt2(vocab: &str, merges: &str) -> Result<Self, DataError> {
        let bpe = BPE::from_file(vocab, merges)
            .build()
            .map_err(|e| err(&format!("{vocab}, {merges}"), e))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        inner.with_decoder(Some(ByteLevel::default()));
        Self::wrap(inner, "GPT2BPETokenizer", vocab)
    }

    /// Megatron's `BertWordPieceLowerCase` / `BertWordPieceCase` (`--vocab-file vocab.txt`):
    /// BERT's basic tokenization (text cleanup, CJK characters apart, accents stripped when
    /// lower-casing, punctuation split) then greedy longest-match WordPiece with `[UNK]`, as
    /// Google's `FullTokenizer` and Hugging Face's `BertTokenizerFast` do. Like Megatron's
    /// `_BertWordPieceTokenizer`, `[BOS]` and `[EOS]` are appended to the vocabulary, then
    /// `extra_ids` sentinels `<extra_id_0>`... (`--vocab-extra-ids`, T5's).
    pub fn bert_wordpiece(
        vocab: &str,
        lower_case: bool,
        extra_ids: usize,
    ) -> Result<Self, DataError> {
        use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
        use tokenizers::models::wordpiece::WordPiece;
        use tokenizers::normalizers::bert::BertNormalizer;
        use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
        let wp = WordPiece::from_file(vocab)
            .unk_token("[UNK]".into())
            .build()
            .map_err(|e| err(vocab, e))?;
        let mut inner = tokenizers::Tokenizer::new(wp);
        inner.with_normalizer(Some(BertNormalizer::new(true, true, None, lower_case)));
        inner.with_pre_tokenizer(Some(BertPreTokenizer));
        inner.with_decoder(Some(WordPieceDecoder::default()));
        let added: Vec<tokenizers::AddedToken> = ["[BOS]".to_string(), "[EOS]".to_string()]
            .into_iter()
            .chain((0..extra_ids).map(|i| format!("<extra_id_{i}>")))
            .map(|t| tokenizers::AddedToken::from(t, true))
            .collect();
        inner.add_special_tokens(&added);
        let name = if lower_case {
            "BertWordPieceLowerCase"
        } else {
            "BertWordPieceCase"
        };
        Self::wrap(inner, name, vocab)
    }

    pub fn from_file(path: &str) -> Result<Self, DataError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| err(path, e))?;
        Self::wrap(inner, "HuggingFaceTokenizer", path)
    }

    fn wrap(
        inner: tokenizers::Tokenizer,
        name: &'static str,
        path: &str,
    ) -> Result<Self, DataError> {
        let eod = EOD_TOKENS
            .iter()
            .find_map(|t| inner.token_to_id(t))
            .ok_or_else(|| {
                err(
                    path,
                    format!("no end-of-document token (looked for {EOD_TOKENS:?})"),
                )
            })?;
        let vocab_size = inner.get_vocab_size(true);
        Ok(HFTokenizer {
            inner,
            name,
            eod,
            vocab_size,
        })
    }

    /// The underlying `tokenizers` object (for saving).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl Tokenizer for HFTokenizer {
    fn name(&self) -> &'static str {
        self.name
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| err(self.name, e))?;
        Ok(enc.get_ids().to_vec())
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }
    fn decode_without_special(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }
    fn eod(&self) -> u32 {
        self.eod
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}
