//! The grouped GEMM's tuning cache: which variant of the warp-specialized GEMM
//! ([`crate::gemm_ws`]) won for a kernel family, shape and token bucket on a GPU, kept with the
//! kernel cache so that a choice is made once and then reused (the same inputs always run the same
//! variant, so they give the same bits).
//!
//! A [`TuneKey`] names the GPU (its name and driver version), the moeforge version and the code
//! generator's fingerprint, the kernel family (operands, scaling, output type), N, K, the experts
//! and the shape bucket of the rows (`codegen::gemm::tune::bucket`: 500 and 512 rows share one).
//! A [`TuneEntry`] holds the chosen variant (its tag and every [`WsConfig`] field, so that it is
//! rebuilt without tuning again) and every candidate's measured time. Entries are small JSON files,
//! `{cache dir}/tune/{BLAKE3 of the key}.json`, holding the key, the entry and the BLAKE3 checksum
//! of both; they are written to a temporary file and renamed into place, and an entry that fails its
//! checksum, or whose key or variant does not match what is asked, is ignored (tuned again and
//! replaced), never trusted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use moeforge_codegen::gemm::ws::{Epilogue, Operands, OutTy, Scaling, WRows, WsConfig};
use serde_json::{json, Value};

use crate::{Device, Error, Result};

/// The format named in every entry (a change of the layout changes it, so old files are ignored).
pub const FORMAT: &str = "moeforge-gemm-tune 2";

/// What a tuning result is keyed by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TuneKey {
    /// The GPU's name.
    pub gpu: String,
    /// The driver's CUDA version.
    pub driver: i32,
    /// The moeforge version.
    pub version: String,
    /// The code generator's fingerprint ([`moeforge_codegen::FINGERPRINT`]): a generator change
    /// changes the kernels, so their timings are measured again.
    pub codegen: String,
    /// Operand type.
    pub operands: Operands,
    /// Accumulator scaling.
    pub scaling: Scaling,
    /// Output type.
    pub out: OutTy,
    /// What the epilogue stores (the fused SiLU variants are timed apart).
    pub epilogue: Epilogue,
    /// N.
    pub n: u32,
    /// K.
    pub k: u32,
    /// Experts.
    pub experts: u32,
    /// The shape bucket of the rows (`codegen::gemm::tune::bucket`).
    pub bucket: u64,
}

impl TuneKey {
    /// The key of a family and shape on `dev`, with this build's version and generator
    /// fingerprint; `rows` is bucketed (`codegen::gemm::tune::bucket`).
    #[allow(clippy::too_many_arguments)]
    pub fn for_device(
        dev: &Device,
        operands: Operands,
        scaling: Scaling,
        out: OutTy,
        epilogue: Epilogue,
        n: u32,
        k: u32,
        experts: u32,
        rows: usize,
    ) -> TuneKey {
        TuneKey {
            gpu: dev.name.clone(),
            driver: dev.driver_version,
            version: env!("CARGO_PKG_VERSION").to_string(),
            codegen: moeforge_codegen::FINGERPRINT.to_string(),
            operands,
            scaling,
            out,
            epilogue,
            n,
            k,
            experts,
            bucket: moeforge_codegen::gemm::tune::bucket(rows) as u64,
        }
    }

    /// The key as JSON (an object with one member per field; names of the enums as
    /// [`Operands::name`], [`scaling_name`] and [`OutTy::name`] give them).
    pub fn to_json(&self) -> Value {
        json!({
            "gpu": self.gpu,
            "driver": self.driver,
            "version": self.version,
            "codegen": self.codegen,
            "operands": self.operands.name(),
            "scaling": scaling_name(self.scaling),
            "out": self.out.name(),
            "epilogue": self.epilogue.name(),
            "n": self.n,
            "k": self.k,
            "experts": self.experts,
            "bucket": self.bucket,
        })
    }

