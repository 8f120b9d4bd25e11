//! Incremental decoding with a key/value cache: one new token per sequence per step, reusing the
//! training kernels for everything but the single-query attention.

use crate::models::gpt::GPTModel;
use crate::params::Params;
use megatron_tensor::cpu::{
    attention_decode_forward, bias_dropout_add_forward, embedding_forward, kv_cache_append,
    matmul_forward,
};
use megatron_tensor::{RngKey, Tensor};

pub struct KVCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    pub len: usize,
    pub max_t: usize,
    pub b: usize,
}

impl KVCache {
    pub fn new(model: &GPTModel, b: usize, max_t: usize) -> Self {
        let c = &model.config;
        let per = b * c.num_attention_heads * max_t * c.head_dim();
        KVCache {
            k: (0..c.num_layers).map(|_| vec![0.0; per]).collect(),
            v: (0..c.num_layers).map(|_| vec![0.0; per]).collect(),
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
    let (b, h, heads, hd) = (
        cache.b,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.head_dim(),
    );
    assert_eq!(tokens.len(), b);
    let pos = cache.len;
    assert!(
        pos < cache.max_t && pos < cfg.max_position_embeddings,
        "KV cache full"
    );
    // Position `pos` for every sequence: embed with a one-row position table.
    let mut x = Tensor::zeros(&[b, h]);
    let emb = model
        .embedding
        .as_ref()
        .expect("decoding needs the whole model (one pipeline stage)");
    let wpe = &params.get(emb.position_embeddings)[pos * h..(pos + 1) * h];
    embedding_forward(
        x.data_mut(),
        tokens,
        None,
        &params.get(emb.word_embeddings),
        wpe,
        1,
    );
    let no_key = RngKey::new(0);
    for (l, layer) in model.layers.iter().enumerate() {
        let sa = &layer.self_attention;
        let (ln1, _) = layer.input_layernorm.forward(params, &x);
        let mut qkv = Tensor::zeros(&[b, 3 * h]);
        matmul_forward(
            qkv.data_mut(),
            ln1.data(),
            &params.get(sa.qkv_weight),
            Some(&params.get(sa.qkv_bias)),
            b,
            h,
            3 * h,
        );
        let mut q = Tensor::zeros(&[b, h]);
        kv_cache_append(
            &mut cache.k[l],
            &mut cache.v[l],
            q.data_mut(),
            qkv.data(),
            b,
            heads,
            hd,
            cache.max_t,
            pos,
        );
        let mut attn = Tensor::zeros(&[b, h]);
        attention_decode_forward(
            attn.data_mut(),
            q.data(),
            &cache.k[l],
            &cache.v[l],
            b,
            heads,
            hd,
            cache.max_t,
            pos + 1,
        );
        let mut proj = Tensor::zeros(&[b, h]);
        matmul_forward(
            proj.data_mut(),
            attn.data(),
            &params.get(sa.proj_weight),
            None,
            b,
            h,
            h,
        );
        let mut mid = Tensor::zeros(&[b, h]);
        bias_dropout_add_forward(
            mid.data_mut(),
            proj.data(),
            &params.get(sa.proj_bias),
            x.data(),
            0.0,
            no_key,
        );
        let (ln2, _) = layer.pre_mlp_layernorm.forward(params, &mid);
        let mut serial = crate::tensor_parallel::serial_group();
        let mut tp = crate::tensor_parallel::Tp::new(&mut serial, false);
        let (y, _) = layer
            .mlp
            .forward(params, &mut tp, &ln2)
            .expect("a group of one rank does not communicate");
        let mut out = Tensor::zeros(&[b, h]);
        bias_dropout_add_forward(
            out.data_mut(),
            y.data(),
            &params.get(layer.mlp.fc2_bias),
            mid.data(),
            0.0,
            no_key,
        );
        x = out;
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
        &params.get(wid),
        None,
        b,
        h,
        v,
    );
    logits
}
