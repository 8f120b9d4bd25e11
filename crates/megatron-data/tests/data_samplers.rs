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

mod cyclic {
    use megatron_data::data_samplers::{
        DataSharding, MegatronPretrainingRandomSampler, RandomSamplerError,
    };

    #[derive(serde::Deserialize)]
    struct Case {
        total: u64,
        mbs: u64,
        dp: u64,
        data_sharding: bool,
        consumed: u64,
        ranks: Vec<Vec<Vec<u64>>>,
    }

    fn sharding(on: bool) -> DataSharding {
        if on {
            DataSharding::Buckets
        } else {
            DataSharding::Off
        }
    }

    /// `bench/make_cyclic_sampler_fixture.py` iterated Megatron-LM's own sampler (under
    /// `cyclic_iter`, so across epochs) from a consumed count; each micro-batch must be the one
    /// computed here from its consumed count alone.
    #[test]
    fn random_sampler_matches_megatron_lm_over_epochs_and_ranks() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/cyclic_sampler.json"
        );
        let cases: Vec<Case> = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(cases.len(), 7);
        for c in &cases {
            assert_eq!(c.ranks.len() as u64, c.dp);
            for (rank, want) in c.ranks.iter().enumerate() {
                let mut s = MegatronPretrainingRandomSampler::new(
                    c.total,
                    c.mbs,
                    rank as u64,
                    c.dp,
                    sharding(c.data_sharding),
                )
                .unwrap();
                for (j, batch) in want.iter().enumerate() {
                    let consumed = c.consumed + j as u64 * c.mbs * c.dp;
                    assert_eq!(
                        &s.micro_batch(consumed),
                        batch,
                        "total {} mbs {} dp {} sharding {} rank {rank}, micro-batch {j}",
                        c.total,
                        c.mbs,
                        c.dp,
                        c.data_sharding
                    );
                }
            }
        }
    }

    #[test]
    fn random_sampler_spans_more_than_one_epoch_in_each_case() {
        // The fixture is worth its name only if it crosses epoch boundaries.
        let s =
            MegatronPretrainingRandomSampler::new(1000, 4, 0, 2, DataSharding::Buckets).unwrap();
        assert_eq!(s.epoch(984), 0);
        assert_eq!(s.epoch(1000), 1);
    }

    #[test]
    fn random_sampler_refuses_an_epoch_without_a_micro_batch_per_rank() {
        let e =
            MegatronPretrainingRandomSampler::new(7, 2, 0, 4, DataSharding::Buckets).unwrap_err();
        assert_eq!(
            e,
            RandomSamplerError::TooFewSamples {
                total: 7,
                mbs: 2,
                dp: 4
            }
        );
        assert!(e.to_string().contains("fewer than one micro-batch"), "{e}");
    }

    #[test]
    fn random_sampler_each_epoch_reads_every_bucket_sample_once() {
        for sharding in [DataSharding::Buckets, DataSharding::Off] {
            let (total, mbs, dp) = (103u64, 3u64, 4u64);
            let per_epoch = total / (mbs * dp);
            let mut seen = vec![0u32; total as usize];
            for rank in 0..dp {
                let mut s =
                    MegatronPretrainingRandomSampler::new(total, mbs, rank, dp, sharding).unwrap();
                for j in 0..per_epoch {
                    for i in s.micro_batch(j * mbs * dp) {
                        seen[i as usize] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n <= 1), "{sharding:?}: a sample twice");
            assert_eq!(
                seen.iter().sum::<u32>() as u64,
                per_epoch * mbs * dp,
                "{sharding:?}"
            );
        }
    }
}
