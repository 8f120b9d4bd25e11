//! `megatron convert`: Hugging Face checkpoints in and out (Megatron Bridge's role). A model
//! family is one file here (`gpt2.rs`, `llama.rs`) that maps config.json to a
//! `TransformerConfig` and tensor names and fused layouts both ways; this file reads and writes
//! the containers (safetensors, sharded or not; megatron-rs checkpoints) and never looks inside
//! a family.

mod bert;
mod deepseek_v3;
pub mod gguf;
pub mod gguf_export;
mod gguf_gpt_oss;
pub mod gguf_writer;
mod gpt2;
mod gpt_oss;
mod k_quants;
mod llama;
mod megatron_legacy;
mod megatron_legacy_export;
mod megatron_legacy_state;
mod megatron_lm;
mod megatron_lm_buckets;
mod megatron_lm_state;
mod mixtral;
pub mod pickle;
pub mod pickle_writer;
pub mod pre_tokenizers;
mod qwen2_moe;
mod rotary_layout;
mod sliding_window;
mod tp_shards;
pub use megatron_data::spm_vocab;
mod t5;
pub mod torch_dist;
pub mod torch_dist_writer;
pub mod torch_save;
mod yarn;

use crate::checkpointing::{
    iteration_dir, load_checkpoint_weights, write_whole_checkpoint, ConvertedExtras, HfBuffer,
    RecordedTokenizer,
};
use crate::TrainError;
use megatron_core::TransformerConfig;
pub use megatron_legacy::torch_to_megatron;
pub use megatron_legacy_export::{megatron_to_torch, LegacyLayout, LegacyState};
pub use megatron_lm::{
    megatron_to_torch_dist, torch_dist_to_megatron, LayerSpec, OptimizerExport, OptimizerForm,
};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Tensors by name: global shape and f32 values.
pub type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// What every family provides.
pub(crate) trait HfFamily {
    /// The megatron-rs model of a Hugging Face config.json (vocabulary padded to
    /// `make_vocab_size_divisible_by`).
    fn megatron_config(
        &self,
        hf: &serde_json::Value,
        divisible_by: usize,
    ) -> Result<TransformerConfig, String>;
    /// Hugging Face tensors to megatron-core names and layouts (embedding rows padded).
    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        hf: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String>;
    /// The reverse, with the config.json that transformers reads back.
    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(serde_json::Value, Tensors), String>;
}

/// The family of an `architectures` entry of config.json.
fn family(arch: &str) -> Option<Box<dyn HfFamily>> {
    match arch {
        "GPT2LMHeadModel" => Some(Box::new(gpt2::Gpt2)),
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM" => {
            Some(Box::new(llama::Llama {
                arch: arch.to_string(),
                mlp: Box::new(llama::DenseMlp),
            }))
        }
        "MixtralForCausalLM" => Some(Box::new(llama::Llama {
            arch: arch.to_string(),
            mlp: Box::new(mixtral::MixtralMoe),
        })),
        "Qwen2MoeForCausalLM" | "Qwen3MoeForCausalLM" => Some(Box::new(llama::Llama {
            arch: arch.to_string(),
            mlp: Box::new(qwen2_moe::Qwen2Moe),
        })),
        gpt_oss::ARCHITECTURE => Some(Box::new(llama::Llama {
            arch: arch.to_string(),
            mlp: Box::new(gpt_oss::GptOssMoe),
        })),
        _ => None,
    }
}

