//! Asynchronous rearrangement on one GPU, what serving needs: a layer's next placement is built on
//! a side stream while forwards keep running on the layer's stream (slots in use are only read,
//! never written), then swapped in between two forwards: the layer's stream waits for the staging
//! event (no host synchronisation) and the map switches.
//!
//! An owned param is staged as a whole new buffer (vLLM's per-layer buffer): runs of slots that do
//! not move are copied as one range, moved experts from the slot that holds them now, and the swap-in
//! exchanges the buffers, so nothing is copied on the forward stream (the param's address changes:
//! re-capture a CUDA graph after a swap). A borrowed param (memory the caller owns) is staged as its
//! changed slots only and copied into place at the swap-in.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use crate::collective::{DeviceCollective, Group, SingleDevice};
use crate::device::Device;
use crate::device_storage::Aliases;
use crate::moves::{MovePlan, Transfer};
use crate::store::{DeviceStorage, ExpertStorage as _, MoveReport, ParamStore};
use crate::{drv, Error, Result};

/// How one param was staged.
enum Stage {
    /// Nothing to move (no changed slot, or no bytes).
    Nothing,
    /// A whole new buffer, swapped in.
    Whole(CudaSlice<u8>),
    /// The changed slots' new experts, in slot order, copied in.
    Changed(CudaSlice<u8>),
}

/// A rearrangement staged on a side stream, waiting to be swapped in.
pub struct Staged {
    plan: MovePlan,
    side: Arc<CudaStream>,
    stages: Vec<Stage>,
    /// Changed local slots, ascending.
    slots: Vec<usize>,
    ready: CudaEvent,
    staged_bytes: u64,
}

impl Staged {
    /// Whether the staging copies have finished (a non-blocking query).
    pub fn is_ready(&self) -> bool {
        self.ready.is_complete()
    }

    /// The plan being applied.
    pub fn plan(&self) -> &MovePlan {
        &self.plan
    }

    /// Bytes written on the side stream.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }
}

fn copy(stream: &CudaStream, dst: u64, src: u64, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: callers pass ranges inside live allocations of this context (a param, checked by
    // `ParamStore::placed` against its slots, and a staging buffer allocated for exactly what is
    // copied into it) that do not overlap, ordered on `stream` by events (see `stage`/`commit`).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
        .map_err(drv("cuMemcpyDtoDAsync"))
}

/// Where slot `p` of a rank's new buffer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// An old slot of this rank (itself when unchanged, else the lowest holding its expert).
    Old(usize),
    /// Receive `k` of the plan, landing in this slot (the expert's first slot here).
    Recv(usize),
    /// A slot of the new buffer that received the expert.
    Local(usize),
}

/// The source of every slot of a rank's new buffer: `old`/`new` are the rank's slots, `recvs` its
/// receives (`at` = index).
fn local_sources(old: &[usize], new: &[usize], recvs: &[Transfer]) -> Result<Vec<Src>> {
    let mut first: Vec<(usize, usize)> = Vec::new();
    (0..new.len())
        .map(|p| {
            if old[p] == new[p] {
                return Ok(Src::Old(p));
            }
            if let Some(q) = old.iter().position(|&x| x == new[p]) {
                return Ok(Src::Old(q));
            }
            if let Some(&(_, q)) = first.iter().find(|f| f.0 == new[p]) {
                return Ok(Src::Local(q));
            }
            let t = recvs.iter().find(|t| t.expert == new[p]).ok_or_else(|| {
                Error::Placement(format!("no slot or receive holds expert {}", new[p]))
            })?;
            first.push((new[p], p));
            Ok(Src::Recv(t.at))
        })
        .collect()
}

/// Copy runs over `(dst slot, src slot)` pairs (ascending dst): maximal `(dst, src, slots)` ranges
/// where consecutive slots read consecutive sources.
fn runs(pairs: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for &(p, q) in pairs {
        match out.last_mut() {
            Some((d, s, n)) if *d + *n == p && *s + *n == q => *n += 1,
            _ => out.push((p, q, 1)),
        }
    }
    out
}

impl ParamStore<DeviceStorage> {
    /// Stage `plan` (one rank) on `side`. The store keeps serving; nothing it holds is written.
    pub fn stage(&self, plan: &MovePlan, side: &Arc<CudaStream>) -> Result<Staged> {
        self.stage_with(plan, side, &SingleDevice)
    }

