//! The MoE layer's route + permute on the device (`codegen::moe::permute`): logical `topk_ids` to
//! EPLB slots, per-slot counts (and the EPLB load counters), row offsets, expert-sorted row indices
//! and gathered activations (bf16, or quantized to E4M3 on the fly: `permute::Gather`).
//! [`Permute::load`] JITs the module's four kernels through the driver's linker; [`Permute::run`] checks the buffers' sizes and queues the route, the scan and the
//! scatter on `dev.stream` (for few items, `Launch::small`, the route and the scan as one
//! one-CTA kernel), with no host synchronization between them and no memset: the scan leaves
//! `counts` and `errors[0]` zero for the next run, and the small path does not touch them.

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig};
use std::sync::Arc;

use moeforge_codegen::moe::permute::{
    self, Gather, Launch, ROUTE_ENTRY, ROUTE_SCAN_ENTRY, ROUTE_THREADS, SCAN_ENTRY, SCATTER_THREADS,
};

use crate::launch::KernelLaunch;
use crate::{Device, Error, Result};

/// The loaded route + permute kernels for one `(H, R)`.
pub struct Permute {
    _module: Arc<CudaModule>,
    route: CudaFunction,
    scan: CudaFunction,
    scatter: CudaFunction,
    /// Kernels A and B in one CTA, for few items.
    small: CudaFunction,
    launch: Launch,
}

impl std::fmt::Debug for Permute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permute({:?})", self.launch)
    }
}

/// The buffers of one [`Permute::run`]. `n = T * k` items; `E` experts, `R` slots.
#[derive(Debug)]
pub struct Buffers<'a> {
    /// Logical expert ids, i32 `[T, k]`.
    pub topk_ids: &'a CudaSlice<i32>,
    /// EPLB `log2phy`, i32 `[E, max_replicas]` (`-1` padded); the identity without EPLB.
    pub log2phy: &'a CudaSlice<i32>,
    /// EPLB `logcnt`, i32 `[E]`; all ones without EPLB.
    pub logcnt: &'a CudaSlice<i32>,
    /// Activations, bf16 bits `[T, H]`.
    pub x: &'a CudaSlice<u16>,
    /// Written: each item's slot (`-1` for an out-of-range one), i32 `[n]`.
    pub slot: &'a mut CudaSlice<i32>,
    /// Scratch: this run's items per slot, u32 `[R]`: zero on entry (a zeroed allocation, or as
    /// the previous run left it), zero again after the run (the offsets keep the counts).
    pub counts: &'a mut CudaSlice<u32>,
    /// Accumulated: the EPLB window's load counters, u32 `[R]` (never zeroed here).
    pub load: &'a mut CudaSlice<u32>,
    /// u32 `[2]`: `errors[0]` zero on entry (as for `counts`) and after; written: `errors[1]`, the
    /// items this run skipped as out of range.
    pub errors: &'a mut CudaSlice<u32>,
    /// Written: row offsets, i32 `[R + 1]`.
    pub offsets: &'a mut CudaSlice<i32>,
    /// Scratch: a cursor per slot, u32 `[R]` (zeroed by the scan).
    pub cursor: &'a mut CudaSlice<u32>,
    /// Written: the item of each expert-sorted row, i32 `[n]` (the first `offsets[R]`).
    pub row_of: &'a mut CudaSlice<i32>,
    /// Written: gathered rows (the first `offsets[R]`), what the grouped GEMM reads: bf16 `[n, H]`
    /// as bytes, or E4M3 codes `[n, H]` for a quantizing module.
    pub xs: &'a mut CudaSlice<u8>,
    /// Written by a quantizing module (required there, ignored otherwise): the rows' f32 scales,
    /// `n` (per token, static) or `ceil(H/128) * n` (per 1x128 group, group-major).
    pub scales: Option<&'a mut CudaSlice<f32>>,
    /// Read by the static form (required there, ignored otherwise): each slot's activation scale,
    /// f32 `[R]`, positive and finite.
    pub static_scales: Option<&'a CudaSlice<f32>>,
    /// Written: each item's expert-sorted row (`row_of`'s inverse), `-1` for a skipped item, i32
    /// `[n]`: what the combine reads.
    pub pos_of: &'a mut CudaSlice<i32>,
}

impl Permute {
    /// Generate the module for hidden size `hidden`, `slots` physical slots and gathered rows
    /// `gather`, JIT it for `dev` (Hopper, sm_90a, only) and load its four kernels. Errors: no
    /// driver or another architecture (`NoDriver`), a shape the generator refuses (`Codegen`),
    /// the JIT's.
    pub fn load(dev: &Device, hidden: u32, slots: u32, gather: Gather) -> Result<Permute> {
        crate::device::hopper_only(dev, "the MoE permute")?;
        let (ptx, launch) = permute::permute_module(hidden, slots, gather)?;
        let (module, [route, scan, scatter, small]) = crate::jit::load_entries(
            dev,
            &ptx,
            [
                ROUTE_ENTRY,
                SCAN_ENTRY,
                launch.scatter_entry(),
                ROUTE_SCAN_ENTRY,
            ],
        )?;
        Ok(Permute {
            route,
            scan,
            scatter,
            small,
            _module: module,
            launch,
        })
    }

