//! One-launch execution of a rank's local copy list ([`moves::Copy`]) over one param on the GPU,
//! "rotated in chunks".
//!
//! The param's expert bytes are split into *units* of `width` bytes (16, 4 or 1: the widest that
//! divides `bytes_per_expert` and both base addresses) and the units into *columns* of
//! `4 x threads` units. Each CTA takes columns (grid-stride) and runs the **whole** copy list, in
//! order, on its column: thread `t` of column `c` owns units `c*4T + j*T + t` (`j` in `0..4`, so a
//! warp's accesses are contiguous) of every expert, loads them from the copy's source and stores
//! them to its destination. Every thread reads and writes the same byte offsets for every copy, so
//! a copy that reads what an earlier copy wrote reads the same thread's own store (program order):
//! no barrier, no cross-thread hazard. The scratch expert of a cycle lives in **shared memory** (one
//! column's units per thread, each thread's own) and never touches global memory, so breaking a
//! cycle costs no traffic; keeping it out of registers leaves a thread 32 registers, so 8 CTAs of
//! 256 threads stay resident and each keeps its 64 bytes in flight.
//!
//! The copy list travels as a device array of `u32` pairs `(src, dst)`, one per copy, each a
//! *code* ([`encode`]):
//!
//! | code                     | location                                             |
//! |--------------------------|------------------------------------------------------|
//! | `0x0000_0000 \| p`       | [`Loc::Slot`]`(p)`: `base + p * bytes_per_expert`     |
//! | `0x4000_0000 \| k`       | [`Loc::Transfer`]`(k)`: `transfer + k * bytes_per_expert` |
//! | `0x8000_0000`            | [`Loc::Scratch`]: the thread's shared-memory scratch |
//!
//! (bits 31..30 the kind, bits 29..0 the index, below 2^30.) The list is checked on the host
//! against the region's slot and transfer counts before it is uploaded: no code the kernel sees
//! reaches outside them, and the scratch is never read before it is written.
//!
//! Three entry points share one PTX generator ([`ptx`]): `moeforge_copy_list_w16` (16-byte
//! `ld/st.global.v4.u32`), `_w4` (`u32`) and `_w1` (`u8`). Because the width divides the expert
//! size, there is no tail: a 4-byte alpha runs one 32-thread CTA of the `w4` kernel, an expert of
//! `4096 + 3` bytes the `w1` kernel, a 16-byte-aligned one the `w16` kernel at full bandwidth.
//! [`simulate`] is the same index arithmetic on host bytes, the reference the tests hold the
//! kernel's logic to; [`gpu_check`] compares the device against [`moves::apply_local`].

use std::fmt::Write as _;
use std::sync::Arc;

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use cudarc::driver::{DevicePtrMut, PushKernelArg};

use crate::moves::{self, Copy, Loc};
use crate::{drv, Device, Error, Result};

/// Kind bits of a code (bits 31..30): a slot.
pub const KIND_SLOT: u32 = 0;
/// Kind bits of a code: an expert of the transfer buffer.
pub const KIND_TRANSFER: u32 = 1;
/// Kind bits of a code: the scratch (registers).
pub const KIND_SCRATCH: u32 = 2;
/// The index bits of a code (bits 29..0).
pub const INDEX_MASK: u32 = (1 << 30) - 1;
/// Units each thread moves per column (and units of scratch it holds: `4 x width` bytes).
pub const UNITS_PER_THREAD: u64 = 4;
/// Threads of a CTA for an expert of at least one full column (`256 x 4 x 16 B = 16 KiB` per
/// column at width 16).
pub const MAX_THREADS: u32 = 256;
/// Shared memory a launch may take: the copy list (8 bytes a copy, rounded up to 16) and, when the
/// list uses the scratch, `4 x threads x width` bytes of it (the default 48 KiB without opt-in).
pub const MAX_LIST_BYTES: u64 = 48 * 1024;

/// Dynamic shared memory of a launch of `copies` copies on geometry `g` in the form `v` (the
/// scratch takes shared memory only where `v` keeps it there).
pub fn shared_bytes_for(g: &Geometry, copies: usize, scratch: bool, v: Variant) -> u64 {
    let scratch = scratch && v.smem_scratch;
    let list = (8 * copies as u64).div_ceil(16) * 16;
    let sc = if scratch {
        UNITS_PER_THREAD * u64::from(g.threads) * g.width
    } else {
        0
    };
    list + sc
}
/// CTAs per SM the grid is capped at (the grid-stride loop takes the remaining columns). Two
/// stream as fast as eight (`bench --gpu --eplb` on an H200: 3.71-3.75 TB/s at 2, 4 and 8 resident
/// per SM) and leave the SMs room for an NCCL exchange running beside the copies.
pub const CTAS_PER_SM: u64 = 2;

/// The code of one location (see the module docs).
pub fn encode_loc(l: Loc) -> Result<u32> {
    let idx = |i: usize| {
        u32::try_from(i)
            .ok()
            .filter(|&i| i <= INDEX_MASK)
            .ok_or_else(|| Error::Placement(format!("copy index {i} does not fit a code")))
    };
    Ok(match l {
        Loc::Slot(p) => (KIND_SLOT << 30) | idx(p)?,
        Loc::Transfer(k) => (KIND_TRANSFER << 30) | idx(k)?,
        Loc::Scratch => KIND_SCRATCH << 30,
    })
}

/// The codes of a copy list, `[src0, dst0, src1, dst1, ..]`, checked against a region of `slots`
/// slots and `transfers` transfer experts: every index in range, no copy into the transfer buffer,
/// the scratch read only after it was written (the same rules as [`moves::apply_local`]).
pub fn encode(copies: &[Copy], slots: usize, transfers: usize) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(2 * copies.len());
    let mut scratch = false;
    for c in copies {
        match c.from {
            Loc::Slot(p) if p >= slots => {
                return Err(Error::Placement(format!(
                    "copy from slot {p}, but the param has {slots} slots"
                )))
            }
            Loc::Transfer(k) if k >= transfers => {
                return Err(Error::Placement(format!(
                    "copy from transfer expert {k}, but the buffer holds {transfers}"
                )))
            }
            Loc::Scratch if !scratch => {
                return Err(Error::Placement(
                    "copy from the scratch before anything was staged in it".into(),
                ))
            }
            _ => {}
        }
        match c.to {
            Loc::Slot(p) if p >= slots => {
                return Err(Error::Placement(format!(
                    "copy to slot {p}, but the param has {slots} slots"
                )))
            }
            Loc::Transfer(_) => {
                return Err(Error::Placement("a copy into the transfer buffer".into()))
            }
            Loc::Scratch => scratch = true,
            _ => {}
        }
        out.push(encode_loc(c.from)?);
        out.push(encode_loc(c.to)?);
    }
    Ok(out)
}

/// How one launch covers a param: unit width, threads, columns, grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes per unit (16, 4 or 1): the widest dividing the expert size and both bases.
    pub width: u64,
    /// Units per expert (`bytes_per_expert / width`, exact).
    pub units: u64,
    /// Threads per CTA (a multiple of 32, at most [`MAX_THREADS`]).
    pub threads: u32,
    /// Columns per expert (`ceil(units / (4 x threads))`).
    pub columns: u64,
    /// CTAs launched (at most `columns`, at most [`CTAS_PER_SM`] per SM).
    pub grid: u32,
}

