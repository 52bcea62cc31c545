//! The batched form of the copy-list kernel: a rank's local copy list turned into one *parallel
//! assignment* (every slot whose content changes, with the location its new bytes were in before
//! the move), run so that, for every byte offset inside an expert, all the sources are read before
//! any destination is written.
//!
//! The sequential list of [`crate::moves::Copy`] (cycles broken through a scratch expert) has a data
//! dependence from one copy to the next, so the column form ([`crate::copy_kernel`]) keeps one copy
//! of each thread in flight at a time: a small param (a few MiB per expert or less) is then a chain
//! of dependent DRAM round trips, and a large one keeps only 64 bytes a thread in flight. Here
//! [`parallel`] resolves the list on the host into `dst <- src` pairs that read only the bytes as
//! they were before the move (no scratch: a cycle is one more pair), and the kernel runs them
//! **chunk by chunk**: a CTA owns a contiguous range of unit offsets (the same offsets in every
//! expert, balanced over the grid to within a 32-unit block), and for each chunk of `chunk` units
//! of that range it loads the chunk of **every** source into shared memory, waits, then stores
//! every destination. Offsets of different CTAs are disjoint, so no CTA reads what another writes;
//! inside a CTA the barrier between the two phases orders them.
//!
//! Two flavours share that plan:
//! - [`Flavour::CpAsync`]: every thread issues `cp.async` (16 or 4 bytes, global -> shared) for
//!   its units of every source, waits for its groups, then `bar.sync`, `ld.shared` and `st.global`;
//!   widths 16 and 4.
//! - [`Flavour::Bulk`]: one thread issues a `cp.async.bulk` (TMA bulk copy) a source into shared
//!   memory, completing on an mbarrier, then a bulk store a destination, and waits for the stores
//!   to have read shared memory before the next chunk; width 16 only.
//!
//! [`simulate`] is the kernel's index arithmetic on host bytes; the tests hold it, and
//! [`parallel`], to [`crate::moves::apply_local`].

use std::fmt::Write as _;

use crate::moves::{Copy, Loc};
use crate::{Error, Result};

/// Units of a balancing block: CTA ranges start and end on multiples of this many units, so a
/// warp's accesses stay aligned.
pub const BLOCK_UNITS: u64 = 32;

/// Shared memory an SM holds for CTAs (H100/H200: 228 KiB, of which each CTA reserves 1 KiB).
const SM_SHARED: u64 = 228 * 1024;

/// Threads of a [`Flavour::CpAsync`] CTA (at most).
pub const CPASYNC_THREADS: u32 = 256;

/// How a chunk's bytes travel between global and shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flavour {
    /// `cp.async` by every thread, then `ld.shared` + `st.global`.
    CpAsync,
    /// `cp.async.bulk` (TMA) loads and stores, issued by one thread.
    Bulk,
}

impl Flavour {
    /// Entry-name stem.
    fn stem(self) -> &'static str {
        match self {
            Flavour::CpAsync => "moeforge_copy_batch",
            Flavour::Bulk => "moeforge_copy_bulk",
        }
    }

    /// The entry for unit width `w`, if the flavour has one.
    pub fn entry(self, w: u64) -> Option<String> {
        match (self, w) {
            (Flavour::CpAsync, 16 | 4) | (Flavour::Bulk, 16) => {
                Some(format!("{}_w{w}", self.stem()))
            }
            _ => None,
        }
    }
}

/// Resolve a sequential copy list into the parallel assignment it performs: for every slot whose
/// bytes change, the location (a slot or a transfer expert) its new bytes were in **before** the
/// list ran. Sorted by destination slot; slots the list leaves as they were are not in it. Errors
/// as [`crate::moves::apply_local`] does (a read of the scratch before it was written, a copy into the
/// transfer buffer).
pub fn parallel(copies: &[Copy]) -> Result<Vec<Copy>> {
    use std::collections::BTreeMap;
    // What each written location holds now, as a location of the original bytes.
    let mut holds: BTreeMap<usize, Loc> = BTreeMap::new();
    let mut scratch: Option<Loc> = None;
    for c in copies {
        let v = match c.from {
            Loc::Slot(p) => holds.get(&p).copied().unwrap_or(Loc::Slot(p)),
            Loc::Transfer(k) => Loc::Transfer(k),
            Loc::Scratch => scratch.ok_or_else(|| {
                Error::Placement("copy from the scratch before anything was staged in it".into())
            })?,
        };
        match c.to {
            Loc::Slot(p) => {
                holds.insert(p, v);
            }
            Loc::Scratch => scratch = Some(v),
            Loc::Transfer(_) => {
                return Err(Error::Placement("a copy into the transfer buffer".into()))
            }
        }
    }
    Ok(holds
        .into_iter()
        .filter(|&(p, v)| v != Loc::Slot(p))
        .map(|(p, v)| Copy {
            from: v,
            to: Loc::Slot(p),
        })
        .collect())
}

