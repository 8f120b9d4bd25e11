//! Data parallelism (Megatron's `megatron/core/distributed/`): gradient buckets over the flat
//! gradient buffer and their reduction over the data-parallel group.

pub mod expert_grads;
pub mod overlap;
pub mod overlap_param_gather;
pub mod param_and_grad_buffer;

pub use expert_grads::ExpertGrads;
pub use param_and_grad_buffer::{
    collective_scratch_elements, Bucket, Gathered, GradBuffer, ParamGroup, Placement,
    COLLECTIVE_CHUNK_ELEMENTS,
};
