use megatron_data::data_samplers::MegatronPretrainingSampler;

fn sampler(consumed: u64, mbs: u64, rank: u64, dp: u64) -> MegatronPretrainingSampler {
    MegatronPretrainingSampler {
        total_samples: 1000,
        consumed_samples: consumed,
        micro_batch_size: mbs,
        data_parallel_rank: rank,
        data_parallel_size: dp,
    }
}

#[test]
fn global_order_does_not_depend_on_the_data_parallel_size() {
    // dp=1 with mbs 4 and dp=2 with mbs 2 (same global micro-batch) read the same samples in
    // the same global order.
    let mut one = sampler(0, 4, 0, 1);
    let mut r0 = sampler(0, 2, 0, 2);
    let mut r1 = sampler(0, 2, 1, 2);
    for _ in 0..10 {
        let a = one.next_micro_batch().unwrap();
        let mut b = r0.next_micro_batch().unwrap();
        b.extend(r1.next_micro_batch().unwrap());
        assert_eq!(a, b);
    }
}

#[test]
fn resuming_at_any_consumed_count_continues_the_sequence() {
    let mut full = sampler(0, 3, 1, 2);
    let mut seen = Vec::new();
    while let Some(b) = full.next_micro_batch() {
        seen.push(b);
    }
    assert_eq!(seen.len(), 1000 / 6);
    for k in [0, 1, 17, 100] {
        let mut resumed = sampler(6 * k as u64, 3, 1, 2);
        assert_eq!(
            resumed.next_micro_batch().unwrap(),
            seen[k],
            "resume after {k} steps"
        );
    }
    assert!(
        sampler(996, 3, 0, 2).next_micro_batch().is_none(),
        "no partial last batch"
    );
}
