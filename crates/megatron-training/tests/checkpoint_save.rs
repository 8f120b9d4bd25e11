//! Saving checkpoints: a `--save` directory no rank can write stops the run at start-up, naming
//! the flag, instead of after the first `--save-interval` iterations of training.

mod common;

use common::*;
use megatron_training::pretrain;

#[test]
fn an_unwritable_save_directory_is_refused_before_training() {
    let dir = tmpdir("save-unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    // A path below a regular file: no rank can create a directory there (even as root).
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let save = file.join("checkpoints");
    let save = save.to_str().unwrap();
    for layout in [&[][..], &["--nproc-per-node", "2"][..]] {
        let flags = [&["--train-iters", "2", "--save", save][..], layout].concat();
        let err = pretrain(&args(&flags)).expect_err("an unwritable --save must stop the run");
        let msg = err.to_string();
        assert!(
            msg.contains("--save") && msg.contains(save) && msg.contains("nothing was trained"),
            "{layout:?}: {msg}"
        );
    }
    // A writable one is created at start-up and left without probe files.
    let ok = dir.join("checkpoints");
    let s = pretrain(&args(&[
        "--train-iters",
        "2",
        "--save",
        ok.to_str().unwrap(),
        "--nproc-per-node",
        "2",
    ]))
    .unwrap();
    assert_eq!(s.final_iteration, 2);
    let stray: Vec<_> = std::fs::read_dir(&ok)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".write_check"))
        .collect();
    assert!(stray.is_empty(), "probe files left behind: {stray:?}");
    let _ = std::fs::remove_dir_all(dir);
}
