//! `megatron`: the command-line front end. Logic lives in the library crates; this file parses
//! flags, dispatches, and turns errors into one clear line and a non-zero exit status.

use clap::{Parser, Subcommand};
use megatron_training::generate::generate;
use megatron_training::{pretrain, GenerateArgs, TrainArgs};
use std::process::ExitCode;

mod bench;

/// GEMM packing buffers and activations are large, short-lived allocations; glibc hands them
/// back to the kernel after each call (munmap + page faults + TLB shootdowns across rank and
/// GEMM threads). mimalloc keeps them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Pretrain a GPT (Megatron's pretrain_gpt.py flags).
    Train(Box<TrainArgs>),
    /// Generate text from a checkpoint.
    Generate(GenerateArgs),
    /// Micro-benchmarks (GEMM throughput on transformer shapes).
    Bench(bench::BenchArgs),
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
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Train(args) => pretrain(&args)
            .map(|s| {
                if let (Some(first), Some(last)) = (s.losses.first(), s.losses.last()) {
                    println!(
                        "done: iterations {}..{} | first lm loss {:.4} | last lm loss {:.4}",
                        first.0, last.0, first.1, last.1
                    );
                }
            })
            .map_err(Into::into),
        Command::Generate(args) => generate(&args)
            .map(|text| println!("{}{}", args.prompt, text))
            .map_err(Into::into),
        Command::Bench(args) => bench::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
