//! Token dropping, padding and the expert-bias update as megatron-core defines them.

use megatron_core::transformer::config::DropPolicy;
use megatron_core::transformer::moe::router::{
    assign, expert_capacity, update_expert_bias, Capacity,
};
use megatron_core::transformer::moe::token_dispatcher::NO_SLOT;

/// 6 tokens, top-1 of 2 experts: expert 0 gets tokens 0..5, expert 1 token 5.
fn routing() -> (Vec<u32>, Vec<f32>) {
    (vec![0, 0, 0, 0, 0, 1], vec![0.6, 0.9, 0.7, 0.95, 0.8, 0.99])
}

fn rows_of(rows: &[(u32, u32)], counts: &[usize], e: usize) -> Vec<(u32, u32)> {
    let at: usize = counts[..e].iter().sum();
    rows[at..at + counts[e]].to_vec()
}

#[test]
fn capacity_is_megatrons_ceiling_of_rows_per_expert_times_the_factor() {
    assert_eq!(expert_capacity(6, 1, 2, 1.0), 3);
    assert_eq!(expert_capacity(7, 2, 4, 1.0), 4);
    assert_eq!(expert_capacity(6, 1, 2, 0.5), 2);
}

#[test]
fn dropless_routing_keeps_every_row_in_token_order() {
    let (idx, p) = routing();
    let (a, dropped) = assign(&idx, p, 6, 1, 2, None);
    assert_eq!(dropped, 0);
    assert_eq!(a.counts, [5, 1]);
    assert_eq!(
        rows_of(&a.rows, &a.counts, 0),
        [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    );
}

#[test]
fn the_probs_policy_drops_the_least_probable_and_the_position_policy_the_latest() {
    let (idx, p) = routing();
    let cap = |policy| Capacity {
        factor: 1.0,
        policy,
        pad: false,
    };
    // Capacity 3: expert 0 keeps its three most probable rows (tokens 1, 3, 4), in token order.
    let (a, dropped) = assign(&idx, p.clone(), 6, 1, 2, Some(cap(DropPolicy::Probs)));
    assert_eq!(dropped, 2);
    assert_eq!(rows_of(&a.rows, &a.counts, 0), [(1, 1), (3, 3), (4, 4)]);
    let (a, dropped) = assign(&idx, p, 6, 1, 2, Some(cap(DropPolicy::Position)));
    assert_eq!(dropped, 2);
    assert_eq!(rows_of(&a.rows, &a.counts, 0), [(0, 0), (1, 1), (2, 2)]);
    assert_eq!(rows_of(&a.rows, &a.counts, 1), [(5, 5)]);
}

#[test]
fn padding_fills_each_expert_to_capacity_with_weightless_rows() {
    let (idx, p) = routing();
    let c = Capacity {
        factor: 1.0,
        policy: DropPolicy::Probs,
        pad: true,
    };
    let (a, _) = assign(&idx, p, 6, 1, 2, Some(c));
    assert_eq!(a.counts, [3, 3]);
    // Expert 1: its routed token 5 and the earliest tokens not routed to it.
    assert_eq!(
        rows_of(&a.rows, &a.counts, 1),
        [(0, NO_SLOT), (1, NO_SLOT), (5, 5)]
    );
}

#[test]
fn a_capacity_above_the_token_count_never_drops() {
    let (idx, p) = routing();
    let c = Capacity {
        factor: 4.0,
        policy: DropPolicy::Position,
        pad: false,
    };
    let (a, dropped) = assign(&idx, p, 6, 1, 2, Some(c));
    assert_eq!((dropped, a.counts.clone()), (0, vec![5, 1]));
}

#[test]
fn the_expert_bias_moves_by_the_rate_toward_the_mean_load() {
    let mut bias = vec![0.0f32, 0.5, -0.5, 0.0];
    update_expert_bias(&mut bias, &[10.0, 2.0, 4.0, 4.0], 0.1);
    // Mean 5: overloaded expert 0 down, the others up.
    assert_eq!(bias, [-0.1, 0.6, -0.4, 0.1]);
    update_expert_bias(&mut bias, &[5.0, 5.0, 5.0, 5.0], 0.1);
    assert_eq!(bias, [-0.1, 0.6, -0.4, 0.1]);
}