    /// Stage `plan` on `side`, experts from other ranks arriving through `coll` (its EP group) on
    /// the side stream too: every rank calls this with the same plan. Received experts land straight
    /// in their first slot of the new buffer, and further local replicas copy from there. Across
    /// ranks only owned params can be staged (a borrowed param's changed-slot staging has no room for
    /// receives): move those with [`ParamStore::rearrange`].
    pub fn stage_with(
        &self,
        plan: &MovePlan,
        side: &Arc<CudaStream>,
        coll: &dyn DeviceCollective,
    ) -> Result<Staged> {
        self.check_plan(plan)?;
        let rank = self.rank();
        let local = plan.local_slots();
        let rm = plan
            .rank(rank)
            .ok_or_else(|| Error::Placement(format!("the plan has no rank {rank}")))?
            .clone();
        let old = &plan.old().phy2log()[rank * local..(rank + 1) * local];
        let new = &plan.new_map().phy2log()[rank * local..(rank + 1) * local];
        let src = local_sources(old, new, &rm.recvs)?;
        let slots: Vec<usize> = (0..local).filter(|&p| old[p] != new[p]).collect();
        let crosses = !rm.sends.is_empty() || !rm.recvs.is_empty();
        let main = self.stream()?;
        // Whole buffers are the params' spares (the buffers the last swap-in replaced) or new
        // allocations on the layer's stream; the side stream starts after everything already queued
        // there (forwards still reading a spare, a previous swap-in).
        let mut stages = Vec::new();
        let mut staged_bytes = 0u64;
        for e in self.entries() {
            let b = e.bytes_per_expert;
            let st = if (slots.is_empty() && !crosses) || b == 0 {
                Stage::Nothing
            } else if e.storage.is_borrowed() {
                if crosses {
                    return Err(Error::Placement(format!(
                        "`{}` is borrowed: an async move across ranks needs owned params (use rearrange)",
                        e.name
                    )));
                }
                // SAFETY: every byte is written by the copies below before the swap-in reads it.
                Stage::Changed(
                    unsafe { side.alloc::<u8>(slots.len() * b) }.map_err(drv("cuMemAlloc"))?,
                )
            } else {
                // Every byte is written below (the receives, all slots, the tail past the last
                // slot) before the buffer is swapped in.
                Stage::Whole(e.storage.take_spare()?)
            };
            stages.push(st);
        }
        let after = main.record_event(None).map_err(drv("cuEventRecord"))?;
        side.wait(&after).map_err(drv("cuStreamWaitEvent"))?;
        let on_side = Device::on_stream(side);
        for (e, st) in self.entries().iter().zip(&stages) {
            let b = e.bytes_per_expert;
            let from = e.storage.address();
            match st {
                Stage::Nothing => {}
                Stage::Whole(buf) => {
                    let to = buf.device_ptr(side).0;
                    if crosses {
                        let old_buf = e
                            .storage
                            .slice()
                            .ok_or_else(|| Error::Placement("storage released".into()))?;
                        let sends: Vec<_> = rm
                            .sends
                            .iter()
                            .map(|t| (t.peer, old_buf.slice(t.at * b..(t.at + 1) * b)))
                            .collect();
                        let mut aliases = Aliases(Vec::new());
                        for t in &rm.recvs {
                            let p = src.iter().position(|x| *x == Src::Recv(t.at)).ok_or_else(
                                || {
                                    Error::Placement(format!(
                                        "no slot receives expert {}",
                                        t.expert
                                    ))
                                },
                            )?;
                            // SAFETY: slot `p` of the new buffer (a live allocation of `b * local`
                            // or more bytes); the receives' slots are distinct, and the alias is
                            // leaked, never freed (`Aliases`), once the exchange is queued.
                            aliases.0.push(unsafe {
                                side.upgrade_device_ptr::<u8>(to + (p * b) as u64, b)
                            });
                        }
                        let mut recvs: Vec<_> = rm
                            .recvs
                            .iter()
                            .zip(aliases.0.iter_mut())
                            .map(|(t, a)| (t.peer, a.as_view_mut()))
                            .collect();
                        coll.exchange(Group::Ep, &sends, &mut recvs, &on_side)?;
                    }
                    let olds: Vec<(usize, usize)> = src
                        .iter()
                        .enumerate()
                        .filter_map(|(p, x)| match x {
                            Src::Old(q) => Some((p, *q)),
                            _ => None,
                        })
                        .collect();
                    for (d, s0, n) in runs(&olds) {
                        copy(side, to + (d * b) as u64, from + (s0 * b) as u64, n * b)?;
                    }
                    for (p, x) in src.iter().enumerate() {
                        if let Src::Local(q) = x {
                            copy(side, to + (p * b) as u64, to + (q * b) as u64, b)?;
                        }
                    }
                    let used = local * b;
                    copy(side, to + used as u64, from + used as u64, buf.len() - used)?;
                    staged_bytes += buf.len() as u64;
                }
                Stage::Changed(buf) => {
                    let to = buf.device_ptr(side).0;
                    for (k, &p) in slots.iter().enumerate() {
                        let Src::Old(q) = src[p] else {
                            return Err(Error::Placement(
                                "a borrowed param's expert is not on this rank".into(),
                            ));
                        };
                        copy(side, to + (k * b) as u64, from + (q * b) as u64, b)?;
                    }
                    staged_bytes += buf.len() as u64;
                }
            }
        }
        let ready = side.record_event(None).map_err(drv("cuEventRecord"))?;
        Ok(Staged {
            plan: plan.clone(),
            side: side.clone(),
            stages,
            slots,
            ready,
            staged_bytes,
        })
    }

