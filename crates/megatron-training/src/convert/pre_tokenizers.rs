//! llama.cpp's byte-level pre-tokenizers (`tokenizer.ggml.pre`) as Hugging Face `tokenizer.json`
//! pre-tokenizers, both ways. llama.cpp splits text with a list of regexes per name
//! (`llama-vocab.cpp`), each splitting the pieces of the one before; a tokenizer.json says the
//! same with a `Sequence` of isolating `Split`s before a `ByteLevel` that splits no more, or with
//! `ByteLevel`'s own GPT-2 split last. The patterns are the tokenizer.json originals llama.cpp
//! cites for Llama 3 and Qwen2 (transformers' GGUF loader uses the same), GPT-2's, and llama.cpp's
//! own list for a file that names no pre-tokenizer. A name not here is refused on import rather
//! than read as GPT-2's split, and a tokenizer.json whose split is not here is refused on export.

use serde_json::{json, Value};

/// `ByteLevel`'s own split (`use_regex: true`), the GPT-2 pattern.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const DIGIT: &str = r"\p{N}";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One of llama.cpp's pre-tokenizers: the names that select it (the first is written on
/// export), its splits in order, and whether BPE takes a whole word found in the vocabulary
/// before merging (llama.cpp's `ignore_merges`, tokenizer.json's `model.ignore_merges`).
struct PreTokenizer {
    names: &'static [&'static str],
    splits: &'static [&'static str],
    ignore_merges: bool,
}

/// Every name llama.cpp gives a pre-tokenizer built here.
pub fn llama_cpp_pre_names() -> impl Iterator<Item = &'static str> {
    PRE_TOKENIZERS.iter().flat_map(|p| p.names).copied()
}

const PRE_TOKENIZERS: &[PreTokenizer] = &[
    PreTokenizer {
        names: &["gpt-2", "phi-2"],
        splits: &[GPT2],
        ignore_merges: false,
    },
    PreTokenizer {
        names: &["smollm"],
        splits: &[DIGIT, GPT2],
        ignore_merges: false,
    },
    PreTokenizer {
        names: &["qwen2", "deepseek-r1-qwen"],
        splits: &[QWEN2],
        ignore_merges: false,
    },
    PreTokenizer {
        names: &["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"],
        splits: &[LLAMA3],
        ignore_merges: true,
    },
    PreTokenizer {
        names: &["default"],
        splits: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
        ignore_merges: false,
    },
];

/// The tokenizer.json `pre_tokenizer` and `model.ignore_merges` of llama.cpp's pre-tokenizer
/// `name`.
pub fn pre_tokenizer_json(name: &str) -> Result<(Value, bool), String> {
    let p = PRE_TOKENIZERS
        .iter()
        .find(|p| p.names.contains(&name))
        .ok_or_else(|| {
            let known: Vec<&str> = llama_cpp_pre_names().collect();
            format!(
                "tokenizer.ggml.pre '{name}': this pre-tokenizer is not built (known: {}); reading it as another would split text differently from llama.cpp",
                known.join(", ")
            )
        })?;
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |r: &str| {
        if r == DIGIT {
            json!({"type": "Digits", "individual_digits": true})
        } else {
            json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false})
        }
    };
    let value = match p.splits {
        [GPT2] => byte_level(true),
        [before @ .., GPT2] => {
            let mut seq: Vec<Value> = before.iter().map(|r| split(r)).collect();
            seq.push(byte_level(true));
            json!({"type": "Sequence", "pretokenizers": seq})
        }
        all => {
            let mut seq: Vec<Value> = all.iter().map(|r| split(r)).collect();
            seq.push(byte_level(false));
            json!({"type": "Sequence", "pretokenizers": seq})
        }
    };
    Ok((value, p.ignore_merges))
}

/// llama.cpp's name for a tokenizer.json `pre_tokenizer` (with its BPE's `ignore_merges`), if
/// llama.cpp splits text as it does.
pub fn llama_cpp_pre_name(pre: &Value, ignore_merges: bool) -> Option<&'static str> {
    let mut splits: Vec<String> = Vec::new();
    let mut flatten = |v: &Value| -> Option<()> {
        match v["type"].as_str()? {
            "ByteLevel" if v["use_regex"].as_bool().unwrap_or(true) => splits.push(GPT2.into()),
            "ByteLevel" => {}
            "Digits" if v["individual_digits"] == true => splits.push(DIGIT.into()),
            "Split" if v["behavior"] == "Isolated" && v["invert"] != true => {
                splits.push(v["pattern"]["Regex"].as_str()?.to_string())
            }
            _ => return None,
        }
        Some(())
    };
    match pre["type"].as_str()? {
        "Sequence" => {
            let seq = pre["pretokenizers"].as_array()?;
            // ByteLevel maps bytes to other characters: a split after it would see those.
            let last = seq.len().saturating_sub(1);
            if seq[..last].iter().any(|p| p["type"] == "ByteLevel") {
                return None;
            }
            for p in seq {
                flatten(p)?;
            }
        }
        _ => flatten(pre)?,
    }
    PRE_TOKENIZERS
        .iter()
        .find(|p| p.splits == splits.as_slice() && p.ignore_merges == ignore_merges)
        .map(|p| p.names[0])
}
