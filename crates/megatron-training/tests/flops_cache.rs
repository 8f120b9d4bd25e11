//! The cached FMA peak: a figure measured while another job held the cores (too low) is
//! noticed and measured again, so the MFU of later runs is not inflated by it. Alone in its
//! test binary because it points `XDG_CACHE_HOME` at a temporary directory.

use megatron_training::flops::{peak_flops, PeakUnit};

#[test]
fn a_cached_peak_measured_under_load_is_measured_again() {
    let dir = std::env::temp_dir().join(format!("megatron-peak-cache-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let cache = dir.join("megatron-rs");
    std::fs::create_dir_all(&cache).unwrap();
    let file = cache.join("peak_fp32_flops_1t.txt");
    // 1 MFLOP/s: far below any CPU's FMA rate.
    std::fs::write(&file, "1000000\n").unwrap();
    std::env::set_var("XDG_CACHE_HOME", &dir);
    let peak = peak_flops(None, 1, PeakUnit::Fma);
    assert!(peak > 1e9, "{peak}");
    let stored: f64 = std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(stored, peak);
    // A sound cached figure is used as it is.
    std::fs::write(&file, format!("{}\n", peak * 1.5)).unwrap();
    assert_eq!(peak_flops(None, 1, PeakUnit::Fma), peak * 1.5);
    std::fs::remove_dir_all(&dir).ok();
}
