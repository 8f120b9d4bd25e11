use megatron_data::indexed_dataset::IndexedDataset;
use megatron_data::preprocess::{preprocess, PreprocessConfig};
use megatron_data::{build_tokenizer_from, Tokenizer, TokenizerSpec};

fn gpt2() -> Box<dyn Tokenizer> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt2");
    build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "GPT2BPETokenizer".into(),
        vocab_file: Some(format!("{dir}/vocab.json")),
        merge_file: Some(format!("{dir}/merges.txt")),
        ..Default::default()
    })
    .unwrap()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mrs-pre-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cfg(input: &std::path::Path, out: &std::path::Path, workers: usize) -> PreprocessConfig {
    PreprocessConfig {
        input: vec![input.display().to_string()],
        json_keys: vec!["text".into()],
        output_prefix: out.display().to_string(),
        append_eod: true,
        split_sentences: false,
        workers,
        skip_bad_lines: false,
        log_interval: 0,
    }
}

fn docs() -> Vec<String> {
    (0..500)
        .map(|i| {
            format!(
                "Document {i}: the State of the Union is {}.",
                "strong ".repeat(i % 7)
            )
        })
        .collect()
}

#[test]
fn preprocess_jsonl_round_trips_in_input_order_with_any_worker_count() {
    let dir = tmp("rt");
    let input = dir.join("in.jsonl");
    let mut text = String::new();
    for d in docs() {
        text.push_str(&serde_json::json!({ "text": d, "id": 1 }).to_string());
        text.push('\n');
    }
    text.push_str("{\"text\": \"\"}\n\n");
    std::fs::write(&input, text).unwrap();
    let tok = gpt2();
    let mut outputs = Vec::new();
    for workers in [1, 2, 3] {
        let out = dir.join(format!("w{workers}"));
        let s = preprocess(&cfg(&input, &out, workers), tok.as_ref()).unwrap();
        assert_eq!(s.documents, 500);
        assert_eq!(s.empty_documents, 1);
        let prefix = format!("{}_text_document", out.display());
        let ds = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(ds.len(), 500);
        for (i, d) in docs().iter().enumerate() {
            let mut want = tok.encode(d).unwrap();
            want.push(50256);
            assert_eq!(ds.item(i), want, "document {i}");
        }
        outputs.push((
            std::fs::read(format!("{prefix}.bin")).unwrap(),
            std::fs::read(format!("{prefix}.idx")).unwrap(),
        ));
    }
    assert!(
        outputs.windows(2).all(|w| w[0] == w[1]),
        "output independent of --workers"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_lines_are_refused_with_file_and_line_and_leave_no_index() {
    let dir = tmp("bad");
    let input = dir.join("in.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"fine\"}\n{\"text\": \"fine\"}\n{not json\n{\"text\": \"x\"}\n",
    )
    .unwrap();
    let out = dir.join("out");
    let e = preprocess(&cfg(&input, &out, 2), gpt2().as_ref())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("in.jsonl:3") && e.contains("malformed JSON"),
        "{e}"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert!(
        !left
            .iter()
            .any(|f| f.ends_with(".idx") || f.ends_with(".bin")),
        "nothing that looks like a dataset: {left:?}"
    );

    let mut c = cfg(&input, &out, 1);
    c.skip_bad_lines = true;
    let s = preprocess(&c, gpt2().as_ref()).unwrap();
    assert_eq!((s.documents, s.skipped_bad_lines), (3, 1));

    std::fs::write(&input, "{\"body\": \"no text key\"}\n").unwrap();
    let e = preprocess(&cfg(&input, &out, 1), gpt2().as_ref())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("in.jsonl:1") && e.contains("missing key 'text'"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn plain_text_files_are_one_document_each_and_non_utf8_is_named() {
    let dir = tmp("txt");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a.txt"), "first file").unwrap();
    std::fs::write(src.join("b.txt"), "second file").unwrap();
    let out = dir.join("out");
    let s = preprocess(&cfg(&src, &out, 2), gpt2().as_ref()).unwrap();
    assert_eq!(s.documents, 2);
    let ds = IndexedDataset::open(&format!("{}_text_document", out.display())).unwrap();
    let item = ds.item(1);
    assert_eq!(item.last(), Some(&50256), "--append-eod");
    assert_eq!(gpt2().decode(&item[..item.len() - 1]), "second file");
    std::fs::write(src.join("c.txt"), [0x66u8, 0xff, 0xfe]).unwrap();
    let e = preprocess(&cfg(&src, &out, 1), gpt2().as_ref())
        .unwrap_err()
        .to_string();
    assert!(e.contains("c.txt") && e.contains("UTF-8"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_out_of_range_token_id_is_named_with_its_file_and_line() {
    // NullTokenizer reads integer ids; 500 is beyond its vocabulary of 100.
    let dir = tmp("nullrange");
    let input = dir.join("ids.jsonl");
    std::fs::write(&input, "{\"text\": \"1 2 3\"}\n{\"text\": \"4 500 6\"}\n").unwrap();
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "NullTokenizer".into(),
        vocab_size: Some(100),
        ..Default::default()
    })
    .unwrap();
    let e = preprocess(&cfg(&input, &dir.join("out"), 1), tok.as_ref())
        .unwrap_err()
        .to_string();
    assert!(e.contains("ids.jsonl:2") && e.contains("500"), "{e}");
    assert!(!dir.join("out_text_document.idx").exists());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn split_sentences_writes_one_sequence_per_sentence_within_documents() {
    let dir = tmp("sentences");
    let input = dir.join("in.jsonl");
    let lines = [
        r#"{"text": "Mr. Smith went to Washington. He arrived at 3 p.m. on Tuesday! Did he stay?"}"#,
        r#"{"text": "One sentence only"}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("out");
    let mut c = cfg(&input, &out, 1);
    c.split_sentences = true;
    let tok = megatron_data::tokenizer::ByteLevelTokenizer;
    preprocess(&c, &tok).unwrap();
    let ds = IndexedDataset::open(&format!("{}_text_sentence", out.display())).unwrap();
    assert_eq!(ds.document_indices(), &[0, 3, 4]);
    let text = |i: usize| String::from_utf8(ds.item(i).iter().map(|&b| b as u8).collect()).unwrap();
    assert_eq!(text(0), "Mr. Smith went to Washington.");
    assert_eq!(text(1), "He arrived at 3 p.m. on Tuesday!");
    // --append-eod: the end-of-document token closes the document's last sentence.
    assert_eq!(ds.item(2).last(), Some(&256));
    assert_eq!(ds.item(3).len(), "One sentence only".len() + 1);
}

#[test]
fn bert_wordpiece_tokenizer_matches_the_bert_dataset_fixture() {
    // The fixture's sentences were tokenized by transformers' BertTokenizerFast (bert-base-
    // uncased's vocabulary); the same vocabulary is bundled as examples/bert/vocab.txt.
    let vocab = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/bert/vocab.txt");
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "BertWordPieceLowerCase".into(),
        vocab_file: Some(vocab.into()),
        ..Default::default()
    })
    .unwrap();
    // Megatron's WordPiece tokenizer appends [BOS] and [EOS].
    assert_eq!(tok.vocab_size(), 30524);
    assert_eq!(tok.token_text(30522).as_deref(), Some("[BOS]"));
    assert_eq!(tok.encode("Hello world").unwrap(), vec![7592, 2088]);
    assert_eq!(tok.token_id("[MASK]"), Some(103));
    assert_eq!(tok.token_text(2088).as_deref(), Some("world"));
    // Words split into pieces ("##..."), accents stripped, punctuation apart.
    let ids = tok.encode("Eisenhower's Café, naïvely!").unwrap();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.token_text(i).unwrap()).collect();
    assert!(pieces.iter().any(|p| p.starts_with("##")), "{pieces:?}");
    assert_eq!(pieces.last().map(String::as_str), Some("!"));
    assert!(pieces.contains(&"cafe".to_string()), "{pieces:?}");
    let j: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/bert/samples.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let rows = j["tokenized"].as_array().unwrap();
    assert_eq!(rows.len(), 40);
    for r in rows {
        let want: Vec<u32> = r["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.encode(r["text"].as_str().unwrap()).unwrap(),
            want,
            "{}",
            r["text"]
        );
    }
}

#[test]
fn llama2_tokenizer_documents_are_bos_sentencepieces_ids_and_eos() {
    // Megatron's Llama2Tokenizer begins every document with BOS; --append-eod ends it with EOS.
    let fx = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sentencepiece");
    let tok = build_tokenizer_from(&TokenizerSpec {
        tokenizer_type: "Llama2Tokenizer".into(),
        tokenizer_model: Some(format!("{fx}/tiny-sotu-bpe.model")),
        ..Default::default()
    })
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{fx}/tiny-sotu-bpe-vectors.json")).unwrap(),
    )
    .unwrap();
    let cases: Vec<(String, Vec<u32>)> = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["text"].as_str().unwrap().trim().is_empty())
        .map(|c| {
            let ids = c["ids"].as_array().unwrap();
            let ids = ids.iter().map(|i| i.as_u64().unwrap() as u32).collect();
            (c["text"].as_str().unwrap().to_string(), ids)
        })
        .collect();
    let dir = tmp("llama2");
    let input = dir.join("in.jsonl");
    let lines: Vec<String> = cases
        .iter()
        .map(|(t, _)| serde_json::json!({ "text": t }).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("out");
    let s = preprocess(&cfg(&input, &out, 2), tok.as_ref()).unwrap();
    assert_eq!(s.documents, cases.len() as u64);
    let ds = IndexedDataset::open(&format!("{}_text_document", out.display())).unwrap();
    for (i, (text, ids)) in cases.iter().enumerate() {
        let mut want = vec![1];
        want.extend(ids);
        want.push(2);
        assert_eq!(ds.item(i), want, "{text:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
