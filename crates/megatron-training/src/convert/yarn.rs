//! YaRN in Hugging Face configs (`rope_type: "yarn"`), both ways: transformers'
//! `_compute_yarn_parameters` reads `factor` (or max / original positions), `beta_fast` (32),
//! `beta_slow` (1), `mscale` and `mscale_all_dim` (used only when both are non-zero),
//! `truncate` (the correction range rounded outward, by default) and an explicit
//! `attention_factor`, which must then be the one these give.

use megatron_core::transformer::config::YarnConfig;
use serde_json::{json, Value};

/// The YaRN settings of a config's rope parameters `r`; `positions` is the model's
/// `max_position_embeddings`.
pub(crate) fn yarn_from_hf(r: &Value, positions: usize) -> Result<YarnConfig, String> {
    let original = r["original_max_position_embeddings"]
        .as_u64()
        .map_or(positions, |v| v as usize);
    let factor = r["factor"]
        .as_f64()
        .unwrap_or(positions as f64 / original as f64);
    let (mscale, mscale_all_dim) = match (r["mscale"].as_f64(), r["mscale_all_dim"].as_f64()) {
        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => (m, a),
        // transformers ignores either alone: the plain concentration 0.1 ln(factor) + 1.
        _ => (1.0, 0.0),
    };
    let y = YarnConfig {
        factor,
        original_max_position_embeddings: original,
        beta_fast: r["beta_fast"].as_f64().unwrap_or(32.0),
        beta_slow: r["beta_slow"].as_f64().unwrap_or(1.0),
        mscale,
        mscale_all_dim,
        correction_range_round_to_int: r["truncate"].as_bool().unwrap_or(true),
    };
    if let Some(a) = r["attention_factor"].as_f64() {
        let get = |m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * factor.ln() + 1.0
            }
        };
        let implied = if mscale_all_dim == 0.0 {
            get(1.0)
        } else {
            get(mscale) / get(mscale_all_dim)
        };
        if (a - implied).abs() > 1e-6 * implied {
            return Err(format!(
                "yarn attention_factor {a} differs from the {implied} its factor and mscale give: not built"
            ));
        }
    }
    Ok(y)
}

/// `rope_parameters` for `y`.
pub(crate) fn yarn_to_hf(y: &YarnConfig, base: f64) -> Value {
    json!({
        "rope_theta": base,
        "rope_type": "yarn",
        "factor": y.factor,
        "original_max_position_embeddings": y.original_max_position_embeddings,
        "beta_fast": y.beta_fast,
        "beta_slow": y.beta_slow,
        "mscale": y.mscale,
        "mscale_all_dim": y.mscale_all_dim,
        "truncate": y.correction_range_round_to_int,
    })
}
