//! BERT under `megatron train --model bert`: Megatron's `BertDataset` samples of a
//! sentence-split indexed dataset (`megatron preprocess --split-sentences`), read in the
//! pretraining sampler's order, into `[b, t]` tokens and segments, the padding lengths, the
//! masked positions with their labels and the sentence-order labels.

use crate::arguments::TrainConfig;
use crate::data::{check_token_ids, data_flags};
use crate::family::{sentence_splits, split_index, TrainFamily};
use crate::TrainError;
use megatron_core::context_parallel::CpLayout;
use megatron_core::models::bert::{BertBatch, BertConfig, BertHeads, BertModel};
use megatron_data::bert_dataset::{BertDataset, BertSampleConfig, WordPieceTokens};
use megatron_data::{SpecialToken, Split, Tokenizer};

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

/// One of Megatron's named special ids, or an error naming the model and what the tokenizer
/// lacks.
pub(crate) fn special(
    tok: &dyn Tokenizer,
    which: SpecialToken,
    model: &str,
) -> Result<u32, TrainError> {
    tok.special_id(which).ok_or_else(|| {
        TrainError::Args(format!(
            "--model {model} needs a {which:?} token ({} in a WordPiece vocabulary); {} has none (use --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt, or SentencePieceTokenizer --tokenizer-model m.model)",
            which.wordpiece_text(),
            tok.name()
        ))
    })
}

/// The tokenizer's special ids and word pieces, or an error naming what it lacks.
pub(crate) fn wordpiece(tok: &dyn Tokenizer, model: &str) -> Result<WordPieceTokens, TrainError> {
    let id = |which| special(tok, which, model);
    Ok(WordPieceTokens {
        cls: id(SpecialToken::Cls)?,
        sep: id(SpecialToken::Sep)?,
        mask: id(SpecialToken::Mask)?,
        pad: id(SpecialToken::Pad)?,
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

    fn activation_formulas(
        _cfg: &TrainConfig,
        _tp: &megatron_core::tensor_parallel::Tp,
    ) -> Option<(f64, f64)> {
        None
    }

    fn flops(cfg: &TrainConfig, batch: usize) -> f64 {
        crate::flops::bert_floating_point_operations(&cfg.model, batch)
    }

    fn config(cfg: &TrainConfig) -> BertConfig {
        let s = cfg.bert.expect("--model bert has BERT settings");
        BertConfig::with_heads(cfg.model.clone(), s.heads)
    }

    fn bert_heads(cfg: &TrainConfig) -> Option<BertHeads> {
        cfg.bert.map(|s| s.heads)
    }

    fn logs_sop_apart(cfg: &TrainConfig) -> bool {
        cfg.bert.is_some_and(|s| {
            s.heads.binary_head == megatron_core::models::bert::BinaryHead::SentenceOrder
        })
    }

    fn build_data(
        cfg: &TrainConfig,
        tok: &dyn Tokenizer,
        lead: bool,
    ) -> Result<BertData, TrainError> {
        let a = &cfg.args;
        let s = cfg.bert.expect("--model bert has BERT settings");
        let pieces = wordpiece(tok, "bert")?;
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
        let splits = sentence_splits(
            cfg,
            "bert",
            lead,
            |ds, docs, n| BertDataset::new(ds, docs, Some(n), sample_cfg, pieces.clone()),
            BertDataset::len,
        )?;
        Ok(BertData { splits })
    }

    fn num_samples(data: &BertData, split: Split) -> u64 {
        data.splits[split_index(split)]
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

    fn fill(
        cfg: &TrainConfig,
        data: &BertData,
        mb: &mut BertMicroBatch,
        split: Split,
        samples: &[u64],
    ) -> Result<(), TrainError> {
        let t = cfg.args.seq_length;
        let ds = data.splits[split_index(split)]
            .as_ref()
            .expect("a split with samples");
        mb.rows.clear();
        mb.labels.clear();
        for (j, &index) in samples.iter().enumerate() {
            let index = index % ds.len() as u64;
            let s = ds.sample(index as usize);
            check_token_ids(&s.tokens, cfg.vocab_size, || data_flags(cfg), split, index)?;
            mb.tokens[j * t..(j + 1) * t].copy_from_slice(&s.tokens);
            mb.types[j * t..(j + 1) * t].copy_from_slice(&s.types);
            mb.key_lens[j] = s.len;
            mb.order[j] = u32::from(s.is_random);
            for &p in &s.masked_positions {
                mb.rows.push((j * t + p) as u32);
                mb.labels.push(s.labels[p] as u32);
            }
        }
        Ok(())
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
