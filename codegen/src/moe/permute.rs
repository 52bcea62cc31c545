//! The generated route + permute kernels of the MoE layer (issue \[9\], SPEC §9 and §6), PTX for
//! `sm_90a` through the typed builder: four kernels in one module, of which two or three run back
//! to back on one stream with no host synchronization between them (the counts and offsets never
//! leave the device): kernels A, B and C, or for few items ([`Launch::small`]: a decode step) the
//! small path [`ROUTE_SCAN_ENTRY`], kernels A and B in one CTA that counts in shared memory, then
//! C. At one token the launches are the cost (on the H200 three kernels took about 11 us and two
//! take 8-10, whatever little they move), so the fewer the better.
//!
//! With `n = T * k` items `i = t * k + j` (token `t`, choice `j`), `E` logical experts and `R`
//! physical slots:
//! * [`ROUTE_ENTRY`] (kernel A), a grid-stride loop of one thread per item: `e = topk_ids[i]`;
//!   an `e` outside `[0, E)`, a `logcnt[e]` outside `[1, max_replicas]` or a map entry outside
//!   `[0, R)` (a `-1` pad) counts one into `errors[0]` and gives `slot[i] = -1`. Otherwise
//!   `slot[i] = log2phy[e * max_replicas + (t mod logcnt[e])]` (SPEC §9's replica choice) and the
//!   slot's `counts` (this run's, zero on entry) and `load` (the EPLB window's running
//!   load counters, accumulated across launches, `u32`) each count one (`red.global.add.u32`).
//!   Without EPLB, `log2phy` is the identity, `logcnt` all ones and `max_replicas` 1.
//! * [`SCAN_ENTRY`] (kernel B), one CTA: `offsets[s] = sum(counts[..s])` for `s` in `0..=R`
//!   (`i32`, the grouped GEMM's row offsets), and `cursor[..R] = 0`. It leaves the next run's
//!   zeros behind: `counts[..R] = 0` once read, and `errors[1] = errors[0]` (this run's count of
//!   skipped items, what the host reads), `errors[0] = 0`. So a run needs no memset: `counts` and
//!   `errors[0]` are zero on entry when the buffers were allocated zeroed, or when the previous run
//!   on them completed. Each thread holds
//!   [`Launch::scan_chunk`] consecutive counts; warps scan with `shfl.sync.up`, the warps' totals
//!   are scanned by warp 0 through shared memory. `R` is compiled in, at most [`MAX_SLOTS`].
//! * kernel C, the scatter ([`super::scatter`]), a grid-stride loop of one CTA per token: thread
//!   `j < k` takes `pos = offsets[slot] + atom.add(cursor[slot], 1)` for the token's choice `j`,
//!   writes `row_of[pos] = i` and `pos_of[i] = pos` (the inverse of `row_of` that the combine
//!   reads, so the layer needs no inverting kernel) and hands `pos` to the CTA through shared
//!   memory. The CTA then loads row `t` of `x` (bf16 `[T, H]`, `H` compiled in) once, with 16-byte
//!   vector loads all issued before any store, and writes it at each of its positions, as the
//!   module's [`Gather`] says:
//!   * [`Gather::Bf16`], [`SCATTER_ENTRY`]: a copy to `xs`;
//!   * [`Gather::PerToken`], [`Gather::Group128`], [`Gather::Static`], [`SCATTER_E4M3_ENTRY`]:
//!     quantized on the fly to E4M3 codes and scales, bit for bit what `gemm::act_quant` (or the
//!     activation kernel's static rows) would make of the copied rows, for the FP8 recipes' first
//!     GEMM (H at most [`MAX_HIDDEN_E4M3`]: the row is held in registers).
//!
//!   Items with `slot < 0` are skipped, with `pos_of[i] = -1`; so is a `pos` past `n`, which only
//!   counts not zero on entry could make (nothing is written there, and it counts into
//!   `errors[1]`, so the layer reports it).
//!
//! # Row order within a slot
//! The order of a slot's rows in `xs` and `row_of` is the order in which the CTAs won the
//! cursor's atomic, so it may differ between runs. No output bit depends on it: the grouped GEMM's
//! rows are independent (each output row reads one `xs` row and the expert's weights), and the
//! combine sums `out_t = sum_j w[t, j] * y` in `j` order, finding each `(t, j)`'s row through
//! `row_of` (the position of item `i` is the `p` with `row_of[p] = i`), never through a position
//! within the slot. The host reference ([`super::reference`]) puts a slot's rows in `(t, j)`
//! order; its checker accepts any order within a slot.
//!
//! # Parameters, in order
//! * A: `topk_ids` (i32 `[n]`), `log2phy` (i32 `[E, max_replicas]`), `logcnt` (i32 `[E]`), `slot`
//!   (i32 `[n]`, written), `counts` (u32 `[R]`), `load` (u32 `[R]`), `errors` (u32 `[2]`), then
//!   the u32 scalars `n`, `k`, `E`, `max_replicas`.
//! * B: `counts` (u32 `[R]`, zeroed once read), `offsets` (i32 `[R + 1]`, written), `cursor` (u32
//!   `[R]`, zeroed), `errors` (u32 `[2]`).
//! * C: [`SCATTER_PARAMS`] or [`SCATTER_E4M3_PARAMS`] (see [`super::scatter`]): `slot` (i32
//!   `[n]`), `offsets`, `cursor`, `x` (bf16 `[T, H]`, 16-byte aligned), `row_of` (i32 `[n]`, its
//!   first `offsets[R]` written), the gathered rows (and scales), `pos_of` (i32 `[n]`, written),
//!   `errors` (u32 `[2]`: a position past `n` counts into `errors[1]`), then the u32 scalars `n`,
//!   `k`.

