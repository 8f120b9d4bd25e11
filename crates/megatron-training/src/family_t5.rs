//! T5 under `megatron train --model t5`: Megatron's `T5Dataset` span-corruption samples of a
//! sentence-split indexed dataset (`--vocab-extra-ids` sentinels), read in the pretraining
//! sampler's order, into encoder and decoder tokens, labels (padding not counted) and the
//! sequences' lengths, on any layout but sequence and context parallelism.

use crate::arguments::TrainConfig;
use crate::data::{check_token_ids, data_flags};
use crate::family::{sentence_splits, split_index, TrainFamily};
use crate::family_bert::{special, wordpiece};
use crate::TrainError;
use megatron_core::context_parallel::CpLayout;
use megatron_core::models::t5::{T5Batch, T5Config, T5Model, T5Stacks};
use megatron_data::t5_dataset::{T5Dataset, T5SampleConfig, T5Tokens};
use megatron_data::{SpecialToken, Split, Tokenizer};
use megatron_tensor::cpu::IGNORE_INDEX;

/// The validated T5 settings: the stacks, the decoder's length and the masking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct T5Settings {
    pub stacks: T5Stacks,
    pub decoder_seq_length: usize,
    pub mask_prob: f64,
    pub short_seq_prob: f64,
}

pub(crate) struct T5;

pub(crate) struct T5Data {
    splits: [Option<T5Dataset>; 3],
}

pub(crate) struct T5MicroBatch {
    enc: Vec<u32>,
    dec: Vec<u32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    enc_lens: Vec<usize>,
    dec_lens: Vec<usize>,
}

fn settings(cfg: &TrainConfig) -> T5Settings {
    cfg.t5.expect("--model t5 has T5 settings")
}

impl TrainFamily for T5 {
    type Config = T5Config;
    type Chunk = T5Model;
    type Data = T5Data;
    type MicroBatch = T5MicroBatch;

    fn config(cfg: &TrainConfig) -> T5Config {
        T5Config {
            transformer: cfg.model.clone(),
            stacks: settings(cfg).stacks,
        }
    }

    fn activation_formulas(
        _cfg: &TrainConfig,
        _tp: &megatron_core::tensor_parallel::Tp,
    ) -> Option<(f64, f64)> {
        None
    }

    fn flops(cfg: &TrainConfig, batch: usize) -> f64 {
        let s = settings(cfg);
        crate::flops::t5_floating_point_operations(
            &cfg.model,
            (s.stacks.encoder_layers, s.stacks.decoder_layers),
            (cfg.args.seq_length, s.decoder_seq_length),
            batch,
        )
    }

    fn describe_layers(cfg: &TrainConfig) -> String {
        let s = settings(cfg).stacks;
        format!(
            "{} encoder + {} decoder layers",
            s.encoder_layers, s.decoder_layers
        )
    }

    fn t5_stacks(cfg: &TrainConfig) -> Option<T5Stacks> {
        cfg.t5.map(|s| s.stacks)
    }

    fn build_data(
        cfg: &TrainConfig,
        tok: &dyn Tokenizer,
        lead: bool,
    ) -> Result<T5Data, TrainError> {
        let a = &cfg.args;
        let s = settings(cfg);
        let id = |t: &str| {
            tok.token_id(t).ok_or_else(|| {
                TrainError::Args(format!(
                    "--model t5 needs {t} in the vocabulary; {} has none (use --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt --vocab-extra-ids 100, or SentencePieceTokenizer --tokenizer-model m.model --vocab-extra-ids 100)",
                    tok.name()
                ))
            })
        };
        let sentinels = (0..a.tokenizer.vocab_extra_ids)
            .map(|k| id(&format!("<extra_id_{k}>")))
            .collect::<Result<Vec<_>, _>>()?;
        let tokens = T5Tokens {
            pieces: wordpiece(tok, "t5")?,
            bos: special(tok, SpecialToken::Bos, "t5")?,
            eos: special(tok, SpecialToken::Eos, "t5")?,
            sentinels,
        };
        let sample_cfg = T5SampleConfig {
            encoder_seq_length: a.seq_length,
            decoder_seq_length: s.decoder_seq_length,
            seed: a.seed,
            masking_probability: s.mask_prob,
            short_seq_prob: s.short_seq_prob,
        };
        let splits = sentence_splits(
            cfg,
            "t5",
            lead,
            |ds, docs, n| T5Dataset::new(ds, docs, Some(n), sample_cfg, tokens.clone()),
            T5Dataset::len,
        )?;
        Ok(T5Data { splits })
    }

    fn num_samples(data: &T5Data, split: Split) -> u64 {
        data.splits[split_index(split)]
            .as_ref()
            .map_or(0, |d| d.len() as u64)
    }

    fn micro_batch(cfg: &TrainConfig, _cp: CpLayout) -> T5MicroBatch {
        let (b, te, td) = (
            cfg.args.micro_batch_size,
            cfg.args.seq_length,
            settings(cfg).decoder_seq_length,
        );
        T5MicroBatch {
            enc: vec![0; b * te],
            dec: vec![0; b * td],
            labels: vec![IGNORE_INDEX; b * td],
            mask: vec![0.0; b * td],
            enc_lens: vec![te; b],
            dec_lens: vec![td; b],
        }
    }

    fn fill(
        cfg: &TrainConfig,
        data: &T5Data,
        mb: &mut T5MicroBatch,
        split: Split,
        samples: &[u64],
    ) -> Result<(), TrainError> {
        let (te, td) = (cfg.args.seq_length, settings(cfg).decoder_seq_length);
        let ds = data.splits[split_index(split)]
            .as_ref()
            .expect("a split with samples");
        for (j, &index) in samples.iter().enumerate() {
            let index = index % ds.len() as u64;
            let s = ds.sample(index as usize);
            for ids in [&s.encoder_input, &s.decoder_input] {
                check_token_ids(ids, cfg.vocab_size, || data_flags(cfg), split, index)?;
            }
            mb.enc[j * te..(j + 1) * te].copy_from_slice(&s.encoder_input);
            mb.dec[j * td..(j + 1) * td].copy_from_slice(&s.decoder_input);
            for p in 0..td {
                let counted = p < s.decoder_len;
                mb.labels[j * td + p] = if counted {
                    s.labels[p] as u32
                } else {
                    IGNORE_INDEX
                };
                mb.mask[j * td + p] = if counted { 1.0 } else { 0.0 };
            }
            mb.enc_lens[j] = s.encoder_len;
            mb.dec_lens[j] = s.decoder_len;
        }
        Ok(())
    }

    fn batch<'m>(cfg: &TrainConfig, mb: &'m T5MicroBatch) -> T5Batch<'m> {
        T5Batch {
            enc_tokens: &mb.enc,
            dec_tokens: &mb.dec,
            labels: &mb.labels,
            loss_mask: &mb.mask,
            enc_lens: &mb.enc_lens,
            dec_lens: &mb.dec_lens,
            b: cfg.args.micro_batch_size,
            te: cfg.args.seq_length,
            td: settings(cfg).decoder_seq_length,
        }
    }
}