impl Geometry {
    /// The geometry for an expert of `bytes_per_expert` (at least 1) at `base` and `transfer` on a
    /// device of `sms` SMs.
    pub fn new(base: u64, transfer: u64, bytes_per_expert: usize, sms: u32) -> Geometry {
        let b = bytes_per_expert.max(1) as u64;
        let width = [16u64, 4, 1]
            .into_iter()
            .find(|&w| base.is_multiple_of(w) && transfer.is_multiple_of(w) && b.is_multiple_of(w))
            .unwrap_or(1);
        let units = b / width;
        let full = UNITS_PER_THREAD * u64::from(MAX_THREADS);
        let threads = if units >= full {
            MAX_THREADS
        } else {
            // Just enough warps for one column.
            (units.div_ceil(UNITS_PER_THREAD).div_ceil(32) * 32).max(32) as u32
        };
        let columns = units.div_ceil(UNITS_PER_THREAD * u64::from(threads));
        let cap = (u64::from(sms.max(1)) * CTAS_PER_SM).min(u64::from(u32::MAX));
        let grid = columns.clamp(1, cap) as u32;
        Geometry {
            width,
            units,
            threads,
            columns,
            grid,
        }
    }
}

/// One form of the kernel's code: where a cycle's scratch lives and the cache hints of its global
/// accesses. [`PRODUCTION`] is what [`CopyKernel::run_list`] launches; [`VARIANTS`] are the forms
/// the self-check also times (`bench --gpu --eplb`), so that the choice stays a measured one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// Entry-name suffix (empty for the production form).
    pub suffix: &'static str,
    /// The scratch in shared memory (32 registers, `.minnctapersm 8`) instead of registers.
    pub smem_scratch: bool,
    /// Qualifiers of the global loads (for example `.L1::no_allocate`), empty for none.
    pub load: &'static str,
    /// Qualifiers of the global stores (for example `.cs`), empty for none.
    pub store: &'static str,
}

/// The form [`CopyKernel::run_list`] launches.
pub const PRODUCTION: Variant = Variant {
    suffix: "",
    smem_scratch: false,
    load: "",
    store: "",
};

/// Forms timed against each other by [`gpu_check`] (the first is [`PRODUCTION`]). On an H200
/// (`bench --gpu --eplb`, 16 MiB experts) the register scratch streams at 3.71-3.76 TB/s with or
/// without `.cs` hints; `.L1::no_allocate` loads were slower (3.51-3.65), and the shared-memory
/// scratch, which needs only 32 registers, much slower (2.36-2.72) at every residency.
pub const VARIANTS: [Variant; 3] = [
    PRODUCTION,
    Variant {
        suffix: "_cs",
        smem_scratch: false,
        load: ".cs",
        store: ".cs",
    },
    Variant {
        suffix: "_smem",
        smem_scratch: true,
        load: "",
        store: "",
    },
];

/// PTX that copies the list (`%r0` pairs at the global address `%rd2`) into shared memory at
/// `moeforge_copy_list_smem`, every thread a pair at a time, then `bar.sync`: `%r8` is left the
/// list's shared address and `%r10` the CTA's threads (clobbers `%r3`, `%r4`, `%r7`, `%r9`,
/// `%rd19`, `%rd23`, `%p5`). Shared by the column and batched entries.
pub(crate) const LIST_TO_SHARED: &str =
    "\tmov.u32 %r7, %tid.x;\n\tmov.u32 %r8, moeforge_copy_list_smem;\n\tmov.u32 %r10, %ntid.x;\n\
         LIST:\n\tsetp.ge.u32 %p5, %r7, %r0;\n\t@%p5 bra LISTED;\n\
         \tmul.wide.u32 %rd19, %r7, 8;\n\tadd.u64 %rd23, %rd2, %rd19;\n\
         \tld.global.nc.v2.u32 {%r3, %r4}, [%rd23];\n\
         \tmad.lo.u32 %r9, %r7, 8, %r8;\n\tst.shared.v2.u32 [%r9], {%r3, %r4};\n\
         \tadd.u32 %r7, %r7, %r10;\n\tbra LIST;\nLISTED:\n\tbar.sync 0;\n";

/// The PTX module (all three entry points of every [`VARIANTS`] form) for `target` (`sm_90a`,
/// `sm_100a`; anything `ptxas` takes as `-arch`).
pub fn ptx(target: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// moeforge copy-list kernel: one launch runs a rank's copy list over one param.\n\
         .version 8.7\n.target {target}\n.address_size 64\n\n\
         .extern .shared .align 16 .b8 moeforge_copy_list_smem[];\n"
    );
    for v in VARIANTS {
        for w in [16u32, 4, 1] {
            entry(&mut s, w, v);
        }
    }
    crate::copy_batch::entries(&mut s);
    s
}

/// Which kernel runs a list: the column form (the sequential list, [`VARIANTS`]) or the batched
/// form ([`crate::copy_batch`]: the list's parallel assignment, chunk by chunk, at `resident` CTAs
/// an SM), falling back to the column form where the batched one has no entry for the width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The column form in `VARIANTS[variant]`, spread as `shape` says (`None`: the default).
    Columns {
        /// Index into [`VARIANTS`].
        variant: usize,
        /// The spread over the GPU.
        shape: Option<Shape>,
    },
    /// The batched form.
    Batch {
        /// How the chunks travel.
        flavour: crate::copy_batch::Flavour,
        /// CTAs an SM (their shared memory share sizes the chunks).
        resident: u32,
    },
}

/// The form [`CopyKernel::run_list`] launches unless [`CopyKernel::with_form`] says otherwise.
pub const DEFAULT_FORM: Form = Form::Columns {
    variant: 0,
    shape: None,
};