use super::emit::{entry_params, push_entry, G};
use super::scatter::scatter;
use crate::gemm::emit::Emit as _;
use crate::ptx::{
    BinOpcode, CmpOp, Entry, Inst, Operand, PtxTy, Reg, SharedDecl, SharedTy, SpecialReg,
    PTX_VERSION,
};
use crate::{Error, Result};

pub use super::scatter::{
    Gather, SCATTER_E4M3_ENTRY, SCATTER_E4M3_PARAMS, SCATTER_ENTRY, SCATTER_PARAMS,
};

/// The small path's entry name (kernels A and B in one CTA).
pub const ROUTE_SCAN_ENTRY: &str = "moeforge_moe_route_scan";
/// Kernel A's entry name.
pub const ROUTE_ENTRY: &str = "moeforge_moe_route_count";
/// Kernel B's entry name.
pub const SCAN_ENTRY: &str = "moeforge_moe_offsets_scan";
/// The most physical slots (kernel B is one CTA of at most 1024 threads, 4 counts each).
pub const MAX_SLOTS: u32 = 4096;
/// The largest hidden size (kernel C's copy is unrolled: `H / 2048` chunks a thread).
pub const MAX_HIDDEN: u32 = 32768;
/// The largest hidden size of the quantizing scatter (8 chunks of 8 values a thread, in
/// registers).
pub const MAX_HIDDEN_E4M3: u32 = 16384;
/// Threads per CTA of kernel A.
pub const ROUTE_THREADS: u32 = 256;
/// Threads per CTA of kernel C (one item at a time: 16 bytes of its row a thread per step).
pub const SCATTER_THREADS: u32 = 256;
/// The most CTAs of kernel A (a grid-stride loop covers the rest).
pub const ROUTE_MAX_CTAS: u32 = 1024;
/// The most CTAs of kernel C.
pub const SCATTER_MAX_CTAS: u32 = 8192;
/// The CTAs kernel C aims for when it splits tokens ([`Launch::scatter_split`]): two waves of the
/// H200's 132 SMs.
pub const SCATTER_UNITS: u32 = 264;
/// The largest top-k of kernel C (one CTA per token: thread `j` claims the token's choice `j`).
pub const MAX_TOPK: u32 = SCATTER_THREADS;

/// The shape a permute module is generated for, and its launch shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Launch {
    /// The hidden size `H` (bf16 elements a row; compiled into kernel C).
    pub hidden: u32,
    /// The physical slot count `R` (compiled into kernel B).
    pub slots: u32,
    /// Threads of kernel B's one CTA.
    pub scan_threads: u32,
    /// Consecutive counts each thread of kernel B holds.
    pub scan_chunk: u32,
    /// What kernel C writes.
    pub gather: Gather,
}

