//! `megatron`: the command-line front end. Logic lives in the library crates; this file parses
//! flags, dispatches, and turns errors into one clear line and a non-zero exit status.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use megatron_training::generate::generate;
use megatron_training::{
    inspect_data, pretrain, GenerateArgs, InspectArgs, MergeArgs, PreprocessArgs, TrainArgs,
    TrainTokenizerArgs,
};
use std::process::ExitCode;

mod bench;
mod bench_attention;
mod bench_cp;
mod bench_moe;
mod bench_muon;
mod bench_pipeline;
mod bench_prior;
mod bench_tp;

/// GEMM packing buffers and activations are large, short-lived allocations; glibc hands them
/// back to the kernel after each call (munmap + page faults + TLB shootdowns across rank and
/// GEMM threads). mimalloc keeps them. Around it, the per-rank byte counts of `--log-memory`.
#[global_allocator]
static GLOBAL: megatron_tensor::alloc::RankAllocator<mimalloc::MiMalloc> =
    megatron_tensor::alloc::RankAllocator(mimalloc::MiMalloc);

#[derive(Parser)]
#[command(
    name = "megatron",
    version,
    about = "Megatron-LM's way of training large transformers, in Rust"
)]
// Like argparse in Megatron's launch scripts, a repeated flag takes its last value.
#[command(args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Pretrain a GPT (Megatron's pretrain_gpt.py flags), or with `--model tabular` the tabular
    /// foundation model on the synthetic-table prior.
    Train(Box<TrainArgs>),
    /// Generate text from a checkpoint.
    Generate(GenerateArgs),
    /// Sentence embeddings from a BERT checkpoint: `embed --load SAVE --input texts.txt --out
    /// embeddings.npy` (mean-pooled over each line's tokens; `--normalize` for unit vectors).
    Embed(megatron_training::embed::EmbedArgs),
    /// Tokenize JSON lines or text into Megatron's .bin/.idx (tools/preprocess_data.py).
    Preprocess(PreprocessArgs),
    /// Train a byte-level BPE tokenizer (tokenizer.json, vocab.json, merges.txt).
    TrainTokenizer(TrainTokenizerArgs),
    /// Concatenate indexed datasets (tools/merge_datasets.py).
    MergeDatasets(MergeArgs),
    /// Print the token ids of training samples in the order training consumes them.
    InspectData(Box<InspectArgs>),
    /// Micro-benchmarks (GEMM throughput on transformer shapes).
    Bench(bench::BenchArgs),
    /// Convert checkpoints: `--from hf --input HF_DIR --output SAVE` (GPT-2, Llama, Mistral,
    /// Qwen2/3, Mixtral, Qwen2/3-MoE, gpt-oss, DeepSeek-V2/V3, BERT, T5), `--from gguf --input
    /// FILE.gguf --output SAVE` (gpt2, llama, Mixtral, qwen2, qwen3, qwen2moe, qwen3moe, gpt-oss),
    /// `--to
    /// hf --input SAVE --output HF_DIR` or `--to gguf --input SAVE --output FILE.gguf [--outtype
    /// f32|f16|bf16|q8_0]` (GPT-2, Llama, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, gpt-oss).
    Convert(ConvertArgs),
    /// Look into checkpoints: `inspect DIR` (iteration, layout saved from, files, tensors) or
    /// `verify DIR` (every file against the manifest's size and crc32c).
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Rank the layouts of a model on a cluster by predicted throughput, with memory per device
    /// (`--cluster dgx-a100|dgx-h100|this-machine`, model flags as for `train`; `--measure K`
    /// runs the best K here).
    Plan(Box<megatron_training::plan::PlanArgs>),
    /// Plot loss and validation loss against tokens, throughput, peak memory and learning rate
    /// from `--metrics-file` JSON lines, several runs overlaid: `plot A.jsonl B.jsonl --out
    /// curves.png`.
    Plot(PlotArgs),
    /// Use a trained tabular model on CSV tables: predict, impute, score-anomalies.
    #[command(subcommand)]
    Tabular(megatron_training::tabular::commands::TabularCommand),
}

#[derive(clap::Args)]
struct PlotArgs {
    /// Metrics files (`megatron train --metrics-file`), one per run.
    #[arg(required = true)]
    metrics: Vec<std::path::PathBuf>,
    #[arg(long, default_value = "curves.png")]
    out: std::path::PathBuf,
}

