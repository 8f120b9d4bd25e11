//! The `megatron` binary as a command-line tool.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// `megatron train ... | head -1`: once the reader is gone the process ends like any Unix tool
/// (SIGPIPE), not with a "failed printing to stdout" panic and its backtrace.
#[test]
fn output_piped_into_a_reader_that_closes_ends_without_a_panic() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args([
            "train",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "63",
            "--num-layers",
            "1",
            "--hidden-size",
            "16",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "8",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--train-iters",
            "100000",
            "--lr",
            "1e-3",
            "--log-interval",
            "1",
            "--eval-iters",
            "0",
            "--no-progress-bar",
            "--num-threads",
            "1",
            "--peak-tflops",
            "1",
        ])
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMI_RANK")
        .env_remove("PMIX_RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start megatron");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a first line").expect("utf-8");
    assert!(!first.is_empty());
    drop(lines);
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked"),
        "the process panicked after its reader closed: {stderr}"
    );
    assert!(
        !out.status.success(),
        "100000 iterations cannot have finished: the write to the closed pipe must end the run"
    );
}

/// A tiny GPT on mock data at two rank threads: the model of the tests below.
fn tiny_train() -> Vec<String> {
    [
        "train",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "63",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--nproc-per-node",
        "2",
        "--no-progress-bar",
        "--num-threads",
        "1",
        "--peak-tflops",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn train_args(save: &str) -> Vec<String> {
    let mut v = tiny_train();
    v.extend(
        [
            "--train-iters",
            "1000000",
            "--log-interval",
            "1",
            "--eval-iters",
            "0",
            "--save",
            save,
            "--save-interval",
            "1000000",
            "--exit-signal-handler",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    v
}

/// SIGTERM during training (`--exit-signal-handler`): the iteration finishes, a complete
/// checkpoint is saved, the process exits 0; `megatron checkpoint verify` accepts it and
/// refuses it once a byte of a shard is flipped.
#[test]
fn sigterm_saves_a_complete_checkpoint_and_exits_0_and_verify_catches_a_flipped_byte() {
    let dir = std::env::temp_dir().join(format!("megatron-cli-sigterm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = dir.join("ckpt");
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(train_args(save.to_str().unwrap()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains("iteration        3/") {
            break;
        }
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}: {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("exiting after iteration")),
        "{rest:?}"
    );
    assert!(
        rest.iter().any(|l| l.contains("saved checkpoint")),
        "{rest:?}"
    );
    let verify = |dir: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_megatron"))
            .args(["checkpoint", "verify", dir.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let ok = verify(&save);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let it = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("iter_")
        })
        .unwrap();
    let shard = it.join("shard_00001.safetensors");
    let mut b = std::fs::read(&shard).unwrap();
    let i = b.len() - 5;
    b[i] ^= 1;
    std::fs::write(&shard, b).unwrap();
    let bad = verify(&save);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        err.contains("shard_00001.safetensors") && err.contains("checksum mismatch"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `megatron preprocess` names the files it wrote, one pair per JSON key.
#[test]
fn preprocess_reports_the_files_it_wrote() {
    let dir = std::env::temp_dir().join(format!("megatron-cli-pre-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.jsonl");
    std::fs::write(&input, "{\"text\": \"1 2 3\", \"title\": \"4 5\"}\n").unwrap();
    let prefix = dir.join("out");
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args([
            "preprocess",
            "--input",
            input.to_str().unwrap(),
            "--json-keys",
            "text",
            "title",
        ])
        .args([
            "--output-prefix",
            prefix.to_str().unwrap(),
            "--tokenizer-type",
            "NullTokenizer",
        ])
        .args(["--vocab-size", "10"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for key in ["text", "title"] {
        let name = format!("{}_{key}_document.bin/.idx", prefix.display());
        assert!(stdout.contains(&name), "{stdout}");
        assert!(dir.join(format!("out_{key}_document.idx")).exists());
    }
    assert!(!stdout.contains("<key>"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A run that trains ends as Megatron's `pretrain` does: validation every --eval-interval
/// iterations only, then Megatron's end-of-training lines for the validation set (a new
/// evaluation) and the test set, which log parsers look for. A run ended by an exit condition
/// stops after its checkpoint and prints neither, as Megatron's exits.
#[test]
fn a_finished_run_prints_megatrons_end_of_training_lines_and_an_exited_one_does_not() {
    let run = |extra: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
            .args(tiny_train())
            .args(["--eval-iters", "1"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{extra:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let out = run(&["--train-iters", "3", "--eval-interval", "2"]);
    let value = |prefix: &str| {
        out.lines()
            .position(|l| l.trim_start().starts_with(prefix))
            .map(|i| {
                let v = out.lines().nth(i).unwrap().split("lm loss value: ").nth(1);
                (i, v.unwrap().split(' ').next().unwrap().to_string())
            })
    };
    let (at_2, _) = value("validation loss at iteration 2 |").expect("validation at 2");
    assert!(
        value("validation loss at iteration 3 |").is_none(),
        "3 is not a multiple of --eval-interval: {out}"
    );
    let (at_val, _) =
        value("validation loss at iteration 3 on validation set |").expect("validation line");
    let (at_test, _) = value("validation loss at iteration 3 on test set |").expect("test line");
    assert!(at_2 < at_val, "{out}");
    assert!(
        at_val < at_test,
        "validation, then test, as Megatron prints them"
    );
    let exited = run(&["--train-iters", "5", "--exit-interval", "2"]);
    assert!(exited.contains("exiting after iteration 2"), "{exited}");
    assert!(
        !exited.contains("on validation set") && !exited.contains("on test set"),
        "{exited}"
    );
}

/// A prompt longer than the model's positions is cut to its most recent tokens, and `generate`
/// says so on stderr instead of dropping the beginning silently.
#[test]
fn generate_says_when_it_cuts_a_prompt_longer_than_the_models_positions() {
    let dir = std::env::temp_dir().join(format!("megatron-cli-cut-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let save = dir.join("ckpt");
    let mut args = train_args(save.to_str().unwrap());
    let iters = args.iter().position(|a| a == "--train-iters").unwrap();
    args[iters + 1] = "1".into();
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(&args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // --seq-length 8: 8 positions; a prompt of 10 keeps its last 7 and generates 1.
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(["generate", "--load", save.to_str().unwrap(), "--greedy"])
        .args([
            "--prompt-ids",
            "1 2 3 4 5 6 7 8 9 10",
            "--max-new-tokens",
            "3",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("the prompt's 10 tokens are cut to their last 7"),
        "{err}"
    );
    assert_eq!(
        String::from_utf8(out.stdout)
            .unwrap()
            .split_whitespace()
            .count(),
        1,
        "one new token fits"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `convert`'s layout flags name what they go with, before anything is read.
#[test]
fn convert_refuses_legacy_layout_flags_where_they_mean_nothing() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
            .arg("convert")
            .args(args)
            .args(["--input", "/nonexistent/in", "--output", "/nonexistent/out"])
            .output()
            .expect("run megatron");
        assert!(!out.status.success(), "{args:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&["--to", "torch"]);
    assert!(e.contains("--transformer-impl local"), "{e}");
    let e = run(&["--to", "torch_dist", "--tensor-model-parallel-size", "2"]);
    assert!(e.contains("go with --to torch"), "{e}");
    let e = run(&["--to", "hf", "--num-layers-per-virtual-pipeline-stage", "1"]);
    assert!(e.contains("go with --to torch"), "{e}");
    let e = run(&["--to", "hf", "--expert-model-parallel-size", "2"]);
    assert!(e.contains("--expert-model-parallel-size"), "{e}");
}
