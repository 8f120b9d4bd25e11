//! `T5Dataset` against megatron-core's `T5MaskedWordPieceDataset`
//! (`bench/make_bert_dataset_fixture.py`): the same sentence-split `.bin/.idx`, split and seed
//! give the same number of samples and the same first 50 training and 10 validation samples
//! (encoder input with sentinels, decoder input and labels, masks).

use megatron_data::gpt_dataset::{split_indices, split_matrix};
use megatron_data::indexed_dataset::IndexedDataset;
use megatron_data::masked_dataset::WordPieceTokens;
use megatron_data::t5_dataset::{T5Dataset, T5SampleConfig, T5Tokens};
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

#[test]
fn t5_span_corruption_samples_equal_megatron_cores() {
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("samples.json")).unwrap())
            .unwrap();
    let t5 = &j["t5"];
    let prefix = fixture().join("sotu_sentence");
    let ds = Arc::new(IndexedDataset::open(prefix.to_str().unwrap()).unwrap());
    let mut continues_word = vec![false; j["vocab_size"].as_u64().unwrap() as usize];
    for id in ints(&j["continuation_ids"]) {
        continues_word[id as usize] = true;
    }
    let id = |v: &Value| v.as_u64().unwrap() as u32;
    let tok = T5Tokens {
        pieces: WordPieceTokens {
            cls: id(&j["cls"]),
            sep: id(&j["sep"]),
            mask: id(&j["mask"]),
            pad: id(&j["pad"]),
            continues_word,
        },
        bos: id(&t5["bos"]),
        eos: id(&t5["eos"]),
        sentinels: ints(&t5["sentinels"]).iter().map(|&x| x as u32).collect(),
    };
    let cfg = T5SampleConfig {
        encoder_seq_length: t5["encoder_seq_length"].as_u64().unwrap() as usize,
        decoder_seq_length: t5["decoder_seq_length"].as_u64().unwrap() as usize,
        seed: j["seed"].as_u64().unwrap(),
        masking_probability: j["mask_prob"].as_f64().unwrap(),
        short_seq_prob: j["short_seq_prob"].as_f64().unwrap(),
    };
    let matrix = split_matrix(&[95.0, 5.0, 0.0]);
    let num_samples = ints(&j["num_samples"]);
    let mut spans = 0;
    for (s, name) in [(0, "train"), (1, "valid")] {
        let docs = split_indices(matrix[s].unwrap(), ds.num_documents());
        let d = T5Dataset::new(
            ds.clone(),
            &docs,
            Some(num_samples[s] as u64),
            cfg,
            tok.clone(),
        );
        assert_eq!(
            d.len() as u64,
            t5[format!("{name}_len")].as_u64().unwrap(),
            "{name}: number of samples"
        );
        for (i, w) in t5[name].as_array().unwrap().iter().enumerate() {
            let got = d.sample(i);
            let as_i64 = |v: &[u32]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
            assert_eq!(
                as_i64(&got.encoder_input),
                ints(&w["text_enc"]),
                "{name} {i}: text_enc"
            );
            assert_eq!(
                as_i64(&got.decoder_input),
                ints(&w["text_dec"]),
                "{name} {i}: text_dec"
            );
            assert_eq!(got.labels, ints(&w["labels"]), "{name} {i}: labels");
            let mask =
                |n: usize, len: usize| (0..len).map(|p| i64::from(p < n)).collect::<Vec<_>>();
            assert_eq!(
                mask(got.encoder_len, cfg.encoder_seq_length),
                ints(&w["enc_mask"]),
                "{name} {i}: enc_mask"
            );
            assert_eq!(
                mask(got.decoder_len, cfg.decoder_seq_length),
                ints(&w["dec_mask"]),
                "{name} {i}: dec_mask"
            );
            assert_eq!(
                mask(got.decoder_len, cfg.decoder_seq_length),
                ints(&w["loss_mask"]),
                "{name} {i}: loss_mask"
            );
            assert_eq!(
                got.truncated as i64,
                w["truncated"].as_i64().unwrap(),
                "{name} {i}: truncated"
            );
            spans += got
                .encoder_input
                .iter()
                .filter(|x| tok.sentinels.contains(x))
                .count();
        }
    }
    // Span corruption happened: several sentinels per sample on average.
    assert!(spans > 60, "{spans} sentinels in 60 samples");
}
