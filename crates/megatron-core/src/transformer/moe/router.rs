//! The router's decisions beyond top-k (megatron-core's `router.py` and `moe_utils.py`): which
//! rows each expert takes under a capacity (`apply_router_token_dropping`), the load-balancing
//! losses' token counts, and the aux-loss-free expert bias update (`get_updated_expert_bias`).

use super::token_dispatcher::{Assignment, NO_SLOT};
use crate::transformer::config::DropPolicy;

/// `--moe-expert-capacity-factor` and its companions.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub factor: f32,
    pub policy: DropPolicy,
    pub pad: bool,
}

/// megatron-core's `get_capacity`: `ceil(rows / experts * factor)` for `rows = tokens * topk`.
pub fn expert_capacity(tokens: usize, topk: usize, experts: usize, factor: f32) -> usize {
    ((tokens * topk) as f64 / experts as f64 * factor as f64).ceil() as usize
}

/// The rows each expert takes of this rank's `tokens` routed by `top_idx` (`tokens x topk`),
/// with `probs` their weights: every routed (token, slot) without a capacity; with one, each
/// expert keeps at most `capacity` of its rows (the most probable, or the earliest) and with
/// `pad` takes exactly `capacity` rows, the missing ones the earliest tokens not routed to it
/// with weight 0 (megatron-core pads with arbitrary zero-weight tokens; the earliest makes the
/// choice deterministic). Returns the assignment and the number of dropped rows.
pub fn assign(
    top_idx: &[u32],
    probs: Vec<f32>,
    tokens: usize,
    topk: usize,
    experts: usize,
    capacity: Option<Capacity>,
) -> (Assignment, usize) {
    let mut per: Vec<Vec<(u32, u32)>> = vec![Vec::new(); experts];
    for (j, &e) in top_idx.iter().enumerate() {
        per[e as usize].push(((j / topk) as u32, j as u32));
    }
    let mut dropped = 0;
    if let Some(c) = capacity {
        let cap = expert_capacity(tokens, topk, experts, c.factor);
        // As megatron-core: a capacity above the token count never drops (and pads to all).
        let cap = cap.min(tokens);
        for list in per.iter_mut() {
            if list.len() > cap {
                dropped += list.len() - cap;
                if c.policy == DropPolicy::Probs {
                    // Keep the most probable (earlier token on ties), then token order again.
                    list.sort_by(|a, b| {
                        probs[b.1 as usize]
                            .total_cmp(&probs[a.1 as usize])
                            .then(a.0.cmp(&b.0))
                    });
                }
                list.truncate(cap);
                list.sort_by_key(|r| r.0);
            }
            if c.pad && list.len() < cap {
                let mut routed = vec![false; tokens];
                for r in list.iter() {
                    routed[r.0 as usize] = true;
                }
                let need = cap - list.len();
                let pads: Vec<(u32, u32)> = (0..tokens as u32)
                    .filter(|&t| !routed[t as usize])
                    .take(need)
                    .map(|t| (t, NO_SLOT))
                    .collect();
                list.extend(pads);
                list.sort_by_key(|r| r.0);
            }
        }
    }
    let counts = per.iter().map(|l| l.len()).collect();
    let rows = per.into_iter().flatten().collect();
    (
        Assignment {
            rows,
            counts,
            tokens,
            topk,
            probs,
        },
        dropped,
    )
}

/// DeepSeek-V3's update (megatron-core's `get_updated_expert_bias`): every expert's bias moves
/// by `rate` toward balance, up when it took fewer tokens than the mean, down when more.
pub fn update_expert_bias(bias: &mut [f32], tokens_per_expert: &[f32], rate: f32) {
    let mean = tokens_per_expert.iter().sum::<f32>() / tokens_per_expert.len().max(1) as f32;
    for (b, &t) in bias.iter_mut().zip(tokens_per_expert) {
        let offset = mean - t;
        // torch.sign: 0 at 0.
        let sign = if offset > 0.0 {
            1.0
        } else if offset < 0.0 {
            -1.0
        } else {
            0.0
        };
        *b += sign * rate;
    }
}