fn entry(s: &mut String, w: u32, var: Variant) {
    let sfx = var.suffix;
    let (ld, st) = (var.load, var.store);
    // Value registers per unit: 4 for a v4 access, 1 otherwise.
    let per = if w == 16 { 4 } else { 1 };
    let nv = 4 * per;
    let shift = w.trailing_zeros();
    let vals_of = |j: u32, pre: &str| -> String {
        if per == 4 {
            format!(
                "{{%{pre}{}, %{pre}{}, %{pre}{}, %{pre}{}}}",
                4 * j,
                4 * j + 1,
                4 * j + 2,
                4 * j + 3
            )
        } else {
            format!("%{pre}{j}")
        }
    };
    let vals = |j: u32| vals_of(j, "v");
    let ty = match w {
        16 => "v4.u32",
        4 => "u32",
        _ => "u8",
    };
    let mut k = String::new();
    // With the scratch in shared memory, `.minnctapersm` asks ptxas for the registers of 8
    // resident CTAs (32 a thread); in registers, the scratch takes `nv` more.
    let occupancy = if var.smem_scratch {
        ".minnctapersm 8\n".to_string()
    } else {
        String::new()
    };
    let _ = writeln!(
        k,
        ".visible .entry moeforge_copy_list_w{w}{sfx}(\n\
         \t.param .u64 p_base,\n\t.param .u64 p_transfer,\n\t.param .u64 p_list,\n\
         \t.param .u32 p_n,\n\t.param .u64 p_units,\n\t.param .u64 p_stride\n)\n\
         .maxntid {MAX_THREADS}, 1, 1\n{occupancy}{{\n\
         \t.reg .pred %p<8>;\n\t.reg .b32 %r<16>;\n\t.reg .b64 %rd<32>;\n\
         \t.reg .b32 %v<{nv}>;\n\t.reg .b32 %s<{nv}>;\n"
    );
    // Parameters: %rd0 base, %rd1 transfer, %rd2 list, %r0 n, %rd3 units, %rd4 stride (bytes).
    k.push_str(
        "\tld.param.u64 %rd20, [p_base];\n\tcvta.to.global.u64 %rd0, %rd20;\n\
         \tld.param.u64 %rd21, [p_transfer];\n\tcvta.to.global.u64 %rd1, %rd21;\n\
         \tld.param.u64 %rd22, [p_list];\n\tcvta.to.global.u64 %rd2, %rd22;\n\
         \tld.param.u32 %r0, [p_n];\n\tld.param.u64 %rd3, [p_units];\n\
         \tld.param.u64 %rd4, [p_stride];\n",
    );
    for i in 0..nv {
        let _ = writeln!(k, "\tmov.b32 %v{i}, 0;\n\tmov.b32 %s{i}, 0;");
    }
    // The list goes to shared memory once per CTA (every copy then reads its codes at shared-memory
    // latency instead of a dependent global load): %r7 index, %r8 list base in shared memory, %r10
    // threads.
    k.push_str(LIST_TO_SHARED);
    // The scratch: after the list (rounded up to 16 bytes), `4 x threads` units, unit `j*T + tid`
    // the thread's own. %r12 = its unit 0, %r13 = the step between its units (T x width).
    let _ = writeln!(
        k,
        "\tshl.b32 %r12, %r0, 3;\n\tadd.u32 %r12, %r12, 15;\n\tand.b32 %r12, %r12, -16;\n\
         \tadd.u32 %r12, %r12, %r8;\n\tmov.u32 %r13, %tid.x;\n\
         \tmad.lo.u32 %r12, %r13, {w}, %r12;\n\tmul.lo.u32 %r13, %r10, {w};"
    );
    // %rd5 column, %rd6 grid, %rd7 tid, %rd8 threads, %rd9 column units, %rd10 columns.
    let _ = writeln!(
        k,
        "\tmov.u32 %r1, %ctaid.x;\n\tcvt.u64.u32 %rd5, %r1;\n\
         \tmov.u32 %r1, %nctaid.x;\n\tcvt.u64.u32 %rd6, %r1;\n\
         \tmov.u32 %r1, %tid.x;\n\tcvt.u64.u32 %rd7, %r1;\n\
         \tmov.u32 %r1, %ntid.x;\n\tcvt.u64.u32 %rd8, %r1;\n\
         \tshl.b64 %rd9, %rd8, 2;\n\
         \tadd.u64 %rd10, %rd3, %rd9;\n\tsub.u64 %rd10, %rd10, 1;\n\
         \tdiv.u64 %rd10, %rd10, %rd9;\n\
         COL:\n\
         \tsetp.ge.u64 %p0, %rd5, %rd10;\n\t@%p0 bra.uni DONE;"
    );
    // Units u_j = col*4T + j*T + tid -> predicates %p1+j; %rd11 the byte offset of unit 0 (unit j
    // is `j x %rd12` bytes further, %rd12 = T x width).
    let _ = writeln!(
        k,
        "\tmad.lo.u64 %rd15, %rd5, %rd9, %rd7;\n\tshl.b64 %rd11, %rd15, {shift};\n\
         \tshl.b64 %rd12, %rd8, {shift};"
    );
    for j in 0..4 {
        if j > 0 {
            let _ = writeln!(k, "\tadd.u64 %rd15, %rd15, %rd8;");
        }
        let _ = writeln!(k, "\tsetp.lt.u64 %p{}, %rd15, %rd3;", j + 1);
    }
    // Copy loop: %r2 i, %r11 the entry in shared memory; %r3 src code, %r4 dst code.
    k.push_str(
        "\tmov.u32 %r2, 0;\n\tmov.u32 %r11, %r8;\n\
         COPY:\n\tsetp.ge.u32 %p5, %r2, %r0;\n\t@%p5 bra.uni NEXT;\n\
         \tld.shared.v2.u32 {%r3, %r4}, [%r11];\n",
    );
    // Address of a code in %r{c}: %rd17 = (kind == slot ? base : transfer) + idx * stride + the
    // offset of unit 0; unit j at %rd17 + j x %rd12 (%rd24, stepped as the accesses issue).
    let addr = |k: &mut String, c: u32| {
        let _ = writeln!(
            k,
            "\tshr.u32 %r5, %r{c}, 30;\n\tand.b32 %r6, %r{c}, {INDEX_MASK};\n\
             \tsetp.eq.u32 %p6, %r5, {KIND_SLOT};\n\tselp.b64 %rd17, %rd0, %rd1, %p6;\n\
             \tcvt.u64.u32 %rd18, %r6;\n\tmad.lo.u64 %rd17, %rd18, %rd4, %rd17;\n\
             \tadd.u64 %rd24, %rd17, %rd11;"
        );
    };
    let step = |k: &mut String, j: u32| {
        if j > 0 {
            let _ = writeln!(k, "\tadd.u64 %rd24, %rd24, %rd12;");
        }
    };
    // The scratch unit j of this thread: %r14 (shared-memory address).
    let scratch = |k: &mut String, j: u32| {
        if j == 0 {
            let _ = writeln!(k, "\tmov.u32 %r14, %r12;");
        } else {
            let _ = writeln!(k, "\tadd.u32 %r14, %r14, %r13;");
        }
    };
    // Source.
    let _ = writeln!(
        k,
        "\tshr.u32 %r5, %r3, 30;\n\tsetp.eq.u32 %p7, %r5, {KIND_SCRATCH};\n\t@%p7 bra.uni SRCS;"
    );
    addr(&mut k, 3);
    for j in 0..4u32 {
        step(&mut k, j);
        let _ = writeln!(k, "\t@%p{} ld.global{ld}.{ty} {}, [%rd24];", j + 1, vals(j));
    }
    // Unit j between the values and the scratch (`to_scratch`: values -> scratch): shared memory,
    // or the `%s` registers.
    let scratch_move = |k: &mut String, j: u32, to_scratch: bool| {
        if var.smem_scratch {
            scratch(k, j);
            let _ = if to_scratch {
                writeln!(k, "\t@%p{} st.shared.{ty} [%r14], {};", j + 1, vals(j))
            } else {
                writeln!(k, "\t@%p{} ld.shared.{ty} {}, [%r14];", j + 1, vals(j))
            };
        } else {
            let (v, s) = (vals(j), vals_of(j, "s"));
            let regs = |t: &str| {
                t.trim_matches(['{', '}'])
                    .split(", ")
                    .map(String::from)
                    .collect::<Vec<_>>()
            };
            for (x, y) in regs(&v).into_iter().zip(regs(&s)) {
                let (d, a) = if to_scratch { (y, x) } else { (x, y) };
                let _ = writeln!(k, "\tmov.b32 {d}, {a};");
            }
        }
    };
    k.push_str("\tbra.uni DST;\nSRCS:\n");
    for j in 0..4u32 {
        scratch_move(&mut k, j, false);
    }
    // Destination.
    let _ = writeln!(
        k,
        "DST:\n\tshr.u32 %r5, %r4, 30;\n\tsetp.eq.u32 %p7, %r5, {KIND_SCRATCH};\n\t@%p7 bra.uni DSTS;"
    );
    addr(&mut k, 4);
    for j in 0..4u32 {
        step(&mut k, j);
        let _ = writeln!(k, "\t@%p{} st.global{st}.{ty} [%rd24], {};", j + 1, vals(j));
    }
    k.push_str("\tbra.uni STEP;\nDSTS:\n");
    for j in 0..4u32 {
        scratch_move(&mut k, j, true);
    }
    k.push_str(
        "STEP:\n\tadd.u32 %r2, %r2, 1;\n\tadd.u32 %r11, %r11, 8;\n\tbra.uni COPY;\n\
         NEXT:\n\tadd.u64 %rd5, %rd5, %rd6;\n\tbra.uni COL;\nDONE:\n\tret;\n}\n\n",
    );
    s.push_str(&k);
}

