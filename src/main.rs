//! The `moeforge` command. It reads the environment once, into [`moeforge::Settings`], for the
//! commands that compile or run kernels, and passes the settings down.

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
        /// `pack` (the pack program), `gemm` (every grouped-GEMM variant the recipe's weights can
        /// use, autotune candidates included; sm_90a PTX) or `all` (both, in one PTX module).
        #[arg(long, default_value = "pack")]
        kernels: String,
        /// Write to this file (atomically) instead of standard output.
        #[arg(short = 'o', long = "output")]
        output: Option<std::path::PathBuf>,
    },
    /// Pack checkpoint expert weights with a recipe on the host (Cranelift JIT).
    Pack {
        /// The recipe file, or the name of a standard recipe.
        file: String,
        /// Input safetensors files, `model.safetensors.index.json` files or checkpoint directories
        /// (repeat for several).
        #[arg(long = "input", required = true)]
        inputs: Vec<std::path::PathBuf>,
        /// Output safetensors file (written atomically); with --passthrough, a new directory.
        #[arg(long)]
        output: std::path::PathBuf,
        /// Inclusive layer range, e.g. `0-3`; every MoE layer when absent.
        #[arg(long)]
        layers: Option<String>,
        /// Host threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// `host` (Cranelift JIT) or `gpu` (generated PTX on GPU 0; with --moe-tp/--ep, rank r on
        /// GPU r, the all-reduces through NCCL).
        #[arg(long, default_value = "host")]
        device: String,
        /// Write a complete checkpoint directory at --output: every tensor the recipe does not
        /// consume copied through, sharded like the input, with an index file.
        #[arg(long)]
        passthrough: bool,
        /// Pack weights that hold NaN or infinities (refused by default).
        #[arg(long)]
        allow_nonfinite: bool,
        /// Split every expert over T ranks (w13's gate and up rows, w2's columns): one file per
        /// rank, OUT.rank{r}.safetensors, with the scales of the unsplit pack.
        #[arg(long, value_name = "T", default_value_t = 1)]
        moe_tp: usize,
        /// Divide the experts over N ranks: one file per rank, OUT.rank{r}.safetensors; the
        /// activation scales are reduced over them.
        #[arg(long, value_name = "N", default_value_t = 1)]
        ep: usize,
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
        /// Run the GPU benchmarks (JIT latency, on-GPU pack).
        #[arg(long)]
        gpu: bool,
        /// Host threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Only this standard recipe.
        #[arg(long)]
        recipe: Option<String>,
        /// GPU: only the on-GPU pack benchmark (no JIT latency part).
        #[arg(long, conflicts_with = "jit_only")]
        pack_only: bool,
        /// GPU: only the JIT latency part (no pack benchmark).
        #[arg(long)]
        jit_only: bool,
        /// GPU: timed pack runs per recipe (the best is reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Only the declared-layout benchmark: each layout example against its row-major twin
        /// (with --host and/or --gpu).
        #[arg(long)]
        layouts: bool,
        /// Only the EPLB benchmark (with --gpu): in-place rearrangement of a DeepSeek-V3 EP8
        /// layer for every recipe, against the copy ceiling.
        #[arg(long, conflicts_with = "layouts")]
        eplb: bool,
        /// Only the grouped-GEMM benchmark (with --gpu): the MoE w13 GEMM at the anchor shapes
        /// against torch (measured now by --anchor) and vLLM (recorded); --recipe is then a
        /// comma-separated list of bf16, fp8_per_tensor, fp8_block128, nvfp4_cutedsl, mxfp4,
        /// int8_per_row, int4_g128, or all (the first three) or weights_only (the last four); the
        /// variants int4_g128_zp, int8_g128, fp8_channel and fp8_g128 by name.
        #[arg(long, conflicts_with_all = ["layouts", "eplb"])]
        gemm: bool,
        /// Only the MoE layer benchmark (with --gpu): the whole forward (permute, both GEMMs,
        /// SiLU*up, combine) per model, recipe and token count, with torch's bf16 layer measured
        /// in the same call (--anchor, default scripts/moe_anchor.py). `--gpu --model M` without
        /// --gemm runs it too.
        #[arg(long, conflicts_with_all = ["layouts", "eplb", "gemm"])]
        moe: bool,
        /// GEMM and MoE: qwen3-30b-a3b, deepseek-v3-ep8, mixtral-8x7b or all (default: all).
        #[arg(long)]
        model: Option<String>,
        /// GEMM and MoE: token counts, comma-separated (default: 1,16,128,512,2048,8192).
        #[arg(long)]
        tokens: Option<String>,
        /// GEMM and MoE: write the JSON report here, atomically (GEMM default: $OUT/bench_gemm.json
        /// when OUT is set, else none).
        #[arg(long, value_name = "OUT.json")]
        json: Option<std::path::PathBuf>,
        /// GEMM and MoE: the torch anchor script (default: scripts/gemm_anchor.py, or
        /// scripts/moe_anchor.py), run as `python3 PATH CASES.json` after our kernels.
        #[arg(long, value_name = "PATH")]
        anchor: Option<std::path::PathBuf>,
        /// GEMM and MoE: do not measure torch.
        #[arg(long, conflicts_with = "anchor")]
        no_anchor: bool,
        /// MoE: feed the FP8 recipes (per tensor, per channel, group-wise) static activation
        /// scales, as a checkpoint with calibrated input scales does (rows read `<recipe>+static`).
        #[arg(long, requires = "moe")]
        static_scales: bool,
        /// MoE: also draw the report as SVG here (what `moeforge plot` draws from the JSON).
        #[arg(long, value_name = "OUT.svg")]
        plot: Option<std::path::PathBuf>,
    },
    /// GPU self-tests: on-GPU packing byte-identical to the host for every standard recipe.
    Selftest {
        /// Run the GPU tests (they say that they skipped when there is no GPU).
        #[arg(long)]
        gpu: bool,
        /// Only the two smallest shapes.
        #[arg(long)]
        quick: bool,
        /// Instead: the two-GPU NCCL smoke test (a MAX all-reduce, a grouped exchange both ways, a
        /// pack whose amax is reduced over moe_tp = 2, every standard recipe's sharded pack under
        /// moe_tp = 2 and ep = 2 with one rank per GPU, EPLB across the GPUs), one thread per GPU;
        /// it says that it skipped with fewer than 2 GPUs. Sets NCCL_NVLS_ENABLE=0 when it is unset.
        #[arg(long, requires = "gpu")]
        nccl: bool,
        /// Instead: the generated grouped bf16 GEMM (v0) against the f64 host reference on three
        /// shapes (fresh random seed, printed), and the largest one timed; it says that it skipped
        /// without a Hopper GPU.
        #[arg(long, requires = "gpu", conflicts_with = "nccl")]
        gemm: bool,
        /// Instead: the MoE layer forward on the GPU against the host path, through `moe run`, for
        /// every standard recipe (bf16, FP8 per tensor static and dynamic, FP8 128x128 blocks, and
        /// the weights-only NVFP4, MXFP4, INT8 and INT4) over several routings and a placement
        /// with replicas (fresh seed, printed); then the forward captured in a CUDA graph and
        /// replayed (the same bits).
        #[arg(long, requires = "gpu", conflicts_with_all = ["nccl", "gemm"])]
        moe: bool,
        /// Instead: only the MoE layer's own kernels of `--gemm` (activation quantization, route +
        /// permute in every gathered form, activation and combine) against their host references,
        /// without the grouped GEMMs.
        #[arg(long, requires = "gpu", conflicts_with_all = ["nccl", "gemm", "moe"])]
        kernels: bool,
        /// With --gemm: only the warp-specialized GEMM variants whose tag contains one of these
        /// comma-separated pieces (e.g. `d1x128,d2x256`), without the v0 shapes, the timing and
        /// the layer's other kernels (so that a sanitizer run covers just those variants).
        #[arg(long, requires = "gemm", value_name = "TAGS")]
        only: Option<String>,
    },
    /// The kernel cache: list, clear, or warm up the variants a binding needs.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// Expert-parallel load balancing: `plan` computes DeepSeek's placement from observed loads,
    /// `apply` lays a packed checkpoint out along one.
    Eplb {
        #[command(subcommand)]
        action: EplbAction,
    },
    /// MoE layers: `run` computes one layer's forward on the router's output (SPEC §9).
    Moe {
        #[command(subcommand)]
        action: MoeAction,
    },
    /// Plot a MoE layer benchmark report (`bench --gpu --moe --json`) as SVG: time against tokens
    /// per model and recipe, with the rooflines, torch's bf16 layer and vLLM's recorded w13 GEMM.
    Plot {
        /// The report (JSON).
        report: std::path::PathBuf,
        /// The SVG to write (atomically).
        #[arg(short = 'o', long = "output", value_name = "OUT.svg")]
        output: std::path::PathBuf,
    },
    /// Run the main job on an embedded default MoE layer (Qwen3-30B-A3B shaped).
    Demo {
        /// Experts in the synthetic layer that is packed (the verification uses the full 128).
        #[arg(long, default_value_t = 128)]
        experts: usize,
    },
}

