//! Token dispatchers (megatron-core's `token_dispatcher.py`): move each routed (token, slot)
//! row to the rank holding its expert and the expert outputs back, as an explicit forward and
//! backward pair.
//!
//! Every dispatcher hands the experts the same rows in the same order — for each local expert,
//! the rows of expert-parallel rank 0's tokens, then rank 1's, ..., each in token order — so
//! the experts' results do not depend on the dispatcher or on the number of expert-parallel
//! ranks (one rank is the special case with no communication).
//!
//! - [`TokenDispatcherType::AllToAll`]: count rows per expert, sort this rank's rows by expert,
//!   all-gather the counts over EP (every rank then knows every split), all-to-all-v the rows,
//!   regroup what arrived from (source rank, expert) order into (expert, source rank) order.
//!   Combine runs the same steps backwards and weights rows by their probabilities at the
//!   source, where the probabilities live.
//! - [`TokenDispatcherType::AllGather`]: all-gather every rank's tokens and routing over EP,
//!   keep the rows of local experts, weight outputs by their probabilities and reduce-scatter
//!   the partial sums back to the owners.

use crate::tensor_parallel::Tp;
use crate::transformer::config::TokenDispatcherType;
use megatron_comm::{CommError, Communicator, ReduceOp};
use megatron_tensor::cpu::moe_permute::{
    gather_rows, gather_rows_scaled, rows_dot, scatter_add_rows,
};
use megatron_tensor::Tensor;

/// A row slot that carries no routing weight: a padding row (`--moe-pad-expert-input-to-capacity`).
pub const NO_SLOT: u32 = u32::MAX;

/// The rows this rank's tokens send to the experts: `rows[i] = (token, slot)` sorted by expert
/// and, within one, by token (`slot` indexes the routing probabilities, `t * topk + j`, or is
/// [`NO_SLOT`] for padding), `counts[e]` rows for expert `e`.
pub struct Assignment {
    pub rows: Vec<(u32, u32)>,
    pub counts: Vec<usize>,
    pub tokens: usize,
    pub topk: usize,
    /// Routing weight of each slot.
    pub probs: Vec<f32>,
}

/// Where every row goes, fixed at dispatch and reused by combine and both backward passes.
pub struct DispatchPlan {
    /// This rank's rows (token, slot), sorted by global expert, token order within one.
    order: Vec<(u32, u32)>,
    /// Rows per local expert in the experts' buffer.
    pub local_counts: Vec<usize>,
    /// Rows this rank's tokens send to each global expert (load statistics).
    pub tokens_per_expert: Vec<usize>,
    kind: Kind,
    hidden: usize,
    tokens: usize,
    /// This rank's routing weights per slot.
    pub probs: Vec<f32>,
    /// Under expert tensor parallelism: every ETP rank's rows are gathered for the experts'
    /// slices and their partial outputs reduce-scattered back.
    etp: Option<EtpPlan>,
}

enum Kind {
    Local,
    AllToAll {
        /// Rows sent to / received from each EP rank.
        send: Vec<usize>,
        recv: Vec<usize>,
        /// Expert-buffer row `i` is received row `regroup[i]`.
        regroup: Vec<u32>,
    },
    AllGather {
        /// Expert-buffer row `i` is gathered token `token[i]`, slot `slot[i]`.
        token: Vec<u32>,
        slot: Vec<u32>,
        /// Every EP rank's probabilities, in rank order.
        probs: Vec<f32>,
        ep: usize,
    },
}

fn invert(perm: &[u32]) -> Vec<u32> {
    let mut inv = vec![0u32; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p as usize] = i as u32;
    }
    inv
}

