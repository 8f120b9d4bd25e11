//! The data side of a step: the sample source a run reads (mock, indexed datasets and blends,
//! or raw text), the micro-batch buffers filled from it, and `megatron inspect-data`.

use crate::arguments::TrainConfig;
use crate::TrainError;
use megatron_core::context_parallel::CpLayout;
use megatron_core::Batch;
use megatron_data::megatron_data::{is_indexed_blend, MegatronDataConfig, MegatronGPTData};
use megatron_data::{
    build_tokenizer_from, GPTSampleSource, MockGPTDataset, Split, TextDataset, Tokenizer,
};

pub(crate) fn build_data(
    cfg: &TrainConfig,
    tok: &dyn Tokenizer,
    lead: bool,
) -> Result<Box<dyn GPTSampleSource>, TrainError> {
    let a = &cfg.args;
    if a.fim.fim_data && a.mock_data {
        return Err(TrainError::Args(
            "--fim-data cuts documents as text: it needs --data-path, not --mock-data".into(),
        ));
    }
    let settings = a.fim.settings(tok)?;
    let data = build_gpt_samples(cfg, tok, lead)?;
    let Some(settings) = settings else {
        return Ok(data);
    };
    Ok(Box::new(megatron_data::fim_dataset::GPTFIMDataset {
        inner: data,
        tokenizer: build_tokenizer_from(&a.tokenizer.spec())?,
        settings,
        seed: a.seed,
    }))
}

/// The samples of the data flags, before any FIM transform.
fn build_gpt_samples(
    cfg: &TrainConfig,
    tok: &dyn Tokenizer,
    lead: bool,
) -> Result<Box<dyn GPTSampleSource>, TrainError> {
    let a = &cfg.args;
    if a.mock_data {
        return Ok(Box::new(MockGPTDataset {
            vocab_size: tok.vocab_size(),
            seq_length: a.seq_length,
            seed: a.seed,
        }));
    }
    if !a.train_data_path.is_empty() || is_indexed_blend(&a.data_path) {
        let (valid, test) = cfg.eval_split_samples();
        let mcfg = MegatronDataConfig {
            data_path: a.data_path.clone(),
            per_split: [
                a.train_data_path.clone(),
                a.valid_data_path.clone(),
                a.test_data_path.clone(),
            ],
            split: a.split.clone(),
            seq_length: a.seq_length,
            seed: a.seed,
            // Megatron's sizes: every training sample, every evaluation, one test pass.
            num_samples: [Some(cfg.train_samples()), valid, Some(test)],
            data_cache_path: a.data_cache_path.clone(),
            mid_level_dataset_surplus: Some(a.mid_level_dataset_surplus),
            valid_split: match cfg.validation {
                crate::arguments::ValidationScope::FullPerDataset { .. } => {
                    megatron_data::megatron_data::ValidSplit::PerDataset
                }
                _ => megatron_data::megatron_data::ValidSplit::Blended,
            },
            tokenizer: format!("{}:{}", tok.name(), tok.vocab_size()),
            eod: tok.eod(),
        };
        let data = MegatronGPTData::build(&mcfg)?;
        for line in data.report.iter().filter(|_| lead) {
            println!("data: {line}");
        }
        return Ok(Box::new(data));
    }
    let files: Vec<String> =
        megatron_data::inputs::expand_inputs(&a.data_path, &["txt"], "--data-path")?
            .iter()
            .map(|p| p.display().to_string())
            .collect();
    let ds = TextDataset::from_files(&files, tok, &a.split, a.seq_length, a.seed)?;
    if lead {
        println!(
        "data: {} files, {} tokens | samples train/valid/test {}/{}/{} | unigram entropy of the train split: {:.4} nats",
        files.len(),
        ds.num_tokens(),
        ds.num_samples(Split::Train),
        ds.num_samples(Split::Valid),
        ds.num_samples(Split::Test),
        ds.unigram_entropy()
    );
    }
    Ok(Box::new(ds))
}

