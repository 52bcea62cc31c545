//! The parameter store: the packed params of one layer (on one rank) in device or host buffers,
//! with views that borrow it, placed on physical expert slots by EPLB.
//!
//! A [`View`] is not `Clone` and holds `&ParamStore`, so it cannot outlive its params, and it cannot
//! coexist with a rearrangement, which takes `&mut ParamStore`: the borrow checker enforces that what
//! a kernel reads through a view is always the params' current storage. (Lifetimes do not stop anyone
//! copying bytes out; that no derived per-expert value lives outside a param is the verifier's
//! promise 3.)
//!
//! A store holds the recipe's whole move set or is refused ([`Error::IncompleteMoveSet`]).
//! Rearrangement runs a [`MovePlan`] over every param: the plan is checked against the store first
//! (a bad plan changes nothing), then received experts land in a per-param staging buffer (the
//! transfer buffer plus one expert of scratch, never a copy of the whole param), then the local
//! copies run, and only then does the store's placement switch. A failure after the first byte
//! moved leaves the store unusable: it refuses views until it is rebuilt.

use moeforge_dsl::ir::SymLayout;
use moeforge_dsl::ModuleInfo;

use crate::collective::{Collective, Group};
pub use crate::device_storage::{DeviceStaging, DeviceStorage};
use crate::moves::{Copy, Loc, MovePlan, SlotMap};
use crate::{Error, Result};

/// Where a staged copy reads or writes: the param's own bytes, or its staging buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Byte offset into the param.
    Main(usize),
    /// Byte offset into the staging buffer.
    Staging(usize),
}

/// Storage the store can hold: host bytes or a device allocation, owned or borrowed.
pub trait ExpertStorage {
    /// A staging buffer of the same kind (received experts and the scratch).
    type Staging;
    /// How ranks exchange bytes of this kind.
    type Transport: ?Sized;
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The address a kernel argument is built from (device pointer, or host address).
    fn address(&self) -> u64;
    /// A staging buffer of `experts` experts of `bytes_per_expert` each.
    fn staging(&self, experts: usize, bytes_per_expert: usize) -> Result<Self::Staging>;
    /// Copy `len` bytes (the two ranges never overlap).
    fn copy(&mut self, st: &mut Self::Staging, from: Place, to: Place, len: usize) -> Result<()>;
    /// Whether the local copies need the one-expert scratch in staging (false where a cycle's
    /// scratch lives on chip).
    fn needs_scratch(&self) -> bool {
        true
    }
    /// Run one rank's local copies in order over `len`-byte experts, `transfers` received experts
    /// at the start of the staging buffer and the scratch after them. `tick` is called before each
    /// unit of work (the fault hook). The default issues one [`ExpertStorage::copy`] per copy.
    fn run_copies(
        &mut self,
        st: &mut Self::Staging,
        copies: &[Copy],
        transfers: usize,
        len: usize,
        tick: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        copy_each(self, st, copies, transfers, len, tick)
    }
    /// Called once every param's copies are queued: join any work a storage forked off its stream
    /// (the default has none).
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
    /// One grouped exchange over `t`'s EP group: for each `(peer, offset, bytes)` of `sends`,
    /// `bytes` from `Main(offset)` to `peer`; for each of `recvs`, `bytes` from `peer` into
    /// `Staging(offset)` (disjoint ranges). `len` is the bytes of one expert: every message is a
    /// whole number of experts ([`crate::moves::MovePlan::messages`]).
    fn exchange(
        &self,
        st: &mut Self::Staging,
        t: &Self::Transport,
        sends: &[(usize, usize, usize)],
        recvs: &[(usize, usize, usize)],
        len: usize,
    ) -> Result<()>;
}

/// A rank's local copies as one [`ExpertStorage::copy`] each, the scratch after the `transfers`
/// received experts in staging: the default of [`ExpertStorage::run_copies`], and what a storage
/// without a faster path falls back to.
pub(crate) fn copy_each<S: ExpertStorage>(
    storage: &mut S,
    st: &mut S::Staging,
    copies: &[Copy],
    transfers: usize,
    len: usize,
    tick: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let place = |l: Loc| match l {
        Loc::Slot(p) => Place::Main(p * len),
        Loc::Transfer(k) => Place::Staging(k * len),
        Loc::Scratch => Place::Staging(transfers * len),
    };
    for c in copies {
        tick()?;
        storage.copy(st, place(c.from), place(c.to), len)?;
    }
    Ok(())
}

pub(crate) fn range(
    what: &str,
    off: usize,
    len: usize,
    size: usize,
) -> Result<std::ops::Range<usize>> {
    match off.checked_add(len) {
        Some(end) if end <= size => Ok(off..end),
        _ => Err(Error::Placement(format!(
            "{what} bytes {off}..{} are outside its {size} bytes",
            off.saturating_add(len)
        ))),
    }
}