impl DispatchPlan {
    /// Plans the dispatch of this rank's routed rows to `num_experts` experts held in equal
    /// blocks by the ranks of the expert-parallel group (none: all here), each split over the
    /// expert-tensor-parallel group. Collective over both.
    pub fn new(
        routing: &Assignment,
        num_experts: usize,
        hidden: usize,
        kind: TokenDispatcherType,
        tp: &mut Tp,
    ) -> Result<Self, CommError> {
        let mut plan = Self::new_ep(routing, num_experts, hidden, kind, tp.ep())?;
        if let Some(etp) = tp.etp() {
            let etp_plan = EtpPlan::new(&plan.local_counts, etp)?;
            plan.local_counts = etp_plan.totals();
            plan.etp = Some(etp_plan);
        }
        Ok(plan)
    }

    fn new_ep(
        routing: &Assignment,
        num_experts: usize,
        hidden: usize,
        kind: TokenDispatcherType,
        ep: Option<&mut dyn Communicator>,
    ) -> Result<Self, CommError> {
        let (k, tokens) = (routing.topk, routing.tokens);
        let (order, counts) = (routing.rows.clone(), routing.counts.clone());
        let my_probs = routing.probs.clone();
        let Some(ep) = ep else {
            return Ok(DispatchPlan {
                order,
                local_counts: counts.clone(),
                tokens_per_expert: counts,
                kind: Kind::Local,
                hidden,
                tokens,
                probs: my_probs,
                etp: None,
            });
        };
        let (p, me) = (ep.size(), ep.rank());
        let per = num_experts / p;
        let mine = me * per..(me + 1) * per;
        let kind_of = match kind {
            TokenDispatcherType::AllToAll => {
                let c: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
                let mut all = vec![0.0f32; p * num_experts];
                ep.all_gather(&c, &mut all)?;
                let all: Vec<usize> = all.iter().map(|&c| c as usize).collect();
                let cnt = |src: usize, e: usize| all[src * num_experts + e];
                let send = (0..p)
                    .map(|q| (q * per..(q + 1) * per).map(|e| counts[e]).sum())
                    .collect();
                let recv: Vec<usize> = (0..p)
                    .map(|src| mine.clone().map(|e| cnt(src, e)).sum())
                    .collect();
                // Received: source-major, then expert; the experts want expert-major.
                let start: Vec<usize> = recv
                    .iter()
                    .scan(0, |s, &r| {
                        let v = *s;
                        *s += r;
                        Some(v)
                    })
                    .collect();
                let mut regroup = Vec::with_capacity(recv.iter().sum());
                let mut local_counts = vec![0usize; per];
                for (l, e) in mine.clone().enumerate() {
                    for (src, &first) in start.iter().enumerate() {
                        let before: usize = (mine.start..e).map(|x| cnt(src, x)).sum();
                        let lo = first + before;
                        regroup.extend((lo..lo + cnt(src, e)).map(|r| r as u32));
                        local_counts[l] += cnt(src, e);
                    }
                }
                (
                    Kind::AllToAll {
                        send,
                        recv,
                        regroup,
                    },
                    local_counts,
                )
            }
            TokenDispatcherType::AllGather => {
                // Every rank's rows as a dense [token, expert] map of slots (-1: no row).
                let mut slot_of = vec![-1.0f32; tokens * num_experts];
                let mut at = 0;
                for (e, &c) in counts.iter().enumerate() {
                    for &(t, sl) in &order[at..at + c] {
                        slot_of[t as usize * num_experts + e] =
                            if sl == NO_SLOT { -2.0 } else { sl as f32 };
                    }
                    at += c;
                }
                let mut all_slots = vec![0.0f32; p * slot_of.len()];
                ep.all_gather(&slot_of, &mut all_slots)?;
                let n_probs = tokens * k;
                let mut probs = vec![0.0f32; p * n_probs];
                ep.all_gather(&routing.probs, &mut probs)?;
                let (mut token, mut slot) = (Vec::new(), Vec::new());
                let mut local_counts = vec![0usize; per];
                for (l, e) in mine.clone().enumerate() {
                    for src in 0..p {
                        for t in 0..tokens {
                            let v = all_slots[(src * tokens + t) * num_experts + e];
                            if v == -1.0 {
                                continue;
                            }
                            token.push((src * tokens + t) as u32);
                            slot.push(if v == -2.0 {
                                NO_SLOT
                            } else {
                                (src * n_probs) as u32 + v as u32
                            });
                            local_counts[l] += 1;
                        }
                    }
                }
                (
                    Kind::AllGather {
                        token,
                        slot,
                        probs,
                        ep: p,
                    },
                    local_counts,
                )
            }
        };
        Ok(DispatchPlan {
            order,
            local_counts: kind_of.1,
            tokens_per_expert: counts,
            kind: kind_of.0,
            hidden,
            tokens,
            probs: my_probs,
            etp: None,
        })
    }

