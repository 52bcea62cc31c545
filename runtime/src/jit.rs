//! PTX -> cubin through the driver's JIT linker (`cuLinkCreate` / `cuLinkAddData` / `cuLinkComplete`),
//! keeping the info and error logs so that a failure says why; or, where [`JitOptions`] ask for it
//! (the CLI's `MOEFORGE_JIT=ptxas|auto`), through a `ptxas` found on the machine.

use std::ffi::{c_void, CString, OsStr};
use std::path::{Path, PathBuf};
use std::process::Command;

use cudarc::driver::sys::{self, CUjitInputType, CUjit_option, CUresult};

use crate::{Device, Error, Result};

const LOG: usize = 1 << 16;

/// Compile PTX text to a cubin for the device's architecture. The device's context must be current
/// (it is made current here).
pub fn link_ptx(dev: &Device, name: &str, ptx: &str) -> Result<(Vec<u8>, String)> {
    dev.ctx
        .bind_to_thread()
        .map_err(crate::drv("cuCtxSetCurrent"))?;
    let mut info = vec![0u8; LOG];
    let mut error = vec![0u8; LOG];
    let mut opts = [
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_LOG_VERBOSE,
    ];
    // Integer-valued options travel in the pointer-sized slot, as the driver API defines.
    let mut vals: [*mut c_void; 5] = [
        info.as_mut_ptr() as *mut c_void,
        std::ptr::without_provenance_mut(LOG),
        error.as_mut_ptr() as *mut c_void,
        std::ptr::without_provenance_mut(LOG),
        std::ptr::without_provenance_mut(1),
    ];
    let src = CString::new(ptx).map_err(|_| Error::Jit {
        name: name.into(),
        code: "invalid".into(),
        log: "the PTX contains a NUL byte".into(),
    })?;
    let cname = CString::new(name).unwrap_or_default();
    let mut state: sys::CUlinkState = std::ptr::null_mut();
    let log_text = |b: &[u8]| {
        String::from_utf8_lossy(&b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())])
            .into_owned()
    };
    // SAFETY: `opts` and `vals` have the same length (5) and live until `cuLinkDestroy`; the log
    // buffers are LOG bytes long as their size options say; `state` is a valid out-pointer.
    let r = unsafe {
        sys::cuLinkCreate_v2(
            opts.len() as u32,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
            &mut state,
        )
    };
    if r != CUresult::CUDA_SUCCESS {
        return Err(Error::Driver {
            call: "cuLinkCreate",
            detail: format!("{r:?}"),
        });
    }
    let result = (|| {
        // SAFETY: `state` was created above; `src` is a NUL-terminated PTX string whose size includes
        // the terminator, as the driver expects for PTX input; no per-input options are passed.
        let r = unsafe {
            sys::cuLinkAddData_v2(
                state,
                CUjitInputType::CU_JIT_INPUT_PTX,
                src.as_ptr() as *mut c_void,
                src.as_bytes_with_nul().len(),
                cname.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Jit {
                name: name.into(),
                code: format!("{r:?}"),
                log: format!("{}{}", log_text(&error), log_text(&info)),
            });
        }
        let mut cubin: *mut c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: `state` holds the added PTX; the out-pointers are valid locals. The returned image is
        // owned by `state` and copied below before `cuLinkDestroy`.
        let r = unsafe { sys::cuLinkComplete(state, &mut cubin, &mut size) };
        if r != CUresult::CUDA_SUCCESS || cubin.is_null() {
            return Err(Error::Jit {
                name: name.into(),
                code: format!("{r:?}"),
                log: format!("{}{}", log_text(&error), log_text(&info)),
            });
        }
        // SAFETY: the driver returned `size` readable bytes at `cubin`, valid until `cuLinkDestroy`.
        let bytes = unsafe { std::slice::from_raw_parts(cubin as *const u8, size) }.to_vec();
        Ok((bytes, log_text(&info)))
    })();
    // SAFETY: `state` was created by `cuLinkCreate` and is destroyed exactly once, after its image was
    // copied out.
    unsafe { sys::cuLinkDestroy(state) };
    result
}

/// JIT `ptx` with the driver's linker ([`link_ptx`]; `name` labels it) and load the module on
/// `dev`'s context: what every loader of a kernel outside the cache does.
pub(crate) fn load_ptx(
    dev: &Device,
    name: &str,
    ptx: &str,
) -> Result<std::sync::Arc<cudarc::driver::CudaModule>> {
    let (cubin, _log) = link_ptx(dev, name, ptx)?;
    dev.ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
        .map_err(crate::drv("cuModuleLoadData"))
}

