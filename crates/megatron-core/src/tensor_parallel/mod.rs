//! Tensor and sequence parallelism (Megatron's `megatron/core/tensor_parallel/`): the conjugate
//! region operators, column- and row-parallel linear layers, the vocabulary-parallel embedding
//! and cross entropy. Every operator is an explicit forward/backward pair over the TP group.

pub mod cross_entropy;
pub mod duplicated_linear;
pub mod finalize;
pub mod layers;
pub mod mappings;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use duplicated_linear::DuplicatedLinear;
pub use finalize::{
    allreduce_sequence_parallel_grads, grad_norm_squared_tp, grad_norm_tp, sum_f64,
};
pub use layers::{ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};

use megatron_comm::{Communicator, ThreadCommunicator};

/// The tensor-parallel group a forward or backward runs in, and whether the LayerNorm, dropout
/// and residual regions are split along the sequence (`--sequence-parallel`).
pub struct Tp<'a> {
    pub comm: &'a mut dyn Communicator,
    pub sequence_parallel: bool,
    /// The expert-parallel group MoE layers dispatch tokens over (`None`: one rank holds
    /// every expert). It travels with the TP group because both are used inside a layer.
    pub ep: Option<&'a mut dyn Communicator>,
    /// Tensor parallelism inside the experts (`None`: each expert whole on its rank).
    pub etp: Option<&'a mut dyn Communicator>,
    /// Context parallelism: the ranks holding the other chunks of this rank's sequences.
    pub cp: Option<&'a mut dyn Communicator>,
    pub cp_comm_type: crate::context_parallel::CpCommType,
}

impl<'a> Tp<'a> {
    pub fn new(comm: &'a mut dyn Communicator, sequence_parallel: bool) -> Self {
        let sequence_parallel = sequence_parallel && comm.size() > 1;
        Tp {
            comm,
            sequence_parallel,
            ep: None,
            etp: None,
            cp: None,
            cp_comm_type: Default::default(),
        }
    }

    /// The same group with the context-parallel group attention gathers the sequence over.
    pub fn with_context_parallel(
        self,
        cp: &'a mut dyn Communicator,
        cp_comm_type: crate::context_parallel::CpCommType,
    ) -> Self {
        Tp {
            cp: (cp.size() > 1).then_some(cp),
            cp_comm_type,
            ..self
        }
    }

    /// This rank's place in the context-parallel group (one rank without one).
    pub fn cp_layout(&self) -> crate::context_parallel::CpLayout {
        let (rank, size) = self.cp.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
        crate::context_parallel::CpLayout { rank, size }
    }

    /// The context-parallel group, reborrowed for one operation.
    pub fn cp(&mut self) -> Option<&mut dyn Communicator> {
        megatron_comm::reborrow(&mut self.cp)
    }

    /// The same TP group with the expert-parallel and expert-tensor-parallel groups MoE
    /// layers dispatch over.
    pub fn with_expert_parallel(
        self,
        ep: &'a mut dyn Communicator,
        etp: &'a mut dyn Communicator,
    ) -> Self {
        Tp {
            ep: (ep.size() > 1).then_some(ep),
            etp: (etp.size() > 1).then_some(etp),
            ..self
        }
    }
    pub fn size(&self) -> usize {
        self.comm.size()
    }
    /// The expert-tensor-parallel group, reborrowed for one operation.
    pub fn etp(&mut self) -> Option<&mut dyn Communicator> {
        megatron_comm::reborrow(&mut self.etp)
    }
    /// The expert-parallel group, reborrowed for one operation.
    pub fn ep(&mut self) -> Option<&mut dyn Communicator> {
        megatron_comm::reborrow(&mut self.ep)
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// Rows `[lo, hi)` of the `n` tokens this rank holds in sequence-parallel regions (all rows
    /// without sequence parallelism).
    pub fn sequence_shard(&self, n: usize) -> (usize, usize) {
        if self.sequence_parallel {
            let s = n / self.size();
            (self.rank() * s, (self.rank() + 1) * s)
        } else {
            (0, n)
        }
    }
}

/// A group of one rank, for code paths without tensor parallelism (TP = 1).
pub fn serial_group() -> ThreadCommunicator {
    ThreadCommunicator::world(1).pop().expect("one rank")
}