/// The kernel's index arithmetic on host bytes: `slots` is the param (`bytes_per_expert` per
/// slot), `transfer` the transfer buffer, `codes` from [`encode`]. Each (CTA, thread) runs the
/// whole list over its columns with its own value and scratch registers (zero at start), exactly
/// as the PTX does; threads touch disjoint bytes, so running them one after another is one valid
/// interleaving of the device's. An access outside the buffers is an error (on the device: a
/// fault).
pub fn simulate(
    g: &Geometry,
    codes: &[u32],
    slots: &mut [u8],
    transfer: &[u8],
    bytes_per_expert: usize,
) -> Result<()> {
    let w = g.width as usize;
    let t = u64::from(g.threads);
    let col_units = UNITS_PER_THREAD * t;
    let stride = bytes_per_expert;
    let oob = |what: &str, at: usize| Error::Placement(format!("{what} byte {at} out of range"));
    for cta in 0..u64::from(g.grid) {
        for tid in 0..t {
            let mut v = [[0u8; 16]; 4];
            let mut sc = [[0u8; 16]; 4];
            let mut col = cta;
            while col < g.columns {
                let mut off = [0usize; 4];
                let mut pred = [false; 4];
                for j in 0..4u64 {
                    let u = col * col_units + j * t + tid;
                    pred[j as usize] = u < g.units;
                    off[j as usize] = (u as usize) * w;
                }
                for pair in codes.chunks_exact(2) {
                    let (src, dst) = (pair[0], pair[1]);
                    if src >> 30 == KIND_SCRATCH {
                        v = sc;
                    } else {
                        let idx = (src & INDEX_MASK) as usize;
                        let from: &[u8] = if src >> 30 == KIND_SLOT {
                            slots
                        } else {
                            transfer
                        };
                        for j in 0..4 {
                            if pred[j] {
                                let a = idx * stride + off[j];
                                let b = from.get(a..a + w).ok_or_else(|| oob("load", a))?;
                                v[j][..w].copy_from_slice(b);
                            }
                        }
                    }
                    if dst >> 30 == KIND_SCRATCH {
                        sc = v;
                    } else {
                        let idx = (dst & INDEX_MASK) as usize;
                        if dst >> 30 != KIND_SLOT {
                            return Err(Error::Placement("a store to the transfer buffer".into()));
                        }
                        for j in 0..4 {
                            if pred[j] {
                                let a = idx * stride + off[j];
                                let b = slots.get_mut(a..a + w).ok_or_else(|| oob("store", a))?;
                                b.copy_from_slice(&v[j][..w]);
                            }
                        }
                    }
                }
                col += u64::from(g.grid);
            }
        }
    }
    Ok(())
}

/// Where one param's copies run: its slots and its transfer buffer, by device address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Address of slot 0 (slot `p` at `base + p * bytes_per_expert`).
    pub base: u64,
    /// Slots of the param.
    pub slots: usize,
    /// Address of transfer expert 0 (0 when there is none).
    pub transfer: u64,
    /// Experts the transfer buffer holds.
    pub transfers: usize,
    /// Bytes of one expert (at least 1).
    pub bytes_per_expert: usize,
}

/// How a launch is spread over the GPU: CTAs resident per SM (forced by padding the dynamic shared
/// memory; at most 8, which the kernel's 32 registers allow) and whether the grid is persistent
/// (`resident x SMs` CTAs walking the columns) or one CTA per column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// CTAs resident per SM (1..=8).
    pub resident: u32,
    /// `resident x SMs` CTAs taking columns grid-stride, or one CTA per column.
    pub persistent: bool,
}

/// Shared memory an SM holds for CTAs (H100/H200: 228 KiB, of which each CTA reserves 1 KiB).
const SM_SHARED: u64 = 228 * 1024;

impl Shape {
    /// Dynamic shared memory that keeps at most `resident` CTAs on an SM, at least `need`.
    fn shared(&self, need: u64) -> u64 {
        let r = u64::from(self.resident.clamp(1, 8));
        let pad = (SM_SHARED / r - 1024) / 16 * 16;
        need.max(if r >= 8 { 0 } else { pad })
    }
}

/// A copy list uploaded once, for running over every param of a layer.
pub struct CopyList {
    codes: Option<CudaSlice<u32>>,
    /// Whether the list was uploaded for the batched form (with its parallel assignment).
    batched: bool,
    /// The list's parallel assignment ([`crate::copy_batch::parallel`]) and its length, where it
    /// was uploaded for the batched form and is not empty.
    pairs: Option<(CudaSlice<u32>, usize)>,
    copies: usize,
    scratch: bool,
    slots: usize,
    transfers: usize,
}

impl CopyList {
    /// Copies in the list.
    pub fn len(&self) -> usize {
        self.copies
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.copies == 0
    }
}

/// A list uploaded by [`CopyKernel::run`]: its copies, slots, transfers and device copy.
/// The event after its upload orders a launch on another stream after the copy.
type Uploaded = (Vec<Copy>, usize, usize, Arc<CopyList>, Arc<CudaEvent>);

/// The copy-list kernel, loaded once per context.
pub struct CopyKernel {
    _module: Arc<CudaModule>,
    /// Per [`VARIANTS`] form, its `w16`, `w4` and `w1` entries.
    fns: Vec<[CudaFunction; 3]>,
    /// The batched entries: `cp.async` w16 and w4, bulk w16.
    batch: [CudaFunction; 3],
    /// What [`CopyKernel::run_list`] launches.
    form: Form,
    sms: u32,
    /// The last list uploaded by [`CopyKernel::run`], reused while the same copies run over the
    /// next params of a layer (one upload per rearrangement, not one per param).
    last: std::sync::Mutex<Option<Uploaded>>,
}

