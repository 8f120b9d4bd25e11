//! Megatron's `initialize_model_parallel`: every group this rank belongs to, as communicators
//! split from the world, plus the start-up health check of each of them.

use crate::communicator::{CommError, Communicator, ReduceOp};
use crate::parallel_state::{Axis, ParallelState};
use std::time::Duration;

/// A group family of `ParallelState` and this rank's communicator in it.
pub struct Group {
    /// Family name as Megatron calls it (`tp`, `pp`, `dp`, `cp`, `dp-cp`, `mp`, `ep`, `etp`, `edp`, `embd`).
    pub family: &'static str,
    /// World ranks of the members, in group-rank order.
    pub members: Vec<usize>,
    pub comm: Box<dyn Communicator>,
}

pub struct ProcessGroups {
    pub state: ParallelState,
    pub world_rank: usize,
    pub tp: Group,
    pub pp: Group,
    pub dp: Group,
    pub cp: Group,
    pub dp_cp: Group,
    /// Model-parallel: TP x PP.
    pub mp: Group,
    pub ep: Group,
    /// Tensor parallelism inside the experts.
    pub etp: Group,
    /// Expert data parallel: ranks holding the same experts (expert gradients are reduced
    /// here). `None` once the optimizer took it.
    pub edp: Option<Group>,
    /// Every rank (expert-parallel, its tensor-parallel, expert-DP and pipeline axes): sums of
    /// the experts' gradient norms. `None` once the optimizer took it.
    pub expert_norm: Option<Group>,
    /// First and last pipeline stage (tied embeddings); `None` on middle stages.
    pub embedding: Option<Group>,
}

fn split_family(
    world: &mut dyn Communicator,
    family: &'static str,
    groups: &[Vec<usize>],
) -> Result<Option<Group>, CommError> {
    let rank = world.rank();
    match ParallelState::group_of(groups, rank) {
        Some((members, pos)) => {
            let color = groups.iter().position(|g| g == members).expect("listed");
            let name = format!("{family}{members:?}");
            let comm = world.split_named(color, pos, &name)?;
            Ok(Some(Group {
                family,
                members: members.to_vec(),
                comm,
            }))
        }
        None => {
            // Not a member (e.g. a middle pipeline stage for the embedding group): still take
            // part in the split, which is collective over the world.
            world.split_named(groups.len(), rank, "none")?;
            Ok(None)
        }
    }
}

impl ProcessGroups {
    /// Splits `world` into every group of `state`. Collective: all world ranks call it.
    pub fn new(world: &mut dyn Communicator, state: ParallelState) -> Result<Self, CommError> {
        let world_rank = world.rank();
        let mut need = |family: &'static str, groups: Vec<Vec<usize>>| {
            split_family(world, family, &groups)
                .map(|g| g.expect("every rank is in one group of each dense family"))
        };
        let tp = need("tp", state.tensor_model_parallel_groups())?;
        let pp = need("pp", state.pipeline_model_parallel_groups())?;
        let dp = need("dp", state.data_parallel_groups())?;
        let cp = need("cp", state.context_parallel_groups())?;
        let dp_cp = need("dp-cp", state.data_parallel_groups_with_cp())?;
        let mp = need("mp", state.model_parallel_groups())?;
        let ep = need("ep", state.expert_groups(&[Axis::Ep]))?;
        let etp = need("etp", state.expert_tensor_parallel_groups())?;
        let edp = Some(need("edp", state.expert_data_parallel_groups())?);
        let expert_norm = Some(need(
            "expt-all",
            state.expert_groups(&[Axis::Tp, Axis::Ep, Axis::Dp, Axis::Pp]),
        )?);
        let embedding = split_family(world, "embd", &state.embedding_groups())?;
        Ok(ProcessGroups {
            state,
            world_rank,
            tp,
            pp,
            dp,
            cp,
            dp_cp,
            mp,
            ep,
            etp,
            edp,
            expert_norm,
            embedding,
        })
    }

    pub fn all_mut(&mut self) -> Vec<&mut Group> {
        let mut v = vec![
            &mut self.tp,
            &mut self.pp,
            &mut self.dp,
            &mut self.cp,
            &mut self.dp_cp,
            &mut self.mp,
            &mut self.ep,
            &mut self.etp,
        ];
        if let Some(e) = self.edp.as_mut() {
            v.push(e);
        }
        if let Some(e) = self.expert_norm.as_mut() {
            v.push(e);
        }
        if let Some(e) = self.embedding.as_mut() {
            v.push(e);
        }
        v
    }

    /// Every group all-reduces its members' world ranks under a short timeout and compares
    /// with the known sum; the error names the family and members of the failing group.
    /// Restores each group's previous timeout afterwards.
    pub fn health_check(&mut self, timeout: Duration, restore: Duration) -> Result<(), String> {
        let rank = self.world_rank;
        for g in self.all_mut() {
            g.comm.set_timeout(timeout);
            let mut v = [rank as f32];
            let r = g.comm.all_reduce(&mut v, ReduceOp::Sum);
            g.comm.set_timeout(restore);
            let want = g.members.iter().sum::<usize>() as f32;
            match r {
                Err(e) => {
                    return Err(format!(
                        "health check of {} group {:?} failed on rank {rank}: {e}",
                        g.family, g.members
                    ))
                }
                Ok(()) if v[0] != want => {
                    return Err(format!(
                        "health check of {} group {:?} on rank {rank}: all-reduce gave {}, expected {want}",
                        g.family, g.members, v[0]
                    ))
                }
                Ok(()) => {}
            }
        }
        Ok(())
    }
}