#[derive(clap::Args)]
struct ConvertArgs {
    /// `hf` (a Hugging Face model directory), `gguf` (a llama.cpp file), `torch_dist` or
    /// `torch` (a checkpoint Megatron-LM saved with that `--ckpt-format`) or `megatron` (a
    /// --save directory).
    #[arg(long, default_value = "megatron")]
    from: String,
    /// `megatron`, `hf`, `gguf`, or a Megatron-LM checkpoint format: `torch_dist`, or `torch`
    /// (the legacy per-rank files, written at the layout of the run that loads them).
    #[arg(long, default_value = "megatron")]
    to: String,
    /// With `--to gguf`: the storage of the 2-D weights, as llama.cpp's converter's `--outtype`
    /// (norms, biases and position embeddings stay f32; a q8_0 row that is not whole 32-value
    /// blocks is written f16). Default f32.
    #[arg(long, value_parser = clap::builder::ValueParser::new(|s: &str| s.parse::<megatron_training::convert::gguf_export::GgufOutType>()))]
    outtype: Option<megatron_training::convert::gguf_export::GgufOutType>,
    #[arg(long)]
    input: std::path::PathBuf,
    #[arg(long)]
    output: std::path::PathBuf,
    /// Vocabulary padding of the converted model (Megatron's flag; the default is Megatron's).
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
    /// With `--to torch`: the tensor-parallel size of the Megatron-LM run that loads it.
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// With `--to torch`: its pipeline-parallel size.
    #[arg(long, default_value_t = 1)]
    pipeline_model_parallel_size: usize,
    /// With `--to torch`: its layers per virtual pipeline stage (interleaved stages).
    #[arg(long)]
    num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// With `--to torch_dist` or `--to torch`: the weights alone (a release checkpoint), even where the
    /// checkpoint holds the optimizer state a Megatron-LM run would continue from.
    #[arg(long)]
    no_save_optim: bool,
    /// With `--to torch_dist` of an MoE run's optimizer state, or `--to torch`: the
    /// expert-parallel size Megatron-LM will load it at (above 1 its optimizer chains a second
    /// one for the experts, and the state is written in that shape; the legacy format also
    /// keeps each expert rank's experts in a file of its own).
    #[arg(long, default_value_t = 1)]
    expert_model_parallel_size: usize,
    /// With `--to torch_dist` of a run's optimizer state: in the form Megatron-LM's
    /// non-distributed optimizer loads (a run without --use-distributed-optimizer), not the
    /// distributed optimizer's.
    #[arg(long)]
    non_distributed_optimizer: bool,
    /// With `--to torch_dist`: the layer spec of the Megatron-LM run that will load it,
    /// `transformer_engine` (Megatron-LM's default) or `local`; they name an MoE layer's
    /// pre-MLP norm and multi-latent attention's norms differently.
    #[arg(long, value_enum)]
    transformer_impl: Option<TransformerImpl>,
}

/// `convert --to torch_dist --transformer-impl`.
#[derive(clap::ValueEnum, Clone, Copy)]
enum TransformerImpl {
    #[value(name = "transformer_engine")]
    TransformerEngine,
    Local,
}