/// How one batched launch covers a param.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchGeometry {
    /// The flavour.
    pub flavour: Flavour,
    /// Bytes per unit (16 or 4).
    pub width: u64,
    /// Units per expert (`bytes_per_expert / width`, exact).
    pub units: u64,
    /// Threads per CTA.
    pub threads: u32,
    /// CTAs launched.
    pub grid: u32,
    /// Units of a chunk (a multiple of [`BLOCK_UNITS`] unless the whole range is smaller).
    pub chunk: u64,
    /// Dynamic shared memory of a launch: the list, the mbarrier, `pairs x chunk x width` bytes.
    pub shared: u64,
}

/// Bytes the list takes at the start of shared memory (8 a pair, rounded up to 16), then 16 for the
/// mbarrier.
fn head_bytes(pairs: usize) -> u64 {
    (8 * pairs as u64).div_ceil(16) * 16 + 16
}

impl BatchGeometry {
    /// The geometry for `pairs` assignments over an expert of `bytes_per_expert` at `base` and
    /// `transfer` on `sms` SMs with `resident` CTAs an SM; `None` where the flavour has no entry
    /// for the widest unit that divides the sizes, or one unit of every source does not fit.
    pub fn new(
        flavour: Flavour,
        base: u64,
        transfer: u64,
        bytes_per_expert: usize,
        pairs: usize,
        sms: u32,
        resident: u32,
    ) -> Option<BatchGeometry> {
        let b = bytes_per_expert as u64;
        if b == 0 || pairs == 0 {
            return None;
        }
        let width = [16u64, 4].into_iter().find(|&w| {
            base.is_multiple_of(w) && transfer.is_multiple_of(w) && b.is_multiple_of(w)
        })?;
        flavour.entry(width)?;
        let units = b / width;
        let blocks = units.div_ceil(BLOCK_UNITS);
        let resident = u64::from(resident.clamp(1, 8));
        let cap = u64::from(sms.max(1)) * resident;
        let grid = blocks.clamp(1, cap);
        // The longest range a CTA gets.
        let range = (blocks.div_ceil(grid) * BLOCK_UNITS).min(units);
        let budget = (SM_SHARED / resident - 1024) / 16 * 16;
        let head = head_bytes(pairs);
        let room = budget.checked_sub(head)? / (pairs as u64 * width);
        let mut chunk = room.min(range);
        if chunk >= BLOCK_UNITS && chunk < range {
            chunk = chunk / BLOCK_UNITS * BLOCK_UNITS;
        }
        if chunk == 0 {
            return None;
        }
        let threads = match flavour {
            Flavour::Bulk => 32,
            Flavour::CpAsync => {
                (chunk.div_ceil(32) * 32).clamp(32, u64::from(CPASYNC_THREADS)) as u32
            }
        };
        Some(BatchGeometry {
            flavour,
            width,
            units,
            threads,
            grid: u32::try_from(grid).ok()?,
            chunk,
            shared: head + pairs as u64 * chunk * width,
        })
    }

    /// The unit range `[lo, hi)` of CTA `cta`.
    pub fn range(&self, cta: u64) -> (u64, u64) {
        let blocks = self.units.div_ceil(BLOCK_UNITS);
        let g = u64::from(self.grid);
        let b0 = cta * blocks / g;
        let b1 = (cta + 1) * blocks / g;
        (
            (b0 * BLOCK_UNITS).min(self.units),
            (b1 * BLOCK_UNITS).min(self.units),
        )
    }
}