/// [`load_ptx`] (labelled with the first name), then the entries `names` of the module, in order.
pub(crate) fn load_entries<const N: usize>(
    dev: &Device,
    ptx: &str,
    names: [&str; N],
) -> Result<(
    std::sync::Arc<cudarc::driver::CudaModule>,
    [cudarc::driver::CudaFunction; N],
)> {
    let module = load_ptx(dev, names.first().copied().unwrap_or("module"), ptx)?;
    let mut fns = Vec::with_capacity(N);
    for n in names {
        fns.push(
            module
                .load_function(n)
                .map_err(crate::drv("cuModuleGetFunction"))?,
        );
    }
    let fns: [cudarc::driver::CudaFunction; N] = fns
        .try_into()
        .map_err(|_| Error::Placement("module entries: a count mismatch".into()))?;
    Ok((module, fns))
}

/// Which compiler turns PTX into cubins, as asked for (the CLI's `MOEFORGE_JIT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CompilerChoice {
    /// The driver's JIT linker, never ptxas (`driver`).
    Driver,
    /// A ptxas on this machine; an error when none is found or it does not run (`ptxas`).
    Ptxas,
    /// A ptxas when one is found and it assembles a probe kernel of moeforge's PTX version, the
    /// driver's JIT linker otherwise (`auto`, the default: ptxas 13.0 gives the warp-specialized
    /// GEMMs' consumers the registers `setmaxnreg` raises them to, which the driver's JIT does
    /// not, and on an H200 they ran 2-7% faster compiled by it: BENCHMARKS.md).
    #[default]
    Auto,
}

impl CompilerChoice {
    /// The choice named `driver`, `ptxas` or `auto`; the empty name is the default (`auto`).
    pub fn from_name(name: &str) -> Option<CompilerChoice> {
        match name {
            "driver" => Some(CompilerChoice::Driver),
            "ptxas" => Some(CompilerChoice::Ptxas),
            "" | "auto" => Some(CompilerChoice::Auto),
            _ => None,
        }
    }

    /// The choice's name.
    pub fn name(self) -> &'static str {
        match self {
            CompilerChoice::Driver => "driver",
            CompilerChoice::Ptxas => "ptxas",
            CompilerChoice::Auto => "auto",
        }
    }
}

/// Options of the JIT: which compiler, and where a ptxas is looked for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JitOptions {
    /// The compiler asked for.
    pub compiler: CompilerChoice,
    /// The ptxas to use, when given (the CLI's `MOEFORGE_PTXAS`); the folders are not searched then.
    pub ptxas: Option<PathBuf>,
    /// Folders searched in order for a `ptxas` when none is given ([`JitOptions::standard_dirs`]
    /// makes the usual list).
    pub search_dirs: Vec<PathBuf>,
}

impl Default for JitOptions {
    /// `auto`: a ptxas found in `/usr/local/cuda/bin` (the only folder searched), else the
    /// driver's JIT.
    fn default() -> Self {
        JitOptions {
            compiler: CompilerChoice::Auto,
            ptxas: None,
            search_dirs: JitOptions::standard_dirs(None, None),
        }
    }
}

impl JitOptions {
    /// Where ptxas is looked for: the entries of a `PATH`-style list, then `{cuda_home}/bin`, then
    /// `/usr/local/cuda/bin`.
    pub fn standard_dirs(path: Option<&OsStr>, cuda_home: Option<&Path>) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = path
            .map(|p| std::env::split_paths(p).collect())
            .unwrap_or_default();
        if let Some(h) = cuda_home {
            dirs.push(h.join("bin"));
        }
        dirs.push(PathBuf::from("/usr/local/cuda/bin"));
        dirs
    }
}

/// What turns PTX into cubins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compiler {
    /// The driver's JIT linker (`cuLink*`): always there with a GPU, no files.
    Driver,
    /// A `ptxas` on this machine: the same cubin whatever the driver, so its cache entries do not
    /// depend on the driver version (they can be filled on a machine without a GPU).
    Ptxas {
        /// The executable.
        path: PathBuf,
        /// Its `--version` release line (part of every cubin key it makes).
        version: String,
    },
}

