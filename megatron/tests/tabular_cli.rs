//! `megatron train --model tabular` then `megatron tabular predict | impute | score-anomalies`
//! through the binary: outputs with the promised shape, inputs refused by name.

use std::path::{Path, PathBuf};
use std::process::Command;

fn megatron(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args(args)
        .output()
        .expect("runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megatron-rs-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny tabular checkpoint (3 iterations) under `dir`.
fn checkpoint(dir: &Path) -> PathBuf {
    let save = dir.join("ckpt");
    let (ok, text) = megatron(&[
        "train",
        "--model",
        "tabular",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--ffn-hidden-size",
        "32",
        "--global-batch-size",
        "4",
        "--train-iters",
        "3",
        "--lr",
        "1e-3",
        "--prior-max-context-rows",
        "48",
        "--prior-max-query-rows",
        "16",
        "--prior-max-features",
        "8",
        "--save",
        s(&save),
        "--num-threads",
        "2",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("saved checkpoint at iteration 3"), "{text}");
    save
}

/// Rows of a CSV file (header first).
fn read(p: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

fn write_tables(dir: &Path) {
    let mut train = String::from("x1,x2,colour,label,y\n");
    let mut test = String::from("x1,x2,colour,y\n");
    let mut holes = String::from("x1,x2,colour,label,y\n");
    for i in 0..40 {
        let (a, b) = ((i % 7) as f32 * 0.5 - 1.5, (i % 5) as f32 - 2.0);
        let colour = ["red", "blue"][i % 2];
        let label = if a + b > 0.0 { "yes" } else { "no" };
        let y = 2.0 * a - b;
        let row = format!("{a},{b},{colour},{label},{y}\n");
        if i < 30 {
            train += &row
        } else {
            test += &format!("{a},{b},{colour},{y}\n")
        }
        // Missing cells: x1 every 6th row, the label every 9th.
        let a_text = if i % 6 == 0 {
            String::new()
        } else {
            a.to_string()
        };
        let l_text = if i % 9 == 4 { "" } else { label };
        holes += &format!("{a_text},{b},{colour},{l_text},{y}\n");
    }
    std::fs::write(dir.join("train.csv"), train).unwrap();
    std::fs::write(dir.join("test.csv"), test).unwrap();
    std::fs::write(dir.join("holes.csv"), holes).unwrap();
}

#[test]
fn predict_impute_and_score_write_what_they_promise() {
    let dir = tmpdir("tabular");
    let ck = checkpoint(&dir);
    write_tables(&dir);
    let (train, test, holes) = (
        dir.join("train.csv"),
        dir.join("test.csv"),
        dir.join("holes.csv"),
    );

    // Classes: one probability per label, the labels as the header, each row summing to 1.
    let out = dir.join("pred.csv");
    let (ok, text) = megatron(&[
        "tabular",
        "predict",
        "--load",
        s(&ck),
        "--train",
        s(&train),
        "--test",
        s(&test),
        "--target",
        "label",
        "--categorical",
        "colour",
        "--ensemble",
        "3",
        "--out",
        s(&out),
    ]);
    assert!(ok, "{text}");
    let rows = read(&out);
    assert_eq!(rows[0], vec!["no", "yes"]);
    assert_eq!(rows.len(), 11);
    for r in &rows[1..] {
        let sum: f32 = r.iter().map(|v| v.parse::<f32>().unwrap()).sum();
        assert!((sum - 1.0).abs() < 1e-4, "{r:?}");
    }
    // A context of 30 rows read 8 at a time: the same shape, other probabilities.
    let sub = dir.join("pred-sub.csv");
    let (ok, text) = megatron(&[
        "tabular",
        "predict",
        "--load",
        s(&ck),
        "--train",
        s(&train),
        "--test",
        s(&test),
        "--target",
        "label",
        "--categorical",
        "colour",
        "--ensemble",
        "3",
        "--max-context-rows",
        "8",
        "--out",
        s(&sub),
    ]);
    assert!(ok, "{text}");
    let sub_rows = read(&sub);
    assert_eq!(sub_rows.len(), 11);
    assert_ne!(sub_rows, rows, "an 8-row context reads differently");

    // Regression: one `prediction` column of finite values. The test rows lack `label`, so it
    // cannot be a feature here: predict y from a table without it.
    let out = dir.join("reg.csv");
    let train_no_label = dir.join("train_nl.csv");
    let text: String = std::fs::read_to_string(&train)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            format!("{},{},{},{}\n", f[0], f[1], f[2], f[4])
        })
        .collect();
    std::fs::write(&train_no_label, text).unwrap();
    let (ok, text) = megatron(&[
        "tabular",
        "predict",
        "--load",
        s(&ck),
        "--train",
        s(&train_no_label),
        "--test",
        s(&test),
        "--target",
        "y",
        "--categorical",
        "colour",
        "--out",
        s(&out),
    ]);
    assert!(ok, "{text}");
    let rows = read(&out);
    assert_eq!(rows[0], vec!["prediction"]);
    assert_eq!(rows.len(), 11);
    assert!(rows[1..]
        .iter()
        .all(|r| r[0].parse::<f32>().unwrap().is_finite()));

    // Impute, by either method: every hole filled, every observed cell as it was.
    let mut filled = Vec::new();
    for method in ["conditional", "reconstruction"] {
        let out = dir.join(format!("filled-{method}.csv"));
        let (ok, text) = megatron(&[
            "tabular",
            "impute",
            "--load",
            s(&ck),
            "--table",
            s(&holes),
            "--target",
            "label",
            "--categorical",
            "colour",
            "--impute-method",
            method,
            "--out",
            s(&out),
        ]);
        assert!(ok, "{text}");
        let (before, after) = (read(&holes), read(&out));
        assert_eq!(before.len(), after.len());
        for (b, a) in before.iter().zip(&after) {
            for (x, y) in b.iter().zip(a) {
                if x.is_empty() {
                    assert!(!y.is_empty(), "{method}: a hole was left: {a:?}");
                } else {
                    assert_eq!(x, y);
                }
            }
        }
        for r in &after[1..] {
            assert!(r[3] == "yes" || r[3] == "no", "imputed label {:?}", r[3]);
        }
        filled.push(after);
    }
    // The numeric holes are filled by different heads.
    assert_ne!(filled[0], filled[1], "the two methods fill alike");

    // Scores: one per numeric cell, none for the categorical column.
    let out = dir.join("scores.csv");
    let (ok, text) = megatron(&[
        "tabular",
        "score-anomalies",
        "--load",
        s(&ck),
        "--table",
        s(&train),
        "--categorical",
        "colour,label",
        "--out",
        s(&out),
    ]);
    assert!(ok, "{text}");
    let rows = read(&out);
    assert_eq!(rows.len(), 31);
    for r in &rows[1..] {
        assert!(r[2].is_empty(), "{r:?}");
        for c in [0, 1, 4] {
            assert!(r[c].parse::<f32>().unwrap().is_finite(), "{r:?}");
        }
    }
}

#[test]
fn bad_tables_and_checkpoints_are_refused_by_name() {
    let dir = tmpdir("tabular-bad");
    let ck = checkpoint(&dir);
    let cases: [(&str, &str, &[&str]); 5] = [
        (
            "ragged.csv",
            "a,b,t\n1,2,0\n3,4\n5,6,1\n",
            &["ragged.csv:3", "ragged row"],
        ),
        (
            "text.csv",
            "a,b,t\n1,2,0\n1,oops,1\n5,6,1\n",
            &["text.csv:3", "\"b\"", "\"oops\"", "--categorical"],
        ),
        ("empty.csv", "a,b,t\n", &["empty.csv", "empty table"]),
        (
            "classes.csv",
            "a,t\n1,a\n2,b\n3,c\n4,d\n5,e\n6,f\n7,g\n8,h\n9,i\n10,j\n11,k\n",
            &["classes.csv", "11 classes", "at most 10"],
        ),
        (
            "wide.csv",
            "a,b,c,d,e,f,g,h,i,t\n1,2,3,4,5,6,7,8,9,0\n1,2,3,4,5,6,7,8,9,1\n",
            &["wide.csv", "9 feature columns", "at most 8"],
        ),
    ];
    for (name, body, want) in cases {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        let out = dir.join("out.csv");
        let mut args = vec![
            "tabular",
            "impute",
            "--load",
            s(&ck),
            "--table",
            s(&p),
            "--out",
            s(&out),
        ];
        if name == "classes.csv" {
            args.extend(["--categorical", "t"]);
        }
        let (ok, text) = megatron(&args);
        assert!(!ok, "{name} was accepted");
        assert!(!text.contains("panicked"), "{name}: {text}");
        for w in want {
            assert!(text.contains(w), "{name}: want {w:?} in {text}");
        }
        assert!(!out.exists(), "{name}: an output was written");
    }
    // A directory that is not a tabular checkpoint.
    let (ok, text) = megatron(&[
        "tabular",
        "impute",
        "--load",
        s(&dir),
        "--table",
        s(&dir.join("ragged.csv")),
        "--out",
        s(&dir.join("o.csv")),
    ]);
    assert!(!ok && text.contains("manifest"), "{text}");
}

/// `megatron tabular predict` of `target` with `extra` flags into `out`.
fn predict(
    ck: &Path,
    train: &Path,
    test: &Path,
    target: &str,
    extra: &[&str],
    out: &Path,
) -> (bool, String) {
    let mut args = vec![
        "tabular",
        "predict",
        "--load",
        s(ck),
        "--train",
        s(train),
        "--test",
        s(test),
        "--target",
        target,
        "--out",
        s(out),
    ];
    args.extend_from_slice(extra);
    megatron(&args)
}

/// A query far beyond the context's range: on the linear base the prediction follows the
/// linear trend out there; the in-context model alone stays within the context's targets.
#[test]
fn the_linear_regression_base_extrapolates_where_the_model_alone_cannot() {
    let dir = tmpdir("linear-base");
    let ck = checkpoint(&dir);
    let (train, test) = (dir.join("lin_train.csv"), dir.join("lin_test.csv"));
    let mut text = String::from("a,b,y\n");
    for r in 0..60 {
        let (a, b) = ((r as f32 * 0.37).sin(), (r as f32 * 0.91).cos());
        text += &format!("{a},{b},{}\n", 2.0 * a - b + 1.0);
    }
    std::fs::write(&train, text).unwrap();
    // a = 10, b = 0.5: y = 20.5, where the context's targets stay within [-2, 4].
    std::fs::write(&test, "a,b\n10,0.5\n").unwrap();
    let mut got = Vec::new();
    for base in ["linear", "none"] {
        let out = dir.join(format!("lin_{base}.csv"));
        let (ok, text) = predict(&ck, &train, &test, "y", &["--regression-base", base], &out);
        assert!(ok, "{text}");
        got.push(read(&out)[1][0].parse::<f32>().unwrap());
    }
    assert!((got[0] - 20.5).abs() < 1.5, "linear base: {}", got[0]);
    assert!(got[1] < 5.0, "the model alone: {}", got[1]);
}

/// A second round of conditional imputation reads the first round's fills: with holes in one
/// column only there is nothing to read differently, with holes in two columns of the same rows
/// there is.
#[test]
fn a_second_imputation_round_changes_only_what_other_holes_feed() {
    let dir = tmpdir("impute-rounds");
    let ck = checkpoint(&dir);
    let fill = |name: &str, holes: &[usize], rounds: &str| -> Vec<Vec<String>> {
        let table = dir.join(format!("{name}.csv"));
        let mut text = String::from("a,b,c,y\n");
        for r in 0..40usize {
            let (a, b) = ((r as f32 * 0.37).sin(), (r as f32 * 0.91).cos());
            let cells = [a, b, a - b].map(|v| v.to_string());
            let cells: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(c, v)| {
                    if r % 5 == 0 && holes.contains(&c) {
                        String::new()
                    } else {
                        v.clone()
                    }
                })
                .collect();
            text += &format!("{},{}\n", cells.join(","), r % 2);
        }
        std::fs::write(&table, text).unwrap();
        let out = dir.join(format!("{name}_{rounds}.csv"));
        let (ok, text) = megatron(&[
            "tabular",
            "impute",
            "--load",
            s(&ck),
            "--table",
            s(&table),
            "--impute-rounds",
            rounds,
            "--out",
            s(&out),
        ]);
        assert!(ok, "{text}");
        read(&out)
    };
    assert_eq!(fill("one", &[0], "1"), fill("one", &[0], "2"));
    assert_ne!(fill("two", &[0, 2], "1"), fill("two", &[0, 2], "2"));
}
