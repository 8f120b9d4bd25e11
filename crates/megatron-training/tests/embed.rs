//! `megatron embed` on the tiny converted `BertModel` fixture with a small WordPiece
//! tokenizer: each line's vector is the mean of the encoder's outputs over its tokens (the same
//! whether lines are embedded alone or padded into a micro-batch), `--normalize` gives unit
//! vectors, `--max-length` keeps `[SEP]`, and bad input is named.

mod common;

use common::tmpdir;
use megatron_core::models::bert::BertBatch;
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_training::convert::hf_to_megatron;
use megatron_training::embed::{embed, EmbedArgs};
use megatron_training::load::load_bert;
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/bert_model")
}

/// A WordPiece tokenizer.json over the fixture's 96 ids: specials, letters, a few words and
/// their `##` pieces, with BERT's `[CLS] ... [SEP]` post-processor.
fn write_tokenizer(dir: &Path) -> PathBuf {
    use tokenizers::models::wordpiece::WordPiece;
    use tokenizers::normalizers::bert::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::processors::bert::BertProcessing;
    let mut vocab: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","]
        .iter()
        .map(|s| s.to_string())
        .collect();
    vocab.extend(('a'..='z').map(|c| c.to_string()));
    vocab.extend(('a'..='z').map(|c| format!("##{c}")));
    vocab.extend(["the", "cat", "sat", "on", "mat", "dog", "ran"].map(String::from));
    while vocab.len() < 96 {
        vocab.push(format!("[unused{}]", vocab.len()));
    }
    let vocab_file = dir.join("vocab.txt");
    std::fs::write(&vocab_file, vocab.join("\n")).unwrap();
    let wp = WordPiece::from_file(vocab_file.to_str().unwrap())
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(wp);
    tok.with_normalizer(Some(BertNormalizer::new(true, true, None, true)));
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_post_processor(Some(BertProcessing::new(
        ("[SEP]".into(), 3),
        ("[CLS]".into(), 2),
    )));
    let path = dir.join("tokenizer.json");
    tok.save(&path, false).unwrap();
    path
}

fn read_npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let v = b[10 + hl..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (shape, v)
}

fn args(save: &Path, input: &Path, out: &Path, tok: &Path) -> EmbedArgs {
    EmbedArgs {
        load: save.to_path_buf(),
        input: input.to_path_buf(),
        out: out.to_path_buf(),
        max_length: None,
        micro_batch_size: 2,
        normalize: false,
        tokenizer_model: Some(tok.to_path_buf()),
    }
}

#[test]
fn embed_mean_pools_each_line_alone_or_in_a_padded_micro_batch() {
    let dir = tmpdir("embed");
    let save = dir.join("megatron");
    hf_to_megatron(&fixture(), &save, 1).unwrap();
    let tok_path = write_tokenizer(&dir);
    let lines = ["The cat sat on the mat.", "", "dog ran", "zzz, cats."];
    let input = dir.join("texts.txt");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("emb.npy");
    assert_eq!(embed(&args(&save, &input, &out, &tok_path)).unwrap(), 4);
    let (shape, got) = read_npy_f32(&out);
    assert_eq!(shape, vec![4, 32]);
    // Each line alone, through the encoder, averaged by hand.
    let (model, params, _) = load_bert(&save).unwrap();
    let tok = tokenizers::Tokenizer::from_file(&tok_path).unwrap();
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    for (i, line) in lines.iter().enumerate() {
        let e = tok.encode(*line, true).unwrap();
        let ids = e.get_ids().to_vec();
        assert_eq!((ids[0], *ids.last().unwrap()), (2, 3), "[CLS] ... [SEP]");
        let types = vec![0u32; ids.len()];
        let batch = BertBatch {
            tokens: &ids,
            tokentypes: &types,
            key_lens: &[ids.len()],
            masked_rows: &[],
            masked_labels: &[],
            sentence_order: &[],
            b: 1,
            t: ids.len(),
        };
        let y = model.encode(&params, &mut tp, &batch).unwrap();
        let want: Vec<f32> = (0..32)
            .map(|c| (0..ids.len()).map(|r| y.data()[r * 32 + c]).sum::<f32>() / ids.len() as f32)
            .collect();
        let d = want
            .iter()
            .zip(&got[i * 32..(i + 1) * 32])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d < 1e-5, "line {i} ({line:?}): {d}");
    }
    // --normalize: unit vectors in the same directions.
    let mut a = args(&save, &input, &out, &tok_path);
    a.normalize = true;
    embed(&a).unwrap();
    let (_, unit) = read_npy_f32(&out);
    for i in 0..4 {
        let u = &unit[i * 32..(i + 1) * 32];
        let norm = u.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "line {i}: norm {norm}");
        let g = &got[i * 32..(i + 1) * 32];
        let gn = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(u.iter().zip(g).all(|(x, y)| (x - y / gn).abs() < 1e-5));
    }
    // --max-length 4: [CLS], two tokens, and the closing [SEP] kept.
    let mut a = args(&save, &input, &out, &tok_path);
    a.max_length = Some(4);
    embed(&a).unwrap();
    let (_, short) = read_npy_f32(&out);
    assert_ne!(&short[..32], &got[..32], "the first line was truncated");
    // The same 2 tokens either way, but the batch is padded to 4 tokens here and to the longest
    // line above, and the kernels' blocking follows the padded shape: equal to rounding, as each
    // line alone is above (bit-equal on AVX-512 machines, not on an AVX2-only Zen 3).
    let d = short[32..64]
        .iter()
        .zip(&got[32..64])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(d < 1e-5, "the empty line is 2 tokens either way: {d}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn embed_names_what_is_wrong() {
    let dir = tmpdir("embed-errors");
    let save = dir.join("megatron");
    hf_to_megatron(&fixture(), &save, 1).unwrap();
    let tok_path = write_tokenizer(&dir);
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let out = dir.join("e.npy");
    let e = embed(&args(&save, &empty, &out, &tok_path))
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty.txt") && e.contains("no lines"), "{e}");
    assert!(!out.exists(), "nothing written for a failed run");
    // The fixture checkpoint records no tokenizer: without --tokenizer-model it says so.
    let texts = dir.join("t.txt");
    std::fs::write(&texts, "the cat").unwrap();
    let mut a = args(&save, &texts, &out, &tok_path);
    a.tokenizer_model = None;
    let e = embed(&a).unwrap_err().to_string();
    assert!(e.contains("--tokenizer-model"), "{e}");
    // A GPT checkpoint is not a BERT.
    let gpt = dir.join("gpt");
    hf_to_megatron(&fixture().join("../gpt2"), &gpt, 1).unwrap();
    let e = embed(&args(&gpt, &texts, &out, &tok_path))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a BERT checkpoint"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
