//! `ColumnParallelLinear`, `RowParallelLinear` and `VocabParallelEmbedding`: a region operator,
//! the local kernel, a region operator; backward is the same three in reverse.

use super::mappings::*;
use super::Tp;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use megatron_comm::CommError;
use megatron_tensor::cpu::matmul::Operand;
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, matmul_backward, matmul_forward,
};
use megatron_tensor::Tensor;

/// `Y = X A^T + b` with `A` split along its output rows: each rank computes `out / t` output
/// columns. The input is complete on every rank (or, under sequence parallelism, all-gathered
/// from the ranks' token blocks).
pub struct ColumnParallelLinear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub input_size: usize,
    pub output_size_per_partition: usize,
    /// All-gather the output's last dimension (Megatron's default is false: the next layer is
    /// row-parallel or the vocabulary-parallel loss).
    pub gather_output: bool,
    /// Leave the bias to the caller (fused into the next kernel); its gradient too.
    pub skip_bias_add: bool,
}

impl ColumnParallelLinear {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        params: &mut Params,
        inits: &mut Vec<Init>,
        prefix: &str,
        input_size: usize,
        output_size: usize,
        bias: bool,
        init_std: f32,
        gather_output: bool,
        skip_bias_add: bool,
    ) -> Self {
        let sharding = Sharding::Split(0);
        Self::register(
            params,
            inits,
            prefix,
            input_size,
            output_size,
            bias,
            init_std,
            sharding,
        )
        .with_output(gather_output, skip_bias_add)
    }

    /// megatron-core's fused SwiGLU `linear_fc1`: `[gate; up]` (`2 * each` outputs), split so
    /// that a rank holds `[gate_r; up_r]` and applies SwiGLU to its own columns; the bias (if
    /// any) is added in the GEMM.
    #[allow(clippy::too_many_arguments)]
    pub fn new_gated(
        params: &mut Params,
        inits: &mut Vec<Init>,
        prefix: &str,
        input_size: usize,
        each: usize,
        bias: bool,
        init_std: f32,
    ) -> Self {
        let sharding = Sharding::SplitChunks(2);
        Self::register(
            params,
            inits,
            prefix,
            input_size,
            2 * each,
            bias,
            init_std,
            sharding,
        )
    }

    fn with_output(mut self, gather_output: bool, skip_bias_add: bool) -> Self {
        self.gather_output = gather_output;
        self.skip_bias_add = skip_bias_add;
        self
    }

    #[allow(clippy::too_many_arguments)]
    fn register(
        params: &mut Params,
        inits: &mut Vec<Init>,
        prefix: &str,
        input_size: usize,
        output_size: usize,
        bias: bool,
        init_std: f32,
        sharding: Sharding,
    ) -> Self {
        let t = params.tp.1.max(1);
        let weight = params.add_sharded(
            inits,
            format!("{prefix}.weight"),
            &[output_size, input_size],
            true,
            Init::Normal(init_std),
            sharding,
        );
        let bias = bias.then(|| {
            params.add_sharded(
                inits,
                format!("{prefix}.bias"),
                &[output_size],
                false,
                Init::Const(0.0),
                sharding,
            )
        });
        ColumnParallelLinear {
            weight,
            bias,
            input_size,
            output_size_per_partition: output_size / t,
            gather_output: false,
            skip_bias_add: false,
        }
    }

    /// `x` is `[tokens, in]` (under sequence parallelism this rank's `[tokens / t, in]`).
    pub fn forward(&self, params: &Params, tp: &mut Tp, x: &Tensor) -> Result<Tensor, CommError> {
        let gathered;
        let xf = if tp.sequence_parallel {
            gathered = gather_from_sequence_parallel_region_forward(tp, x)?;
            &gathered
        } else {
            x
        };
        let n = xf.shape()[0];
        let (k, m) = (self.input_size, self.output_size_per_partition);
        let mut y = Tensor::for_overwrite(&[n, m]);
        let bias = match (self.bias, self.skip_bias_add) {
            (Some(b), false) => Some(params.get(b)),
            _ => None,
        };
        matmul_forward(
            y.data_mut(),
            xf.operand(),
            params.operand(self.weight).operand(),
            bias.as_deref(),
            n,
            k,
            m,
        );
        if self.gather_output {
            gather_from_tensor_model_parallel_region_forward(tp, y)
        } else {
            Ok(y)
        }
    }

    /// `x` is the forward input (recomputed or saved), `dy` the output gradient. Under sequence
    /// parallelism the input is all-gathered again for the weight gradient (as Megatron does,
    /// so the gathered input is never kept) and the input gradient is reduce-scattered.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        x: &Tensor,
        dy: Tensor,
    ) -> Result<Tensor, CommError> {
        let dy = if self.gather_output {
            gather_from_tensor_model_parallel_region_backward(tp, dy)
        } else {
            dy
        };
        let gathered;
        let xf = if tp.sequence_parallel {
            gathered = gather_from_sequence_parallel_region_forward(tp, x)?;
            &gathered
        } else {
            x
        };
        let n = xf.shape()[0];
        let (k, m) = (self.input_size, self.output_size_per_partition);
        let mut dx = Tensor::for_overwrite(&[n, k]);
        match (self.bias, self.skip_bias_add) {
            (Some(b), false) => {
                let [dw, db] = grads.many_mut([self.weight, b]);
                matmul_backward(
                    Some(dx.data_mut()),
                    dw,
                    Some(db),
                    dy.data(),
                    xf.operand(),
                    params.operand(self.weight).operand(),
                    n,
                    k,
                    m,
                );
            }
            _ => matmul_backward(
                Some(dx.data_mut()),
                grads.get_mut(self.weight),
                None,
                dy.data(),
                xf.operand(),
                params.operand(self.weight).operand(),
                n,
                k,
                m,
            ),
        }
        if tp.sequence_parallel {
            gather_from_sequence_parallel_region_backward(tp, &dx)
        } else {
            copy_to_tensor_model_parallel_region_backward(tp, dx)
        }
    }
}

