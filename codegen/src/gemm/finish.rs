//! The E4M3 output of the fused first GEMM (issue \[8\] item 3): `a = silu(gate) * up` quantized
//! for an FP8 second GEMM inside the first GEMM's kernel, with no activation kernel between them.
//! Each form uses the activation kernel's instructions (`crate::moe::act`: the amax on magnitude
//! bits, the scale formulas and the packing are the shared `Emit` helpers; every conversion is
//! `cvt.rn.satfinite.e4m3x2.f32`), so the codes and scales are the same bits as the unfused
//! path's. The epilogue also stores the f32 `a` (`y`, `[T, N / 2]`) as
//! [`super::ws::Epilogue::SiluMul`] does (static scales: where `y` is not 0).
//!
//! * [`AQuant::Static`] needs nothing outside the tile: the epilogue itself stores each output's
//!   code `e4m3(a * rcp.rn(s))` with `s = static[expert]` (the slot's registered activation
//!   scale), and the threads that hold output column 0 store `scales[row] = s` for their rows.
//!   The f32 `a` is stored only where `y` is not 0 (the MoE layer passes 0: it reads only the
//!   codes; the GEMM check passes a buffer, to compare the codes with the activation kernel's of
//!   the kernel's own `a`).
//! * A per-token scale needs the amax of a token's whole row of `a`, and a 1x128 group of `a`
//!   spans the output columns of two 128-row weight tiles in the paired order, so no one tile's
//!   epilogue can quantize what it computed ([`AQuant::PerToken`], [`AQuant::Group128`]). The
//!   kernel finishes each token tile once every weight tile of it is stored: every consumer
//!   thread fences (`fence.acq_rel.gpu`), the consumers meet at a named barrier, and their first
//!   thread counts the arrival on the token tile's counter (`atom.acq_rel.gpu.add`; the key is
//!   the token tiles of the experts before this one plus the tile's index in its expert). The CTA
//!   that brings the count to the weight-tile count resets the counter (for the next launch and
//!   graph replays) and quantizes the token tile's rows, one warp a row, reading `a` with
//!   `ld.global.cg` (L2, never a stale L1 line):
//!   * per token: the row's amax (a first pass), `s = max(amax / 448, 1/(448*512))` (1 for an
//!     all-zero row), codes `e4m3(a / s)` (`div.rn`), `scales[row] = s`;
//!   * per 1x128 group (a half warp's 16 chunks of 8 columns): `s = max(amax, 1e-4) / 448`,
//!     codes `e4m3(a * rcp.rn(s))`, scales group-major at `scales[g * T + row]` (`T`, the
//!     kernel's `tokens`, is the second GEMM's row stride).
//!
//!   A lane takes the chunks of 8 columns `lane, lane + 32, ...` of its row (two 16-byte loads,
//!   one 8-byte store of codes); a chunk past the row's end is read at the row's last chunk (its
//!   values repeat ones already in the amax) and not stored. `N / 2` is a multiple of 8 (the
//!   paired order's tiles of 16 rows).
//!
//!   Measured on the H200 (run 87, the layer at DeepSeek-V3 EP8 and Qwen3), these forms are
//!   slower than the f32 `a` plus the activation kernel they replace, so the MoE layer does not
//!   use them: the w13 GEMM with its quantization against the GEMM plus the activation kernel,
//!   DeepSeek-V3 at 1 token 82.2 against 69.3 + 5.8 us, Qwen3 at 16 tokens 95.0 against 76.0 +
//!   4.7, DeepSeek-V3 at 2048 tokens 2084.7 against 847.7 + 48.8. Our reading, not profiled:
//!   every tile pays a GPU-scope fence and a counted arrival, and in prefill a token tile's rows
//!   are quantized by the one CTA that arrives last, behind the tile's slowest. They stay as
//!   generator forms, checked on the GPU.

use super::emit::{Emit as _, K};
use super::ws::WsConfig;
use crate::moe::act::ActOut;
use crate::ptx::{BinOpcode, CmpOp, Inst, Operand, PtxTy, Reg, RegClass};
use crate::Result;

/// How the fused first GEMM's `a` is quantized to E4M3 for the second GEMM (the recipe's
/// activation scheme of the second GEMM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AQuant {
    /// One dynamic scale per token row (`activation fp8(per_token)`).
    PerToken,
    /// One dynamic scale per token row and 128 columns (`activation fp8(per_token_group = 128)`).
    Group128,
    /// The expert's static activation scale (`activation fp8(static(..))`), spread to rows.
    Static,
}

