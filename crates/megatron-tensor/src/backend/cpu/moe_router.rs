//! The MoE router's math (megatron-core's `moe_utils.py`: `topk_routing_with_score_function`,
//! `compute_routing_scores_for_aux_loss`, `switch_load_balancing_loss_func`, `z_loss_func`),
//! with explicit backward passes; all in f32, as megatron-core computes the router.
//!
//! Top-k routing: softmax before top-k (`pre_softmax`), softmax over the k selected logits, or
//! sigmoid scores (normalized over the k selected when k > 1; an expert bias, DeepSeek-V3's
//! aux-loss-free balancing, shifts the selection only); then an optional scaling factor. Ties
//! pick the lower expert index. Group-limited routing (DeepSeek's device- and node-limited
//! routing, megatron-core's `group_limited_topk`) restricts the top-k to the experts of the
//! best few groups.

/// `--moe-router-num-groups` / `--moe-router-group-topk`: experts split into `groups` equal
/// groups by index; a token picks its `topk_groups` groups by the sum of each group's best
/// `topk / topk_groups` selection scores, then its top-k among their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLimit {
    pub groups: usize,
    pub topk_groups: usize,
}

use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFunction {
    Softmax,
    Sigmoid,
}

#[derive(Clone, Copy, Debug)]
pub struct RouterDims {
    pub tokens: usize,
    pub experts: usize,
    pub topk: usize,
    pub score: ScoreFunction,
    /// Softmax over all experts before top-k (`--moe-router-pre-softmax`).
    pub pre_softmax: bool,
    /// `--moe-router-topk-scaling-factor`.
    pub scaling: Option<f32>,
    pub group_limit: Option<GroupLimit>,
}