fn err(path: &Path, msg: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

/// Takes a tensor out of `t`, checking its shape; the error names it.
pub(crate) fn take(t: &mut Tensors, name: &str, shape: &[usize]) -> Result<Vec<f32>, String> {
    let (s, v) = t
        .remove(name)
        .ok_or_else(|| format!("missing tensor {name}"))?;
    if s != shape {
        return Err(format!("tensor {name} has shape {s:?}, expected {shape:?}"));
    }
    Ok(v)
}

/// An f32 as the shortest decimal that reads back as it (`1e-12`, not `9.99999996e-13`), as
/// config.json writers print it.
pub(crate) fn decimal(x: f32) -> f64 {
    x.to_string().parse().expect("an f32 prints as a number")
}

/// `rows` of `x` (row-major, `cols` wide) appended with zero rows up to `padded`.
pub(crate) fn pad_rows(mut x: Vec<f32>, cols: usize, padded: usize) -> Vec<f32> {
    x.resize(padded * cols, 0.0);
    x
}

/// Reads `model.safetensors`, or every file a `model.safetensors.index.json` names, as f32
/// (F32, F16 and BF16 tensors), and its integer (I64) buffers apart.
fn read_hf_tensors(dir: &Path) -> Result<(Tensors, Vec<HfBuffer>), TrainError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(crate::io_err(&index))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(&index, e.to_string()))?;
        let map = v["weight_map"]
            .as_object()
            .ok_or_else(|| err(&index, "no weight_map"))?;
        let mut names: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|f| dir.join(f)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut out = Tensors::new();
    let mut buffers = Vec::new();
    for f in files {
        let file = std::fs::File::open(&f).map_err(|e| err(&f, format!("cannot open: {e}")))?;
        // SAFETY: the file is only read, and converters do not run beside writers of it.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(crate::io_err(&f))?;
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| err(&f, format!("not a safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            let b = view.data();
            let v: Vec<f32> = match view.dtype() {
                Dtype::F32 => b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                Dtype::F16 => b
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                Dtype::BF16 => b
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                // Bytes (gpt-oss's MXFP4 blocks and scales): each as its value, exact in f32.
                Dtype::U8 => b.iter().map(|&x| x as f32).collect(),
                Dtype::I64 => {
                    buffers.push(HfBuffer {
                        name,
                        shape: view.shape().to_vec(),
                        values: b
                            .chunks_exact(8)
                            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                            .collect(),
                    });
                    continue;
                }
                other => {
                    return Err(err(
                        &f,
                        format!("tensor {name}: unsupported dtype {other:?}"),
                    ))
                }
            };
            out.insert(name, (view.shape().to_vec(), v));
        }
    }
    buffers.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((out, buffers))
}

/// `megatron convert --from hf --input DIR --output SAVE`: a megatron-rs checkpoint (iteration
/// 0, no optimizer state) whose manifest records the model, so `generate --load` needs no
/// model flags.
pub fn hf_to_megatron(
    input: &Path,
    output: &Path,
    divisible_by: usize,
) -> Result<PathBuf, TrainError> {
    let cfg_path = input.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|e| err(&cfg_path, format!("cannot read: {e}")))?;
    let hf: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(&cfg_path, e.to_string()))?;
    let arch = hf["architectures"][0].as_str().unwrap_or("").to_string();
    let (mut hf_tensors, buffers) = read_hf_tensors(input)?;
    let mut extras = ConvertedExtras::default();
    let fam: Box<dyn HfFamily> = if bert::ARCHITECTURES.contains(&arch.as_str()) {
        let b = bert::Bert::from_file(&arch, &hf, &hf_tensors);
        extras.bert = Some(b.heads);
        Box::new(b)
    } else if arch == deepseek_v3::ARCHITECTURE || arch == deepseek_v3::ARCHITECTURE_V2 {
        let generation = if arch == deepseek_v3::ARCHITECTURE {
            deepseek_v3::Generation::V3
        } else {
            deepseek_v3::Generation::V2
        };
        Box::new(deepseek_v3::DeepseekV3::reading(
            generation,
            &hf,
            &hf_tensors,
        ))
    } else if arch == t5::ARCHITECTURE {
        let t = t5::T5::from_config(&hf).map_err(|m| err(&cfg_path, m))?;
        extras.t5 = Some(t.stacks);
        Box::new(t)
    } else {
        family(&arch).ok_or_else(|| {
            err(&cfg_path, format!("unknown architecture '{arch}' (known: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, {}, {}, {}, {}, {})", gpt_oss::ARCHITECTURE, deepseek_v3::ARCHITECTURE_V2, deepseek_v3::ARCHITECTURE, bert::ARCHITECTURES.join(", "), t5::ARCHITECTURE))
        })?
    };
    for b in buffers {
        // Position ids 0..n are what the model computes anyway; anything else is not a buffer
        // this engine knows how to keep.
        let counting = b.values.iter().enumerate().all(|(i, &v)| v == i as i64);
        if extras.bert.is_none() || !b.name.ends_with("embeddings.position_ids") || !counting {
            return Err(err(
                input,
                format!(
                    "unexpected integer tensor {} (not part of a {arch})",
                    b.name
                ),
            ));
        }
        extras.hf_buffers.push(b);
    }
    let cfg = fam
        .megatron_config(&hf, divisible_by)
        .map_err(|m| err(&cfg_path, m))?;
    cfg.validate().map_err(|e| err(&cfg_path, e.to_string()))?;
    let vocab = hf["vocab_size"]
        .as_u64()
        .ok_or_else(|| err(&cfg_path, "no vocab_size"))? as usize;
    let tensors = fam
        .to_megatron(&cfg, &mut hf_tensors, vocab)
        .map_err(|m| err(input, m))?;
    if let Some(extra) = hf_tensors.keys().next() {
        return Err(err(
            input,
            format!("unexpected tensor {extra} (not part of a {arch})"),
        ));
    }
    write_whole_checkpoint(output, cfg, extras, &tensors, vocab, hf_tokenizer(input)?)?;
    Ok(iteration_dir(output, 0))
}

