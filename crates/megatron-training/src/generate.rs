//! `megatron generate`: sample from a checkpoint with a KV cache.

use crate::arguments::GenerateArgs;
use crate::checkpointing::{load_checkpoint_weights, restore};
use crate::TrainError;
use megatron_core::inference::{decode_step, KVCache};
use megatron_core::models::ModelFamily;
use megatron_core::params::Params;
use megatron_data::{build_tokenizer_from, SpecialToken, Tokenizer};
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
        return megatron_tensor::cpu::reduce::argmax(logits) as u32;
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
    // 0 is Megatron's "off" (`top_p > 0.0` enables the filter), as is 1.
    if top_p > 0.0 && top_p < 1.0 {
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

/// The text `out` adds after `prompt`: the whole sequence decoded, less the prompt's text.
/// Decoded alone, a continuation loses what its first token means after other text (a
/// SentencePiece `▁and` is " and" after a word, "and" at the start of a text).
fn continuation(t: &dyn Tokenizer, prompt: &[u32], out: &[u32]) -> String {
    let before = t.decode(prompt);
    let all = t.decode(&[prompt, out].concat());
    match all.strip_prefix(&before) {
        Some(rest) => rest.to_string(),
        None => t.decode(out),
    }
}

/// The prompt's token ids: `--prompt-ids`, or `--prompt` (in the ChatML template under `--chat`)
/// through the tokenizer.
fn prompt_ids(args: &GenerateArgs, tok: Option<&dyn Tokenizer>) -> Result<Vec<u32>, TrainError> {
    if let Some(ids) = &args.prompt_ids {
        let ids: Vec<u32> = ids
            .split_whitespace()
            .map(|t| {
                t.parse::<u32>()
                    .map_err(|_| TrainError::Args(format!("--prompt-ids: '{t}' is not a token id")))
            })
            .collect::<Result<_, _>>()?;
        if ids.is_empty() {
            return Err(TrainError::Args(
                "--prompt-ids is empty: give at least one token id".into(),
            ));
        }
        return Ok(ids);
    }
    let tok = tok.ok_or_else(|| {
        TrainError::Args("the checkpoint names no tokenizer: give --prompt-ids".into())
    })?;
    let text = if args.chat {
        let mut t = String::new();
        if let Some(sys) = &args.system {
            t.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
        }
        t.push_str(&format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            args.prompt
        ));
        t
    } else {
        args.prompt.clone()
    };
    let mut ids = tok.encode(&text)?;
    if ids.is_empty() {
        ids.push(tok.eod());
    }
    Ok(ids)
}

/// The sampling flags, checked before the checkpoint is read.
fn check_sampling(args: &GenerateArgs) -> Result<(), TrainError> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(TrainError::Args(format!(
            "--temperature must be a non-negative number (0 is greedy), got {}",
            args.temperature
        )));
    }
    if !(0.0..=1.0).contains(&args.top_p) {
        return Err(TrainError::Args(format!(
            "--top-p must be in [0, 1] (0 and 1 filter nothing), got {}",
            args.top_p
        )));
    }
    Ok(())
}

/// Writes the prompt's logits (`[positions, vocab]`) as f32 safetensors.
fn write_logits(path: &Path, rows: &[Vec<f32>]) -> Result<(), TrainError> {
    let vocab = rows.first().map_or(0, |r| r.len());
    let bytes: Vec<u8> = rows
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let view = safetensors::tensor::TensorView::new(
        safetensors::tensor::Dtype::F32,
        vec![rows.len(), vocab],
        &bytes,
    )
    .map_err(|e| TrainError::Args(format!("--logits-out: {e}")))?;
    safetensors::serialize_to_file([("logits", view)], None, path)
        .map_err(|e| TrainError::Args(format!("--logits-out {}: {e}", path.display())))
}

