//! `BertDataset` against megatron-core's `BERTMaskedWordPieceDataset`
//! (`bench/make_bert_dataset_fixture.py`): the same sentence-split `.bin/.idx`, split and seed
//! give the same number of samples and the same first 50 training and 10 validation samples
//! (tokens, segments, labels, sentence order, padding and loss masks), with and without the
//! binary head.

use megatron_data::bert_dataset::{BertDataset, BertSampleConfig, WordPieceTokens};
use megatron_data::gpt_dataset::{split_indices, split_matrix};
use megatron_data::indexed_dataset::IndexedDataset;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bert")
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn check(head: bool) {
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("samples.json")).unwrap())
            .unwrap();
    let prefix = fixture().join("sotu_sentence");
    let ds = Arc::new(IndexedDataset::open(prefix.to_str().unwrap()).unwrap());
    let mut continues_word = vec![false; j["vocab_size"].as_u64().unwrap() as usize];
    for id in ints(&j["continuation_ids"]) {
        continues_word[id as usize] = true;
    }
    let id = |k: &str| j[k].as_u64().unwrap() as u32;
    let tok = WordPieceTokens {
        cls: id("cls"),
        sep: id("sep"),
        mask: id("mask"),
        pad: id("pad"),
        continues_word,
    };
    let cfg = BertSampleConfig {
        seq_length: j["seq_length"].as_u64().unwrap() as usize,
        seed: j["seed"].as_u64().unwrap(),
        masking_probability: j["mask_prob"].as_f64().unwrap(),
        short_seq_prob: j["short_seq_prob"].as_f64().unwrap(),
        masking_max_ngram: 3,
        whole_word: true,
        binary_head: head,
    };
    let key = if head {
        "binary_head"
    } else {
        "no_binary_head"
    };
    let want = &j[key];
    let weights: Vec<f64> = j["split"]
        .as_str()
        .unwrap()
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    let matrix = split_matrix(&[weights[0], weights[1], weights[2]]);
    let num_samples = ints(&j["num_samples"]);
    for (s, name) in [(0, "train"), (1, "valid")] {
        let docs = split_indices(matrix[s].unwrap(), ds.num_documents());
        let d = BertDataset::new(
            ds.clone(),
            &docs,
            Some(num_samples[s] as u64),
            cfg,
            tok.clone(),
        );
        assert_eq!(
            d.len() as u64,
            want[format!("{name}_len")].as_u64().unwrap(),
            "{key} {name}: number of samples"
        );
        let rows = want[name].as_array().unwrap();
        assert!(rows.len() >= 10);
        let mut masked = 0;
        for (i, w) in rows.iter().enumerate() {
            let got = d.sample(i);
            let text: Vec<i64> = got.tokens.iter().map(|&x| x as i64).collect();
            assert_eq!(text, ints(&w["text"]), "{key} {name} sample {i}: text");
            let types: Vec<i64> = got.types.iter().map(|&x| x as i64).collect();
            assert_eq!(types, ints(&w["types"]), "{key} {name} sample {i}: types");
            assert_eq!(
                got.labels,
                ints(&w["labels"]),
                "{key} {name} sample {i}: labels"
            );
            assert_eq!(
                got.is_random as i64,
                w["is_random"].as_i64().unwrap(),
                "{key} {name} sample {i}: is_random"
            );
            let pad: Vec<i64> = (0..cfg.seq_length)
                .map(|p| i64::from(p < got.len))
                .collect();
            assert_eq!(
                pad,
                ints(&w["padding_mask"]),
                "{key} {name} sample {i}: padding"
            );
            let mut loss = vec![0i64; cfg.seq_length];
            got.masked_positions.iter().for_each(|&p| loss[p] = 1);
            assert_eq!(
                loss,
                ints(&w["loss_mask"]),
                "{key} {name} sample {i}: loss mask"
            );
            assert_eq!(
                got.truncated as i64,
                w["truncated"].as_i64().unwrap(),
                "{key} {name} sample {i}: truncated"
            );
            masked += got.masked_positions.len();
        }
        assert!(masked > rows.len(), "{key} {name}: {masked} masked tokens");
    }
}

#[test]
fn bert_samples_with_the_binary_head_equal_megatron_cores() {
    check(true);
}

#[test]
fn bert_samples_without_the_binary_head_equal_megatron_cores() {
    check(false);
}