fn run_convert(a: &ConvertArgs) -> anyhow::Result<()> {
    use megatron_training::convert::gguf_export::GgufOutType;
    use megatron_training::convert::{
        gguf_to_megatron, hf_to_megatron, megatron_to_gguf, megatron_to_hf, megatron_to_torch,
        megatron_to_torch_dist, torch_dist_to_megatron, torch_to_megatron, LayerSpec, LegacyLayout,
        LegacyState, OptimizerExport, OptimizerForm,
    };
    let legacy_layout = a.tensor_model_parallel_size != 1
        || a.pipeline_model_parallel_size != 1
        || a.num_layers_per_virtual_pipeline_stage.is_some();
    if legacy_layout && a.to != "torch" {
        anyhow::bail!("--tensor-model-parallel-size, --pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage lay out a legacy Megatron-LM export: they go with --to torch (torch_dist checkpoints load at any layout)");
    }
    if a.expert_model_parallel_size != 1
        && !(a.to == "torch" || (a.to == "torch_dist" && !a.no_save_optim))
    {
        anyhow::bail!("--expert-model-parallel-size shapes a Megatron-LM export: it goes with --to torch, or --to torch_dist without --no-save-optim");
    }
    if a.expert_model_parallel_size == 0 {
        anyhow::bail!("--expert-model-parallel-size must be at least 1");
    }
    if a.non_distributed_optimizer && (a.to != "torch_dist" || a.no_save_optim) {
        anyhow::bail!("--non-distributed-optimizer shapes the optimizer state of a Megatron-LM export: it goes with --to torch_dist (without --no-save-optim)");
    }
    if a.no_save_optim && a.to != "torch_dist" && a.to != "torch" {
        anyhow::bail!("--no-save-optim leaves the optimizer state out of a Megatron-LM export: it goes with --to torch_dist or --to torch");
    }
    match (a.to.as_str(), a.transformer_impl) {
        ("torch_dist", _) | ("torch", Some(TransformerImpl::Local)) => {}
        ("torch", _) => anyhow::bail!("--to torch writes megatron-core's local layer spec (its module names and parameter order): give --transformer-impl local, and load it into a run with --transformer-impl local (or use --to torch_dist, which names tensors for either spec)"),
        (_, Some(_)) => anyhow::bail!("--transformer-impl names the tensors of a Megatron-LM export for its layer spec: it goes with --to torch_dist or --to torch"),
        (_, None) => {}
    }
    if a.outtype.is_some() && a.to != "gguf" {
        anyhow::bail!("--outtype chooses the tensor types of a GGUF: it goes with --to gguf");
    }
    let out = match (a.from.as_str(), a.to.as_str()) {
        ("hf", "megatron") => hf_to_megatron(&a.input, &a.output, a.make_vocab_size_divisible_by)?,
        ("megatron", "hf") => megatron_to_hf(&a.input, &a.output)?,
        ("torch_dist", "megatron") => torch_dist_to_megatron(&a.input, &a.output)?,
        ("torch", "megatron") => torch_to_megatron(&a.input, &a.output)?,
        ("megatron", "torch_dist") => {
            let optim = if a.no_save_optim {
                OptimizerExport::WeightsOnly
            } else {
                OptimizerExport::IfSaved {
                    expert_model_parallel_size: a.expert_model_parallel_size,
                    form: if a.non_distributed_optimizer {
                        OptimizerForm::NonDistributed
                    } else {
                        OptimizerForm::Distributed
                    },
                }
            };
            let spec = match a.transformer_impl {
                None | Some(TransformerImpl::TransformerEngine) => LayerSpec::TransformerEngine,
                Some(TransformerImpl::Local) => LayerSpec::Local,
            };
            megatron_to_torch_dist(&a.input, &a.output, optim, spec)?
        }
        ("megatron", "torch") => {
            let (tp, pp) = (a.tensor_model_parallel_size, a.pipeline_model_parallel_size);
            let layout = LegacyLayout {
                tp,
                pp,
                layers_per_virtual_stage: a.num_layers_per_virtual_pipeline_stage,
                ep: a.expert_model_parallel_size,
            };
            let what = if a.no_save_optim {
                LegacyState::WeightsOnly
            } else {
                LegacyState::IfSaved
            };
            megatron_to_torch(&a.input, &a.output, layout, what)?
        }
        ("megatron", "gguf") => {
            let outtype = a.outtype.unwrap_or(GgufOutType::F32);
            megatron_to_gguf(&a.input, &a.output, outtype)?
        }
        ("gguf", "megatron") => {
            gguf_to_megatron(&a.input, &a.output, a.make_vocab_size_divisible_by)?
        }
        (f, t) => anyhow::bail!(
            "--from {f} --to {t}: expected --from hf, --from gguf, --from torch_dist or --from torch (to megatron), or --to hf, --to gguf, --to torch_dist or --to torch (from megatron)"
        ),
    };
    println!("wrote {}", out.display());
    Ok(())
}

fn run_tabular(c: &megatron_training::tabular::commands::TabularCommand) -> anyhow::Result<()> {
    use megatron_training::tabular::commands::{impute, predict, score_anomalies, TabularCommand};
    let (out, rows) = match c {
        TabularCommand::Predict(a) => (&a.out, predict(a)?.len()),
        TabularCommand::Impute(a) => (&a.table.out, impute(a)?.len()),
        TabularCommand::ScoreAnomalies(a) => (&a.out, score_anomalies(a)?.len()),
    };
    println!("wrote {} ({rows} rows)", out.display());
    Ok(())
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// What a checkpoint holds (DIR: a save directory, for the one --load would pick, or an
    /// iter_NNNNNNN directory).
    Inspect { dir: std::path::PathBuf },
    /// Checks files against the manifest (DIR: every checkpoint under a save directory, or one).
    Verify { dir: std::path::PathBuf },
}

