//! The content-addressed kernel cache: an in-memory map over an on-disk store.
//!
//! A PTX entry's key hashes (BLAKE3) the normalized kernel IR of the program, the target, the options,
//! the moeforge version and a fingerprint of the code generator's sources
//! ([`moeforge_codegen::FINGERPRINT`]); a cubin entry's key adds the compiler: the driver version for
//! the driver's JIT linker, the release of ptxas where that compiles ([`crate::JitOptions`]). Never
//! paths or mtimes. Disk entries live in `kernels/` under the folder the cache is given
//! ([`crate::Settings::cache_dir`]; the `moeforge` command's: `$MOEFORGE_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/moeforge`, else `~/.cache/moeforge`). Each file is a header line, the BLAKE3 checksum of the payload
//! and the payload; it is written to a temporary file and renamed into place, so readers never see half
//! an entry and two processes compiling the same key both succeed (the last rename wins, with identical
//! bytes). A corrupt or truncated entry fails its checksum, is recompiled and replaced, never trusted.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::{Error, Result};

const MAGIC: &[u8] = b"MOEFORGE-KERNEL-CACHE 1\n";

/// Where a cached artifact came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hit {
    /// The in-memory map.
    Memory,
    /// The on-disk store (checksum verified).
    Disk,
    /// Not cached: compiled now.
    Compiled,
    /// A disk entry failed its checksum and was recompiled and replaced.
    Recompiled,
}

/// One stored entry.
#[derive(Debug, Clone)]
pub struct EntryInfo {
    /// `ptx` or `cubin`.
    pub kind: String,
    /// The key (hex).
    pub key: String,
    /// File size in bytes.
    pub bytes: u64,
    /// Whether its checksum verifies.
    pub valid: bool,
}

/// The kernel cache.
pub struct Cache {
    dir: Option<PathBuf>,
    mem: Mutex<HashMap<String, Arc<Vec<u8>>>>,
}

impl Cache {
    /// A cache over a folder, its entries in `{dir}/kernels` (`None`: in memory only).
    pub fn new(dir: Option<PathBuf>) -> Cache {
        Cache {
            dir: dir.map(|d| d.join("kernels")),
            mem: Mutex::new(HashMap::new()),
        }
    }

    /// The folder entries are stored in.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The key of a program's PTX for a target.
    pub fn ptx_key(prog: &moeforge_codegen::kir::Program, target: &str, options: &str) -> String {
        let mut h = blake3::Hasher::new();
        for part in [
            "moeforge-ptx",
            env!("CARGO_PKG_VERSION"),
            moeforge_codegen::FINGERPRINT,
            target,
            options,
        ] {
            h.update(part.as_bytes());
            h.update(&[0]);
        }
        h.update(prog.to_string().as_bytes());
        h.finalize().to_hex().to_string()
    }

    /// The key of the cubin compiled from a PTX entry by a compiler (`compiler` is
    /// [`crate::jit::Compiler::key_part`]: the driver version for the driver's JIT linker, the
    /// release for ptxas).
    pub fn cubin_key(ptx_key: &str, compiler: &str) -> String {
        let mut h = blake3::Hasher::new();
        h.update(b"moeforge-cubin\0");
        h.update(compiler.as_bytes());
        h.update(&[0]);
        h.update(ptx_key.as_bytes());
        h.finalize().to_hex().to_string()
    }

    fn path(&self, kind: &str, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.{kind}")))
    }

    fn read(path: &Path) -> Option<Vec<u8>> {
        let data = std::fs::read(path).ok()?;
        parse(&data)
    }

    fn write(&self, path: &Path, payload: &[u8]) -> Result<()> {
        let sum = blake3::hash(payload).to_hex();
        write_atomic(path, &[MAGIC, sum.as_bytes(), b"\n", payload], false)
    }

    /// The artifact of `kind` under `key`: from memory, from disk (checksum verified), or made by
    /// `make` and stored in both.
    pub fn get_or_insert(
        &self,
        kind: &str,
        key: &str,
        make: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Arc<Vec<u8>>, Hit)> {
        let mkey = format!("{kind}:{key}");
        if let Some(v) = self.mem.lock().ok().and_then(|m| m.get(&mkey).cloned()) {
            return Ok((v, Hit::Memory));
        }
        let path = self.path(kind, key);
        let mut hit = Hit::Compiled;
        if let Some(p) = &path {
            if p.exists() {
                match Self::read(p) {
                    Some(v) => {
                        let v = Arc::new(v);
                        if let Ok(mut m) = self.mem.lock() {
                            m.insert(mkey, v.clone());
                        }
                        return Ok((v, Hit::Disk));
                    }
                    None => hit = Hit::Recompiled,
                }
            }
        }
        let v = Arc::new(make()?);
        if let Some(p) = &path {
            self.write(p, &v)?;
        }
        if let Ok(mut m) = self.mem.lock() {
            m.insert(mkey, v.clone());
        }
        Ok((v, hit))
    }

    /// Forget the in-memory map (the disk store stays).
    pub fn forget_memory(&self) {
        if let Ok(mut m) = self.mem.lock() {
            m.clear();
        }
    }

