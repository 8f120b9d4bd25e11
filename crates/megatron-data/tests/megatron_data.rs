//! Blends against megatron-core's own `BlendedMegatronDatasetBuilder`
//! (`bench/make_blend_fixture.py`, `tests/fixtures/blends.json`): every sample of every split, for
//! an unweighted `--data-path A B` (weights from the datasets' lengths, one epoch at most), the
//! same with the validation split unsized (`--full-validation`), and a weighted blend (as long as
//! its datasets' rounded-up shares), with megatron-core's `--mid-level-dataset-surplus` and
//! another.

use megatron_data::megatron_data::{MegatronDataConfig, MegatronGPTData};
use megatron_data::{GPTSampleSource, Split};
use serde_json::Value;

fn data(name: &str) -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../megatron-training/tests/fixtures/megatron_resume/data/"
    )
    .to_string()
        + name
}

fn config(data_path: &[String], sizes: [Option<u64>; 3]) -> MegatronDataConfig {
    MegatronDataConfig {
        data_path: data_path.to_vec(),
        split: "70,30,0".into(),
        seq_length: 16,
        seed: 5,
        num_samples: sizes,
        tokenizer: "NullTokenizer:101".into(),
        eod: 100,
        ..Default::default()
    }
}

#[test]
fn blends_give_megatron_cores_samples_in_its_order() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/blends.json");
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (a, b) = (data("tokens_text_document"), data("tokens_b_text_document"));
    let weighted = vec!["0.3".into(), a.clone(), "0.7".into(), b.clone()];
    for (name, list, surplus) in [
        ("unweighted", vec![a.clone(), b.clone()], None),
        (
            "unweighted_full_validation",
            vec![a.clone(), b.clone()],
            None,
        ),
        ("weighted", weighted.clone(), None),
        // --mid-level-dataset-surplus: each dataset built for more than its share.
        ("weighted_surplus_1.5", weighted.clone(), Some(1.5)),
    ] {
        let case = &cases[name];
        let sizes: Vec<Option<u64>> = case["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64())
            .collect();
        let ds = MegatronGPTData::build(&MegatronDataConfig {
            mid_level_dataset_surplus: surplus,
            ..config(&list, [sizes[0], sizes[1], sizes[2]])
        })
        .unwrap();
        for (split, key) in [(Split::Train, "train"), (Split::Valid, "valid")] {
            let want: Vec<Vec<u32>> = case["samples"][key]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    s.as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect()
                })
                .collect();
            assert_eq!(
                ds.num_samples(split),
                want.len() as u64,
                "{name} {key}: length"
            );
            let mut buf = vec![0u32; 17];
            for (i, w) in want.iter().enumerate() {
                ds.sample(split, i as u64, &mut buf);
                assert_eq!(&buf, w, "{name} {key}: sample {i}");
            }
        }
    }
}

#[test]
fn an_unweighted_blend_too_short_for_the_run_is_refused_naming_the_remedy() {
    let list = [data("tokens_text_document"), data("tokens_b_text_document")];
    let e = MegatronGPTData::build(&config(&list, [Some(1000), Some(12), Some(0)]))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unweighted") && e.contains("give weights"),
        "{e}"
    );
}
