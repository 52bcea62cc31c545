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

use crate::moves::MovePlan;
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

/// The slot each slot of `new` copies from in `old`: itself when unchanged, else the lowest slot
/// holding its expert.
fn sources(old: &[usize], new: &[usize]) -> Result<Vec<usize>> {
    (0..new.len())
        .map(|p| {
            if old[p] == new[p] {
                return Ok(p);
            }
            old.iter()
                .position(|&x| x == new[p])
                .ok_or_else(|| Error::Placement(format!("no slot holds expert {}", new[p])))
        })
        .collect()
}

/// Copy runs: maximal `(dst slot, src slot, slots)` ranges where consecutive slots read
/// consecutive sources.
fn runs(src: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (p, &q) in src.iter().enumerate() {
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
        self.check_plan(plan)?;
        if plan.ranks() != 1 {
            return Err(Error::MissingCollective {
                group: "ep",
                size: plan.ranks(),
            });
        }
        let old = plan.old().phy2log();
        let new = plan.new_map().phy2log();
        let src = sources(old, new)?;
        let slots: Vec<usize> = (0..old.len()).filter(|&p| old[p] != new[p]).collect();
        let main = self.stream()?;
        // Whole buffers are the params' spares (the buffers the last swap-in replaced) or new
        // allocations on the layer's stream; the side stream starts after everything already queued
        // there (forwards still reading a spare, a previous swap-in).
        let mut stages = Vec::new();
        let mut staged_bytes = 0u64;
        for e in self.entries() {
            let b = e.bytes_per_expert;
            let st = if slots.is_empty() || b == 0 {
                Stage::Nothing
            } else if e.storage.is_borrowed() {
                // SAFETY: every byte is written by the copies below before the swap-in reads it.
                Stage::Changed(
                    unsafe { side.alloc::<u8>(slots.len() * b) }.map_err(drv("cuMemAlloc"))?,
                )
            } else {
                // Every byte is written by the copies below (all slots, then the tail past the last
                // slot) before the buffer is swapped in.
                Stage::Whole(e.storage.take_spare()?)
            };
            stages.push(st);
        }
        let after = main.record_event(None).map_err(drv("cuEventRecord"))?;
        side.wait(&after).map_err(drv("cuStreamWaitEvent"))?;
        let pieces = runs(&src);
        for (e, st) in self.entries().iter().zip(&stages) {
            let b = e.bytes_per_expert;
            let from = e.storage.address();
            match st {
                Stage::Nothing => {}
                Stage::Whole(buf) => {
                    let to = buf.device_ptr(side).0;
                    for &(d, s, n) in &pieces {
                        copy(side, to + (d * b) as u64, from + (s * b) as u64, n * b)?;
                    }
                    let used = old.len() * b;
                    let tail = buf.len() - used;
                    copy(side, to + used as u64, from + used as u64, tail)?;
                    staged_bytes += buf.len() as u64;
                }
                Stage::Changed(buf) => {
                    let to = buf.device_ptr(side).0;
                    for (k, &p) in slots.iter().enumerate() {
                        copy(side, to + (k * b) as u64, from + (src[p] * b) as u64, b)?;
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
        let mut report = MoveReport {
            slots_written: staged.slots.len(),
            local_bytes: Vec::new(),
            sent: vec![0],
            received: vec![0],
        };
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
    fn unmoved_slots_copy_as_runs() {
        let old = [0, 1, 2, 3, 4, 5];
        let new = [0, 1, 3, 2, 4, 5];
        let src = sources(&old, &new).unwrap_or_default();
        assert_eq!(src, vec![0, 1, 3, 2, 4, 5]);
        assert_eq!(runs(&src), vec![(0, 0, 2), (2, 3, 1), (3, 2, 1), (4, 4, 2)]);
        let rep = sources(&[0, 1, 0], &[1, 0, 1]).unwrap_or_default();
        assert_eq!(rep, vec![1, 0, 1]);
        assert!(sources(&[0, 0], &[1, 0]).is_err());
    }
}