    /// Every entry on disk.
    pub fn entries(&self) -> Result<Vec<EntryInfo>> {
        let Some(dir) = &self.dir else {
            return Ok(Vec::new());
        };
        let rd = dir_files(dir)?;
        let mut out = Vec::new();
        for e in rd {
            let p = e.path();
            let (Some(stem), Some(ext)) = (p.file_stem(), p.extension()) else {
                continue;
            };
            let (ext, stem) = (
                ext.to_string_lossy().into_owned(),
                stem.to_string_lossy().into_owned(),
            );
            if ext != "ptx" && ext != "cubin" {
                continue;
            }
            out.push(EntryInfo {
                kind: ext,
                key: stem,
                bytes: e.metadata().map(|m| m.len()).unwrap_or(0),
                valid: Self::read(&p).is_some(),
            });
        }
        out.sort_by(|a, b| (&a.kind, &a.key).cmp(&(&b.kind, &b.key)));
        Ok(out)
    }

    /// Remove every entry; returns how many files were removed.
    pub fn clear(&self) -> Result<usize> {
        self.forget_memory();
        let mut n = 0;
        for e in self.entries()? {
            if let Some(p) = self.path(&e.kind, &e.key) {
                let removed = if p.symlink_metadata().is_ok_and(|m| m.is_dir()) {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
                removed.map_err(|err| Error::Cache {
                    path: p.display().to_string(),
                    source: err,
                })?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// Write `chunks` to `path` atomically: a temporary file in the same folder (removed if anything
/// fails), flushed to disk first where `sync`, then renamed over `path`. Something that is not a
/// file at `path` (a directory left by anything) is removed first; the folder is created.
pub(crate) fn write_atomic(path: &Path, chunks: &[&[u8]], sync: bool) -> Result<()> {
    let io = |e: std::io::Error| Error::Cache {
        path: path.display().to_string(),
        source: e,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
    for c in chunks {
        tmp.write_all(c).map_err(io)?;
    }
    if sync {
        tmp.as_file().sync_all().map_err(io)?;
    }
    if path.symlink_metadata().is_ok_and(|m| m.is_dir()) {
        std::fs::remove_dir_all(path).map_err(io)?;
    }
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}

/// The entries directly in `dir`; none when it does not exist.
pub(crate) fn dir_files(dir: &Path) -> Result<Vec<std::fs::DirEntry>> {
    match std::fs::read_dir(dir) {
        Ok(r) => Ok(r.flatten().collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::Cache {
            path: dir.display().to_string(),
            source: e,
        }),
    }
}

/// Parse a stored entry: the header, a checksum line and a payload that matches it.
fn parse(data: &[u8]) -> Option<Vec<u8>> {
    let rest = data.strip_prefix(MAGIC)?;
    if rest.len() < 65 || rest[64] != b'\n' {
        return None;
    }
    let (sum, payload) = (&rest[..64], &rest[65..]);
    (blake3::hash(payload).to_hex().as_bytes() == sum).then(|| payload.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrupt_and_truncated_entries_are_recompiled_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::new(Some(dir.path().to_path_buf()));
        let (v, hit) = c
            .get_or_insert("ptx", "k1", || Ok(b"payload one".to_vec()))
            .unwrap();
        assert_eq!((v.as_slice(), hit), (&b"payload one"[..], Hit::Compiled));
        let (_, hit) = c.get_or_insert("ptx", "k1", || unreachable!()).unwrap();
        assert_eq!(hit, Hit::Memory);
        // A new process: disk hit.
        let c2 = Cache::new(Some(dir.path().to_path_buf()));
        let (v, hit) = c2.get_or_insert("ptx", "k1", || unreachable!()).unwrap();
        assert_eq!((v.as_slice(), hit), (&b"payload one"[..], Hit::Disk));
        // Flip one payload byte: recompiled, and the replacement is valid.
        let p = dir.path().join("kernels/k1.ptx");
        let mut bytes = std::fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let c3 = Cache::new(Some(dir.path().to_path_buf()));
        let (v, hit) = c3
            .get_or_insert("ptx", "k1", || Ok(b"payload one".to_vec()))
            .unwrap();
        assert_eq!((v.as_slice(), hit), (&b"payload one"[..], Hit::Recompiled));
        assert!(c3.entries().unwrap().iter().all(|e| e.valid));
        // Truncate: recompiled too.
        std::fs::write(&p, &bytes[..10]).unwrap();
        let c4 = Cache::new(Some(dir.path().to_path_buf()));
        let (_, hit) = c4
            .get_or_insert("ptx", "k1", || Ok(b"payload one".to_vec()))
            .unwrap();
        assert_eq!(hit, Hit::Recompiled);
        assert_eq!(c4.clear().unwrap(), 1);
        assert!(c4.entries().unwrap().is_empty());
    }

    #[test]
    fn a_directory_at_an_entry_path_is_replaced_or_removed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let cache = Cache::new(Some(dir.path().to_path_buf()));
        let Some(p) = cache.path("ptx", "k") else {
            panic!("cache path")
        };
        std::fs::create_dir_all(p.join("junk")).unwrap_or_else(|e| panic!("{e}"));
        let got = cache.get_or_insert("ptx", "k", || Ok(b"x".to_vec()));
        assert_eq!(got.ok().map(|x| x.0.to_vec()), Some(b"x".to_vec()));
        assert!(p.is_file());
        std::fs::remove_file(&p).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(p.join("junk")).unwrap_or_else(|e| panic!("{e}"));
        assert!(cache.clear().is_ok());
        assert!(!p.exists());
    }

    #[test]
    fn concurrent_writers_of_one_key_both_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let p = path.clone();
                std::thread::spawn(move || {
                    let c = Cache::new(Some(p));
                    c.get_or_insert("cubin", "same", || Ok(vec![7u8; 1 << 16]))
                        .map(|(v, _)| v.len())
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), 1 << 16);
        }
        let c = Cache::new(Some(path));
        let e = c.entries().unwrap();
        assert_eq!(e.len(), 1);
        assert!(e[0].valid);
    }
}