    /// The canonical encoding of the key: a fixed order of `name=value` lines under [`FORMAT`]
    /// (the GPU name is JSON-quoted, so no name can make two keys encode alike).
    pub fn encode(&self) -> String {
        format!(
            "{FORMAT}\ngpu={}\ndriver={}\nversion={}\ncodegen={}\noperands={}\nscaling={}\nout={}\nepilogue={}\nn={}\nk={}\nexperts={}\nbucket={}\n",
            Value::from(self.gpu.as_str()),
            self.driver,
            Value::from(self.version.as_str()),
            Value::from(self.codegen.as_str()),
            self.operands.name(),
            scaling_name(self.scaling),
            self.out.name(),
            self.epilogue.name(),
            self.n,
            self.k,
            self.experts,
            self.bucket
        )
    }

    /// The BLAKE3 of [`TuneKey::encode`] (hex): the entry's file name.
    pub fn hash(&self) -> String {
        blake3::hash(self.encode().as_bytes()).to_hex().to_string()
    }

    /// A one-line description (for `cache ls`).
    pub fn describe(&self) -> String {
        format!(
            "{} (driver {}, moeforge {}) {}/{}/{}/{} N={} K={} E={} rows<={}",
            self.gpu,
            self.driver,
            self.version,
            self.operands.name(),
            scaling_name(self.scaling),
            self.out.name(),
            self.epilogue.name(),
            self.n,
            self.k,
            self.experts,
            self.bucket
        )
    }

    fn from_json(v: &Value) -> Option<TuneKey> {
        Some(TuneKey {
            gpu: v.get("gpu")?.as_str()?.to_string(),
            driver: i32::try_from(v.get("driver")?.as_i64()?).ok()?,
            version: v.get("version")?.as_str()?.to_string(),
            codegen: v.get("codegen")?.as_str()?.to_string(),
            operands: operands_from(v.get("operands")?.as_str()?)?,
            scaling: scaling_from(v.get("scaling")?.as_str()?)?,
            out: out_from(v.get("out")?.as_str()?)?,
            epilogue: epilogue_from(v.get("epilogue")?.as_str()?)?,
            n: u32_of(v, "n")?,
            k: u32_of(v, "k")?,
            experts: u32_of(v, "experts")?,
            bucket: v.get("bucket")?.as_u64()?,
        })
    }
}

/// A tuning result.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneEntry {
    /// The chosen variant.
    pub choice: WsConfig,
    /// Every candidate timed, in the order timed: its tag and mean time in nanoseconds.
    pub times_ns: Vec<(String, u64)>,
    /// Timed launches per candidate.
    pub reps: u32,
}

impl TuneEntry {
    fn to_json(&self) -> Value {
        let c = &self.choice;
        json!({
            "tag": c.tag(),
            "config": {
                "operands": c.operands.name(),
                "scaling": scaling_name(c.scaling),
                "out": c.out.name(),
                "epilogue": c.epilogue.name(),
                "consumers": c.consumers,
                "bn": c.bn,
                "stages": c.stages,
                "swap_ab": c.swap_ab,
                "split_k": c.split_k,
                "two_slices": c.two_slices,
                "skip_idle": c.skip_idle,
                "n": c.n,
                "k": c.k,
            },
            "times_ns": self
                .times_ns
                .iter()
                .map(|(t, ns)| json!({"tag": t, "ns": ns}))
                .collect::<Vec<_>>(),
            "reps": self.reps,
        })
    }

    fn from_json(v: &Value) -> Option<TuneEntry> {
        let c = v.get("config")?;
        let choice = WsConfig {
            operands: operands_from(c.get("operands")?.as_str()?)?,
            scaling: scaling_from(c.get("scaling")?.as_str()?)?,
            out: out_from(c.get("out")?.as_str()?)?,
            epilogue: epilogue_from(c.get("epilogue")?.as_str()?)?,
            consumers: u32_of(c, "consumers")?,
            bn: u32_of(c, "bn")?,
            stages: u32_of(c, "stages")?,
            swap_ab: c.get("swap_ab")?.as_bool()?,
            split_k: u32_of(c, "split_k")?,
            n: u32_of(c, "n")?,
            k: u32_of(c, "k")?,
            w_rows: WRows::PLAIN,
            // Absent from entries written before the field existed (all one-slice forms).
            two_slices: c
                .get("two_slices")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            // Absent from entries written before the field existed (no form skipped).
            skip_idle: c.get("skip_idle").and_then(Value::as_bool).unwrap_or(false),
        };
        // The tag is what the variant is called everywhere: it must name the same variant.
        if v.get("tag")?.as_str()? != choice.tag() {
            return None;
        }
        let mut times_ns = Vec::new();
        for t in v.get("times_ns")?.as_array()? {
            times_ns.push((t.get("tag")?.as_str()?.to_string(), t.get("ns")?.as_u64()?));
        }
        Some(TuneEntry {
            choice,
            times_ns,
            reps: u32_of(v, "reps")?,
        })
    }
}

