//! One rank's rearrangement of slot-major device buffers that are not a recipe's params: a GPU MoE
//! layer's GEMM operands (codes, weight scales, group scales, static activation scales), each
//! `slots x bytes_per_slot`, moved with one [`MovePlan`] so that every per-slot buffer follows the
//! same placement (a buffer left out would be exactly the stale derived state EPLB must never
//! leave). The copies are the parameter store's ([`crate::store::ExpertStorage::run_copies`] on a
//! [`DeviceStorage`] borrowing each buffer), queued on one stream.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::device_storage::DeviceStorage;
use crate::moves::MovePlan;
use crate::store::ExpertStorage;
use crate::{Error, Result};

/// One buffer: its device address and length in bytes (`slots` equal parts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotBuffer {
    /// Device address.
    pub ptr: u64,
    /// Bytes (a multiple of the slot count).
    pub len: usize,
}

/// Move every buffer of `buffers` from `plan`'s old placement to its new one, on `stream` (one rank:
/// a plan over more ranks is refused, as is a buffer that is not `slots` equal parts). Returns the
/// bytes read and written by the copies. The copies are queued, not waited for.
///
/// # Safety
/// Each buffer must be one live device allocation (or a part of one) of `stream`'s context that
/// outlives the call's queued work, written by nothing else meanwhile except through work ordered
/// on `stream`.
pub unsafe fn rearrange(
    stream: &Arc<CudaStream>,
    buffers: &[SlotBuffer],
    plan: &MovePlan,
) -> Result<u64> {
    if plan.ranks() != 1 {
        return Err(Error::Placement(format!(
            "slot buffers move on one rank; the plan spans {}",
            plan.ranks()
        )));
    }
    let slots = plan.local_slots();
    let rm = plan
        .rank(0)
        .ok_or_else(|| Error::Placement("the plan has no rank 0".into()))?;
    let mut moved = 0u64;
    for b in buffers {
        if slots == 0 || b.len % slots != 0 {
            return Err(Error::Placement(format!(
                "a buffer of {} bytes is not {slots} equal slots",
                b.len
            )));
        }
    }
    for b in buffers {
        let per = b.len / slots;
        if per == 0 || rm.copies.is_empty() {
            continue;
        }
        // SAFETY: the caller guarantees the allocation and its exclusive use through `stream`.
        let mut storage = unsafe { DeviceStorage::borrowed(stream, b.ptr, b.len) };
        let scratch = usize::from(rm.uses_scratch());
        let mut st = storage.staging(scratch.max(1), per)?;
        let mut tick = || Ok(());
        storage.run_copies(&mut st, &rm.copies, 0, per, &mut tick)?;
        storage.finish()?;
        moved += 2 * (per * rm.copies.len()) as u64;
    }
    Ok(moved)
}
