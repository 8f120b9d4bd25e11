//! Whole models from checkpoints, for the commands that run them rather than train them
//! (`embed`, conversion checks): the checkpoint's manifest says which family it holds.

use crate::checkpointing::{load_checkpoint_weights, restore, LoadedCheckpoint};
use crate::TrainError;
use megatron_core::models::bert::{BertConfig, BertModel};
use megatron_core::models::t5::{T5Config, T5Model};
use megatron_core::models::ModelFamily;
use megatron_core::Params;
use std::path::Path;

/// A BERT checkpoint's model, with its weights.
pub fn load_bert(load: &Path) -> Result<(BertModel, Params, LoadedCheckpoint), TrainError> {
    let ck = load_checkpoint_weights(load)?;
    let heads = ck.meta.bert.ok_or_else(|| TrainError::Checkpoint {
        path: ck.dir.display().to_string(),
        msg: "not a BERT checkpoint (its manifest records no BERT heads)".into(),
    })?;
    let cfg = BertConfig::with_heads(ck.meta.model.clone(), heads);
    let mut params = Params::default();
    let layers = cfg.num_layers();
    let model = cfg.build_chunk(&mut params, &mut Vec::new(), 0..layers, true, true);
    params.data = vec![0.0; params.numel()];
    restore(&ck, &mut params, None)?;
    Ok((model, params, ck))
}

/// A T5 checkpoint's model, with its weights.
pub fn load_t5(load: &Path) -> Result<(T5Model, Params, LoadedCheckpoint), TrainError> {
    let ck = load_checkpoint_weights(load)?;
    let stacks = ck.meta.t5.ok_or_else(|| TrainError::Checkpoint {
        path: ck.dir.display().to_string(),
        msg: "not a T5 checkpoint (its manifest records no T5 stacks)".into(),
    })?;
    let cfg = T5Config {
        transformer: ck.meta.model.clone(),
        stacks,
    };
    let mut params = Params::default();
    let model = T5Model::build(cfg, &mut params, &mut Vec::new());
    params.data = vec![0.0; params.numel()];
    restore(&ck, &mut params, None)?;
    Ok((model, params, ck))
}
