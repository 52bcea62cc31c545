//! v0 of the generated grouped GEMM (issue \[7\] item 3, prefill form): `Y[rows of e] = X[rows of e] ·
//! W[e]^T` with bf16 operands and an f32 output, one kernel `moeforge_gemm_bf16_v0` emitted through
//! the typed PTX builder (or the same kernel under another entry name, [`grouped_bf16_v0_entry`],
//! so that several variants share one module). Simple and correct first, not tuned.
//!
//! # Shape of the kernel
//! * One CTA of one warpgroup (128 threads) computes one `BM x BN = 64 x 128` output tile of one
//!   expert with `wgmma.mma_async m64n128k16` (bf16, both operands from shared memory, K-major,
//!   128-byte swizzle), `BK = 64` deep per pipeline stage (four k16 steps, the descriptors' low word
//!   advancing by 2 per step as in the H200 example, GEMM.md §1.5).
//! * `S` stages (`2..=MAX_STAGES`) in dynamic shared memory, each `A 8 KiB + B 16 KiB`, at
//!   1024-byte aligned addresses (the dynamic base is rounded up at run time; the launch asks for
//!   [`SMEM_ALIGN_SLACK`] bytes more); one "full" mbarrier per stage (static shared memory), on
//!   which thread 0 expects the 24576 bytes of both TMA boxes.
//! * The classic single-warpgroup software pipeline: the loads of the first `S - 1` k-tiles are
//!   issued up front; k-iteration `i` first issues the load of k-tile `i + S - 1` into the stage
//!   consumed by iteration `i - 1` (free: every iteration ends in `wgmma.wait_group 0` and a CTA
//!   barrier), then waits on `full[i % S]` with parity `(i / S) & 1`, fences, issues four wgmmas
//!   (scale-d 0 on the very first), commits and waits for them. So `S - 1` loads are in flight
//!   while one stage is multiplied; the MMAs of consecutive iterations do not overlap (v0).
//! * Grid: `x` = `ceil(N / 128)` n-tiles, `y` = an upper bound on the m-tiles, `ceil(T / 64) + E`.
//!   CTA `(x, y)` finds its expert and m-tile by scanning the device-resident offsets ([`cta_tile`]
//!   is the same scan on the host): the m-tiles are numbered expert by expert (`ceil(rows_e / 64)`
//!   each), and a CTA past the last one exits at once.
//! * TMA coordinates: `X {k0, row0}` (rank-2 map of `X [T, K]`, box 64 rows x 64 K), `W {k0, n0, e}`
//!   (rank-3 map of `W [E, N, K]`, box 128 rows x 64 K x 1, so rows past `N` are zero-filled, never
//!   read from the next expert).
//! * Epilogue: the accumulator fragment (GEMM.md §1.6; thread `t`, warp `w = t / 32`, lane `l`:
//!   row `16w + l/4`, column `2(l % 4)`; `f[4j], f[4j+1]` at `(row, 8j + {0,1})`, `f[4j+2],
//!   f[4j+3]` at `(row + 8, 8j + {0,1})`) stored with `st.global.f32`, masked: rows at or past
//!   `offsets[e + 1]` (the next expert's rows, which a ragged last tile computes) and columns at or
//!   past `N` are not stored.
//!
//! # Parameters, in order
//! `.param .align 64 .b8 tmap_x[128]`, `.param .align 64 .b8 tmap_w[128]`, `.param .u64 y` (f32
//! `[T, N]` row-major), `.param .u64 offsets` (i32 `[E + 1]`, exclusive row offsets, in device
//! memory: no host sync), `.param .u32 experts`.

use std::ops::Range;

use super::emit::{Emit as _, K};
use crate::ptx::{
    AsyncOp, BinOpcode, Builder, CmpOp, DynamicShared, Entry, Guard, Inst, Operand, Param, PtxTy,
    Reg, RegClass, ScaleD, SharedDecl, SharedTy, SpecialReg, TmaDim, TmaLoad, Wgmma, WgmmaN,
    WgmmaTy, PTX_VERSION,
};
use crate::{Error, Result};