/// The kernel's arithmetic on host bytes: `codes` are [`crate::copy_kernel::encode`]'s codes of a
/// [`parallel`] assignment. For each CTA and chunk, every source's chunk is read before any
/// destination's is written, as on the device.
pub fn simulate(
    g: &BatchGeometry,
    codes: &[u32],
    slots: &mut [u8],
    transfer: &[u8],
    bytes_per_expert: usize,
) -> Result<()> {
    use crate::copy_kernel::{INDEX_MASK, KIND_SLOT, KIND_TRANSFER};
    let w = g.width as usize;
    let oob = |what: &str, at: usize| Error::Placement(format!("{what} byte {at} out of range"));
    for cta in 0..u64::from(g.grid) {
        let (lo, hi) = g.range(cta);
        let mut u0 = lo;
        while u0 < hi {
            let m = g.chunk.min(hi - u0) as usize;
            let off = u0 as usize * w;
            let mut staged = Vec::with_capacity(codes.len() / 2);
            for pair in codes.chunks_exact(2) {
                let idx = (pair[0] & INDEX_MASK) as usize;
                let a = idx * bytes_per_expert + off;
                let from: &[u8] = match pair[0] >> 30 {
                    KIND_SLOT => slots,
                    KIND_TRANSFER => transfer,
                    _ => return Err(Error::Placement("a batched source is the scratch".into())),
                };
                staged.push(
                    from.get(a..a + m * w)
                        .ok_or_else(|| oob("load", a))?
                        .to_vec(),
                );
            }
            for (pair, bytes) in codes.chunks_exact(2).zip(staged) {
                if pair[1] >> 30 != KIND_SLOT {
                    return Err(Error::Placement("a batched store outside the slots".into()));
                }
                let a = (pair[1] & INDEX_MASK) as usize * bytes_per_expert + off;
                slots
                    .get_mut(a..a + m * w)
                    .ok_or_else(|| oob("store", a))?
                    .copy_from_slice(&bytes);
            }
            u0 += g.chunk;
        }
    }
    Ok(())
}

/// Append the batched entries (both flavours, every width they have) to a module that declares
/// `moeforge_copy_list_smem` (see [`crate::copy_kernel::ptx`]).
pub fn entries(s: &mut String) {
    for (f, w) in [
        (Flavour::CpAsync, 16u32),
        (Flavour::CpAsync, 4),
        (Flavour::Bulk, 16),
    ] {
        entry(s, f, w);
    }
}

