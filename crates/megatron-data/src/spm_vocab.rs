//! SentencePiece vocabularies, llama.cpp's `tokenizer.ggml.model = "llama"` (Llama 1 and 2,
//! Mistral 7B v0.1, TinyLlama, CodeLlama), as a Hugging Face `tokenizer.json` and back.
//!
//! llama.cpp tokenizes such a vocabulary its own way: a space is put in front of the text (and
//! after every special token) when `add_space_prefix` holds, spaces become `▁`, then adjacent
//! symbols whose concatenation is a token merge, highest token score first (leftmost among
//! equals), and what is left unmerged falls back to `<0xXX>` byte tokens. The same result in a
//! `tokenizers` BPE model: the `Prepend("▁")` + `Replace(" ", "▁")` normalizer (the one Hugging
//! Face's Llama tokenizers use, applied per piece between special tokens, as llama.cpp's
//! prefix is), no pre-tokenizer, byte fallback, and a merge for every split of every token into
//! two tokens, ranked by the merged token's score. Written by hand: no crate maps between the
//! two (transformers' converter writes a Metaspace pre-tokenizer that prepends only at the
//! start of the text, and llama.cpp's own converter, given only a tokenizer.json, writes every
//! score as -1000, which makes its merges run left to right).
//!
//! llama.cpp's algorithm is the sentencepiece library's BPE encoding, restated, so this
//! `tokenizer.json` is also what `convert --to hf` writes for a `tokenizer.model`: the same ids
//! as sentencepiece but where the model has user-defined pieces (an added token in `tokenizers`
//! takes the `▁` before it). Megatron's sentencepiece tokenizers encode with `sentencepiece_encoder.rs`,
//! which keeps them as sentencepiece does.

use serde_json::{json, Value};
use std::collections::HashMap;

/// llama.cpp's token types (`llama_token_type`).
pub const NORMAL: i32 = 1;
pub const UNKNOWN: i32 = 2;
pub const CONTROL: i32 = 3;
pub const USER_DEFINED: i32 = 4;
pub const UNUSED: i32 = 5;
pub const BYTE: i32 = 6;

/// llama.cpp's whitespace symbol.
const SPACE: &str = "\u{2581}";

/// The score given to a token no merge makes (below every merged token's, so llama.cpp merges
/// into it last, as SentencePiece scores its whitespace-only pieces).
const UNMERGED_SCORE: f32 = -1e9;

/// A SentencePiece vocabulary as llama.cpp stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct SpmVocab {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<i32>,
    /// `tokenizer.ggml.add_space_prefix` (llama.cpp's default for this model: true).
    pub add_space_prefix: bool,
}

/// Every split of a token into two tokens, in llama.cpp's merge order: the merged token's score,
/// highest first (then its id, then the split, so the order is total). Unknown, control and
/// byte tokens are never made by merging (control tokens are matched whole in the text).
fn merges(v: &SpmVocab) -> Vec<(usize, &str, &str)> {
    let ids: HashMap<&str, usize> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut m: Vec<(usize, &str, &str)> = Vec::new();
    for (id, t) in v.tokens.iter().enumerate() {
        if matches!(v.types[id], UNKNOWN | CONTROL | BYTE) {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if ids.contains_key(a) && ids.contains_key(b) {
                m.push((id, a, b));
            }
        }
    }
    m.sort_by(|x, y| {
        v.scores[y.0]
            .total_cmp(&v.scores[x.0])
            .then(x.0.cmp(&y.0))
            .then(x.1.len().cmp(&y.1.len()))
    });
    m
}

/// The vocabulary as a Hugging Face `tokenizer.json` that tokenizes as llama.cpp does (see the
/// module documentation); `bos`/`eos` with their add flags make its post-processor (what
/// `AutoTokenizer` adds; megatron-rs encodes without it).
pub fn tokenizer_json(
    v: &SpmVocab,
    bos: Option<(usize, bool)>,
    eos: Option<(usize, bool)>,
) -> Value {
    let vocab: serde_json::Map<String, Value> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let merges: Vec<Value> = merges(v)
        .into_iter()
        .map(|(_, a, b)| json!([a, b]))
        .collect();
    let added: Vec<Value> = v
        .tokens
        .iter()
        .zip(&v.types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(**ty, UNKNOWN | CONTROL | USER_DEFINED))
        .map(|(i, (t, ty))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": *ty != USER_DEFINED})
        })
        .collect();
    let unk = v.types.iter().position(|&t| t == UNKNOWN);
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE});
    let normalizer = if v.add_space_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]})
    } else {
        replace
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if v.add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": post_processor(v, bos, eos),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk.map(|i| v.tokens[i].clone()),
                  "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                  "byte_fallback": v.types.contains(&BYTE), "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    })
}