impl Launch {
    /// CTAs of kernel A for `n` items (at least 1).
    pub fn route_grid(&self, n: u32) -> u32 {
        n.div_ceil(ROUTE_THREADS).clamp(1, ROUTE_MAX_CTAS)
    }

    /// Threads of the small path's one CTA: at least 512 and [`Launch::scan_threads`].
    pub fn small_threads(&self) -> u32 {
        self.scan_threads.max(512)
    }

    /// Whether `n` items take the small path ([`ROUTE_SCAN_ENTRY`], then kernel C): at most two
    /// items a thread of its one CTA.
    pub fn small(&self, n: u32) -> bool {
        n <= 2 * self.small_threads()
    }

    /// How many CTAs share a token's `k` items in kernel C, for `t` tokens: one (the token's row
    /// read once, written `k` times) when there are tokens enough for about [`SCATTER_UNITS`]
    /// CTAs, else more, up to one item a CTA, so that a decode step's few rows are written by
    /// many SMs at once. In `1..=k` (1 for `k = 0`).
    pub fn scatter_split(&self, t: u32, k: u32) -> u32 {
        SCATTER_UNITS.div_ceil(t.max(1)).clamp(1, k.max(1))
    }

    /// CTAs of kernel C for `t` tokens split over `split` CTAs each (at least 1).
    pub fn scatter_grid(&self, t: u32, split: u32) -> u32 {
        t.saturating_mul(split).clamp(1, SCATTER_MAX_CTAS)
    }

    /// Bytes of one row of `x`.
    pub fn row_bytes(&self) -> usize {
        2 * self.hidden as usize
    }

    /// Bytes of one gathered row (bf16, or one code a column).
    pub fn gathered_row_bytes(&self) -> usize {
        self.gather.row_bytes(self.hidden as usize)
    }

    /// Kernel C's entry name.
    pub fn scatter_entry(&self) -> &'static str {
        self.gather.entry()
    }
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "permute".into(),
        what,
    }
}

/// The launch shapes for hidden size `hidden` and `slots` physical slots, after checking them:
/// `hidden` positive, a multiple of 8 (rows of whole 16-byte chunks) and at most [`MAX_HIDDEN`];
/// `slots` in `1..=`[`MAX_SLOTS`]; quantized ([`Gather`] other than bf16), `hidden` at most
/// [`MAX_HIDDEN_E4M3`].
pub fn launch(hidden: u32, slots: u32, gather: Gather) -> Result<Launch> {
    let max = if gather == Gather::Bf16 {
        MAX_HIDDEN
    } else {
        MAX_HIDDEN_E4M3
    };
    if hidden == 0 || !hidden.is_multiple_of(8) || hidden > max {
        return Err(unsupported(format!(
            "H = {hidden} (positive, a multiple of 8, at most {max}{})",
            if gather == Gather::Bf16 {
                ""
            } else {
                " when quantized on the fly"
            }
        )));
    }
    if slots == 0 || slots > MAX_SLOTS {
        return Err(unsupported(format!(
            "R = {slots} physical slots (1 to {MAX_SLOTS}: the offsets scan is one CTA)"
        )));
    }
    let scan_threads = (32 * slots.div_ceil(32)).min(1024);
    Ok(Launch {
        hidden,
        slots,
        scan_threads,
        scan_chunk: slots.div_ceil(scan_threads),
        gather,
    })
}

/// The permute module for hidden size `hidden`, `slots` physical slots and the gathered rows'
/// form `gather`: PTX (`.version`, `.target sm_90a`, the four entries [`ROUTE_ENTRY`],
/// [`SCAN_ENTRY`], [`Launch::scatter_entry`], [`ROUTE_SCAN_ENTRY`]) and its launch shapes.
/// Errors: as [`launch`].
pub fn permute_module(hidden: u32, slots: u32, gather: Gather) -> Result<(String, Launch)> {
    let l = launch(hidden, slots, gather)?;
    let mut s = format!(".version {PTX_VERSION}\n.target sm_90a\n.address_size 64\n");
    for (entry, g) in [route(&l), scan(&l)?, scatter(&l, gather)?, route_scan(&l)?] {
        push_entry(&mut s, &entry, &g)?;
    }
    Ok((s, l))
}