/// Generates a continuation of the prompt; returns the new text (and, with `--print-ids`, a
/// last line of the new token ids).
pub fn generate(args: &GenerateArgs) -> Result<String, TrainError> {
    check_sampling(args)?;
    let ck = load_checkpoint_weights(Path::new(&args.load))?;
    if ck.meta.bert.is_some() {
        return Err(TrainError::Checkpoint {
            path: ck.dir.display().to_string(),
            msg: "a BERT encoder does not generate text (use `megatron embed`)".into(),
        });
    }
    let tok = build_tokenizer_from(&ck.meta.tokenizer_spec());
    // Token ids need no tokenizer.
    let tok = match (tok, &args.prompt_ids) {
        (Ok(t), _) => Some(t),
        (Err(_), Some(_)) => None,
        (Err(e), None) => return Err(e.into()),
    };
    if ck.meta.t5.is_some() {
        return generate_t5(args, tok.as_deref());
    }
    let mut params = Params::default();
    let mut inits = Vec::new();
    let layers = ck.meta.model.num_layers();
    let model: megatron_core::GPTModel =
        ck.meta
            .model
            .build_chunk(&mut params, &mut inits, 0..layers, true, true);
    params.data = vec![0.0; params.numel()];
    restore(&ck, &mut params, None)?;
    crate::checkpointing::restore_buffers(&ck, &model);
    if args.bf16 {
        use megatron_tensor::cpu::matmul::{
            set_bf16_kernel, set_matmul_precision, MatmulPrecision,
        };
        // Rounded once here, so no matmul has to round (or copy) a weight again.
        let rounded: Vec<f32> = params
            .data
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        params.data = rounded;
        set_matmul_precision(MatmulPrecision::BF16);
        set_bf16_kernel(megatron_tensor::cpu::fastest_bf16_kernel());
    }
    let max_pos = model.config.max_position_embeddings;
    let mut prompt = prompt_ids(args, tok.as_deref())?;
    let vocab = ck.meta.vocab_rows_of(tok.as_deref());
    if let Some(bad) = prompt.iter().find(|&&i| i as usize >= vocab) {
        return Err(TrainError::Args(format!(
            "prompt token id {bad} is outside the vocabulary ({vocab})"
        )));
    }
    if prompt.len() >= max_pos {
        // Keep the most recent context that leaves room for at least one new token, and say
        // so: the model never sees the prompt's beginning.
        eprintln!(
            "the prompt's {} tokens are cut to their last {}: the model has {max_pos} positions \
             and generates at least one token",
            prompt.len(),
            max_pos - 1
        );
        prompt = prompt[prompt.len() - (max_pos - 1)..].to_vec();
    }
    let mut stop: Vec<u32> = tok.as_ref().map(|t| t.eod()).into_iter().collect();
    if args.chat {
        stop.extend(tok.as_ref().and_then(|t| t.token_id("<|im_end|>")));
    }
    let new_tokens = args.max_new_tokens.min(max_pos - prompt.len());
    if new_tokens < args.max_new_tokens {
        eprintln!(
            "generating at most {new_tokens} tokens, not --max-new-tokens {}: the prompt's {} \
             tokens and the new ones fill the model's {max_pos} positions",
            args.max_new_tokens,
            prompt.len()
        );
    }
    let mut cache = KVCache::new(&model, 1, prompt.len() + new_tokens);
    let temperature = if args.greedy { 0.0 } else { args.temperature };
    let key = RngKey::new(args.seed).fold(0x6E6);
    let mut logits = None;
    let mut prompt_logits = Vec::new();
    let started = std::time::Instant::now();
    for &p in &prompt {
        let l = decode_step(&model, &params, &mut cache, &[p]);
        if args.logits_out.is_some() {
            prompt_logits.push(l.data()[..vocab].to_vec());
        }
        logits = Some(l);
    }
    if let Some(path) = &args.logits_out {
        write_logits(path, &prompt_logits)?;
    }
    let prefill = started.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for step in 0..new_tokens {
        let l = logits.take().expect("prompt is never empty");
        let next = sample_next(
            l.data(),
            vocab,
            temperature,
            args.top_k,
            args.top_p,
            key,
            step as u64,
        );
        if stop.contains(&next) {
            break;
        }
        out.push(next);
        if step + 1 < new_tokens {
            logits = Some(decode_step(&model, &params, &mut cache, &[next]));
        }
    }
    let secs = started.elapsed().as_secs_f64() - prefill;
    eprintln!(
        "prompt {} tokens in {prefill:.2} s; generated {} tokens in {secs:.2} s ({:.1} tokens/s)",
        prompt.len(),
        out.len(),
        out.len() as f64 / secs.max(1e-9)
    );
    let ids = || {
        out.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut text = match &tok {
        Some(t) => continuation(t.as_ref(), &prompt, &out),
        None => ids(),
    };
    if args.print_ids {
        text = format!("{text}\n{}", ids());
    }
    Ok(text)
}

/// T5: the prompt is the encoder's input; the decoder starts from `--decoder-start-id` and
/// decodes (greedy, or sampled as for decoders: `--temperature`, `--top-k`, `--top-p`,
/// `--seed`) until `--eos-id` or `--max-new-tokens`, with the decoder's cache.
fn generate_t5(args: &GenerateArgs, tok: Option<&dyn Tokenizer>) -> Result<String, TrainError> {
    let (model, params, ck) = crate::load::load_t5(Path::new(&args.load))?;
    let prompt = prompt_ids(args, tok)?;
    let special = |which, default: u32| tok.and_then(|t| t.special_id(which)).unwrap_or(default);
    let start = args
        .decoder_start_id
        .unwrap_or_else(|| special(SpecialToken::Bos, 0));
    let eos = args.eos_id.unwrap_or_else(|| special(SpecialToken::Eos, 1));
    let mut one = megatron_core::tensor_parallel::serial_group();
    let mut tp = megatron_core::tensor_parallel::Tp::new(&mut one, false);
    let started = std::time::Instant::now();
    let temperature = if args.greedy { 0.0 } else { args.temperature };
    let key = RngKey::new(args.seed).fold(0x6E6);
    let seqs = model.generate(
        &params,
        &mut tp,
        &prompt,
        &[prompt.len()],
        (start, eos, 0),
        ck.meta.vocab_size,
        args.max_new_tokens,
        &mut |row, s, step| {
            sample_next(
                row,
                row.len(),
                temperature,
                args.top_k,
                args.top_p,
                key.fold(s as u64),
                step as u64,
            )
        },
    )?;
    let out: Vec<u32> = seqs[0][1..]
        .iter()
        .copied()
        .take_while(|&t| t != eos)
        .collect();
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "encoder input {} tokens; generated {} tokens in {secs:.2} s ({:.1} tokens/s)",
        prompt.len(),
        out.len(),
        out.len() as f64 / secs.max(1e-9)
    );
    let ids = out
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(" ");
    let mut text = match tok {
        Some(t) => t.decode(&out),
        None => ids.clone(),
    };
    if args.print_ids {
        text = format!("{text}\n{ids}");
    }
    Ok(text)
}
