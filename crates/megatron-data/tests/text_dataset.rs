use megatron_data::{
    parse_split, ByteLevelTokenizer, GPTSampleSource, MockGPTDataset, NullTokenizer, Split,
    TextDataset, Tokenizer,
};

#[test]
fn split_parses_megatron_weights() {
    let w = parse_split("969,30,1").unwrap();
    assert!(
        (w[0] - 0.969).abs() < 1e-12 && (w[1] - 0.03).abs() < 1e-12 && (w[2] - 0.001).abs() < 1e-12
    );
    assert_eq!(parse_split("1").unwrap(), [1.0, 0.0, 0.0]);
    for bad in ["", "a,b", "1,2,3,4", "0,0,0", "-1,2"] {
        let e = parse_split(bad).unwrap_err().to_string();
        assert!(e.contains("--split"), "{bad}: {e}");
    }
}

fn corpus(dir: &std::path::Path) -> String {
    let p = dir.join("corpus.txt");
    let text: String = (0..400)
        .map(|i| format!("line {i} of the corpus.\n"))
        .collect();
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn text_samples_are_windows_of_the_corpus_with_shifted_labels() {
    let dir = std::env::temp_dir().join(format!("mrs-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = corpus(&dir);
    let ds = TextDataset::from_files(
        std::slice::from_ref(&p),
        &ByteLevelTokenizer,
        "90,10,0",
        32,
        7,
    )
    .unwrap();
    let all = ByteLevelTokenizer
        .encode(&std::fs::read_to_string(&p).unwrap())
        .unwrap();
    let mut s = vec![0u32; 33];
    let n = ds.num_samples(Split::Train);
    assert!(n > 100);
    let mut starts = std::collections::HashSet::new();
    for i in 0..n {
        ds.sample(Split::Train, i, &mut s);
        let pos = all
            .windows(33)
            .position(|w| w == s.as_slice())
            .expect("sample is a window of the corpus");
        assert_eq!(pos % 32, 0, "windows overlap by exactly one token");
        starts.insert(pos);
    }
    assert_eq!(starts.len() as u64, n, "an epoch visits every window once");
    // Same seed, same order; another seed, another order.
    let again = TextDataset::from_files(
        std::slice::from_ref(&p),
        &ByteLevelTokenizer,
        "90,10,0",
        32,
        7,
    )
    .unwrap();
    let other = TextDataset::from_files(
        std::slice::from_ref(&p),
        &ByteLevelTokenizer,
        "90,10,0",
        32,
        8,
    )
    .unwrap();
    let (mut a, mut b, mut c) = (vec![0; 33], vec![0; 33], vec![0; 33]);
    ds.sample(Split::Train, 5, &mut a);
    again.sample(Split::Train, 5, &mut b);
    other.sample(Split::Train, 5, &mut c);
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(ds.num_samples(Split::Valid) > 0);
    assert_eq!(ds.num_samples(Split::Test), 0);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn corpus_smaller_than_one_sample_is_refused_with_its_path() {
    let dir = std::env::temp_dir().join(format!("mrs-small-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("tiny.txt");
    std::fs::write(&p, "hello").unwrap();
    let e = TextDataset::from_files(&[p.display().to_string()], &ByteLevelTokenizer, "1", 32, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("tiny.txt") && e.contains("--seq-length"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tokenizers_round_trip() {
    let b = ByteLevelTokenizer;
    assert_eq!(b.decode(&b.encode("héllo").unwrap()), "héllo");
    let n = NullTokenizer { vocab_size: 10 };
    assert_eq!(n.encode("1 2 9").unwrap(), vec![1, 2, 9]);
    assert_eq!(n.eod(), 10);
    assert!(n.encode("1 x").unwrap_err().to_string().contains("'x'"));
}

#[test]
fn mock_samples_are_consecutive_ids() {
    let m = MockGPTDataset {
        vocab_size: 50,
        seq_length: 8,
        seed: 3,
    };
    let mut s = vec![0u32; 9];
    m.sample(Split::Train, 17, &mut s);
    for w in s.windows(2) {
        assert_eq!(w[1], (w[0] + 1) % 50);
    }
}

#[test]
fn gpt2_bpe_encodes_hello_world_like_gpt2() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt2");
    let spec = megatron_data::TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(format!("{dir}/vocab.json")),
        merge_file: Some(format!("{dir}/merges.txt")),
        ..Default::default()
    };
    let t = megatron_data::build_tokenizer_from(&spec).unwrap();
    assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
    assert_eq!(t.eod(), 50256);
    assert_eq!(t.vocab_size(), 50257);
    let text = "The quick brown fox, naïve café — 2024!\n  indented";
    assert_eq!(t.decode(&t.encode(text).unwrap()), text);
    let missing = megatron_data::TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        ..Default::default()
    };
    assert!(megatron_data::build_tokenizer_from(&missing)
        .err()
        .unwrap()
        .to_string()
        .contains("--vocab-file"));
}

#[test]
fn fast_gpt2_bpe_gives_the_same_ids_as_hugging_face_bpe() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt2");
    let (v, m) = (format!("{dir}/vocab.json"), format!("{dir}/merges.txt"));
    let fast = megatron_data::gpt2_bpe::Gpt2Bpe::from_files(&v, &m)
        .unwrap()
        .expect("GPT-2 ids follow merge order");
    let hf = megatron_data::hf_tokenizer::HFTokenizer::gpt2(&v, &m).unwrap();
    let cases = [
        "Hello world",
        "  leading and trailing spaces   ",
        "tabs\tand\nnewlines\n\n\n",
        "I'll we've they're it's don't",
        "numbers 1234567890 3.14159 -42",
        "naïve café — “quotes” ünïcödé 日本語 🙂",
        "int main(void) { return x->y[0] != 0x1F; }",
        "<|endoftext|> is plain text here",
        "",
    ];
    for c in cases {
        assert_eq!(fast.encode(c).unwrap(), hf.encode(c).unwrap(), "{c:?}");
        assert_eq!(fast.decode(&fast.encode(c).unwrap()), c);
    }
    assert_eq!(fast.eod(), 50256);
}
