use megatron_data::blended_dataset::{build_blending_indices, parse_blend, per_dataset_samples};

#[test]
fn blending_follows_the_weights_and_reads_each_dataset_in_order() {
    let (di, si) = build_blending_indices(&[0.3, 0.7], 1000);
    let n0 = di.iter().filter(|&&d| d == 0).count();
    assert_eq!(n0, 300);
    // Every prefix stays within one sample of its share.
    for i in 1..=1000 {
        let c0 = di[..i].iter().filter(|&&d| d == 0).count() as f64;
        assert!((c0 - 0.3 * i as f64).abs() <= 1.0, "prefix {i}: {c0}");
    }
    for d in 0..2 {
        let own: Vec<i64> = si
            .iter()
            .zip(&di)
            .filter(|(_, &x)| x == d)
            .map(|(&s, _)| s)
            .collect();
        assert_eq!(
            own,
            (0..own.len() as i64).collect::<Vec<_>>(),
            "dataset {d} read in its own order"
        );
    }
    assert_eq!(
        per_dataset_samples(&[0.3, 0.7], 1000, 0.005),
        vec![302, 704]
    );
}

#[test]
fn blend_flags_parse_and_bad_weights_are_refused() {
    let w = parse_blend(&["0.3".into(), "A".into(), "0.7".into(), "B".into()]).unwrap();
    assert_eq!(w, vec![(0.3, "A".to_string()), (0.7, "B".to_string())]);
    let e = parse_blend(&["A".into(), "B".into()]).unwrap();
    assert_eq!(e, vec![(0.5, "A".to_string()), (0.5, "B".to_string())]);
    let z = parse_blend(&["0".into(), "A".into(), "0".into(), "B".into()])
        .unwrap_err()
        .to_string();
    assert!(z.contains("--data-path") && z.contains("positive"), "{z}");
}