impl AQuant {
    /// `token`, `g128` or `static` (the tuning cache's and the tables' names).
    pub const fn name(self) -> &'static str {
        match self {
            AQuant::PerToken => "token",
            AQuant::Group128 => "g128",
            AQuant::Static => "static",
        }
    }

    /// Whether the token tile is quantized after all its weight tiles (counted arrivals), not by
    /// the epilogue itself (static scales).
    pub const fn counted(self) -> bool {
        !matches!(self, AQuant::Static)
    }

    /// The tag letter of a variant name (`_silu_q{t,g,s}`).
    pub const fn tag(self) -> &'static str {
        match self {
            AQuant::PerToken => "qt",
            AQuant::Group128 => "qg",
            AQuant::Static => "qs",
        }
    }

    /// The activation kernel's output of the same quantization (`crate::moe::act`), whose bits
    /// this one gives.
    pub const fn act_out(self) -> ActOut {
        match self {
            AQuant::PerToken => ActOut::PerToken,
            AQuant::Group128 => ActOut::Group128,
            AQuant::Static => ActOut::StaticRow,
        }
    }

    /// f32 scales the second GEMM reads for `rows` token rows of `cols` columns: one a row, or
    /// `ceil(cols / 128)` a row (group-major).
    pub const fn scales_len(self, rows: usize, cols: usize) -> usize {
        match self {
            AQuant::Group128 => cols.div_ceil(128) * rows,
            AQuant::PerToken | AQuant::Static => rows,
        }
    }
}

/// The parameters the quantizing variants take after [`super::ws::PARAMS`], in order: the E4M3
/// codes `[T, N / 2]` (u64), their f32 scales ([`AQuant::scales_len`], u64), the token tiles'
/// arrival counters (u32, [`WsConfig::token_tiles_upper_bound`] of them, zero before the first
/// launch; the finishing CTA resets each; unused with static scales, may be 0), and the static
/// scales per expert (f32 `[experts]`, u64; 0 unless [`AQuant::Static`]).
pub const FINISH_PARAMS: [&str; 4] = ["act_codes", "act_scales", "act_counters", "act_static"];

/// What the finishing code needs of the consumer's state.
pub(super) struct Tile {
    /// The consumer thread's index (0 .. 128 C).
    pub ctid: Reg,
    /// The token tile's first row.
    pub tok0: Reg,
    /// The expert's row end.
    pub hi: Reg,
    /// The token tile's counter index.
    pub key: Reg,
    /// `T`, the group-major scales' row stride.
    pub tokens: Reg,
    /// `a`, f32 `[T, N / 2]`.
    pub a: Reg,
}

/// Count this tile's arrival on its token tile and, in the CTA that completes the token tile,
/// quantize its rows of `a` (see the module docs); every other CTA goes on at `skip`. Called by
/// every consumer thread after the epilogue's stores, for the counted forms only (static scales
/// are the epilogue's own: [`static_codes`]).
pub(super) fn finish(k: &mut K, cfg: &WsConfig, q: AQuant, t: &Tile, skip: &str) -> Result<()> {
    if !q.counted() {
        return Err(crate::Error::Internal(
            "a counted finisher for static scales",
        ));
    }
    // Every thread's stores of `a`, then the count (release); the last CTA's loads after its
    // acquire see every tile's `a`.
    k.last_arrival(
        t.ctid,
        |k| {
            let counters = k.global_param(FINISH_PARAMS[2]);
            k.addr(counters, t.key, 4)
        },
        i64::from(cfg.weight_tiles()),
        (128 * cfg.consumers, "token_tile_last", "q_counted"),
        skip,
    )?;
    rows(k, cfg, q == AQuant::PerToken, t)
}

