//! Device storage for the parameter store: one param's allocation, owned or borrowed, and how a
//! rearrangement runs over it: received experts land in one contiguous staging buffer (NCCL
//! receives into disjoint ranges of it), and the local copies run either as one chunked copy-list
//! launch per param ([`CopyKernel`]: the whole list per column, a cycle's scratch in registers) or,
//! without a loaded kernel, as one `cuMemcpyDtoDAsync` per copy with the scratch in staging.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::collective::{DeviceCollective, Group};
use crate::copy_kernel::{CopyKernel, Region};
use crate::device::Device;
use crate::moves::Copy;
use crate::store::{copy_each, range, ExpertStorage, Place};
use crate::{drv, Error, Result};

/// A device allocation and the stream its copies are queued on: owned (freed on drop) or borrowed
/// from the caller (a serving process's tensor; never freed here).
pub struct DeviceStorage {
    buf: Option<CudaSlice<u8>>,
    borrowed: bool,
    stream: Arc<CudaStream>,
    kernel: Option<Arc<CopyKernel>>,
    /// The buffer an async swap-in replaced, kept as the next staging buffer (a second copy of the
    /// param, as vLLM's async mode keeps one layer's buffer): no allocation or free per move.
    spare: std::sync::Mutex<Option<CudaSlice<u8>>>,
    /// A stream of its own for the copy list of a small param (up to a few MiB per expert: too few
    /// 16 KiB columns to fill the GPU, so the launch is latency-bound), so that it overlaps the large
    /// params' launches on the main stream.
    aux: Option<Arc<CudaStream>>,
    /// Whether small params run on their side streams (the default; `false` keeps the launches of
    /// params that exchanged no experts on the main stream, [`DeviceStorage::with_side_stream`]:
    /// one that received experts over a collective still forks after its exchange).
    side: bool,
    /// The event the main stream waits for at [`ExpertStorage::finish`].
    pending: Option<cudarc::driver::CudaEvent>,
    /// Recorded on the main stream after this param's exchange: its copies then run on the side
    /// stream from there, overlapping the next params' exchanges instead of queueing behind them.
    exchanged: std::sync::Mutex<Option<cudarc::driver::CudaEvent>>,
}

/// Params of at most this many bytes per expert run their copy list on their own stream: below
/// about 132 x 16 KiB columns a launch cannot fill an H200 (ncu: a 56-CTA launch at 0.11 waves, 22%
/// of DRAM throughput).
pub const SMALL_EXPERT_BYTES: usize = 4 << 20;

impl DeviceStorage {
    /// Own `buf`; copies go on `stream`.
    pub fn owned(buf: CudaSlice<u8>, stream: Arc<CudaStream>) -> DeviceStorage {
        DeviceStorage {
            buf: Some(buf),
            borrowed: false,
            stream,
            kernel: None,
            spare: std::sync::Mutex::new(None),
            aux: None,
            side: true,
            pending: None,
            exchanged: std::sync::Mutex::new(None),
        }
    }

    /// Adopt `len` bytes at device address `ptr` without copying them, for as long as the store
    /// lives; they are not freed on drop.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one live device allocation (or a part of one) of `stream`'s context
    /// that outlives the returned storage, and nothing else may write it while the store is used
    /// except through work ordered on `stream`.
    pub unsafe fn borrowed(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> DeviceStorage {
        // SAFETY: the caller guarantees the allocation (see above); the slice is leaked on drop
        // (`Drop for DeviceStorage`), so it never frees memory it does not own.
        let buf = unsafe { stream.upgrade_device_ptr::<u8>(ptr, len) };
        DeviceStorage {
            buf: Some(buf),
            borrowed: true,
            stream: stream.clone(),
            kernel: None,
            spare: std::sync::Mutex::new(None),
            aux: None,
            side: true,
            pending: None,
            exchanged: std::sync::Mutex::new(None),
        }
    }

    /// Run local copies with `kernel` (one launch per param) instead of one memcpy per copy.
    pub fn with_copy_kernel(mut self, kernel: Arc<CopyKernel>) -> DeviceStorage {
        self.kernel = Some(kernel);
        self
    }

    /// Run a small param's copy list on the main stream too (`side == false`) instead of a side
    /// stream of its own (the benchmark's comparison of the two, on one GPU); a param that
    /// exchanged experts still runs its copies on a side stream forked after the exchange.
    pub fn with_side_stream(mut self, side: bool) -> DeviceStorage {
        self.side = side;
        self
    }

    /// The side stream a small param's copy list runs on (made on first use).
    fn aux(&mut self) -> Result<Arc<CudaStream>> {
        if let Some(a) = &self.aux {
            return Ok(a.clone());
        }
        let a = self
            .stream
            .context()
            .new_stream()
            .map_err(drv("cuStreamCreate"))?;
        self.aux = Some(a.clone());
        Ok(a)
    }

    /// Whether the memory is the caller's ([`DeviceStorage::borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        self.borrowed
    }

