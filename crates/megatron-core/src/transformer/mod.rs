pub mod attention;
pub mod config;
pub mod layer;
pub mod mlp;
pub mod norm;
pub mod qk_norm;
pub mod saved;
pub mod step;
