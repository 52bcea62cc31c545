//! The parameter store: the packed params of one layer in device (or host) buffers, with views that
//! borrow it.
//!
//! A [`View`] is not `Clone` and holds `&ParamStore`, so it cannot outlive its params, and it cannot
//! coexist with a rearrangement, which takes `&mut ParamStore`: the borrow checker enforces that what a
//! kernel reads through a view is always the params' current storage. (Lifetimes do not stop anyone
//! copying bytes out; that no derived per-expert value lives outside a param is the verifier's promise 3.)
//! Rearrangement permutes whole experts of every param, using the move set the verifier derived.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use moeforge_dsl::ir::SymLayout;
use moeforge_dsl::ModuleInfo;

use crate::{drv, Error, Result};

/// Storage the store can hold: host bytes or a device allocation.
pub trait ExpertStorage {
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Put expert `perm[k]`'s `bytes`-long range at slot `k`, for every slot.
    fn permute_experts(&mut self, bytes: usize, perm: &[usize]) -> Result<()>;
    /// The address a kernel argument is built from (device pointer, or host address).
    fn address(&self) -> u64;
}

impl ExpertStorage for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn permute_experts(&mut self, bytes: usize, perm: &[usize]) -> Result<()> {
        let old = self.clone();
        for (k, &src) in perm.iter().enumerate() {
            let from = old
                .get(src * bytes..(src + 1) * bytes)
                .ok_or(out_of_range(src))?;
            self.get_mut(k * bytes..(k + 1) * bytes)
                .ok_or(out_of_range(k))?
                .copy_from_slice(from);
        }
        Ok(())
    }

    fn address(&self) -> u64 {
        self.as_ptr() as u64
    }
}

fn out_of_range(e: usize) -> Error {
    Error::Driver {
        call: "permute_experts",
        detail: format!("expert {e} is out of range"),
    }
}

/// A device allocation and the stream its copies are queued on.
pub struct DeviceStorage {
    /// The bytes.
    pub buf: CudaSlice<u8>,
    /// The stream.
    pub stream: std::sync::Arc<CudaStream>,
}

impl ExpertStorage for DeviceStorage {
    fn len(&self) -> usize {
        self.buf.len()
    }

    fn permute_experts(&mut self, bytes: usize, perm: &[usize]) -> Result<()> {
        // Copy the moved experts' ranges out, then into their new slots (stream-ordered after every
        // launch already queued, so kernels in flight read the old layout).
        let old = self
            .stream
            .clone_dtod(&self.buf)
            .map_err(drv("cuMemcpyDtoD"))?;
        for (k, &src) in perm.iter().enumerate() {
            if k == src {
                continue;
            }
            let from = old.slice(src * bytes..(src + 1) * bytes);
            let mut to = self.buf.slice_mut(k * bytes..(k + 1) * bytes);
            self.stream
                .memcpy_dtod(&from, &mut to)
                .map_err(drv("cuMemcpyDtoD"))?;
        }
        Ok(())
    }

    fn address(&self) -> u64 {
        let (p, _sync) = self.buf.device_ptr(&self.stream);
        p
    }
}

/// One registered param in the store.
struct Entry<S> {
    name: String,
    storage: S,
    bytes_per_expert: usize,
}

/// The params of one layer.
pub struct ParamStore<S: ExpertStorage> {
    entries: Vec<Entry<S>>,
    views: Vec<(String, usize, SymLayout)>,
    experts: usize,
    binding: moeforge_dsl::Binding,
}

/// A borrowed alias of one param: its storage and the layout from view coordinates to element offsets.
/// Not `Clone`; it lives no longer than the store and excludes any rearrangement while it exists.
pub struct View<'s, S: ExpertStorage> {
    store: &'s ParamStore<S>,
    param: usize,
    layout: &'s SymLayout,
}

