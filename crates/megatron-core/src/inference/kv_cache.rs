//! Incremental decoding with a key/value cache: one new token per sequence per step through the
//! model's own modules (embedding, each layer's norms, projections, rotary embeddings and MLP);
//! only the single-query attention against the cache is decode-specific.

use crate::models::gpt::GPTModel;
use crate::params::Params;
use crate::tensor_parallel::{serial_group, Tp};
use crate::transformer::attention::LayerKVCache;
use crate::transformer::step::StepContext;
use megatron_tensor::cpu::matmul_forward;
use megatron_tensor::Tensor;

pub struct KVCache {
    layers: Vec<LayerKVCache>,
    pub len: usize,
    pub max_t: usize,
    pub b: usize,
}

impl KVCache {
    pub fn new(model: &GPTModel, b: usize, max_t: usize) -> Self {
        KVCache {
            layers: model
                .layers
                .iter()
                .map(|l| LayerKVCache::new(&l.self_attention, b, max_t))
                .collect(),
            len: 0,
            max_t,
            b,
        }
    }
}

/// Feeds `tokens` (one per sequence) at position `cache.len`; returns logits `[b, vocab]`.
pub fn decode_step(
    model: &GPTModel,
    params: &Params,
    cache: &mut KVCache,
    tokens: &[u32],
) -> Tensor {
    let cfg = &model.config;
    let (b, h) = (cache.b, cfg.hidden_size);
    assert_eq!(tokens.len(), b);
    let pos = cache.len;
    assert!(
        pos < cache.max_t && pos < cfg.max_position_embeddings.max(cfg.seq_length),
        "KV cache full"
    );
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    let comm = "a group of one rank does not communicate";
    let emb = model
        .embedding
        .as_ref()
        .expect("decoding needs the whole model (one pipeline stage)");
    let positions = vec![pos as u32; b];
    let mut x = emb
        .forward(
            params,
            &mut tp,
            tokens,
            Some(&positions),
            1,
            &StepContext::eval(),
        )
        .expect(comm);
    for (layer, c) in model.layers.iter().zip(&mut cache.layers) {
        x = layer
            .decode_forward(params, &mut tp, x, c, pos)
            .expect(comm);
    }
    cache.len += 1;
    let (xf, _) = model
        .final_layernorm
        .as_ref()
        .expect("decoding needs the whole model")
        .forward(params, &x);
    let v = cfg.padded_vocab_size;
    let mut logits = Tensor::zeros(&[b, v]);
    let wid = model.output_weight.expect("decoding needs the whole model");
    matmul_forward(
        logits.data_mut(),
        xf.data(),
        params.operand(wid).operand(),
        None,
        b,
        h,
        v,
    );
    logits
}
