//! A sentencepiece `tokenizer.model` (the `ModelProto` protobuf of `sentencepiece_model.proto`)
//! read into a [`SpmVocab`], for Megatron's `Llama2Tokenizer` and `GPTSentencePieceTokenizer`.
//! Only what decides the ids is read, and a model these ids would not reproduce is refused by
//! name: unigram and BPE models (Llama 1 and 2, Mistral 7B v0.1, CodeLlama, TinyLlama, T5,
//! ALBERT, and models trained with sentencepiece's defaults: `nmt_nfkc` rules, whitespace
//! collapsed) are built; WORD and CHAR models are not. The messages are written with prost's derive from the field numbers of the
//! `.proto` (no protoc at build time).

use crate::spm_vocab::SpmVocab;
use crate::DataError;
use prost::Message;

#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<SentencePiece>,
    #[prost(message, optional, tag = "2")]
    trainer_spec: Option<TrainerSpec>,
    #[prost(message, optional, tag = "3")]
    normalizer_spec: Option<NormalizerSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct SentencePiece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// NORMAL 1 (the default), UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6: the
    /// numbering llama.cpp's token types copy.
    #[prost(int32, optional, tag = "3")]
    r#type: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct TrainerSpec {
    /// UNIGRAM 1 (the default), BPE 2, WORD 3, CHAR 4.
    #[prost(int32, optional, tag = "3")]
    model_type: Option<i32>,
    #[prost(bool, optional, tag = "24")]
    treat_whitespace_as_suffix: Option<bool>,
    #[prost(bool, optional, tag = "35")]
    byte_fallback: Option<bool>,
    #[prost(int32, optional, tag = "41")]
    bos_id: Option<i32>,
    #[prost(string, optional, tag = "44")]
    unk_surface: Option<String>,
    #[prost(int32, optional, tag = "42")]
    eos_id: Option<i32>,
    #[prost(int32, optional, tag = "43")]
    pad_id: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct NormalizerSpec {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(bytes = "vec", optional, tag = "2")]
    precompiled_charsmap: Option<Vec<u8>>,
    #[prost(bool, optional, tag = "3")]
    add_dummy_prefix: Option<bool>,
    #[prost(bool, optional, tag = "4")]
    remove_extra_whitespaces: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    escape_whitespaces: Option<bool>,
}

/// `trainer_spec.model_type`, of those built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SentencePieceKind {
    /// Pieces chosen by the best total score (Viterbi): T5's, ALBERT's, sentencepiece's default.
    Unigram,
    /// Pieces merged by score: Llama's.
    Bpe,
}

/// A sentencepiece model's vocabulary and its BOS/EOS/padding ids (`None` where disabled, id -1).
#[derive(Clone, Debug)]
pub struct SentencePieceModel {
    pub kind: SentencePieceKind,
    pub vocab: SpmVocab,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    /// `trainer_spec.byte_fallback`: text no piece covers becomes `<0xXX>` pieces.
    pub byte_fallback: bool,
    /// What decoding writes for the unknown piece (`trainer_spec.unk_surface`).
    pub unk_surface: String,
    /// `normalizer_spec.remove_extra_whitespaces` (sentencepiece's default; Llama's models keep
    /// whitespace): spaces at the ends dropped and runs of them made one.
    pub remove_extra_whitespaces: bool,
    /// `normalizer_spec.precompiled_charsmap`: the compiled normalization rules (`nmt_nfkc`,
    /// sentencepiece's default); `None` for the identity rules (Llama's).
    pub charsmap: Option<Vec<u8>>,
    /// `normalizer_spec.name`, for messages.
    pub normalization: String,
}

impl SentencePieceModel {
    /// Why a merge vocabulary (llama.cpp's `llama` model, the `tokenizer.json` of
    /// `spm_vocab.rs`) would tokenize this model's text differently; `None` when it would not.
    /// Both apply no normalization rules, keep every space and merge as BPE does.
    pub fn unlike_a_merge_vocabulary(&self) -> Option<String> {
        if self.kind == SentencePieceKind::Unigram {
            return Some("a unigram sentencepiece model, not a BPE".into());
        }
        if self.charsmap.is_some() {
            return Some(format!(
                "normalization rules {:?} (precompiled_charsmap)",
                self.normalization
            ));
        }
        self.remove_extra_whitespaces
            .then(|| "normalizer_spec.remove_extra_whitespaces (spaces dropped and merged)".into())
    }
}

/// Reads `path`; refuses what the BPE tokenizer.json would tokenize differently.
pub fn load(path: &str) -> Result<SentencePieceModel, DataError> {
    let err = |msg: String| DataError::Tokenizer {
        path: path.to_string(),
        msg,
    };
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_string(),
        source,
    })?;
    let m = ModelProto::decode(bytes.as_slice())
        .map_err(|e| err(format!("not a sentencepiece model (ModelProto): {e}")))?;
    if m.pieces.is_empty() {
        return Err(err("not a sentencepiece model: no pieces".into()));
    }
    let t = m.trainer_spec.unwrap_or_default();
    let n = m.normalizer_spec.unwrap_or_default();
    let kind = match t.model_type.unwrap_or(1) {
        1 => SentencePieceKind::Unigram,
        2 => SentencePieceKind::Bpe,
        k => return Err(err(format!("a sentencepiece model of type {k} (WORD 3, CHAR 4): only unigram and BPE models are built"))),
    };
    if !n.escape_whitespaces.unwrap_or(true) || t.treat_whitespace_as_suffix.unwrap_or(false) {
        return Err(err(
            "whitespace kept unescaped or as a suffix: only models that prefix \u{2581} (Llama's) are built".into(),
        ));
    }
    let tokens: Vec<String> = m
        .pieces
        .iter()
        .map(|p| p.piece.clone().unwrap_or_default())
        .collect();
    let scores = m.pieces.iter().map(|p| p.score.unwrap_or(0.0)).collect();
    let types = m.pieces.iter().map(|p| p.r#type.unwrap_or(1)).collect();
    let id = |i: Option<i32>, default: i32| {
        let i = i.unwrap_or(default);
        (i >= 0).then_some(i as u32)
    };
    let (bos, eos, pad) = (id(t.bos_id, 1), id(t.eos_id, 2), id(t.pad_id, -1));
    for (what, i) in [("bos_id", bos), ("eos_id", eos), ("pad_id", pad)] {
        if i.is_some_and(|i| i as usize >= tokens.len()) {
            return Err(err(format!(
                "trainer_spec.{what} {} is past the {} pieces",
                i.unwrap_or(0),
                tokens.len()
            )));
        }
    }
    Ok(SentencePieceModel {
        kind,
        vocab: SpmVocab {
            tokens,
            scores,
            types,
            add_space_prefix: n.add_dummy_prefix.unwrap_or(true),
        },
        bos,
        eos,
        pad,
        byte_fallback: t.byte_fallback.unwrap_or(false),
        unk_surface: t.unk_surface.unwrap_or_else(|| " \u{2047} ".into()),
        remove_extra_whitespaces: n.remove_extra_whitespaces.unwrap_or(true),
        charsmap: n.precompiled_charsmap.filter(|c| !c.is_empty()),
        normalization: n.name.unwrap_or_default(),
    })
}
