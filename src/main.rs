//! The `moeforge` command.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// moeforge: a compiler and runtime for quantized Mixture-of-Experts kernels.
#[derive(Parser)]
#[command(name = "moeforge", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a recipe: parse, bind and prove its views, params and kernel bindings sound.
    Check {
        /// The recipe file (`kernels/*.recipe`), or the name of a standard recipe.
        file: String,
        /// Dimension values, e.g. `E=8,H=2048,I=768`.
        #[arg(long)]
        bind: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Print the source element offsets of every element of VIEW (row-major, needs --bind).
        #[arg(long, value_name = "VIEW")]
        index_map: Option<String>,
    },
    /// Compile a bound recipe's pack program: PTX for a GPU, CLIF for the host, or the kernel IR.
    Compile {
        /// The recipe file, or the name of a standard recipe.
        file: String,
        /// Dimension values, e.g. `E=8,H=2048,I=768`.
        #[arg(long)]
        bind: String,
        /// `sm_90a`, `sm_100a` or `host`.
        #[arg(long, default_value = "sm_90a")]
        target: String,
        /// `ptx` (GPU targets), `clif` (host) or `ir` (the kernel IR).
        #[arg(long)]
        emit: Option<String>,
        /// Write to this file (atomically) instead of standard output.
        #[arg(short = 'o', long = "output")]
        output: Option<std::path::PathBuf>,
    },
    /// Pack checkpoint expert weights with a recipe on the host (Cranelift JIT).
    Pack {
        /// The recipe file, or the name of a standard recipe.
        file: String,
        /// Input safetensors files (repeat for sharded checkpoints).
        #[arg(long = "input", required = true)]
        inputs: Vec<std::path::PathBuf>,
        /// Output safetensors file (written atomically).
        #[arg(long)]
        output: std::path::PathBuf,
        /// Inclusive layer range, e.g. `0-3`; every MoE layer when absent.
        #[arg(long)]
        layers: Option<String>,
        /// Host threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// List the tensors and metadata of a safetensors file.
    Inspect {
        /// The file.
        file: std::path::PathBuf,
    },
    /// Benchmarks: `--host` packs a Qwen3-30B-A3B layer with every recipe on this machine.
    Bench {
        /// Run the host benchmarks.
        #[arg(long)]
        host: bool,
        /// Host threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Only this standard recipe.
        #[arg(long)]
        recipe: Option<String>,
    },
    /// Run the main job on an embedded default MoE layer (Qwen3-30B-A3B shaped).
    Demo {
        /// Experts in the synthetic layer that is packed (the verification uses the full 128).
        #[arg(long, default_value_t = 128)]
        experts: usize,
    },
}

fn read_recipe(file: &str) -> moeforge::Result<(String, String)> {
    match std::fs::read_to_string(file) {
        Ok(s) => Ok((file.to_string(), s)),
        Err(e) => match moeforge::kernels::find(file) {
            Some(r) => Ok((r.path.to_string(), r.source.to_string())),
            None => Err(moeforge::Error::Io {
                path: file.to_string(),
                source: e,
            }),
        },
    }
}

