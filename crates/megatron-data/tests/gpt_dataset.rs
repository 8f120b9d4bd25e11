//! Against fixtures written by megatron-core itself (tests/fixtures/make_megatron_fixtures.py).

use megatron_data::gpt_dataset::{build_indices, read_sample, split_indices, split_matrix};
use megatron_data::indexed_dataset::IndexedDataset;
use megatron_data::numpy_rng::RandomState;
use megatron_data::parse_split;
use serde_json::Value;

fn fixture() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/megatron_gpt_indices.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn prefix() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/megatron_small").to_string()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn numpy_legacy_shuffle_matches_numpy() {
    let f = fixture();
    let mut a: Vec<i64> = (0..1000).collect();
    RandomState::new(42).shuffle(&mut a);
    assert_eq!(a, ints(&f["shuffle_arange_1000_seed_42"]));
}

#[test]
fn gpt_indices_and_samples_match_megatron_core() {
    let f = fixture();
    let ds = IndexedDataset::open(&prefix()).unwrap();
    let sizes = ds.lengths();
    for case in f["cases"].as_array().unwrap() {
        let seq = case["seq_length"].as_u64().unwrap() as usize;
        let split = case["split"].as_str().unwrap();
        let ns = case["num_samples"].as_u64().unwrap();
        let seed = case["seed"].as_u64().unwrap() as u32;
        let m = split_matrix(&parse_split(split).unwrap());
        let want_m = case["split_matrix"][0].as_array().unwrap();
        let (b, e) = m[0].unwrap();
        assert_eq!(
            (b, e),
            (want_m[0].as_f64().unwrap(), want_m[1].as_f64().unwrap()),
            "split matrix of {split}"
        );
        let docs = split_indices((b, e), ds.len());
        let ix = build_indices(&sizes, &docs, Some(ns), seq, seed, 1, true).unwrap();
        let what = format!("seq {seq} split {split} samples {ns} seed {seed}");
        assert_eq!(
            ix.document_index
                .iter()
                .map(|&v| v as i64)
                .collect::<Vec<_>>(),
            ints(&case["document_index"]),
            "document index, {what}"
        );
        let want_si: Vec<i64> = case["sample_index"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(ints)
            .collect();
        assert_eq!(
            ix.sample_index
                .iter()
                .flat_map(|r| r.iter().map(|&v| v as i64))
                .collect::<Vec<_>>(),
            want_si,
            "sample index, {what}"
        );
        assert_eq!(
            ix.shuffle_index
                .iter()
                .map(|&v| v as i64)
                .collect::<Vec<_>>(),
            ints(&case["shuffle_index"]),
            "shuffle index, {what}"
        );
        let mut buf = Vec::new();
        for (i, want) in case["samples"].as_array().unwrap().iter().enumerate() {
            read_sample(&ds, &ix, i, seq, 1, &mut buf);
            assert_eq!(
                buf.iter().map(|&v| v as i64).collect::<Vec<_>>(),
                ints(want),
                "sample {i}, {what}"
            );
        }
    }
    // The cases cover one epoch, several epochs with the final one shuffled apart, and several
    // epochs shuffled together.
    let epochs: Vec<usize> = f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let docs = split_indices(
                split_matrix(&parse_split(c["split"].as_str().unwrap()).unwrap())[0].unwrap(),
                ds.len(),
            );
            build_indices(
                &sizes,
                &docs,
                c["num_samples"].as_u64(),
                c["seq_length"].as_u64().unwrap() as usize,
                c["seed"].as_u64().unwrap() as u32,
                1,
                true,
            )
            .map(|ix| ix.num_epochs * 10 + ix.separate_final_epoch as usize)
            .unwrap()
        })
        .collect();
    assert!(
        epochs.contains(&10)
            && epochs.iter().any(|e| e % 10 == 1)
            && epochs.iter().any(|e| *e > 10 && e % 10 == 0),
        "{epochs:?}"
    );
}