/// The kernel's entry name.
pub const V0_ENTRY: &str = "moeforge_gemm_bf16_v0";
/// Output rows per CTA (one wgmma m64).
pub const BM: u32 = 64;
/// Output columns per CTA (the wgmma N).
pub const BN: u32 = 128;
/// K depth of one pipeline stage (one 128-byte swizzle span of bf16).
pub const BK: u32 = 64;
/// Threads per CTA (one warpgroup).
pub const THREADS: u32 = 128;
/// Bytes of A (`X`, 64 x 64 bf16) per stage.
pub const A_STAGE_BYTES: u32 = BM * BK * 2;
/// Bytes of B (`W[e]`, 128 x 64 bf16) per stage.
pub const B_STAGE_BYTES: u32 = BN * BK * 2;
/// Bytes of one stage (the expected transaction bytes of its mbarrier).
pub const STAGE_BYTES: u32 = A_STAGE_BYTES + B_STAGE_BYTES;
/// Extra dynamic shared memory so that the kernel can round its base up to 1024 bytes.
pub const SMEM_ALIGN_SLACK: u32 = 1024;
/// The most stages (`8 x 24 KiB + 1 KiB` fits the H200's 227 KiB per CTA).
pub const MAX_STAGES: u32 = 8;
/// The sm_90 descriptor's high word for a K-major 128B-swizzled tile: SBO 1024 bytes, layout 1.
const DESC_HI: i64 = 0x4000_0040;
/// The descriptor's low-word LBO field (16 bytes, ignored for swizzled K-major operands).
const DESC_LBO: i64 = 0x1_0000;

/// Parameter names, in launch order.
pub const PARAMS: [&str; 5] = ["tmap_x", "tmap_w", "y", "offsets", "experts"];

/// What a launch of the kernel needs besides its arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Launch {
    /// The entry name.
    pub entry: String,
    /// N (compiled in).
    pub n: u32,
    /// K (compiled in).
    pub k: u32,
    /// Pipeline stages.
    pub stages: u32,
    /// K tiles of [`BK`] per output tile.
    pub k_tiles: u32,
    /// Threads per CTA.
    pub threads: u32,
    /// Dynamic shared memory per CTA, in bytes (above 48 KiB: the launch must opt in with
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub dynamic_smem_bytes: u32,
}

impl Launch {
    /// The grid for `t` token rows over `experts` experts: `(ceil(N / BN), ceil(T / BM) + E, 1)`.
    pub fn grid(&self, t: u32, experts: u32) -> (u32, u32, u32) {
        (
            self.n.div_ceil(BN),
            t.div_ceil(BM).saturating_add(experts),
            1,
        )
    }
}

/// The tile a CTA of grid row `cta_y` computes: its expert, m-tile within the expert and global
/// rows (clipped at the expert's end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtaTile {
    /// The expert.
    pub expert: usize,
    /// The m-tile within the expert.
    pub m_tile: usize,
    /// The rows it stores.
    pub rows: Range<usize>,
}

/// The kernel's scan on the host: walk the experts in order, counting `ceil(rows_e / BM)` m-tiles
/// each, until the count passes `cta_y`; `None` (the CTA exits) past the last m-tile. `offsets` has
/// `E + 1` entries.
pub fn cta_tile(offsets: &[usize], cta_y: usize) -> Option<CtaTile> {
    let bm = BM as usize;
    let mut before = 0usize;
    for (e, w) in offsets.windows(2).enumerate() {
        let (lo, hi) = (w[0], w[1]);
        let tiles = (hi - lo).div_ceil(bm);
        if cta_y < before + tiles {
            let m_tile = cta_y - before;
            let r0 = lo + bm * m_tile;
            return Some(CtaTile {
                expert: e,
                m_tile,
                rows: r0..(r0 + bm).min(hi),
            });
        }
        before += tiles;
    }
    None
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "grouped GEMM bf16 v0".into(),
        what,
    }
}

/// The operands of one stage's loads.
struct LoadOps {
    guard: Guard,
    tmap_x: Reg,
    tmap_w: Reg,
    row0: Reg,
    n0: Reg,
    expert: Reg,
}

