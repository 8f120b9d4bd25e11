//! `megatron generate`: sample from a checkpoint with a KV cache.

use crate::arguments::GenerateArgs;
use crate::checkpointing::{load_checkpoint, restore};
use crate::setup::Model;
use crate::TrainError;
use megatron_core::inference::{decode_step, KVCache};
use megatron_core::models::ModelFamily;
use megatron_core::params::Params;
use megatron_data::{build_tokenizer_from, TokenizerSpec};
use megatron_tensor::RngKey;
use std::path::Path;

/// Picks the next id from `logits` (only the first `vocab` entries are real tokens).
pub fn sample_next(
    logits: &[f32],
    vocab: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    key: RngKey,
    step: u64,
) -> u32 {
    let logits = &logits[..vocab];
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let mut idx: Vec<usize> = (0..vocab).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        idx.truncate(top_k);
    }
    let mx = logits[idx[0]];
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - mx) / temperature) as f64).exp())
        .collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let s: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= s);
    }
    let u = key.uniform(step) as f64;
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return idx[i] as u32;
        }
    }
    idx[probs.len() - 1] as u32
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Generates a continuation of `args.prompt`; returns only the new text.
pub fn generate(args: &GenerateArgs) -> Result<String, TrainError> {
    let ck = load_checkpoint(Path::new(&args.load), None)?;
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: ck.meta.tokenizer_type.clone(),
        vocab_file: ck.meta.vocab_file.clone(),
        merge_file: ck.meta.merge_file.clone(),
        tokenizer_model: ck.meta.tokenizer_model.clone(),
        vocab_size: Some(ck.meta.vocab_size),
    })?;
    let mut params = Params::default();
    let mut inits = Vec::new();
    let layers = ck.meta.model.num_layers();
    let model: Model = ck
        .meta
        .model
        .build_chunk(&mut params, &mut inits, 0..layers, true, true);
    params.data = vec![0.0; params.numel()];
    restore(&ck, &mut params, None)?;
    let max_pos = model.config.max_position_embeddings;
    let mut prompt = tok.encode(&args.prompt)?;
    if prompt.is_empty() {
        prompt.push(tok.eod());
    }
    if prompt.len() >= max_pos {
        // Keep the most recent context that leaves room for at least one new token.
        prompt = prompt[prompt.len() - (max_pos - 1)..].to_vec();
    }
    let new_tokens = args.max_new_tokens.min(max_pos - prompt.len());
    let mut cache = KVCache::new(&model, 1, prompt.len() + new_tokens);
    let temperature = if args.greedy { 0.0 } else { args.temperature };
    let key = RngKey::new(args.seed).fold(0x6E6);
    let mut logits = None;
    for &p in &prompt {
        logits = Some(decode_step(&model, &params, &mut cache, &[p]));
    }
    let mut out = Vec::new();
    for step in 0..new_tokens {
        let l = logits.take().expect("prompt is never empty");
        let next = sample_next(
            l.data(),
            tok.vocab_size(),
            temperature,
            args.top_k,
            args.top_p,
            key,
            step as u64,
        );
        if next == tok.eod() {
            break;
        }
        out.push(next);
        if step + 1 < new_tokens {
            logits = Some(decode_step(&model, &params, &mut cache, &[next]));
        }
    }
    Ok(tok.decode(&out))
}