    /// Rows of the experts' buffer.
    pub fn rows(&self) -> usize {
        self.local_counts.iter().sum()
    }

    /// The token of each of this rank's rows.
    fn sorted_tokens(&self) -> Vec<u32> {
        self.order.iter().map(|&(t, _)| t).collect()
    }

    /// The routing weight of each of this rank's rows (0 for padding).
    fn sorted_scales(&self) -> Vec<f32> {
        let slots: Vec<u32> = self.order.iter().map(|&(_, s)| s).collect();
        weights(&slots, &self.probs)
    }

    /// Rows of this rank's buffer before the expert-tensor-parallel gather.
    fn ep_rows(&self) -> usize {
        self.etp
            .as_ref()
            .map_or_else(|| self.rows(), |e| e.own_rows())
    }

    /// `x` (`[tokens, h]`, this rank's) to the experts' buffer, in `x`'s storage type. A bf16
    /// `x` (under `--bf16`, whose expert GEMMs would round the rows to bf16 anyway) travels as
    /// f32 words of two bf16 values each: every step of the dispatch only copies whole rows, so
    /// the bit pairs arrive intact, at half the bytes of f32 rows (Megatron dispatches its
    /// 16-bit activations likewise).
    pub fn dispatch(&self, x: &Tensor, tp: &mut Tp) -> Result<Tensor, CommError> {
        match x.bf16_words().filter(|_| self.hidden.is_multiple_of(2)) {
            Some(words) => {
                let out = self.dispatch_rows(words, self.hidden / 2, tp)?;
                Ok(Tensor::bf16_from_words(out, &[self.rows(), self.hidden]))
            }
            None => self.dispatch_rows(
                crate::transformer::saved::restore(x).data(),
                self.hidden,
                tp,
            ),
        }
    }

    /// [`DispatchPlan::dispatch`] of rows `w` words wide.
    fn dispatch_rows(&self, x: &[f32], w: usize, tp: &mut Tp) -> Result<Tensor, CommError> {
        let xj = self.dispatch_ep(x, w, tp.ep())?;
        match (&self.etp, tp.etp()) {
            (Some(e), Some(c)) => e.gather(&xj, w, c),
            _ => Ok(xj),
        }
    }

    /// The experts' outputs `y` (partial sums over the expert-tensor-parallel group under
    /// it) back to their tokens, weighted by the routing probabilities: `[tokens, h]`, and the
    /// rows backward needs for the probabilities' gradients.
    pub fn combine(&self, y: Tensor, tp: &mut Tp) -> Result<(Tensor, Tensor), CommError> {
        let yj = match (&self.etp, tp.etp()) {
            (Some(e), Some(c)) => e.reduce_scatter(&y, self.hidden, c)?,
            _ => y,
        };
        self.combine_ep(yj, tp.ep())
    }

    /// Backward of [`DispatchPlan::combine`]: from `dout` (`[tokens, h]`) the gradient of the
    /// experts' outputs (their buffer's rows) and of this rank's routing probabilities.
    pub fn combine_backward(
        &self,
        dout: &Tensor,
        kept: &Tensor,
        tp: &mut Tp,
    ) -> Result<(Tensor, Vec<f32>), CommError> {
        let (dyj, dprobs) = self.combine_backward_ep(dout, kept, tp.ep())?;
        let dy = match (&self.etp, tp.etp()) {
            (Some(e), Some(c)) => e.gather(&dyj, self.hidden, c)?,
            _ => dyj,
        };
        Ok((dy, dprobs))
    }