/// Quantize rows `tok0 + w, tok0 + w + 4C, ..` below `min(tok0 + tile_tokens, hi)` of `a`, warp
/// `w` a row: one scale a row (`per_token`), else one a row and 128 columns.
fn rows(k: &mut K, cfg: &WsConfig, per_token: bool, t: &Tile) -> Result<()> {
    let cols = i64::from(cfg.out_cols());
    let chunks = cols / 8;
    let iters = (chunks + 31) / 32;
    let codes = k.global_param(FINISH_PARAMS[0]);
    let scales = k.global_param(FINISH_PARAMS[1]);
    let lane = k.bin(BinOpcode::And, PtxTy::B32, t.ctid, Operand::Int(31));
    let warp = k.bin(BinOpcode::Shr, PtxTy::U32, t.ctid, Operand::Int(5));
    let lane0 = k.setp(CmpOp::Eq, lane, Operand::Int(0));
    let end = k.bin(
        BinOpcode::Add,
        PtxTy::U32,
        t.tok0,
        Operand::Int(i64::from(cfg.tile_tokens())),
    );
    k.bin_to(end, BinOpcode::Min, PtxTy::U32, end, Operand::Reg(t.hi));
    let row = k.bin(BinOpcode::Add, PtxTy::U32, t.tok0, Operand::Reg(warp));
    let (top, done) = (k.b.label("q_row"), k.b.label("q_done"));
    k.b.push(Inst::Label(top.clone()));
    let past = k.setp(CmpOp::Ge, row, Operand::Reg(end));
    k.bra(&done, Some((past, false)));
    let src = k.addr(t.a, row, 4 * cols);
    let dst = k.addr(codes, row, cols);
    // The lane's chunk of iteration j: lane + 32 j, read clamped to the row's last chunk.
    let chunk = |k: &mut K, j: i64| -> (Reg, Option<Reg>) {
        let c = k.bin(BinOpcode::Add, PtxTy::U32, lane, Operand::Int(32 * j));
        if (32 * (j + 1)) <= chunks {
            (c, None)
        } else {
            let ok = k.setp(CmpOp::Lt, c, Operand::Int(chunks));
            let r = k.bin(BinOpcode::Min, PtxTy::U32, c, Operand::Int(chunks - 1));
            (r, Some(ok))
        }
    };
    let load = |k: &mut K, c: Reg| -> [Reg; 8] {
        let a = k.addr(src, c, 32);
        let v: [Reg; 8] = std::array::from_fn(|_| k.b.reg(RegClass::F32));
        for h in 0..2 {
            k.b.push(Inst::LdGlobalCgV4F32 {
                d: [v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]],
                addr: a,
                off: 16 * h as i64,
            });
        }
        v
    };
    let put = |k: &mut K, c: Reg, ok: Option<Reg>, words: [Reg; 2]| {
        let a = k.addr(dst, c, 8);
        let skip = ok.map(|p| {
            let l = k.b.label("q_skip");
            k.bra(&l, Some((p, true)));
            l
        });
        k.b.push(Inst::StV {
            words: words.to_vec(),
            addr: a,
        });
        if let Some(l) = skip {
            k.b.push(Inst::Label(l));
        }
    };
    let row_scale = |k: &mut K, s: Reg| {
        let a = k.addr(scales, row, 4);
        k.b.push(Inst::StGuarded {
            pred: lane0,
            negate: false,
            ty: PtxTy::F32,
            addr: a,
            off: 0,
            v: s,
        });
    };
    if per_token {
        let m = k.imm(0);
        for j in 0..iters {
            let (c, _) = chunk(k, j);
            let v = load(k, c);
            k.amax_bits(m, &v);
        }
        k.reduce_max_u32(m, &[16, 8, 4, 2, 1]);
        let amax = k.un(
            crate::ptx::UnOpcode::Mov(PtxTy::B32),
            RegClass::F32,
            Operand::Reg(m),
        );
        let s = k.e4m3_token_scale(amax, m);
        for j in 0..iters {
            let (c, ok) = chunk(k, j);
            let v = load(k, c);
            let w = k.e4m3_codes(&v, BinOpcode::DivRn, s);
            put(k, c, ok, w);
        }
        row_scale(k, s);
    } else {
        // Lane l's chunk c = l + 32 j lies in group c / 16 = 2 j + l / 16: a half warp a group.
        let half_first = {
            let h = k.bin(BinOpcode::And, PtxTy::B32, lane, Operand::Int(15));
            k.setp(CmpOp::Eq, h, Operand::Int(0))
        };
        for j in 0..iters {
            let (c, ok) = chunk(k, j);
            let v = load(k, c);
            let m = k.imm(0);
            k.amax_bits(m, &v);
            k.reduce_max_u32(m, &[8, 4, 2, 1]);
            let amax = k.un(
                crate::ptx::UnOpcode::Mov(PtxTy::B32),
                RegClass::F32,
                Operand::Reg(m),
            );
            let (s, inv) = k.e4m3_group_scale(amax);
            let w = k.e4m3_codes(&v, BinOpcode::MulRn, inv);
            put(k, c, ok, w);
            // scales[(c / 16) T + row] from the half warp's first lane (its chunk in the row).
            let pred = match ok {
                None => half_first,
                Some(ok) => k.bin(BinOpcode::And, PtxTy::Pred, half_first, Operand::Reg(ok)),
            };
            let g = k.bin(BinOpcode::Shr, PtxTy::U32, c, Operand::Int(4));
            let i = k.bin(BinOpcode::MulLo, PtxTy::U32, g, Operand::Reg(t.tokens));
            k.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(row));
            let a = k.addr(scales, i, 4);
            k.b.push(Inst::StGuarded {
                pred,
                negate: false,
                ty: PtxTy::F32,
                addr: a,
                off: 0,
                v: s,
            });
        }
    }
    k.bin_to(
        row,
        BinOpcode::Add,
        PtxTy::U32,
        row,
        Operand::Int(i64::from(4 * cfg.consumers)),
    );
    k.bra(&top, None);
    k.b.push(Inst::Label(done));
    Ok(())
}

