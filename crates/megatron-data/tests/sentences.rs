//! The `--split-sentences` splitter: sentence ends, abbreviations, initials, decimals,
//! quotes and blank lines.

use megatron_data::sentences::split_sentences;

#[test]
fn sentences_end_at_marks_followed_by_a_capital() {
    assert_eq!(
        split_sentences("It rained. Then it stopped! Was it over? \"Yes,\" she said."),
        vec![
            "It rained.",
            "Then it stopped!",
            "Was it over?",
            "\"Yes,\" she said."
        ]
    );
}

#[test]
fn abbreviations_initials_and_numbers_do_not_end_sentences() {
    assert_eq!(
        split_sentences("Dr. Jones met John F. Kennedy in the U.S. capital. Pi is 3.14 today."),
        vec![
            "Dr. Jones met John F. Kennedy in the U.S. capital.",
            "Pi is 3.14 today."
        ]
    );
    // A lower-case word after a period continues the sentence ("e.g. this").
    assert_eq!(
        split_sentences("Use tools, e.g. this one. Done."),
        vec!["Use tools, e.g. this one.", "Done."]
    );
}

#[test]
fn closing_quotes_stay_and_blank_lines_split() {
    assert_eq!(
        split_sentences("He said \"stop.\" We did\n\nA new paragraph"),
        vec!["He said \"stop.\"", "We did", "A new paragraph"]
    );
    assert!(split_sentences("   \n ").is_empty());
}
