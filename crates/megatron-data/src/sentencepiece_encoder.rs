//! The sentencepiece library's encoding (`bpe_model.cc`, `unigram_model.cc`'s
//! `EncodeOptimized`, `normalizer.cc` and the byte fallback of
//! `sentencepiece_processor.cc`), which Megatron's `Llama2Tokenizer` and
//! `GPTSentencePieceTokenizer` call. Written by hand: no Rust crate encodes a sentencepiece model
//! as the library does, and a `tokenizers` BPE built from the pieces (`spm_vocab.rs`) matches it
//! only without user-defined pieces (sentencepiece keeps each whole, frozen, where it occurs; an
//! added token in `tokenizers` also takes the `▁` before it).
//!
//! The text is normalized by the model's rules (`precompiled_charsmap.rs`), gets `▁` in front
//! (the dummy prefix) and for every space (runs of spaces made one
//! and spaces at the ends dropped where the model says `remove_extra_whitespaces`);
//! user-defined pieces are
//! cut out first (the longest at each position); then adjacent symbols whose concatenation is a
//! piece merge, highest score first (the leftmost among equals); a merged piece of type UNUSED
//! is split back into what made it; what is no piece becomes `<0xXX>` byte pieces (or one
//! unknown id per run, without byte fallback).

use crate::precompiled_charsmap::PrecompiledCharsmap;
use crate::sentencepiece_model::{SentencePieceKind, SentencePieceModel};
use crate::spm_vocab::{SpmVocab, BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED};
use rustc_hash::FxHashMap as HashMap;
use std::collections::BinaryHeap;

const SPACE: char = '\u{2581}';

pub struct SentencePieceEncoder {
    /// Pieces merging can make (sentencepiece's `pieces_`: normal, user-defined, unused).
    pieces: HashMap<String, u32>,
    /// Control, unknown and byte pieces (`reserved_id_map_`): named only as a whole symbol.
    reserved: HashMap<String, u32>,
    scores: Vec<f32>,
    types: Vec<i32>,
    /// User-defined pieces by their first character, longest first (a model may have
    /// thousands; each position looks only at those that can start there).
    user_defined: HashMap<char, Vec<String>>,
    bytes: Option<[u32; 256]>,
    unk: u32,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    charsmap: Option<PrecompiledCharsmap>,
    unigram: Option<Unigram>,
}

/// What a unigram model's best path needs besides the pieces.
struct Unigram {
    /// The unknown node's score: the lowest normal piece's, less sentencepiece's penalty of 10.
    unk_score: f32,
    /// The highest normal piece's score (at least `f32::MIN_POSITIVE`, as sentencepiece starts
    /// from `FLT_MIN`): a user-defined piece scores `bytes * max_score - 0.1`.
    max_score: f32,
    /// The longest piece, in bytes.
    max_len: usize,
}

/// A candidate merge, ordered by one integer: higher score first, then the leftmost (the
/// score's bits made order-preserving above the inverted left index), so the heap compares
/// 16-byte entries with one `u64` comparison.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Bigram {
    key: u64,
    right: u32,
    len: u32,
}

impl Bigram {
    fn new(score: f32, left: usize, right: usize, len: usize) -> Self {
        let b = score.to_bits();
        let ordered = if b >> 31 == 1 { !b } else { b | 1 << 31 };
        Bigram {
            key: (ordered as u64) << 32 | (u32::MAX - left as u32) as u64,
            right: right as u32,
            len: len as u32,
        }
    }

    fn left(&self) -> usize {
        (u32::MAX - self.key as u32) as usize
    }
}

/// A symbol: a byte range of the normalized text, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
    frozen: bool,
}

impl SentencePieceEncoder {
    /// The model's vocabulary and normalization; an error for a model without an unknown
    /// piece (sentencepiece requires one) or with a malformed charsmap.
    pub fn new(v: &SpmVocab, m: &SentencePieceModel) -> Result<Self, String> {
        let unk =
            v.types
                .iter()
                .position(|&t| t == UNKNOWN)
                .ok_or("no unknown piece (every sentencepiece model has one)")? as u32;
        let charsmap = match &m.charsmap {
            Some(blob) => Some(PrecompiledCharsmap::parse(blob)?),
            None => None,
        };
        let (mut pieces, mut reserved) = (HashMap::default(), HashMap::default());
        let mut user_defined: HashMap<char, Vec<String>> = HashMap::default();
        for (i, (t, &ty)) in v.tokens.iter().zip(&v.types).enumerate() {
            let map = if matches!(ty, CONTROL | UNKNOWN | BYTE) {
                &mut reserved
            } else {
                &mut pieces
            };
            map.entry(t.clone()).or_insert(i as u32);
            if let (USER_DEFINED, Some(c)) = (ty, t.chars().next()) {
                user_defined.entry(c).or_default().push(t.clone());
            }
        }
        for pieces in user_defined.values_mut() {
            pieces.sort_by_key(|p| std::cmp::Reverse(p.len()));
        }
        let bytes = m.byte_fallback.then(|| {
            let mut b = [unk; 256];
            for (x, id) in b.iter_mut().enumerate() {
                if let Some(&i) = reserved.get(&format!("<0x{x:02X}>")) {
                    *id = i;
                }
            }
            b
        });
        let unigram = (m.kind == SentencePieceKind::Unigram).then(|| {
            let normal = || {
                v.types
                    .iter()
                    .zip(&v.scores)
                    .filter(|(&t, _)| t == NORMAL)
                    .map(|(_, &s)| s)
            };
            Unigram {
                unk_score: normal().fold(f32::MAX, f32::min) - 10.0,
                max_score: normal().fold(f32::MIN_POSITIVE, f32::max),
                max_len: pieces.keys().map(String::len).max().unwrap_or(1),
            }
        });
        Ok(SentencePieceEncoder {
            pieces,
            reserved,
            scores: v.scores.clone(),
            types: v.types.clone(),
            user_defined,
            bytes,
            unk,
            add_dummy_prefix: v.add_space_prefix,
            remove_extra_whitespaces: m.remove_extra_whitespaces,
            charsmap,
            unigram,
        })
    }