/// The static E4M3 output's constants of a tile ([`AQuant::Static`], stored by the epilogue).
pub(super) struct StaticCodes {
    /// The code of the thread's first (token, output): `codes + tok * (N / 2) + out0`.
    at: Reg,
    /// `scales + tok * 4`: the thread's first token row's scale.
    scale_at: Reg,
    /// The expert's static scale and its reciprocal (`rcp.rn`).
    s: Reg,
    inv: Reg,
    /// Whether the thread holds output column 0 (it stores its rows' scales).
    first_col: Reg,
    /// Whether `y` is given (not 0): the f32 `a` is stored too.
    pub(super) has_a: Reg,
}

/// Load the expert's static activation scale `act_static[expert]` (one of the epilogue's scale
/// loads, issued before the k loop: `ws::epilogue_loads`).
pub(super) fn static_scale(k: &mut K, expert: Reg) -> Reg {
    let st = k.global_param(FINISH_PARAMS[3]);
    let a = k.addr(st, expert, 4);
    let s = k.b.reg(RegClass::F32);
    k.b.push(Inst::Ld {
        ty: PtxTy::F32,
        d: s,
        addr: a,
    });
    s
}

/// [`StaticCodes`] of the thread whose first token is `tok` and first output `out0`, with `s` the
/// expert's static scale as [`static_scale`] loaded it (the f32 `a` is stored where the parameter
/// `y` is not 0).
pub(super) fn static_codes(
    k: &mut K,
    cfg: &WsConfig,
    s: Reg,
    (tok, out0): (Reg, Reg),
) -> StaticCodes {
    let half = i64::from(cfg.out_cols());
    let codes = k.global_param(FINISH_PARAMS[0]);
    let scales = k.global_param(FINISH_PARAMS[1]);
    let row = k.addr(codes, tok, half);
    let at = k.addr(row, out0, 1);
    let scale_at = k.addr(scales, tok, 4);
    let inv = k.un(
        crate::ptx::UnOpcode::RcpRn(PtxTy::F32),
        RegClass::F32,
        Operand::Reg(s),
    );
    let first_col = k.setp(CmpOp::Eq, out0, Operand::Int(0));
    // The raw parameter, not the consumers' `y` (its `cvta.to.global` of 0 need not be 0).
    let y = k.b.reg(RegClass::B64);
    k.b.push(Inst::LdParam {
        ty: PtxTy::U64,
        d: y,
        name: super::ws::PARAMS[2].into(),
    });
    let has_a = k.b.reg(RegClass::Pred);
    k.b.push(Inst::Setp {
        cmp: CmpOp::Ne,
        ty: PtxTy::U64,
        p: has_a,
        a: Operand::Reg(y),
        b: Operand::Int(0),
    });
    StaticCodes {
        at,
        scale_at,
        s,
        inv,
        first_col,
        has_a,
    }
}

/// Store the codes of `lo` (and `hi`, the next output) at `(dt, dout)` from the thread's first
/// (token, output), where `pred` (the f32 store's mask) holds: one byte, or two as one `u16`.
pub(super) fn store_static(
    k: &mut K,
    cfg: &WsConfig,
    c: &StaticCodes,
    pred: Reg,
    (dt, dout): (i64, i64),
    lo: Reg,
    hi: Option<Reg>,
) {
    let half = i64::from(cfg.out_cols());
    let scaled = |k: &mut K, v: Reg| k.fmul_rn(v, Operand::Reg(c.inv));
    let a = scaled(k, lo);
    let (vals, ty) = match hi {
        Some(h) => {
            let b = scaled(k, h);
            ([a, b, a, b], PtxTy::U16)
        }
        None => ([a, a, a, a], PtxTy::U8),
    };
    let w = k.reg32();
    k.b.push(Inst::CvtE4m3Pack { d: w, vals });
    k.b.push(Inst::StGuarded {
        pred,
        negate: false,
        ty,
        addr: c.at,
        off: dt * half + dout,
        v: w,
    });
}

/// The threads of output column 0 store `s` as the scale of their token rows `tok + dt` (each
/// `dt` of `rows`, where its `pred`, the token's mask, holds).
pub(super) fn store_static_scales(k: &mut K, c: &StaticCodes, rows: &[(i64, Reg)]) {
    for &(dt, tok_ok) in rows {
        let p = k.bin(
            BinOpcode::And,
            PtxTy::Pred,
            tok_ok,
            Operand::Reg(c.first_col),
        );
        k.b.push(Inst::StGuarded {
            pred: p,
            negate: false,
            ty: PtxTy::F32,
            addr: c.scale_at,
            off: 4 * dt,
            v: c.s,
        });
    }
}