/// mimalloc's `mi_option_purge_delay` (the option after `eager_commit_delay` = 14 in both of its
/// bundled major versions).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() -> ExitCode {
    // Never hand freed pages back to the kernel: a training step frees and re-allocates the same
    // buffers (GEMM packing, activations) every iteration, and each purge costs a page fault and
    // a page clear on the next touch.
    // SAFETY: setting an option before any other thread exists.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    restore_sigpipe();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result: anyhow::Result<()> = match cli.command {
        Command::Train(args) => pretrain(&args)
            .map(|s| {
                if let (Some(first), Some(last)) = (s.losses.first(), s.losses.last()) {
                    let what = match args.model {
                        megatron_training::arguments::ModelArg::Gpt => "lm loss",
                        megatron_training::arguments::ModelArg::Tabular => "loss",
                        // Masked-LM plus sentence-order loss, as Megatron's BERT trains on.
                        megatron_training::arguments::ModelArg::Bert => "loss",
                        megatron_training::arguments::ModelArg::T5 => "lm loss",
                    };
                    println!(
                        "done: iterations {}..{} | first {what} {:.4} | last {what} {:.4}",
                        first.0, last.0, first.1, last.1
                    );
                    if let Some(m) = &args.metrics_file {
                        let png = std::path::Path::new(m).with_extension("png");
                        println!("plot: megatron plot {m} --out {}", png.display());
                    }
                }
            })
            .map_err(Into::into),
        Command::Generate(args) => generate(&args)
            .map(|text| {
                // A plain text prompt is echoed before its continuation; a chat answer or a
                // continuation of token ids stands alone.
                let echo = !args.chat && args.prompt_ids.is_none();
                println!("{}{}", if echo { args.prompt.as_str() } else { "" }, text)
            })
            .map_err(Into::into),
        Command::Embed(args) => megatron_training::embed::embed(&args)
            .map(|n| println!("wrote {} ({n} embeddings)", args.out.display()))
            .map_err(Into::into),
        Command::Preprocess(args) => run_preprocess(&args),
        Command::TrainTokenizer(args) => {
            megatron_data::train_tokenizer::train_tokenizer(&args.config())
                .map(|()| {
                    println!(
                        "wrote {0}/tokenizer.json, {0}/vocab.json, {0}/merges.txt",
                        args.output_dir
                    )
                })
                .map_err(Into::into)
        }
        Command::MergeDatasets(args) => {
            megatron_data::preprocess::merge_datasets(&args.input, &args.output_prefix)
                .map(|()| println!("wrote {}.bin/.idx", args.output_prefix))
                .map_err(Into::into)
        }
        Command::InspectData(args) => inspect_data(&args)
            .map(|rows| {
                for r in rows {
                    println!("{}", serde_json::to_string(&r).unwrap_or_default());
                }
            })
            .map_err(Into::into),
        Command::Bench(args) => bench::run(&args),
        Command::Convert(a) => run_convert(&a),
        Command::Tabular(c) => run_tabular(&c),
        Command::Plot(a) => megatron_training::plot::plot(&a.metrics, &a.out)
            .map(|runs| {
                let points: usize = runs.iter().map(|r| r.loss.len()).sum();
                println!(
                    "wrote {} ({} runs, {points} logged iterations)",
                    a.out.display(),
                    runs.len()
                )
            })
            .map_err(Into::into),
        Command::Plan(a) => {
            let sub = matches.subcommand_matches("plan");
            let given = |id: &str| {
                sub.and_then(|m| m.value_source(id)) == Some(clap::parser::ValueSource::CommandLine)
            };
            let pins = megatron_training::plan::layout::Pins::from_flags(&a, given);
            megatron_training::plan::run_plan(&a, &pins)
                .map(|s| print!("{s}"))
                .map_err(Into::into)
        }
        Command::Checkpoint(c) => match c {
            CheckpointCommand::Inspect { dir } => megatron_training::checkpoint_tool::inspect(&dir),
            CheckpointCommand::Verify { dir } => megatron_training::checkpoint_tool::verify(&dir),
        }
        .map(|s| print!("{s}"))
        .map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_preprocess(args: &PreprocessArgs) -> anyhow::Result<()> {
    let tok = megatron_data::build_tokenizer_from(&args.tokenizer.spec())?;
    let s = megatron_data::preprocess::preprocess(&args.config(), tok.as_ref())?;
    println!(
        "wrote {} documents, {} tokens ({} MB in {:.1} s: {:.0} docs/s, {:.2} MB/s){}{} to {}",
        s.documents,
        s.tokens,
        s.bytes / 1_000_000,
        s.seconds,
        s.documents as f64 / s.seconds,
        s.bytes as f64 / s.seconds / 1e6,
        if s.empty_documents > 0 {
            format!(", {} empty documents skipped", s.empty_documents)
        } else {
            String::new()
        },
        if s.skipped_bad_lines > 0 {
            format!(", {} bad lines skipped", s.skipped_bad_lines)
        } else {
            String::new()
        },
        args.json_keys
            .iter()
            .map(|k| {
                let level = if args.split_sentences {
                    "sentence"
                } else {
                    "document"
                };
                format!("{}_{k}_{level}.bin/.idx", args.output_prefix)
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// `megatron ... | head` should end quietly, as Unix tools do, not with a "failed printing to
/// stdout" panic: Rust ignores SIGPIPE, so restore its default. Not under an MPI launcher, where a
/// peer that dies must surface as the communicator's error naming the rank rather than as a
/// signal that kills the others mid-write.
fn restore_sigpipe() {
    const MPI_LAUNCHER_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK"];
    if MPI_LAUNCHER_VARS
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    {
        return;
    }
    #[cfg(unix)]
    // SAFETY: called at the start of `main`, before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