    /// One unit of the text as sentencepiece's `NormalizePrefix` takes it: a user-defined
    /// piece as it is, else the longest charsmap rule's replacement, else one character; and
    /// the bytes it consumes.
    fn normalize_prefix<'a>(&'a self, text: &'a str) -> (&'a str, usize) {
        if let Some(n) = self.user_defined_at(text) {
            return (&text[..n], n);
        }
        if let Some((n, replacement)) = self.charsmap.as_ref().and_then(|c| c.longest_prefix(text))
        {
            return (replacement, n);
        }
        let n = text.chars().next().map_or(1, char::len_utf8);
        (&text[..n], n)
    }

    /// sentencepiece's `Normalizer::Normalize`: each unit normalized (`normalize_prefix`),
    /// spaces become `▁`, with the dummy prefix in front; with `remove_extra_whitespaces`,
    /// spaces at the start and end are dropped and a run of them is one. Empty when nothing is
    /// left.
    fn normalize(&self, text: &str) -> String {
        let mut rest = text;
        if self.remove_extra_whitespaces {
            while !rest.is_empty() {
                let (unit, n) = self.normalize_prefix(rest);
                if unit != " " {
                    break;
                }
                rest = &rest[n..];
            }
        }
        let mut s = String::with_capacity(3 * rest.len() + 3);
        if rest.is_empty() {
            return s;
        }
        if self.add_dummy_prefix {
            s.push(SPACE);
        }
        let mut prev_space = self.remove_extra_whitespaces;
        while !rest.is_empty() {
            let (mut unit, n) = self.normalize_prefix(rest);
            rest = &rest[n..];
            if prev_space {
                unit = unit.trim_start_matches(' ');
            }
            if !unit.is_empty() {
                s.extend(unit.chars().map(|c| if c == ' ' { SPACE } else { c }));
                prev_space = self.remove_extra_whitespaces && unit.ends_with(' ');
            }
        }
        if self.remove_extra_whitespaces {
            let kept = s.trim_end_matches(SPACE).len();
            s.truncate(kept);
        }
        s
    }

    /// The length of the longest user-defined piece at the start of `text`.
    fn user_defined_at(&self, text: &str) -> Option<usize> {
        let c = text.chars().next()?;
        let pieces = self.user_defined.get(&c)?;
        pieces
            .iter()
            .find(|p| text.starts_with(p.as_str()))
            .map(String::len)
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        let s = self.normalize(text);
        if s.is_empty() {
            return Vec::new();
        }
        if let Some(u) = &self.unigram {
            return self.encode_unigram(&s, u);
        }
        let mut sym = self.symbols(&s);
        let mut queue = BinaryHeap::new();
        // Merged unused pieces and what made them (sentencepiece's `rev_merge`).
        let mut rev_merge: HashMap<&str, (usize, usize, usize)> = HashMap::default();
        let mut add =
            |sym: &[Symbol], l: Option<usize>, r: Option<usize>, q: &mut BinaryHeap<Bigram>| {
                let (Some(l), Some(r)) = (l, r) else { return };
                if sym[l].frozen || sym[r].frozen {
                    return;
                }
                let piece = &s[sym[l].start..sym[r].start + sym[r].len];
                if let Some(&id) = self.pieces.get(piece) {
                    q.push(Bigram::new(self.scores[id as usize], l, r, piece.len()));
                    if self.types[id as usize] == UNUSED {
                        rev_merge.insert(piece, (sym[l].start, sym[l].len, sym[r].len));
                    }
                }
            };
        for i in 1..sym.len() {
            add(&sym, Some(i - 1), Some(i), &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (li, ri) = (b.left(), b.right as usize);
            let (l, r) = (sym[li], sym[ri]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len as usize {
                continue;
            }
            sym[li].len += r.len;
            sym[li].next = r.next;
            sym[ri].len = 0;
            if let Some(n) = r.next {
                sym[n].prev = Some(li);
            }
            add(&sym, sym[li].prev, Some(li), &mut queue);
            add(&sym, Some(li), sym[li].next, &mut queue);
        }
        let mut out = Vec::new();
        let mut prev_unk = false;
        let mut at = (!sym.is_empty()).then_some(0);
        while let Some(i) = at {
            self.resegment(
                &s,
                (sym[i].start, sym[i].len),
                &rev_merge,
                &mut out,
                &mut prev_unk,
            );
            at = sym[i].next;
        }
        out
    }

    /// sentencepiece's `EncodeOptimized`: the best-scoring path of pieces, found position by
    /// position (for each character start, every piece that starts there, shortest first, then
    /// an unknown node where no one-character piece does; a later candidate replaces an
    /// earlier only when it scores strictly higher), then unknown runs as in BPE.
    fn encode_unigram(&self, s: &str, u: &Unigram) -> Vec<u32> {
        // For each byte end: (score, start, id) of the best path ending there.
        let mut best: Vec<Option<(f32, usize, u32)>> = vec![None; s.len() + 1];
        best[0] = Some((0.0, 0, u32::MAX));
        let offer = |best: &mut [Option<(f32, usize, u32)>], end: usize, score, start, id| {
            if best[end].is_none_or(|(b, _, _)| score > b) {
                best[end] = Some((score, start, id));
            }
        };
        for (start, c) in s.char_indices() {
            let here = best[start].map_or(0.0, |b| b.0);
            let mut single = false;
            let limit = (start + u.max_len).min(s.len());
            for end in (start + 1..=limit).filter(|&e| s.is_char_boundary(e)) {
                let Some(&id) = self.pieces.get(&s[start..end]) else {
                    continue;
                };
                if self.types[id as usize] == UNUSED {
                    continue;
                }
                let len = end - start;
                let score = if self.types[id as usize] == USER_DEFINED {
                    len as f32 * u.max_score - 0.1
                } else {
                    self.scores[id as usize]
                };
                offer(&mut best, end, here + score, start, id);
                single |= len == c.len_utf8();
            }
            if !single {
                offer(
                    &mut best,
                    start + c.len_utf8(),
                    here + u.unk_score,
                    start,
                    self.unk,
                );
            }
        }
        let mut path = Vec::new();
        let mut end = s.len();
        while end > 0 {
            let (_, start, id) = best[end].expect("every character ends a path");
            path.push((start, end, id));
            end = start;
        }
        let mut out = Vec::new();
        let mut prev_unk = false;
        for &(start, end, id) in path.iter().rev() {
            if id != self.unk {
                out.push(id);
                prev_unk = false;
                continue;
            }
            self.unknown(&s[start..end], &mut out, &mut prev_unk);
        }
        out
    }

    /// The text as symbols: user-defined pieces whole and frozen, other characters one each.
    fn symbols(&self, s: &str) -> Vec<Symbol> {
        let mut sym = Vec::new();
        let mut at = 0;
        while at < s.len() {
            let rest = &s[at..];
            let len = self.user_defined_at(rest).map_or_else(
                || (rest.chars().next().map_or(1, char::len_utf8), false),
                |n| (n, true),
            );
            let n = sym.len();
            sym.push(Symbol {
                start: at,
                len: len.0,
                prev: n.checked_sub(1),
                next: Some(n + 1),
                frozen: len.1,
            });
            at += len.0;
        }
        if let Some(last) = sym.last_mut() {
            last.next = None;
        }
        sym
    }

    /// The id of a piece given by its text (sentencepiece's `PieceToId`, without its fallback
    /// to the unknown id).
    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        self.reserved
            .get(piece)
            .or_else(|| self.pieces.get(piece))
            .copied()
    }

    /// A final symbol's ids: its piece, an unused piece split back, or its bytes.
    fn resegment(
        &self,
        s: &str,
        (start, len): (usize, usize),
        rev_merge: &HashMap<&str, (usize, usize, usize)>,
        out: &mut Vec<u32>,
        prev_unk: &mut bool,
    ) {
        let piece = &s[start..start + len];
        let id = self.piece_id(piece);
        if let Some(id) = id {
            if self.types[id as usize] == UNUSED {
                if let Some(&(l, ll, rl)) = rev_merge.get(piece) {
                    self.resegment(s, (l, ll), rev_merge, out, prev_unk);
                    self.resegment(s, (l + ll, rl), rev_merge, out, prev_unk);
                    return;
                }
            }
            if id != self.unk {
                out.push(id);
                *prev_unk = false;
                return;
            }
        }
        self.unknown(piece, out, prev_unk);
    }

    /// Text no piece covers: its bytes as `<0xXX>` pieces, or, without byte fallback, one
    /// unknown id per run (sentencepiece merges runs of unknown pieces).
    fn unknown(&self, piece: &str, out: &mut Vec<u32>, prev_unk: &mut bool) {
        match &self.bytes {
            Some(b) => {
                out.extend(piece.bytes().map(|x| b[x as usize]));
                *prev_unk = false;
            }
            None => {
                if !*prev_unk {
                    out.push(self.unk);
                }
                *prev_unk = true;
            }
        }
    }
}