impl CopyKernel {
    /// JIT the PTX for `dev`'s target through the driver's linker and load it.
    pub fn load(dev: &Device) -> Result<CopyKernel> {
        let target = dev.target().ok_or_else(|| {
            Error::NoDriver(format!(
                "no PTX target for compute capability {:?}",
                dev.capability
            ))
        })?;
        let (cubin, _log) = crate::jit::link_ptx(dev, "moeforge_copy_list", &ptx(target.name()))?;
        let module = dev
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(drv("cuModuleLoadData"))?;
        let f = |n: &str| -> Result<CudaFunction> {
            let f = module
                .load_function(n)
                .map_err(drv("cuModuleGetFunction"))?;
            // Padded launches ([`Shape`]) take up to one SM's shared memory less the reserve.
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (SM_SHARED - 1024) as i32,
            )
            .map_err(drv("cuFuncSetAttribute"))?;
            Ok(f)
        };
        let mut fns = Vec::with_capacity(VARIANTS.len());
        for v in VARIANTS {
            let sfx = v.suffix;
            fns.push([
                f(&format!("moeforge_copy_list_w16{sfx}"))?,
                f(&format!("moeforge_copy_list_w4{sfx}"))?,
                f(&format!("moeforge_copy_list_w1{sfx}"))?,
            ]);
        }
        use crate::copy_batch::Flavour;
        let name = |fl: Flavour, w: u64| fl.entry(w).unwrap_or_default();
        let batch = [
            f(&name(Flavour::CpAsync, 16))?,
            f(&name(Flavour::CpAsync, 4))?,
            f(&name(Flavour::Bulk, 16))?,
        ];
        Ok(CopyKernel {
            fns,
            batch,
            form: DEFAULT_FORM,
            _module: module,
            sms: dev.sms,
            last: std::sync::Mutex::new(None),
        })
    }

    /// Launch `form` instead of [`DEFAULT_FORM`] from [`CopyKernel::run_list`] (a benchmark's
    /// comparison of the forms).
    pub fn with_form(mut self, form: Form) -> CopyKernel {
        self.form = form;
        self
    }

    /// The geometry a launch over `r` uses.
    pub fn geometry(&self, r: &Region) -> Geometry {
        Geometry::new(r.base, r.transfer, r.bytes_per_expert, self.sms)
    }

    /// Check `copies` against `slots` slots and `transfers` transfer experts ([`encode`]) and upload
    /// them (one small host-to-device copy on `stream`).
    pub fn upload(
        &self,
        stream: &Arc<CudaStream>,
        copies: &[Copy],
        slots: usize,
        transfers: usize,
    ) -> Result<CopyList> {
        let batched = matches!(self.form, Form::Batch { .. });
        self.upload_for(stream, copies, slots, transfers, batched)
    }

    /// [`CopyKernel::upload`] for the batched form (`batched`: the parallel assignment resolved and
    /// uploaded too) or the column form only, whatever this kernel's own form.
    pub fn upload_for(
        &self,
        stream: &Arc<CudaStream>,
        copies: &[Copy],
        slots: usize,
        transfers: usize,
        batched: bool,
    ) -> Result<CopyList> {
        let codes = encode(copies, slots, transfers)?;
        let dev = if codes.is_empty() {
            None
        } else {
            Some(
                stream
                    .clone_htod(&codes)
                    .map_err(drv("cuMemcpyHtoDAsync"))?,
            )
        };
        let assignment = if batched {
            crate::copy_batch::parallel(copies)?
        } else {
            Vec::new()
        };
        let pair_codes = crate::copy_batch::check(&assignment, slots, transfers)?;
        let pairs = if pair_codes.is_empty() {
            None
        } else {
            Some((
                stream
                    .clone_htod(&pair_codes)
                    .map_err(drv("cuMemcpyHtoDAsync"))?,
                assignment.len(),
            ))
        };
        Ok(CopyList {
            codes: dev,
            batched,
            pairs,
            copies: copies.len(),
            scratch: copies.iter().any(|c| c.to == Loc::Scratch),
            slots,
            transfers,
        })
    }

    /// Run an uploaded list over one param in one launch on `stream`.
    ///
    /// # Safety
    /// `r.base .. r.base + r.slots * r.bytes_per_expert` and `r.transfer .. r.transfer +
    /// r.transfers * r.bytes_per_expert` must be live device memory of `stream`'s context, not
    /// overlapping, written by nothing else while the launch runs except work ordered on `stream`.
    pub unsafe fn run_list(
        &self,
        stream: &Arc<CudaStream>,
        list: &CopyList,
        r: &Region,
    ) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.run_form(stream, list, r, self.form) }
    }

    /// [`CopyKernel::run_list`] in `form`.
    ///
    /// # Safety
    /// As [`CopyKernel::run_list`].
    pub unsafe fn run_form(
        &self,
        stream: &Arc<CudaStream>,
        list: &CopyList,
        r: &Region,
        form: Form,
    ) -> Result<()> {
        match form {
            Form::Columns { variant, shape } => {
                // SAFETY: the caller's promise, passed on.
                unsafe { self.run_list_shaped(stream, list, r, shape, variant) }
            }
            Form::Batch { flavour, resident } => {
                // SAFETY: the caller's promise, passed on.
                if unsafe { self.run_batch(stream, list, r, flavour, resident) }? {
                    Ok(())
                } else {
                    // SAFETY: the caller's promise, passed on.
                    unsafe { self.run_list_shaped(stream, list, r, None, 0) }
                }
            }
        }
    }

    /// Run the list's parallel assignment in the batched form; `Ok(false)` (nothing launched) where
    /// that form has no geometry for the region ([`crate::copy_batch::BatchGeometry::new`]).
    ///
    /// # Safety
    /// As [`CopyKernel::run_list`].
    pub unsafe fn run_batch(
        &self,
        stream: &Arc<CudaStream>,
        list: &CopyList,
        r: &Region,
        flavour: crate::copy_batch::Flavour,
        resident: u32,
    ) -> Result<bool> {
        use crate::copy_batch::{BatchGeometry, Flavour};
        if r.slots < list.slots || r.transfers < list.transfers {
            return Err(Error::Placement(format!(
                "a copy list for {} slots and {} transfer experts run over {} and {}",
                list.slots, list.transfers, r.slots, r.transfers
            )));
        }
        if !list.batched {
            return Err(Error::Placement(
                "a copy list uploaded for the column form run in the batched form".into(),
            ));
        }
        let Some((codes, n)) = &list.pairs else {
            return Ok(true);
        };
        let Some(g) = BatchGeometry::new(
            flavour,
            r.base,
            r.transfer,
            r.bytes_per_expert,
            *n,
            self.sms,
            resident,
        ) else {
            return Ok(false);
        };
        let f = match (flavour, g.width) {
            (Flavour::CpAsync, 16) => &self.batch[0],
            (Flavour::CpAsync, _) => &self.batch[1],
            (Flavour::Bulk, _) => &self.batch[2],
        };
        let (list_ptr, _sync) = codes.device_ptr(stream);
        let n = *n as u32;
        let stride = r.bytes_per_expert as u64;
        let cfg = LaunchConfig {
            grid_dim: (g.grid, 1, 1),
            block_dim: (g.threads, 1, 1),
            shared_mem_bytes: g.shared as u32,
        };
        let mut l = stream.launch_builder(f);
        l.arg(&r.base)
            .arg(&r.transfer)
            .arg(&list_ptr)
            .arg(&n)
            .arg(&g.units)
            .arg(&stride)
            .arg(&g.chunk);
        // SAFETY: the arguments match the entry's parameters (u64 base, u64 transfer, u64 list, u32
        // n, u64 units, u64 stride, u64 chunk). The list holds `n` pairs checked by
        // `copy_batch::check` against `list.slots <= r.slots` and `list.transfers <= r.transfers`,
        // every unit lies inside one expert (`units * width == bytes_per_expert`) and every chunk
        // row inside the dynamic shared memory (`g.shared` counts `n x chunk x width` after the
        // list and the mbarrier), so every access lies inside the two regions the caller vouches
        // for; the list buffer lives until the launch is done (freed in stream order).
        unsafe { l.launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
        Ok(true)
    }

    /// [`CopyKernel::run_list`] in the form `VARIANTS[variant]`, spread as `shape` says (`None`:
    /// the default geometry).
    ///
    /// # Safety
    /// As [`CopyKernel::run_list`].
    pub unsafe fn run_list_shaped(
        &self,
        stream: &Arc<CudaStream>,
        list: &CopyList,
        r: &Region,
        shape: Option<Shape>,
        variant: usize,
    ) -> Result<()> {
        let (Some(var), Some(fns)) = (VARIANTS.get(variant), self.fns.get(variant)) else {
            return Err(Error::Placement(format!("no copy-kernel form {variant}")));
        };
        if r.slots < list.slots || r.transfers < list.transfers {
            return Err(Error::Placement(format!(
                "a copy list for {} slots and {} transfer experts run over {} and {}",
                list.slots, list.transfers, r.slots, r.transfers
            )));
        }
        let Some(codes) = &list.codes else {
            return Ok(());
        };
        if r.bytes_per_expert == 0 {
            return Ok(());
        }
        let mut g = self.geometry(r);
        let f = match g.width {
            16 => &fns[0],
            4 => &fns[1],
            _ => &fns[2],
        };
        let (list_ptr, _sync) = codes.device_ptr(stream);
        let n = list.copies as u32;
        let mut smem = shared_bytes_for(&g, list.copies, list.scratch, *var);
        if smem > MAX_LIST_BYTES {
            return Err(Error::Placement(format!(
                "a copy list of {n} copies (and its scratch) needs {smem} bytes of shared memory, over the kernel's {MAX_LIST_BYTES}"
            )));
        }
        if let Some(sh) = shape {
            smem = sh.shared(smem);
            g.grid = if sh.persistent {
                (self.sms * sh.resident.clamp(1, 8)).min(g.columns.min(u64::from(u32::MAX)) as u32)
            } else {
                g.columns.clamp(1, u64::from(i32::MAX as u32)) as u32
            };
        }
        let stride = r.bytes_per_expert as u64;
        let cfg = LaunchConfig {
            grid_dim: (g.grid, 1, 1),
            block_dim: (g.threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut l = stream.launch_builder(f);
        l.arg(&r.base)
            .arg(&r.transfer)
            .arg(&list_ptr)
            .arg(&n)
            .arg(&g.units)
            .arg(&stride);
        // SAFETY: the arguments match the entry's parameters (u64 base, u64 transfer, u64 list, u32
        // n, u64 units, u64 stride). The list holds `n` pairs of codes checked by `encode` against
        // `list.slots <= r.slots` and `list.transfers <= r.transfers`, and `Geometry` keeps every
        // unit inside one expert (`units * width == bytes_per_expert`), so every access lies inside
        // the two regions the caller vouches for; the list buffer lives until the launch is done
        // (freed in stream order).
        unsafe { l.launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
        Ok(())
    }

    /// Upload `copies` and run them over one param ([`CopyKernel::upload`] then
    /// [`CopyKernel::run_list`]); for several params of one layer, upload once instead.
    ///
    /// # Safety
    /// As [`CopyKernel::run_list`].
    pub unsafe fn run(&self, stream: &Arc<CudaStream>, r: &Region, copies: &[Copy]) -> Result<()> {
        let cached = self.last.lock().ok().and_then(|l| {
            l.as_ref()
                .filter(|(c, s, t, _, _)| c == copies && *s == r.slots && *t == r.transfers)
                .map(|x| (x.3.clone(), x.4.clone()))
        });
        let list = match cached {
            Some((l, uploaded)) => {
                // The list may have been uploaded on another stream (a small param's side stream).
                stream.wait(&uploaded).map_err(drv("cuStreamWaitEvent"))?;
                l
            }
            None => {
                let l = Arc::new(self.upload(stream, copies, r.slots, r.transfers)?);
                let ev = Arc::new(stream.record_event(None).map_err(drv("cuEventRecord"))?);
                if let Ok(mut last) = self.last.lock() {
                    *last = Some((copies.to_vec(), r.slots, r.transfers, l.clone(), ev));
                }
                l
            }
        };
        // SAFETY: the caller's promise, passed on.
        unsafe { self.run_list(stream, &list, r) }
    }
}

/// A small deterministic generator for the self-check.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let x = self.next().to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
    }

    /// A random placement of `e` experts on `r` slots (every expert once, the rest replicas).
    fn placement(&mut self, e: usize, r: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..e).chain((e..r).map(|_| self.below(e))).collect();
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
        v
    }
}