/// The tokenizer of a Hugging Face model directory, as the converted checkpoint records it (by
/// absolute path, so the checkpoint works from any directory): its tokenizer.json, or, where
/// there is none, a sentencepiece tokenizer.model that Megatron's `Llama2Tokenizer` reads (as
/// transformers' Llama tokenizer, BOS before the text); a tokenizer.model of another kind is
/// not recorded, as before there was a reader for any.
fn hf_tokenizer(input: &Path) -> Result<Option<RecordedTokenizer>, TrainError> {
    let absolute = |p: &Path| -> Result<String, TrainError> {
        Ok(std::fs::canonicalize(p)
            .map_err(crate::io_err(p))?
            .display()
            .to_string())
    };
    let json = input.join("tokenizer.json");
    if json.exists() {
        return Ok(Some(RecordedTokenizer {
            tokenizer_type: "HuggingFaceTokenizer",
            path: absolute(&json)?,
        }));
    }
    let model = input.join("tokenizer.model");
    if !model.exists() {
        return Ok(None);
    }
    let path = absolute(&model)?;
    Ok(megatron_data::sentencepiece_model::load(&path)
        .is_ok()
        .then_some(RecordedTokenizer {
            tokenizer_type: "Llama2Tokenizer",
            path,
        }))
}

/// A megatron-rs checkpoint as the Hugging Face model of its family: the checkpoint's
/// manifest and directory, config.json's values and the tensors.
fn checkpoint_as_hf(
    input: &Path,
) -> Result<
    (
        crate::checkpointing::CheckpointMeta,
        PathBuf,
        serde_json::Value,
        Tensors,
    ),
    TrainError,