impl Compiler {
    /// The compiler `opts` ask for: the driver's JIT, a ptxas found as `opts` say (an error when
    /// none is found or it does not run), or, for `auto`, ptxas when one is found and takes
    /// moeforge's PTX, else the driver. Resolved once per process for each distinct `opts`
    /// (finding ptxas runs it).
    pub fn resolve(opts: &JitOptions) -> Result<Compiler> {
        type Resolved = std::collections::HashMap<JitOptions, Result<Compiler, String>>;
        static RESOLVED: std::sync::OnceLock<std::sync::Mutex<Resolved>> =
            std::sync::OnceLock::new();
        let memo = RESOLVED.get_or_init(Default::default);
        if let Some(r) = memo.lock().ok().and_then(|m| m.get(opts).cloned()) {
            return r.map_err(Error::Compiler);
        }
        let r = Compiler::choose(opts).map_err(|e| match e {
            Error::Compiler(m) => m,
            other => other.to_string(),
        });
        if let Ok(mut m) = memo.lock() {
            m.insert(opts.clone(), r.clone());
        }
        r.map_err(Error::Compiler)
    }

    fn choose(opts: &JitOptions) -> Result<Compiler> {
        let found = match opts.compiler {
            CompilerChoice::Driver => None,
            CompilerChoice::Ptxas | CompilerChoice::Auto => find_ptxas(opts),
        };
        Compiler::choose_from(opts.compiler, found).map_err(|e| match (e, opts.compiler) {
            (Error::Compiler(m), CompilerChoice::Ptxas) if opts.ptxas.is_none() => {
                let dirs: Vec<String> = opts
                    .search_dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect();
                Error::Compiler(format!("{m} (looked in {})", dirs.join(", ")))
            }
            (e, _) => e,
        })
    }

    /// The compiler for a choice, given the ptxas found (if any).
    pub fn choose_from(want: CompilerChoice, found: Option<PathBuf>) -> Result<Compiler> {
        match want {
            CompilerChoice::Driver => Ok(Compiler::Driver),
            CompilerChoice::Ptxas => match found {
                Some(p) => Compiler::ptxas(&p),
                None => Err(Error::Compiler(
                    "ptxas was asked for as the PTX compiler, but none was found".into(),
                )),
            },
            // A ptxas too old for the PTX moeforge writes (or broken) leaves the driver's JIT.
            CompilerChoice::Auto => Ok(found
                .and_then(|p| Compiler::ptxas(&p).ok())
                .filter(|c| match c {
                    Compiler::Ptxas { path, .. } => {
                        ptxas_compile(path, "sm_90a", "probe", &probe()).is_ok()
                    }
                    Compiler::Driver => true,
                })
                .unwrap_or(Compiler::Driver)),
        }
    }

