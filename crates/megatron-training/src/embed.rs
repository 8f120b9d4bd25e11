//! `megatron embed`: sentence embeddings from a BERT checkpoint, as sentence-transformers
//! computes them for its BERT encoders (all-MiniLM-L6-v2 and kin): each line of the input
//! tokenized with the checkpoint's `tokenizer.json` (`[CLS] ... [SEP]`, truncated to
//! `--max-length`), the encoder run on micro-batches padded to their longest line under the
//! padding mask, the outputs mean-pooled over the real tokens and, with `--normalize`, scaled
//! to unit length. Written as a float32 `.npy` of `[lines, hidden]`.

use crate::load::load_bert;
use crate::{io_err, TrainError};
use megatron_core::models::bert::{BertBatch, BertModel};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::Params;
use megatron_tensor::cpu::{mean_pool_forward, PoolNorm};
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct EmbedArgs {
    /// A BERT checkpoint (`--save` directory, e.g. from `megatron convert --from hf`).
    #[arg(long)]
    pub load: PathBuf,
    /// Text, one sentence per line.
    #[arg(long)]
    pub input: PathBuf,
    /// Output `.npy` (float32, `[lines, hidden]`).
    #[arg(long)]
    pub out: PathBuf,
    /// Tokens per line at most, `[CLS]` and `[SEP]` included (sentence-transformers'
    /// `max_seq_length`; all-MiniLM-L6-v2 uses 256). Default: the model's position limit.
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Lines per forward pass.
    #[arg(long, default_value_t = 32)]
    pub micro_batch_size: usize,
    /// Scale each vector to unit L2 norm (sentence-transformers' `Normalize` module).
    #[arg(long)]
    pub normalize: bool,
    /// A `tokenizer.json` other than the one the checkpoint records.
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,
}

/// Token ids and segments of one line, truncated to `max_length` with the closing `[SEP]`
/// kept (what Hugging Face tokenizers do when truncating before adding special tokens).
fn encode_line(
    tok: &tokenizers::Tokenizer,
    line: &str,
    max_length: usize,
) -> Result<(Vec<u32>, Vec<u32>), String> {
    let e = tok.encode(line, true).map_err(|e| e.to_string())?;
    let (mut ids, mut types) = (e.get_ids().to_vec(), e.get_type_ids().to_vec());
    if ids.len() > max_length {
        let last = (
            *ids.last().expect("non-empty"),
            *types.last().expect("non-empty"),
        );
        ids.truncate(max_length - 1);
        types.truncate(max_length - 1);
        ids.push(last.0);
        types.push(last.1);
    }
    Ok((ids, types))
}

/// Pooled embeddings (`[lines, hidden]`) of `lines`.
pub fn embed_lines(
    model: &BertModel,
    params: &Params,
    tok: &tokenizers::Tokenizer,
    lines: &[String],
    args: &EmbedArgs,
) -> Result<Vec<f32>, TrainError> {
    let cfg = &model.config.transformer;
    let max_length = args
        .max_length
        .unwrap_or(cfg.max_position_embeddings)
        .min(cfg.max_position_embeddings);
    if max_length < 2 {
        return Err(TrainError::Args(format!(
            "--max-length {max_length}: a line needs at least [CLS] and [SEP]"
        )));
    }
    let h = cfg.hidden_size;
    let norm = if args.normalize {
        PoolNorm::Unit
    } else {
        PoolNorm::None
    };
    let mut out = Vec::with_capacity(lines.len() * h);
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    for (c, chunk) in lines.chunks(args.micro_batch_size.max(1)).enumerate() {
        let encoded: Vec<(Vec<u32>, Vec<u32>)> = chunk
            .iter()
            .enumerate()
            .map(|(i, l)| {
                encode_line(tok, l, max_length).map_err(|e| {
                    let line = c * args.micro_batch_size.max(1) + i + 1;
                    TrainError::Args(format!("{}: line {line}: {e}", args.input.display()))
                })
            })
            .collect::<Result<_, _>>()?;
        let (b, t) = (
            encoded.len(),
            encoded.iter().map(|e| e.0.len()).max().unwrap_or(1),
        );
        let mut tokens = vec![0u32; b * t];
        let mut types = vec![0u32; b * t];
        let mut key_lens = Vec::with_capacity(b);
        for (s, (ids, ty)) in encoded.iter().enumerate() {
            tokens[s * t..s * t + ids.len()].copy_from_slice(ids);
            types[s * t..s * t + ty.len()].copy_from_slice(ty);
            key_lens.push(ids.len());
        }
        if let Some(&bad) = tokens
            .iter()
            .find(|&&x| x as usize >= cfg.padded_vocab_size)
        {
            return Err(TrainError::Args(format!(
                "token id {bad} is outside the model's vocabulary ({}): is the tokenizer the model's?",
                cfg.padded_vocab_size
            )));
        }
        let batch = BertBatch {
            tokens: &tokens,
            tokentypes: &types,
            key_lens: &key_lens,
            masked_rows: &[],
            masked_labels: &[],
            sentence_order: &[],
            b,
            t,
        };
        let y = model.encode(params, &mut tp, &batch)?;
        let mut pooled = vec![0.0f32; b * h];
        mean_pool_forward(&mut pooled, y.data(), &key_lens, t, norm);
        out.extend_from_slice(&pooled);
    }
    Ok(out)
}

/// Runs `megatron embed`; returns the number of lines embedded.
pub fn embed(args: &EmbedArgs) -> Result<usize, TrainError> {
    let (model, params, ck) = load_bert(&args.load)?;
    let tok_path = match (&args.tokenizer_model, &ck.meta.tokenizer_model) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) => PathBuf::from(p),
        (None, None) => {
            return Err(TrainError::Args(format!(
                "checkpoint {} records no tokenizer: pass --tokenizer-model tokenizer.json",
                ck.dir.display()
            )))
        }
    };
    let mut tok = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| TrainError::Args(format!("--tokenizer-model {}: {e}", tok_path.display())))?;
    // Lines are padded here, per micro-batch; truncation is ours too.
    tok.with_padding(None);
    tok.with_truncation(None)
        .map_err(|e| TrainError::Args(format!("{}: {e}", tok_path.display())))?;
    let text = std::fs::read_to_string(&args.input).map_err(io_err(&args.input))?;
    let lines: Vec<String> = text.lines().map(String::from).collect();
    if lines.is_empty() {
        return Err(TrainError::Args(format!(
            "--input {}: no lines to embed",
            args.input.display()
        )));
    }
    let v = embed_lines(&model, &params, &tok, &lines, args)?;
    let h = model.config.transformer.hidden_size;
    megatron_data::npy::write_f32(&args.out, &[lines.len(), h], &v)?;
    Ok(lines.len())
}