> {
    let ck = load_checkpoint_weights(input)?;
    let mut cfg = ck.meta.model.clone();
    let mut m: Tensors = ck
        .tensors
        .into_iter()
        .filter(|(n, _)| !n.starts_with("optimizer."))
        .map(|(n, v)| {
            let shape = ck
                .meta
                .tensors
                .iter()
                .find(|t| t.name == n)
                .map(|t| t.shape.clone())
                .unwrap_or_default();
            (n, (shape, v))
        })
        .collect();
    let fam: Box<dyn HfFamily> = if let Some(heads) = ck.meta.bert {
        Box::new(bert::Bert::for_heads(heads))
    } else if let Some(stacks) = ck.meta.t5 {
        Box::new(t5::T5 { stacks })
    } else if cfg.mla.is_some() {
        Box::new(deepseek_v3::DeepseekV3::exporting(&cfg))
    } else if cfg.position_embedding_type
        == megatron_core::transformer::config::PositionEmbeddingType::LearnedAbsolute
    {
        Box::new(gpt2::Gpt2)
    } else {
        let gpt_oss = gpt_oss::GptOssMoe::fits(&cfg).map_err(|e| err(&ck.dir, e))?;
        let arch = if gpt_oss {
            gpt_oss::ARCHITECTURE
        } else if cfg.add_qkv_bias && !cfg.add_bias_linear {
            "Qwen2ForCausalLM"
        } else {
            "LlamaForCausalLM"
        };
        if cfg.normalization != megatron_core::transformer::config::Normalization::RMSNorm {
            return Err(err(
                &ck.dir,
                "--normalization LayerNorm: Llama, Mistral, Qwen and Mixtral have RMSNorms (a LayerNorm model exports with learned positions, as GPT-2)",
            ));
        }
        if cfg.rotary.percent < 1.0 {
            return Err(err(
                &ck.dir,
                format!(
                    "--rotary-percent {}: Llama, Mistral, Qwen and Mixtral rotate every feature of a head",
                    cfg.rotary.percent
                ),
            ));
        }
        // Llama, Mistral, Qwen and Mixtral rotate the pairs (i, i + d/2): an interleaved
        // model is exported as the rotate-half model with the same scores.
        rotary_layout::interleaved_to_rotate_half(&mut cfg, &mut m).map_err(|e| err(&ck.dir, e))?;
        if cfg.qk_layernorm && cfg.add_bias_linear {
            return Err(err(
                &ck.dir,
                "--qk-layernorm with biases on every linear layer (trained without --disable-bias-linear) has no Hugging Face family (Qwen3, the one with query/key norms, has no MLP biases)",
            ));
        }
        if cfg.qk_layernorm && cfg.add_qkv_bias {
            return Err(err(
                &ck.dir,
                "--qk-layernorm with --add-qkv-bias has no Hugging Face family (Qwen3's attention_bias is on q, k, v and o alike)",
            ));
        }
        if cfg.moe.as_ref().is_some_and(|m| m.router_groups.is_some()) {
            return Err(err(
                &ck.dir,
                "--moe-router-num-groups / --moe-router-group-topk: group-limited routing has no counterpart in Mixtral or Qwen-MoE configs",
            ));
        }
        let mlp: Box<dyn llama::MlpMapping> = match &cfg.moe {
            Some(_) if gpt_oss => Box::new(gpt_oss::GptOssMoe),
            None => Box::new(llama::DenseMlp),
            Some(m) if cfg.qk_layernorm && m.shared_expert_ffn.is_some() => {
                return Err(err(
                    &ck.dir,
                    "--qk-layernorm with a shared expert has no Hugging Face family (Qwen3-MoE has no shared expert, Qwen2-MoE no query/key norms)",
                ));
            }
            Some(_) if cfg.qk_layernorm => Box::new(qwen2_moe::Qwen2Moe),
            Some(m) if m.shared_expert_ffn.is_some() => Box::new(qwen2_moe::Qwen2Moe),
            Some(_) if (0..cfg.num_layers).any(|l| !cfg.is_moe_layer(l)) => {
                return Err(err(
                    &ck.dir,
                    "--moe-layer-freq leaves dense layers, which MixtralForCausalLM cannot hold (experts on every layer), and Qwen2MoeForCausalLM, which can, needs a shared expert (--moe-shared-expert-intermediate-size)",
                ));
            }
            Some(_) => Box::new(mixtral::MixtralMoe),
        };
        Box::new(llama::Llama {
            arch: arch.into(),
            mlp,
        })
    };
    let (config, tensors) = fam
        .to_hf(&cfg, &mut m, ck.meta.vocab_rows())
        .map_err(|e| err(&ck.dir, e))?;
    if let Some(extra) = m.keys().next() {
        // E.g. a router's expert bias: the Hugging Face family has no place for it, and
        // dropping it would route tokens differently.
        return Err(err(
            &ck.dir,
            format!(
                "tensor {extra} has no counterpart in {}",
                config["architectures"][0]
            ),
        ));
    }
    Ok((ck.meta, ck.dir, config, tensors))
}

