//! `megatron plot`: two runs' metrics files become one PNG with both runs' colours in it, and
//! a file that is not a metrics file is refused naming the file and line.

mod common;

use megatron_training::plot::{plot, read_run};

fn train(name: &str, lr: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("megatron-plot-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let m = dir.join("metrics.jsonl");
    let ms = m.display().to_string();
    let a = common::args(&[
        "--train-iters",
        "12",
        "--log-interval",
        "2",
        "--eval-interval",
        "4",
        "--lr",
        lr,
        "--metrics-file",
        &ms,
    ]);
    megatron_training::pretrain(&a).unwrap();
    m
}

/// Pixels within a small distance of `rgb`.
fn count_colour(px: &[u8], rgb: [u8; 3]) -> usize {
    px.chunks_exact(3)
        .filter(|p| (0..3).all(|k| (p[k] as i32 - rgb[k] as i32).abs() <= 8))
        .count()
}

#[test]
fn two_runs_become_one_png_with_both_colours() {
    let (a, b) = (train("a", "3e-3"), train("b", "1e-3"));
    let run = read_run(&a).unwrap();
    assert_eq!(run.loss.len(), 6);
    // Iterations 4, 8 and 12, then the end of training.
    assert_eq!(run.val_loss.len(), 4);
    // Tokens: 4 samples of 16 tokens per iteration.
    assert!(
        (run.loss[0].0 - 2.0 * 64.0).abs() < 1.0,
        "{:?}",
        run.loss[0]
    );
    let out = std::env::temp_dir().join(format!("megatron-plot-{}.png", std::process::id()));
    plot(&[a.clone(), b.clone()], &out).unwrap();
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&out).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0u8; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1400, 1000 + 64));
    let px = &buf[..info.buffer_size()];
    // The first two series colours (blue, red) are drawn, and plenty of dark text.
    assert!(count_colour(px, [31, 119, 180]) > 500);
    assert!(count_colour(px, [214, 39, 40]) > 500);
    let dark = px
        .chunks_exact(3)
        .filter(|p| p.iter().all(|&v| v < 100))
        .count();
    assert!(dark > 2000, "{dark} dark pixels");
    for p in [&a, &b] {
        std::fs::remove_dir_all(p.parent().unwrap()).ok();
    }
    std::fs::remove_file(&out).ok();
}

#[test]
fn a_file_that_is_not_a_metrics_file_is_refused() {
    let p = std::env::temp_dir().join(format!("megatron-plot-bad-{}.jsonl", std::process::id()));
    std::fs::write(&p, "{\"iteration\": 1, \"lm_loss\": 2.0}\nnot json\n").unwrap();
    let e = plot(std::slice::from_ref(&p), std::path::Path::new("/tmp/x.png"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 2") && e.contains(&p.display().to_string()),
        "{e}"
    );
    std::fs::remove_file(&p).ok();
}
