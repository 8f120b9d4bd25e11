//! `tables::csv`: real tables read with their missing cells, and bad files refused with the
//! file, line and column.

use megatron_data::tables::CsvTable;
use std::path::PathBuf;

fn file(name: &str, body: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megatron-rs-csv-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

#[test]
fn quoted_fields_blank_lines_and_missing_markers_are_read() {
    let p = file(
        "ok.csv",
        "a,\"b, quoted\",c\n1.5,x,\n\n2,\"y, z\",NA\n?,x,3\n",
    );
    let t = CsvTable::read(&p).unwrap();
    assert_eq!(t.header, vec!["a", "b, quoted", "c"]);
    assert_eq!(t.records.len(), 3);
    assert_eq!(t.lines, vec![2, 4, 5]);
    let a = t.numeric(0).unwrap();
    assert_eq!(a[..2], [1.5, 2.0]);
    assert!(a[2].is_nan());
    let c = t.numeric(2).unwrap();
    assert!(c[0].is_nan() && c[1].is_nan());
    assert_eq!(c[2], 3.0);
    assert_eq!(t.levels(1), vec!["x", "y, z"]);
    assert_eq!(t.codes(1, &t.levels(1)), vec![0.0, 1.0, 0.0]);
}

#[test]
fn numeric_levels_sort_as_numbers() {
    let p = file("levels.csv", "k\n10\n9\n2\n10\n");
    let t = CsvTable::read(&p).unwrap();
    assert_eq!(t.levels(0), vec!["2", "9", "10"]);
}

#[test]
fn bad_files_are_refused_with_their_place() {
    for (name, body, want) in [
        (
            "ragged.csv",
            "a,b\n1,2\n1,2,3\n",
            "ragged.csv:3: ragged row: 3 fields",
        ),
        ("empty.csv", "a,b\n", "empty.csv: empty table"),
        ("nothing.csv", "", "nothing.csv: empty table"),
        (
            "twice.csv",
            "a,a\n1,2\n",
            "twice.csv:1: column name \"a\" appears twice",
        ),
    ] {
        let err = CsvTable::read(&file(name, body)).unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
    }
    let t = CsvTable::read(&file("text.csv", "a,b\n1,2\n3,four\n")).unwrap();
    let err = t.numeric(1).unwrap_err().to_string();
    assert!(
        err.contains("text.csv:3: column \"b\": \"four\" is not a number"),
        "{err}"
    );
    assert!(t
        .column("c")
        .unwrap_err()
        .to_string()
        .contains("columns: a, b"));
}