/// One self-check case: rank 0's copies of a random plan, run at `offset` bytes into the param's
/// allocation; `Ok(None)` when it matches, `Ok(Some(why))` when not.
#[allow(clippy::too_many_arguments)]
fn check_case(
    dev: &Device,
    k: &CopyKernel,
    plan: &moves::MovePlan,
    bpe: usize,
    offset: usize,
    rng: &mut XorShift,
    form: Form,
) -> Result<(Option<String>, Geometry, f64)> {
    let rm = plan.rank(0).cloned().unwrap_or_default();
    let local = plan.local_slots();
    let transfers = rm.transfer_experts();
    let mut host = vec![0u8; offset + local * bpe];
    rng.fill(&mut host);
    let mut recv = vec![0u8; transfers * bpe];
    rng.fill(&mut recv);
    let s = &dev.stream;
    let mut d_main = s.clone_htod(&host).map_err(drv("cuMemcpyHtoD"))?;
    let d_tr = if recv.is_empty() {
        None
    } else {
        Some(s.clone_htod(&recv).map_err(drv("cuMemcpyHtoD"))?)
    };
    let base = d_main.device_ptr_mut(s).0 + offset as u64;
    let transfer = d_tr.as_ref().map_or(0, |b| b.device_ptr(s).0);
    let r = Region {
        base,
        slots: local,
        transfer,
        transfers,
        bytes_per_expert: bpe,
    };
    let g = k.geometry(&r);
    let list = k.upload_for(
        s,
        &rm.copies,
        local,
        transfers,
        matches!(form, Form::Batch { .. }),
    )?;
    // SAFETY: `d_main` holds `offset + local * bpe` bytes and `d_tr` `transfers * bpe`, both live
    // until after the synchronisations below; nothing else uses them.
    unsafe { k.run_form(s, &list, &r, form) }?;
    let got = s.clone_dtoh(&d_main).map_err(drv("cuMemcpyDtoH"))?;
    // The host reference.
    let mut slots: Vec<Vec<u8>> = host[offset..].chunks(bpe).map(|c| c.to_vec()).collect();
    let received: Vec<Vec<u8>> = recv.chunks(bpe).map(|c| c.to_vec()).collect();
    moves::apply_local(&mut slots, &received, &rm.copies)?;
    let mut why = None;
    if got[..offset] != host[..offset] {
        why = Some("bytes before the base changed".to_string());
    }
    for (p, want) in slots.iter().enumerate() {
        let have = &got[offset + p * bpe..offset + (p + 1) * bpe];
        if why.is_none() && have != want.as_slice() {
            let b = have.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            why = Some(format!("slot {p} differs from byte {b}"));
        }
    }
    // Time a few more launches of the same list (same traffic; the bytes no longer matter).
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let reps = 5;
    let t0 = s.record_event(timing).map_err(drv("cuEventRecord"))?;
    for _ in 0..reps {
        // SAFETY: as above.
        unsafe { k.run_form(s, &list, &r, form) }?;
    }
    let t1 = s.record_event(timing).map_err(drv("cuEventRecord"))?;
    s.synchronize().map_err(drv("cuStreamSynchronize"))?;
    let ms = f64::from(t0.elapsed_ms(&t1).map_err(drv("cuEventElapsedTime"))?) / reps as f64;
    let written = rm
        .copies
        .iter()
        .filter(|c| matches!(c.to, Loc::Slot(_)))
        .count();
    let gbs = if ms > 0.0 {
        2.0 * (written * bpe) as f64 / (ms * 1e-3) / 1e9
    } else {
        0.0
    };
    Ok((why, g, gbs))
}

