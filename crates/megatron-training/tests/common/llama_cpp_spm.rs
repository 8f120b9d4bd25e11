//! llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm` in `src/llama-vocab.cpp`), restated
//! for tests: it tokenizes a vocabulary's tokens, scores and types as llama.cpp does, so a test
//! can check that a vocabulary we write tokenizes as the one llama.cpp was run on. It is itself
//! checked against `llama-tokenize`'s ids on the fixture (`convert_gguf_spm.rs`).

use std::collections::{BinaryHeap, HashMap};

const CONTROL: i32 = 3;
const UNKNOWN: i32 = 2;
const USER_DEFINED: i32 = 4;

pub struct LlamaCppSpm<'a> {
    ids: HashMap<&'a str, usize>,
    scores: &'a [f32],
    /// Control, unknown and user-defined tokens, longest first: matched whole in the text.
    special: Vec<(&'a str, usize)>,
    add_space_prefix: bool,
}

/// A candidate merge: the merged token's score, then the leftmost first.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// A symbol of the text being merged: a byte range, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl<'a> LlamaCppSpm<'a> {
    pub fn new(
        tokens: &'a [String],
        scores: &'a [f32],
        types: &[i32],
        add_space_prefix: bool,
    ) -> Self {
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        let mut special: Vec<(&str, usize)> = tokens
            .iter()
            .enumerate()
            .filter(|(i, t)| matches!(types[*i], CONTROL | UNKNOWN | USER_DEFINED) && !t.is_empty())
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        special.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        LlamaCppSpm {
            ids,
            scores,
            special,
            add_space_prefix,
        }
    }

    /// `llama-tokenize --no-bos` with special tokens parsed.
    pub fn tokenize(&self, text: &str) -> Vec<usize> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest special token in the text (the longest at a position).
            let hit = (0..rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .find_map(|i| {
                    self.special
                        .iter()
                        .find(|(t, _)| rest[i..].starts_with(t))
                        .map(|&(t, id)| (i, t.len(), id))
                });
            let (piece, after) = match hit {
                Some((at, len, id)) => (&rest[..at], Some((id, &rest[at + len..]))),
                None => (rest, None),
            };
            // Text comes first or after a special token: llama.cpp prefixes every piece.
            if !piece.is_empty() {
                let prefix = if self.add_space_prefix { " " } else { "" };
                let text = format!("{prefix}{piece}").replace(' ', "\u{2581}");
                self.tokenize_piece(&text, &mut out);
            }
            match after {
                Some((id, tail)) => {
                    out.push(id);
                    rest = tail;
                }
                None => break,
            }
        }
        out
    }

    fn tokenize_piece(&self, text: &str, out: &mut Vec<usize>) {
        let mut sym: Vec<Symbol> = text
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            })
            .collect();
        if let Some(last) = sym.last_mut() {
            last.next = None;
        }
        let mut queue = BinaryHeap::new();
        let try_add = |sym: &[Symbol],
                       left: Option<usize>,
                       right: Option<usize>,
                       q: &mut BinaryHeap<Bigram>| {
            let (Some(l), Some(r)) = (left, right) else {
                return;
            };
            let s = &text[sym[l].start..sym[r].start + sym[r].len];
            if let Some(&id) = self.ids.get(s) {
                q.push(Bigram {
                    score: self.scores[id],
                    left: l,
                    right: r,
                    size: s.len(),
                });
            }
        };
        for i in 1..sym.len() {
            try_add(&sym, Some(i - 1), Some(i), &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (sym[b.left], sym[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            sym[b.left].len += r.len;
            sym[b.left].next = r.next;
            sym[b.right].len = 0;
            if let Some(n) = r.next {
                sym[n].prev = Some(b.left);
            }
            try_add(&sym, sym[b.left].prev, Some(b.left), &mut queue);
            try_add(&sym, Some(b.left), sym[b.left].next, &mut queue);
        }
        // What is left, by its text; a symbol that is no token goes as its bytes (a merged one
        // always is a token, so llama.cpp's `rev_merge` never applies).
        let mut i = if sym.is_empty() { None } else { Some(0) };
        while let Some(at) = i {
            let s = &text[sym[at].start..sym[at].start + sym[at].len];
            match self.ids.get(s) {
                Some(&id) => out.push(id),
                None => out.extend(s.bytes().map(|b| self.ids[format!("<0x{b:02X}>").as_str()])),
            }
            i = sym[at].next;
        }
    }
}
