//! Sliding-window attention in Hugging Face configs, both ways. transformers' window `W`
//! (`sliding_window`) lets query `i` see keys `j > i - W`, that is itself and `W - 1` earlier
//! keys: megatron-core's `window_size = (W - 1, 0)`. Mistral and Mixtral window every layer;
//! Qwen2 and Qwen3 window the layers `layer_types` marks `sliding_attention` (by default those from
//! `max_window_layers` on, under `use_sliding_window`); gpt-oss those `layer_types` marks.

use megatron_core::transformer::config::{LayerPattern, SlidingWindow};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

/// The window a config.json asks for, if any.
pub(crate) fn window_from_hf(hf: &Value, layers: usize) -> Result<Option<SlidingWindow>, String> {
    if hf["use_sliding_window"].as_bool() == Some(false) {
        return Ok(None);
    }
    let Some(w) = hf["sliding_window"].as_u64() else {
        return Ok(None);
    };
    if w == 0 {
        return Err("sliding_window 0 lets a token see nothing".into());
    }
    let windowed: Vec<bool> = match hf["layer_types"].as_array() {
        Some(types) => {
            if types.len() != layers {
                return Err(format!(
                    "layer_types has {} entries for {layers} layers",
                    types.len()
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(format!("layer_types entry {other:?} is not built")),
                })
                .collect::<Result<_, _>>()?
        }
        None => match hf["max_window_layers"].as_u64() {
            // Qwen2's rule before `layer_types`: layers from max_window_layers on.
            Some(from)
                if matches!(
                    hf["model_type"].as_str(),
                    Some("qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe")
                ) =>
            {
                (0..layers).map(|l| l as u64 >= from).collect()
            }
            _ => vec![true; layers],
        },
    };
    if !windowed.contains(&true) {
        return Ok(None);
    }
    let skip = (!windowed.iter().all(|&x| x)).then_some(LayerPattern::List(windowed));
    Ok(Some(SlidingWindow {
        left: (w - 1) as usize,
        skip,
    }))
}

/// Writes `cfg`'s window into `config` (`model_type` already set), or refuses a layout the
/// family's config cannot express. A Llama without QKV biases and a window on every layer
/// becomes a Mistral (the same tensors).
pub(crate) fn window_to_hf(cfg: &TransformerConfig, config: &mut Value) -> Result<(), String> {
    let Some(w) = &cfg.window else {
        if config["model_type"] == "gpt_oss" {
            // GptOssConfig's defaults window every other layer: say there is none.
            config["sliding_window"] = Value::Null;
            config["layer_types"] = json!(vec!["full_attention"; cfg.num_layers]);
        }
        return Ok(());
    };
    let windowed: Vec<bool> = (0..cfg.num_layers)
        .map(|l| cfg.attention_window(l).is_some())
        .collect();
    let every = windowed.iter().all(|&x| x);
    let hf_window = w.left + 1;
    let types: Vec<&str> = windowed
        .iter()
        .map(|&x| {
            if x {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    match config["model_type"].as_str() {
        Some("llama") if every => {
            config["architectures"] = json!(["MistralForCausalLM"]);
            config["model_type"] = json!("mistral");
            config["sliding_window"] = json!(hf_window);
        }
        Some("mixtral") if every => config["sliding_window"] = json!(hf_window),
        Some("gpt_oss") => {
            config["sliding_window"] = json!(hf_window);
            config["layer_types"] = json!(types);
        }
        Some("qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe") => {
            config["use_sliding_window"] = json!(true);
            config["sliding_window"] = json!(hf_window);
            config["max_window_layers"] = json!(windowed.iter().position(|&x| x).unwrap_or(0));
            config["layer_types"] = json!(types);
        }
        other => {
            return Err(format!(
                "--window-attn-skip-freq: a sliding window on some layers only has no {} config (Mistral and Mixtral window every layer; Qwen2's layer_types needs its QKV biases)",
                other.unwrap_or("Hugging Face")
            ))
        }
    }
    Ok(())
}
