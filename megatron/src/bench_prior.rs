//! `megatron bench prior`: how fast the synthetic-table prior makes tables (tables/s and cells/s)
//! with 1 and with each of --ranks worker threads through `PriorLoader` (the loader that feeds
//! training), `--num-samples` tables per run, median of `--repeats`.

use crate::bench::BenchArgs;
use megatron_data::tables::{PriorConfig, PriorLoader};
use std::time::Instant;

pub fn prior(a: &BenchArgs) -> anyhow::Result<()> {
    let cfg = PriorConfig::default();
    let n = a.num_samples.min(100_000) as usize;
    println!(
        "synthetic-table prior (defaults: context rows {}-{}, up to {} queries, {}-{} features), {n} tables per run, median of {}",
        cfg.min_context_rows,
        cfg.max_context_rows,
        cfg.max_query_rows,
        cfg.min_features,
        cfg.max_features,
        a.repeats
    );
    println!("| workers | tables/s | cells/s | mean cells per table |");
    println!("|---:|---:|---:|---:|");
    let mut workers = vec![1usize];
    workers.extend(a.ranks.iter().copied().filter(|&w| w > 1));
    for &w in &workers {
        let mut runs = Vec::new();
        let mut cells = 0usize;
        for r in 0..a.repeats.max(1) {
            // A fresh range of tables each repeat (no cache effects from the last).
            let mut loader = PriorLoader::new(cfg.clone(), 1234, (r * n) as u64, w, 4);
            let t0 = Instant::now();
            cells = 0;
            for _ in 0..n {
                let t = loader.next_table();
                cells += t.rows * t.cols;
            }
            runs.push(t0.elapsed().as_secs_f64());
        }
        runs.sort_by(f64::total_cmp);
        let s = runs[runs.len() / 2];
        println!(
            "| {w} | {:.0} | {:.3e} | {:.0} |",
            n as f64 / s,
            cells as f64 / s,
            cells as f64 / n as f64
        );
    }
    Ok(())
}