#[derive(Subcommand)]
enum MoeAction {
    /// Run one MoE layer of a packed checkpoint: IN holds `hidden_states` [T, H] bf16, `topk_ids`
    /// [T, k] i32 and `topk_weights` [T, k] f32; OUT gets `output` [T, H] bf16 (written atomically).
    Run {
        /// The packed safetensors file (`moeforge pack` or `eplb apply` output).
        packed: std::path::PathBuf,
        /// The inputs safetensors file.
        #[arg(long)]
        inputs: std::path::PathBuf,
        /// The output safetensors file.
        #[arg(long)]
        output: std::path::PathBuf,
        /// The MoE layer (needed when the file holds several).
        #[arg(long)]
        layer: Option<u32>,
        /// `host` (the host reference path) or `gpu` (the generated kernels on GPU 0, Hopper: bf16 and FP8 recipes).
        #[arg(long, default_value = "host")]
        device: String,
        /// Place the params along this placement first (`eplb plan --json` output), as `eplb apply`.
        #[arg(long)]
        placement: Option<std::path::PathBuf>,
        /// Also write `w13_out` [T, k, 2I] f32 and `act` [T, k, I] f32.
        #[arg(long)]
        dump_intermediates: bool,
        /// The recipe (file or standard name), instead of the file's `moeforge.recipe_source`.
        #[arg(long)]
        recipe: Option<String>,
        /// Host threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
}

#[derive(Subcommand)]
enum EplbAction {
    /// A placement of logical experts on R physical slots from per-layer loads (docs/FORMATS.md §6).
    Plan {
        /// JSON: a list of per-layer lists of logical expert loads.
        #[arg(long)]
        loads: std::path::PathBuf,
        /// Physical expert slots R (a multiple of --gpus).
        #[arg(long)]
        replicas: usize,
        /// Expert groups G (hierarchical when G divides by --nodes).
        #[arg(long, default_value_t = 1)]
        groups: usize,
        /// Nodes N.
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        /// GPUs P (a multiple of --nodes).
        #[arg(long)]
        gpus: usize,
        /// Print `{"phy2log", "log2phy", "logcnt"}` as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a packed checkpoint's params in a placement's slot order (replicas copied), every
    /// registered param of every MoE layer; optionally only one rank's slots.
    Apply {
        /// The packed safetensors file (`moeforge pack` output).
        packed: std::path::PathBuf,
        /// The placement: `eplb plan --json` output (only `phy2log` is read: one row per MoE layer).
        #[arg(long)]
        placement: std::path::PathBuf,
        /// Output safetensors file (written atomically).
        #[arg(long)]
        output: std::path::PathBuf,
        /// Keep only this rank's contiguous R/P slots (with --ranks).
        #[arg(long, requires = "ranks")]
        rank: Option<usize>,
        /// The number of ranks P the slots are split among (with --rank).
        #[arg(long, requires = "rank")]
        ranks: Option<usize>,
        /// The recipe (file or standard name), instead of the file's `moeforge.recipe_source`.
        #[arg(long)]
        recipe: Option<String>,
    },
}

#[derive(Subcommand)]
enum CacheAction {
    /// List the entries on disk (kernels, then GEMM tuning results).
    Ls,
    /// Remove every entry (kernels and GEMM tuning results).
    Clear,
    /// Compile the PTX (and, with a GPU, the cubin) a binding needs into the cache; or, with
    /// --model, build and tune every grouped-GEMM variant of a model's shapes.
    Warmup {
        /// The recipe file, or the name of a standard recipe.
        #[arg(conflicts_with = "model")]
        file: Option<String>,
        /// Pre-build (and, on a Hopper GPU, pre-tune) every grouped-GEMM variant of a model's w13
        /// and w2: qwen3-30b-a3b, deepseek-v3-ep8, mixtral-8x7b or all.
        #[arg(long, conflicts_with_all = ["bind", "replay", "manifest"])]
        model: Option<String>,
        /// With --model: a comma-separated list of bf16, fp8_per_tensor, fp8_block128,
        /// nvfp4_cutedsl, mxfp4, int8_per_row, int4_g128, or all (the first three; the default) or
        /// weights_only (the last four).
        #[arg(long, requires = "model")]
        recipe: Option<String>,
        /// With --model: the token counts tuned, comma-separated (default:
        /// 1,16,128,512,2048,8192).
        #[arg(long, requires = "model")]
        tokens: Option<String>,
        /// Dimension values.
        #[arg(long)]
        bind: Option<String>,
        /// PTX target.
        #[arg(long, default_value = "sm_90a")]
        target: String,
        /// Also write a precompile manifest here.
        #[arg(long)]
        manifest: Option<std::path::PathBuf>,
        /// Replay a manifest.
        #[arg(long)]
        replay: Option<std::path::PathBuf>,
    },
}

/// Files larger than this are refused unread; up to it, the parser reports a recipe over its own
/// limit (`dsl::limits::MAX_SOURCE_BYTES`) with a spanned diagnostic.
const RECIPE_READ_LIMIT: u64 = 16 << 20;

fn read_recipe(file: &str) -> moeforge::Result<(String, String)> {
    let path = std::path::Path::new(file);
    if !path.exists() {
        if let Some(r) = moeforge::kernels::find(file) {
            return Ok((r.path.to_string(), r.source.to_string()));
        }
    }
    let src = moeforge::read_capped(path, RECIPE_READ_LIMIT)?;
    Ok((file.to_string(), src))
}

fn cache_cmd(
    action: CacheAction,
    settings: &moeforge::Settings,
    out: &mut dyn Write,
) -> moeforge::Result<()> {
    let io = |e: std::io::Error| moeforge::Error::Io {
        path: "<stdout>".into(),
        source: e,
    };
    let rs = &settings.runtime;
    let cache = moeforge::runtime::Cache::new(rs.cache_dir.clone());
    let tune = moeforge::runtime::gemm_tune::TuneCache::new(rs.cache_dir.clone());
    match action {
        CacheAction::Ls => {
            let entries = cache.entries()?;
            let dir = cache
                .dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|| "-".into());
            writeln!(out, "{} entries in {dir}", entries.len()).map_err(io)?;
            for e in entries {
                let state = if e.valid {
                    "ok"
                } else {
                    "CORRUPT (will be recompiled)"
                };
                writeln!(
                    out,
                    "{:<6} {}  {:>9} bytes  {state}",
                    e.kind, e.key, e.bytes
                )
                .map_err(io)?;
            }
            let tuned = tune.entries()?;
            if !tuned.is_empty() {
                let dir = tune
                    .dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_else(|| "-".into());
                writeln!(out, "{} GEMM tuning entries in {dir}", tuned.len()).map_err(io)?;
                for t in tuned {
                    match (&t.key, &t.choice) {
                        (Some(k), Some(c)) if t.valid => {
                            writeln!(out, "tune   {}  {}  -> {c}  ok", t.hash, k.describe())
                        }
                        _ => writeln!(
                            out,
                            "tune   {}  {:>9} bytes  CORRUPT (will be tuned again)",
                            t.hash, t.bytes
                        ),
                    }
                    .map_err(io)?;
                }
            }
        }
        CacheAction::Clear => {
            let n = cache.clear()?;
            writeln!(out, "removed {n} entries").map_err(io)?;
            let t = tune.clear()?;
            if t > 0 {
                writeln!(out, "removed {t} GEMM tuning entries").map_err(io)?;
            }
        }
        CacheAction::Warmup {
            model: Some(model),
            recipe,
            tokens,
            ..
        } => {
            let selection = moeforge::bench_gemm::Selection::parse(
                Some(&model),
                tokens.as_deref(),
                recipe.as_deref(),
            )?;
            write!(out, "{}", moeforge::gemm_warmup::warmup(&selection, rs)?).map_err(io)?;
        }
        CacheAction::Warmup {
            file,
            bind,
            target,
            manifest,
            replay,
            ..
        } => {
            let mut jobs: Vec<(String, String, String)> = Vec::new();
            if let Some(m) = replay {
                let text = moeforge::read_capped(&m, moeforge::MANIFEST_LIMIT)?;
                for line in text
                    .lines()
                    .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
                {
                    let parts: Vec<&str> = line.split('\t').collect();
                    let [f, b, t] = parts[..] else {
                        return Err(moeforge::Error::Usage(format!(
                            "bad manifest line `{line}` (expected RECIPE<TAB>BINDING<TAB>TARGET)"
                        )));
                    };
                    jobs.push((f.into(), b.into(), t.into()));
                }
            }
            if let (Some(f), Some(b)) = (file, bind) {
                jobs.push((f, b, target));
            }
            if jobs.is_empty() {
                return Err(moeforge::Error::Usage(
                    "warmup needs RECIPE --bind ... or --replay MANIFEST".into(),
                ));
            }
            let dev = moeforge::runtime::Device::open(0);
            let compiler = moeforge::runtime::jit::Compiler::resolve(&rs.jit)?;
            for (f, b, t) in &jobs {
                // Request to loaded modules (parse, plan, keys, cache, JIT or disk, module load):
                // what a serving process pays at start-up after opening the device.
                let t0 = std::time::Instant::now();
                let (name, src) = read_recipe(f)?;
                // The variants a binding needs: its pack program (every optional input present),
                // tuned as loading it tunes it.
                let prog = moeforge::pack_program(&src, &name, b, &|_| true)?;
                let prog = rs.launch.apply(&prog);
                let tgt = moeforge::codegen::ptx::Target::from_name(t)
                    .filter(|t| t.is_gpu())
                    .ok_or_else(|| moeforge::Error::Usage(format!("unknown target `{t}`")))?;
                let (units, hit) = moeforge::runtime::gpu_pack::unit_ptx(&cache, &prog, tgt)?;
                let on_this_gpu = matches!(&dev, Ok(d) if d.target() == Some(tgt));
                if !on_this_gpu && compiler != moeforge::runtime::jit::Compiler::Driver {
                    // ptxas needs no device: the cubin entries are filled here too.
                    let names: Vec<&str> = prog.kernels().map(|k| k.name.as_str()).collect();
                    let mut worst = moeforge::runtime::cache::Hit::Memory;
                    for c in moeforge::runtime::gpu_pack::unit_cubins(
                        &cache, &units, &names, tgt, &compiler, None,
                    ) {
                        worst = moeforge::runtime::gpu_pack::worst(worst, c?.1);
                    }
                    writeln!(
                        out,
                        "{f} {b} {t}: ptx {hit:?}, cubin {worst:?} by {} (no module loaded: {})",
                        compiler.describe(),
                        match &dev {
                            Ok(_) => format!("the GPU here is not {t}"),
                            Err(why) => why.to_string(),
                        }
                    )
                    .map_err(io)?;
                    continue;
                }
                match &dev {
                    Ok(d) if d.target() == Some(tgt) => {
                        let gp =
                            moeforge::runtime::gpu_pack::GpuProgram::load(d, &cache, &prog, rs)?;
                        writeln!(
                            out,
                            "{f} {b} {t}: ptx {hit:?}, cubin {:?}, loaded in {:.2} ms",
                            gp.cubin_hit,
                            t0.elapsed().as_secs_f64() * 1e3
                        )
                        .map_err(io)?;
                    }
                    Ok(_) => writeln!(
                        out,
                        "{f} {b} {t}: ptx {hit:?}; cubin step skipped (the GPU here is not {t})"
                    )
                    .map_err(io)?,
                    Err(why) => {
                        writeln!(out, "{f} {b} {t}: ptx {hit:?}; cubin step skipped ({why})")
                            .map_err(io)?
                    }
                }
            }
            if let Some(m) = manifest {
                let text: String = jobs
                    .iter()
                    .map(|(f, b, t)| format!("{f}\t{b}\t{t}\n"))
                    .collect();
                moeforge::write_atomic(&m, text.as_bytes())?;
                writeln!(out, "wrote manifest {}", m.display()).map_err(io)?;
            }
        }
    }
    Ok(())
}

fn run(cli: Cli, out: &mut dyn Write) -> moeforge::Result<()> {
    let io = |e: std::io::Error| moeforge::Error::Io {
        path: "<stdout>".into(),
        source: e,
    };
    // The one read of the environment, for the commands that compile or run kernels (`check`,
    // `compile` and `inspect` take nothing from it).
    let settings = match cli.command {
        Command::Check { .. }
        | Command::Compile { .. }
        | Command::Inspect { .. }
        | Command::Eplb { .. }
        | Command::Plot { .. }
        | Command::Moe { .. } => moeforge::Settings::default(),
        _ => moeforge::Settings::from_env()?,
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
                let Some(b) = info.binding() else {
                    return Err(moeforge::Error::Usage(
                        "--index-map needs --bind with every dimension".into(),
                    ));
                };
                // Streamed: the map is written as it is computed, never held whole, and refused
                // above a stated size (its element count is checked arithmetic).
                let n = moeforge::dsl::verify::index_map_len(&v.layout, b).ok_or_else(|| {
                    moeforge::Error::Usage(format!(
                        "--index-map: view `{view}` has more elements than 64-bit arithmetic holds"
                    ))
                })?;
                if n > moeforge::INDEX_MAP_LIMIT {
                    return Err(moeforge::Error::Usage(format!(
                        "--index-map: view `{view}` has {n} elements at this binding, over the limit of {} (bind smaller sizes)",
                        moeforge::INDEX_MAP_LIMIT
                    )));
                }
                let mut w = std::io::BufWriter::new(out);
                w.write_all(b"[").map_err(io)?;
                let mut first = true;
                let mut err = None;
                moeforge::dsl::verify::index_map_each(&v.layout, b, &mut |o| {
                    if err.is_some() {
                        return;
                    }
                    let r = if first {
                        write!(w, "{o}")
                    } else {
                        write!(w, ",{o}")
                    };
                    first = false;
                    if let Err(e) = r {
                        err = Some(e);
                    }
                });
                if let Some(e) = err {
                    return Err(io(e));
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
            kernels,
            output,
        } => {
            let (pack, gemm) = match kernels.as_str() {
                "pack" => (true, false),
                "gemm" => (false, true),
                "all" => (true, true),
                other => {
                    return Err(moeforge::Error::Usage(format!(
                        "unknown --kernels `{other}` (expected pack, gemm or all)"
                    )))
                }
            };
            if gemm && (target != "sm_90a" || emit.as_deref().is_some_and(|e| e != "ptx")) {
                return Err(moeforge::Error::Usage(format!(
                    "--kernels {kernels}: the GEMM variants are sm_90a PTX only so far (wgmma); pass --target sm_90a"
                )));
            }
            let (name, src) = read_recipe(&file)?;
            let plan = if gemm {
                let info = moeforge::verify_source(&src, &name, Some(&bind))?;
                let plan = moeforge::gemm_variants::plan(&info)?;
                if !pack && !plan.missing.is_empty() {
                    // Nothing is written: a GEMM of the recipe has no kernel to check.
                    return Err(moeforge::Error::Usage(plan.missing.join("\nerror: ")));
                }
                let mut err = std::io::stderr().lock();
                for m in &plan.missing {
                    writeln!(err, "note: {m}").map_err(io)?;
                }
                // A slow access pattern: which GEMM reads a re-laid copy, and why.
                for (g, _, what) in &plan.access {
                    writeln!(err, "note: {g} reads {what}").map_err(io)?;
                }
                Some(plan)
            } else {
                None
            };
            if let (false, Some(plan)) = (pack, &plan) {
                let text = plan.module();
                match output {
                    Some(path) => moeforge::write_atomic(&path, text.as_bytes())?,
                    None => out.write_all(text.as_bytes()).map_err(io)?,
                }
                return Ok(());
            }
            // Every optional input present: compile every param.
            let prog = moeforge::pack_program(&src, &name, &bind, &|_| true)?;
            let gpu = moeforge::codegen::ptx::Target::from_name(&target).filter(|t| t.is_gpu());
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
            // `all`: the GEMM entries follow the pack module's, in the same module.
            let text = match &plan {
                Some(plan) => text + &plan.entries(),
                None => text,
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
            device,
            passthrough,
            allow_nonfinite,
            moe_tp,
            ep,
        } => {
            let gpu = match device.as_str() {
                "host" => false,
                "gpu" => true,
                other => {
                    return Err(moeforge::Error::Usage(format!(
                        "unknown --device `{other}` (expected host or gpu)"
                    )))
                }
            };
            let (name, src) = read_recipe(&file)?;
            let layers = match layers {
                Some(l) => Some(moeforge::pack::parse_layers(&l)?),
                None => None,
            };
            // The GPU ranks all-reduce through NCCL: NVLink multicast stays off unless the caller
            // turned it on (set here, before any NCCL call, with no other thread).
            let nvls = (gpu && ep * moe_tp > 1).then(nvls_off_unless_set);
            let opts = moeforge::pack::PackOptions {
                recipe_src: src,
                recipe_path: name,
                inputs,
                output: output.clone(),
                layers,
                threads,
                progress: true,
                gpu,
                passthrough,
                allow_nonfinite,
                settings,
                topology: moeforge::runtime::collective::Topology { ep, moe_tp },
            };
            let r = moeforge::pack::pack(&opts)?;
            if let Some(nvls) = nvls {
                writeln!(out, "{nvls}").map_err(io)?;
            }
            for n in &r.notes {
                writeln!(out, "note: {n}").map_err(io)?;
            }
            let ranks = ep * moe_tp;
            let wrote = if ranks > 1 {
                format!(
                    "{} .. {} ({ranks} ranks: ep {ep} x moe_tp {moe_tp})",
                    moeforge::pack::rank_path(&output, 0).display(),
                    moeforge::pack::rank_path(&output, ranks - 1).display()
                )
            } else {
                output.display().to_string()
            };
            let bytes: usize = r.layers.iter().map(|l| l.input_bytes).sum();
            let secs: f64 = r.layers.iter().map(|l| l.seconds).sum();
            writeln!(
                out,
                "packed {} layer(s) on {}, {:.1} MB of expert weights in {:.2} s ({:.2} GB/s in the backend), wrote {} ({:.1} MB) in {:.2} s total",
                r.layers.len(),
                match (gpu, ranks) {
                    (false, _) => "the host".to_string(),
                    (true, 1) => "the GPU".to_string(),
                    (true, n) => format!("{n} GPUs"),
                },
                bytes as f64 / 1e6,
                secs,
                bytes as f64 / secs.max(1e-9) / 1e9,
                wrote,
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
            gpu,
            threads,
            recipe,
            pack_only,
            jit_only,
            reps,
            layouts,
            eplb,
            gemm,
            moe,
            model,
            tokens,
            json,
            anchor,
            no_anchor,
            static_scales,
            plot,
        } => {
            // `bench --gpu --model M` alone is the MoE layer benchmark (issue [9]'s form).
            let moe = moe || (model.is_some() && !gemm && !eplb && !layouts);
            if plot.is_some() && !moe {
                return Err(moeforge::Error::Usage(
                    "--plot draws the MoE layer benchmark: pass --moe".into(),
                ));
            }
            if !host && !gpu {
                return Err(moeforge::Error::Usage(
                    "nothing to run: pass --host and/or --gpu".into(),
                ));
            }
            if !(gemm || moe)
                && (model.is_some()
                    || tokens.is_some()
                    || json.is_some()
                    || anchor.is_some()
                    || no_anchor)
            {
                return Err(moeforge::Error::Usage(
                    "--model, --tokens, --json, --anchor and --no-anchor go with --gemm or --moe"
                        .into(),
                ));
            }
            if moe {
                if !gpu || host {
                    return Err(moeforge::Error::Usage(
                        "the MoE layer benchmark runs on the GPU: pass --gpu (and not --host)"
                            .into(),
                    ));
                }
                let selection = moeforge::bench_gemm::Selection::parse(
                    model.as_deref(),
                    tokens.as_deref(),
                    recipe.as_deref(),
                )?;
                let opts = moeforge::bench_moe::Options {
                    selection,
                    json,
                    plot,
                    anchor: if no_anchor {
                        None
                    } else {
                        Some(anchor.unwrap_or_else(|| moeforge::bench_moe::DEFAULT_ANCHOR.into()))
                    },
                    settings: settings.runtime.clone(),
                    static_scales,
                };
                let report = moeforge::bench_moe::run(&opts)?;
                write!(out, "{report}").map_err(io)?;
                return Ok(());
            }
            if eplb {
                if !gpu {
                    return Err(moeforge::Error::Usage(
                        "the EPLB benchmark runs on the GPU: pass --gpu".into(),
                    ));
                }
                write!(
                    out,
                    "{}",
                    moeforge::bench_eplb::run(
                        reps,
                        settings.runtime.nccl_path.as_deref(),
                        &mut |l: &str| {
                            use std::io::Write as _;
                            let _ = writeln!(std::io::stderr(), "[eplb] {l}");
                        }
                    )?
                )
                .map_err(io)?;
                return Ok(());
            }
            if gemm {
                if !gpu || host {
                    return Err(moeforge::Error::Usage(
                        "the GEMM benchmark runs on the GPU: pass --gpu (and not --host)".into(),
                    ));
                }
                let selection = moeforge::bench_gemm::Selection::parse(
                    model.as_deref(),
                    tokens.as_deref(),
                    recipe.as_deref(),
                )?;
                // The JSON report's default place: the device run's output folder, when there is one.
                let json = json.or_else(|| {
                    std::env::var_os("OUT")
                        .filter(|o| !o.is_empty())
                        .map(|o| std::path::PathBuf::from(o).join("bench_gemm.json"))
                });
                let opts = moeforge::bench_gemm::Options {
                    selection,
                    anchor: if no_anchor {
                        moeforge::bench_gemm::Anchor::Off
                    } else {
                        moeforge::bench_gemm::Anchor::Script(
                            anchor.unwrap_or_else(|| moeforge::bench_gemm::DEFAULT_ANCHOR.into()),
                        )
                    },
                    json,
                    runtime: settings.runtime.clone(),
                };
                let (report, ok) = moeforge::bench_gemm::run(&opts)?;
                write!(out, "{report}").map_err(io)?;
                if !ok {
                    return Err(moeforge::Error::Usage(
                        "GEMM benchmark: some cases failed (see FAILED above)".into(),
                    ));
                }
                return Ok(());
            }
            if layouts {
                if host {
                    let report = moeforge::bench_layouts::host(threads, 3, &settings.host)?;
                    write!(out, "{report}").map_err(io)?;
                }
                if gpu {
                    let report = moeforge::bench_layouts::gpu(reps, &settings.runtime)?;
                    write!(out, "{report}").map_err(io)?;
                }
                return Ok(());
            }
            if host {
                let report =
                    moeforge::bench::host_report(threads, recipe.as_deref(), &settings.host)?;
                write!(out, "{report}").map_err(io)?;
            }
            if gpu {
                let report =
                    moeforge::gpu::bench(recipe.as_deref(), pack_only, jit_only, reps, &settings)?;
                write!(out, "{report}").map_err(io)?;
            }
        }
        Command::Selftest {
            gpu,
            quick,
            nccl,
            gemm,
            moe,
            kernels,
            only,
        } => {
            if !gpu {
                return Err(moeforge::Error::Usage("nothing to run: pass --gpu".into()));
            }
            let (report, ok) = if gemm || kernels {
                let (g, gok) = if gemm {
                    moeforge::gemm_check::selftest(quick, &settings.runtime.jit, only.as_deref())?
                } else {
                    (String::new(), None)
                };
                if only.is_some() {
                    (g, gok)
                } else {
                    let (a, aok) = moeforge::act_quant_check::selftest()?;
                    let (pm, pok) = moeforge::permute_check::selftest()?;
                    let (mk, mok) = moeforge::moe_kernels_check::selftest()?;
                    let both = moeforge::act_quant_check::both;
                    (g + &a + &pm + &mk, both(both(both(gok, aok), pok), mok))
                }
            } else if moe {
                moeforge::moe_gpu_check::selftest(quick, &settings)?
            } else if nccl {
                // NVLink multicast (NVLS) stays off unless the caller turned it on: NCCL reads this
                // when a communicator is made, so it is set here, in the CLI only, before any NCCL
                // call and while this process has no other thread.
                writeln!(out, "{}", nvls_off_unless_set()).map_err(io)?;
                moeforge::gpu::nccl_selftest(&settings)?
            } else {
                moeforge::gpu::selftest(quick, &settings)?
            };
            write!(out, "{report}").map_err(io)?;
            if ok == Some(false) {
                return Err(moeforge::Error::Usage("GPU self-test failed".into()));
            }
        }
        Command::Cache { action } => cache_cmd(action, &settings, out)?,
        Command::Eplb {
            action:
                EplbAction::Apply {
                    packed,
                    placement,
                    output,
                    rank,
                    ranks,
                    recipe,
                },
        } => {
            let recipe = match recipe {
                Some(f) => Some(read_recipe(&f)?),
                None => None,
            };
            let opts = moeforge::eplb_apply::ApplyOptions {
                input: packed,
                placement,
                output: output.clone(),
                rank: rank.zip(ranks),
                recipe,
            };
            let r = moeforge::eplb_apply::apply(&opts)?;
            writeln!(
                out,
                "placed {} layer(s) of recipe `{}`: {} logical experts on {} slots{}, {} param(s) written, {} other tensor(s) passed through; wrote {} ({:.1} MB)",
                r.layers.len(),
                r.recipe,
                r.experts,
                r.slots,
                match opts.rank {
                    Some((k, p)) => format!(" (rank {k} of {p}: {} slots)", r.written_slots),
                    None => String::new(),
                },
                r.params,
                r.passed,
                output.display(),
                r.output_bytes as f64 / 1e6
            )
            .map_err(io)?;
        }
        Command::Eplb {
            action:
                EplbAction::Plan {
                    loads,
                    replicas,
                    groups,
                    nodes,
                    gpus,
                    json,
                },
        } => {
            let text = moeforge::read_capped(&loads, moeforge::MANIFEST_LIMIT)?;
            let w: Vec<Vec<f32>> = serde_json::from_str(&text).map_err(|e| {
                moeforge::Error::Usage(format!(
                    "{}: expected a list of per-layer lists of loads ({e})",
                    loads.display()
                ))
            })?;
            let p = moeforge::runtime::eplb::rebalance_experts(&w, replicas, groups, nodes, gpus)
                .map_err(|e| moeforge::Error::Usage(format!("eplb plan: {e}")))?;
            if json {
                let v = serde_json::json!({
                    "phy2log": p.phy2log,
                    "log2phy": p.log2phy,
                    "logcnt": p.logcnt,
                });
                writeln!(out, "{v}").map_err(io)?;
            } else {
                let e = w.first().map(Vec::len).unwrap_or(0);
                writeln!(
                    out,
                    "{} layer(s), {e} experts on {replicas} slots, {gpus} GPUs; balancedness = mean / max GPU load",
                    w.len()
                )
                .map_err(io)?;
                for (l, row) in w.iter().enumerate() {
                    // Before: each expert once, E/P consecutive experts per GPU (where P divides E).
                    let before = if e.is_multiple_of(gpus) {
                        let ident: Vec<usize> = (0..e).collect();
                        format!(
                            "{:.3}",
                            moeforge::runtime::eplb::balancedness(row, &ident, &vec![1; e], gpus)
                        )
                    } else {
                        "-".into()
                    };
                    let after = moeforge::runtime::eplb::balancedness(
                        row,
                        &p.phy2log[l],
                        &p.logcnt[l],
                        gpus,
                    );
                    writeln!(
                        out,
                        "layer {l}: balancedness {before} -> {after:.3}; phy2log {:?}",
                        p.phy2log[l]
                    )
                    .map_err(io)?;
                }
            }
        }
        Command::Moe {
            action:
                MoeAction::Run {
                    packed,
                    inputs,
                    output,
                    layer,
                    device,
                    placement,
                    dump_intermediates,
                    recipe,
                    threads,
                },
        } => {
            let recipe = match recipe {
                Some(f) => Some(read_recipe(&f)?),
                None => None,
            };
            let opts = moeforge::moe_run::RunOptions {
                packed,
                inputs,
                output: output.clone(),
                layer,
                device: device.parse()?,
                placement,
                dump_intermediates,
                recipe,
                threads,
                settings: settings.runtime.clone(),
            };
            let r = moeforge::moe_run::run(&opts)?;
            writeln!(
                out,
                "ran layer {} of recipe `{}` on the {}: {} token(s), top-{}, {} logical experts on {} slots, activations w13: {}, w2: {}; wrote {} ({:.1} kB)",
                r.layer,
                r.recipe,
                if r.device == moeforge::moe_run::Device::Gpu { "GPU" } else { "host" },
                r.tokens,
                r.top_k,
                r.experts,
                r.slots,
                r.activation.0,
                r.activation.1,
                output.display(),
                r.output_bytes as f64 / 1e3
            )
            .map_err(io)?;
        }
        Command::Demo { experts } => {
            let report = moeforge::demo::run(experts, &settings)?;
            write!(out, "{report}").map_err(io)?;
        }
        Command::Plot { report, output } => {
            let said = moeforge::plot::plot_report(&report, &output)?;
            write!(out, "{said}").map_err(io)?;
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

/// Set `NCCL_NVLS_ENABLE=0` (NVLink multicast off) unless the environment sets it; the line that
/// says which. NCCL reads it when a communicator is made, so this runs before any NCCL call, in the
/// CLI only, while the process has no other thread.
fn nvls_off_unless_set() -> String {
    match std::env::var_os("NCCL_NVLS_ENABLE") {
        Some(v) => format!(
            "NCCL_NVLS_ENABLE={} (from the environment)",
            v.to_string_lossy()
        ),
        None => {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
            "NCCL_NVLS_ENABLE=0 (set by moeforge: it was unset)".to_string()
        }
    }
}