/// Under `ops.guard`: expect the stage's bytes on `bar`, then the two TMA loads of k-tile
/// coordinate `k0` into the stage at `a` (A) and `a + A_STAGE_BYTES` (B).
fn issue_load(k: &mut K, ops: &LoadOps, a: Reg, bar: Reg, k0: Reg) -> Result<()> {
    let b_dst = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        a,
        Operand::Int(A_STAGE_BYTES.into()),
    );
    k.b.emit_guarded(
        ops.guard,
        AsyncOp::MbarrierArriveExpectTx {
            bar,
            tx_bytes: Operand::Int(STAGE_BYTES.into()),
        },
    )?;
    k.b.emit_guarded(
        ops.guard,
        AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D2,
            dst: a,
            tmap: ops.tmap_x,
            coords: vec![k0, ops.row0],
            bar,
            cache_hint: None,
        }),
    )?;
    k.b.emit_guarded(
        ops.guard,
        AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D3,
            dst: b_dst,
            tmap: ops.tmap_w,
            coords: vec![k0, ops.n0, ops.expert],
            bar,
            cache_hint: None,
        }),
    )
}

/// The PTX module header of the GEMM kernels (`.version`, `.target sm_90a`, `.address_size 64`).
pub fn module_header() -> String {
    format!(".version {PTX_VERSION}\n.target sm_90a\n.address_size 64\n\n")
}

/// The kernel for `N = n`, `K = k` and `stages` pipeline stages: the PTX module (`.version`,
/// `.target sm_90a`, one entry [`V0_ENTRY`]) and its launch information.
///
/// Errors: `n` or `k` of 0, `k` not a multiple of 8 (the TMA row stride must be a multiple of 16
/// bytes), stages outside `2..=MAX_STAGES`, sizes past the kernel's 32-bit index arithmetic.
pub fn grouped_bf16_v0(n: u32, k: u32, stages: u32) -> Result<(String, Launch)> {
    let (body, launch) = grouped_bf16_v0_entry(V0_ENTRY, n, k, stages)?;
    Ok((module_header() + &body, launch))
}

