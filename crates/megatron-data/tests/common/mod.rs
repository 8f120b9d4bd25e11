//! Helpers shared by megatron-data's tokenizer tests.

use megatron_data::Tokenizer;

/// A JSON array of token ids.
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

/// Each reference case (`text`, `ids`, `decoded`) against `t`: the ids of encoding the text, and
/// the text of decoding them. A case whose text is null checks decoding of its ids alone.
/// Asserts that all agree, naming every case that does not; returns how many there were.
pub fn check_cases(t: &dyn Tokenizer, cases: &serde_json::Value, what: &str) -> usize {
    let cases = cases.as_array().unwrap();
    let mut wrong = Vec::new();
    for c in cases {
        let want = json_ids(&c["ids"]);
        let got = match c["text"].as_str() {
            Some(text) => t.encode(text).unwrap(),
            None => want.clone(),
        };
        let decoded = t.decode(&got);
        if got != want || decoded != c["decoded"].as_str().unwrap() {
            wrong.push(format!(
                "{}: ids {got:?} vs {want:?}, decoded {decoded:?} vs {}",
                c["text"], c["decoded"]
            ));
        }
    }
    assert!(wrong.is_empty(), "{what}:\n{}", wrong.join("\n"));
    cases.len()
}
