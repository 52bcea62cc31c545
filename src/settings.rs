//! The command's settings: the one place that reads the environment. The CLI calls
//! [`Settings::from_env`] once and passes the result down; the libraries take the options it holds
//! ([`codegen::host::Options`], [`runtime::Settings`]) and read no environment themselves.
//!
//! | variable | setting |
//! |---|---|
//! | `MOEFORGE_CL_OPT` | Cranelift's optimization level for the host backend (`none`, `speed`, `speed_and_size`) |
//! | `MOEFORGE_DISASM` | folder for each host kernel's machine code |
//! | `MOEFORGE_MAXNREG` | register cap of one-thread-per-item GPU kernels (ignored unless a number) |
//! | `MOEFORGE_INDEX64` | `1`: 64-bit index arithmetic in every GPU kernel |
//! | `MOEFORGE_GPU_MAX_BLOCKS` | grid cap of GPU launches (ignored unless a number) |
//! | `MOEFORGE_JIT` | PTX -> cubin compiler: `auto` (default: ptxas when found, else the driver), `driver`, `ptxas` |
//! | `MOEFORGE_PTXAS` | the ptxas to use; else one is looked for in `PATH`, `$CUDA_HOME/bin`, `/usr/local/cuda/bin` |
//! | `MOEFORGE_CACHE_DIR` | kernel cache folder; else `$XDG_CACHE_HOME/moeforge`, else `$HOME/.cache/moeforge` |
//! | `MOEFORGE_NCCL_SO_PATH` | the NCCL library to try first, before `libnccl.so.2` and `libnccl.so` |
//! | `MOEFORGE_PDL` | `0`: launch the MoE layer's kernels without programmatic dependent launch (on by default on Hopper; read by [`pdl_enabled`] when a command opens its GPU) |
//! | `MOEFORGE_IDLE_SKIP` | `1`: the GEMM tuning (the benchmarks' and the layer's) also times each two-consumer prefill form's twin that skips an idle consumer's MMAs (`codegen::gemm::tune::with_idle_twins`; read by [`idle_skip_enabled`]; off by default until measured faster) |
//! | `CUDA_CACHE_DISABLE` | read by the CUDA driver itself; reported by `bench --gpu` |

use std::ffi::OsString;
use std::path::PathBuf;

use crate::codegen::host::{OptLevel, Options as HostOptions};
use crate::runtime::jit::{CompilerChoice, JitOptions};
use crate::runtime::LaunchOptions;
use crate::{codegen, runtime, Error, Result};

/// Everything the environment sets, as the options the libraries take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    /// The host backend's options.
    pub host: codegen::host::Options,
    /// The GPU runtime's settings (kernel tuning, JIT compiler, kernel cache folder).
    pub runtime: runtime::Settings,
    /// `CUDA_CACHE_DISABLE` as set (empty when not): the CUDA driver reads it itself; the GPU
    /// benchmarks report it.
    pub cuda_cache_disable: String,
}

/// Whether the GPU a command opens may launch the MoE layer's kernels with programmatic dependent
/// launch (`runtime::launch`): unless `MOEFORGE_PDL` is `0`.
pub fn pdl_enabled() -> bool {
    pdl_from(std::env::var_os("MOEFORGE_PDL"))
}

/// Whether the GEMM tuning also times the forms that skip an idle consumer's MMAs: when
/// `MOEFORGE_IDLE_SKIP` is `1`.
pub fn idle_skip_enabled() -> bool {
    idle_skip_from(std::env::var_os("MOEFORGE_IDLE_SKIP"))
}

fn idle_skip_from(v: Option<OsString>) -> bool {
    v.is_some_and(|v| v == "1")
}

fn pdl_from(v: Option<OsString>) -> bool {
    v.is_none_or(|v| v != "0")
}

impl Settings {
    /// The settings of this process's environment.
    pub fn from_env() -> Result<Settings> {
        Settings::from_vars(|name| std::env::var_os(name))
    }