/// Micro-batch buffers: tokens, labels and loss mask for `b` samples.
pub(crate) struct MicroBatch {
    tokens: Vec<u32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    sample: Vec<u32>,
    /// `--reset-position-ids` / `--reset-attention-mask`, derived from end-of-document tokens.
    position_ids: Option<Vec<u32>>,
    doc_start: Option<Vec<u32>>,
    /// Under context parallelism: this rank's layout and its chunks of the micro-batch.
    cp: Option<(CpLayout, LocalChunks)>,
    /// The tokenizer's vocabulary: every id of a sample must be below it.
    vocab: usize,
    /// The data flags, as an out-of-vocabulary error names them.
    source: String,
}

/// A context-parallel rank's chunks of a micro-batch, with their positions in the sequence.
#[derive(Default)]
struct LocalChunks {
    tokens: Vec<u32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    positions: Vec<u32>,
}

impl MicroBatch {
    /// The micro-batch as context-parallel rank `cp` holds it (the whole of it on one rank).
    pub(crate) fn on_context_parallel_rank(mut self, cp: CpLayout) -> Self {
        self.cp = (cp.size > 1).then(|| (cp, LocalChunks::default()));
        self
    }

    pub(crate) fn new(b: usize, t: usize, cfg: &TrainConfig) -> Self {
        MicroBatch {
            tokens: vec![0; b * t],
            labels: vec![0; b * t],
            mask: vec![1.0; b * t],
            sample: vec![0; t + 1],
            position_ids: cfg.args.reset_position_ids.then(|| vec![0; b * t]),
            doc_start: cfg.args.reset_attention_mask.then(|| vec![0; b * t]),
            cp: None,
            vocab: cfg.vocab_size,
            source: data_flags(cfg),
        }
    }

    pub(crate) fn fill(
        &mut self,
        data: &dyn GPTSampleSource,
        split: Split,
        samples: &[u64],
        t: usize,
        eod_mask: Option<u32>,
    ) -> Result<(), TrainError> {
        let b = samples.len();
        for (j, &index) in samples.iter().enumerate() {
            data.sample(split, index, &mut self.sample);
            check_token_ids(
                &self.sample,
                self.vocab,
                || self.source.clone(),
                split,
                index,
            )?;
            self.tokens[j * t..(j + 1) * t].copy_from_slice(&self.sample[..t]);
            self.labels[j * t..(j + 1) * t].copy_from_slice(&self.sample[1..]);
        }
        if let Some(eod) = eod_mask {
            for (m, l) in self.mask.iter_mut().zip(&self.labels) {
                *m = if *l == eod { 0.0 } else { 1.0 };
            }
        }
        if self.position_ids.is_some() || self.doc_start.is_some() {
            // Megatron's `_get_ltor_masks_and_position_ids`: a document starts after each
            // end-of-document token of the inputs.
            let eod = data.eod();
            for j in 0..b {
                let mut start = 0u32;
                for q in 0..t {
                    if let Some(p) = &mut self.position_ids {
                        p[j * t + q] = q as u32 - start;
                    }
                    if let Some(d) = &mut self.doc_start {
                        d[j * t + q] = start;
                    }
                    if Some(self.tokens[j * t + q]) == eod {
                        start = q as u32 + 1;
                    }
                }
            }
        }
        if let Some((cp, local)) = &mut self.cp {
            local.tokens = cp.batch_on_this_rank(&self.tokens, b, t);
            local.labels = cp.batch_on_this_rank(&self.labels, b, t);
            local.mask = cp.batch_on_this_rank(&self.mask, b, t);
            local.positions = match &self.position_ids {
                // --reset-position-ids: the documents' positions of this rank's tokens.
                Some(p) => cp.batch_on_this_rank(p, b, t),
                None => {
                    let pos = cp.positions(t / cp.size);
                    (0..b).flat_map(|_| pos.iter().map(|&p| p as u32)).collect()
                }
            };
        }
        Ok(())
    }

    /// Labels the loss counts on this rank (its part of the sequence under context
    /// parallelism). Summed in f64: masks are 0 or 1, so the count is exact.
    pub(crate) fn counted_tokens(&self) -> f64 {
        let mask = match &self.cp {
            Some((_, local)) => &local.mask,
            None => &self.mask,
        };
        mask.iter().map(|&m| m as f64).sum()
    }