/// `Y = X A^T` with `A` split along its input columns: each rank multiplies its slice of the
/// input features and the partial outputs are summed (all-reduce, or reduce-scatter over the
/// tokens under sequence parallelism). The bias is not sharded and is added after the
/// reduction by the caller (fused into bias-dropout-add), as Megatron's `skip_bias_add`.
pub struct RowParallelLinear {
    pub weight: ParamId,
    /// `None` under `--disable-bias-linear`.
    pub bias: Option<ParamId>,
    pub input_size_per_partition: usize,
    pub output_size: usize,
    /// The input already holds this rank's features; otherwise it is split here.
    pub input_is_parallel: bool,
}

impl RowParallelLinear {
    pub fn new(
        params: &mut Params,
        inits: &mut Vec<Init>,
        prefix: &str,
        input_size: usize,
        output_size: usize,
        bias: bool,
        init_std: f32,
        input_is_parallel: bool,
    ) -> Self {
        let t = params.tp.1.max(1);
        let weight = params.add_sharded(
            inits,
            format!("{prefix}.weight"),
            &[output_size, input_size],
            true,
            Init::Normal(init_std),
            Sharding::Split(1),
        );
        let bias = bias.then(|| {
            params.add_sharded(
                inits,
                format!("{prefix}.bias"),
                &[output_size],
                false,
                Init::Const(0.0),
                Sharding::ReplicatedSequenceParallel,
            )
        });
        RowParallelLinear {
            weight,
            bias,
            input_size_per_partition: input_size / t,
            output_size,
            input_is_parallel,
        }
    }

