pub mod embedding;
pub mod gpt;
pub mod model_chunk;

pub use model_chunk::{ChunkState, ModelChunk, ModelFamily};