    /// Replace an owned buffer by `buf` (same size) at an async swap-in; the old one becomes the
    /// spare (the next staging buffer; work queued on the stream before the swap may still read it,
    /// and the next staging is ordered after that work).
    pub(crate) fn swap_buffer(&mut self, buf: CudaSlice<u8>) {
        let old = self.buf.replace(buf);
        if let Ok(mut s) = self.spare.lock() {
            *s = old;
        }
    }

    /// A whole-param staging buffer: the spare when there is one of the right size, else a new
    /// allocation on the param's stream.
    pub(crate) fn take_spare(&self) -> Result<CudaSlice<u8>> {
        let n = ExpertStorage::len(self);
        if let Some(b) = self.spare.lock().ok().and_then(|mut s| s.take()) {
            if b.len() == n {
                return Ok(b);
            }
        }
        // SAFETY: every byte is written by the staging copies before the buffer is swapped in.
        unsafe { self.stream.alloc::<u8>(n) }.map_err(drv("cuMemAlloc"))
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The bytes, if still held.
    pub fn slice(&self) -> Option<&CudaSlice<u8>> {
        self.buf.as_ref()
    }

    /// Copy the bytes to the host (waits for the stream).
    pub fn download(&self) -> Result<Vec<u8>> {
        let b = self
            .buf
            .as_ref()
            .ok_or(Error::Placement("storage released".into()))?;
        self.stream.clone_dtoh(b).map_err(drv("cuMemcpyDtoH"))
    }

    fn ptr(&self) -> Result<u64> {
        let b = self
            .buf
            .as_ref()
            .ok_or(Error::Placement("storage released".into()))?;
        let (p, _sync) = b.device_ptr(&self.stream);
        Ok(p)
    }

    fn dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: both ranges were checked to lie inside live allocations of this context (the
        // param and its staging buffer; `range`), they do not overlap (distinct slots, or a slot and
        // the staging buffer), and the copy is ordered on the stream after every earlier use.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, len, self.stream.cu_stream()) }
            .map_err(drv("cuMemcpyDtoDAsync"))
    }
}

impl Drop for DeviceStorage {
    fn drop(&mut self) {
        if self.borrowed {
            if let Some(b) = self.buf.take() {
                // Borrowed memory belongs to the caller: forget it instead of freeing it.
                let _ = b.leak();
            }
        }
    }
}

/// A device staging buffer: `experts` experts of `unit` bytes, contiguous (received experts first,
/// then the scratch where one is needed).
pub struct DeviceStaging {
    buf: Option<CudaSlice<u8>>,
    unit: usize,
    experts: usize,
}

impl DeviceStaging {
    fn base(&self, stream: &CudaStream) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.device_ptr(stream).0)
    }

    fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }
}

/// Views over disjoint ranges of one allocation for the length of an exchange; leaked (never freed)
/// when dropped, since the allocation owns the memory.
pub(crate) struct Aliases(pub(crate) Vec<CudaSlice<u8>>);

impl Drop for Aliases {
    fn drop(&mut self) {
        for s in self.0.drain(..) {
            let _ = s.leak();
        }
    }
}

impl ExpertStorage for DeviceStorage {
    type Staging = DeviceStaging;
    type Transport = dyn DeviceCollective;

    fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    fn address(&self) -> u64 {
        self.ptr().unwrap_or(0)
    }

    fn staging(&self, experts: usize, bytes_per_expert: usize) -> Result<DeviceStaging> {
        let bytes = experts * bytes_per_expert;
        let buf = if bytes == 0 {
            None
        } else {
            // SAFETY: a staged expert is written (by a receive or a copy) before any byte of it is
            // read: the plan only reads transfer experts it received and the scratch after staging
            // it.
            Some(unsafe { self.stream.alloc::<u8>(bytes) }.map_err(drv("cuMemAlloc"))?)
        };
        Ok(DeviceStaging {
            buf,
            unit: bytes_per_expert,
            experts,
        })
    }

    fn needs_scratch(&self) -> bool {
        self.kernel.is_none()
    }

    fn copy(&mut self, st: &mut DeviceStaging, from: Place, to: Place, len: usize) -> Result<()> {
        let n = ExpertStorage::len(self);
        let main = self.ptr()?;
        let (sbase, slen) = (st.base(&self.stream), st.len());
        let at = |p: Place| -> Result<u64> {
            Ok(match p {
                Place::Main(o) => main + range("the param", o, len, n)?.start as u64,
                Place::Staging(o) => {
                    sbase + range("the staging buffer", o, len, slen)?.start as u64
                }
            })
        };
        self.dtod(at(to)?, at(from)?, len)
    }