/// Hugging Face's Llama template: BOS (and EOS) around each sequence where the GGUF adds them.
fn post_processor(v: &SpmVocab, bos: Option<(usize, bool)>, eos: Option<(usize, bool)>) -> Value {
    let added = |s: Option<(usize, bool)>| s.filter(|&(id, add)| add && id < v.tokens.len());
    let (bos, eos) = (added(bos), added(eos));
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let sequence = |name: &str, type_id: u32| {
        let special = |(id, _): (usize, bool)| json!({"SpecialToken": {"id": v.tokens[id], "type_id": type_id}});
        let mut s: Vec<Value> = bos.map(special).into_iter().collect();
        s.push(json!({"Sequence": {"id": name, "type_id": type_id}}));
        s.extend(eos.map(special));
        s
    };
    let single = sequence("A", 0);
    let mut pair = sequence("A", 0);
    pair.extend(sequence("B", 1));
    let mut tokens = serde_json::Map::new();
    for (id, _) in [bos, eos].into_iter().flatten() {
        let t = &v.tokens[id];
        tokens.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": tokens})
}

/// The SentencePiece vocabulary of a `tokenizer.json` in the form above (Hugging Face's own
/// Llama tokenizers: a byte-fallback BPE with the `▁` normalizer, or a non-splitting Metaspace
/// pre-tokenizer), with llama.cpp's scores derived from the merge ranks: a token scores minus
/// the rank of the first merge that makes it, so llama.cpp merges in the file's order. `None`
/// for a tokenizer of another kind; an error where llama.cpp would tokenize differently.
pub fn of_tokenizer_json(t: &Value, path: &str) -> Result<Option<SpmVocab>, String> {
    let model = &t["model"];
    if model["type"].as_str() != Some("BPE") || model["byte_fallback"].as_bool() != Some(true) {
        return Ok(None);
    }
    let add_space_prefix = match (&t["normalizer"], &t["pre_tokenizer"]) {
        (n, Value::Null) if is_space_replace(n) => false,
        (n, Value::Null)
            if n["type"] == "Sequence"
                && n["normalizers"].as_array().is_some_and(|s| {
                    s.len() == 2
                        && s[0]["type"] == "Prepend"
                        && s[0]["prepend"] == SPACE
                        && is_space_replace(&s[1])
                }) =>
        {
            true
        }
        (Value::Null, p) if p["type"] == "Metaspace" && p["replacement"] == SPACE => {
            if p["split"].as_bool() == Some(true) {
                return Err(format!(
                    "{path}: a Metaspace pre-tokenizer that splits on spaces: llama.cpp merges across them"
                ));
            }
            // transformers' non-legacy Llama tokenizers. Metaspace prepends only where the text
            // (or, "always", a piece between special tokens) does not begin with a space
            // already, and "first" only at the start of the text; llama.cpp prepends always,
            // as the sentencepiece library does. Accepted as llama.cpp's own converter accepts
            // it: the same ids but for text that begins with a space or follows a special token.
            p["prepend_scheme"].as_str() != Some("never")
        }
        (n, p) => {
            return Err(format!(
                "{path}: a byte-fallback BPE with normalizer {n} and pre-tokenizer {p}: llama.cpp's SentencePiece tokenizer prepends and replaces spaces with {SPACE} and splits nothing"
            ))
        }
    };
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| format!("{path}: no model.vocab"))?;
    let mut by_id: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: usize, tok: &str, ty: i32| {
        if by_id.len() <= id {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((tok.to_string(), ty));
    };
    let unk = model["unk_token"].as_str();
    for (tok, id) in vocab {
        let ty = if Some(tok.as_str()) == unk {
            UNKNOWN
        } else if is_byte_token(tok) {
            BYTE
        } else {
            NORMAL
        };
        put(id.as_u64().unwrap_or(0) as usize, tok, ty);
    }
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        let content = a["content"].as_str().unwrap_or("");
        let ty = match a["special"].as_bool() {
            _ if Some(content) == unk => UNKNOWN,
            Some(true) => CONTROL,
            _ => USER_DEFINED,
        };
        put(a["id"].as_u64().unwrap_or(0) as usize, content, ty);
    }
    let (tokens, types): (Vec<String>, Vec<i32>) = by_id
        .into_iter()
        .enumerate()
        .map(|(i, e)| e.unwrap_or((format!("[PAD{i}]"), UNUSED)))
        .unzip();
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut first_rank: Vec<Option<usize>> = vec![None; tokens.len()];
    let mut listed = std::collections::HashSet::new();
    for (rank, m) in model["merges"].as_array().into_iter().flatten().enumerate() {
        let (a, b) = match m {
            Value::Array(p) if p.len() == 2 => (p[0].as_str(), p[1].as_str()),
            Value::String(s) => match s.split_once(' ') {
                Some((a, b)) => (Some(a), Some(b)),
                None => (None, None),
            },
            _ => (None, None),
        };
        let (Some(a), Some(b)) = (a, b) else {
            return Err(format!("{path}: merge {rank} is {m}, not a pair of tokens"));
        };
        let merged = format!("{a}{b}");
        let id = *ids.get(merged.as_str()).ok_or_else(|| {
            format!("{path}: merge {rank} ({a} {b}) makes {merged}, which is no token")
        })?;
        first_rank[id].get_or_insert(rank);
        listed.insert((a.to_string(), b.to_string()));
    }
    // llama.cpp merges any two adjacent tokens that make a token; a split the file does not
    // list would merge there and not here (a token no merge makes included).
    for (id, t) in tokens.iter().enumerate() {
        if matches!(types[id], UNKNOWN | CONTROL | BYTE) {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(at);
            if ids.contains_key(a)
                && ids.contains_key(b)
                && !listed.contains(&(a.to_string(), b.to_string()))
            {
                return Err(format!(
                    "{path}: token {id} ({t}) is made by merging {a} and {b} in llama.cpp, a merge the file does not list; llama.cpp would tokenize differently"
                ));
            }
        }
    }
    let scores = first_rank
        .iter()
        .zip(&tokens)
        .map(|(r, t)| match r {
            Some(r) => -(*r as f32),
            None if t.chars().count() > 1 => UNMERGED_SCORE,
            None => 0.0,
        })
        .collect();
    Ok(Some(SpmVocab {
        tokens,
        scores,
        types,
        add_space_prefix,
    }))
}

/// `Replace(" " → "▁")`.
fn is_space_replace(n: &Value) -> bool {
    n["type"] == "Replace" && n["pattern"]["String"] == " " && n["content"] == SPACE
}

/// `<0xXX>`: SentencePiece's byte-fallback tokens.
fn is_byte_token(t: &str) -> bool {
    t.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
}