    /// Backward of [`DispatchPlan::dispatch`]: the experts' input gradients (buffer rows,
    /// partial over the expert-tensor-parallel group under it) summed back onto this rank's
    /// tokens, `[tokens, h]`.
    pub fn dispatch_backward(&self, dxe: Tensor, tp: &mut Tp) -> Result<Tensor, CommError> {
        let dxj = match (&self.etp, tp.etp()) {
            (Some(e), Some(c)) => e.reduce_scatter(&dxe, self.hidden, c)?,
            _ => dxe,
        };
        self.dispatch_backward_ep(dxj, tp.ep())
    }

    /// The expert-parallel stage of [`DispatchPlan::dispatch`].
    fn dispatch_ep(
        &self,
        x: &[f32],
        h: usize,
        ep: Option<&mut dyn Communicator>,
    ) -> Result<Tensor, CommError> {
        let mut out = Tensor::for_overwrite(&[self.ep_rows(), h]);
        match &self.kind {
            Kind::Local => gather_rows(out.data_mut(), x, &self.sorted_tokens(), h),
            Kind::AllToAll {
                send,
                recv,
                regroup,
            } => {
                let mut sorted = vec![0.0f32; self.order.len() * h];
                gather_rows(&mut sorted, x, &self.sorted_tokens(), h);
                let got = exchange(&sorted, send, recv, h, ep)?;
                gather_rows(out.data_mut(), got.data(), regroup, h);
            }
            Kind::AllGather { token, ep: p, .. } => {
                let mut all = vec![0.0f32; p * x.len()];
                expect(ep).all_gather(x, &mut all)?;
                gather_rows(out.data_mut(), &all, token, h);
            }
        }
        Ok(out)
    }

    /// The expert-parallel stage of [`DispatchPlan::combine`].
    fn combine_ep(
        &self,
        y: Tensor,
        ep: Option<&mut dyn Communicator>,
    ) -> Result<(Tensor, Tensor), CommError> {
        let h = self.hidden;
        let mut out = Tensor::zeros(&[self.tokens, h]);
        match &self.kind {
            Kind::Local => {
                let scales = self.sorted_scales();
                scatter_add_rows(
                    out.data_mut(),
                    y.data(),
                    &self.sorted_tokens(),
                    Some(&scales),
                    h,
                );
                Ok((out, y))
            }
            Kind::AllToAll {
                send,
                recv,
                regroup,
            } => {
                let mut back = vec![0.0f32; y.numel()];
                gather_rows(&mut back, y.data(), &invert(regroup), h);
                drop(y);
                let sorted = exchange(&back, recv, send, h, ep)?;
                let scales = self.sorted_scales();
                let tokens = self.sorted_tokens();
                scatter_add_rows(out.data_mut(), sorted.data(), &tokens, Some(&scales), h);
                Ok((out, sorted))
            }
            Kind::AllGather {
                token,
                slot,
                probs: all_probs,
                ep: p,
            } => {
                let scales = weights(slot, all_probs);
                let mut partial = vec![0.0f32; p * self.tokens * h];
                scatter_add_rows(&mut partial, y.data(), token, Some(&scales), h);
                expect(ep).reduce_scatter(&partial, out.data_mut(), ReduceOp::Sum)?;
                Ok((out, y))
            }
        }
    }

