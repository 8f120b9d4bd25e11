//! The tabular foundation model (TabPFN-style in-context learning over whole tables; issue 18).
//! Built so far: the cell embedding and the layer (attention across the cells of a row,
//! attention down each column with queries seeing only context rows, MLP). The head
//! (classes or binned regression on the query rows' target cells, binned reconstruction of
//! hidden cells); `megatron-training::tabular` trains it and reads predictions off it.

pub mod embedding;
pub mod head;
pub mod layer;
pub mod model;

pub use embedding::CellEmbedding;
pub use head::{bin_of, HeadRows, TabularHead, Task, BINS};
pub use layer::{TableShape, TabularConfig, TabularLayer, TabularLayerSaved};
pub use model::{layer_groups, Encoded, HiddenCell, TabularBatch, TabularModel};
