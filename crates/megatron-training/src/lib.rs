//! The training loop of megatron-rs with Megatron's flags and semantics, checkpoints, logging and
//! generation.

pub mod arguments;
mod bert_logging;
pub mod checkpoint_policy;
mod checkpoint_save;
pub mod checkpoint_tool;
pub mod checkpointing;
pub mod convert;
mod data;
pub mod dist_checkpointing;
pub mod embed;
mod evaluate;
mod family;
pub mod family_bert;
mod family_gpt;
pub mod family_t5;
pub mod fim;
pub mod flops;
pub mod generate;
mod launch;
pub mod layer_pattern;
pub mod load;
pub mod logging;
pub mod machine_probes;
pub mod memory;
pub mod moe_logging;
pub mod mtp_logging;
pub mod num_microbatches;
pub mod plan;
pub mod plot;
pub mod sample_order;
pub mod script_compat;
mod setup;
pub mod straggler;
pub mod tabular;
pub mod tensorboard;
mod train_step;
pub mod training;

pub use arguments::{
    GenerateArgs, InspectArgs, MergeArgs, PreprocessArgs, TrainArgs, TrainTokenizerArgs,
};
pub use training::{inspect_data, pretrain, TrainSummary};

/// Everything that can stop a run; each message names the flag, file or iteration at fault.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Args(String),
    #[error(transparent)]
    Config(#[from] megatron_core::ConfigError),
    #[error(transparent)]
    Data(#[from] megatron_data::DataError),
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: String, msg: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Comm(#[from] megatron_comm::CommError),
    #[error("rank {rank}: {msg}")]
    Rank { rank: usize, msg: String },
    #[error("iteration {iteration}: {what} is {value}; stopping (the last saved checkpoint is left untouched)")]
    NonFinite {
        iteration: u64,
        what: &'static str,
        value: f64,
    },
    #[error("iteration {iteration}: rank {rank} ({coords}) found {what} {when}; stopping (the last saved checkpoint is left untouched; --no-check-for-nan-in-loss-and-grad turns this check off)")]
    LocalNonFinite {
        iteration: u64,
        rank: usize,
        /// The rank's tensor-, pipeline- and data-parallel coordinates.
        coords: String,
        /// The value and where: `NaN in the gradient of decoder.layers.1.mlp.linear_fc1.weight`.
        what: String,
        when: &'static str,
    },
}

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}