    /// Returns the reduced output without bias: `[tokens, out]`, or this rank's
    /// `[tokens / t, out]` under sequence parallelism.
    pub fn forward(&self, params: &Params, tp: &mut Tp, x: &Tensor) -> Result<Tensor, CommError> {
        let split;
        let x = if self.input_is_parallel {
            x
        } else {
            split = scatter_to_tensor_model_parallel_region_forward(tp, x.clone());
            &split
        };
        let n = x.shape()[0];
        let (k, m) = (self.input_size_per_partition, self.output_size);
        let mut y = Tensor::for_overwrite(&[n, m]);
        matmul_forward(
            y.data_mut(),
            x.operand(),
            params.operand(self.weight).operand(),
            None,
            n,
            k,
            m,
        );
        reduce_to_output_region_forward(tp, y)
    }

    /// `x` is the forward input (this rank's features), `dy` the gradient of the reduced output.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        x: &Tensor,
        dy: Tensor,
    ) -> Result<Tensor, CommError> {
        let dy = reduce_to_output_region_backward(tp, dy)?;
        let split;
        let xl = if self.input_is_parallel {
            x
        } else {
            split = scatter_to_tensor_model_parallel_region_forward(tp, x.clone());
            &split
        };
        let n = dy.shape()[0];
        let (k, m) = (self.input_size_per_partition, self.output_size);
        let mut dx = Tensor::for_overwrite(&[n, k]);
        matmul_backward(
            Some(dx.data_mut()),
            grads.get_mut(self.weight),
            None,
            dy.data(),
            xl.operand(),
            params.operand(self.weight).operand(),
            n,
            k,
            m,
        );
        if self.input_is_parallel {
            Ok(dx)
        } else {
            scatter_to_tensor_model_parallel_region_backward(tp, dx)
        }
    }
}

/// The word embedding with the (padded) vocabulary split over TP ranks: each rank looks up the
/// ids it owns (zeros for the others) and the partial rows are summed (all-reduce, or
/// reduce-scatter over the tokens under sequence parallelism).
pub struct VocabParallelEmbedding {
    pub weight: ParamId,
    pub vocab_start: usize,
    pub vocab_per_partition: usize,
    pub hidden: usize,
}

impl VocabParallelEmbedding {
    pub fn new(
        params: &mut Params,
        inits: &mut Vec<Init>,
        name: &str,
        padded_vocab: usize,
        hidden: usize,
        init_std: f32,
    ) -> Self {
        let weight = params.add_sharded(
            inits,
            name.to_string(),
            &[padded_vocab, hidden],
            true,
            Init::Normal(init_std),
            Sharding::Split(0),
        );
        Self::over(params, weight, padded_vocab, hidden)
    }

    /// The embedding of an already registered `[padded_vocab, hidden]` table (a copy of the
    /// first stage's on another pipeline stage).
    pub fn over(params: &Params, weight: ParamId, padded_vocab: usize, hidden: usize) -> Self {
        let (rank, t) = (params.tp.0, params.tp.1.max(1));
        let per = padded_vocab / t;
        VocabParallelEmbedding {
            weight,
            vocab_start: rank * per,
            vocab_per_partition: per,
            hidden,
        }
    }

    pub fn forward(&self, params: &Params, tp: &mut Tp, ids: &[u32]) -> Result<Tensor, CommError> {
        let mut out = Tensor::for_overwrite(&[ids.len(), self.hidden]);
        let (o, start) = (out.data_mut(), self.vocab_start);
        match params.operand(self.weight).operand() {
            Operand::F32(table) => embedding_lookup_forward(o, ids, table, start, false),
            Operand::BF16(table) => embedding_lookup_forward(o, ids, table, start, false),
        }
        reduce_to_output_region_forward(tp, out)
    }

    /// `dout` is the gradient of the reduced output (this rank's token block under sequence
    /// parallelism). Gradients land only in the owned rows.
    pub fn backward(
        &self,
        grads: &mut Grads,
        tp: &mut Tp,
        ids: &[u32],
        dout: Tensor,
    ) -> Result<(), CommError> {
        let dout = reduce_to_output_region_backward(tp, dout)?;
        embedding_lookup_backward(
            grads.get_mut(self.weight),
            dout.data(),
            ids,
            self.vocab_start,
        );
        Ok(())
    }
}
