//! Asynchronous rearrangement on one GPU, what serving needs: the incoming experts of a layer are
//! staged on a side stream while forwards keep running on the layer's stream (slots in use are only
//! read, never written), then swapped in between two forwards: the layer's stream waits for the
//! staging event (no host synchronisation), copies the staged experts into their slots, and the map
//! switches. Only the swap-in is on the forward stream's critical path.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use crate::moves::MovePlan;
use crate::store::{DeviceStorage, ExpertStorage as _, MoveReport, ParamStore};
use crate::{drv, Error, Result};

/// A rearrangement staged on a side stream, waiting to be swapped in.
pub struct Staged {
    plan: MovePlan,
    side: Arc<CudaStream>,
    /// Per param: the staging buffer (one expert per changed slot, in slot order).
    bufs: Vec<Option<CudaSlice<u8>>>,
    /// Changed local slots, in staging order.
    slots: Vec<usize>,
    ready: CudaEvent,
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
}

fn copy(stream: &CudaStream, dst: u64, src: u64, len: usize) -> Result<()> {
    // SAFETY: callers pass ranges inside live allocations of this context (a param's slot, checked
    // by `ParamStore::placed` against its size, and a staging buffer allocated for exactly these
    // slots) that do not overlap, ordered on `stream` by events (see `stage`/`commit`).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
        .map_err(drv("cuMemcpyDtoDAsync"))
}

impl ParamStore<DeviceStorage> {
    /// Stage `plan` (one rank) on `side`: every changed slot's new expert is copied from a slot that
    /// holds it now into a staging buffer. The store keeps serving; nothing it holds is written.
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
        let slots: Vec<usize> = (0..old.len()).filter(|&p| old[p] != new[p]).collect();
        // Order the side stream after everything already queued on the layer's stream (a previous
        // swap-in's writes).
        let main = self.stream()?;
        let after = main.record_event(None).map_err(drv("cuEventRecord"))?;
        side.wait(&after).map_err(drv("cuStreamWaitEvent"))?;
        let mut bufs = Vec::new();
        for e in self.entries() {
            let b = e.bytes_per_expert;
            if slots.is_empty() || b == 0 {
                bufs.push(None);
                continue;
            }
            // SAFETY: every byte of the staging buffer is written by the copies below before the
            // swap-in reads it.
            let buf = unsafe { side.alloc::<u8>(slots.len() * b) }.map_err(drv("cuMemAlloc"))?;
            let base = buf.device_ptr(side).0;
            let src = e.storage.address();
            for (k, &p) in slots.iter().enumerate() {
                let q = old
                    .iter()
                    .position(|&x| x == new[p])
                    .ok_or_else(|| Error::Placement(format!("no slot holds expert {}", new[p])))?;
                copy(side, base + (k * b) as u64, src + (q * b) as u64, b)?;
            }
            bufs.push(Some(buf));
        }
        let ready = side.record_event(None).map_err(drv("cuEventRecord"))?;
        Ok(Staged {
            plan: plan.clone(),
            side: side.clone(),
            bufs,
            slots,
            ready,
        })
    }

    /// Swap a staged rearrangement in, between two forwards: the layer's stream waits for the
    /// staging (no host sync), copies the staged experts into their slots, and the map switches.
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
        let mut result = Ok(());
        for (e, buf) in self.entries().iter().zip(&staged.bufs) {
            let b = e.bytes_per_expert;
            let Some(buf) = buf else {
                continue;
            };
            let base = buf.device_ptr(&main).0;
            let dst = e.storage.address();
            for (k, &p) in staged.slots.iter().enumerate() {
                if result.is_ok() {
                    result = copy(&main, dst + (p * b) as u64, base + (k * b) as u64, b);
                }
            }
            report
                .local_bytes
                .push((e.name.clone(), 4 * (b * staged.slots.len()) as u64));
        }
        // The staging buffers are freed on the side stream: order that after the swap-in copies.
        let done = main.record_event(None).map_err(drv("cuEventRecord"))?;
        staged.side.wait(&done).map_err(drv("cuStreamWaitEvent"))?;
        if let Err(err) = result {
            self.mark_unusable();
            return Err(Error::Unusable(format!(
                "swap-in failed part-way ({err}); the layer must be re-placed before it serves"
            )));
        }
        self.set_placement(staged.plan.new_map().clone());
        Ok(report)
    }

    fn stream(&self) -> Result<Arc<CudaStream>> {
        self.entries()
            .first()
            .map(|e| e.storage.stream().clone())
            .ok_or_else(|| Error::Placement("the store holds no params".into()))
    }
}
