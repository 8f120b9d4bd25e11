//! T5's relative position bias (megatron-core's `RelativePositionEmbedding`, Hugging Face's
//! `relative_attention_bias` of block 0): a `[num_buckets, heads]` table, one per stack
//! (bidirectional buckets in the encoder, causal ones in the decoder), looked up once per
//! micro-batch into every layer's `[heads, tq, tk]` bias; its gradient is the sum of the
//! layers' bias gradients. Split over tensor parallelism by heads, as the attention is.

use crate::params::{Grads, Init, ParamId, Params, Sharding};
use megatron_tensor::cpu::attention_bias::{
    relative_position_bias_backward, relative_position_bias_forward, RelativePositionDims,
};

pub struct RelativePositionBias {
    pub table: ParamId,
    num_buckets: usize,
    max_distance: usize,
    bidirectional: bool,
    /// This rank's heads.
    heads: usize,
}

impl RelativePositionBias {
    /// Registers `{prefix}.relative_attention_bias.weight` (`[num_buckets, heads]`).
    pub fn new(
        prefix: &str,
        (num_buckets, max_distance): (usize, usize),
        bidirectional: bool,
        heads: usize,
        init_std: f32,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let table = params.add_sharded(
            inits,
            format!("{prefix}.relative_attention_bias.weight"),
            &[num_buckets, heads],
            false,
            Init::Normal(init_std),
            Sharding::Split(1),
        );
        RelativePositionBias {
            table,
            num_buckets,
            max_distance,
            bidirectional,
            heads: heads / params.tp.1.max(1),
        }
    }

    fn dims(&self, tq: usize, tk: usize) -> RelativePositionDims {
        RelativePositionDims {
            tq,
            tk,
            heads: self.heads,
            num_buckets: self.num_buckets,
            max_distance: self.max_distance,
            bidirectional: self.bidirectional,
        }
    }

    /// This rank's heads' `[heads, tq, tk]` bias.
    pub fn forward(&self, params: &Params, tq: usize, tk: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; self.heads * tq * tk];
        relative_position_bias_forward(&mut out, &params.get(self.table), self.dims(tq, tk));
        out
    }

    /// Accumulates the table's gradient from the bias gradient `dbias` (`[heads, tq, tk]`).
    pub fn backward(&self, grads: &mut Grads, dbias: &[f32], tq: usize, tk: usize) {
        relative_position_bias_backward(grads.get_mut(self.table), dbias, self.dims(tq, tk));
    }
}