    /// The settings of the environment `var` describes (a variable's value, `None` when unset).
    /// A value that cannot mean anything (`MOEFORGE_JIT=nvcc`) is an error naming the variable.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<Settings> {
        let text = |name: &str| var(name).map(|v| v.to_string_lossy().into_owned());
        let opt_level = match text("MOEFORGE_CL_OPT") {
            None => OptLevel::default(),
            Some(v) => OptLevel::from_name(&v).ok_or_else(|| {
                Error::Setting(format!(
                    "MOEFORGE_CL_OPT=`{v}`: expected none, speed or speed_and_size"
                ))
            })?,
        };
        let compiler = match text("MOEFORGE_JIT") {
            None => CompilerChoice::default(),
            Some(v) => CompilerChoice::from_name(&v).ok_or_else(|| {
                Error::Setting(format!(
                    "MOEFORGE_JIT=`{v}`: expected driver, ptxas or auto"
                ))
            })?,
        };
        let cuda_home = var("CUDA_HOME").map(PathBuf::from);
        let cache_dir = match var("MOEFORGE_CACHE_DIR") {
            Some(d) => Some(PathBuf::from(d)),
            None => match var("XDG_CACHE_HOME") {
                Some(d) => Some(PathBuf::from(d).join("moeforge")),
                None => var("HOME").map(|h| PathBuf::from(h).join(".cache/moeforge")),
            },
        };
        Ok(Settings {
            host: HostOptions {
                opt_level,
                disasm_dir: var("MOEFORGE_DISASM").map(PathBuf::from),
            },
            runtime: runtime::Settings {
                launch: LaunchOptions {
                    maxnreg: text("MOEFORGE_MAXNREG").and_then(|v| v.parse().ok()),
                    wide_index: text("MOEFORGE_INDEX64").is_some_and(|v| v == "1"),
                    max_blocks: text("MOEFORGE_GPU_MAX_BLOCKS").and_then(|v| v.parse().ok()),
                },
                jit: JitOptions {
                    compiler,
                    ptxas: var("MOEFORGE_PTXAS").map(PathBuf::from),
                    search_dirs: JitOptions::standard_dirs(
                        var("PATH").as_deref(),
                        cuda_home.as_deref(),
                    ),
                },
                cache_dir,
                nccl_path: var("MOEFORGE_NCCL_SO_PATH").map(PathBuf::from),
            },
            cuda_cache_disable: text("CUDA_CACHE_DISABLE").unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<Settings> {
        let env: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        Settings::from_vars(|name| env.get(name).cloned())
    }

    #[test]
    fn pdl_is_on_unless_turned_off() {
        assert!(pdl_from(None));
        assert!(pdl_from(Some("1".into())));
        assert!(!pdl_from(Some("0".into())));
    }

    #[test]
    fn the_idle_consumer_forms_are_tuned_only_when_asked_for() {
        assert!(!idle_skip_from(None));
        assert!(idle_skip_from(Some("1".into())));
        assert!(!idle_skip_from(Some("0".into())));
        assert!(!idle_skip_from(Some("yes".into())));
    }

    #[test]
    fn settings_are_read_from_the_given_environment() {
        // Nothing set: the defaults, and no cache folder.
        assert_eq!(from(&[]).unwrap(), Settings::default());
        let s = from(&[
            ("MOEFORGE_CL_OPT", "none"),
            ("MOEFORGE_DISASM", "/tmp/asm"),
            ("MOEFORGE_MAXNREG", "40"),
            ("MOEFORGE_INDEX64", "1"),
            ("MOEFORGE_GPU_MAX_BLOCKS", "264"),
            ("MOEFORGE_JIT", "ptxas"),
            ("MOEFORGE_PTXAS", "/opt/ptxas"),
            ("PATH", "/a/bin:/b/bin"),
            ("CUDA_HOME", "/cuda"),
            ("MOEFORGE_CACHE_DIR", "/c"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/home/u"),
            ("CUDA_CACHE_DISABLE", "1"),
            ("MOEFORGE_NCCL_SO_PATH", "/opt/nccl/libnccl.so.2"),
            ("UNRELATED", "x"),
        ])
        .unwrap();
        let want = Settings {
            host: HostOptions {
                opt_level: OptLevel::None,
                disasm_dir: Some("/tmp/asm".into()),
            },
            runtime: runtime::Settings {
                launch: LaunchOptions {
                    maxnreg: Some(40),
                    wide_index: true,
                    max_blocks: Some(264),
                },
                jit: JitOptions {
                    compiler: CompilerChoice::Ptxas,
                    ptxas: Some("/opt/ptxas".into()),
                    search_dirs: ["/a/bin", "/b/bin", "/cuda/bin", "/usr/local/cuda/bin"]
                        .map(PathBuf::from)
                        .to_vec(),
                },
                cache_dir: Some("/c".into()),
                nccl_path: Some("/opt/nccl/libnccl.so.2".into()),
            },
            cuda_cache_disable: "1".into(),
        };
        assert_eq!(s, want);
    }

    #[test]
    fn the_cache_folder_falls_back_to_xdg_then_home() {
        let dir = |pairs: &[(&str, &str)]| from(pairs).unwrap().runtime.cache_dir;
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/xdg"), ("HOME", "/home/u")]),
            Some(PathBuf::from("/xdg/moeforge"))
        );
        assert_eq!(
            dir(&[("HOME", "/home/u")]),
            Some(PathBuf::from("/home/u/.cache/moeforge"))
        );
    }

    #[test]
    fn lenient_knobs_ignore_what_they_cannot_parse_and_choices_name_the_variable() {
        let s = from(&[
            ("MOEFORGE_MAXNREG", "many"),
            ("MOEFORGE_GPU_MAX_BLOCKS", "-1"),
            ("MOEFORGE_INDEX64", "yes"),
            ("MOEFORGE_JIT", ""),
        ])
        .unwrap();
        assert_eq!(s.runtime.launch, LaunchOptions::default());
        assert_eq!(s.runtime.jit.compiler, CompilerChoice::Auto);
        let err = from(&[("MOEFORGE_JIT", "nvcc")]).unwrap_err().to_string();
        assert!(err.contains("MOEFORGE_JIT=`nvcc`"), "{err}");
        let err = from(&[("MOEFORGE_CL_OPT", "fast")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("MOEFORGE_CL_OPT=`fast`"), "{err}");
    }
}
