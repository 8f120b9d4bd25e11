use megatron_comm::{Axis, ParallelError, ParallelState};
use std::collections::BTreeMap;

#[test]
fn matches_the_worked_example_of_design_md() {
    let ps = ParallelState::new(8, 2, 2, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
    assert_eq!(ps.dp, 2);
    for rank in 0..8 {
        let c = ps.coords(rank).unwrap();
        assert_eq!(rank, c.tp + 2 * c.dp + 4 * c.pp);
    }
    assert_eq!(
        ps.tensor_model_parallel_groups(),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        ps.data_parallel_groups(),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(ps.data_parallel_groups_with_cp(), ps.data_parallel_groups());
    assert_eq!(
        ps.pipeline_model_parallel_groups(),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(
        ps.model_parallel_groups(),
        vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
    );
    assert_eq!(
        ps.groups(&[Axis::Tp, Axis::Dp, Axis::Cp]),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
    );
    assert_eq!(ps.embedding_groups(), ps.pipeline_model_parallel_groups());
    let (g, pos) = ParallelState::group_of(&ps.data_parallel_groups(), 6)
        .map(|(g, p)| (g.to_vec(), p))
        .unwrap();
    assert_eq!((g, pos), (vec![4, 6], 1));

    let alt = ParallelState::new(8, 2, 2, 1, 1, "tp-cp-ep-pp-dp").unwrap();
    assert_eq!(
        alt.tensor_model_parallel_groups(),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        alt.pipeline_model_parallel_groups(),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        alt.data_parallel_groups(),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
}

#[test]
fn megatron_docstring_example_16_gpus_tp2_pp4() {
    let ps = ParallelState::new(16, 2, 4, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
    assert_eq!(ps.data_parallel_groups()[..2], [vec![0, 2], vec![1, 3]]);
    assert_eq!(ps.pipeline_model_parallel_groups()[0], vec![0, 4, 8, 12]);
    assert_eq!(ps.embedding_groups()[0], vec![0, 12]);
}

/// An independent formulation: a rank's coordinates by explicit strides in order, and a group as
/// the ranks sharing every coordinate outside the varying axes, sorted.
fn reference_groups(
    order: &[&str],
    sizes: &BTreeMap<&str, usize>,
    world: usize,
    vary: &[&str],
) -> Vec<Vec<usize>> {
    let coord = |rank: usize, axis: &str| {
        let mut stride = 1;
        for a in order {
            if *a == axis {
                return (rank / stride) % sizes[a];
            }
            stride *= sizes[a];
        }
        unreachable!()
    };
    let mut buckets: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
    for r in 0..world {
        let key: Vec<usize> = order
            .iter()
            .filter(|a| !vary.contains(a))
            .map(|a| coord(r, a))
            .collect();
        buckets.entry(key).or_default().push(r);
    }
    let mut groups: Vec<Vec<usize>> = buckets.into_values().collect();
    groups.sort_by_key(|g| g[0]);
    groups
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

#[test]
fn every_layout_up_to_world_64_matches_an_independent_formulation() {
    let (mut layouts, mut refused) = (0, 0);
    for world in 1..=64usize {
        for tp in divisors(world) {
            for pp in divisors(world / tp) {
                for cp in divisors(world / (tp * pp)) {
                    let dp = world / (tp * pp * cp);
                    for ep in divisors(world / (tp * pp)) {
                        for order in ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"] {
                            let ps = match ParallelState::new(world, tp, pp, cp, ep, order) {
                                Ok(ps) => ps,
                                Err(ParallelError::InconsistentPipelineGroups { .. }) => {
                                    // Only the pp-before-dp order can separate the two layouts.
                                    assert_eq!(order, "tp-cp-ep-pp-dp");
                                    assert!(cp > 1 || ep > 1);
                                    refused += 1;
                                    continue;
                                }
                                Err(e) => panic!("{e}"),
                            };
                            let axes: Vec<&str> = order.split('-').collect();
                            let dense: BTreeMap<&str, usize> =
                                [("tp", tp), ("cp", cp), ("ep", 1), ("dp", dp), ("pp", pp)].into();
                            let edp = world / (tp * ep * pp);
                            let expert: BTreeMap<&str, usize> =
                                [("tp", tp), ("cp", 1), ("ep", ep), ("dp", edp), ("pp", pp)].into();
                            for (vary, got) in [
                                (vec!["tp"], ps.tensor_model_parallel_groups()),
                                (vec!["pp"], ps.pipeline_model_parallel_groups()),
                                (vec!["dp"], ps.data_parallel_groups()),
                                (vec!["cp"], ps.context_parallel_groups()),
                                (vec!["dp", "cp"], ps.data_parallel_groups_with_cp()),
                                (vec!["tp", "pp"], ps.model_parallel_groups()),
                                (
                                    vec!["tp", "dp", "cp"],
                                    ps.groups(&[Axis::Tp, Axis::Dp, Axis::Cp]),
                                ),
                            ] {
                                assert_eq!(got, reference_groups(&axes, &dense, world, &vary), "world {world} tp {tp} pp {pp} cp {cp} ep {ep} {order} {vary:?}");
                            }
                            assert_eq!(
                                ps.expert_model_parallel_groups(),
                                reference_groups(&axes, &expert, world, &["ep"])
                            );
                            assert_eq!(
                                ps.expert_groups(&[Axis::Pp]),
                                ps.pipeline_model_parallel_groups(),
                                "expert and dense pipeline groups agree"
                            );
                            let (tpg, ppg, dpg, epg) = (
                                ps.tensor_model_parallel_groups(),
                                ps.pipeline_model_parallel_groups(),
                                ps.data_parallel_groups(),
                                ps.expert_model_parallel_groups(),
                            );
                            for rank in 0..world {
                                let c = ps.coords(rank).unwrap();
                                let (g, pos) = ParallelState::group_of(&tpg, rank).unwrap();
                                assert_eq!((g.len(), pos), (tp, c.tp));
                                let (g, pos) = ParallelState::group_of(&ppg, rank).unwrap();
                                assert_eq!((g.len(), pos), (pp, c.pp));
                                let (g, pos) = ParallelState::group_of(&dpg, rank).unwrap();
                                assert_eq!((g.len(), pos), (dp, c.dp));
                                let (_, pos) = ParallelState::group_of(&epg, rank).unwrap();
                                assert_eq!(pos, c.ep);
                            }
                            layouts += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(layouts > 1000, "{layouts} layouts checked");
    assert!(refused > 0 && refused < layouts / 2, "{refused} refused");
}

#[test]
fn sizes_that_do_not_divide_the_world_are_refused_naming_the_flags() {
    let e = ParallelState::new(12, 5, 1, 1, 1, ParallelState::DEFAULT_ORDER).unwrap_err();
    assert!(matches!(e, ParallelError::NotDivisible { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("--tensor-model-parallel-size") && msg.contains("12"),
        "{msg}"
    );
    let e = ParallelState::new(8, 2, 1, 1, 3, ParallelState::DEFAULT_ORDER)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--expert-model-parallel-size"), "{e}");
    let e = ParallelState::new(8, 0, 1, 1, 1, ParallelState::DEFAULT_ORDER)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--tensor-model-parallel-size"), "{e}");
    let e = ParallelState::new(8, 2, 2, 1, 1, "tp-dp-xx")
        .unwrap_err()
        .to_string();
    assert!(e.contains("tp-dp-xx"), "{e}");
    assert!(ParallelState::new(8, 2, 2, 1, 1, "tp-dp-tp").is_err());
    let ps = ParallelState::new(4, 2, 1, 1, 1, "tp-dp").unwrap();
    assert_eq!(
        ps.order(),
        "tp-dp-cp-ep-pp",
        "missing axes of size 1 are appended"
    );
    assert!(ps.describe().contains("TP groups: [0, 1] [2, 3]"));
}
