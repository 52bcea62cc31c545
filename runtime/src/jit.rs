//! PTX -> cubin through the driver's JIT linker (`cuLinkCreate` / `cuLinkAddData` / `cuLinkComplete`),
//! keeping the info and error logs so that a failure says why; or, where asked for
//! (`MOEFORGE_JIT=ptxas|auto`), through a `ptxas` found on the machine.

use std::ffi::{c_void, CString};
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
    /// The compiler `MOEFORGE_JIT` asks for: `driver` (the default), `ptxas` (an error when none is
    /// found or it does not run) or `auto` (ptxas when one is found, else the driver).
    pub fn from_env() -> Result<Compiler> {
        // Asked once per process (finding ptxas runs it for its version).
        static CHOSEN: std::sync::OnceLock<Result<Compiler, String>> = std::sync::OnceLock::new();
        CHOSEN
            .get_or_init(|| {
                Compiler::choose().map_err(|e| match e {
                    Error::Compiler(m) => m,
                    other => other.to_string(),
                })
            })
            .clone()
            .map_err(Error::Compiler)
    }

    fn choose() -> Result<Compiler> {
        let want = std::env::var("MOEFORGE_JIT").unwrap_or_default();
        Compiler::choose_from(&want, find_ptxas())
    }

    /// The compiler for a `MOEFORGE_JIT` value, given the ptxas found (if any).
    pub fn choose_from(want: &str, found: Option<PathBuf>) -> Result<Compiler> {
        match want {
            "" | "driver" => Ok(Compiler::Driver),
            "ptxas" => match found {
                Some(p) => Compiler::ptxas(&p),
                None => Err(Error::Compiler(
                    "MOEFORGE_JIT=ptxas, but no ptxas was found (looked at MOEFORGE_PTXAS, PATH, \
                     $CUDA_HOME/bin, /usr/local/cuda/bin)"
                        .into(),
                )),
            },
            // A ptxas too old for the PTX moeforge writes (or broken) leaves the driver's JIT.
            "auto" => Ok(found
                .and_then(|p| Compiler::ptxas(&p).ok())
                .filter(|c| match c {
                    Compiler::Ptxas { path, .. } => {
                        ptxas_compile(path, "sm_90a", "probe", &probe()).is_ok()
                    }
                    Compiler::Driver => true,
                })
                .unwrap_or(Compiler::Driver)),
            other => Err(Error::Compiler(format!(
                "MOEFORGE_JIT=`{other}`: expected driver, ptxas or auto"
            ))),
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

/// A `ptxas` on this machine: `MOEFORGE_PTXAS`, else the first on `PATH`, else `$CUDA_HOME/bin` or
/// `/usr/local/cuda/bin`.
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOEFORGE_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(h).join("bin"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/bin"));
    dirs.into_iter()
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

    const PTX: &str = ".version 8.6\n.target sm_90a\n.address_size 64\n\
        .visible .entry k(.param .u64 p)\n{\n.reg .b64 %rd<2>;\n.reg .b32 %r<2>;\n\
        ld.param.u64 %rd1, [p];\nmov.u32 %r1, 7;\nst.global.u32 [%rd1], %r1;\nret;\n}\n";

    /// ptxas from `MOEFORGE_PTXAS` (scripts/test installs one); `None` skips, saying so, unless
    /// `MOEFORGE_REQUIRE_PTXAS` is set.
    fn ptxas() -> Option<Compiler> {
        let found = std::env::var_os("MOEFORGE_PTXAS").map(PathBuf::from);
        match found.map(|p| Compiler::ptxas(&p)) {
            Some(Ok(c)) => Some(c),
            other => {
                assert!(
                    std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
                    "MOEFORGE_REQUIRE_PTXAS is set but ptxas is unusable: {other:?}"
                );
                eprintln!("skipped: no ptxas (set MOEFORGE_PTXAS; scripts/test does)");
                None
            }
        }
    }

    #[test]
    fn ptxas_compiles_ptx_to_a_cubin_and_reports_errors_with_its_log() {
        let Some(c) = ptxas() else { return };
        let Compiler::Ptxas { path, version } = &c else {
            unreachable!()
        };
        assert!(version.contains("release"), "{version}");
        assert!(c.key_part(13000).starts_with("ptxas "));
        let (cubin, _) = ptxas_compile(path, "sm_90a", "k", PTX).unwrap();
        assert_eq!(&cubin[..4], b"\x7fELF");
        let bad = PTX.replace("mov.u32", "mov.u32.bogus");
        match ptxas_compile(path, "sm_90a", "k", &bad) {
            Err(Error::Jit { code, log, .. }) => {
                assert!(code.starts_with("ptxas exit"), "{code}");
                assert!(log.contains("bogus") || log.contains("error"), "{log}");
            }
            other => panic!("expected a ptxas error, got {other:?}"),
        }
    }

    #[test]
    fn the_choice_follows_moeforge_jit() {
        assert_eq!(Compiler::choose_from("", None).unwrap(), Compiler::Driver);
        assert_eq!(
            Compiler::choose_from("driver", None).unwrap(),
            Compiler::Driver
        );
        // auto: no ptxas, or one that does not run or rejects the probe, is the driver.
        assert_eq!(
            Compiler::choose_from("auto", None).unwrap(),
            Compiler::Driver
        );
        let not_ptxas = Some(PathBuf::from("/bin/true"));
        assert_eq!(
            Compiler::choose_from("auto", not_ptxas).unwrap(),
            Compiler::Driver
        );
        assert!(Compiler::choose_from("ptxas", None).is_err());
        let err = Compiler::choose_from("nvcc", None).unwrap_err().to_string();
        assert!(err.contains("MOEFORGE_JIT=`nvcc`"), "{err}");
        if let Some(Compiler::Ptxas { path, .. }) = ptxas() {
            let c = Compiler::choose_from("auto", Some(path.clone())).unwrap();
            assert!(matches!(c, Compiler::Ptxas { .. }), "{c:?}");
            assert_eq!(Compiler::choose_from("ptxas", Some(path)).unwrap(), c);
        }
    }

    #[test]
    fn a_missing_ptxas_is_a_clear_error() {
        let err = Compiler::ptxas(Path::new("/nonexistent/ptxas")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ptxas"), "{err}");
    }
}