impl ExpertStorage for Vec<u8> {
    type Staging = Vec<u8>;
    type Transport = dyn Collective;

    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn address(&self) -> u64 {
        self.as_ptr() as u64
    }

    fn staging(&self, experts: usize, bytes_per_expert: usize) -> Result<Vec<u8>> {
        Ok(vec![0; experts * bytes_per_expert])
    }

    fn copy(&mut self, st: &mut Vec<u8>, from: Place, to: Place, len: usize) -> Result<()> {
        let (n, s) = (Vec::len(self), Vec::len(st));
        match (from, to) {
            (Place::Main(a), Place::Main(b)) => {
                let src = range("the param", a, len, n)?;
                range("the param", b, len, n)?;
                self.copy_within(src, b);
            }
            (Place::Main(a), Place::Staging(b)) => {
                st[range("the staging buffer", b, len, s)?]
                    .copy_from_slice(&self[range("the param", a, len, n)?]);
            }
            (Place::Staging(a), Place::Main(b)) => {
                self[range("the param", b, len, n)?]
                    .copy_from_slice(&st[range("the staging buffer", a, len, s)?]);
            }
            (Place::Staging(a), Place::Staging(b)) => {
                let src = range("the staging buffer", a, len, s)?;
                range("the staging buffer", b, len, s)?;
                st.copy_within(src, b);
            }
        }
        Ok(())
    }

    fn exchange(
        &self,
        st: &mut Vec<u8>,
        t: &dyn Collective,
        sends: &[(usize, usize, usize)],
        recvs: &[(usize, usize, usize)],
        _len: usize,
    ) -> Result<()> {
        let mut out = Vec::with_capacity(sends.len());
        for &(peer, off, len) in sends {
            out.push((peer, &self[range("the param", off, len, Vec::len(self))?]));
        }
        // Split the staging buffer into the receive ranges (ascending, disjoint by construction).
        let mut order: Vec<usize> = (0..recvs.len()).collect();
        order.sort_by_key(|&i| recvs[i].1);
        let mut parts: Vec<Option<(usize, &mut [u8])>> = (0..recvs.len()).map(|_| None).collect();
        let mut rest: &mut [u8] = st.as_mut_slice();
        let mut at = 0;
        for i in order {
            let (peer, off, len) = recvs[i];
            let skip = off.checked_sub(at).ok_or_else(|| {
                Error::Placement("receive ranges overlap in the staging buffer".into())
            })?;
            if rest.len() < skip + len {
                return Err(Error::Placement(
                    "a receive range is outside the staging buffer".into(),
                ));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
            let (mine, tail) = tail.split_at_mut(len);
            parts[i] = Some((peer, mine));
            rest = tail;
            at = off + len;
        }
        let mut recv: Vec<(usize, &mut [u8])> = parts.into_iter().flatten().collect();
        t.exchange(Group::Ep, &out, &mut recv)
    }
}

/// One registered param in the store.
pub(crate) struct Entry<S> {
    pub(crate) name: String,
    pub(crate) storage: S,
    pub(crate) bytes_per_expert: usize,
}

/// What one rearrangement moved, for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MoveReport {
    /// Local slots written.
    pub slots_written: usize,
    /// Bytes read plus written by local copies, per param (name, bytes).
    pub local_bytes: Vec<(String, u64)>,
    /// Bytes sent to each peer (EP rank).
    pub sent: Vec<u64>,
    /// Bytes received from each peer.
    pub received: Vec<u64>,
}

impl MoveReport {
    /// Read + written bytes of every local copy plus everything sent and received.
    pub fn total_bytes(&self) -> u64 {
        self.local_bytes.iter().map(|x| x.1).sum::<u64>()
            + self.sent.iter().sum::<u64>()
            + self.received.iter().sum::<u64>()
    }
}

/// The params of one layer on one rank, placed on physical slots.
pub struct ParamStore<S: ExpertStorage> {
    entries: Vec<Entry<S>>,
    views: Vec<(String, usize, SymLayout)>,
    /// Local slots (the binding's expert count).
    slots: usize,
    binding: moeforge_dsl::Binding,
    placement: SlotMap,
    rank: usize,
    ranks: usize,
    usable: bool,
    fault_after: Option<usize>,
    /// The order the params' local copies are queued in: largest first (the default: the large
    /// params' launches start before the host queues the small ones; run 96 on an H100, the
    /// in-place rearrangement of a DeepSeek-V3 layer 0-4 points of the copy ceiling faster, most for
    /// the recipes with the most small params) or smallest first ([`ParamStore::with_large_first`]).
    large_first: bool,
    /// Staging kept between rearrangements, per param: `(experts it holds, buffer)`; it grows to
    /// the largest move seen and is reused, so the steady state allocates nothing.
    staging: Vec<Option<(usize, S::Staging)>>,
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
    /// A store over packed params (`(name, storage)`) with slot `p` holding expert `p` (one rank).
    pub fn new(info: &ModuleInfo, params: Vec<(String, S)>) -> Result<ParamStore<S>> {
        let slots = bound_experts(info)?;
        ParamStore::placed(info, params, SlotMap::identity(slots), 0, 1)
    }