/// Whether a variant's choice came from the cache or was measured now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TuneSource {
    /// A stored result (memory or disk): nothing was timed.
    Cached,
    /// Every candidate was timed now and the result stored.
    Tuned,
}

/// One stored tuning entry, as `cache ls` shows it.
#[derive(Debug, Clone)]
pub struct TuneInfo {
    /// The file name's key hash.
    pub hash: String,
    /// The key, when the entry verifies.
    pub key: Option<TuneKey>,
    /// The chosen variant's tag, when the entry verifies.
    pub choice: Option<String>,
    /// File size in bytes.
    pub bytes: u64,
    /// Whether the entry verifies (checksum, format, key matching its file name).
    pub valid: bool,
}

/// The tuning cache: an in-memory map over `{dir}/tune`.
pub struct TuneCache {
    dir: Option<PathBuf>,
    mem: Mutex<HashMap<TuneKey, TuneEntry>>,
}

impl TuneCache {
    /// A tuning cache under the kernel cache's folder `dir` (its entries in `{dir}/tune`; `None`:
    /// in memory only).
    pub fn new(dir: Option<PathBuf>) -> TuneCache {
        TuneCache {
            dir: dir.map(|d| d.join("tune")),
            mem: Mutex::new(HashMap::new()),
        }
    }

    /// The folder entries are stored in.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The file of `key`'s entry.
    pub fn path(&self, key: &TuneKey) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("{}.json", key.hash())))
    }

    /// The stored result of `key`: from memory, else from its file if that verifies (checksum,
    /// format, the same key); `None` otherwise.
    pub fn get(&self, key: &TuneKey) -> Option<TuneEntry> {
        if let Some(e) = self.mem.lock().ok().and_then(|m| m.get(key).cloned()) {
            return Some(e);
        }
        let data = std::fs::read(self.path(key)?).ok()?;
        let (k, e) = parse(&data)?;
        if &k != key {
            return None;
        }
        if let Ok(mut m) = self.mem.lock() {
            m.insert(key.clone(), e.clone());
        }
        Some(e)
    }

    /// Store `entry` under `key`, in memory and (with a folder) in its file, written to a temporary
    /// file in the same folder and renamed into place: a reader sees the old entry or the new one,
    /// never part of one, and a failed write leaves no file behind.
    pub fn put(&self, key: &TuneKey, entry: &TuneEntry) -> Result<()> {
        if let Some(path) = self.path(key) {
            crate::cache::write_atomic(&path, &[&render(key, entry)], true)?;
        }
        if let Ok(mut m) = self.mem.lock() {
            m.insert(key.clone(), entry.clone());
        }
        Ok(())
    }

    /// Forget the in-memory map (the files stay).
    pub fn forget_memory(&self) {
        if let Ok(mut m) = self.mem.lock() {
            m.clear();
        }
    }

    /// Every entry on disk, by key hash.
    pub fn entries(&self) -> Result<Vec<TuneInfo>> {
        let Some(dir) = &self.dir else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for e in crate::cache::dir_files(dir)? {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let Some(hash) = p.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
                continue;
            };
            let parsed = std::fs::read(&p)
                .ok()
                .and_then(|d| parse(&d))
                .filter(|(k, _)| k.hash() == hash);
            out.push(TuneInfo {
                hash,
                valid: parsed.is_some(),
                choice: parsed.as_ref().map(|(_, e)| e.choice.tag()),
                key: parsed.map(|(k, _)| k),
                bytes: e.metadata().map(|m| m.len()).unwrap_or(0),
            });
        }
        out.sort_by(|a, b| a.hash.cmp(&b.hash));
        Ok(out)
    }

    /// Remove every entry (valid or not); returns how many files were removed.
    pub fn clear(&self) -> Result<usize> {
        self.forget_memory();
        let Some(dir) = &self.dir else {
            return Ok(0);
        };
        let mut n = 0;
        for e in self.entries()? {
            let p = dir.join(format!("{}.json", e.hash));
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
        Ok(n)
    }
}