fn softmax_into(out: &mut [f32], x: &[f32]) {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0f32;
    for (o, v) in out.iter_mut().zip(x) {
        *o = (v - m).exp();
        s += *o;
    }
    for o in out.iter_mut() {
        *o /= s;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Indices of the `k` largest of `v` (ties: lower index first), in decreasing order.
fn topk(v: &[f32], k: usize, idx: &mut [u32]) {
    let mut order: Vec<u32> = (0..v.len() as u32).collect();
    order.sort_by(|&a, &b| {
        v[b as usize]
            .partial_cmp(&v[a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    idx.copy_from_slice(&order[..k]);
}

/// The top-`k` of `v` (one token's selection scores) among the experts of its best groups, as
/// `group_limited_topk` chooses them; plain top-`k` without a limit.
fn select(v: &[f32], k: usize, idx: &mut [u32], limit: Option<GroupLimit>) {
    let Some(g) = limit else {
        return topk(v, k, idx);
    };
    let per = v.len() / g.groups;
    let best = k / g.topk_groups;
    let mut group_score = vec![0.0f32; g.groups];
    let mut top = vec![0u32; best];
    for (gi, s) in group_score.iter_mut().enumerate() {
        let members = &v[gi * per..(gi + 1) * per];
        topk(members, best, &mut top);
        *s = top.iter().map(|&i| members[i as usize]).sum();
    }
    let mut chosen = vec![0u32; g.topk_groups];
    topk(&group_score, g.topk_groups, &mut chosen);
    let mut masked = vec![f32::NEG_INFINITY; v.len()];
    for &gi in &chosen {
        let r = gi as usize * per..(gi as usize + 1) * per;
        masked[r.clone()].copy_from_slice(&v[r]);
    }
    topk(&masked, k, idx);
}

/// `top_idx [tokens, k]` and `probs [tokens, k]` from `logits [tokens, experts]`.
pub fn topk_router_forward(
    top_idx: &mut [u32],
    probs: &mut [f32],
    logits: &[f32],
    expert_bias: Option<&[f32]>,
    d: RouterDims,
) {
    let (e, k) = (d.experts, d.topk);
    assert!(k >= 1 && k <= e, "top-{k} of {e} experts");
    assert_eq!(logits.len(), d.tokens * e);
    assert_eq!(top_idx.len(), d.tokens * k);
    assert_eq!(probs.len(), d.tokens * k);
    top_idx
        .par_chunks_mut(k)
        .zip(probs.par_chunks_mut(k))
        .zip(logits.par_chunks(e))
        .for_each(|((idx, p), l)| {
            let mut scores = vec![0.0f32; e];
            match (d.score, d.pre_softmax) {
                (ScoreFunction::Softmax, true) => {
                    softmax_into(&mut scores, l);
                    select(&scores, k, idx, d.group_limit);
                    for (pv, &i) in p.iter_mut().zip(idx.iter()) {
                        *pv = scores[i as usize];
                    }
                }
                (ScoreFunction::Softmax, false) => {
                    select(l, k, idx, d.group_limit);
                    let sel: Vec<f32> = idx.iter().map(|&i| l[i as usize]).collect();
                    softmax_into(p, &sel);
                }
                (ScoreFunction::Sigmoid, _) => {
                    for (s, v) in scores.iter_mut().zip(l) {
                        *s = sigmoid(*v);
                    }
                    match expert_bias {
                        Some(b) => {
                            let shifted: Vec<f32> =
                                scores.iter().zip(b).map(|(s, b)| s + b).collect();
                            select(&shifted, k, idx, d.group_limit);
                        }
                        None => select(&scores, k, idx, d.group_limit),
                    }
                    let sel: Vec<f32> = idx.iter().map(|&i| scores[i as usize]).collect();
                    let sum: f32 = sel.iter().sum();
                    for (pv, s) in p.iter_mut().zip(&sel) {
                        *pv = if k > 1 { s / (sum + 1e-20) } else { *s };
                    }
                }
            }
            if let Some(f) = d.scaling {
                for pv in p.iter_mut() {
                    *pv *= f;
                }
            }
        });
}

/// `dlogits [tokens, experts]` (overwritten) from `dprobs [tokens, k]`, for the selection
/// `top_idx` the forward made.
pub fn topk_router_backward(
    dlogits: &mut [f32],
    dprobs: &[f32],
    logits: &[f32],
    top_idx: &[u32],
    d: RouterDims,
) {
    let (e, k) = (d.experts, d.topk);
    let scale = d.scaling.unwrap_or(1.0);
    dlogits
        .par_chunks_mut(e)
        .zip(dprobs.par_chunks(k))
        .zip(logits.par_chunks(e))
        .zip(top_idx.par_chunks(k))
        .for_each(|(((dl, dp), l), idx)| {
            dl.fill(0.0);
            let dp: Vec<f32> = dp.iter().map(|g| g * scale).collect();
            match (d.score, d.pre_softmax) {
                (ScoreFunction::Softmax, true) => {
                    // p_j = s_{idx_j}, s = softmax(l): dl = s * (g - <g, s>) with g scattered.
                    let mut s = vec![0.0f32; e];
                    softmax_into(&mut s, l);
                    let mut g = vec![0.0f32; e];
                    for (gv, &i) in dp.iter().zip(idx) {
                        g[i as usize] += gv;
                    }
                    let dot: f32 = g.iter().zip(&s).map(|(a, b)| a * b).sum();
                    for j in 0..e {
                        dl[j] = s[j] * (g[j] - dot);
                    }
                }
                (ScoreFunction::Softmax, false) => {
                    let sel: Vec<f32> = idx.iter().map(|&i| l[i as usize]).collect();
                    let mut p = vec![0.0f32; k];
                    softmax_into(&mut p, &sel);
                    let dot: f32 = dp.iter().zip(&p).map(|(a, b)| a * b).sum();
                    for (j, &i) in idx.iter().enumerate() {
                        dl[i as usize] = p[j] * (dp[j] - dot);
                    }
                }
                (ScoreFunction::Sigmoid, _) => {
                    let sel: Vec<f32> = idx.iter().map(|&i| sigmoid(l[i as usize])).collect();
                    // ds_j: through the normalization when k > 1.
                    let ds: Vec<f32> = if k > 1 {
                        let sum: f32 = sel.iter().sum::<f32>() + 1e-20;
                        let dot: f32 = dp.iter().zip(&sel).map(|(a, b)| a * b).sum();
                        dp.iter().map(|g| g / sum - dot / (sum * sum)).collect()
                    } else {
                        dp.clone()
                    };
                    for (j, &i) in idx.iter().enumerate() {
                        dl[i as usize] = ds[j] * sel[j] * (1.0 - sel[j]);
                    }
                }
            }
        });
}

/// The switch-transformer load-balancing loss, `coeff * E / (k * T^2) * sum_i tokens_i *
/// sum_x score(x, i)` with the aux-loss scores (softmax over all experts, or sigmoid normalized
/// over them); `tokens_per_expert` counts the routed tokens and `total_tokens` is T. Returns the
/// loss; with `dlogits`, accumulates `dloss * d(loss)/d(logits)` into it.
pub fn aux_loss(
    dlogits: Option<&mut [f32]>,
    logits: &[f32],
    tokens_per_expert: &[f32],
    total_tokens: f32,
    coeff: f32,
    dloss: f32,
    d: RouterDims,
) -> f32 {
    let e = d.experts;
    let c = coeff * e as f32 / (d.topk as f32 * total_tokens * total_tokens);
    let mut loss = 0.0f64;
    let mut rows: Vec<Option<&mut [f32]>> = match dlogits {
        Some(dl) => dl.chunks_mut(e).map(Some).collect(),
        None => (0..d.tokens).map(|_| None).collect(),
    };
    for (x, dl) in logits.chunks(e).zip(rows.iter_mut()) {
        let mut s = vec![0.0f32; e];
        // g = d(loss)/d(score) = c * tokens_i.
        let g: Vec<f32> = tokens_per_expert.iter().map(|t| c * t).collect();
        match d.score {
            ScoreFunction::Softmax => {
                softmax_into(&mut s, x);
                loss += s
                    .iter()
                    .zip(&g)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>();
                if let Some(dl) = dl {
                    let dot: f32 = g.iter().zip(&s).map(|(a, b)| a * b).sum();
                    for j in 0..e {
                        dl[j] += dloss * s[j] * (g[j] - dot);
                    }
                }
            }
            ScoreFunction::Sigmoid => {
                let sig: Vec<f32> = x.iter().map(|v| sigmoid(*v)).collect();
                let sum: f32 = sig.iter().sum::<f32>() + 1e-20;
                for (o, v) in s.iter_mut().zip(&sig) {
                    *o = v / sum;
                }
                loss += s
                    .iter()
                    .zip(&g)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>();
                if let Some(dl) = dl {
                    let dot: f32 = g.iter().zip(&sig).map(|(a, b)| a * b).sum();
                    for j in 0..e {
                        let ds = g[j] / sum - dot / (sum * sum);
                        dl[j] += dloss * ds * sig[j] * (1.0 - sig[j]);
                    }
                }
            }
        }
    }
    loss as f32
}

/// The router z-loss (ST-MoE), `coeff * mean_x logsumexp(logits_x)^2`; with `dlogits`,
/// accumulates `dloss * d(loss)/d(logits)`.
pub fn z_loss(
    dlogits: Option<&mut [f32]>,
    logits: &[f32],
    coeff: f32,
    dloss: f32,
    experts: usize,
) -> f32 {
    let n = logits.len() / experts;
    let mut loss = 0.0f64;
    let mut rows: Vec<Option<&mut [f32]>> = match dlogits {
        Some(dl) => dl.chunks_mut(experts).map(Some).collect(),
        None => (0..n).map(|_| None).collect(),
    };
    for (x, dl) in logits.chunks(experts).zip(rows.iter_mut()) {
        let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = x.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        loss += (lse as f64) * (lse as f64);
        if let Some(dl) = dl {
            for (g, v) in dl.iter_mut().zip(x) {
                *g += dloss * coeff * 2.0 * lse / n as f32 * (v - lse).exp();
            }
        }
    }
    (loss / n as f64) as f32 * coeff
}
