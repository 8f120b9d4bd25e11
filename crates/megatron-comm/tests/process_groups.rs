use megatron_comm::{run_ranks, ParallelState, ProcessGroups};
use std::time::Duration;

#[test]
fn process_groups_match_parallel_state_and_pass_the_health_check() {
    // World 8 = TP2 x PP2 x DP2.
    let out = run_ranks(8, |rank, c| {
        let ps = ParallelState::new(8, 2, 2, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
        let mut g = ProcessGroups::new(c, ps.clone()).unwrap();
        g.health_check(Duration::from_secs(5), Duration::from_secs(60))
            .unwrap();
        let (tp, pos) = ParallelState::group_of(&ps.tensor_model_parallel_groups(), rank)
            .map(|(m, p)| (m.to_vec(), p))
            .unwrap();
        assert_eq!(g.tp.members, tp);
        assert_eq!((g.tp.comm.size(), g.tp.comm.rank()), (2, pos));
        assert_eq!(g.dp.members.len(), 2);
        assert_eq!(g.pp.members.len(), 2);
        assert_eq!(g.mp.members.len(), 4);
        // Embedding group: first and last pipeline stages, i.e. every rank when PP = 2.
        assert!(g.embedding.is_some());
        g.tp.comm.name().to_string()
    });
    for (rank, r) in out.into_iter().enumerate() {
        let name = r.unwrap();
        assert!(name.starts_with("tp["), "rank {rank}: {name}");
    }
}

#[test]
fn middle_pipeline_stages_have_no_embedding_group() {
    let out = run_ranks(4, |_, c| {
        let ps = ParallelState::new(4, 1, 4, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
        let g = ProcessGroups::new(c, ps).unwrap();
        g.embedding.map(|e| e.members)
    });
    let got: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(got, vec![Some(vec![0, 3]), None, None, Some(vec![0, 3])]);
}

#[test]
fn a_rank_missing_from_the_health_check_is_reported_with_its_group() {
    let out = run_ranks(4, |rank, c| {
        let ps = ParallelState::new(4, 2, 1, 1, 1, ParallelState::DEFAULT_ORDER).unwrap();
        let mut g = ProcessGroups::new(c, ps).unwrap();
        if rank == 3 {
            return Ok(());
        }
        g.health_check(Duration::from_millis(200), Duration::from_secs(60))
    });
    let e = out[2].as_ref().unwrap().as_ref().unwrap_err();
    assert!(e.contains("tp group [2, 3]"), "{e}");
    assert!(e.contains("did not arrive"), "{e}");
}
