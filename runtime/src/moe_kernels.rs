//! The MoE layer's activation and combine kernels on the device (`codegen::moe::act`,
//! `codegen::moe::combine`): between the grouped GEMMs, [`MoeAct`] turns the first GEMM's f32
//! output (or bf16 rows) into the second GEMM's input (bf16, or E4M3 codes with per-token, per
//! 1x128-group or static per-row scales); after them, [`MoeCombine`] gathers per-row scales and
//! sums each token's rows with its top-k weights (finding them through the permute's `pos_of`). `load` JITs a
//! module through the driver's linker; every launch checks the buffers' sizes first and is queued
//! on `dev.stream` with no host synchronization (row counts are read on the device from the
//! grouped GEMM's offsets).

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig};
use std::sync::Arc;

use moeforge_codegen::moe::act::{self, ActIn, ActLaunch, ActOut, ACT_ENTRY};
use moeforge_codegen::moe::combine::{self, CombineLaunch, COMBINE_ENTRY, ROW_SCALES_ENTRY};

use crate::launch::KernelLaunch;
use crate::{Device, Error, Result};

fn cfg(grid: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `n` as a u32 kernel argument, or `Placement` naming it.
fn to_u32(what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Placement(format!("`{what}` = {n} does not fit 32 bits")))
}

/// `Placement` for each `(name, elements, needed)` with fewer elements than needed.
fn check_sizes(kernel: &str, need: &[(&str, usize, usize)]) -> Result<()> {
    for &(what, got, want) in need {
        if got < want {
            return Err(Error::Placement(format!(
                "{kernel}: `{what}` has {got} elements, needs at least {want}"
            )));
        }
    }
    Ok(())
}

/// The loaded activation kernel for one `(input, output, W)`.
pub struct MoeAct {
    _module: Arc<CudaModule>,
    func: CudaFunction,
    launch: ActLaunch,
}

impl std::fmt::Debug for MoeAct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeAct({:?})", self.launch)
    }
}

impl MoeAct {
    /// Generate the activation kernel of `(input, output)` at width `width`, JIT it for `dev`
    /// (Hopper, sm_90a, only) and load it. Errors: no driver or another architecture
    /// (`NoDriver`), a width the generator refuses (0, not a multiple of 8, past 16384:
    /// `Codegen`), the JIT's.
    pub fn load(dev: &Device, input: ActIn, output: ActOut, width: u32) -> Result<MoeAct> {
        crate::device::hopper_only(dev, "the MoE activation kernel")?;
        let (ptx, launch) = act::act_module(input, output, width)?;
        let (module, [func]) = crate::jit::load_entries(dev, &ptx, [ACT_ENTRY])?;
        Ok(MoeAct {
            _module: module,
            func,
            launch,
        })
    }

    /// The launch shape (input, output, W, threads).
    pub fn launch(&self) -> &ActLaunch {
        &self.launch
    }