    /// A store over rank `rank`'s slots of `placement` (over `ranks` ranks): the module is bound at
    /// `E` = the local slot count, and every param holds that many expert slots.
    pub fn placed(
        info: &ModuleInfo,
        params: Vec<(String, S)>,
        placement: SlotMap,
        rank: usize,
        ranks: usize,
    ) -> Result<ParamStore<S>> {
        let m = info.module();
        let binding = info
            .binding()
            .cloned()
            .ok_or_else(|| Error::Placement("the module is not bound".into()))?;
        let slots = bound_experts(info)?;
        if ranks == 0 || rank >= ranks || placement.slots() != slots * ranks {
            return Err(Error::Placement(format!(
                "rank {rank} of {ranks} with {slots} local slots cannot hold a placement of {} slots",
                placement.slots()
            )));
        }
        let mut entries = Vec::new();
        for (name, storage) in params {
            let mv = info
                .move_set
                .iter()
                .find(|e| m.tensor(e.param).is_some_and(|t| t.name == name))
                .ok_or_else(|| Error::Placement(format!("`{name}` is not a registered param")))?;
            let bytes = info.bytes_per_expert(mv).unwrap_or(0) as usize;
            if storage.len() < bytes * slots {
                return Err(Error::Placement(format!(
                    "`{name}` holds {} bytes, fewer than {slots} expert slots of {bytes}",
                    storage.len()
                )));
            }
            if entries.iter().any(|e: &Entry<S>| e.name == name) {
                return Err(Error::Placement(format!("`{name}` is given twice")));
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
            slots,
            binding,
            placement,
            rank,
            ranks,
            usable: true,
            fault_after: None,
            large_first: true,
            staging: Vec::new(),
        })
    }

    /// Queue the params' local copies largest first (`true`, the default: the large params'
    /// launches then start before the host has queued the small ones) or smallest first (`false`,
    /// the benchmark's comparison of the two orders).
    pub fn with_large_first(mut self, large_first: bool) -> Self {
        self.large_first = large_first;
        self
    }

