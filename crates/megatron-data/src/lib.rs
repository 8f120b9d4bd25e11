//! Data for megatron-rs: tokenizers and GPT sample sources. Until Megatron's `.bin/.idx` path
//! lands, training reads mock sequences or raw text tokenized byte by byte, both through the
//! [`GPTSampleSource`] trait that the indexed datasets will implement too.

pub mod bert_dataset;
pub mod blended_dataset;
pub mod data_samplers;
pub mod fim_dataset;
pub mod gpt2_bpe;
pub mod gpt_dataset;
pub mod hf_tokenizer;
pub mod indexed_dataset;
pub mod inputs;
pub mod masked_dataset;
pub mod megatron_data;
pub mod mock_dataset;
pub mod npy;
pub mod numpy_rng;
pub mod precompiled_charsmap;
pub mod preprocess;
pub mod sentencepiece_encoder;
pub mod sentencepiece_megatron;
pub mod sentencepiece_model;
pub mod sentencepiece_tokenizer;
pub mod sentences;
pub mod spm_vocab;
pub mod t5_dataset;
pub mod tables;
pub mod text_dataset;
pub mod tiktoken_tokenizer;
pub mod tokenizer;
pub mod torch_randperm;
pub mod train_tokenizer;

pub use mock_dataset::MockGPTDataset;
pub use text_dataset::{parse_split, TextDataset};
pub use tokenizer::{
    build_tokenizer, build_tokenizer_from, ByteLevelTokenizer, NullTokenizer, SpecialToken,
    Tokenizer, TokenizerSpec,
};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("--split '{0}': expected up to three comma-separated non-negative weights with a positive sum, e.g. 969,30,1")]
    BadSplit(String),
    #[error("{path}: the {split} split holds {tokens} tokens, fewer than one sample of --seq-length {seq} + 1")]
    TooSmall {
        path: String,
        split: &'static str,
        tokens: usize,
        seq: usize,
    },
    #[error("--tokenizer-type {0} is not known (expected GPT2BPETokenizer, HuggingFaceTokenizer, Llama2Tokenizer, GPTSentencePieceTokenizer, SentencePieceTokenizer, TikTokenizer, BertWordPieceLowerCase, BertWordPieceCase, ByteLevelTokenizer or NullTokenizer)")]
    UnknownTokenizer(String),
    #[error("--tokenizer-type {tokenizer} needs {flag}")]
    MissingFlag {
        flag: &'static str,
        tokenizer: &'static str,
    },
    #[error("{path}: {msg}")]
    Tokenizer { path: String, msg: String },
    #[error("--tokenizer-type NullTokenizer needs a positive --vocab-size")]
    NullNeedsVocab,
    #[error("token id {token} does not fit the dataset's {dtype} tokens")]
    TokenTooLarge { token: u32, dtype: String },
    #[error("{path}: {msg}")]
    Format { path: String, msg: String },
    #[error("token '{token}' is not an integer id below the vocabulary size {vocab}")]
    BadNullToken { token: String, vocab: usize },
}

/// Which split a sample comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Valid,
    Test,
}

/// A source of fixed-length GPT samples (`seq_length + 1` tokens each), addressed by index so
/// that a resumed run continues exactly where it stopped.
pub trait GPTSampleSource: Send + Sync {
    fn seq_length(&self) -> usize;
    /// Number of distinct samples; indices wrap around beyond it (epochs).
    fn num_samples(&self, split: Split) -> u64;
    /// Writes sample `idx` (`seq_length + 1` tokens) into `out`.
    fn sample(&self, split: Split, idx: u64, out: &mut [u32]);
    /// Id whose label is masked out of the loss (Megatron's `--eod-mask-loss`), if any.
    fn eod(&self) -> Option<u32>;
    /// The validation split's sets, laid end to end in its sample indices: their lengths
    /// (`--multiple-validation-sets` makes several; otherwise the split is one).
    fn validation_sets(&self) -> Vec<u64> {
        vec![self.num_samples(Split::Valid)]
    }
}
