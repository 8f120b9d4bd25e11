//! Megatron's fill-in-the-middle transform (`GPTFIMDataset`): each document keeps its text behind
//! the sentinels in PSM or SPM order, samples keep their length, `--fim-no-prefix` and
//! `--fim-split-sample` act as Megatron's do, and a sample's transform depends on its index
//! alone.

use megatron_data::fim_dataset::{FimSettings, FimTokens, GPTFIMDataset};
use megatron_data::{build_tokenizer_from, GPTSampleSource, Split, Tokenizer, TokenizerSpec};
use megatron_tensor::RngKey;
use std::path::PathBuf;

/// GPT-2's vocabulary (committed fixture) with FIM tokens and a file separator appended, as
/// StarCoder's adds them.
fn fim_tokenizer(tag: &str) -> Box<dyn Tokenizer> {
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2");
    let dir = std::env::temp_dir().join(format!("megatron-rs-fim-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(fx.join("vocab.json")).unwrap();
    let mut vocab: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).unwrap();
    for (i, t) in [
        "<fim_prefix>",
        "<fim_middle>",
        "<fim_suffix>",
        "<fim_pad>",
        "<file_sep>",
    ]
    .iter()
    .enumerate()
    {
        vocab.insert(t.to_string(), (50257 + i).into());
    }
    let v = dir.join("vocab.json");
    std::fs::write(&v, serde_json::Value::Object(vocab).to_string()).unwrap();
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(v.display().to_string()),
        merge_file: Some(fx.join("merges.txt").display().to_string()),
        tokenizer_model: None,
        vocab_size: None,
        vocab_extra_ids: 0,
        tiktoken: None,
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(dir);
    tok
}

/// The same vocabulary as a Hugging Face tokenizer.json (byte-level BPE, the FIM tokens and
/// `<|endoftext|>` as special added tokens), as StarCoder ships its tokenizer.
fn fim_hf_tokenizer(tag: &str) -> Box<dyn Tokenizer> {
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2");
    let dir = std::env::temp_dir().join(format!("megatron-rs-fim-hf-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(fx.join("vocab.json")).unwrap();
    let mut vocab: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).unwrap();
    let mut added = vec![serde_json::json!({"id": 50256, "content": "<|endoftext|>",
        "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
        "special": true})];
    for (i, t) in ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
        .iter()
        .enumerate()
    {
        vocab.insert(t.to_string(), (50257 + i).into());
        added.push(
            serde_json::json!({"id": 50257 + i, "content": t, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let merges: Vec<String> = std::fs::read_to_string(fx.join("merges.txt"))
        .unwrap()
        .lines()
        .skip(1)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "HuggingFaceTokenizer".into(),
        tokenizer_model: Some(path.display().to_string()),
        ..Default::default()
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(dir);
    tok
}

fn settings(tok: &dyn Tokenizer, rate: f64, spm_rate: f64) -> FimSettings {
    let id = |t: &str| tok.token_id(t).unwrap();
    FimSettings {
        rate,
        spm_rate,
        split_sample: None,
        no_prefix: None,
        tokens: FimTokens {
            prefix: id("<fim_prefix>"),
            middle: id("<fim_middle>"),
            suffix: id("<fim_suffix>"),
            pad: id("<fim_pad>"),
            eod: id("<|endoftext|>"),
        },
    }
}

/// A fixed sample source: sample `i` is `samples[i % len]`.
struct Fixed(Vec<Vec<u32>>);

impl GPTSampleSource for Fixed {
    fn seq_length(&self) -> usize {
        self.0[0].len() - 1
    }
    fn num_samples(&self, _: Split) -> u64 {
        self.0.len() as u64
    }
    fn sample(&self, _: Split, idx: u64, out: &mut [u32]) {
        out.copy_from_slice(&self.0[idx as usize % self.0.len()]);
    }
    fn eod(&self) -> Option<u32> {
        None
    }
}

fn dataset(tok: Box<dyn Tokenizer>, s: FimSettings, samples: Vec<Vec<u32>>) -> GPTFIMDataset {
    GPTFIMDataset {
        inner: Box::new(Fixed(samples)),
        tokenizer: tok,
        settings: s,
        seed: 1234,
    }
}

/// The text of one PSM-transformed document, put back in order: `[PRE] prefix [SUF] suffix
/// [MID] middle` read as prefix + middle + suffix.
fn psm_text(tok: &dyn Tokenizer, x: &[u32], t: &FimTokens) -> String {
    let pos = |id: u32| x.iter().position(|&v| v == id).unwrap();
    let (s, m) = (pos(t.suffix), pos(t.middle));
    assert_eq!(x[0], t.prefix);
    tok.decode(&x[1..s]) + &tok.decode(&x[m + 1..]) + &tok.decode(&x[s + 1..m])
}

#[test]
fn each_document_keeps_its_text_behind_the_sentinels_in_psm_and_spm_order() {
    // Megatron's GPT2BPETokenizer files, and the same vocabulary as a tokenizer.json whose FIM
    // tokens are special (dropped from the text that is cut, as Megatron's
    // `remove_special_tokens=True` drops them).
    type Make = fn(&str) -> Box<dyn Tokenizer>;
    for make in [fim_tokenizer as Make, fim_hf_tokenizer as Make] {
        documents_keep_their_text(make);
    }
}

fn documents_keep_their_text(make: fn(&str) -> Box<dyn Tokenizer>) {
    let tok = make("psm");
    // The end-of-document token is special in both: not part of the text FIM cuts.
    let ids = [&[tok.eod()][..], &tok.encode("ab").unwrap()].concat();
    assert_eq!(tok.decode_without_special(&ids), "ab", "{}", tok.name());
    assert!(tok.decode(&ids).contains("<|endoftext|>"));
    let doc = "def add(a, b):\n    return a + b\n";
    let other = "print('hello world') # and more text after it";
    let mut sample = tok.encode(doc).unwrap();
    let first_len = sample.len();
    sample.push(tok.eod());
    sample.extend(tok.encode(other).unwrap());
    for spm in [false, true] {
        let s = settings(tok.as_ref(), 1.0, if spm { 1.0 } else { 0.0 });
        let t = s.tokens;
        let ds = dataset(make("psm2"), s, vec![sample.clone()]);
        for idx in 0..8u64 {
            let key = RngKey::new(7).fold(idx);
            let out = ds.transform(&sample, key);
            assert_eq!(out.len(), sample.len(), "the sample keeps its length");
            let eod = out.iter().position(|&x| x == tok.eod()).unwrap();
            assert!(
                eod >= first_len + 3,
                "the first document grew by its three sentinels"
            );
            let text = if spm {
                // SPM: [PRE, SUF] suffix [MID] prefix middle.
                assert_eq!(&out[..2], &[t.prefix, t.suffix]);
                let mid = out[..eod].iter().position(|&v| v == t.middle).unwrap();
                tok.decode(&out[mid + 1..eod]) + &tok.decode(&out[2..mid])
            } else {
                psm_text(tok.as_ref(), &out[..eod], &t)
            };
            assert_eq!(text, doc, "idx {idx}, spm {spm}");
            // The second document is transformed too: it starts with the prefix sentinel.
            assert_eq!(out[eod + 1], t.prefix);
        }
    }
}

#[test]
fn rate_zero_leaves_samples_alone_and_a_sample_index_fixes_its_transform() {
    let tok = fim_tokenizer("rate");
    let sample = tok
        .encode("fn main() { println!(\"{}\", 1 + 2); } // a line of Rust")
        .unwrap();
    let untouched = dataset(
        fim_tokenizer("rate0"),
        settings(tok.as_ref(), 0.0, 0.5),
        vec![sample.clone()],
    );
    let mut out = vec![0; sample.len()];
    for idx in 0..16 {
        untouched.sample(Split::Train, idx, &mut out);
        assert_eq!(out, sample);
    }
    let ds = dataset(
        fim_tokenizer("rate1"),
        settings(tok.as_ref(), 1.0, 0.5),
        vec![sample.clone()],
    );
    let (mut a, mut b) = (vec![0; sample.len()], vec![0; sample.len()]);
    let mut distinct = std::collections::HashSet::new();
    for idx in 0..16 {
        ds.sample(Split::Train, idx, &mut a);
        ds.sample(Split::Train, idx, &mut b);
        assert_eq!(a, b, "sample {idx} is drawn the same each time");
        distinct.insert(a.clone());
    }
    assert!(
        distinct.len() > 4,
        "different samples cut at different places"
    );
    // Another split draws other cuts for the same index.
    let mut v = vec![0; sample.len()];
    let differs = (0..16).any(|idx| {
        ds.sample(Split::Train, idx, &mut a);
        ds.sample(Split::Valid, idx, &mut v);
        a != v
    });
    assert!(differs);
}

#[test]
fn no_prefix_documents_stay_and_split_samples_transform_each_fragment() {
    let tok = fim_tokenizer("split");
    let (eod, sep) = (tok.eod(), tok.token_id("<file_sep>").unwrap());
    let a = tok.encode("#!skip this document").unwrap();
    let b = tok.encode("x = 1\ny = 2\n").unwrap();
    let c = tok.encode("z = x + y\n").unwrap();
    let mut s = settings(tok.as_ref(), 1.0, 0.0);
    s.no_prefix = Some("#!".into());
    let t = s.tokens;
    // Document a is left alone; document b is transformed.
    let sample: Vec<u32> = [&a[..], &[eod], &b[..]].concat();
    let ds = dataset(fim_tokenizer("split2"), s.clone(), vec![sample.clone()]);
    let out = ds.transform(&sample, RngKey::new(3));
    assert_eq!(&out[..a.len() + 1], &sample[..a.len() + 1]);
    assert_eq!(out[a.len() + 1], t.prefix);
    // A repository sample: files b and c around the separator, each file transformed.
    s.no_prefix = None;
    s.split_sample = Some((sep, 1.0));
    let repo: Vec<u32> = [&b[..], &[sep], &c[..], &[eod]].concat();
    let long: Vec<u32> = [&repo[..], &vec![eod; 12][..]].concat();
    let ds = dataset(fim_tokenizer("split3"), s.clone(), vec![long.clone()]);
    let out = ds.transform(&long, RngKey::new(5));
    let cut = out.iter().position(|&x| x == sep).unwrap();
    assert_eq!(out[0], t.prefix, "file b transformed");
    assert_eq!(out[cut + 1], t.prefix, "file c transformed");
    let end = out.iter().position(|&x| x == eod).unwrap();
    assert_eq!(psm_text(tok.as_ref(), &out[..cut], &t), "x = 1\ny = 2\n");
    assert_eq!(
        psm_text(tok.as_ref(), &out[cut + 1..end], &t),
        "z = x + y\n"
    );
    // Megatron's quirks: the twelve empty documents lose their end-of-document tokens, the
    // empty piece after the last one becomes three sentinels, and pad fills the rest.
    assert_eq!(&out[end + 1..end + 4], &[t.prefix, t.suffix, t.middle]);
    assert!(out[end + 4..].iter().all(|&x| x == t.pad));
    assert_eq!(out.len(), long.len());
    // At fragment rate 0 the files stay as they were.
    s.split_sample = Some((sep, 0.0));
    let ds = dataset(fim_tokenizer("split4"), s, vec![repo.clone()]);
    let out = ds.transform(&repo, RngKey::new(5));
    assert_eq!(&out[..repo.len() - 1], &repo[..repo.len() - 1]);
}