/// The variant to run for `key` among `candidates`: the stored choice when there is one that is
/// among the candidates (then `time` is not called at all), else every candidate timed `reps`
/// times (at least once) in the given order, candidate by candidate, the fastest mean kept (a tie
/// goes to the earlier candidate) and stored. `time` returns one launch's time in microseconds; an
/// error of it is returned (nothing is stored). Returns the entry and where it came from. The
/// error type is the caller's (one that a runtime [`Error`] converts into).
pub fn tune<E: From<Error>>(
    cache: &TuneCache,
    key: &TuneKey,
    candidates: &[WsConfig],
    reps: u32,
    mut time: impl FnMut(&WsConfig) -> Result<f64, E>,
) -> Result<(TuneEntry, TuneSource), E> {
    if let Some(e) = cache.get(key) {
        if candidates.contains(&e.choice) {
            return Ok((e, TuneSource::Cached));
        }
    }
    let reps = reps.max(1);
    let mut best: Option<(WsConfig, f64)> = None;
    let mut times_ns = Vec::with_capacity(candidates.len());
    for cfg in candidates {
        let mut total = 0.0;
        for _ in 0..reps {
            total += time(cfg)?;
        }
        let us = total / f64::from(reps);
        if !us.is_finite() || us < 0.0 {
            return Err(E::from(Error::Placement(format!(
                "tuning {}: candidate {} measured {us} us",
                key.describe(),
                cfg.tag()
            ))));
        }
        times_ns.push((cfg.tag(), (us * 1e3).round() as u64));
        if best.is_none_or(|(_, b)| us < b) {
            best = Some((*cfg, us));
        }
    }
    let Some((choice, _)) = best else {
        return Err(E::from(Error::Placement(format!(
            "tuning {}: no candidate",
            key.describe()
        ))));
    };
    let entry = TuneEntry {
        choice,
        times_ns,
        reps,
    };
    cache.put(key, &entry).map_err(E::from)?;
    Ok((entry, TuneSource::Tuned))
}

