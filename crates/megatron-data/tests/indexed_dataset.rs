use megatron_data::indexed_dataset::{IndexedDataset, IndexedDatasetBuilder, TokenDType};

fn fixture_prefix() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/megatron_small").to_string()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mrs-idx-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn reads_a_dataset_written_by_megatron_core() {
    let ds = IndexedDataset::open(&fixture_prefix()).unwrap();
    assert_eq!(ds.len(), 60);
    assert_eq!(ds.num_documents(), 60);
    assert_eq!(ds.dtype(), TokenDType::U16);
    for i in 0..ds.len() {
        let item = ds.item(i);
        // The typed view reads the memory map in place and agrees with the decoded copy.
        match ds.slice(i, 0, ds.length(i)) {
            megatron_data::indexed_dataset::TokenSlice::U16(v) => {
                assert_eq!(v.iter().map(|&x| x as u32).collect::<Vec<_>>(), item);
                let bin_start = ds.pointer(i) as usize;
                assert_eq!(bin_start % 2, 0);
            }
            other => panic!("expected a u16 view, got {other:?}"),
        }
        assert_eq!(item.len(), ds.length(i));
        assert_eq!(
            *item.last().unwrap(),
            999,
            "every document ends with the EOD id"
        );
        assert!(item.iter().all(|&t| t <= 999));
    }
}

#[test]
fn rewriting_megatron_items_gives_byte_identical_files() {
    let src = IndexedDataset::open(&fixture_prefix()).unwrap();
    let dir = tmp("rewrite");
    let prefix = dir.join("copy").display().to_string();
    let mut b = IndexedDatasetBuilder::new(&prefix, TokenDType::U16).unwrap();
    for i in 0..src.len() {
        b.add_item(&src.item(i)).unwrap();
        b.end_document();
    }
    b.finalize().unwrap();
    for ext in ["bin", "idx"] {
        let ours = std::fs::read(format!("{prefix}.{ext}")).unwrap();
        let theirs = std::fs::read(format!("{}.{ext}", fixture_prefix())).unwrap();
        assert_eq!(ours, theirs, ".{ext} differs from megatron-core's");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn round_trip_and_merge() {
    let dir = tmp("merge");
    let a = dir.join("a").display().to_string();
    let b = dir.join("b").display().to_string();
    let docs_a: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![70000, 5]];
    let docs_b: Vec<Vec<u32>> = vec![vec![9; 10]];
    for (p, docs) in [(&a, &docs_a), (&b, &docs_b)] {
        let mut w = IndexedDatasetBuilder::new(p, TokenDType::I32).unwrap();
        for d in docs.iter() {
            w.add_item(d).unwrap();
            w.end_document();
        }
        w.finalize().unwrap();
    }
    let m = dir.join("m").display().to_string();
    let mut w = IndexedDatasetBuilder::new(&m, TokenDType::I32).unwrap();
    w.add_index(&IndexedDataset::open(&a).unwrap()).unwrap();
    w.add_index(&IndexedDataset::open(&b).unwrap()).unwrap();
    w.finalize().unwrap();
    let ds = IndexedDataset::open(&m).unwrap();
    let all: Vec<Vec<u32>> = (0..ds.len()).map(|i| ds.item(i)).collect();
    assert_eq!(all, [docs_a, docs_b].concat());
    assert_eq!(ds.document_indices(), &[0, 1, 2, 3]);
    let mut part = Vec::new();
    ds.get(2, 3, 4, &mut part);
    assert_eq!(part, vec![9; 4]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn token_too_large_for_uint16_is_refused() {
    let dir = tmp("big");
    let p = dir.join("x").display().to_string();
    let mut w = IndexedDatasetBuilder::new(&p, TokenDType::U16).unwrap();
    let e = w.add_item(&[70000]).unwrap_err().to_string();
    assert!(e.contains("70000"), "{e}");
    drop(w);
    assert!(
        std::fs::read_dir(&dir).unwrap().next().is_none(),
        "an abandoned builder leaves no files"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn damaged_files_are_refused_with_their_path() {
    let dir = tmp("bad");
    for ext in ["bin", "idx"] {
        std::fs::copy(
            format!("{}.{ext}", fixture_prefix()),
            dir.join(format!("d.{ext}")),
        )
        .unwrap();
    }
    let p = dir.join("d").display().to_string();
    assert!(IndexedDataset::open(&p).is_ok());
    // Truncated .bin
    let bin = std::fs::read(format!("{p}.bin")).unwrap();
    std::fs::write(format!("{p}.bin"), &bin[..bin.len() - 2]).unwrap();
    let e = IndexedDataset::open(&p).err().unwrap().to_string();
    assert!(e.contains("d.bin") && e.contains("truncated"), "{e}");
    std::fs::write(format!("{p}.bin"), &bin).unwrap();
    // Bad magic, bad version, truncated index
    let idx = std::fs::read(format!("{p}.idx")).unwrap();
    let mut bad = idx.clone();
    bad[0] = b'X';
    std::fs::write(format!("{p}.idx"), &bad).unwrap();
    assert!(IndexedDataset::open(&p)
        .err()
        .unwrap()
        .to_string()
        .contains("magic"));
    let mut bad = idx.clone();
    bad[9] = 2;
    std::fs::write(format!("{p}.idx"), &bad).unwrap();
    assert!(IndexedDataset::open(&p)
        .err()
        .unwrap()
        .to_string()
        .contains("version 2"));
    std::fs::write(format!("{p}.idx"), &idx[..idx.len() - 8]).unwrap();
    let e = IndexedDataset::open(&p).err().unwrap().to_string();
    assert!(e.contains("d.idx") && e.contains("truncated"), "{e}");
    // Missing files
    let e = IndexedDataset::open(&dir.join("nope").display().to_string())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nope.idx"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