/// [`grouped_bf16_v0`] as one entry named `name`, without the module header (so that several
/// entries concatenate into one module after [`module_header`]): the entry's text (its dynamic
/// shared memory's `.extern .shared` declaration, the `.entry` and its body) and its launch
/// information. Errors: as [`grouped_bf16_v0`], and a name that is not a PTX identifier.
pub fn grouped_bf16_v0_entry(name: &str, n: u32, k: u32, stages: u32) -> Result<(String, Launch)> {
    if !super::emit::is_ptx_ident(name) {
        return Err(unsupported(format!(
            "entry name `{name}` (not a PTX identifier)"
        )));
    }
    if n == 0 || k == 0 || !k.is_multiple_of(8) {
        return Err(unsupported(format!(
            "N = {n}, K = {k} (both positive, K a multiple of 8)"
        )));
    }
    if !(2..=MAX_STAGES).contains(&stages) {
        return Err(unsupported(format!("{stages} stages (2 to {MAX_STAGES})")));
    }
    if n > (1 << 24) || k > (1 << 24) {
        return Err(unsupported(format!("N = {n}, K = {k} (at most 2^24 each)")));
    }
    let k_tiles = k.div_ceil(BK);
    let launch = Launch {
        entry: name.to_string(),
        n,
        k,
        stages,
        k_tiles,
        threads: THREADS,
        dynamic_smem_bytes: stages * STAGE_BYTES + SMEM_ALIGN_SLACK,
    };

    let mut entry = Entry::new(name);
    entry.params = vec![
        Param::tensor_map(PARAMS[0]),
        Param::tensor_map(PARAMS[1]),
        Param::global_ptr(PARAMS[2], 16),
        Param::global_ptr(PARAMS[3], 4),
        Param::scalar(PARAMS[4], PtxTy::U32),
    ];
    entry.dynamic_shared = Some(DynamicShared {
        name: "smem".into(),
        align: 1024,
    });
    let mut kb = K {
        b: Builder::default(),
    };
    kb.b.declare_shared(SharedDecl::array("full_bar", SharedTy::B64, stages, 8)?)?;
    let k = &mut kb;

    // Prologue: the leader thread, the tensor maps.
    let tid = k.special(SpecialReg::TidX);
    let leader = k.setp(CmpOp::Eq, tid, Operand::Int(0));
    let tmap_x = k.b.tensor_map_addr(PARAMS[0])?;
    let tmap_w = k.b.tensor_map_addr(PARAMS[1])?;
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::PrefetchTensorMap { tmap: tmap_x },
    )?;
    k.b.emit_guarded(
        Guard::when(leader),
        AsyncOp::PrefetchTensorMap { tmap: tmap_w },
    )?;

    // Which (expert, m-tile): scan the device offsets (every thread, redundantly).
    let cta_x = k.special(SpecialReg::CtaidX);
    let cta_y = k.special(SpecialReg::CtaidY);
    let experts = k.reg32();
    k.b.push(Inst::LdParam {
        ty: PtxTy::U32,
        d: experts,
        name: PARAMS[4].into(),
    });
    let off = k.global_param(PARAMS[3]);
    let cursor = k.bin(BinOpcode::Add, PtxTy::U64, off, Operand::Int(0));
    let expert = k.imm(0);
    let before = k.imm(0);
    let lo = k.reg32();
    k.b.push(Inst::Ld {
        ty: PtxTy::U32,
        d: lo,
        addr: cursor,
    });
    let hi = k.reg32();
    let (scan, exit, found) = (k.b.label("scan"), k.b.label("exit"), k.b.label("found"));
    k.b.push(Inst::Label(scan.clone()));
    let done = k.setp(CmpOp::Ge, expert, Operand::Reg(experts));
    k.bra(&exit, Some((done, false)));
    k.bin_to(cursor, BinOpcode::Add, PtxTy::U64, cursor, Operand::Int(4));
    k.b.push(Inst::Ld {
        ty: PtxTy::U32,
        d: hi,
        addr: cursor,
    });
    let tiles = k.bin(BinOpcode::Sub, PtxTy::U32, hi, Operand::Reg(lo));
    k.bin_to(
        tiles,
        BinOpcode::Add,
        PtxTy::U32,
        tiles,
        Operand::Int((BM - 1).into()),
    );
    k.bin_to(tiles, BinOpcode::Shr, PtxTy::U32, tiles, Operand::Int(6));
    let next_before = k.bin(BinOpcode::Add, PtxTy::U32, before, Operand::Reg(tiles));
    let hit = k.setp(CmpOp::Lt, cta_y, Operand::Reg(next_before));
    k.bra(&found, Some((hit, false)));
    k.mov(before, Operand::Reg(next_before));
    k.mov(lo, Operand::Reg(hi));
    k.bin_to(expert, BinOpcode::Add, PtxTy::U32, expert, Operand::Int(1));
    k.bra(&scan, None);
    k.b.push(Inst::Label(exit));
    k.b.push(Inst::Ret);
    k.b.push(Inst::Label(found));
    // row0 = offsets[e] + 64 * (cta_y - before); rows stop at offsets[e + 1] (= hi).
    let m_tile = k.bin(BinOpcode::Sub, PtxTy::U32, cta_y, Operand::Reg(before));
    let row0 = k.bin(BinOpcode::Shl, PtxTy::B32, m_tile, Operand::Int(6));
    k.bin_to(row0, BinOpcode::Add, PtxTy::U32, row0, Operand::Reg(lo));
    let row_end = hi;
    let n0 = k.bin(BinOpcode::Shl, PtxTy::B32, cta_x, Operand::Int(7));

    // Barriers: one "full" mbarrier per stage, one arrival (the leader's expect_tx) each.
    let bars = k.b.shared_addr("full_bar");
    for s in 0..stages {
        let bar = k.bin(
            BinOpcode::Add,
            PtxTy::U32,
            bars,
            Operand::Int(8 * i64::from(s)),
        );
        k.b.emit_guarded(
            Guard::when(leader),
            AsyncOp::MbarrierInit {
                bar,
                count: Operand::Int(1),
            },
        )?;
    }
    k.b.emit_guarded(Guard::when(leader), AsyncOp::FenceMbarrierInit)?;
    k.b.push(Inst::BarSync);
    // The stage buffers: the dynamic base rounded up to 1024 bytes.
    let base = k.aligned_shared_base("smem", SMEM_ALIGN_SLACK);

    // Prefill: k-tiles 0 .. min(S - 1, KT) into stages 0 ...
    let ops = LoadOps {
        guard: Guard::when(leader),
        tmap_x,
        tmap_w,
        row0,
        n0,
        expert,
    };
    for j in 0..(stages - 1).min(k_tiles) {
        let a = k.bin(
            BinOpcode::Add,
            PtxTy::U32,
            base,
            Operand::Int(i64::from(j * STAGE_BYTES)),
        );
        let bar = k.bin(
            BinOpcode::Add,
            PtxTy::U32,
            bars,
            Operand::Int(8 * i64::from(j)),
        );
        let k0 = k.imm(i64::from(j * BK));
        issue_load(k, &ops, a, bar, k0)?;
    }

    // The main loop over k-tiles.
    let n128 = WgmmaN::new(BN)?;
    let acc = k.b.accumulator(n128);
    let desc_hi = k.imm(DESC_HI);
    let i = k.imm(0);
    let stage = k.imm(0);
    let phase = k.imm(0);
    let load_stage = k.imm(i64::from(stages - 1));
    let kloop = k.b.label("kloop");
    k.b.push(Inst::Label(kloop.clone()));
    // Refill: k-tile i + S - 1 into the stage iteration i - 1 consumed.
    let next = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        i,
        Operand::Int(i64::from(stages - 1)),
    );
    let in_range = k.setp(CmpOp::Lt, next, Operand::Int(k_tiles.into()));
    let issue = k.bin(BinOpcode::And, PtxTy::Pred, in_range, Operand::Reg(leader));
    let (la, lbar) = k.stage_addrs(load_stage, STAGE_BYTES, base, bars);
    let k0 = k.bin(BinOpcode::Shl, PtxTy::B32, next, Operand::Int(6));
    issue_load(
        k,
        &LoadOps {
            guard: Guard::when(issue),
            ..ops
        },
        la,
        lbar,
        k0,
    )?;
    // Consume stage i % S.
    let (ca, cbar) = k.stage_addrs(stage, STAGE_BYTES, base, bars);
    k.b.mbarrier_wait(cbar, Operand::Reg(phase))?;
    // scale-d as predicates, as in the H200 example: `i != 0` on the first k16 step, true after.
    let accumulate = k.setp(CmpOp::Ne, i, Operand::Int(0));
    let always = k.setp(CmpOp::Eq, tid, Operand::Reg(tid));
    let a_lo = k.bin(BinOpcode::Shr, PtxTy::U32, ca, Operand::Int(4));
    k.bin_to(
        a_lo,
        BinOpcode::Or,
        PtxTy::B32,
        a_lo,
        Operand::Int(DESC_LBO),
    );
    let b_lo = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        a_lo,
        Operand::Int(i64::from(A_STAGE_BYTES >> 4)),
    );
    let mut descs = Vec::with_capacity(4);
    for step in 0..i64::from(BK / 16) {
        let mut pair = [a_lo, b_lo];
        for lo in pair.iter_mut() {
            let l = k.bin(BinOpcode::Add, PtxTy::U32, *lo, Operand::Int(2 * step));
            let d = k.b.reg(RegClass::B64);
            k.b.emit(AsyncOp::PackB64 {
                d,
                lo: l,
                hi: desc_hi,
            })?;
            *lo = d;
        }
        descs.push(pair);
    }
    k.b.emit(AsyncOp::WgmmaFence)?;
    for (step, [da, db]) in descs.into_iter().enumerate() {
        let scale_d = if step == 0 {
            ScaleD::Pred(accumulate)
        } else {
            ScaleD::Pred(always)
        };
        k.b.emit(AsyncOp::Wgmma(Wgmma::ss(
            n128,
            WgmmaTy::Bf16,
            acc.clone(),
            da,
            db,
            scale_d,
        )))?;
    }
    k.b.emit(AsyncOp::WgmmaCommitGroup)?;
    k.b.emit(AsyncOp::WgmmaWaitGroup(0))?;
    // Every warp is done reading the stage before the next iteration refills it.
    k.b.push(Inst::BarSync);
    // Advance: i, the stage and its parity, the refill stage.
    k.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Int(1));
    k.advance_stage(stage, phase, stages);
    k.bin_to(
        load_stage,
        BinOpcode::Add,
        PtxTy::U32,
        load_stage,
        Operand::Int(1),
    );
    let lwrap = k.setp(CmpOp::Eq, load_stage, Operand::Int(stages.into()));
    k.b.push(Inst::Selp {
        ty: PtxTy::U32,
        d: load_stage,
        a: Operand::Int(0),
        b: Operand::Reg(load_stage),
        p: lwrap,
    });
    let more = k.setp(CmpOp::Lt, i, Operand::Int(k_tiles.into()));
    k.bra(&kloop, Some((more, false)));

    // Epilogue: masked f32 stores of the fragment.
    let warp = k.bin(BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(5));
    let lane = k.bin(BinOpcode::And, PtxTy::B32, tid, Operand::Int(31));
    let row = k.bin(BinOpcode::Shl, PtxTy::B32, warp, Operand::Int(4));
    let quad = k.bin(BinOpcode::Shr, PtxTy::U32, lane, Operand::Int(2));
    k.bin_to(row, BinOpcode::Add, PtxTy::U32, row, Operand::Reg(quad));
    k.bin_to(row, BinOpcode::Add, PtxTy::U32, row, Operand::Reg(row0));
    let col = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(3));
    k.bin_to(col, BinOpcode::Shl, PtxTy::B32, col, Operand::Int(1));
    k.bin_to(col, BinOpcode::Add, PtxTy::U32, col, Operand::Reg(n0));
    let row8 = k.bin(BinOpcode::Add, PtxTy::U32, row, Operand::Int(8));
    let row_ok = [
        k.setp(CmpOp::Lt, row, Operand::Reg(row_end)),
        k.setp(CmpOp::Lt, row8, Operand::Reg(row_end)),
    ];
    let y = k.global_param(PARAMS[2]);
    let row_bytes = k.b.reg(RegClass::B64);
    k.b.push(Inst::Bin {
        op: BinOpcode::MulWide,
        ty: PtxTy::U32,
        d: row_bytes,
        a: Operand::Reg(row),
        b: Operand::Int(4 * i64::from(n)),
    });
    let col_bytes = k.b.reg(RegClass::B64);
    k.b.push(Inst::Bin {
        op: BinOpcode::MulWide,
        ty: PtxTy::U32,
        d: col_bytes,
        a: Operand::Reg(col),
        b: Operand::Int(4),
    });
    let addr = k.bin(BinOpcode::Add, PtxTy::U64, y, Operand::Reg(row_bytes));
    k.bin_to(
        addr,
        BinOpcode::Add,
        PtxTy::U64,
        addr,
        Operand::Reg(col_bytes),
    );
    let full_columns = n.is_multiple_of(BN);
    for j in 0..(BN / 8) {
        for c in 0..2u32 {
            let col_ok = if full_columns {
                None
            } else {
                let cj = k.bin(
                    BinOpcode::Add,
                    PtxTy::U32,
                    col,
                    Operand::Int(i64::from(8 * j + c)),
                );
                Some(k.setp(CmpOp::Lt, cj, Operand::Int(n.into())))
            };
            for (h, &rok) in row_ok.iter().enumerate() {
                let pred = match col_ok {
                    None => rok,
                    Some(cok) => k.bin(BinOpcode::And, PtxTy::Pred, rok, Operand::Reg(cok)),
                };
                let reg = acc[(4 * j + 2 * h as u32 + c) as usize];
                let off = 4 * (8 * h as i64 * i64::from(n) + i64::from(8 * j + c));
                k.b.push(Inst::StGuarded {
                    pred,
                    negate: false,
                    ty: PtxTy::F32,
                    addr,
                    off,
                    v: reg,
                });
            }
        }
    }
    k.b.push(Inst::Ret);

    let s = kb.entry_text(&entry)?;
    Ok((s, launch))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::gemm::schedule::{Schedule, Tile};

    /// The kernel's scan visits exactly the schedule's (expert, m-tile) items of one n-tile, in
    /// order, and nothing past them, for grids of `ceil(T / 64) + E` rows.
    #[test]
    fn the_cta_scan_matches_the_schedule() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % m as u64) as usize
        };
        let mut cases: Vec<Vec<usize>> = vec![
            vec![0, 1, 70, 129],
            vec![0, 0, 0],
            vec![64, 128, 0, 65],
            vec![1],
        ];
        for _ in 0..50 {
            let e = 1 + next(40);
            cases.push((0..e).map(|_| next(300)).collect());
        }
        for rows in cases {
            let sched =
                Schedule::new(&rows, 256, 512, Tile::prefill(64, 128, 64).unwrap(), 1, 1).unwrap();
            let want: Vec<CtaTile> = sched
                .enumerate()
                .into_iter()
                .filter(|w| w.n_tile == 0)
                .map(|w| CtaTile {
                    expert: w.expert,
                    m_tile: w.m_tile,
                    rows: w.rows,
                })
                .collect();
            let t: usize = rows.iter().sum();
            let grid_y = t.div_ceil(64) + rows.len();
            assert!(want.len() <= grid_y, "{rows:?}");
            for y in 0..grid_y + 3 {
                assert_eq!(
                    cta_tile(sched.offsets(), y),
                    want.get(y).cloned(),
                    "{rows:?} y={y}"
                );
            }
        }
    }

    #[test]
    fn the_kernel_is_deterministic_and_has_the_asked_shape() {
        let (a, la) = grouped_bf16_v0(256, 512, 2).unwrap();
        let (b, _) = grouped_bf16_v0(256, 512, 2).unwrap();
        assert_eq!(a, b);
        assert_eq!(la.k_tiles, 8);
        assert_eq!(la.dynamic_smem_bytes, 2 * 24576 + 1024);
        assert_eq!(la.grid(129, 4), (2, 3 + 4, 1));
        assert!(a.contains(".visible .entry moeforge_gemm_bf16_v0("));
        assert!(a.contains(".param .align 64 .b8 tmap_x[128]"));
        assert!(a.contains(".param .align 64 .b8 tmap_w[128]"));
        assert!(a.contains(".extern .shared .align 1024 .b8 smem[];"));
        assert_eq!(
            a.matches("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16")
                .count(),
            4
        );
        assert_eq!(a.matches("st.global.f32").count(), 64);
        assert!(a.contains("mbarrier.arrive.expect_tx.shared::cta.b64 \t_, [%r"));
        assert!(a.contains(", 24576;"));
        assert!(a.contains("%ctaid.y"));
    }

    #[test]
    fn a_named_entry_is_the_default_kernel_renamed() {
        let (full, la) = grouped_bf16_v0(256, 512, 3).unwrap();
        let (body, lb) = grouped_bf16_v0_entry("k_w13_s3", 256, 512, 3).unwrap();
        assert_eq!(la.entry, V0_ENTRY);
        assert_eq!(lb.entry, "k_w13_s3");
        assert_eq!(
            Launch {
                entry: V0_ENTRY.into(),
                ..lb
            },
            la
        );
        assert!(!body.contains(".version"));
        assert_eq!(module_header() + &body.replace("k_w13_s3", V0_ENTRY), full);
        for bad in ["", "1k", "k-1", "k w"] {
            assert!(grouped_bf16_v0_entry(bad, 256, 512, 3).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(grouped_bf16_v0(0, 512, 2).is_err());
        assert!(grouped_bf16_v0(256, 0, 2).is_err());
        assert!(grouped_bf16_v0(256, 12, 2).is_err());
        assert!(grouped_bf16_v0(256, 512, 1).is_err());
        assert!(grouped_bf16_v0(256, 512, MAX_STAGES + 1).is_err());
    }
}
