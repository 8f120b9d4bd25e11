pub mod attention;
pub mod config;
pub mod layer;
pub mod mlp;
pub mod saved;
pub mod step;
