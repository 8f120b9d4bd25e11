//! BERT under `megatron train --model bert`: Megatron's `BertDataset` samples of a
//! sentence-split indexed dataset (`megatron preprocess --split-sentences`), read in the
//! pretraining sampler's order, into `[b, t]` tokens and segments, the padding lengths, the
//! masked positions with their labels and the sentence-order labels.

use crate::arguments::TrainConfig;
use crate::family::TrainFamily;
use crate::TrainError;
use megatron_core::context_parallel::CpLayout;
use megatron_core::models::bert::{BertBatch, BertConfig, BertHeads, BertModel};
use megatron_data::bert_dataset::{BertDataset, BertSampleConfig, WordPieceTokens};
use megatron_data::blended_dataset::parse_blend;
use megatron_data::gpt_dataset::{split_indices, split_matrix};
use megatron_data::indexed_dataset::IndexedDataset;
use megatron_data::{Split, Tokenizer};
use std::sync::Arc;

/// `--mask-prob`, `--short-seq-prob` and the model's heads, validated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BertSettings {
    pub heads: BertHeads,
    pub mask_prob: f64,
    pub short_seq_prob: f64,
}

pub(crate) struct Bert;

/// The train, validation and test samples.
pub(crate) struct BertData {
    splits: [Option<BertDataset>; 3],
}

/// One micro-batch's buffers.
pub(crate) struct BertMicroBatch {
    tokens: Vec<u32>,
    types: Vec<u32>,
    key_lens: Vec<usize>,
    rows: Vec<u32>,
    labels: Vec<u32>,
    order: Vec<u32>,
}

fn split_of(s: Split) -> usize {
    match s {
        Split::Train => 0,
        Split::Valid => 1,
        Split::Test => 2,
    }
}

/// The tokenizer's special ids and word pieces, or an error naming what it lacks.
pub(crate) fn wordpiece(tok: &dyn Tokenizer) -> Result<WordPieceTokens, TrainError> {
    let id = |t: &str| {
        tok.token_id(t).ok_or_else(|| {
            TrainError::Args(format!(
                "--model bert needs a WordPiece vocabulary with {t}; {} has none (use --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt)",
                tok.name()
            ))
        })
    };
    Ok(WordPieceTokens {
        cls: id("[CLS]")?,
        sep: id("[SEP]")?,
        mask: id("[MASK]")?,
        pad: id("[PAD]")?,
        continues_word: (0..tok.vocab_size() as u32)
            .map(|i| tok.token_text(i).is_some_and(|t| t.starts_with("##")))
            .collect(),
    })
}

impl TrainFamily for Bert {
    type Config = BertConfig;
    type Chunk = BertModel;
    type Data = BertData;
    type MicroBatch = BertMicroBatch;

    fn config(cfg: &TrainConfig) -> BertConfig {
        let s = cfg.bert.expect("--model bert has BERT settings");
        BertConfig::with_heads(cfg.model.clone(), s.heads)
    }

    fn bert_heads(cfg: &TrainConfig) -> Option<BertHeads> {
        cfg.bert.map(|s| s.heads)
    }

    fn build_data(
        cfg: &TrainConfig,
        tok: &dyn Tokenizer,
        lead: bool,
    ) -> Result<BertData, TrainError> {
        let a = &cfg.args;
        let s = cfg.bert.expect("--model bert has BERT settings");
        let blend = parse_blend(&a.data_path)?;
        let [(_, prefix)] = blend.as_slice() else {
            return Err(TrainError::Args(format!(
                "--model bert reads one sentence-split dataset (--data-path PREFIX); got {} prefixes",
                blend.len()
            )));
        };
        let ds = Arc::new(IndexedDataset::open(prefix)?);
        let pieces = wordpiece(tok)?;
        let sample_cfg = BertSampleConfig {
            seq_length: a.seq_length,
            seed: a.seed,
            masking_probability: s.mask_prob,
            short_seq_prob: s.short_seq_prob,
            masking_max_ngram: 3,
            whole_word: true,
            binary_head: s.heads.binary_head
                == megatron_core::models::bert::BinaryHead::SentenceOrder,
        };
        let gbs = cfg.global_batch_size as u64;
        let eval = a.eval_iters * gbs;
        let want = [
            cfg.train_iters * gbs,
            (cfg.train_iters / a.eval_interval + 1) * eval,
            eval,
        ];
        let matrix = split_matrix(&megatron_data::text_dataset::parse_split(&a.split)?);
        let names = ["train", "validation", "test"];
        let mut splits: [Option<BertDataset>; 3] = [None, None, None];
        for k in 0..3 {
            let (Some(bounds), n) = (matrix[k], want[k]) else {
                continue;
            };
            let docs = split_indices(bounds, ds.num_documents());
            if n == 0 || docs.is_empty() {
                continue;
            }
            let d = BertDataset::new(ds.clone(), &docs, Some(n), sample_cfg, pieces.clone());
            if d.is_empty() {
                return Err(TrainError::Args(format!(
                    "{prefix}: the {} split's {} documents make no BERT sample (each needs {} sentences; preprocess with --split-sentences)",
                    names[k],
                    docs.len(),
                    if sample_cfg.binary_head { "at least 2" } else { "a" }
                )));
            }
            if lead {
                println!(
                    "data: {} split, {prefix}: {} documents, {} BERT samples",
                    names[k],
                    docs.len(),
                    d.len()
                );
            }
            splits[k] = Some(d);
        }
        if splits[0].is_none() {
            return Err(TrainError::Args(format!(
                "--split {}: the training split of {prefix} is empty",
                a.split
            )));
        }
        Ok(BertData { splits })
    }

    fn num_samples(data: &BertData, split: Split) -> u64 {
        data.splits[split_of(split)]
            .as_ref()
            .map_or(0, |d| d.len() as u64)
    }

    fn micro_batch(cfg: &TrainConfig, _cp: CpLayout) -> BertMicroBatch {
        let (b, t) = (cfg.args.micro_batch_size, cfg.args.seq_length);
        BertMicroBatch {
            tokens: vec![0; b * t],
            types: vec![0; b * t],
            key_lens: vec![t; b],
            rows: Vec::new(),
            labels: Vec::new(),
            order: vec![0; b],
        }
    }

    fn fill(cfg: &TrainConfig, data: &BertData, mb: &mut BertMicroBatch, split: Split, first: u64) {
        let (b, t) = (cfg.args.micro_batch_size, cfg.args.seq_length);
        let ds = data.splits[split_of(split)]
            .as_ref()
            .expect("a split with samples");
        mb.rows.clear();
        mb.labels.clear();
        for j in 0..b {
            let s = ds.sample(((first + j as u64) % ds.len() as u64) as usize);
            mb.tokens[j * t..(j + 1) * t].copy_from_slice(&s.tokens);
            mb.types[j * t..(j + 1) * t].copy_from_slice(&s.types);
            mb.key_lens[j] = s.len;
            mb.order[j] = u32::from(s.is_random);
            for &p in &s.masked_positions {
                mb.rows.push((j * t + p) as u32);
                mb.labels.push(s.labels[p] as u32);
            }
        }
    }

    fn batch<'m>(cfg: &TrainConfig, mb: &'m BertMicroBatch) -> BertBatch<'m> {
        BertBatch {
            tokens: &mb.tokens,
            tokentypes: &mb.types,
            key_lens: &mb.key_lens,
            masked_rows: &mb.rows,
            masked_labels: &mb.labels,
            sentence_order: &mb.order,
            b: cfg.args.micro_batch_size,
            t: cfg.args.seq_length,
        }
    }
}