/// Kernel A's parameter names, in order.
pub const ROUTE_PARAMS: [&str; 11] = [
    "route_topk_ids",
    "route_log2phy",
    "route_logcnt",
    "route_slot",
    "route_counts",
    "route_load",
    "route_errors",
    "route_items",
    "route_k",
    "route_experts",
    "route_max_replicas",
];

/// The small path's parameter names, in order.
pub const ROUTE_SCAN_PARAMS: [&str; 12] = [
    "small_topk_ids",
    "small_log2phy",
    "small_logcnt",
    "small_slot",
    "small_load",
    "small_errors",
    "small_offsets",
    "small_cursor",
    "small_items",
    "small_k",
    "small_experts",
    "small_max_replicas",
];

/// Kernel B's parameter names, in order.
pub const SCAN_PARAMS: [&str; 4] = ["scan_counts", "scan_offsets", "scan_cursor", "scan_errors"];

/// Where the route's per-slot counts and error count go.
#[derive(Clone, Copy)]
enum Counters {
    /// Kernel A: `red.global.add` on `counts[slot]` and `errors[0]`.
    Global { counts: Reg, errors: Reg },
    /// The small path's one CTA: `red.shared.add` on shared `counts[slot]` and the error word.
    Shared { counts: Reg, errors: Reg },
}

/// The route's parameters as registers.
struct RouteIn {
    ids: Reg,
    log2phy: Reg,
    logcnt: Reg,
    slot_out: Reg,
    load: Reg,
    n: Reg,
    k: Reg,
    experts: Reg,
    maxrep: Reg,
}

/// The route loop: items `first, first + step, ...` below `n`, each routed to its slot (SPEC §9)
/// or counted as an error with slot -1, its slot stored, `load[slot]` counted, and the counters
/// of `c` counted.
fn route_items(g: &mut G, l: &Launch, r: &RouteIn, c: Counters, first: Reg, step: Reg) {
    let i = g.r32();
    g.mov(i, Operand::Reg(first));
    let (top, done, bad, store) = (
        g.b.label("route_item"),
        g.b.label("route_done"),
        g.b.label("route_bad"),
        g.b.label("route_store"),
    );
    g.label(&top);
    let past = g.setp(CmpOp::Ge, PtxTy::U32, i, Operand::Reg(r.n));
    g.bra(&done, Some((past, false)));
    let a = g.elem(r.ids, i, 4);
    let e_id = g.ld(PtxTy::S32, a);
    // Unsigned: a negative id is past E too.
    let out = g.setp(CmpOp::Ge, PtxTy::U32, e_id, Operand::Reg(r.experts));
    let slot = g.r32();
    g.bra(&bad, Some((out, false)));
    let a = g.elem(r.logcnt, e_id, 4);
    let cnt = g.ld(PtxTy::S32, a);
    let few = g.setp(CmpOp::Lt, PtxTy::S32, cnt, Operand::Int(1));
    g.bra(&bad, Some((few, false)));
    let many = g.setp(CmpOp::Lt, PtxTy::U32, r.maxrep, Operand::Reg(cnt));
    g.bra(&bad, Some((many, false)));
    let t = g.bin(BinOpcode::Div, PtxTy::U32, i, Operand::Reg(r.k));
    let rep = g.bin(BinOpcode::Rem, PtxTy::U32, t, Operand::Reg(cnt));
    let idx = g.bin(BinOpcode::MulLo, PtxTy::U32, e_id, Operand::Reg(r.maxrep));
    g.bin_to(idx, BinOpcode::Add, PtxTy::U32, idx, Operand::Reg(rep));
    let a = g.elem(r.log2phy, idx, 4);
    g.b.push(Inst::Ld {
        ty: PtxTy::S32,
        d: slot,
        addr: a,
    });
    let off_map = g.setp(
        CmpOp::Ge,
        PtxTy::U32,
        slot,
        Operand::Int(i64::from(l.slots)),
    );
    g.bra(&bad, Some((off_map, false)));
    match c {
        Counters::Global { counts, .. } => {
            let a = g.elem(counts, slot, 4);
            g.b.push(Inst::RedAddU32 {
                addr: a,
                v: Operand::Int(1),
            });
        }
        Counters::Shared { counts, .. } => {
            let a = g.shared_word(counts, slot);
            g.b.push(Inst::RedSharedAddU32 {
                addr: a,
                v: Operand::Int(1),
            });
        }
    }
    let a = g.elem(r.load, slot, 4);
    g.b.push(Inst::RedAddU32 {
        addr: a,
        v: Operand::Int(1),
    });
    g.bra(&store, None);
    g.label(&bad);
    match c {
        Counters::Global { errors, .. } => g.b.push(Inst::RedAddU32 {
            addr: errors,
            v: Operand::Int(1),
        }),
        Counters::Shared { errors, .. } => g.b.push(Inst::RedSharedAddU32 {
            addr: errors,
            v: Operand::Int(1),
        }),
    }
    g.mov(slot, Operand::Int(-1));
    g.label(&store);
    let a = g.elem(r.slot_out, i, 4);
    g.b.push(Inst::St {
        ty: PtxTy::S32,
        addr: a,
        v: slot,
    });
    g.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(step));
    g.bra(&top, None);
    g.label(&done);
}

