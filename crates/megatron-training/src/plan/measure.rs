//! `megatron plan --measure K`: the K best layouts run here for a few iterations on rank
//! threads (mock data), and their measured step time and peak memory printed beside the
//! prediction, so the cost model is checked on the machine it plans for.

use super::Plan;
use crate::TrainError;

/// Measured step time (median after the first iteration) and rank 0's allocator peak, raised
/// to the worst rank's measured/predicted ratio (or, where the binary does not count
/// allocations per rank, the process's peak).
#[derive(Clone, Debug)]
pub struct Measured {
    pub step_seconds: f64,
    pub peak_bytes: f64,
}

/// Runs `args` (a layout's flags) for `iters` iterations and reads its metrics file.
pub fn run_layout(args: &crate::TrainArgs, iters: u64) -> Result<Measured, TrainError> {
    let dir = std::env::temp_dir().join(format!(
        "megatron-plan-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).map_err(|e| TrainError::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    let metrics = dir.join("metrics.jsonl");
    let mut a = args.clone();
    a.train_iters = Some(iters.max(2));
    a.train_samples = None;
    a.lr_warmup_iters = Some(0);
    a.lr_decay_iters = None;
    a.eval_iters = 0;
    a.eval_interval = iters.max(2) + 1;
    a.log_interval = 1;
    a.log_memory = true;
    a.save = None;
    a.load = None;
    a.no_progress_bar = true;
    a.metrics_file = Some(metrics.display().to_string());
    let result = crate::pretrain(&a);
    let text = std::fs::read_to_string(&metrics).unwrap_or_default();
    std::fs::remove_dir_all(&dir).ok();
    result?;
    let (mut steps, mut peak) = (Vec::new(), 0.0f64);
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        let Some(ms) = v.get("ms_per_iter").and_then(|x| x.as_f64()) else {
            continue;
        };
        if v.get("iteration").and_then(|x| x.as_u64()) > Some(1) {
            steps.push(ms / 1e3);
        }
        let m = &v["memory"];
        let ranks = m["peak_over_predicted"]
            .as_array()
            .and_then(|r| r.get(1))
            .and_then(|x| x.as_f64());
        let allocated = m["allocated_peak"].as_f64();
        let predicted = m["predicted_peak"].as_f64();
        let bytes = match (allocated, ranks, predicted) {
            // Rank 0's peak (the first stage, which the plan predicts), raised when another
            // rank overshoots its own prediction by more: the worst rank's measured/predicted
            // ratio applied to rank 0's prediction.
            (Some(a), Some(hi), Some(p)) if p > 0.0 => a.max(hi * p),
            (Some(a), _, _) => a,
            _ => m["process_peak"].as_f64().unwrap_or(0.0),
        };
        peak = peak.max(bytes);
    }
    if steps.is_empty() {
        return Err(TrainError::Args(
            "--measure: the run logged no timed iteration".into(),
        ));
    }
    steps.sort_by(f64::total_cmp);
    Ok(Measured {
        step_seconds: steps[steps.len() / 2],
        peak_bytes: peak,
    })
}

/// The measured-versus-predicted table for the plan's `k` best parallel layouts.
pub fn measure(plan: &Plan, k: usize, iters: u64) -> Result<String, TrainError> {
    let mut out = format!(
        "measured here ({iters} iterations each, median step after the first; peak: rank 0's allocator high-water mark, or the worst rank's measured/predicted ratio times rank 0's prediction if that is more):\n TP  PP  VP  CP  EP    DP  MBS recompute dist. | step predicted  measured  ratio | peak MiB predicted  measured  ratio\n"
    );
    // The best layout of each distinct parallel shape (layouts that differ only in micro-batch
    // size, recomputation or optimizer sharding would measure the same thing again).
    // When there are fewer shapes than `k`, the next best layouts fill the list.
    let mut seen = Vec::new();
    let (mut picked, mut rest) = (Vec::new(), Vec::new());
    for p in &plan.fits {
        let l = &p.layout;
        let key = (l.tp, l.pp, l.virtual_stages(), l.cp, l.ep);
        if seen.contains(&key) {
            rest.push(p);
        } else {
            seen.push(key);
            picked.push(p);
        }
    }
    picked.truncate(k);
    let fill = k.saturating_sub(picked.len());
    picked.extend(rest.into_iter().take(fill));
    for p in picked {
        let m = run_layout(&p.layout.config.args, iters)?;
        let (ps, pm) = (p.prediction.time.total(), p.prediction.memory.total());
        out += &format!(
            "{} | {:>14.3} {:>9.3} {:>6.2} | {:>18.1} {:>9.1} {:>6.3}\n",
            p.layout.columns(),
            ps,
            m.step_seconds,
            m.step_seconds / ps,
            pm / (1 << 20) as f64,
            m.peak_bytes / (1 << 20) as f64,
            m.peak_bytes / pm,
        );
    }
    Ok(out)
}