fn run(cli: Cli, out: &mut dyn Write) -> moeforge::Result<()> {
    let io = |e: std::io::Error| moeforge::Error::Io {
        path: "<stdout>".into(),
        source: e,
    };
    match cli.command {
        Command::Check {
            file,
            bind,
            json,
            index_map,
        } => {
            let (name, src) = read_recipe(&file)?;
            let info = moeforge::check_source(&src, &name, bind.as_deref())?;
            if let Some(view) = index_map {
                let Some(v) = info.view(&view) else {
                    let views = moeforge::report::names_of(info.module(), &|k| {
                        matches!(k, moeforge::dsl::ir::TensorKind::View { .. })
                    });
                    return Err(moeforge::Error::Usage(format!(
                        "recipe `{}` has no view `{view}` (views: {})",
                        info.module().name,
                        if views.is_empty() {
                            "none".into()
                        } else {
                            views.join(", ")
                        }
                    )));
                };
                let Some(map) = info.index_map(v) else {
                    return Err(moeforge::Error::Usage(
                        "--index-map needs --bind with every dimension".into(),
                    ));
                };
                let mut w = std::io::BufWriter::new(out);
                w.write_all(b"[").map_err(io)?;
                for (k, o) in map.iter().enumerate() {
                    if k > 0 {
                        w.write_all(b",").map_err(io)?;
                    }
                    write!(w, "{o}").map_err(io)?;
                }
                w.write_all(b"]\n").map_err(io)?;
                w.flush().map_err(io)?;
            } else if json {
                let v = moeforge::report::json(&info);
                let s = serde_json::to_string_pretty(&v)
                    .map_err(|e| moeforge::Error::Usage(e.to_string()))?;
                writeln!(out, "{s}").map_err(io)?;
            } else {
                write!(out, "{}", moeforge::report::human(&info)).map_err(io)?;
            }
        }
        Command::Compile {
            file,
            bind,
            target,
            emit,
            output,
        } => {
            let (name, src) = read_recipe(&file)?;
            // Every optional input present: compile every param.
            let prog = moeforge::pack_program(&src, &name, &bind, &|_| true)?;
            let gpu = moeforge::codegen::ptx::Target::from_name(&target);
            let emit = emit.unwrap_or_else(|| {
                if gpu.is_some() {
                    "ptx".into()
                } else {
                    "clif".into()
                }
            });
            let text = match (gpu, target.as_str(), emit.as_str()) {
                (_, _, "ir") => prog.to_string(),
                (Some(t), _, "ptx") => moeforge::codegen::ptx::compile(&prog, t)?,
                (None, "host", "clif") => moeforge::codegen::host::clif_text(&prog)?,
                (None, "host", _) | (Some(_), _, _) => {
                    return Err(moeforge::Error::Usage(format!(
                        "--emit {emit} is not available for --target {target} (ptx: sm_90a, sm_100a; clif: host; ir: any)"
                    )))
                }
                (None, _, _) => {
                    return Err(moeforge::Error::Usage(format!(
                        "unknown target `{target}` (expected sm_90a, sm_100a or host)"
                    )))
                }
            };
            match output {
                Some(path) => moeforge::write_atomic(&path, text.as_bytes())?,
                None => out.write_all(text.as_bytes()).map_err(io)?,
            }
        }
        Command::Pack {
            file,
            inputs,
            output,
            layers,
            threads,
        } => {
            let (name, src) = read_recipe(&file)?;
            let layers = match layers {
                Some(l) => Some(moeforge::pack::parse_layers(&l)?),
                None => None,
            };
            let opts = moeforge::pack::PackOptions {
                recipe_src: src,
                recipe_path: name,
                inputs,
                output: output.clone(),
                layers,
                threads,
                progress: true,
            };
            let r = moeforge::pack::pack(&opts)?;
            let bytes: usize = r.layers.iter().map(|l| l.input_bytes).sum();
            let secs: f64 = r.layers.iter().map(|l| l.seconds).sum();
            writeln!(
                out,
                "packed {} layer(s), {:.1} MB of expert weights in {:.2} s ({:.2} GB/s in the host backend), wrote {} ({:.1} MB) in {:.2} s total",
                r.layers.len(),
                bytes as f64 / 1e6,
                secs,
                bytes as f64 / secs.max(1e-9) / 1e9,
                output.display(),
                r.output_bytes as f64 / 1e6,
                r.seconds
            )
            .map_err(io)?;
        }
        Command::Inspect { file } => {
            write!(out, "{}", moeforge::pack::inspect(&file)?).map_err(io)?;
        }
        Command::Bench {
            host,
            threads,
            recipe,
        } => {
            if !host {
                return Err(moeforge::Error::Usage(
                    "nothing to run: pass --host (GPU benchmarks arrive with the GPU runtime)"
                        .into(),
                ));
            }
            write!(
                out,
                "{}",
                moeforge::bench::host_report(threads, recipe.as_deref())?
            )
            .map_err(io)?;
        }
        Command::Demo { experts } => {
            write!(out, "{}", moeforge::demo::run(experts)?).map_err(io)?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    match run(cli, &mut lock) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut err = std::io::stderr().lock();
            let msg = match &e {
                moeforge::Error::Recipe { rendered, .. } => rendered.clone(),
                other => format!("error: {other}\n"),
            };
            let _ = err.write_all(msg.as_bytes());
            ExitCode::from(1)
        }
    }
}