fn route(l: &Launch) -> (Entry, G) {
    let mut e = Entry::new(ROUTE_ENTRY);
    e.params = entry_params(&ROUTE_PARAMS, 7, |_| 4);
    e.maxntid = Some(ROUTE_THREADS);
    let mut g = G::default();
    let [ids, log2phy, logcnt, slot_out, counts, load, errors] =
        [0, 1, 2, 3, 4, 5, 6].map(|k| g.global_param(ROUTE_PARAMS[k]));
    let [n, k, experts, maxrep] = [7, 8, 9, 10].map(|i| g.u32_param(ROUTE_PARAMS[i]));
    let (i, step) = g.grid_stride();
    let r = RouteIn {
        ids,
        log2phy,
        logcnt,
        slot_out,
        load,
        n,
        k,
        experts,
        maxrep,
    };
    route_items(&mut g, l, &r, Counters::Global { counts, errors }, i, step);
    g.b.push(Inst::Ret);
    (e, g)
}

/// The inclusive scan of `v` over the warp's lanes (`lane` is the thread's lane), in place.
fn warp_scan(g: &mut G, v: Reg, lane: Reg) {
    for d in [1, 2, 4, 8, 16] {
        let o = g.r32();
        g.b.push(Inst::ShflUp {
            d: o,
            a: v,
            delta: d,
        });
        let below = g.setp(CmpOp::Lt, PtxTy::U32, lane, Operand::Int(d));
        g.b.push(Inst::Selp {
            ty: PtxTy::U32,
            d: o,
            a: Operand::Int(0),
            b: Operand::Reg(o),
            p: below,
        });
        g.bin_to(v, BinOpcode::Add, PtxTy::U32, v, Operand::Reg(o));
    }
}

/// Where the scan reads the counts.
#[derive(Clone, Copy)]
enum CountsIn {
    /// Kernel B: global `counts`, zeroed once read, and `errors` (`[1] = [0]`, `[0] = 0`).
    Global { counts: Reg, errors: Reg },
    /// The small path: the shared counts its route made.
    Shared { counts: Reg },
}

fn scan(l: &Launch) -> Result<(Entry, G)> {
    let mut e = Entry::new(SCAN_ENTRY);
    e.params = entry_params(&SCAN_PARAMS, SCAN_PARAMS.len(), |_| 4);
    e.maxntid = Some(l.scan_threads);
    let mut g = G::default();
    g.b.declare_shared(SharedDecl::array("scan_warps", SharedTy::B32, 32, 4)?)?;
    let [counts, offsets, cursor, errors] = [0, 1, 2, 3].map(|k| g.global_param(SCAN_PARAMS[k]));
    let tid = g.special(SpecialReg::TidX);
    scan_body(
        &mut g,
        l,
        tid,
        CountsIn::Global { counts, errors },
        offsets,
        cursor,
    );
    g.b.push(Inst::Ret);
    Ok((e, g))
}

