pub mod kv_cache;
pub use kv_cache::{decode_step, KVCache};
