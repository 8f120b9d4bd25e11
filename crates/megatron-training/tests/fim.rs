//! `--fim-data` (Megatron's fill-in-the-middle samples) on an indexed dataset: the samples carry
//! the FIM sentinels, and data and tensor parallelism train the one-rank model on them (every
//! sample's cuts depend on its index alone); bad FIM flags are refused by name.

mod common;

use common::{
    assert_same_training, parse_inspect, parse_train, preprocess_texts, tmpdir, SMALL_RUN,
};
use megatron_data::{build_tokenizer_from, TokenizerSpec};
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::{inspect_data, pretrain};
use std::path::Path;

const FIM_TOKENS: [&str; 4] = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"];

/// GPT-2's vocabulary with the four FIM tokens appended (as StarCoder's has them), and a small
/// corpus of code preprocessed with it; returns (vocab.json, merges.txt, data prefix).
fn fim_corpus(dir: &Path) -> (String, String, String) {
    let gpt2 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../megatron-data/tests/fixtures/gpt2"
    );
    let text = std::fs::read_to_string(format!("{gpt2}/vocab.json")).unwrap();
    let mut vocab: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).unwrap();
    for (i, t) in FIM_TOKENS.iter().enumerate() {
        vocab.insert(t.to_string(), (50257 + i).into());
    }
    let v = dir.join("vocab.json").display().to_string();
    std::fs::write(&v, serde_json::Value::Object(vocab).to_string()).unwrap();
    let m = format!("{gpt2}/merges.txt");
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(v.clone()),
        merge_file: Some(m.clone()),
        ..Default::default()
    })
    .unwrap();
    let code = (0..150).map(|i| {
        format!(
            "def f{i}(x):\n    return x * {} + {}\n",
            i % 7,
            "1 ".repeat(i % 5)
        )
    });
    let data = preprocess_texts(dir, "code", code, tok.as_ref());
    (v, m, data)
}

/// [`SMALL_RUN`] at 32 tokens on the FIM corpus with `--fim-data --fim-rate 0.9`.
fn flags(vocab: &str, merges: &str, data: &str, extra: &[&str]) -> Vec<String> {
    let head = [
        "m",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--data-path",
        data,
        "--split",
        "90,10,0",
    ];
    let tail = [
        "--seq-length",
        "32",
        // 50,261 ids pad to 50,304 rows at TP 1 (x64) and TP 2 (x128) alike.
        "--make-vocab-size-divisible-by",
        "64",
        "--fim-data",
        "--fim-rate",
        "0.9",
    ];
    [&head[..], SMALL_RUN, &tail[..], extra]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[test]
fn fim_samples_carry_the_sentinels_and_every_layout_trains_the_one_rank_model() {
    let dir = tmpdir("fim");
    let (v, m, data) = fim_corpus(&dir);
    let mut inspect = flags(&v, &m, &data, &["--train-iters", "5", "--count", "8"]);
    inspect[0] = "inspect".into();
    let samples = inspect_data(&parse_inspect(&inspect)).unwrap();
    let prefix = 50257u32;
    let with_fim = samples.iter().filter(|s| s.contains(&prefix)).count();
    assert!(with_fim >= 6, "{with_fim} of 8 samples carry <fim_prefix>");
    let mut plain = flags(&v, &m, &data, &["--train-iters", "5", "--count", "8"]);
    plain[0] = "inspect".into();
    plain.retain(|f| f != "--fim-data");
    let before = inspect_data(&parse_inspect(&plain)).unwrap();
    assert!(before.iter().all(|s| !s.contains(&prefix)));
    assert_ne!(before, samples);

    let run = |name: &str, layout: &[&str]| {
        let save = dir.join(name).display().to_string();
        let mut f = flags(&v, &m, &data, &["--train-iters", "5", "--save", &save]);
        f.extend(layout.iter().map(|s| s.to_string()));
        let s = pretrain(&parse_train(&f)).unwrap();
        (s, load_checkpoint(Path::new(&save), None).unwrap())
    };
    let serial = run("serial", &[]);
    for (name, layout) in [
        ("dp2", &["--nproc-per-node", "2"][..]),
        (
            "tp2 sp",
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
    ] {
        let r = run(&name.replace(' ', "_"), layout);
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fim_flags_are_checked_against_the_tokenizer_and_the_data() {
    let dir = tmpdir("fim-flags");
    let (v, m, data) = fim_corpus(&dir);
    let gpt2 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../megatron-data/tests/fixtures/gpt2"
    );
    let plain_vocab = format!("{gpt2}/vocab.json");
    for (vocab, extra, needle) in [
        (
            plain_vocab.as_str(),
            &[][..],
            "--fim-prefix-token \"<fim_prefix>\": not a token",
        ),
        (
            v.as_str(),
            &["--fim-rate", "1.5"][..],
            "--fim-rate must be in [0, 1]",
        ),
        (
            v.as_str(),
            &["--fim-split-sample", "<fim_pad>"][..],
            "--fim-split-sample needs --fim-fragment-rate",
        ),
        (
            v.as_str(),
            &["--fim-fragment-rate", "0.5"][..],
            "--fim-fragment-rate applies with --fim-split-sample",
        ),
        (
            v.as_str(),
            &["--fim-middle-token", "<nope>"][..],
            "--fim-middle-token \"<nope>\"",
        ),
    ] {
        let mut f = flags(vocab, &m, &data, &["--train-iters", "2"]);
        f.extend(extra.iter().map(|s| s.to_string()));
        let e = pretrain(&parse_train(&f)).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
    let mock = common::args(&["--fim-data", "--train-iters", "2"]);
    let e = pretrain(&mock).unwrap_err().to_string();
    assert!(e.contains("--fim-data") && e.contains("--mock-data"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