/// Run the kernel on `dev` over random plans and compare with [`moves::apply_local`] on host
/// copies: expert sizes 4, 100, 4099 and 16 MiB (and 16 MiB at a 4-byte-aligned base, the `w4`
/// path), each with a one-rank plan of 32 slots (cycles through the scratch, replicas) and rank 0
/// of an 8-rank plan of 32 local slots (transfer-buffer sources). One line per size: `ok` or
/// `MISMATCH`, the geometry, and the bandwidth of the larger plan (2 x bytes of slots written /
/// time).
///
/// `progress` sees each line as soon as it is done (a long check then shows how far it got).
pub fn gpu_check(dev: &Device, progress: &mut dyn FnMut(&str)) -> Result<String> {
    use crate::copy_batch::Flavour;
    let k = CopyKernel::load(dev)?;
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    let mut all_ok = true;
    for (bpe, offset) in [
        (4usize, 0usize),
        (100, 0),
        (4099, 0),
        (16 << 20, 0),
        (16 << 20, 4),
    ] {
        let mut line = format!("copy_kernel {bpe} B/expert (base+{offset}):");
        let mut ok = true;
        let mut notes = Vec::new();
        for (ranks, e) in [(1usize, 28usize), (1, 32), (8, 256)] {
            let r = 32 * ranks;
            let old = moves::SlotMap::new(rng.placement(e, r), e)?;
            let new = moves::SlotMap::new(rng.placement(e, r), e)?;
            let plan = moves::MovePlan::new(&old, &new, ranks)?;
            let rm = plan.rank(0).cloned().unwrap_or_default();
            let (why, g, gbs) = check_case(dev, &k, &plan, bpe, offset, &mut rng, DEFAULT_FORM)?;
            // The batched forms on the same plan (where they have no entry, the column form).
            let mut batched = Vec::new();
            for flavour in [Flavour::CpAsync, Flavour::Bulk] {
                let form = Form::Batch {
                    flavour,
                    resident: 2,
                };
                let (w, g, b) = check_case(dev, &k, &plan, bpe, offset, &mut rng, form)?;
                if let Some(w) = w {
                    ok = false;
                    notes.push(format!("MISMATCH ({ranks} ranks, {flavour:?}: {w})"));
                }
                // Where the flavour has no entry for the width, the column form ran (checked
                // above all the same): no batched figure.
                let pairs =
                    crate::copy_batch::parallel(&plan.rank(0).cloned().unwrap_or_default().copies)?
                        .len();
                let bg = crate::copy_batch::BatchGeometry::new(
                    flavour,
                    offset as u64,
                    0,
                    bpe,
                    pairs.max(1),
                    k.sms,
                    2,
                );
                batched.push(match bg {
                    Some(_) => format!("{b:.0}"),
                    None => format!("n/a (w{})", g.width),
                });
            }
            if let Some(w) = why {
                ok = false;
                notes.push(format!("MISMATCH ({ranks} ranks: {w})"));
            } else {
                notes.push(format!(
                    "{ranks}r {} copies{} {:.0} GB/s (batched cp.async/bulk {} GB/s)",
                    rm.copies.len(),
                    if rm.uses_scratch() { " +scratch" } else { "" },
                    gbs,
                    batched.join("/")
                ));
            }
            if notes.len() == 1 {
                let _ = write!(
                    line,
                    " w{} {}x{} grid {}",
                    g.width, g.threads, g.columns, g.grid
                );
            }
        }
        all_ok &= ok;
        let _ = write!(
            line,
            " {}: {}",
            if ok { "ok" } else { "FAIL" },
            notes.join(", ")
        );
        progress(&line);
        out.push(line);
    }
    // How the spread over the GPU moves the bandwidth: 16 MiB experts, a 32-slot one-rank plan
    // (cycles) and rank 0 of an 8-rank plan, at 1..8 resident CTAs per SM, persistent or one CTA
    // per column. Each shape's first launch is checked too.
    let (old1, new1) = (
        moves::SlotMap::new(rng.placement(32, 32), 32)?,
        moves::SlotMap::new(rng.placement(32, 32), 32)?,
    );
    let (old8, new8) = (
        moves::SlotMap::new(rng.placement(256, 256), 256)?,
        moves::SlotMap::new(rng.placement(256, 256), 256)?,
    );
    let plans = [
        moves::MovePlan::new(&old1, &new1, 1)?,
        moves::MovePlan::new(&old8, &new8, 8)?,
    ];
    for (vi, var) in VARIANTS.iter().enumerate() {
        let mut line = format!(
            "copy_kernel form w16{} ({} scratch, ld{} st{}), 16 MiB experts:",
            var.suffix,
            if var.smem_scratch { "smem" } else { "register" },
            var.load,
            var.store,
        );
        // 0: the default geometry; else a persistent grid padded to that many CTAs per SM.
        for resident in [0u32, 4] {
            let shape = (resident > 0).then_some(Shape {
                resident,
                persistent: true,
            });
            let mut cell = Vec::new();
            for plan in &plans {
                let form = Form::Columns { variant: vi, shape };
                let (why, _, gbs) = check_case(dev, &k, plan, 16 << 20, 0, &mut rng, form)?;
                if let Some(w) = why {
                    all_ok = false;
                    cell.push(format!("MISMATCH ({w})"));
                } else {
                    cell.push(format!("{gbs:.0}"));
                }
            }
            let what = if resident == 0 {
                "default".to_string()
            } else {
                format!("{resident}/SM")
            };
            let _ = write!(line, " {what} {}", cell.join("/"));
        }
        let line = format!("{line} GB/s (1-rank/8-rank plan)");
        progress(&line);
        out.push(line);
    }
    for flavour in [Flavour::CpAsync, Flavour::Bulk] {
        let mut line = format!("copy_kernel batched {flavour:?}, 16 MiB experts:");
        for resident in [1u32, 2, 4] {
            let mut cell = Vec::new();
            for plan in &plans {
                let form = Form::Batch { flavour, resident };
                let (why, _, gbs) = check_case(dev, &k, plan, 16 << 20, 0, &mut rng, form)?;
                if let Some(w) = why {
                    all_ok = false;
                    cell.push(format!("MISMATCH ({w})"));
                } else {
                    cell.push(format!("{gbs:.0}"));
                }
            }
            let _ = write!(line, " {resident}/SM {}", cell.join("/"));
        }
        let line = format!("{line} GB/s (1-rank/8-rank plan)");
        progress(&line);
        out.push(line);
    }
    out.push(format!(
        "copy_kernel verdict: {}",
        if all_ok { "PASS" } else { "FAIL" }
    ));
    Ok(out.join("\n"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
pub(crate) mod tests {
    use super::*;
    use crate::moves::{MovePlan, SlotMap};
    use proptest::prelude::*;

    fn ptxas() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os("MOEFORGE_PTXAS") {
            return Some(p.into());
        }
        let cache = std::env::var_os("MOEFORGE_TOOLS_DIR")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME")
                    .map(|x| std::path::PathBuf::from(x).join("moeforge/tools"))
            })
            .or_else(|| {
                std::env::var_os("HOME")
                    .map(|h| std::path::PathBuf::from(h).join(".cache/moeforge/tools"))
            })?;
        let p = cache.join("cuda-nvcc-13.0.88/ptxas");
        p.exists().then_some(p)
    }

    #[test]
    fn ptxas_assembles_the_kernel() {
        let Some(ptxas) = ptxas() else {
            assert!(
                std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
                "MOEFORGE_REQUIRE_PTXAS is set but no ptxas was found (run scripts/ptxas)"
            );
            eprintln!("SKIPPED: ptxas not found; the copy kernel's PTX was not assembled");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        for t in ["sm_90a", "sm_100a"] {
            let src = dir.path().join(format!("copy.{t}.ptx"));
            let cubin = dir.path().join(format!("copy.{t}.cubin"));
            std::fs::write(&src, ptx(t)).unwrap();
            let res = std::process::Command::new(&ptxas)
                .args([format!("-arch={t}"), "-O3".into(), "-v".into()])
                .arg(&src)
                .arg("-o")
                .arg(&cubin)
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&res.stderr);
            assert!(res.status.success(), "ptxas rejected it for {t}:\n{log}");
            for l in log.lines().filter(|l| l.contains("spill stores")) {
                assert!(
                    l.contains(", 0 bytes spill stores, 0 bytes spill loads"),
                    "{t}: {log}"
                );
            }
            assert!(std::fs::metadata(&cubin).unwrap().len() > 0);
            eprintln!("{t}:\n{log}");
        }
    }

    #[test]
    fn ptx_is_deterministic_and_names_its_entries() {
        let p = ptx("sm_90a");
        assert_eq!(p, ptx("sm_90a"));
        for w in [16, 4, 1] {
            assert!(p.contains(&format!(".entry moeforge_copy_list_w{w}(")));
        }
        assert!(p.contains("ld.global.v4.u32") && p.contains("st.global.v4.u32"));
    }

    #[test]
    fn geometry_fits_the_sizes_asked_for() {
        // An 88 MB bf16 slot: 16-byte units, full CTAs, 2 per SM over 132 SMs.
        let g = Geometry::new(1 << 20, 1 << 21, 88 << 20, 132);
        assert_eq!((g.width, g.threads, g.grid), (16, 256, 264));
        assert_eq!(g.columns, (88u64 << 20).div_ceil(16 * 1024));
        // A 4-byte alpha: one unit, one warp, one CTA.
        let g = Geometry::new(256, 0, 4, 132);
        assert_eq!((g.width, g.units, g.threads, g.grid), (4, 1, 32, 1));
        assert_eq!(Geometry::new(256, 512, 4099, 132).width, 1);
        assert_eq!(Geometry::new(260, 512, 4096, 132).width, 4);
        assert_eq!(Geometry::new(256, 512, 100, 132).width, 4);
    }

    #[test]
    fn codes_round_trip_and_bad_lists_are_refused() {
        assert_eq!(encode_loc(Loc::Slot(5)).unwrap(), 5);
        assert_eq!(encode_loc(Loc::Transfer(7)).unwrap(), 0x4000_0007);
        assert_eq!(encode_loc(Loc::Scratch).unwrap(), 0x8000_0000);
        assert!(encode_loc(Loc::Slot(1 << 30)).is_err());
        let c = |from, to| Copy { from, to };
        assert!(encode(&[c(Loc::Slot(0), Loc::Slot(4))], 4, 0).is_err());
        assert!(encode(&[c(Loc::Transfer(1), Loc::Slot(0))], 4, 1).is_err());
        assert!(encode(&[c(Loc::Scratch, Loc::Slot(0))], 4, 0).is_err());
        assert!(encode(&[c(Loc::Slot(0), Loc::Transfer(0))], 4, 1).is_err());
        assert!(encode(
            &[c(Loc::Slot(0), Loc::Scratch), c(Loc::Scratch, Loc::Slot(1))],
            2,
            0
        )
        .is_ok());
    }

    /// Every byte of an expert is owned by exactly one (column, thread, j): the no-hazard claim.
    #[test]
    fn units_partition_the_expert() {
        for bpe in [1usize, 4, 100, 4099, 16 * 1024, 16 * 1024 + 16, 200_000] {
            for (base, sms) in [(0u64, 1u32), (4, 2), (1, 132)] {
                let g = Geometry::new(base, 0, bpe, sms);
                let mut seen = vec![0u8; bpe];
                let t = u64::from(g.threads);
                for cta in 0..u64::from(g.grid) {
                    let mut col = cta;
                    while col < g.columns {
                        for tid in 0..t {
                            for j in 0..4 {
                                let u = col * 4 * t + j * t + tid;
                                if u < g.units {
                                    for b in 0..g.width {
                                        seen[(u * g.width + b) as usize] += 1;
                                    }
                                }
                            }
                        }
                        col += u64::from(g.grid);
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "bpe {bpe} base {base}");
            }
        }
    }

    fn perm(keys: &[u32], v: Vec<usize>) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by_key(|&i| (keys[i], i));
        idx.into_iter().map(|i| v[i]).collect()
    }

    /// Random plans for the kernels' simulations: `(ranks, experts, old phy2log, new phy2log)`
    /// over 1-4 ranks of 1-12 slots, every expert placed, up to 3 replicas.
    pub(crate) fn plans() -> impl Strategy<Value = (usize, usize, Vec<usize>, Vec<usize>)> {
        (1usize..=4, 1usize..=12, 0usize..=3).prop_flat_map(|(ranks, per, extra)| {
            let r = ranks * per;
            let e = (r - extra.min(r - 1)).max(1);
            let pl = move || {
                (
                    proptest::collection::vec(0..e, r - e),
                    proptest::collection::vec(any::<u32>(), r),
                )
                    .prop_map(move |(x, k)| perm(&k, (0..e).chain(x).collect()))
            };
            (Just(ranks), Just(e), pl(), pl())
        })
    }

    fn case() -> impl Strategy<Value = (usize, usize, Vec<usize>, Vec<usize>, usize, u64, u64)> {
        plans().prop_flat_map(|(ranks, e, a, b)| {
            (
                Just(ranks),
                Just(e),
                Just(a),
                Just(b),
                prop_oneof![
                    1usize..=40,
                    Just(4usize),
                    Just(16),
                    Just(100),
                    Just(4099),
                    (1usize..=40).prop_map(|x| 16 * 1024 * x / 8 + 16),
                    Just(3 * 16 * 1024 + 5),
                ],
                prop_oneof![Just(0u64), Just(4), Just(1)],
                1u64..=3,
            )
        })
    }

    /// One rank of a random plan with random bytes: its moves, slots, transfer-buffer bytes, and
    /// what `apply_local` makes of them.
    pub(crate) struct RankCase {
        pub(crate) k: usize,
        pub(crate) rm: moves::RankMoves,
        pub(crate) local: usize,
        pub(crate) mem: Vec<u8>,
        pub(crate) recv: Vec<u8>,
        pub(crate) received: Vec<Vec<u8>>,
        pub(crate) want: Vec<Vec<u8>>,
    }

    /// Every rank of the plan from `a` to `b` (`e` experts, `ranks` ranks) at `bpe` bytes an expert.
    pub(crate) fn rank_cases(
        ranks: usize,
        e: usize,
        a: Vec<usize>,
        b: Vec<usize>,
        bpe: usize,
    ) -> Vec<RankCase> {
        let old = SlotMap::new(a, e).unwrap();
        let new = SlotMap::new(b, e).unwrap();
        let plan = MovePlan::new(&old, &new, ranks).unwrap();
        let local = plan.local_slots();
        (0..ranks)
            .map(|k| {
                let rm = plan.rank(k).cloned().unwrap_or_default();
                let t = rm.transfer_experts();
                let mut seed = XorShift(0x1234_5678 ^ ((k as u64) << 32 | bpe as u64));
                let mut mem = vec![0u8; local * bpe];
                seed.fill(&mut mem);
                let mut recv = vec![0u8; t * bpe];
                seed.fill(&mut recv);
                let mut want: Vec<Vec<u8>> = mem.chunks(bpe).map(|c| c.to_vec()).collect();
                let received: Vec<Vec<u8>> = recv.chunks(bpe).map(|c| c.to_vec()).collect();
                moves::apply_local(&mut want, &received, &rm.copies).unwrap();
                RankCase {
                    k,
                    rm,
                    local,
                    mem,
                    recv,
                    received,
                    want,
                }
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Random plans (cycles, replicas, transfers) and sizes: the kernel's arithmetic gives what
        /// `apply_local` gives, on every rank, for every width.
        #[test]
        fn simulation_matches_apply_local((ranks, e, a, b, bpe, base, sms) in case()) {
            for mut c in rank_cases(ranks, e, a, b, bpe) {
                let t = c.rm.transfer_experts();
                let codes = encode(&c.rm.copies, c.local, t).unwrap();
                let g = Geometry::new(256 + base, 512, bpe, sms as u32);
                simulate(&g, &codes, &mut c.mem, &c.recv, bpe).unwrap();
                prop_assert_eq!(c.mem, c.want.concat(), "rank {} bpe {} geometry {:?}", c.k, bpe, g);
            }
        }
    }

    #[test]
    fn a_cycle_never_uses_memory_for_the_scratch() {
        // 0 -> 1 -> 2 -> 0 on one rank: the scratch is registers, the transfer buffer is empty.
        let old = SlotMap::new(vec![0, 1, 2], 3).unwrap();
        let new = SlotMap::new(vec![1, 2, 0], 3).unwrap();
        let plan = MovePlan::new(&old, &new, 1).unwrap();
        let rm = plan.rank(0).cloned().unwrap();
        assert!(rm.uses_scratch());
        for bpe in [4usize, 16 * 1024 * 3 + 16, 77] {
            let mut mem: Vec<u8> = (0..3 * bpe).map(|i| (i / bpe) as u8 + 1).collect();
            let codes = encode(&rm.copies, 3, 0).unwrap();
            simulate(&Geometry::new(0, 0, bpe, 4), &codes, &mut mem, &[], bpe).unwrap();
            let want: Vec<u8> = [2u8, 3, 1].iter().flat_map(|&x| vec![x; bpe]).collect();
            assert_eq!(mem, want);
        }
    }
}
