//! Checkpoints as serving stacks ship them: sharded safetensors files found through
//! `model.safetensors.index.json` or a directory, and `pack --passthrough`, which writes a complete
//! checkpoint: every tensor the recipe does not consume copied through under its own name, in a shard
//! of the same name as the input's, the packed params in the shard that held their layer's experts,
//! a new index file, and the directory's other files (config, tokenizer) copied. The output directory
//! is assembled beside its final path and renamed into place only when everything was written.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::{Error, Result};

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

/// The shard files an `--input` names: itself (a `.safetensors` file), the files of an index
/// (`*.index.json`'s `weight_map`), or a directory's index (else its `*.safetensors` files, sorted).
pub fn expand_input(p: &Path) -> Result<Vec<PathBuf>> {
    if p.is_dir() {
        let idx = p.join("model.safetensors.index.json");
        if idx.is_file() {
            return expand_input(&idx);
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(p)
            .map_err(io(p))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(bad(format!("{}: no .safetensors files", p.display())));
        }
        return Ok(files);
    }
    if p.to_string_lossy().ends_with(".json") {
        let text = crate::read_capped(p, 64 << 20)?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("{}: not a JSON index ({e})", p.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad(format!("{}: no `weight_map` object", p.display())))?;
        let dir = p.parent().unwrap_or(Path::new("."));
        let mut files: Vec<PathBuf> = Vec::new();
        for (name, f) in map {
            let f = f
                .as_str()
                .ok_or_else(|| bad(format!("{}: `{name}` maps to a non-string", p.display())))?;
            if f.contains('/') || f.contains("..") {
                return Err(bad(format!(
                    "{}: shard `{f}` is not a file name beside the index",
                    p.display()
                )));
            }
            let path = dir.join(f);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        files.sort();
        return Ok(files);
    }
    Ok(vec![p.to_path_buf()])
}

/// A tensor to write: name, dtype, shape, bytes.
pub type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// Write a complete checkpoint to directory `out`: for each input shard (path, bytes), its tensors
/// that `consumed` rejects, plus the packed tensors assigned to it by `shard_of` (an input shard
/// index), with `meta` in every shard; then the index and `extra` files copied in.
pub fn write_passthrough(
    out: &Path,
    shards: &[(PathBuf, &[u8])],
    consumed: &dyn Fn(&str) -> bool,
    packed: Vec<(usize, Tensor)>,
    meta: &HashMap<String, String>,
    extra: &[PathBuf],
) -> Result<usize> {
    if out.exists() {
        return Err(Error::Usage(format!(
            "--passthrough writes a new checkpoint directory, and {} exists",
            out.display()
        )));
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // Created with `create_dir`, so the process's umask applies (the finished directory keeps it);
    // removed with everything in it unless the rename below succeeds.
    let tmp = Staging::new(parent)?;
    let mut by_shard: BTreeMap<usize, Vec<Tensor>> = BTreeMap::new();
    for (k, t) in packed {
        by_shard.entry(k).or_default().push(t);
    }
    let mut weight_map: BTreeMap<String, String> = BTreeMap::new();
    let mut total = 0usize;
    let mut written = 0usize;
    let mut names_seen: HashMap<String, String> = HashMap::new();
    for (k, (path, bytes)) in shards.iter().enumerate() {
        let fname = path
            .file_name()
            .map(|f| f.to_string_lossy().to_string())
            .ok_or_else(|| bad(format!("{}: no file name", path.display())))?;
        if let Some(other) = names_seen.insert(fname.clone(), path.display().to_string()) {
            return Err(bad(format!(
                "two input shards share the file name `{fname}` ({other}, {})",
                path.display()
            )));
        }
        let st = SafeTensors::deserialize(bytes).map_err(|e| {
            bad(format!(
                "{}: not a valid safetensors file ({e})",
                path.display()
            ))
        })?;
        let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
        for (name, v) in st.tensors() {
            if !consumed(&name) {
                total += v.data().len();
                weight_map.insert(name.clone(), fname.clone());
                views.push((name, v));
            }
        }
        let mine = by_shard.remove(&k).unwrap_or_default();
        for (n, d, s, data) in &mine {
            let v = TensorView::new(*d, s.clone(), data)
                .map_err(|e| bad(format!("tensor `{n}`: {e}")))?;
            total += data.len();
            weight_map.insert(n.clone(), fname.clone());
            views.push((n.clone(), v));
        }
        let ser = safetensors::serialize(views, Some(meta.clone()))
            .map_err(|e| bad(format!("serializing `{fname}`: {e}")))?;
        written += ser.len();
        let dst = tmp.path().join(&fname);
        std::fs::write(&dst, &ser).map_err(io(&dst))?;
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let ipath = tmp.path().join("model.safetensors.index.json");
    let text =
        serde_json::to_string_pretty(&index).map_err(|e| bad(format!("writing the index: {e}")))?;
    std::fs::write(&ipath, text).map_err(io(&ipath))?;
    for f in extra {
        if let Some(name) = f.file_name() {
            let dst = tmp.path().join(name);
            std::fs::copy(f, &dst).map_err(io(f))?;
        }
    }
    std::fs::rename(tmp.path(), out).map_err(io(out))?;
    tmp.disarm();
    Ok(written)
}

/// A directory being assembled beside its final path, removed on drop unless disarmed.
struct Staging(Option<PathBuf>);

impl Staging {
    fn new(parent: &Path) -> Result<Staging> {
        for k in 0..1000u32 {
            let p = parent.join(format!(".moeforge-pack-{}-{k}", std::process::id()));
            match std::fs::create_dir(&p) {
                Ok(()) => return Ok(Staging(Some(p))),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io(parent)(e)),
            }
        }
        Err(bad(format!(
            "{}: no free name for a staging directory",
            parent.display()
        )))
    }

    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new("."))
    }

    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// The files of an input directory that are neither shards nor the index (config, tokenizer...).
pub fn extra_files(inputs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for p in inputs {
        let dir = if p.is_dir() {
            p.clone()
        } else if p.to_string_lossy().ends_with(".index.json") {
            p.parent().map(Path::to_path_buf).unwrap_or_default()
        } else {
            continue;
        };
        if let Ok(rd) = std::fs::read_dir(&dir) {
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.is_file()
                        && f.extension().is_none_or(|x| x != "safetensors")
                        && !f.to_string_lossy().ends_with(".index.json")
                })
                .collect();
            v.sort();
            out.extend(v);
        }
    }
    out
}