    /// The rows `r < min(offsets[slots], max_rows)` of `src` (f32 `[max_rows, 2W]` for SiluMul,
    /// bf16 `[max_rows, W]` for Bf16, as bytes) into `dst` (bf16 or E4M3 `[max_rows, W]`, as
    /// bytes) and, for quantized output, `scales` ([`ActLaunch::scales_len`]`(max_rows)` f32:
    /// written per token and per group, **read** for `StaticRow`; `None` is allowed for bf16
    /// output only). `offsets` holds the grouped GEMM's `slots + 1` row offsets. Queued on
    /// `dev.stream`; returns without waiting. Errors (`Placement`): a buffer too small, missing
    /// scales, `slots`, `max_rows` or the scale count past 32 bits; the launch's.
    ///
    /// # Safety
    /// The launch is asynchronous: no work on another stream may write `src`, `offsets` or (for
    /// `StaticRow`) `scales`, nor touch `dst` and written `scales`, until this stream reaches the
    /// kernel's end. Sizes are checked here and the kernel's row count is capped by `max_rows` on
    /// the device, so it touches nothing outside the buffers.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        dev: &Device,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
        scales: Option<&mut CudaSlice<f32>>,
        offsets: &CudaSlice<i32>,
        slots: usize,
        max_rows: usize,
    ) -> Result<()> {
        let l = &self.launch;
        let bad = |why: String| Error::Placement(format!("moe activation: {why}"));
        let slots32 = to_u32("slots", slots)?;
        let rows32 = to_u32("max_rows", max_rows)?;
        let ns = l.scales_len(max_rows);
        to_u32("scales", ns)?;
        let src_need = max_rows
            .checked_mul(l.src_row_bytes())
            .ok_or_else(|| bad(format!("{max_rows} source rows overflow")))?;
        let dst_need = max_rows
            .checked_mul(l.dst_row_bytes())
            .ok_or_else(|| bad(format!("{max_rows} output rows overflow")))?;
        check_sizes(
            "moe activation",
            &[
                ("src", src.len(), src_need),
                ("dst", dst.len(), dst_need),
                ("offsets", offsets.len(), slots + 1),
            ],
        )?;
        let grid = l.grid(rows32);
        let null = 0u64;
        let mut b = KernelLaunch::new(dev, &self.func);
        b.buf(src).buf_mut(&mut *dst);
        match scales {
            Some(s) => {
                check_sizes("moe activation", &[("scales", s.len(), ns)])?;
                b.buf_mut(s);
            }
            None if ns == 0 => {
                b.val(&null);
            }
            None => {
                return Err(bad(format!(
                    "{:?} output needs {ns} scales, none given",
                    l.output
                )))
            }
        }
        b.buf(offsets).val(&slots32).val(&rows32);
        // SAFETY: the arguments match the kernel's parameters in order (four u64 pointers, a null
        // one only for bf16 output, which never reads it; then two u32). It reads `offsets[slots]`
        // (>= slots + 1 checked) and handles rows below `min(offsets[slots], max_rows)`: `src`
        // (>= max_rows source rows), `dst` (>= max_rows output rows) and `scales` (>=
        // scales_len(max_rows), indices `group * max_rows + row` below it) in bounds. cudarc's
        // allocations are 256-byte aligned, more than the 16-byte vectors (rows of whole 16- or
        // 8-byte chunks, W a multiple of 8). The caller keeps other streams off the buffers.
        unsafe { b.launch(cfg(grid, l.threads)) }?;
        Ok(())
    }
}

/// The loaded row-scales and combine kernels for one hidden size.
pub struct MoeCombine {
    _module: Arc<CudaModule>,
    row_scales: CudaFunction,
    combine: CudaFunction,
    launch: CombineLaunch,
}

impl std::fmt::Debug for MoeCombine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeCombine({:?})", self.launch)
    }
}

impl MoeCombine {
    /// Generate the module for hidden size `hidden`, JIT it for `dev` (Hopper, sm_90a, only) and
    /// load its two kernels. Errors: no driver or another architecture (`NoDriver`), a hidden
    /// size the generator refuses (`Codegen`), the JIT's.
    pub fn load(dev: &Device, hidden: u32) -> Result<MoeCombine> {
        crate::device::hopper_only(dev, "the MoE combine kernels")?;
        let (ptx, launch) = combine::combine_module(hidden)?;
        let (module, [row_scales, combine]) =
            crate::jit::load_entries(dev, &ptx, [ROW_SCALES_ENTRY, COMBINE_ENTRY])?;
        Ok(MoeCombine {
            row_scales,
            combine,
            _module: module,
            launch,
        })
    }

    /// The launch shapes (H, threads).
    pub fn launch(&self) -> &CombineLaunch {
        &self.launch
    }