/// `offsets[s] = sum(counts[..s])` for `s` in `0..=R` and `cursor[..R] = 0`, by the CTA's
/// threads (at least [`Launch::scan_threads`], at most 1024: threads past them hold no counts);
/// thread `tid` holds [`Launch::scan_chunk`] consecutive counts. Needs the shared `scan_warps`
/// (32 words).
fn scan_body(g: &mut G, l: &Launch, tid: Reg, src: CountsIn, offsets: Reg, cursor: Reg) {
    let slots = i64::from(l.slots);
    let chunk = l.scan_chunk;
    let lane = g.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(31));
    let warp = g.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(5));
    let base = g.bin(
        BinOpcode::MulLo,
        PtxTy::U32,
        tid,
        Operand::Int(i64::from(chunk)),
    );
    let zero = g.r32();
    g.mov(zero, Operand::Int(0));
    let sum = g.r32();
    g.mov(sum, Operand::Int(0));
    let mut vals = Vec::with_capacity(chunk as usize);
    for c in 0..chunk {
        let idx = g.bin(BinOpcode::Add, PtxTy::U32, base, Operand::Int(i64::from(c)));
        let v = g.r32();
        g.mov(v, Operand::Int(0));
        let skip = g.b.label("scan_skip_load");
        let past = g.setp(CmpOp::Ge, PtxTy::U32, idx, Operand::Int(slots));
        g.bra(&skip, Some((past, false)));
        match src {
            CountsIn::Global { counts, .. } => {
                let a = g.elem(counts, idx, 4);
                g.b.push(Inst::Ld {
                    ty: PtxTy::U32,
                    d: v,
                    addr: a,
                });
                // Zero for the next run (each count is read by this thread only).
                g.b.push(Inst::St {
                    ty: PtxTy::U32,
                    addr: a,
                    v: zero,
                });
            }
            CountsIn::Shared { counts } => {
                let a = g.shared_word(counts, idx);
                g.b.push(Inst::LdSharedU32 {
                    d: v,
                    addr: a,
                    off: 0,
                });
            }
        }
        let a = g.elem(cursor, idx, 4);
        g.b.push(Inst::St {
            ty: PtxTy::U32,
            addr: a,
            v: zero,
        });
        g.label(&skip);
        g.bin_to(sum, BinOpcode::Add, PtxTy::U32, sum, Operand::Reg(v));
        vals.push((idx, v));
    }
    if let CountsIn::Global { errors, .. } = src {
        // Thread 0 reports this run's errors in `errors[1]` and zeroes `errors[0]` for the next
        // run.
        let not_t0 = g.b.label("scan_not_thread0");
        let p = g.setp(CmpOp::Ne, PtxTy::U32, tid, Operand::Int(0));
        g.bra(&not_t0, Some((p, false)));
        let bad = g.ld(PtxTy::U32, errors);
        g.b.push(Inst::St {
            ty: PtxTy::U32,
            addr: errors,
            v: zero,
        });
        let a = g.bin(BinOpcode::Add, PtxTy::U64, errors, Operand::Int(4));
        g.b.push(Inst::St {
            ty: PtxTy::U32,
            addr: a,
            v: bad,
        });
        g.label(&not_t0);
    }
    let incl = g.r32();
    g.mov(incl, Operand::Reg(sum));
    warp_scan(g, incl, lane);
    let warps = g.r32();
    g.b.push(Inst::MovSym {
        d: warps,
        sym: "scan_warps".into(),
    });
    let warp_slot = g.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(2));
    g.bin_to(
        warp_slot,
        BinOpcode::Add,
        PtxTy::U32,
        warp_slot,
        Operand::Reg(warps),
    );
    let not_last = g.b.label("scan_not_last_lane");
    let p = g.setp(CmpOp::Ne, PtxTy::U32, lane, Operand::Int(31));
    g.bra(&not_last, Some((p, false)));
    g.b.push(Inst::StSharedU32 {
        addr: warp_slot,
        off: 0,
        v: incl,
    });
    g.label(&not_last);
    g.b.push(Inst::BarSync);
    // Warp 0 turns the warps' totals into their exclusive prefixes.
    let not_first = g.b.label("scan_not_warp0");
    let p = g.setp(CmpOp::Ne, PtxTy::U32, warp, Operand::Int(0));
    g.bra(&not_first, Some((p, false)));
    let lane_slot = g.bin(BinOpcode::Shl, PtxTy::B32, lane, Operand::Int(2));
    g.bin_to(
        lane_slot,
        BinOpcode::Add,
        PtxTy::U32,
        lane_slot,
        Operand::Reg(warps),
    );
    let w = g.r32();
    g.b.push(Inst::LdSharedU32 {
        d: w,
        addr: lane_slot,
        off: 0,
    });
    let absent = g.setp(
        CmpOp::Ge,
        PtxTy::U32,
        lane,
        Operand::Int(i64::from(l.scan_threads / 32)),
    );
    g.b.push(Inst::Selp {
        ty: PtxTy::U32,
        d: w,
        a: Operand::Int(0),
        b: Operand::Reg(w),
        p: absent,
    });
    let wi = g.r32();
    g.mov(wi, Operand::Reg(w));
    warp_scan(g, wi, lane);
    let ex = g.bin(BinOpcode::Sub, PtxTy::U32, wi, Operand::Reg(w));
    g.b.push(Inst::StSharedU32 {
        addr: lane_slot,
        off: 0,
        v: ex,
    });
    g.label(&not_first);
    g.b.push(Inst::BarSync);
    let prefix = g.r32();
    g.b.push(Inst::LdSharedU32 {
        d: prefix,
        addr: warp_slot,
        off: 0,
    });
    g.bin_to(
        prefix,
        BinOpcode::Add,
        PtxTy::U32,
        prefix,
        Operand::Reg(incl),
    );
    g.bin_to(
        prefix,
        BinOpcode::Sub,
        PtxTy::U32,
        prefix,
        Operand::Reg(sum),
    );
    for (idx, v) in vals {
        let skip = g.b.label("scan_skip_store");
        let past = g.setp(CmpOp::Ge, PtxTy::U32, idx, Operand::Int(slots));
        g.bra(&skip, Some((past, false)));
        let a = g.elem(offsets, idx, 4);
        g.b.push(Inst::St {
            ty: PtxTy::U32,
            addr: a,
            v: prefix,
        });
        g.label(&skip);
        g.bin_to(prefix, BinOpcode::Add, PtxTy::U32, prefix, Operand::Reg(v));
    }
    // The thread holding slot R - 1 ends with the total: offsets[R].
    let not_total = g.b.label("scan_not_total");
    let holder = (l.slots - 1) / chunk;
    let p = g.setp(CmpOp::Ne, PtxTy::U32, tid, Operand::Int(i64::from(holder)));
    g.bra(&not_total, Some((p, false)));
    let a = g.bin(BinOpcode::Add, PtxTy::U64, offsets, Operand::Int(4 * slots));
    g.b.push(Inst::St {
        ty: PtxTy::U32,
        addr: a,
        v: prefix,
    });
    g.label(&not_total);
}