    /// A view by name, borrowing the store; refused while the store is unusable.
    pub fn view(&self, name: &str) -> Result<View<'_, S>> {
        self.check_usable()?;
        let (_, param, layout) = self
            .views
            .iter()
            .find(|v| v.0 == name)
            .ok_or_else(|| Error::Placement(format!("no view `{name}`")))?;
        Ok(View {
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

    /// The params' names, in the order given.
    pub fn param_names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// Local expert slots.
    pub fn experts(&self) -> usize {
        self.slots
    }

    /// The current placement (all ranks' slots).
    pub fn placement(&self) -> &SlotMap {
        &self.placement
    }

    /// Whether the store may serve (false after a failed rearrangement).
    pub fn is_usable(&self) -> bool {
        self.usable
    }

    /// Bytes of one expert slot summed over every param.
    pub fn bytes_per_slot(&self) -> usize {
        self.entries.iter().map(|e| e.bytes_per_expert).sum()
    }

    /// Testing hook: make the next rearrangement fail after `ops` exchanges and copies (counted
    /// over all params), as a transfer failing part-way would.
    pub fn inject_fault(&mut self, ops: Option<usize>) {
        self.fault_after = ops;
    }

    pub(crate) fn entries(&self) -> &[Entry<S>] {
        &self.entries
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn entry_mut(&mut self, k: usize) -> Option<&mut Entry<S>> {
        self.entries.get_mut(k)
    }

    pub(crate) fn mark_unusable(&mut self) {
        self.usable = false;
    }

    pub(crate) fn set_placement(&mut self, map: SlotMap) {
        self.placement = map;
    }

    /// Refuse a plan that does not start from this store's placement or is for another shape.
    pub(crate) fn check_plan(&self, plan: &MovePlan) -> Result<()> {
        self.check_usable()?;
        if plan.old() != &self.placement {
            return Err(Error::Placement(
                "the plan starts from another placement than the layer's".into(),
            ));
        }
        if plan.ranks() != self.ranks || plan.local_slots() != self.slots {
            return Err(Error::Placement(format!(
                "the plan is for {} ranks of {} slots, the layer has {} of {}",
                plan.ranks(),
                plan.local_slots(),
                self.ranks,
                self.slots
            )));
        }
        Ok(())
    }

    fn check_usable(&self) -> Result<()> {
        if self.usable {
            Ok(())
        } else {
            Err(Error::Unusable(
                "a rearrangement failed part-way; the params mix two placements".into(),
            ))
        }
    }

    /// Move experts in place from the current placement to `plan`'s, over every param (the whole
    /// move set): all or nothing. A plan that does not start from this store's placement, or is for
    /// another rank count, changes nothing; a failure while bytes move leaves the store unusable.
    pub fn rearrange(&mut self, plan: &MovePlan, transport: &S::Transport) -> Result<MoveReport> {
        self.check_plan(plan)?;
        let rm = plan
            .rank(self.rank)
            .ok_or_else(|| Error::Placement(format!("the plan has no rank {}", self.rank)))?
            .clone();
        let mut report = MoveReport {
            slots_written: rm
                .copies
                .iter()
                .filter(|c| matches!(c.to, Loc::Slot(_)))
                .count(),
            local_bytes: Vec::new(),
            sent: vec![0; self.ranks],
            received: vec![0; self.ranks],
        };
        // Consecutive experts of one pair of ranks travel as one message.
        let (msg_sends, msg_recvs) = plan.messages(self.rank)?;
        // Staging for every param before any byte moves (an allocation failure changes nothing).
        let transfer = rm.transfer_experts();
        let scratch = usize::from(
            rm.uses_scratch() && self.entries.iter().any(|e| e.storage.needs_scratch()),
        );
        let need = transfer + scratch;
        let mut staging = std::mem::take(&mut self.staging);
        staging.resize_with(self.entries.len(), || None);
        for (e, st) in self.entries.iter().zip(staging.iter_mut()) {
            if st.as_ref().is_none_or(|(n, _)| *n < need) {
                *st = None;
                *st = Some((need, e.storage.staging(need, e.bytes_per_expert)?));
            }
        }
        let mut budget = self.fault_after.take();
        let mut tick = || -> Result<()> {
            match &mut budget {
                Some(0) => Err(Error::Collective {
                    group: Group::Ep.name(),
                    why: "injected transfer failure".into(),
                }),
                Some(n) => {
                    *n -= 1;
                    Ok(())
                }
                None => Ok(()),
            }
        };
        let result = (|| -> Result<()> {
            for (e, st) in self.entries.iter().zip(staging.iter_mut().flatten()) {
                let st = &mut st.1;
                let b = e.bytes_per_expert;
                let sends: Vec<(usize, usize, usize)> = msg_sends
                    .iter()
                    .map(|m| (m.peer, m.at * b, m.count * b))
                    .collect();
                let recvs: Vec<(usize, usize, usize)> = msg_recvs
                    .iter()
                    .map(|m| (m.peer, m.at * b, m.count * b))
                    .collect();
                tick()?;
                e.storage.exchange(st, transport, &sends, &recvs, b)?;
            }
            // Large params first (unless `large_first` is off): their launches go out before the
            // host queues the small ones (which a storage may run aside).
            let mut order: Vec<usize> = (0..self.entries.len()).collect();
            order.sort_by_key(|&k| self.entries[k].bytes_per_expert);
            if self.large_first {
                order.reverse();
            }
            for k in order {
                let (Some(e), Some(Some((_, st)))) = (self.entries.get_mut(k), staging.get_mut(k))
                else {
                    continue;
                };
                e.storage
                    .run_copies(st, &rm.copies, transfer, e.bytes_per_expert, &mut tick)?;
            }
            for e in &mut self.entries {
                e.storage.finish()?;
            }
            Ok(())
        })();
        self.staging = staging;
        if let Err(err) = result {
            self.usable = false;
            return Err(Error::Unusable(format!(
                "rearrangement failed part-way ({err}); the layer must be re-placed before it serves"
            )));
        }
        for e in &self.entries {
            let b = e.bytes_per_expert as u64;
            report
                .local_bytes
                .push((e.name.clone(), 2 * b * rm.copies.len() as u64));
            for t in &rm.sends {
                report.sent[t.peer] += b;
            }
            for t in &rm.recvs {
                report.received[t.peer] += b;
            }
        }
        self.placement = plan.new_map().clone();
        Ok(report)
    }
}

fn bound_experts(info: &ModuleInfo) -> Result<usize> {
    let m = info.module();
    let binding = info
        .binding()
        .ok_or_else(|| Error::Placement("the module is not bound".into()))?;
    let atoms = binding.atoms().to_vec();
    m.experts_dim()
        .and_then(|d| d.poly.eval(&atoms))
        .and_then(|e| usize::try_from(e).ok())
        .ok_or_else(|| Error::Placement("the module has no bound expert dimension".into()))
}