fn entry(s: &mut String, f: Flavour, w: u32) {
    use crate::copy_kernel::{INDEX_MASK, KIND_SLOT};
    let name = f.entry(u64::from(w)).unwrap_or_default();
    let shift = w.trailing_zeros();
    let mut k = String::new();
    let _ = writeln!(
        k,
        ".visible .entry {name}(\n\
         \t.param .u64 p_base,\n\t.param .u64 p_transfer,\n\t.param .u64 p_list,\n\
         \t.param .u32 p_n,\n\t.param .u64 p_units,\n\t.param .u64 p_stride,\n\
         \t.param .u64 p_chunk\n)\n\
         .maxntid {CPASYNC_THREADS}, 1, 1\n{{\n\
         \t.reg .pred %p<8>;\n\t.reg .b32 %r<32>;\n\t.reg .b64 %rd<40>;\n\t.reg .b32 %v<4>;\n"
    );
    // Parameters: %rd0 base, %rd1 transfer, %rd2 list, %r0 n, %rd3 units, %rd4 stride, %rd5 chunk.
    k.push_str(
        "\tld.param.u64 %rd20, [p_base];\n\tcvta.to.global.u64 %rd0, %rd20;\n\
         \tld.param.u64 %rd21, [p_transfer];\n\tcvta.to.global.u64 %rd1, %rd21;\n\
         \tld.param.u64 %rd22, [p_list];\n\tcvta.to.global.u64 %rd2, %rd22;\n\
         \tld.param.u32 %r0, [p_n];\n\tld.param.u64 %rd3, [p_units];\n\
         \tld.param.u64 %rd4, [p_stride];\n\tld.param.u64 %rd5, [p_chunk];\n",
    );
    // The list into shared memory (as the column form): %r8 its base, %r10 threads.
    k.push_str(crate::copy_kernel::LIST_TO_SHARED);
    // %r20 the mbarrier (after the list, rounded up to 16), %r12 the staging (16 bytes further),
    // %r16 the bytes of one source's chunk row (chunk x width).
    let _ = writeln!(
        k,
        "\tshl.b32 %r20, %r0, 3;\n\tadd.u32 %r20, %r20, 15;\n\tand.b32 %r20, %r20, -16;\n\
         \tadd.u32 %r20, %r20, %r8;\n\tadd.u32 %r12, %r20, 16;\n\
         \tcvt.u32.u64 %r16, %rd5;\n\tshl.b32 %r16, %r16, {shift};"
    );
    // The CTA's range: blocks %rd7 = ceil(units / 32); [lo %rd10, hi %rd11).
    let _ = writeln!(
        k,
        "\tmov.u32 %r1, %ctaid.x;\n\tcvt.u64.u32 %rd8, %r1;\n\
         \tmov.u32 %r1, %nctaid.x;\n\tcvt.u64.u32 %rd6, %r1;\n\
         \tadd.u64 %rd7, %rd3, {bm1};\n\tshr.u64 %rd7, %rd7, {bs};\n\
         \tmul.lo.u64 %rd9, %rd8, %rd7;\n\tdiv.u64 %rd9, %rd9, %rd6;\n\
         \tadd.u64 %rd10, %rd8, 1;\n\tmul.lo.u64 %rd11, %rd10, %rd7;\n\tdiv.u64 %rd11, %rd11, %rd6;\n\
         \tshl.b64 %rd10, %rd9, {bs};\n\tmin.u64 %rd10, %rd10, %rd3;\n\
         \tshl.b64 %rd11, %rd11, {bs};\n\tmin.u64 %rd11, %rd11, %rd3;\n\
         \tmov.u32 %r1, %tid.x;\n\tcvt.u64.u32 %rd12, %r1;\n\tcvt.u64.u32 %rd13, %r10;\n\
         \tmov.u64 %rd15, %rd10;",
        bm1 = BLOCK_UNITS - 1,
        bs = BLOCK_UNITS.trailing_zeros()
    );
    // Address of the code in %r{c} at chunk start %rd15: %rd17 = (slot ? base : transfer) +
    // idx x stride + u0 x width.
    let addr = |k: &mut String, c: u32| {
        let _ = writeln!(
            k,
            "\tshr.u32 %r5, %r{c}, 30;\n\tand.b32 %r6, %r{c}, {INDEX_MASK};\n\
             \tsetp.eq.u32 %p6, %r5, {KIND_SLOT};\n\tselp.b64 %rd17, %rd0, %rd1, %p6;\n\
             \tcvt.u64.u32 %rd18, %r6;\n\tmad.lo.u64 %rd17, %rd18, %rd4, %rd17;\n\
             \tshl.b64 %rd18, %rd15, {shift};\n\tadd.u64 %rd17, %rd17, %rd18;"
        );
    };
    // The head of a phase's loop over the pairs: %r2 the pair, %r11 its codes, %r14 its staging
    // row; %rd17 the address of its source (phase A, code at +0) or destination (B, at +4).
    let pair_head = |k: &mut String, phase: &str, code_off: u32| {
        let _ = writeln!(
            k,
            "\tmov.u32 %r2, 0;\n\tmov.u32 %r11, %r8;\n\tmov.u32 %r14, %r12;\n\
             P{phase}:\n\tsetp.ge.u32 %p1, %r2, %r0;\n\t@%p1 bra.uni P{phase}D;\n\
             \tld.shared.u32 %r3, [%r11+{code_off}];"
        );
        addr(k, 3);
    };
    match f {
        Flavour::CpAsync => {
            let (cp, ty, regs) = if w == 16 {
                ("cg", "v4.u32", "{%v0, %v1, %v2, %v3}")
            } else {
                ("ca", "u32", "%v0")
            };
            // Chunk loop: %rd16 m = min(chunk, hi - u0).
            k.push_str(
                "CH:\n\tsetp.ge.u64 %p0, %rd15, %rd11;\n\t@%p0 bra.uni DONE;\n\
                 \tsub.u64 %rd16, %rd11, %rd15;\n\tmin.u64 %rd16, %rd16, %rd5;\n",
            );
            // Phase A: every source's chunk row to shared memory. %r2 pair, %r11 its code, %r14
            // its row.
            for (phase, code_off) in [("A", 0u32), ("B", 4u32)] {
                pair_head(&mut k, phase, code_off);
                let _ = writeln!(
                    k,
                    "\tmov.u64 %rd19, %rd12;\n\
                     J{phase}:\n\tsetp.ge.u64 %p2, %rd19, %rd16;\n\t@%p2 bra J{phase}D;\n\
                     \tshl.b64 %rd24, %rd19, {shift};\n\tadd.u64 %rd24, %rd17, %rd24;\n\
                     \tcvt.u32.u64 %r15, %rd19;\n\tshl.b32 %r15, %r15, {shift};\n\tadd.u32 %r15, %r15, %r14;"
                );
                if phase == "A" {
                    let _ = writeln!(k, "\tcp.async.{cp}.shared.global [%r15], [%rd24], {w};");
                } else {
                    let _ = writeln!(
                        k,
                        "\tld.shared.{ty} {regs}, [%r15];\n\tst.global.{ty} [%rd24], {regs};"
                    );
                }
                let _ = writeln!(
                    k,
                    "\tadd.u64 %rd19, %rd19, %rd13;\n\tbra J{phase};\nJ{phase}D:\n\
                     \tadd.u32 %r2, %r2, 1;\n\tadd.u32 %r11, %r11, 8;\n\tadd.u32 %r14, %r14, %r16;\n\
                     \tbra.uni P{phase};\nP{phase}D:"
                );
                if phase == "A" {
                    k.push_str("\tcp.async.commit_group;\n\tcp.async.wait_group 0;\n");
                }
                k.push_str("\tbar.sync 0;\n");
            }
            k.push_str("\tadd.u64 %rd15, %rd15, %rd5;\n\tbra.uni CH;\nDONE:\n\tret;\n}\n\n");
        }
        Flavour::Bulk => {
            // One thread does the rest; %r21 the mbarrier's parity.
            k.push_str(
                "\tsetp.ne.u32 %p7, %r1, 0;\n\t@%p7 bra DONE;\n\
                 \tmbarrier.init.shared::cta.b64 [%r20], 1;\n\
                 \tfence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;\n\tmov.u32 %r21, 0;\n\
                 CH:\n\tsetp.ge.u64 %p0, %rd15, %rd11;\n\t@%p0 bra.uni FIN;\n\
                 \tsub.u64 %rd16, %rd11, %rd15;\n\tmin.u64 %rd16, %rd16, %rd5;\n",
            );
            // %r22 the bytes of this chunk's row, %r23 of all rows.
            let _ = writeln!(
                k,
                "\tcvt.u32.u64 %r22, %rd16;\n\tshl.b32 %r22, %r22, {shift};\n\
                 \tmul.lo.u32 %r23, %r22, %r0;\n\
                 \tmbarrier.arrive.expect_tx.shared::cta.b64 %rd30, [%r20], %r23;"
            );
            for (phase, code_off) in [("A", 0u32), ("B", 4u32)] {
                pair_head(&mut k, phase, code_off);
                if phase == "A" {
                    k.push_str(
                        "\tcp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r14], [%rd17], %r22, [%r20];\n",
                    );
                } else {
                    k.push_str(
                        "\tcp.async.bulk.global.shared::cta.bulk_group [%rd17], [%r14], %r22;\n",
                    );
                }
                let _ = writeln!(
                    k,
                    "\tadd.u32 %r2, %r2, 1;\n\tadd.u32 %r11, %r11, 8;\n\tadd.u32 %r14, %r14, %r16;\n\
                     \tbra.uni P{phase};\nP{phase}D:"
                );
                if phase == "A" {
                    k.push_str(
                        "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 %p3, [%r20], %r21;\n\
                         \t@!%p3 bra.uni WAIT;\n\txor.b32 %r21, %r21, 1;\n",
                    );
                }
            }
            // The stores must have read the staging before the next chunk's loads overwrite it.
            k.push_str(
                "\tcp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;\n\
                 \tadd.u64 %rd15, %rd15, %rd5;\n\tbra.uni CH;\n\
                 FIN:\n\tcp.async.bulk.wait_group 0;\nDONE:\n\tret;\n}\n\n",
            );
        }
    }
    s.push_str(&k);
}