/// The small path: kernels A and B in one CTA of [`Launch::small_threads`], counting in shared
/// memory (so `counts` and `errors[0]` are not touched: they stay zero), `errors[1]` the run's.
fn route_scan(l: &Launch) -> Result<(Entry, G)> {
    let mut e = Entry::new(ROUTE_SCAN_ENTRY);
    e.params = entry_params(&ROUTE_SCAN_PARAMS, 8, |_| 4);
    e.maxntid = Some(l.small_threads());
    let mut g = G::default();
    g.b.declare_shared(SharedDecl::array("scan_warps", SharedTy::B32, 32, 4)?)?;
    g.b.declare_shared(SharedDecl::array(
        "small_counts",
        SharedTy::B32,
        l.slots + 1,
        4,
    )?)?;
    let [ids, log2phy, logcnt, slot_out, load, errors, offsets, cursor] =
        [0, 1, 2, 3, 4, 5, 6, 7].map(|k| g.global_param(ROUTE_SCAN_PARAMS[k]));
    let [n, k, experts, maxrep] = [8, 9, 10, 11].map(|i| g.u32_param(ROUTE_SCAN_PARAMS[i]));
    let tid = g.special(SpecialReg::TidX);
    let ntid = g.special(SpecialReg::NtidX);
    // Shared: the R counts, then the error count.
    let counts = g.r32();
    g.b.push(Inst::MovSym {
        d: counts,
        sym: "small_counts".into(),
    });
    let err = g.bin(
        BinOpcode::Add,
        PtxTy::U32,
        counts,
        Operand::Int(4 * i64::from(l.slots)),
    );
    let zero = g.r32();
    g.mov(zero, Operand::Int(0));
    // Zero them: words tid, tid + ntid, ... of R + 1.
    let w = g.r32();
    g.mov(w, Operand::Reg(tid));
    let (ztop, zdone) = (g.b.label("small_zero"), g.b.label("small_zeroed"));
    g.label(&ztop);
    let past = g.setp(
        CmpOp::Ge,
        PtxTy::U32,
        w,
        Operand::Int(i64::from(l.slots) + 1),
    );
    g.bra(&zdone, Some((past, false)));
    let a = g.shared_word(counts, w);
    g.b.push(Inst::StSharedU32 {
        addr: a,
        off: 0,
        v: zero,
    });
    g.bin_to(w, BinOpcode::Add, PtxTy::U32, w, Operand::Reg(ntid));
    g.bra(&ztop, None);
    g.label(&zdone);
    g.b.push(Inst::BarSync);
    let r = RouteIn {
        ids,
        log2phy,
        logcnt,
        slot_out,
        load,
        n,
        k,
        experts,
        maxrep,
    };
    route_items(
        &mut g,
        l,
        &r,
        Counters::Shared {
            counts,
            errors: err,
        },
        tid,
        ntid,
    );
    g.b.push(Inst::BarSync);
    // Thread 0: `errors[1]` is this run's count (`errors[0]` stays zero).
    let not_t0 = g.b.label("small_not_thread0");
    let p = g.setp(CmpOp::Ne, PtxTy::U32, tid, Operand::Int(0));
    g.bra(&not_t0, Some((p, false)));
    let bad = g.r32();
    g.b.push(Inst::LdSharedU32 {
        d: bad,
        addr: err,
        off: 0,
    });
    let a = g.bin(BinOpcode::Add, PtxTy::U64, errors, Operand::Int(4));
    g.b.push(Inst::St {
        ty: PtxTy::U32,
        addr: a,
        v: bad,
    });
    g.label(&not_t0);
    scan_body(&mut g, l, tid, CountsIn::Shared { counts }, offsets, cursor);
    g.b.push(Inst::Ret);
    Ok((e, g))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_at_generation() {
        assert!(permute_module(7168, 4097, Gather::Bf16).is_err());
        assert!(permute_module(7168, 0, Gather::Bf16).is_err());
        assert!(permute_module(7164, 32, Gather::Bf16).is_err());
        assert!(permute_module(0, 32, Gather::Bf16).is_err());
        assert!(permute_module(MAX_HIDDEN + 8, 32, Gather::Bf16).is_err());
        let l = launch(7168, 4096, Gather::Bf16).unwrap();
        assert_eq!((l.scan_threads, l.scan_chunk), (1024, 4));
        let l = launch(8, 33, Gather::Bf16).unwrap();
        assert_eq!((l.scan_threads, l.scan_chunk), (64, 1));
        assert_eq!(l.route_grid(0), 1);
        assert_eq!(l.scatter_grid(9, 1), 9);
        assert_eq!(l.scatter_grid(9, 8), 72);
        assert_eq!(l.scatter_grid(u32::MAX, 2), SCATTER_MAX_CTAS);
        // A decode step: one item a CTA; many tokens: one token a CTA; between: between.
        assert_eq!(l.scatter_split(1, 8), 8);
        assert_eq!(l.scatter_split(16, 8), 8);
        assert_eq!(l.scatter_split(128, 8), 3);
        assert_eq!(l.scatter_split(264, 8), 1);
        assert_eq!(l.scatter_split(8192, 8), 1);
        assert_eq!(l.scatter_split(0, 0), 1);
        for t in 0..600 {
            for k in 1..=9 {
                let s = l.scatter_split(t, k);
                assert!((1..=k).contains(&s), "t={t} k={k}: {s}");
            }
        }
    }

    #[test]
    fn module_has_four_entries_and_is_deterministic() {
        let (a, l) = permute_module(7168, 256, Gather::Bf16).unwrap();
        let (b, _) = permute_module(7168, 256, Gather::Bf16).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.matches(".entry ").count(), 4);
        for e in [ROUTE_ENTRY, SCAN_ENTRY, SCATTER_ENTRY, ROUTE_SCAN_ENTRY] {
            assert_eq!(a.matches(&format!(".entry {e}(")).count(), 1);
        }
        assert!(a.contains("shfl.sync.up.b32"));
        assert!(a.contains("atom.global.add.u32"));
        assert!(a.contains("ld.global.nc.v4.b32"));
        // The small path counts in shared memory.
        assert!(a.contains("red.shared.add.u32"));
        assert_eq!(l.small_threads(), 512);
        assert!(l.small(1024) && !l.small(1025));
    }
}