    /// The `ptxas` at `path`, if it runs and reports a version.
    pub fn ptxas(path: &Path) -> Result<Compiler> {
        let out = Command::new(path)
            .arg("--version")
            .output()
            .map_err(|e| Error::Compiler(format!("cannot run {}: {e}", path.display())))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let version = text
            .lines()
            .find(|l| l.contains("release"))
            .map(|l| l.trim().to_string());
        match version {
            Some(version) if out.status.success() => Ok(Compiler::Ptxas {
                path: path.to_path_buf(),
                version,
            }),
            _ => Err(Error::Compiler(format!(
                "{} --version gave no release line:\n{text}{}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            ))),
        }
    }

    /// What the cubin keys take from the compiler: the driver version for the driver's JIT, the
    /// release line for ptxas.
    pub fn key_part(&self, driver_version: i32) -> String {
        match self {
            Compiler::Driver => format!("culink {driver_version}"),
            Compiler::Ptxas { version, .. } => format!("ptxas {version}"),
        }
    }

    /// A short name for reports.
    pub fn describe(&self) -> String {
        match self {
            Compiler::Driver => "the driver's JIT linker".into(),
            Compiler::Ptxas { path, version } => format!("{} ({version})", path.display()),
        }
    }
}

/// The smallest kernel of the PTX version moeforge writes: `auto` uses a ptxas only if it takes it.
fn probe() -> String {
    format!(
        ".version {}\n.target sm_90a\n.address_size 64\n.visible .entry probe()\n{{\nret;\n}}\n",
        moeforge_codegen::ptx::PTX_VERSION
    )
}

/// How long one ptxas run may take before it is stopped and reported.
const PTXAS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// The `ptxas` `opts` give, else the first `ptxas` file in their search folders.
pub fn find_ptxas(opts: &JitOptions) -> Option<PathBuf> {
    if let Some(p) = &opts.ptxas {
        return Some(p.clone());
    }
    opts.search_dirs
        .iter()
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

/// Compile PTX text to a cubin for `arch` (e.g. `sm_90a`) with the ptxas at `ptxas`, in a private
/// temporary folder; the error carries ptxas's messages.
pub fn ptxas_compile(ptxas: &Path, arch: &str, name: &str, ptx: &str) -> Result<(Vec<u8>, String)> {
    let io = |what: &str, e: std::io::Error| Error::Jit {
        name: name.into(),
        code: what.into(),
        log: e.to_string(),
    };
    let dir = tempfile::tempdir().map_err(|e| io("tempdir", e))?;
    let src = dir.path().join("k.ptx");
    let dst = dir.path().join("k.cubin");
    std::fs::write(&src, ptx).map_err(|e| io("write", e))?;
    let log_path = dir.path().join("log");
    let log_file = std::fs::File::create(&log_path).map_err(|e| io("log", e))?;
    let log_err = log_file.try_clone().map_err(|e| io("log", e))?;
    let mut child = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-O3")
        .arg(&src)
        .arg("-o")
        .arg(&dst)
        .stdout(log_file)
        .stderr(log_err)
        .spawn()
        .map_err(|e| io("spawn", e))?;
    let started = std::time::Instant::now();
    let status = loop {
        match child.try_wait().map_err(|e| io("wait", e))? {
            Some(status) => break status,
            None if started.elapsed() > PTXAS_TIMEOUT => {
                // Best effort: the process may have ended meanwhile.
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Jit {
                    name: name.into(),
                    code: "ptxas timeout".into(),
                    log: format!("ptxas ran longer than {} s", PTXAS_TIMEOUT.as_secs()),
                });
            }
            None => std::thread::sleep(std::time::Duration::from_millis(2)),
        }
    };
    let log = String::from_utf8_lossy(&std::fs::read(&log_path).unwrap_or_default()).into_owned();
    if !status.success() {
        return Err(Error::Jit {
            name: name.into(),
            code: format!("ptxas exit {}", status.code().unwrap_or(-1)),
            log,
        });
    }
    let cubin = std::fs::read(&dst).map_err(|e| io("read", e))?;
    Ok((cubin, log))
}

#[cfg(test)]
mod tests {
    use super::*;

    // ptxas itself (compiling, reporting errors, `auto` taking it) is tested in tests/jit.rs, where
    // the test harness says which ptxas to use.

    #[test]
    fn the_choice_follows_the_options() {
        use CompilerChoice::*;
        assert_eq!(
            Compiler::choose_from(Driver, None).unwrap(),
            Compiler::Driver
        );
        // auto: no ptxas, or one that does not run or rejects the probe, is the driver.
        assert_eq!(Compiler::choose_from(Auto, None).unwrap(), Compiler::Driver);
        let not_ptxas = Some(PathBuf::from("/bin/true"));
        assert_eq!(
            Compiler::choose_from(Auto, not_ptxas).unwrap(),
            Compiler::Driver
        );
        assert!(Compiler::choose_from(Ptxas, None).is_err());
        for c in [Driver, Ptxas, Auto] {
            assert_eq!(CompilerChoice::from_name(c.name()), Some(c));
        }
        assert_eq!(CompilerChoice::from_name(""), Some(Auto));
        assert_eq!(CompilerChoice::default(), Auto);
        assert_eq!(CompilerChoice::from_name("nvcc"), None);
    }

    #[test]
    fn ptxas_is_the_one_given_else_the_first_in_the_search_folders() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::write(b.path().join("ptxas"), b"").unwrap();
        let mut opts = JitOptions {
            compiler: CompilerChoice::Ptxas,
            ptxas: None,
            search_dirs: vec![a.path().to_path_buf(), b.path().to_path_buf()],
        };
        assert_eq!(find_ptxas(&opts), Some(b.path().join("ptxas")));
        opts.ptxas = Some(PathBuf::from("/given/ptxas"));
        assert_eq!(find_ptxas(&opts), Some(PathBuf::from("/given/ptxas")));
        // Nothing found: the error names the folders searched.
        opts.ptxas = None;
        opts.search_dirs = vec![a.path().to_path_buf()];
        let err = Compiler::resolve(&opts).unwrap_err().to_string();
        assert!(err.contains(&a.path().display().to_string()), "{err}");
        // The usual folders: PATH's entries, then CUDA_HOME's bin, then /usr/local/cuda/bin.
        let path = std::env::join_paths(["/x/bin", "/y/bin"]).unwrap();
        assert_eq!(
            JitOptions::standard_dirs(Some(&path), Some(Path::new("/cuda"))),
            ["/x/bin", "/y/bin", "/cuda/bin", "/usr/local/cuda/bin"].map(PathBuf::from)
        );
        assert_eq!(
            JitOptions::default().search_dirs,
            [PathBuf::from("/usr/local/cuda/bin")]
        );
    }

    #[test]
    fn a_missing_ptxas_is_a_clear_error() {
        let err = Compiler::ptxas(Path::new("/nonexistent/ptxas")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ptxas"), "{err}");
    }
}
