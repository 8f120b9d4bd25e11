//! The tabular foundation model (TabPFN-style in-context learning over whole tables; issue 18).
//! Built so far: the cell embedding and the layer (attention across the cells of a row,
//! attention down each column with queries seeing only context rows, MLP). The heads and
//! training come next.

pub mod embedding;
pub mod layer;

pub use embedding::CellEmbedding;
pub use layer::{TableShape, TabularConfig, TabularLayer, TabularLayerSaved};
