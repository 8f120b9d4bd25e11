pub mod embedding;
pub mod gpt;