/// Check an assignment the way [`crate::copy_kernel::encode`] checks a list, and that it is one
/// (distinct slot destinations, no scratch).
pub fn check(pairs: &[Copy], slots: usize, transfers: usize) -> Result<Vec<u32>> {
    let mut seen = vec![false; slots];
    for c in pairs {
        if c.from == Loc::Scratch {
            return Err(Error::Placement("a batched source is the scratch".into()));
        }
        if let Loc::Slot(p) = c.to {
            if std::mem::replace(
                seen.get_mut(p).ok_or_else(|| {
                    Error::Placement(format!("copy to slot {p}, but the param has {slots} slots"))
                })?,
                true,
            ) {
                return Err(Error::Placement(format!("slot {p} written twice")));
            }
        }
    }
    crate::copy_kernel::encode(pairs, slots, transfers)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::copy_kernel::encode;
    use crate::copy_kernel::tests::rank_cases;
    use crate::moves::{MovePlan, SlotMap};
    use proptest::prelude::*;

    /// Run a [`parallel`] assignment over plain slots: what [`simulate`] and the kernel must give.
    fn apply<T: Clone>(slots: &mut [T], received: &[T], pairs: &[Copy]) -> Result<()> {
        let mut vals = Vec::with_capacity(pairs.len());
        for c in pairs {
            vals.push(
                match c.from {
                    Loc::Slot(p) => slots.get(p).cloned(),
                    Loc::Transfer(k) => received.get(k).cloned(),
                    Loc::Scratch => None,
                }
                .ok_or_else(|| {
                    Error::Placement(format!("copy from {:?}: nothing there", c.from))
                })?,
            );
        }
        for (c, v) in pairs.iter().zip(vals) {
            let p = match c.to {
                Loc::Slot(p) => p,
                _ => return Err(Error::Placement("a batched store outside the slots".into())),
            };
            *slots
                .get_mut(p)
                .ok_or_else(|| Error::Placement(format!("copy to slot {p}: out of range")))? = v;
        }
        Ok(())
    }

    #[test]
    fn a_cycle_is_one_pair_a_slot() {
        // 0 -> 1 -> 2 -> 0: three pairs, each reading the bytes as they were.
        let old = SlotMap::new(vec![0, 1, 2], 3).unwrap();
        let new = SlotMap::new(vec![1, 2, 0], 3).unwrap();
        let plan = MovePlan::new(&old, &new, 1).unwrap();
        let rm = plan.rank(0).cloned().unwrap();
        let p = parallel(&rm.copies).unwrap();
        assert_eq!(p.len(), 3);
        assert!(p.iter().all(|c| c.from != Loc::Scratch));
        let mut v = vec![10, 11, 12];
        apply(&mut v, &[], &p).unwrap();
        assert_eq!(v, vec![11, 12, 10]);
        // Refusals: the scratch read first, a store into the transfer buffer, a slot twice.
        let c = |from, to| Copy { from, to };
        assert!(parallel(&[c(Loc::Scratch, Loc::Slot(0))]).is_err());
        assert!(parallel(&[c(Loc::Slot(0), Loc::Transfer(0))]).is_err());
        assert!(check(
            &[c(Loc::Slot(0), Loc::Slot(1)), c(Loc::Slot(2), Loc::Slot(1))],
            3,
            0
        )
        .is_err());
        assert!(check(&[c(Loc::Scratch, Loc::Slot(1))], 3, 0).is_err());
        assert!(check(&[c(Loc::Slot(0), Loc::Slot(3))], 3, 0).is_err());
    }

    #[test]
    fn geometry_balances_and_fits() {
        // An 88 MB bf16 slot, 31 pairs, 2 CTAs an SM: 16-byte units, chunks of whole blocks, the
        // shared memory inside one CTA's share.
        for f in [Flavour::CpAsync, Flavour::Bulk] {
            let g = BatchGeometry::new(f, 1 << 20, 1 << 21, 88 << 20, 31, 132, 2).unwrap();
            assert_eq!((g.width, g.grid), (16, 264));
            assert_eq!(g.chunk % BLOCK_UNITS, 0);
            assert!(g.shared <= SM_SHARED / 2 - 1024, "{g:?}");
            // Ranges tile the units, and differ by at most one block.
            let mut next = 0;
            let (mut lo_len, mut hi_len) = (u64::MAX, 0);
            for c in 0..u64::from(g.grid) {
                let (lo, hi) = g.range(c);
                assert_eq!(lo, next);
                next = hi;
                lo_len = lo_len.min(hi - lo);
                hi_len = hi_len.max(hi - lo);
            }
            assert_eq!(next, g.units);
            assert!(hi_len - lo_len <= BLOCK_UNITS);
        }
        // A 4-byte alpha: the cp.async flavour's w4 entry, one CTA of one warp; no bulk entry.
        let g = BatchGeometry::new(Flavour::CpAsync, 256, 0, 4, 32, 132, 2).unwrap();
        assert_eq!(
            (g.width, g.units, g.threads, g.grid, g.chunk),
            (4, 1, 32, 1, 1)
        );
        assert!(BatchGeometry::new(Flavour::Bulk, 256, 0, 4, 32, 132, 2).is_none());
        assert!(BatchGeometry::new(Flavour::CpAsync, 256, 0, 4099, 32, 132, 2).is_none());
        // Too many pairs for one unit each.
        assert!(BatchGeometry::new(Flavour::CpAsync, 0, 0, 1 << 20, 20_000, 132, 1).is_none());
    }

    fn case() -> impl Strategy<Value = (usize, usize, Vec<usize>, Vec<usize>, usize, u32, u32)> {
        crate::copy_kernel::tests::plans().prop_flat_map(|(ranks, e, a, b)| {
            (
                Just(ranks),
                Just(e),
                Just(a),
                Just(b),
                prop_oneof![
                    (1usize..=40).prop_map(|x| 4 * x),
                    Just(16usize),
                    Just(4096 + 16),
                    (1usize..=40).prop_map(|x| 16 * 1024 * x / 8 + 16),
                    Just(3 * 16 * 1024 + 4),
                ],
                1u32..=3,
                1u32..=8,
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Random plans (cycles, replicas, transfers), sizes, grids and residencies: the parallel
        /// assignment, and the kernel's arithmetic over it in either flavour, give what
        /// `apply_local` gives on every rank.
        #[test]
        fn batched_matches_apply_local((ranks, e, a, b, bpe, sms, resident) in case()) {
            for c in rank_cases(ranks, e, a, b, bpe) {
                let (k, local, t) = (c.k, c.local, c.rm.transfer_experts());
                let pairs = parallel(&c.rm.copies).unwrap();
                let mut by_pairs: Vec<Vec<u8>> = c.mem.chunks(bpe).map(|x| x.to_vec()).collect();
                apply(&mut by_pairs, &c.received, &pairs).unwrap();
                prop_assert_eq!(&by_pairs, &c.want);
                if pairs.is_empty() {
                    continue;
                }
                let codes = check(&pairs, local, t).unwrap();
                prop_assert_eq!(&codes, &encode(&pairs, local, t).unwrap());
                for f in [Flavour::CpAsync, Flavour::Bulk] {
                    let Some(g) = BatchGeometry::new(f, 256, 512, bpe, pairs.len(), sms, resident) else {
                        prop_assert!(f == Flavour::Bulk && bpe % 16 != 0);
                        continue;
                    };
                    let mut m = c.mem.clone();
                    simulate(&g, &codes, &mut m, &c.recv, bpe).unwrap();
                    prop_assert_eq!(&m, &c.want.concat(), "rank {} bpe {} {:?}", k, bpe, g);
                }
            }
        }
    }

    /// Run 74 hung: the branches that depend on the thread (the list load, a chunk row's units, the
    /// bulk flavour's one-thread exit) were `bra.uni`, which promises a warp-uniform branch. They
    /// must be plain `bra`; the uniform ones (the pair and chunk loops) may stay `.uni`.
    #[test]
    fn thread_dependent_branches_are_not_uniform() {
        let mut s = String::new();
        entries(&mut s);
        for pred in ["%p5", "%p2", "%p7"] {
            let lines: Vec<&str> = s
                .lines()
                .filter(|l| l.contains(&format!("@{pred} bra")))
                .collect();
            assert!(!lines.is_empty(), "{pred}");
            assert!(
                lines.iter().all(|l| !l.contains("bra.uni")),
                "{pred}: {lines:?}"
            );
        }
        for l in ["\tbra LIST;", "\tbra JA;", "\tbra JB;"] {
            assert!(s.contains(l), "{l}");
        }
        // The bulk flavour's mbarrier is initialised by a generic-proxy write: fenced before the
        // async proxy (the bulk copies) completes transactions on it.
        let init = s.find("mbarrier.init.shared::cta.b64").unwrap();
        let fence = s.find("fence.proxy.async.shared::cta;").unwrap();
        let first_copy = s.find("cp.async.bulk.shared::cluster").unwrap();
        assert!(init < fence && fence < first_copy);
    }
}
