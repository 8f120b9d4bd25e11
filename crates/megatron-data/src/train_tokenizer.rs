//! `megatron train-tokenizer`: a byte-level BPE (GPT-2 style: byte-level pre-tokenizer without a
//! prefix space, byte-level decoder) trained with the `tokenizers` crate, written as
//! `tokenizer.json` plus GPT-2 `vocab.json` / `merges.txt`.

use crate::DataError;
use std::path::Path;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Model, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder};

#[derive(Clone, Debug)]
pub struct TrainTokenizerConfig {
    /// Plain text files, JSON-lines files (`.json`/`.jsonl`, key `json_key`) or directories.
    pub input: Vec<String>,
    pub json_key: String,
    pub vocab_size: usize,
    pub min_frequency: u64,
    pub special_tokens: Vec<String>,
    pub output_dir: String,
}

fn err(path: &str, e: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer {
        path: path.to_string(),
        msg: e.to_string(),
    }
}

/// Yields the training texts: whole plain-text files, or the `json_key` of each JSON line.
fn texts(cfg: &TrainTokenizerConfig) -> Result<Vec<String>, DataError> {
    let files = crate::inputs::expand_inputs(&cfg.input, crate::inputs::TEXT_AND_JSON, "--input")?;
    let mut out = Vec::new();
    for f in files {
        let name = f.display().to_string();
        let text = std::fs::read_to_string(&f).map_err(|e| err(&name, e))?;
        if matches!(
            f.extension().and_then(|e| e.to_str()),
            Some("json" | "jsonl")
        ) {
            for (n, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                    err(&format!("{name}:{}", n + 1), format!("malformed JSON: {e}"))
                })?;
                match v.get(&cfg.json_key).and_then(|t| t.as_str()) {
                    Some(t) => out.push(t.to_string()),
                    None => {
                        return Err(err(
                            &format!("{name}:{}", n + 1),
                            format!("missing string key '{}'", cfg.json_key),
                        ))
                    }
                }
            }
        } else {
            out.push(text);
        }
    }
    Ok(out)
}

pub fn train_tokenizer(cfg: &TrainTokenizerConfig) -> Result<(), DataError> {
    if cfg.vocab_size < 256 + cfg.special_tokens.len() {
        return Err(err(
            "--vocab-size",
            format!(
                "{} is below the 256 byte tokens plus {} special tokens",
                cfg.vocab_size,
                cfg.special_tokens.len()
            ),
        ));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(cfg.vocab_size)
        .min_frequency(cfg.min_frequency)
        .show_progress(false)
        .special_tokens(
            cfg.special_tokens
                .iter()
                .map(|t| AddedToken::from(t.clone(), true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        ByteLevel,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
    .with_decoder(Some(ByteLevel::default()))
    .build()
    .map_err(|e| err("tokenizer", e))?;
    let texts = texts(cfg)?;
    tok.train(&mut trainer, texts.iter())
        .map_err(|e| err("training", e))?;
    let dir = Path::new(&cfg.output_dir);
    std::fs::create_dir_all(dir).map_err(|e| err(&cfg.output_dir, e))?;
    let json = dir.join("tokenizer.json");
    tok.save(&json, true)
        .map_err(|e| err(&json.display().to_string(), e))?;
    tok.get_model()
        .save(dir, None)
        .map_err(|e| err(&cfg.output_dir, e))?;
    Ok(())
}
