pub mod bert;
pub mod embedding;
pub mod gpt;
pub mod model_chunk;
pub mod t5;
pub mod tabular;

pub use model_chunk::{ChunkState, LossPhase, ModelChunk, ModelFamily, TiedParam};