    /// The launch shapes (H, R).
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// Route and permute `t` tokens of `k` choices over `experts` logical experts whose map rows
    /// hold `max_replicas` replicas. Queued on `dev.stream` (two or three kernels); returns without
    /// waiting. Errors (`Placement`): a buffer too small, `k` or `max_replicas` of 0, `t * k` or
    /// `E * max_replicas` past 32 bits; the launches'.
    ///
    /// # Safety
    /// The launches are asynchronous: no work on another stream may write the inputs, nor read or
    /// write the outputs and scratch, until this stream reaches the last kernel's end. Sizes are
    /// checked here, and every index the kernels form from the map is checked on the device, so
    /// they touch nothing outside the buffers. `counts` and `errors[0]` must be zero (see
    /// [`Buffers`]: zeroed when allocated, and left so by every completed run); else the offsets
    /// are wrong (the scatter still writes no position past `n`, and counts each such item in
    /// `errors[1]`).
    pub unsafe fn run(
        &self,
        dev: &Device,
        b: Buffers<'_>,
        t: usize,
        k: usize,
        experts: usize,
        max_replicas: usize,
    ) -> Result<()> {
        let bad = |why: String| Error::Placement(format!("permute: {why}"));
        let slots = self.launch.slots as usize;
        let h = self.launch.hidden as usize;
        if k == 0 || max_replicas == 0 {
            return Err(bad(format!("k = {k}, max_replicas = {max_replicas}")));
        }
        if k > permute::MAX_TOPK as usize {
            return Err(bad(format!(
                "top-k {k} (the scatter takes at most {} choices a token)",
                permute::MAX_TOPK
            )));
        }
        let n = t
            .checked_mul(k)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(format!("{t} tokens of {k} choices overflow 32 bits")))?;
        let map = experts
            .checked_mul(max_replicas)
            .filter(|m| u32::try_from(*m).is_ok())
            .ok_or_else(|| bad(format!("{experts} experts x {max_replicas} replicas")))?;
        let nz = n as usize;
        let gather = self.launch.gather;
        let row_bytes = nz
            .checked_mul(gather.row_bytes(h))
            .ok_or_else(|| bad(format!("{nz} rows of {h} overflow")))?;
        let scales_len = gather.scales_len(nz, h);
        let need = [
            ("topk_ids", b.topk_ids.len(), nz),
            ("log2phy", b.log2phy.len(), map),
            ("logcnt", b.logcnt.len(), experts),
            ("x", b.x.len(), t * h),
            ("slot", b.slot.len(), nz),
            ("counts", b.counts.len(), slots),
            ("load", b.load.len(), slots),
            ("errors", b.errors.len(), 2),
            ("offsets", b.offsets.len(), slots + 1),
            ("cursor", b.cursor.len(), slots),
            ("row_of", b.row_of.len(), nz),
            ("xs (bytes)", b.xs.len(), row_bytes),
            ("pos_of", b.pos_of.len(), nz),
        ];
        let (scales, statics) = match gather {
            Gather::Bf16 => (None, None),
            _ => {
                let s = b
                    .scales
                    .ok_or_else(|| bad("a quantizing permute needs `scales`".into()))?;
                let st = match (gather, b.static_scales) {
                    (Gather::Static, None) => {
                        return Err(bad("a static-scale permute needs `static_scales`".into()))
                    }
                    (Gather::Static, Some(v)) if v.len() < slots => {
                        return Err(bad(format!(
                            "`static_scales` has {} elements, needs at least {slots}",
                            v.len()
                        )))
                    }
                    (_, st) => st,
                };
                (Some(s), st)
            }
        };
        if let Some(s) = &scales {
            if s.len() < scales_len {
                return Err(bad(format!(
                    "`scales` has {} elements, needs at least {scales_len}",
                    s.len()
                )));
            }
        }
        for (what, got, want) in need {
            if got < want {
                return Err(bad(format!(
                    "`{what}` has {got} elements, needs at least {want}"
                )));
            }
        }
        let (k32, e32, m32) = (k as u32, experts as u32, max_replicas as u32);
        let cfg = |grid: u32, threads: u32| LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        if self.launch.small(n) {
            let mut l = KernelLaunch::new(dev, &self.small);
            l.buf(b.topk_ids)
                .buf(b.log2phy)
                .buf(b.logcnt)
                .buf_mut(&mut *b.slot)
                .buf_mut(&mut *b.load)
                .buf_mut(&mut *b.errors)
                .buf_mut(&mut *b.offsets)
                .buf_mut(&mut *b.cursor)
                .val(&n)
                .val(&k32)
                .val(&e32)
                .val(&m32);
            // SAFETY: the arguments match the small path's parameters in order (eight u64
            // pointers, then four u32). As kernels A and B: it reads items below `n` of
            // `topk_ids`, `logcnt[e]` for `e < E` and `log2phy[e * max_replicas + r]` with `r <
            // logcnt[e] <= max_replicas` (sizes checked above), writes `slot` below `n`, `load`
            // at slots below R, `errors[1]`, `offsets` below R + 1 and zeroes `cursor` below R
            // (each checked above); its counts live in its own shared memory (R + 1 words of the
            // static shared area). One CTA of `small_threads` threads (its `.maxntid`). The caller
            // keeps other streams off the buffers.
            unsafe { l.launch(cfg(1, self.launch.small_threads())) }?;
        } else {
            let mut l = KernelLaunch::new(dev, &self.route);
            l.buf(b.topk_ids)
                .buf(b.log2phy)
                .buf(b.logcnt)
                .buf_mut(&mut *b.slot)
                .buf_mut(&mut *b.counts)
                .buf_mut(&mut *b.load)
                .buf_mut(&mut *b.errors)
                .val(&n)
                .val(&k32)
                .val(&e32)
                .val(&m32);
            // SAFETY: the arguments match kernel A's parameters in order (seven u64 pointers,
            // then four u32). It reads items below `n` of `topk_ids` (>= n checked), `logcnt[e]`
            // for `e < E` (>= E checked), `log2phy[e * max_replicas + r]` with `r < logcnt[e] <=
            // max_replicas` (>= E * max_replicas checked, which fits 32 bits), and writes `slot`
            // below `n` and `counts`/`load` at slots below R (each >= R checked), `errors[0]`.
            // The caller keeps other streams off the buffers.
            unsafe { l.launch(cfg(self.launch.route_grid(n), ROUTE_THREADS)) }?;
            let mut l = KernelLaunch::new(dev, &self.scan);
            l.buf_mut(&mut *b.counts)
                .buf_mut(&mut *b.offsets)
                .buf_mut(&mut *b.cursor)
                .buf_mut(&mut *b.errors);
            // SAFETY: kernel B's parameters are four u64 pointers, in this order; it reads and
            // zeroes `counts` and zeroes `cursor` below R, writes `offsets` below R + 1 and
            // `errors[0..2]` (sizes checked above), in one CTA of `scan_threads` threads (its
            // `.maxntid`).
            unsafe { l.launch(cfg(1, self.launch.scan_threads)) }?;
        }
        let mut l = KernelLaunch::new(dev, &self.scatter);
        l.buf(&*b.slot)
            .buf(&*b.offsets)
            .buf_mut(&mut *b.cursor)
            .buf(b.x)
            .buf_mut(&mut *b.row_of)
            .buf_mut(&mut *b.xs);
        // The quantizing form's scales and static scales (a null pointer where the form does not
        // read them).
        let null: u64 = 0;
        if let Some(s) = scales {
            l.buf_mut(s);
            match statics {
                Some(v) => l.buf(v),
                None => l.val(&null),
            };
        }
        let t32 = t as u32;
        let split = self.launch.scatter_split(t32, k32);
        l.buf_mut(&mut *b.pos_of)
            .buf_mut(&mut *b.errors)
            .val(&n)
            .val(&k32)
            .val(&split);
        // SAFETY: the arguments match kernel C's parameters in order (eight u64 pointers, or ten
        // for the quantizing form, whose `scales` and `static_scales` follow `xs`; then three
        // u32, `split` in 1..=k); of `errors` it adds to `errors[1]` only (>= 2 checked). A CTA
        // claims at most `k <= MAX_TOPK` items (checked above) in shared memory. It reads `slot` below `n`, and
        // for slots in [0, R) (kernel A wrote only those or -1) `offsets`, `cursor` and (static
        // form) `static_scales` below R (>= R checked; the other forms never read it); it writes
        // `pos_of` below `n` (>= n checked), and `row_of` (>= n), `xs` (>= n rows checked) and
        // the scales (per token and static at `pos`, per group at `group * n + pos`: >= the
        // form's `scales_len` checked) only at positions below `n` (checked on the device; with
        // zero counts on entry, positions `offsets[s] + cursor` stay below `offsets[R] <= n`
        // anyway, because each slot's cursor counts exactly that slot's items); `x` is read at
        // rows `i / k < t` (>= t * H checked). cudarc's allocations are 256-byte aligned, more
        // than the 16 bytes of the row copies (rows of 2H bytes, or H codes written 8 bytes a
        // thread, H a multiple of 8). The caller keeps other streams off the buffers.
        unsafe { l.launch(cfg(self.launch.scatter_grid(t32, split), SCATTER_THREADS)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver there is no device to load on (`NoDriver`); with one, sm_90a loads.
    #[test]
    fn load_without_a_driver_is_no_driver() {
        match Device::open(0) {
            Err(e) => assert!(matches!(e, Error::NoDriver(_)), "{e}"),
            Ok(dev) => match Permute::load(&dev, 7168, 32, Gather::Bf16) {
                Ok(p) => assert_eq!(p.launch().slots, 32),
                Err(e) => assert!(
                    matches!(e, Error::NoDriver(_))
                        && dev.target() != Some(moeforge_codegen::ptx::Target::Sm90a),
                    "{e}"
                ),
            },
        }
    }
}