    /// Swap a staged rearrangement in, between two forwards: the layer's stream waits for the
    /// staging (no host sync), whole buffers are exchanged (the old ones are freed in the layer
    /// stream's order, after the forwards already queued), borrowed params get their changed slots
    /// copied in, and the map switches.
    pub fn commit(&mut self, staged: Staged) -> Result<MoveReport> {
        self.check_plan(&staged.plan)?;
        let main = self.stream()?;
        main.wait(&staged.ready).map_err(drv("cuStreamWaitEvent"))?;
        let ranks = staged.plan.ranks();
        let mut report = MoveReport {
            slots_written: staged.slots.len(),
            local_bytes: Vec::new(),
            sent: vec![0; ranks],
            received: vec![0; ranks],
        };
        if let Some(rm) = staged.plan.rank(self.rank()) {
            let per_slot = self.bytes_per_slot() as u64;
            for t in &rm.sends {
                report.sent[t.peer] += per_slot;
            }
            for t in &rm.recvs {
                report.received[t.peer] += per_slot;
            }
        }
        let Staged {
            plan,
            side,
            stages,
            slots,
            ..
        } = staged;
        let mut result = Ok(());
        let mut borrowed_staging = Vec::new();
        for (k, st) in stages.into_iter().enumerate() {
            let Some(e) = self.entry_mut(k) else {
                continue;
            };
            let b = e.bytes_per_expert;
            match st {
                Stage::Nothing => {}
                Stage::Whole(buf) => {
                    report
                        .local_bytes
                        .push((e.name.clone(), 2 * buf.len() as u64));
                    // The old buffer becomes the spare for the next staging.
                    e.storage.swap_buffer(buf);
                }
                Stage::Changed(buf) => {
                    let base = buf.device_ptr(&main).0;
                    let dst = e.storage.address();
                    for (j, &p) in slots.iter().enumerate() {
                        if result.is_ok() {
                            result = copy(&main, dst + (p * b) as u64, base + (j * b) as u64, b);
                        }
                    }
                    report
                        .local_bytes
                        .push((e.name.clone(), 4 * (b * slots.len()) as u64));
                    borrowed_staging.push(buf);
                }
            }
        }
        // Staging of borrowed params is freed on the side stream: order that after the copies in.
        let done = main.record_event(None).map_err(drv("cuEventRecord"))?;
        side.wait(&done).map_err(drv("cuStreamWaitEvent"))?;
        drop(borrowed_staging);
        if let Err(err) = result {
            self.mark_unusable();
            return Err(Error::Unusable(format!(
                "swap-in failed part-way ({err}); the layer must be re-placed before it serves"
            )));
        }
        self.set_placement(plan.new_map().clone());
        Ok(report)
    }

    fn stream(&self) -> Result<Arc<CudaStream>> {
        self.entries()
            .first()
            .map(|e| e.storage.stream().clone())
            .ok_or_else(|| Error::Placement("the store holds no params".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmoved_slots_copy_as_runs_and_receives_land_once() {
        let src = local_sources(&[0, 1, 2, 3, 4, 5], &[0, 1, 3, 2, 4, 5], &[]).unwrap_or_default();
        let olds: Vec<(usize, usize)> = src
            .iter()
            .enumerate()
            .filter_map(|(p, x)| match x {
                Src::Old(q) => Some((p, *q)),
                _ => None,
            })
            .collect();
        assert_eq!(
            runs(&olds),
            vec![(0, 0, 2), (2, 3, 1), (3, 2, 1), (4, 4, 2)]
        );
        let t = |expert, at| Transfer {
            peer: 1,
            expert,
            at,
        };
        let src = local_sources(&[0, 1, 0], &[7, 1, 7], &[t(7, 0)]).unwrap_or_default();
        assert_eq!(src, vec![Src::Recv(0), Src::Old(1), Src::Local(0)]);
        assert!(local_sources(&[0, 0], &[1, 0], &[]).is_err());
    }
}