    /// The expert-parallel stage of [`DispatchPlan::combine_backward`].
    fn combine_backward_ep(
        &self,
        dout: &Tensor,
        kept: &Tensor,
        ep: Option<&mut dyn Communicator>,
    ) -> Result<(Tensor, Vec<f32>), CommError> {
        let h = self.hidden;
        let mut dprobs = vec![0.0f32; self.probs.len()];
        let sorted_grads = |dprobs: &mut [f32]| {
            // d(prob) = <dout[token], y>, d(y) = prob * dout[token], per sorted slot.
            let tokens = self.sorted_tokens();
            let mut dp = vec![0.0f32; tokens.len()];
            rows_dot(&mut dp, dout.data(), &tokens, kept.operand(), h);
            for (&(_, j), v) in self.order.iter().zip(&dp) {
                if j != NO_SLOT {
                    dprobs[j as usize] = *v;
                }
            }
            let scales = self.sorted_scales();
            let mut dy = Tensor::for_overwrite(&[tokens.len(), h]);
            gather_rows_scaled(dy.data_mut(), dout.data(), &tokens, &scales, h);
            dy
        };
        match &self.kind {
            Kind::Local => Ok((sorted_grads(&mut dprobs), dprobs)),
            Kind::AllToAll {
                send,
                recv,
                regroup,
            } => {
                let dy = sorted_grads(&mut dprobs);
                let got = exchange(dy.data(), send, recv, h, ep)?;
                drop(dy);
                let mut out = Tensor::for_overwrite(&[self.ep_rows(), h]);
                gather_rows(out.data_mut(), got.data(), regroup, h);
                Ok((out, dprobs))
            }
            Kind::AllGather {
                token,
                slot,
                probs: all_probs,
                ep: p,
            } => {
                let ep = expect(ep);
                let mut all = vec![0.0f32; p * dout.numel()];
                ep.all_gather(dout.data(), &mut all)?;
                let mut dp = vec![0.0f32; token.len()];
                rows_dot(&mut dp, &all, token, kept.operand(), h);
                let mut dprob_all = vec![0.0f32; p * self.probs.len()];
                for (&s, v) in slot.iter().zip(&dp) {
                    if s != NO_SLOT {
                        dprob_all[s as usize] = *v;
                    }
                }
                ep.reduce_scatter(&dprob_all, &mut dprobs, ReduceOp::Sum)?;
                let scales = weights(slot, all_probs);
                let mut out = Tensor::for_overwrite(&[self.ep_rows(), h]);
                gather_rows_scaled(out.data_mut(), &all, token, &scales, h);
                Ok((out, dprobs))
            }
        }
    }

    /// The expert-parallel stage of [`DispatchPlan::dispatch_backward`].
    fn dispatch_backward_ep(
        &self,
        dxe: Tensor,
        ep: Option<&mut dyn Communicator>,
    ) -> Result<Tensor, CommError> {
        let h = self.hidden;
        let mut dx = Tensor::zeros(&[self.tokens, h]);
        match &self.kind {
            Kind::Local => {
                scatter_add_rows(dx.data_mut(), dxe.data(), &self.sorted_tokens(), None, h);
            }
            Kind::AllToAll {
                send,
                recv,
                regroup,
            } => {
                let mut back = vec![0.0f32; dxe.numel()];
                gather_rows(&mut back, dxe.data(), &invert(regroup), h);
                drop(dxe);
                let sorted = exchange(&back, recv, send, h, ep)?;
                let tokens = self.sorted_tokens();
                scatter_add_rows(dx.data_mut(), sorted.data(), &tokens, None, h);
            }
            Kind::AllGather { token, ep: p, .. } => {
                let mut partial = vec![0.0f32; p * self.tokens * h];
                scatter_add_rows(&mut partial, dxe.data(), token, None, h);
                expect(ep).reduce_scatter(&partial, dx.data_mut(), ReduceOp::Sum)?;
            }
        }
        Ok(dx)
    }
}

/// The routing weight of each slot (0 for a padding row).
fn weights(slots: &[u32], probs: &[f32]) -> Vec<f32> {
    slots
        .iter()
        .map(|&s| if s == NO_SLOT { 0.0 } else { probs[s as usize] })
        .collect()
}

fn expect(ep: Option<&mut dyn Communicator>) -> &mut dyn Communicator {
    ep.expect("a plan made over an expert-parallel group is used with it")
}