    /// `out[r] = values[slot[row_of[r]]]` (1.0 where an index is out of range) for the rows `r <
    /// min(offsets[slots], n)`; the rest of `out` is left untouched. Queued on `dev.stream`.
    /// Errors (`Placement`): a buffer too small, `slots` or `n` past 32 bits; the launch's.
    ///
    /// # Safety
    /// As [`MoeAct::run`]: no other stream may write the inputs, nor touch `out`, until this
    /// stream reaches the kernel's end. Sizes are checked, and every index is checked on the
    /// device.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_scales(
        &self,
        dev: &Device,
        row_of: &CudaSlice<i32>,
        slot: &CudaSlice<i32>,
        values: &CudaSlice<f32>,
        offsets: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
        slots: usize,
        n: usize,
    ) -> Result<()> {
        let (slots32, n32) = (to_u32("slots", slots)?, to_u32("n", n)?);
        check_sizes(
            "moe row scales",
            &[
                ("row_of", row_of.len(), n),
                ("slot", slot.len(), n),
                ("values", values.len(), slots),
                ("offsets", offsets.len(), slots + 1),
                ("out", out.len(), n),
            ],
        )?;
        let mut b = KernelLaunch::new(dev, &self.row_scales);
        b.buf(row_of)
            .buf(slot)
            .buf(values)
            .buf(offsets)
            .buf_mut(&mut *out)
            .val(&slots32)
            .val(&n32);
        // SAFETY: the arguments match the row-scales kernel's parameters in order (five u64
        // pointers, two u32). It reads `offsets[slots]` (>= slots + 1 checked), `row_of` and
        // writes `out` below `min(offsets[slots], n)` (both >= n checked), reads `slot[i]` only
        // for `i` in `[0, n)` (>= n) and `values[s]` only for `s` in `[0, slots)` (>= slots). The
        // caller keeps other streams off the buffers.
        unsafe { b.launch(cfg(self.launch.index_grid(n32), self.launch.index_threads)) }?;
        Ok(())
    }

    /// `out[t, c] = bf16(sum_j w[t k + j] * y[pos_of[t k + j], c])` (f32, `j` in order, skipping
    /// positions outside `[0, n)`) for `t` tokens of `k` choices; `y` holds `n` rows of `H` f32, as
    /// bytes (what the grouped GEMM writes).
    /// Queued on `dev.stream`. Errors (`Placement`): a buffer too small, `t * k`, `t` or `n` past
    /// 32 bits; the launch's.
    ///
    /// # Safety
    /// As [`MoeAct::run`]: no other stream may write the inputs, nor touch `out`, until this
    /// stream reaches the kernel's end. Sizes are checked, and every position is checked on the
    /// device.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine(
        &self,
        dev: &Device,
        y: &CudaSlice<u8>,
        pos_of: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        t: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let bad = |why: String| Error::Placement(format!("moe combine: {why}"));
        let h = self.launch.hidden as usize;
        let items = t
            .checked_mul(k)
            .filter(|i| u32::try_from(*i).is_ok())
            .ok_or_else(|| bad(format!("{t} tokens of {k} choices overflow 32 bits")))?;
        let (t32, k32, n32) = (to_u32("t", t)?, to_u32("k", k)?, to_u32("n", n)?);
        let y_need = n
            .checked_mul(h)
            .ok_or_else(|| bad(format!("{n} rows of {h} overflow")))?;
        let out_need = t
            .checked_mul(h)
            .ok_or_else(|| bad(format!("{t} tokens of {h} overflow")))?;
        check_sizes(
            "moe combine",
            &[
                ("y (bytes)", y.len() / 4, y_need),
                ("pos_of", pos_of.len(), items),
                ("weights", weights.len(), items),
                ("out", out.len(), out_need),
            ],
        )?;
        let mut b = KernelLaunch::new(dev, &self.combine);
        b.buf(y)
            .buf(pos_of)
            .buf(weights)
            .buf_mut(&mut *out)
            .val(&t32)
            .val(&k32)
            .val(&n32);
        // SAFETY: the arguments match the combine kernel's parameters in order (four u64
        // pointers, three u32). It reads `pos_of` and `weights` below `t k` (both >= t k checked,
        // which fits 32 bits), `y` rows `p` in `[0, n)` only (>= n H checked), and writes `out`
        // rows below `t` (>= t H). cudarc's allocations are 256-byte aligned, more than the 16
        // bytes of the vectors (rows of 4H and 2H bytes, H a multiple of 8). The caller keeps
        // other streams off the buffers.
        unsafe {
            b.launch(cfg(
                self.launch.combine_grid(t32),
                self.launch.combine_threads,
            ))
        }?;
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
            Ok(dev) => {
                let sm90 = dev.target() == Some(moeforge_codegen::ptx::Target::Sm90a);
                match MoeAct::load(&dev, ActIn::SiluMul, ActOut::Group128, 2048) {
                    Ok(a) => assert_eq!(a.launch().width, 2048),
                    Err(e) => assert!(matches!(e, Error::NoDriver(_)) && !sm90, "{e}"),
                }
                match MoeCombine::load(&dev, 7168) {
                    Ok(c) => assert_eq!(c.launch().hidden, 7168),
                    Err(e) => assert!(matches!(e, Error::NoDriver(_)) && !sm90, "{e}"),
                }
            }
        }
    }
}