/// `megatron convert --to hf --input SAVE --output DIR`: config.json + model.safetensors that
/// transformers' `from_pretrained` reads, written under a temporary name and renamed.
pub fn megatron_to_hf(input: &Path, output: &Path) -> Result<PathBuf, TrainError> {
    let (manifest, _, config, tensors) = checkpoint_as_hf(input)?;
    let tmp = output.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(crate::io_err(&tmp))?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, v))| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let buffer_bytes: Vec<(String, Vec<usize>, Vec<u8>)> = manifest
        .hf_buffers
        .iter()
        .map(|b| {
            let bytes = b.values.iter().flat_map(|x| x.to_le_bytes()).collect();
            (b.name.clone(), b.shape.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| (n, s, b, Dtype::F32))
        .chain(buffer_bytes.iter().map(|(n, s, b)| (n, s, b, Dtype::I64)))
        .map(|(n, s, b, dtype)| {
            (
                n.clone(),
                TensorView::new(dtype, s.clone(), b).expect("shape matches"),
            )
        })
        .collect();
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let st = tmp.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(meta), &st).map_err(|e| err(&st, e.to_string()))?;
    let cj = tmp.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(|e| err(&cj, e.to_string()))?;
    crate::checkpointing::write_synced(&cj, text.as_bytes())?;
    if let Err(e) = hf_tokenizer_files(&manifest, &tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if output.exists() {
        std::fs::remove_dir_all(output).map_err(crate::io_err(output))?;
    }
    std::fs::rename(&tmp, output).map_err(crate::io_err(output))?;
    Ok(output.to_path_buf())
}

/// The checkpoint's tokenizer as Hugging Face reads it beside the model: a tokenizer.json (with
/// the tokenizer_config.json beside it, if any) as it is; GPT-2's vocab.json and merges.txt
/// with a tokenizer_config.json naming GPT-2's tokenizer; a
/// sentencepiece tokenizer.model as it is, with a tokenizer.json that tokenizes as
/// sentencepiece does (`spm_vocab.rs`) and a tokenizer_config.json naming BOS/EOS/unknown and
/// whether BOS is added (as Megatron's `Llama2Tokenizer` adds it). The class named is the
/// generic `PreTrainedTokenizerFast`, which runs the tokenizer.json as written: transformers
/// v5's `LlamaTokenizer` replaces its normalizer with a Metaspace that does not prepend `▁` to
/// text that begins with a space, as sentencepiece does (15 of the fixture's 52 texts differ).
fn hf_tokenizer_files(
    m: &crate::checkpointing::CheckpointMeta,
    dir: &Path,
) -> Result<(), TrainError> {
    let copy = |from: &str, name: &str| -> Result<(), TrainError> {
        std::fs::copy(from, dir.join(name))
            .map(|_| ())
            .map_err(crate::io_err(Path::new(from)))
    };
    let write = |name: &str, v: &serde_json::Value| -> Result<(), TrainError> {
        let p = dir.join(name);
        let text = serde_json::to_string_pretty(v).map_err(|e| err(&p, e.to_string()))?;
        crate::checkpointing::write_synced(&p, text.as_bytes())
    };
    match (
        m.tokenizer_type.as_str(),
        &m.tokenizer_model,
        &m.vocab_file,
        &m.merge_file,
    ) {
        ("HuggingFaceTokenizer", Some(t), ..) => {
            copy(t, "tokenizer.json")?;
            let config = Path::new(t).with_file_name("tokenizer_config.json");
            if config.exists() {
                copy(&config.display().to_string(), "tokenizer_config.json")?;
            }
        }
        ("GPT2BPETokenizer", _, Some(v), Some(mf)) => {
            copy(v, "vocab.json")?;
            copy(mf, "merges.txt")?;
            // transformers v5's AutoTokenizer finds no class for these files without one named.
            let eot = "<|endoftext|>";
            write(
                "tokenizer_config.json",
                &serde_json::json!({"tokenizer_class": "GPT2Tokenizer", "bos_token": eot,
                                    "eos_token": eot, "unk_token": eot}),
            )?;
        }
        (kind @ ("Llama2Tokenizer" | "GPTSentencePieceTokenizer"), Some(t), ..) => {
            let model = megatron_data::sentencepiece_model::load(t)
                .map_err(|e| err(Path::new(t), e.to_string()))?;
            if let Some(why) = model.unlike_a_merge_vocabulary() {
                return Err(err(
                    Path::new(t),
                    format!("{why}: no tokenizer.json of a Llama tokenizer tokenizes as this model does"),
                ));
            }
            copy(t, "tokenizer.model")?;
            let add_bos = kind == "Llama2Tokenizer";
            let (bos, eos) = (model.bos.map(|i| i as usize), model.eos.map(|i| i as usize));
            let v = &model.vocab;
            write(
                "tokenizer.json",
                &spm_vocab::tokenizer_json(v, bos.map(|i| (i, add_bos)), eos.map(|i| (i, false))),
            )?;
            let name = |i: Option<usize>| i.map(|i| serde_json::json!(v.tokens[i]));
            let unk = v.types.iter().position(|&t| t == spm_vocab::UNKNOWN);
            write(
                "tokenizer_config.json",
                &serde_json::json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": name(bos), "eos_token": name(eos), "unk_token": name(unk),
                    "add_bos_token": add_bos, "add_eos_token": false, "legacy": true,
                }),
            )?;
        }
        _ => {}
    }
    Ok(())
}

