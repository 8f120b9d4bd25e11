//! Sentence splitting for `megatron preprocess --split-sentences` (Megatron uses NLTK's Punkt
//! model, which is trained statistics, not a crate): a sentence ends at `.`, `!` or `?`
//! (with any closing quotes or brackets after it) followed by white space and a capital, a
//! digit or an opening quote or bracket, unless the word before the period is a common
//! abbreviation (`Mr.`, `Dr.`, `e.g.`, `U.S.`) or a single letter (an initial); a blank line
//! ends one too. Punkt also learns abbreviations from the text it splits, so on unusual
//! abbreviations the two can disagree; BERT's samples are whole sentences either way.

/// Abbreviations after which a period does not end a sentence (lower case, without the final
/// period).
const ABBREVIATIONS: [&str; 32] = [
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "etc", "e.g", "i.e", "cf", "no",
    "vol", "fig", "gen", "gov", "sen", "rep", "col", "lt", "sgt", "capt", "jan", "feb", "aug",
    "sept", "oct", "nov", "dec",
];

/// The sentences of `text`, trimmed, empty ones left out.
pub fn split_sentences(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c == b'\n' && blank_line_follows(&bytes[i + 1..]) {
            push(&mut out, &text[start..i]);
            start = i + 1;
        } else if matches!(c, b'.' | b'!' | b'?') {
            // Closing quotes and brackets belong to the sentence.
            let mut end = i + 1;
            while end < bytes.len() && matches!(bytes[end], b'"' | b'\'' | b')' | b']') {
                end += 1;
            }
            if ends_sentence(text, start, i, end) {
                push(&mut out, &text[start..end]);
                start = end;
                i = end;
                continue;
            }
        }
        i += 1;
    }
    push(&mut out, &text[start..]);
    out
}

fn push<'a>(out: &mut Vec<&'a str>, s: &'a str) {
    let s = s.trim();
    if !s.is_empty() {
        out.push(s);
    }
}

/// After a newline: only spaces and then another newline.
fn blank_line_follows(rest: &[u8]) -> bool {
    rest.iter()
        .take_while(|b| **b == b' ' || **b == b'\t' || **b == b'\r' || **b == b'\n')
        .any(|b| *b == b'\n')
}

/// Whether the mark at `mark` (the sentence's text from `start`, closing characters up to
/// `end`) ends a sentence.
fn ends_sentence(text: &str, start: usize, mark: usize, end: usize) -> bool {
    let rest = &text[end..];
    let after_space = rest.trim_start();
    if after_space.len() == rest.len() && !rest.is_empty() {
        return false; // no white space after the mark: "3.14", "U.S.A"
    }
    let Some(next) = after_space.chars().next() else {
        return true; // end of text
    };
    if !(next.is_uppercase() || next.is_ascii_digit() || "\"'([".contains(next)) {
        return false;
    }
    if text.as_bytes()[mark] != b'.' {
        return true;
    }
    let word = text[start..mark]
        .rsplit(|c: char| c.is_whitespace() || c == '(' || c == '"')
        .next()
        .unwrap_or("");
    let lower = word.to_lowercase();
    let initial = word.chars().count() == 1 && word.chars().all(char::is_alphabetic);
    let dotted = word.contains('.') && word.split('.').all(|p| p.chars().count() <= 1);
    !(initial || dotted || ABBREVIATIONS.contains(&lower.as_str()))
}
