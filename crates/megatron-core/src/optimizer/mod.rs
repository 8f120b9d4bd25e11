pub mod adam;
pub mod clip_grads;
pub mod distrib_optimizer;
pub mod grad_scaler;
pub mod layer_wise_optimizer;
pub mod lr_scheduler;
pub mod megatron_optimizer;
pub mod moment_buf;
pub mod muon;
pub mod replicated_grads;
pub mod sharded_grads;
pub mod update_rule;

pub use adam::Adam;
pub use clip_grads::{clip_grad_norm, clip_grads_by_norm, get_grad_norm};
pub use distrib_optimizer::DistributedOptimizer;
pub use grad_scaler::GradScaler;
pub use layer_wise_optimizer::{layer_wise_placement, LayerWiseDistributedOptimizer};
pub use lr_scheduler::{LrDecayStyle, OptimizerParamScheduler, WsdDecayStyle};
pub use megatron_optimizer::{
    MegatronOptimizer, MomentReader, ParamGather, PlainOptimizer, StatePiece, StepLr,
};
pub use moment_buf::{MomentBuf, MomentDtype, MomentDtypes};
pub use muon::{
    is_muon_parameter, MuonConfig, MuonMoment2, MuonMomentum, MuonOptimizer, MuonScaleMode,
    MuonTpMode, NsCoefficients,
};
pub use replicated_grads::ReplicatedGrads;
pub use sharded_grads::{OwnedPiece, ShardedGrads};
pub use update_rule::{Moment, UpdateRule};