/// `megatron convert --to gguf --input SAVE --output FILE.gguf --outtype T`: the file llama.cpp's
/// `convert_hf_to_gguf.py` writes for the same model (GPT-2, Llama, Qwen2, Qwen3), with the
/// checkpoint's byte-level BPE or SentencePiece tokenizer; a checkpoint without a recorded tokenizer gets
/// `tokenizer.ggml.model = "none"` (llama.cpp then runs on token ids). Written under a
/// temporary name and renamed.
pub fn megatron_to_gguf(
    input: &Path,
    output: &Path,
    out: gguf_export::GgufOutType,
) -> Result<PathBuf, TrainError> {
    let (meta, dir, config, mut tensors) = checkpoint_as_hf(input)?;
    let name = input
        .file_name()
        .map_or("megatron-rs".into(), |n| n.to_string_lossy().into_owned());
    let mut w =
        gguf_export::gguf_of_hf(&config, &mut tensors, out, &name).map_err(|e| err(&dir, e))?;
    if let Some(extra) = tensors.keys().next() {
        return Err(err(&dir, format!("tensor {extra} has no GGUF counterpart")));
    }
    let recorded = meta.tokenizer_model.is_some() || meta.vocab_file.is_some();
    if recorded {
        let rows = config["vocab_size"].as_u64().unwrap_or(0) as usize;
        let keys = gguf_export::tokenizer_metadata(
            &meta.tokenizer_type,
            meta.vocab_file.as_deref(),
            meta.merge_file.as_deref(),
            meta.tokenizer_model.as_deref(),
            rows,
        )
        .map_err(|e| err(&dir, e))?;
        for (k, v) in keys {
            w.meta(k, v);
        }
    } else {
        w.meta(
            "tokenizer.ggml.model",
            gguf_writer::MetaValue::Str("none".into()),
        );
    }
    w.write(output)?;
    Ok(output.to_path_buf())
}

/// `megatron convert --from gguf --input FILE.gguf --output SAVE`: a Llama, Qwen2 or Qwen3 GGUF
/// (quantized tensors dequantized, llama.cpp's Llama Q/K permutation undone) as a megatron-rs checkpoint, with
/// the GGUF's tokenizer written beside it as `tokenizer.json` and recorded in the manifest.
pub fn gguf_to_megatron(
    input: &Path,
    output: &Path,
    divisible_by: usize,
) -> Result<PathBuf, TrainError> {
    let g = gguf::Gguf::open(input)?;
    let (hf, mut tensors) = gguf::hf_model_of(&g).map_err(|m| err(input, m))?;
    let fam = family(hf["architectures"][0].as_str().unwrap_or("")).expect("a known class");
    let cfg = fam
        .megatron_config(&hf, divisible_by)
        .map_err(|m| err(input, m))?;
    cfg.validate().map_err(|e| err(input, e.to_string()))?;
    let vocab = hf["vocab_size"].as_u64().unwrap_or(0) as usize;
    let m = fam
        .to_megatron(&cfg, &mut tensors, vocab)
        .map_err(|e| err(input, e))?;
    if let Some(extra) = tensors.keys().next() {
        return Err(err(input, format!("unexpected tensor {extra}")));
    }
    let tokenizer = gguf::tokenizer_json(&g).map_err(|e| err(input, e))?;
    std::fs::create_dir_all(output).map_err(crate::io_err(output))?;
    let tok = match tokenizer {
        Some(json) => {
            if let Some(c) = gguf::tokenizer_config_json(&g) {
                let p = output.join("tokenizer_config.json");
                let text = serde_json::to_string_pretty(&c).map_err(|e| err(&p, e.to_string()))?;
                crate::checkpointing::write_synced(&p, text.as_bytes())?;
            }
            let p = output.join("tokenizer.json");
            let text = serde_json::to_string(&json).map_err(|e| err(&p, e.to_string()))?;
            crate::checkpointing::write_synced(&p, text.as_bytes())?;
            Some(RecordedTokenizer {
                tokenizer_type: "HuggingFaceTokenizer",
                path: std::fs::canonicalize(&p)
                    .map_err(crate::io_err(&p))?
                    .display()
                    .to_string(),
            })
        }
        None => None,
    };
    write_whole_checkpoint(output, cfg, ConvertedExtras::default(), &m, vocab, tok)?;
    Ok(iteration_dir(output, 0))
}
