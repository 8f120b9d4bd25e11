//! Megatron's `SentencePieceTokenizer` (`--tokenizer-type SentencePieceTokenizer
//! --tokenizer-model m.model [--vocab-extra-ids N]`): the `_SentencePieceTokenizer` of Megatron-LM's
//! `megatron/training/tokenizer/tokenizer.py`, which BERT and T5 runs on sentencepiece vocabularies
//! used until the 2025 move to `megatron.core.tokenizers`; the ids of their datasets and the
//! vocabulary size of their checkpoints depend on it.
//!
//! What it adds to the library's ids: named special tokens, each the model's piece of that text
//! where there is one, else appended after the pieces in this order: `<CLS>`, `<SEP>`, `<EOD>`,
//! `<MASK>`, the model's padding, BOS and EOS pieces (`<PAD>`, `<BOS>`, `<EOS>` where the model
//! has none), then `<extra_id_0>`... Their text in the input is cut out before sentencepiece sees
//! it (NeMo's splitting: the leftmost occurrence first, ties to the earlier special), and decoding
//! writes them with a space on each side. Documents end with `<EOD>`.

use crate::sentencepiece_encoder::SentencePieceEncoder;
use crate::sentencepiece_tokenizer::decode_ids;
use crate::spm_vocab::SpmVocab;
use crate::tokenizer::{SpecialToken, Tokenizer};
use crate::DataError;
use std::collections::HashMap;

pub struct MegatronSentencePieceTokenizer {
    encoder: SentencePieceEncoder,
    vocab: SpmVocab,
    unk_surface: String,
    /// Texts of the ids after the model's pieces.
    appended: Vec<String>,
    /// The special tokens in the order Megatron registers them (which breaks ties when two
    /// start at the same place, as `<extra_id_1>` and `<extra_id_10>` do).
    specials: Vec<(String, u32)>,
    special_ids: HashMap<u32, usize>,
    named: [(SpecialToken, u32); 6],
    eod: u32,
}

impl MegatronSentencePieceTokenizer {
    pub fn from_file(path: &str, vocab_extra_ids: usize) -> Result<Self, DataError> {
        let m = crate::sentencepiece_model::load(path)?;
        let encoder =
            SentencePieceEncoder::new(&m.vocab, &m).map_err(|msg| DataError::Tokenizer {
                path: path.to_string(),
                msg,
            })?;
        let mut t = MegatronSentencePieceTokenizer {
            encoder,
            vocab: m.vocab,
            unk_surface: m.unk_surface,
            appended: Vec::new(),
            specials: Vec::new(),
            special_ids: HashMap::new(),
            named: [(SpecialToken::Cls, 0); 6],
            eod: 0,
        };
        let piece = |id: Option<u32>, t: &Self, default: &str| match id {
            Some(i) => t.vocab.tokens[i as usize].clone(),
            None => default.to_string(),
        };
        let (pad, bos, eos) = (
            piece(m.pad, &t, "<PAD>"),
            piece(m.bos, &t, "<BOS>"),
            piece(m.eos, &t, "<EOS>"),
        );
        let cls = t.add_special("<CLS>");
        let sep = t.add_special("<SEP>");
        t.eod = t.add_special("<EOD>");
        let mask = t.add_special("<MASK>");
        let pad = t.add_special(&pad);
        let bos = t.add_special(&bos);
        let eos = t.add_special(&eos);
        use SpecialToken::*;
        t.named = [
            (Cls, cls),
            (Sep, sep),
            (Mask, mask),
            (Pad, pad),
            (Bos, bos),
            (Eos, eos),
        ];
        for i in 0..vocab_extra_ids {
            t.add_special(&format!("<extra_id_{i}>"));
        }
        Ok(t)
    }

    /// Megatron's `_add_special_token`: the piece of that text, else a new id after the rest.
    fn add_special(&mut self, text: &str) -> u32 {
        let id = match self.token_id(text) {
            Some(id) => id,
            None => {
                self.appended.push(text.to_string());
                (self.vocab_size() - 1) as u32
            }
        };
        if !self.specials.iter().any(|(t, _)| t == text) {
            self.special_ids.entry(id).or_insert(self.specials.len());
            self.specials.push((text.to_string(), id));
        }
        id
    }
}

impl Tokenizer for MegatronSentencePieceTokenizer {
    fn name(&self) -> &'static str {
        "SentencePieceTokenizer"
    }
    fn vocab_size(&self) -> usize {
        self.vocab.tokens.len() + self.appended.len()
    }
    /// sentencepiece's ids for the text between special tokens. Each special's next place is
    /// kept and searched again only once the text before it is consumed, so a document costs one
    /// pass per special rather than one per special per occurrence.
    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let mut ids = Vec::new();
        let mut next: Vec<Option<usize>> = self
            .specials
            .iter()
            .map(|(s, _)| text.find(s.as_str()))
            .collect();
        let mut at = 0;
        loop {
            for (k, (s, _)) in self.specials.iter().enumerate() {
                if next[k].is_some_and(|p| p < at) {
                    next[k] = text[at..].find(s.as_str()).map(|p| p + at);
                }
            }
            let Some((k, start)) = next
                .iter()
                .enumerate()
                .filter_map(|(k, p)| p.map(|p| (k, p)))
                .min_by_key(|&(_, p)| p)
            else {
                break;
            };
            ids.extend(self.encoder.encode(&text[at..start]));
            let (s, id) = &self.specials[k];
            ids.push(*id);
            at = start + s.len();
        }
        ids.extend(self.encoder.encode(&text[at..]));
        Ok(ids)
    }
    /// Megatron's `detokenize`: each special token as its text with a space on each side, the
    /// ids between them as sentencepiece decodes them.
    fn decode(&self, ids: &[u32]) -> String {
        let mut text = String::new();
        let mut last = 0;
        for (i, id) in ids.iter().enumerate() {
            if let Some(&k) = self.special_ids.get(id) {
                text += &decode_ids(&self.vocab, &self.unk_surface, &ids[last..i]);
                text += " ";
                text += &self.specials[k].0;
                text += " ";
                last = i + 1;
            }
        }
        text + &decode_ids(&self.vocab, &self.unk_surface, &ids[last..])
    }
    fn decode_without_special(&self, ids: &[u32]) -> String {
        let kept: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| !self.special_ids.contains_key(id))
            .collect();
        decode_ids(&self.vocab, &self.unk_surface, &kept)
    }
    fn eod(&self) -> u32 {
        self.eod
    }
    fn special_id(&self, which: SpecialToken) -> Option<u32> {
        self.named
            .iter()
            .find(|(s, _)| *s == which)
            .map(|&(_, id)| id)
    }
    fn token_id(&self, token: &str) -> Option<u32> {
        self.encoder.piece_id(token).or_else(|| {
            self.appended
                .iter()
                .position(|t| t == token)
                .map(|k| (self.vocab.tokens.len() + k) as u32)
        })
    }
    fn token_text(&self, id: u32) -> Option<String> {
        let n = self.vocab.tokens.len();
        match (id as usize).checked_sub(n) {
            None => self.vocab.tokens.get(id as usize).cloned(),
            Some(k) => self.appended.get(k).cloned(),
        }
    }
}