/// All-to-all-v of rows of `h`: `send[q]` rows to rank q, `recv[q]` rows from it.
fn exchange(
    rows: &[f32],
    send: &[usize],
    recv: &[usize],
    h: usize,
    ep: Option<&mut dyn Communicator>,
) -> Result<Tensor, CommError> {
    let sc: Vec<usize> = send.iter().map(|&r| r * h).collect();
    let rc: Vec<usize> = recv.iter().map(|&r| r * h).collect();
    let mut out = Tensor::for_overwrite(&[recv.iter().sum(), h]);
    expect(ep).all_to_all_v(rows, &sc, out.data_mut(), &rc)?;
    Ok(out)
}

/// The expert-tensor-parallel stage: each ETP rank brings `counts[j][l]` rows for local expert
/// `l`; the experts' slices need all of them, in (expert, ETP rank) order. Rows travel padded
/// to the largest rank's count so the collectives are the equal-split ones.
struct EtpPlan {
    counts: Vec<Vec<usize>>,
    me: usize,
    max_rows: usize,
    /// Gathered-buffer row `i` (expert-major) is padded row `padded[i]`.
    padded: Vec<u32>,
}

impl EtpPlan {
    fn new(own: &[usize], etp: &mut dyn Communicator) -> Result<Self, CommError> {
        let (t, l) = (etp.size(), own.len());
        let mine: Vec<f32> = own.iter().map(|&c| c as f32).collect();
        let mut all = vec![0.0f32; t * l];
        etp.all_gather(&mine, &mut all)?;
        let counts: Vec<Vec<usize>> = all
            .chunks(l.max(1))
            .map(|c| c.iter().map(|&x| x as usize).collect())
            .collect();
        let max_rows = counts
            .iter()
            .map(|c| c.iter().sum::<usize>())
            .max()
            .unwrap_or(0);
        let mut padded = Vec::new();
        for e in 0..l {
            for (j, c) in counts.iter().enumerate() {
                let lo = j * max_rows + c[..e].iter().sum::<usize>();
                padded.extend((lo..lo + c[e]).map(|r| r as u32));
            }
        }
        Ok(EtpPlan {
            counts,
            me: etp.rank(),
            max_rows,
            padded,
        })
    }

    fn own_rows(&self) -> usize {
        self.counts[self.me].iter().sum()
    }

    /// Rows per local expert over every ETP rank.
    fn totals(&self) -> Vec<usize> {
        (0..self.counts[0].len())
            .map(|e| self.counts.iter().map(|c| c[e]).sum())
            .collect()
    }

    /// Every ETP rank's rows, expert-major.
    fn gather(
        &self,
        x: &Tensor,
        h: usize,
        etp: &mut dyn Communicator,
    ) -> Result<Tensor, CommError> {
        let mut mine = vec![0.0f32; self.max_rows * h];
        mine[..x.numel()].copy_from_slice(x.data());
        let mut all = vec![0.0f32; self.counts.len() * self.max_rows * h];
        etp.all_gather(&mine, &mut all)?;
        let mut out = Tensor::for_overwrite(&[self.padded.len(), h]);
        gather_rows(out.data_mut(), &all, &self.padded, h);
        Ok(out)
    }

    /// Sums partial rows (expert-major, every ETP rank's) over the group; this rank keeps its
    /// own.
    fn reduce_scatter(
        &self,
        y: &Tensor,
        h: usize,
        etp: &mut dyn Communicator,
    ) -> Result<Tensor, CommError> {
        let mut padded = vec![0.0f32; self.counts.len() * self.max_rows * h];
        for (i, &r) in self.padded.iter().enumerate() {
            let r = r as usize;
            padded[r * h..(r + 1) * h].copy_from_slice(&y.data()[i * h..(i + 1) * h]);
        }
        let mut mine = vec![0.0f32; self.max_rows * h];
        etp.reduce_scatter(&padded, &mut mine, ReduceOp::Sum)?;
        let mut out = Tensor::for_overwrite(&[self.own_rows(), h]);
        let n = out.numel();
        out.data_mut().copy_from_slice(&mine[..n]);
        Ok(out)
    }
}