    pub(crate) fn batch(&self, b: usize, t: usize) -> Batch<'_> {
        if let Some((cp, local)) = &self.cp {
            return Batch {
                tokens: &local.tokens,
                labels: &local.labels,
                loss_mask: &local.mask,
                b,
                t: t / cp.size,
                position_ids: Some(&local.positions),
                // Attention sees whole sequences (all-to-all): the whole micro-batch's starts.
                doc_start: self.doc_start.as_deref(),
            };
        }
        Batch {
            tokens: &self.tokens,
            labels: &self.labels,
            loss_mask: &self.mask,
            b,
            t,
            position_ids: self.position_ids.as_deref(),
            doc_start: self.doc_start.as_deref(),
        }
    }
}

/// Refuses a sample with an id at or above the tokenizer's vocabulary. A dataset tokenized with
/// another tokenizer (or under a wrong `--vocab-size`) would otherwise index past the embedding
/// and the output layer, or silently train on padding rows that stand for no word.
/// `source` names the data flags; it is built only for the error.
pub(crate) fn check_token_ids(
    ids: &[u32],
    vocab: usize,
    source: impl FnOnce() -> String,
    split: Split,
    index: u64,
) -> Result<(), TrainError> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        None => Ok(()),
        Some(&id) => Err(TrainError::Args(format!(
            "{}: sample {index} of the {split:?} split holds token id {id}, outside the \
             tokenizer's vocabulary of {vocab} ids (--tokenizer-type / --vocab-size); was the \
             data preprocessed with another tokenizer?",
            source()
        ))),
    }
}

/// The flags that name a run's samples.
pub(crate) fn data_flags(cfg: &TrainConfig) -> String {
    let a = &cfg.args;
    if a.mock_data {
        "--mock-data".into()
    } else if !a.train_data_path.is_empty() {
        format!("--train-data-path {}", a.train_data_path.join(" "))
    } else {
        format!("--data-path {}", a.data_path.join(" "))
    }
}

/// The label id excluded from the loss under `--eod-mask-loss`.
pub(crate) fn eod_mask(cfg: &TrainConfig, data: &dyn GPTSampleSource) -> Option<u32> {
    if cfg.args.eod_mask_loss {
        data.eod()
    } else {
        None
    }
}

/// Token ids of samples `start..start + count` of a split, in the order training consumes them
/// (`megatron inspect-data`; under `--dataloader-type cyclic`, as one data-parallel rank with
/// `--micro-batch-size` reads them).
pub fn inspect_data(args: &crate::arguments::InspectArgs) -> Result<Vec<Vec<u32>>, TrainError> {
    let tok = build_tokenizer_from(&args.train.tokenizer.spec())?;
    let cfg = args.train.validate(tok.vocab_size())?;
    let split = match args.split_name.as_str() {
        "train" => Split::Train,
        "valid" => Split::Valid,
        "test" => Split::Test,
        other => {
            return Err(TrainError::Args(format!(
                "--split-name {other}: expected train, valid or test"
            )))
        }
    };
    let data = build_data(&cfg, tok.as_ref(), true)?;
    let n = data.num_samples(split);
    if n == 0 {
        return Err(TrainError::Args(format!(
            "the {} split is empty",
            args.split_name
        )));
    }
    // Under `cyclic`, the order of one data-parallel rank reading alone.
    let b = match split {
        Split::Train => cfg.args.micro_batch_size,
        _ => cfg.eval_micro_batch_size,
    } as u64;
    let total = crate::sample_order::split_length(&cfg, n, split);
    let mut sampler = crate::sample_order::RankSamplers::new(
        cfg.sample_order,
        (cfg.args.micro_batch_size, cfg.eval_micro_batch_size),
        0,
        1,
    );
    let mut buf = vec![0u32; cfg.args.seq_length + 1];
    (args.start..args.start + args.count)
        .map(|i| {
            let index = sampler.micro_batch(split, total, i / b * b)?[(i % b) as usize];
            data.sample(split, index, &mut buf);
            Ok(buf.clone())
        })
        .collect()
}