/// The file's bytes: `{"format", "key", "entry", "checksum"}`, the checksum the BLAKE3 of the
/// compact JSON of `[format, key, entry]`.
fn render(key: &TuneKey, entry: &TuneEntry) -> Vec<u8> {
    let body = json!([FORMAT, key.to_json(), entry.to_json()]);
    let sum = blake3::hash(body.to_string().as_bytes())
        .to_hex()
        .to_string();
    let v = json!({
        "format": FORMAT,
        "key": body[1],
        "entry": body[2],
        "checksum": sum,
    });
    let mut bytes = serde_json::to_vec_pretty(&v).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// A stored entry's key and entry, if the file verifies.
fn parse(data: &[u8]) -> Option<(TuneKey, TuneEntry)> {
    let v: Value = serde_json::from_slice(data).ok()?;
    if v.get("format")?.as_str()? != FORMAT {
        return None;
    }
    let (key, entry) = (v.get("key")?, v.get("entry")?);
    let body = json!([FORMAT, key, entry]);
    if blake3::hash(body.to_string().as_bytes()).to_hex().as_str() != v.get("checksum")?.as_str()? {
        return None;
    }
    Some((TuneKey::from_json(key)?, TuneEntry::from_json(entry)?))
}

fn u32_of(v: &Value, name: &str) -> Option<u32> {
    u32::try_from(v.get(name)?.as_u64()?).ok()
}

fn operands_from(s: &str) -> Option<Operands> {
    Operands::from_name(s)
}

/// `none`, `tensorwise_per_token`, `tensorwise`, `block128`, `channelwise_per_token`,
/// `channelwise`, `per_row`, `per_expert` or
/// `per_row_group_G` (groups of `G`), `groupwise_per_token_G` or `groupwise_G`.
pub fn scaling_name(s: Scaling) -> String {
    match s {
        Scaling::None => "none".into(),
        Scaling::Tensorwise { per_token: true } => "tensorwise_per_token".into(),
        Scaling::Tensorwise { per_token: false } => "tensorwise".into(),
        Scaling::Block128 => "block128".into(),
        Scaling::Channelwise { per_token: true } => "channelwise_per_token".into(),
        Scaling::Channelwise { per_token: false } => "channelwise".into(),
        Scaling::PerRow => "per_row".into(),
        Scaling::PerExpert => "per_expert".into(),
        Scaling::PerRowGroup { group } => format!("per_row_group_{group}"),
        Scaling::Groupwise {
            group,
            per_token: true,
        } => format!("groupwise_per_token_{group}"),
        Scaling::Groupwise {
            group,
            per_token: false,
        } => format!("groupwise_{group}"),
    }
}

fn scaling_from(s: &str) -> Option<Scaling> {
    if let Some(g) = s.strip_prefix("per_row_group_") {
        return g.parse().ok().map(|group| Scaling::PerRowGroup { group });
    }
    if let Some(g) = s.strip_prefix("groupwise_per_token_") {
        return g.parse().ok().map(|group| Scaling::Groupwise {
            group,
            per_token: true,
        });
    }
    if let Some(g) = s.strip_prefix("groupwise_") {
        return g.parse().ok().map(|group| Scaling::Groupwise {
            group,
            per_token: false,
        });
    }
    [
        Scaling::None,
        Scaling::Tensorwise { per_token: true },
        Scaling::Tensorwise { per_token: false },
        Scaling::Block128,
        Scaling::Channelwise { per_token: true },
        Scaling::Channelwise { per_token: false },
        Scaling::PerRow,
        Scaling::PerExpert,
    ]
    .into_iter()
    .find(|x| scaling_name(*x) == s)
}

fn epilogue_from(s: &str) -> Option<Epilogue> {
    Epilogue::ALL.into_iter().find(|e| e.name() == s)
}

fn out_from(s: &str) -> Option<OutTy> {
    [OutTy::Bf16, OutTy::F32]
        .into_iter()
        .find(|o| o.name() == s)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use moeforge_codegen::gemm::tune::{bucket, candidates};

    fn key() -> TuneKey {
        TuneKey {
            gpu: "NVIDIA H200".into(),
            driver: 13000,
            version: "0.1.0".into(),
            codegen: "fp".into(),
            operands: Operands::E4m3,
            scaling: Scaling::Block128,
            out: OutTy::Bf16,
            epilogue: Epilogue::Store,
            n: 1536,
            k: 2048,
            experts: 128,
            bucket: bucket(500) as u64,
        }
    }

    fn entry(k: &TuneKey) -> TuneEntry {
        let all = candidates(k.operands, k.scaling, k.n, k.k);
        // (The first decode candidate, d1x8: the tests below look for its BN.)
        let choice = all.iter().find(|c| c.swap_ab).copied().unwrap_or(all[0]);
        TuneEntry {
            choice,
            times_ns: all
                .iter()
                .enumerate()
                .map(|(i, c)| (c.tag(), 1000 + i as u64))
                .collect(),
            reps: 3,
        }
    }

    #[test]
    fn the_key_encoding_and_hash_are_stable() {
        let k = key();
        assert_eq!(
            k.encode(),
            "moeforge-gemm-tune 2\ngpu=\"NVIDIA H200\"\ndriver=13000\nversion=\"0.1.0\"\ncodegen=\"fp\"\noperands=e4m3\nscaling=block128\nout=bf16\nepilogue=store\nn=1536\nk=2048\nexperts=128\nbucket=512\n"
        );
        assert_eq!(
            k.hash(),
            blake3::hash(k.encode().as_bytes()).to_hex().as_str()
        );
        // Pinned: a change of the encoding must be deliberate (and change FORMAT).
        assert_eq!(
            k.hash(),
            "0516315fe6f299b4b3343cb99206db35cf30d5bb0463f3c669746a01ba17049b",
            "update the pinned hash only together with FORMAT"
        );
        // 500 and 512 rows are one bucket; every field is part of the key.
        let mut other = k.clone();
        other.bucket = bucket(512) as u64;
        assert_eq!(other.hash(), k.hash());
        let variants: Vec<fn(&mut TuneKey)> = vec![
            |k: &mut TuneKey| k.gpu.push('x'),
            |k: &mut TuneKey| k.driver += 1,
            |k: &mut TuneKey| k.version.push('x'),
            |k: &mut TuneKey| k.codegen.push('x'),
            |k: &mut TuneKey| k.operands = Operands::Bf16,
            |k: &mut TuneKey| k.scaling = Scaling::Tensorwise { per_token: true },
            |k: &mut TuneKey| k.out = OutTy::F32,
            |k: &mut TuneKey| k.epilogue = Epilogue::SiluMul,
            |k: &mut TuneKey| {
                k.epilogue = Epilogue::SiluMulE4m3(moeforge_codegen::gemm::ws::AQuant::PerToken)
            },
            |k: &mut TuneKey| k.n += 1,
            |k: &mut TuneKey| k.k += 1,
            |k: &mut TuneKey| k.experts += 1,
            |k: &mut TuneKey| k.bucket = bucket(513) as u64,
        ];
        let mut hashes = std::collections::BTreeSet::from([k.hash()]);
        for f in &variants {
            let mut m = k.clone();
            f(&mut m);
            assert!(hashes.insert(m.hash()), "{m:?}");
        }
        // A GPU name cannot forge other fields.
        let mut forged = k.clone();
        forged.gpu = "NVIDIA H200\"\ndriver=1".into();
        assert_ne!(forged.hash(), k.hash());
        assert_eq!(TuneKey::from_json(&k.to_json()), Some(k));
    }

    /// Keys of the weights-only families (int8, and every 4-bit format of the standard recipes)
    /// read back from JSON: their results are found by a later process.
    #[test]
    fn weights_only_keys_round_trip() {
        use moeforge_codegen::gemm::ws::{GroupScale, W4Codes, W4};
        for (operands, scaling) in [
            (Operands::I8Bf16, Scaling::PerRow),
            (Operands::E4m3, Scaling::Channelwise { per_token: true }),
            (Operands::E4m3, Scaling::Channelwise { per_token: false }),
            (Operands::I8Bf16, Scaling::PerRowGroup { group: 128 }),
            (
                Operands::E4m3,
                Scaling::Groupwise {
                    group: 128,
                    per_token: true,
                },
            ),
            (
                Operands::W4Bf16(W4 {
                    codes: W4Codes::E2m1,
                    scale: GroupScale::E4m3,
                    group: 16,
                }),
                Scaling::PerExpert,
            ),
            (
                Operands::W4Bf16(W4 {
                    codes: W4Codes::E2m1,
                    scale: GroupScale::E8m0,
                    group: 32,
                }),
                Scaling::PerExpert,
            ),
            (
                Operands::W4Bf16(W4 {
                    codes: W4Codes::U4,
                    scale: GroupScale::Bf16,
                    group: 128,
                }),
                Scaling::PerExpert,
            ),
            (
                Operands::W4Bf16(W4 {
                    codes: W4Codes::U4,
                    scale: GroupScale::Bf16Zero,
                    group: 64,
                }),
                Scaling::PerExpert,
            ),
        ] {
            let k = TuneKey {
                operands,
                scaling,
                ..key()
            };
            assert_eq!(TuneKey::from_json(&k.to_json()), Some(k.clone()));
            assert_eq!(Operands::from_name(&operands.name()), Some(operands));
        }
        assert_eq!(Operands::from_name("f4eg24"), None);
        assert_eq!(Operands::from_name("f4xg16"), None);
    }

    #[test]
    fn put_get_round_trip_and_other_keys_miss() {
        let dir = tempfile::tempdir().unwrap();
        let c = TuneCache::new(Some(dir.path().to_path_buf()));
        let (k, e) = (key(), entry(&key()));
        assert_eq!(c.get(&k), None);
        c.put(&k, &e).unwrap();
        assert_eq!(c.get(&k), Some(e.clone()));
        let path = dir.path().join("tune").join(format!("{}.json", k.hash()));
        assert_eq!(c.path(&k), Some(path.clone()));
        assert!(path.is_file());
        // A new process reads the file.
        let c2 = TuneCache::new(Some(dir.path().to_path_buf()));
        assert_eq!(c2.get(&k), Some(e.clone()));
        // Another GPU, driver, version or generator misses.
        for f in [
            |k: &mut TuneKey| k.gpu = "NVIDIA H100 80GB HBM3".into(),
            |k: &mut TuneKey| k.driver = 12080,
            |k: &mut TuneKey| k.version = "0.2.0".into(),
            |k: &mut TuneKey| k.codegen = "other".into(),
        ] {
            let mut m = k.clone();
            f(&mut m);
            assert_eq!(c2.get(&m), None, "{m:?}");
        }
        let list = c2.entries().unwrap();
        assert_eq!(list.len(), 1);
        assert!(list[0].valid);
        assert_eq!(list[0].key.as_ref(), Some(&k));
        assert_eq!(list[0].choice, Some(e.choice.tag()));
        // In memory only: nothing on disk, still a round trip.
        let m = TuneCache::new(None);
        m.put(&k, &e).unwrap();
        assert_eq!(m.get(&k), Some(e));
        assert!(m.entries().unwrap().is_empty());
    }

    #[test]
    fn a_corrupt_or_mismatching_entry_is_ignored_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let (k, e) = (key(), entry(&key()));
        TuneCache::new(Some(dir.path().to_path_buf()))
            .put(&k, &e)
            .unwrap();
        let path = dir.path().join("tune").join(format!("{}.json", k.hash()));
        let good = std::fs::read(&path).unwrap();
        // Flip one byte anywhere that matters: the choice's BN, a time, the checksum, the key.
        for needle in [
            "\"bn\": 8",
            "\"ns\": 1003",
            "\"checksum\": \"",
            "\"n\": 1536",
        ] {
            let at = String::from_utf8_lossy(&good).find(needle).unwrap() + needle.len() - 1;
            let mut bad = good.clone();
            bad[at] ^= 1;
            std::fs::write(&path, &bad).unwrap();
            let c = TuneCache::new(Some(dir.path().to_path_buf()));
            assert_eq!(c.get(&k), None, "{needle}");
            assert!(!c.entries().unwrap()[0].valid);
        }
        // Truncated, empty, not JSON.
        for bad in [&good[..good.len() / 2], b"", b"\xff\xfe"] {
            std::fs::write(&path, bad).unwrap();
            assert_eq!(TuneCache::new(Some(dir.path().to_path_buf())).get(&k), None);
        }
        // A valid entry of another key under this key's name is not this key's.
        let mut other = k.clone();
        other.n = 4096;
        std::fs::write(&path, render(&other, &entry(&other))).unwrap();
        let c = TuneCache::new(Some(dir.path().to_path_buf()));
        assert_eq!(c.get(&k), None);
        assert!(!c.entries().unwrap()[0].valid);
        // A tag that does not name the config is refused too.
        let text = String::from_utf8(good.clone()).unwrap();
        let tag = e.choice.tag();
        let body = serde_json::from_str::<Value>(&text).unwrap();
        let mut entry_v = body["entry"].clone();
        entry_v["tag"] = Value::from(format!("{tag}x"));
        let sum = blake3::hash(json!([FORMAT, body["key"], entry_v]).to_string().as_bytes())
            .to_hex()
            .to_string();
        let forged =
            json!({"format": FORMAT, "key": body["key"], "entry": entry_v, "checksum": sum});
        std::fs::write(&path, forged.to_string()).unwrap();
        assert_eq!(TuneCache::new(Some(dir.path().to_path_buf())).get(&k), None);
        // Tuning over a corrupt entry re-tunes and replaces it.
        std::fs::write(&path, &good[..10]).unwrap();
        let c = TuneCache::new(Some(dir.path().to_path_buf()));
        let all = candidates(k.operands, k.scaling, k.n, k.k);
        let (got, src) = tune::<Error>(&c, &k, &all, 1, |cfg| Ok(f64::from(cfg.bn))).unwrap();
        assert_eq!(src, TuneSource::Tuned);
        assert_eq!(got.choice.bn, 8);
        assert!(TuneCache::new(Some(dir.path().to_path_buf()))
            .get(&k)
            .is_some());
        assert_eq!(c.clear().unwrap(), 1);
        assert!(c.entries().unwrap().is_empty());
        assert_eq!(c.get(&k), None);
    }

    #[test]
    fn a_failed_write_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        // The tune folder's place is taken by a file: nothing can be created under it.
        std::fs::write(dir.path().join("tune"), b"not a folder").unwrap();
        let c = TuneCache::new(Some(dir.path().to_path_buf()));
        let (k, e) = (key(), entry(&key()));
        let err = c.put(&k, &e).unwrap_err();
        assert!(matches!(err, Error::Cache { .. }), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(c.get(&k), None);
        // A read-only folder (where permissions apply: not as root): the temporary file cannot be
        // made, and nothing is left.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let ro = tempfile::tempdir().unwrap();
            let tune = ro.path().join("tune");
            std::fs::create_dir(&tune).unwrap();
            std::fs::set_permissions(&tune, std::fs::Permissions::from_mode(0o555)).unwrap();
            let c = TuneCache::new(Some(ro.path().to_path_buf()));
            let r = c.put(&k, &e);
            let left = std::fs::read_dir(&tune).unwrap().count();
            std::fs::set_permissions(&tune, std::fs::Permissions::from_mode(0o755)).unwrap();
            if r.is_err() {
                assert_eq!(left, 0);
            }
        }
    }

    #[test]
    fn tune_picks_the_fastest_breaks_ties_by_order_and_then_reuses_the_choice() {
        let dir = tempfile::tempdir().unwrap();
        let k = key();
        let all = candidates(k.operands, k.scaling, k.n, k.k);
        assert!(all.len() >= 4);
        // Candidate i takes 5, 2, 2, 9, ... us: the second wins the tie with the third.
        let us = |i: usize| [5.0, 2.0, 2.0, 9.0].get(i).copied().unwrap_or(7.0);
        let mut calls = Vec::new();
        let c = TuneCache::new(Some(dir.path().to_path_buf()));
        let (e, src) = tune::<Error>(&c, &k, &all, 3, |cfg| {
            let i = all.iter().position(|x| x == cfg).unwrap();
            calls.push(i);
            Ok(us(i))
        })
        .unwrap();
        assert_eq!(src, TuneSource::Tuned);
        assert_eq!(e.choice, all[1]);
        assert_eq!(e.reps, 3);
        // Candidate by candidate, in order, three times each.
        let want: Vec<usize> = (0..all.len()).flat_map(|i| [i; 3]).collect();
        assert_eq!(calls, want);
        assert_eq!(e.times_ns[0], (all[0].tag(), 5000));
        assert_eq!(e.times_ns.len(), all.len());
        // Again, in this process and in a new one: the stored choice, and no timing at all.
        for c in [&c, &TuneCache::new(Some(dir.path().to_path_buf()))] {
            let (again, src) = tune(c, &k, &all, 3, |_| -> Result<f64> {
                panic!("a cached choice is not timed again")
            })
            .unwrap();
            assert_eq!((again, src), (e.clone(), TuneSource::Cached));
        }
        // Another bucket is tuned on its own.
        let mut k2 = k.clone();
        k2.bucket = bucket(4096) as u64;
        let (e2, src) = tune::<Error>(&c, &k2, &all, 1, |cfg| Ok(f64::from(cfg.stages))).unwrap();
        assert_eq!(src, TuneSource::Tuned);
        assert_eq!(
            e2.choice.stages,
            all.iter().map(|c| c.stages).min().unwrap()
        );
        // A stored choice that is not among the candidates is tuned again.
        let (e3, src) = tune::<Error>(&c, &k, &all[2..], 1, |cfg| Ok(f64::from(cfg.bn))).unwrap();
        assert_eq!(src, TuneSource::Tuned);
        assert!(all[2..].contains(&e3.choice));
        // Errors and bad times are returned, and nothing is stored.
        let mut k4 = k.clone();
        k4.experts = 7;
        assert!(tune::<Error>(&c, &k4, &all, 1, |_| Err(Error::Placement("boom".into()))).is_err());
        assert!(tune::<Error>(&c, &k4, &all, 1, |_| Ok(f64::NAN)).is_err());
        assert!(tune::<Error>(&c, &k4, &[], 1, |_| Ok(1.0)).is_err());
        assert_eq!(c.get(&k4), None);
    }
}
