use megatron_core::optimizer::GradScaler;

#[test]
fn overflow_halves_the_scale_after_the_hysteresis_count_and_clean_windows_grow_it() {
    let mut s = GradScaler::dynamic(1024.0, 1.0, 3, 2);
    s.update(true); // first overflow: hysteresis 2 -> 1, scale kept
    assert_eq!(s.scale(), 1024.0);
    s.update(false);
    s.update(true); // second overflow (need not be consecutive): backs off
    assert_eq!(s.scale(), 512.0);
    s.update(true); // the tracker is not reset by a backoff: every further overflow halves
    assert_eq!(s.scale(), 256.0);
    // Three clean steps (the window) double the scale and reset the hysteresis.
    s.update(false);
    s.update(false);
    assert_eq!(s.scale(), 256.0);
    s.update(false);
    assert_eq!(s.scale(), 512.0);
    s.update(true);
    assert_eq!(s.scale(), 512.0, "hysteresis restored to 2 by the growth");
}

#[test]
fn the_scale_never_drops_below_the_minimum_and_a_constant_scaler_never_moves() {
    let mut s = GradScaler::dynamic(4.0, 2.0, 1000, 1);
    for _ in 0..5 {
        s.update(true);
    }
    assert_eq!(s.scale(), 2.0);
    let mut c = GradScaler::Constant { scale: 8.0 };
    c.update(true);
    c.update(false);
    assert_eq!(c.scale(), 8.0);
}