    fn run_copies(
        &mut self,
        st: &mut DeviceStaging,
        copies: &[Copy],
        transfers: usize,
        len: usize,
        tick: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // This move's exchange event, taken first so that no later move can fork from it.
        let exchanged = self.exchanged.lock().ok().and_then(|mut e| e.take());
        let Some(kernel) = self.kernel.clone() else {
            // One memcpy per copy, the scratch in staging (the trait's default).
            return copy_each(self, st, copies, transfers, len, tick);
        };
        tick()?;
        if copies.is_empty() || len == 0 {
            return Ok(());
        }
        if transfers > st.experts || st.unit != len && transfers > 0 {
            return Err(Error::Placement(
                "the staging buffer does not hold the received experts".into(),
            ));
        }
        let region = Region {
            base: self.ptr()?,
            slots: ExpertStorage::len(self) / len,
            transfer: st.base(&self.stream),
            transfers,
            bytes_per_expert: len,
        };
        if (len > SMALL_EXPERT_BYTES || !self.side) && exchanged.is_none() {
            // SAFETY: `base..base + slots*len` is this param's live allocation and `transfer..
            // transfer + transfers*len` the staging buffer's (checked above), two distinct
            // allocations of this context; the launch is ordered on the stream after the exchange
            // that filled the staging.
            return unsafe { kernel.run(&self.stream, &region, copies) };
        }
        // A small param, or one that exchanged experts: fork a side stream after this param's
        // exchange (else after everything queued so far), run there, and let `finish` join it, so
        // it overlaps the later params' exchanges and launches (with the store's default order,
        // large params first, the large launches are queued before it and run ahead of it).
        let aux = self.aux()?;
        let fork = match exchanged {
            Some(ev) => ev,
            None => self
                .stream
                .record_event(None)
                .map_err(drv("cuEventRecord"))?,
        };
        aux.wait(&fork).map_err(drv("cuStreamWaitEvent"))?;
        // SAFETY: as above; the side stream is ordered after the main stream's work so far (the
        // event), and the main stream waits for it at `finish`, before anything reads the param.
        unsafe { kernel.run(&aux, &region, copies) }?;
        self.pending = Some(aux.record_event(None).map_err(drv("cuEventRecord"))?);
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(ev) = self.pending.take() {
            self.stream.wait(&ev).map_err(drv("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    fn exchange(
        &self,
        st: &mut DeviceStaging,
        t: &dyn DeviceCollective,
        sends: &[(usize, usize, usize)],
        recvs: &[(usize, usize, usize)],
        len: usize,
    ) -> Result<()> {
        // An event left by an earlier move (one that failed before its copies ran) must never
        // order this move's copies: they would not wait for the stream's later work.
        if let Ok(mut e) = self.exchanged.lock() {
            *e = None;
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let main = self
            .buf
            .as_ref()
            .ok_or(Error::Placement("storage released".into()))?;
        let mut out = Vec::with_capacity(sends.len());
        for &(peer, off, bytes) in sends {
            let r = range("the param", off, bytes, main.len())?;
            out.push((peer, main.slice(r)));
        }
        // Each receive fills its own range of the staging buffer, in the order given.
        let base = st.base(&self.stream);
        let size = st.len();
        let mut seen = vec![false; st.experts];
        let mut aliases = Aliases(Vec::with_capacity(recvs.len()));
        for &(_, off, bytes) in recvs {
            let r = range("the staging buffer", off, bytes, size)?;
            let unit = len.max(1);
            if !off.is_multiple_of(unit) || !bytes.is_multiple_of(unit) || bytes == 0 {
                return Err(Error::Placement(
                    "a receive is not a whole number of staged experts".into(),
                ));
            }
            for k in off / unit..(off + bytes) / unit {
                if seen.get(k).copied().unwrap_or(true) {
                    return Err(Error::Placement(
                        "receives must fill distinct staged experts".into(),
                    ));
                }
                seen[k] = true;
            }
            // SAFETY: `base + r.start .. base + r.end` lies inside the live staging allocation
            // (checked by `range`), the ranges of distinct receives are disjoint (checked above),
            // and the alias is leaked, never freed (`Aliases`), once the exchange is queued.
            aliases.0.push(unsafe {
                self.stream
                    .upgrade_device_ptr::<u8>(base + r.start as u64, bytes)
            });
        }
        let mut recv: Vec<(usize, cudarc::driver::CudaViewMut<'_, u8>)> = recvs
            .iter()
            .zip(aliases.0.iter_mut())
            .map(|(&(peer, _, _), a)| (peer, a.as_view_mut()))
            .collect();
        t.exchange(Group::Ep, &out, &mut recv, &Device::on_stream(&self.stream))?;
        let ev = self
            .stream
            .record_event(None)
            .map_err(drv("cuEventRecord"))?;
        if let Ok(mut e) = self.exchanged.lock() {
            *e = Some(ev);
        }
        Ok(())
    }
}