impl<S: ExpertStorage> View<'_, S> {
    /// The address of the param's storage, for a kernel argument built at launch.
    pub fn address(&self) -> u64 {
        self.store.entries[self.param].storage.address()
    }

    /// The aliased param's name.
    pub fn param(&self) -> &str {
        &self.store.entries[self.param].name
    }

    /// Source element offsets of the view's elements, row-major over its flattened shape (the
    /// verifier's index map at the store's binding).
    pub fn index_map(&self) -> Vec<i64> {
        moeforge_dsl::verify::index_map(self.layout, &self.store.binding).unwrap_or_default()
    }
}

impl<S: ExpertStorage> ParamStore<S> {
    /// A store over packed params (`(name, storage)`), checked against the verified module's move set.
    pub fn new(info: &ModuleInfo, params: Vec<(String, S)>) -> Result<ParamStore<S>> {
        let m = info.module();
        let binding = info.binding().cloned().ok_or_else(|| Error::Driver {
            call: "ParamStore::new",
            detail: "the module is not bound".into(),
        })?;
        let atoms = binding.atoms().to_vec();
        let experts = m
            .experts_dim()
            .and_then(|d| d.poly.eval(&atoms))
            .unwrap_or(0) as usize;
        let mut entries = Vec::new();
        for (name, storage) in params {
            let mv = info
                .move_set
                .iter()
                .find(|e| m.tensor(e.param).is_some_and(|t| t.name == name))
                .ok_or_else(|| Error::Driver {
                    call: "ParamStore::new",
                    detail: format!("`{name}` is not a registered param"),
                })?;
            let bytes = info.bytes_per_expert(mv).unwrap_or(0) as usize;
            if storage.len() < bytes * experts {
                return Err(Error::Driver {
                    call: "ParamStore::new",
                    detail: format!(
                        "`{name}` holds {} bytes, fewer than {experts} experts of {bytes}",
                        storage.len()
                    ),
                });
            }
            entries.push(Entry {
                name,
                storage,
                bytes_per_expert: bytes,
            });
        }
        // The whole move set, or nothing: every registered param that is not optional must be
        // given (optional ones exist only where the checkpoint had their inputs; an optional param
        // is required too when another param of the same optional inputs is given).
        let given = |n: &str| entries.iter().any(|x: &Entry<S>| x.name == n);
        let any_optional_given = info.move_set.iter().any(|e| {
            m.tensor(e.param)
                .is_some_and(|t| t.optional && given(&t.name))
        });
        let missing: Vec<String> = info
            .move_set
            .iter()
            .filter_map(|e| m.tensor(e.param))
            .filter(|t| (!t.optional || any_optional_given) && !given(&t.name))
            .map(|t| format!("`{}`", t.name))
            .collect();
        if !missing.is_empty() {
            return Err(Error::IncompleteMoveSet { missing });
        }
        let views = info
            .views
            .iter()
            .filter_map(|v| {
                let vn = m.tensor(v.id)?.name.clone();
                let pn = &m.tensor(v.source)?.name;
                let k = entries.iter().position(|e| &e.name == pn)?;
                Some((vn, k, v.layout.clone()))
            })
            .collect();
        Ok(ParamStore {
            entries,
            views,
            experts,
            binding,
        })
    }

    /// A view by name, borrowing the store.
    pub fn view(&self, name: &str) -> Option<View<'_, S>> {
        let (_, param, layout) = self.views.iter().find(|v| v.0 == name)?;
        Some(View {
            store: self,
            param: *param,
            layout,
        })
    }

    /// A param's storage by name.
    pub fn param(&self, name: &str) -> Option<&S> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .map(|e| &e.storage)
    }

    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Move experts in place: slot `k` takes the expert that was at `perm[k]`, in every param (the
    /// whole move set). `perm` must be a permutation of the experts.
    pub fn rearrange(&mut self, perm: &[usize]) -> Result<()> {
        let mut seen = vec![false; self.experts];
        if perm.len() != self.experts
            || perm
                .iter()
                .any(|&p| p >= self.experts || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::Driver {
                call: "ParamStore::rearrange",
                detail: format!("not a permutation of {} experts: {perm:?}", self.experts),
            });
        }
        for e in &mut self.entries {
            e.storage.permute_experts(e.bytes_per_expert, perm)?;
        }
        Ok(())
    }
}
