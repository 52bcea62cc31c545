//! The generated activation kernel of the MoE layer's forward (issue \[9\]): between the two
//! grouped GEMMs, the rows of the first GEMM's f32 output become the second GEMM's input, PTX for
//! `sm_90a` through the typed builder. One entry, [`ACT_ENTRY`]; the input, the output and the
//! width `W` are compiled in.
//!
//! # What it computes
//! Each row `r` gives `W` f32 values `a[r, c]`, from the source ([`ActIn`]):
//! * [`ActIn::SiluMul`]: `h` f32 `[rows, 2W]` (columns `[0, W)` the gate, `[W, 2W)` the up
//!   projection, in logical order): `a[c] = silu(g) * u` with `g = h[r, c]`, `u = h[r, W + c]`,
//!   `silu(g) = g / (1 + exp(-g))`, computed as `e = ex2.approx.ftz(mul.rn(g, -log2(e)))`, then
//!   `r = rcp.approx(add.rn(e, 1))`, `mul.rn(mul.rn(g, r), u)` (the GEMMs' fused epilogue emits
//!   the same instructions). A very negative `g` overflows `e` to `+inf`, so `r = +0`, `g * r = -0`
//!   and `a = ∓0` (never NaN for finite `u`); a large positive `g` gives `e = 0`, `r = 1` and
//!   `a = g * u`. The host [`reference()`] computes the same sequence with `f32::exp2` and an exact
//!   reciprocal in place of `ex2.approx` and `rcp.approx` (at most 2 and 1 ulp of relative error),
//!   so its `a` may differ from the kernel's by a few ulp: a check compares SiluMul results with a
//!   tolerance.
//! * [`ActIn::Bf16`]: `x` bf16 `[rows, W]`: `a` is the bf16 as f32 (exact; a check compares bit
//!   for bit).
//! * [`ActIn::F32`]: `a` f32 `[rows, W]` as it is: the first GEMM's fused epilogue wrote
//!   `silu(g) * u` (the same instructions as here), and this kernel only quantizes it (a check
//!   compares bit for bit).
//!
//! and writes them as ([`ActOut`]):
//! * [`ActOut::Bf16`]: bf16 `[rows, W]`, `cvt.rn.bf16x2.f32` (round to nearest even). No scales.
//! * [`ActOut::PerToken`]: E4M3 codes `[rows, W]` and f32 scales `[max_rows]`, as
//!   [`reference::quantize_per_token`](crate::gemm::reference::quantize_per_token):
//!   `s = max(amax / 448, 1/(448*512))` (1.0 for an all-zero row), `q = e4m3(clamp(a / s, ±448))`
//!   with `div.rn.f32`.
//! * [`ActOut::Group128`]: E4M3 codes `[rows, W]` and f32 scales **group-major**
//!   `[ceil(W/128), max_rows]` (row `r`, group `g` at `g * max_rows + r`), as
//!   [`reference::quantize_per_group128`](crate::gemm::reference::quantize_per_group128):
//!   `s = max(amax_group, 1e-4) / 448`, `q = e4m3(a * rcp.rn(s))`; the last group is short when
//!   `W % 128 != 0`.
//! * [`ActOut::StaticRow`]: E4M3 codes `[rows, W]`; the scales are **read**: `s = scales[r]` (a
//!   static activation scale per row, positive and finite, filled by the caller),
//!   `q = e4m3(clamp(a * rcp.rn(s), ±448))`, as
//!   [`reference::quantize_per_tensor`](crate::gemm::reference::quantize_per_tensor)`(row, s)`.
//!
//! Every conversion to E4M3 is `cvt.rn.satfinite.e4m3x2.f32` (round to nearest even, saturating
//! to ±448: the host's clamp). The amax is taken on the f32 magnitude bits (`bits & 0x7FFFFFFF`,
//! `max.u32`, which orders finite values as `|a|` does), exactly the host's `max(|a|)`. Inputs
//! must be finite.
//!
//! Rows `r < min(offsets[slots], max_rows)` are processed (`offsets` is the grouped GEMM's row
//! offsets, read on the device: the forward never synchronizes with the host); rows past it, and
//! their scales, are left untouched.
//!
//! # Parameters, in order
//! [`ACT_PARAMS`]: `.u64 src` (f32 `[rows, 2W]`, bf16 `[rows, W]` or f32 `[rows, W]`, 16-byte
//! aligned), `.u64 dst` (bf16 `[rows, W]`, 16-byte aligned, or E4M3 `[rows, W]`, 8-byte aligned),
//! `.u64 scales` (f32, [`ActLaunch::scales_len`] of them; unused for bf16 output, may be 0),
//! `.u64 offsets` (i32 `[slots + 1]`), `.u32 slots`, `.u32 max_rows`.
//!
//! # Launch shape
//! [`ActLaunch::grid`] CTAs (`min(max_rows, `[`ACT_MAX_CTAS`]`)`, at least 1) of
//! [`ActLaunch::threads`] threads, in a grid-stride loop over rows (CTA `b` takes rows `b`,
//! `b + grid`, ...). Thread `t` holds chunks of 8 columns `t, t + threads, ...` (at most
//! [`ActLaunch::chunks_per_thread`], 4) in registers: 16-byte loads (two per chunk of f32 gate and
//! of up, or of f32 `a`; one per chunk of bf16), 16-byte stores of bf16, 8-byte stores of codes. A
//! per-token amax is reduced with `shfl.sync.bfly` over the warp, then over the warps through
//! [`ActLaunch::smem_bytes`] of static shared memory; a per-group amax over the half warp that
//! holds the group's 16 chunks. No dynamic shared memory.

use super::emit::{push_entry, G};
use super::row_out::{load_values, RowWriter};
use crate::gemm::emit::Emit as _;
use crate::gemm::reference as gemm_ref;
use crate::ptx::{
    BinOpcode, CmpOp, Entry, Inst, Operand, Param, PtxTy, SharedDecl, SharedTy, SpecialReg,
    PTX_VERSION,
};
use crate::{Error, Result};

/// The kernel's entry name.
pub const ACT_ENTRY: &str = "moeforge_moe_act";
/// Parameter names, in launch order.
pub const ACT_PARAMS: [&str; 6] = [
    "act_src",
    "act_dst",
    "act_scales",
    "act_offsets",
    "act_slots",
    "act_max_rows",
];
/// The largest width `W` (the recipes' bound on `H` and `I`).
pub const MAX_WIDTH: u32 = 16384;
/// The most threads per CTA.
pub const ACT_MAX_THREADS: u32 = 512;
/// The most CTAs (a grid-stride loop covers the other rows).
pub const ACT_MAX_CTAS: u32 = 4096;
/// `log2(e)` in f32: SiLU's `exp(-g)` is `2^(g * -LOG2_E)`.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// Columns per scale group.
const GROUP: usize = 128;

/// The source of the kernel's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActIn {
    /// f32 `[rows, 2W]`, gate then up: `silu(gate) * up`.
    SiluMul,
    /// bf16 `[rows, W]`, taken as is.
    Bf16,
    /// f32 `[rows, W]`, taken as is (`silu(gate) * up` from the fused first GEMM).
    F32,
}

/// What the kernel writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActOut {
    /// bf16 `[rows, W]`, no scales.
    Bf16,
    /// E4M3 codes and one dynamic scale per row.
    PerToken,
    /// E4M3 codes and one dynamic scale per row and 128 columns (group-major).
    Group128,
    /// E4M3 codes with a static scale per row, read from the scales buffer.
    StaticRow,
}

impl ActIn {
    /// Every input kind.
    pub const ALL: [ActIn; 3] = [ActIn::SiluMul, ActIn::Bf16, ActIn::F32];

    /// Source values (f32) a row holds per output column: 2 (gate and up) or 1.
    pub fn values_per_column(self) -> usize {
        match self {
            ActIn::SiluMul => 2,
            ActIn::Bf16 | ActIn::F32 => 1,
        }
    }

    /// Bytes of one source row of width `w`.
    pub fn row_bytes(self, w: usize) -> usize {
        match self {
            ActIn::SiluMul => 8 * w,
            ActIn::Bf16 => 2 * w,
            ActIn::F32 => 4 * w,
        }
    }
}

impl ActOut {
    /// Every output kind.
    pub const ALL: [ActOut; 4] = [
        ActOut::Bf16,
        ActOut::PerToken,
        ActOut::Group128,
        ActOut::StaticRow,
    ];

    /// Bytes of one output row of width `w`: bf16 or one code a column.
    pub fn row_bytes(self, w: usize) -> usize {
        match self {
            ActOut::Bf16 => 2 * w,
            _ => w,
        }
    }
}

/// What a launch of the activation kernel needs besides its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ActLaunch {
    /// The source kind.
    pub input: ActIn,
    /// The output kind.
    pub output: ActOut,
    /// `W` (compiled in).
    pub width: u32,
    /// Threads per CTA (a multiple of 32, at most [`ACT_MAX_THREADS`]).
    pub threads: u32,
    /// Static shared memory per CTA, bytes (the per-token amax of each warp; 0 otherwise).
    pub smem_bytes: u32,
}

impl ActLaunch {
    /// CTAs for `max_rows` rows: `min(max_rows, ACT_MAX_CTAS)`, at least 1.
    pub fn grid(&self, max_rows: u32) -> u32 {
        max_rows.clamp(1, ACT_MAX_CTAS)
    }

    /// Scales the buffer holds for `max_rows` rows: 0 (bf16 output), `max_rows` (per token,
    /// static), `ceil(W/128) * max_rows` (per group).
    pub fn scales_len(&self, max_rows: usize) -> usize {
        match self.output {
            ActOut::Bf16 => 0,
            ActOut::PerToken | ActOut::StaticRow => max_rows,
            ActOut::Group128 => self.groups() * max_rows,
        }
    }

    /// Groups of 128 columns, `ceil(W / 128)`.
    pub fn groups(&self) -> usize {
        (self.width as usize).div_ceil(GROUP)
    }

    /// Chunks of 8 columns each thread holds (at most 4).
    pub fn chunks_per_thread(&self) -> u32 {
        (self.width / 8).div_ceil(self.threads)
    }

    /// Bytes of one source row.
    pub fn src_row_bytes(&self) -> usize {
        self.input.row_bytes(self.width as usize)
    }

    /// Bytes of one output row.
    pub fn dst_row_bytes(&self) -> usize {
        self.output.row_bytes(self.width as usize)
    }
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        param: "moe activation".into(),
        what,
    }
}

/// The launch shape of `(input, output)` at width `width`, after checking it: positive, a
/// multiple of 8 (whole 16-byte chunks) and at most [`MAX_WIDTH`].
pub fn act_launch(input: ActIn, output: ActOut, width: u32) -> Result<ActLaunch> {
    if width == 0 || !width.is_multiple_of(8) || width > MAX_WIDTH {
        return Err(unsupported(format!(
            "W = {width} (positive, a multiple of 8, at most {MAX_WIDTH})"
        )));
    }
    let chunks = width / 8;
    let threads = (32 * chunks.div_ceil(32)).min(ACT_MAX_THREADS);
    let smem_bytes = match output {
        ActOut::PerToken if threads > 32 => 4 * (threads / 32),
        _ => 0,
    };
    Ok(ActLaunch {
        input,
        output,
        width,
        threads,
        smem_bytes,
    })
}

/// The activation module: PTX (`.version`, `.target sm_90a`, the one entry [`ACT_ENTRY`]) and its
/// launch shape. Errors: as [`act_launch`].
pub fn act_module(input: ActIn, output: ActOut, width: u32) -> Result<(String, ActLaunch)> {
    let l = act_launch(input, output, width)?;
    let mut e = Entry::new(ACT_ENTRY);
    let dst_align = if output == ActOut::Bf16 { 16 } else { 8 };
    e.params = vec![
        Param::global_ptr(ACT_PARAMS[0], 16),
        Param::global_ptr(ACT_PARAMS[1], dst_align),
        Param::global_ptr(ACT_PARAMS[2], 4),
        Param::global_ptr(ACT_PARAMS[3], 4),
        Param::scalar(ACT_PARAMS[4], PtxTy::U32),
        Param::scalar(ACT_PARAMS[5], PtxTy::U32),
    ];
    e.maxntid = Some(l.threads);
    let mut g = G::default();
    act_body(&mut g, &l)?;
    let mut s = format!(".version {PTX_VERSION}\n.target sm_90a\n.address_size 64\n");
    push_entry(&mut s, &e, &g)?;
    Ok((s, l))
}

fn act_body(g: &mut G, l: &ActLaunch) -> Result<()> {
    let threads = l.threads;
    let chunks = l.width / 8;
    let cpt = l.chunks_per_thread();
    let warps = threads / 32;
    if l.smem_bytes > 0 {
        g.b.declare_shared(SharedDecl::array("act_amax", SharedTy::B32, warps, 4)?)?;
    }
    let [src, dst, scales, offsets] = [0, 1, 2, 3].map(|k| g.global_param(ACT_PARAMS[k]));
    let [slots, max_rows] = [4, 5].map(|k| g.u32_param(ACT_PARAMS[k]));
    let tid = g.special(SpecialReg::TidX);
    let cta = g.special(SpecialReg::CtaidX);
    let ncta = g.special(SpecialReg::NctaidX);
    let rows = g.filled_rows(offsets, slots, max_rows);
    let valid = g.chunk_guards(tid, chunks, threads, cpt);
    // Per thread: the first chunk's source and output offsets.
    let src_tid = g.bin(
        BinOpcode::MulWide,
        PtxTy::U32,
        tid,
        Operand::Int(if l.input == ActIn::Bf16 { 16 } else { 32 }),
    );
    let src_t = g.bin(BinOpcode::Add, PtxTy::U64, src, Operand::Reg(src_tid));
    let out_chunk = RowWriter::out_chunk(l.output);
    let dst_tid = g.bin(BinOpcode::MulWide, PtxTy::U32, tid, Operand::Int(out_chunk));
    let dst_t = g.bin(BinOpcode::Add, PtxTy::U64, dst, Operand::Reg(dst_tid));
    let smem = (l.smem_bytes > 0).then_some("act_amax");
    let writer = RowWriter::new(g, l.output, threads, cpt, tid, max_rows, smem);
    let row = g.r32();
    g.mov(row, Operand::Reg(cta));
    let (top, done) = (g.b.label("act_row"), g.b.label("act_done"));
    g.label(&top);
    let past = g.setp(CmpOp::Ge, PtxTy::U32, row, Operand::Reg(rows));
    g.bra(&done, Some((past, false)));
    let src_row = g.elem(src_t, row, l.src_row_bytes() as i64);
    let dst_row = g.elem(dst_t, row, l.dst_row_bytes() as i64);
    let step_src = i64::from(threads);
    let mut data = Vec::with_capacity(cpt as usize);
    for (i, v) in valid.iter().enumerate() {
        data.push(load_values(
            g,
            l.input,
            l.width,
            src_row,
            step_src * i as i64,
            *v,
        ));
    }
    writer.write(g, &data, &valid, dst_row, row, scales, None);
    g.bin_to(row, BinOpcode::Add, PtxTy::U32, row, Operand::Reg(ncta));
    g.bra(&top, None);
    g.label(&done);
    g.b.push(Inst::Ret);
    Ok(())
}

/// `silu(g) * u` as the kernel computes it, with `f32::exp2` for `ex2.approx.ftz` and `1 / x` for
/// `rcp.approx`: `e = exp2(g * -LOG2_E)`, `g * (1 / (1 + e)) * up`, each step rounded to f32.
pub fn silu_mul(gate: f32, up: f32) -> f32 {
    let e = (gate * -LOG2_E).exp2();
    gate * (1.0 / (e + 1.0)) * up
}

/// The f32 values `a [rows, W]` of a source: `silu_mul` of `src [rows, 2W]` (gate, up), or `src
/// [rows, W]` itself (bf16 values as f32). Errors: `src` not of `rows` rows.
pub fn activation(input: ActIn, src: &[f32], width: usize, rows: usize) -> Result<Vec<f32>> {
    let per = input.values_per_column() * width;
    if src.len() != rows * per {
        return Err(Error::BufferSize {
            name: "src".into(),
            expected: rows * per * 4,
            got: src.len() * 4,
        });
    }
    Ok(match input {
        ActIn::Bf16 | ActIn::F32 => src.to_vec(),
        ActIn::SiluMul => src
            .chunks(per.max(1))
            .flat_map(|h| (0..width).map(move |c| silu_mul(h[c], h[width + c])))
            .collect(),
    })
}

/// The host reference in the kernel's layout, with `max_rows = rows`: the output bytes (bf16 LE
/// bytes `[rows, W]`, or E4M3 codes `[rows, W]`) and the scales (none for bf16; `[rows]` per token
/// and static, the latter `static_scales[..rows]` unchanged; `[ceil(W/128), rows]` per group).
/// `src` holds the f32 source values: `h [rows, 2W]` for SiluMul, the bf16 as f32 `[rows, W]`
/// for Bf16, `a [rows, W]` for F32. SiluMul values follow [`silu_mul`], so they may differ from
/// the kernel's by a few ulp (the kernel's `ex2.approx`); Bf16- and F32-input results are the
/// kernel's bit for bit.
///
/// Errors: a width the kernel refuses ([`act_launch`]), `src` not of `rows` rows, fewer than
/// `rows` static scales.
pub fn reference(
    input: ActIn,
    output: ActOut,
    src: &[f32],
    width: usize,
    rows: usize,
    static_scales: &[f32],
) -> Result<(Vec<u8>, Vec<f32>)> {
    let w32 = u32::try_from(width).map_err(|_| unsupported(format!("W = {width}")))?;
    act_launch(input, output, w32)?;
    let a = activation(input, src, width, rows)?;
    match output {
        ActOut::Bf16 => Ok((
            a.iter()
                .flat_map(|v| gemm_ref::bf16_from_f32(*v).to_le_bytes())
                .collect(),
            Vec::new(),
        )),
        ActOut::PerToken => gemm_ref::quantize_per_token(&a, width),
        ActOut::Group128 => {
            let (q, s) = gemm_ref::quantize_per_group128(&a, width)?;
            Ok((
                q,
                crate::gemm::act_quant::scales_group_major(&s, rows, width)?,
            ))
        }
        ActOut::StaticRow => {
            if static_scales.len() < rows {
                return Err(Error::BufferSize {
                    name: "static_scales".into(),
                    expected: rows * 4,
                    got: static_scales.len() * 4,
                });
            }
            let mut q = Vec::with_capacity(a.len());
            for (r, row) in a.chunks(width).enumerate() {
                q.extend(gemm_ref::quantize_per_tensor(row, static_scales[r]));
            }
            Ok((q, static_scales[..rows].to_vec()))
        }
    }
}

/// Whether a kernel's E4M3 value `got` (code times scale) is within one E4M3 step (at the larger
/// of the two magnitudes, times the larger scale) of the host's `want`: the SiluMul tolerance.
pub fn e4m3_close(got: (u8, f32), want: (u8, f32)) -> bool {
    let (a, b) = (
        crate::reference::e4m3_to_f32(got.0),
        crate::reference::e4m3_to_f32(want.0),
    );
    if a.is_nan() || b.is_nan() {
        return false;
    }
    let mag = a.abs().max(b.abs()).max(2f32.powi(-6));
    let step = 2f32.powf(mag.log2().floor() - 3.0);
    let s = got.1.abs().max(want.1.abs());
    ((a * got.1) as f64 - (b * want.1) as f64).abs() <= (step * s) as f64 * (1.0 + 1e-5)
}

/// Whether two bf16 values are at most one ulp apart (adjacent in the order of their values;
/// `+0` and `-0` are equal): the SiluMul tolerance of bf16 output.
pub fn bf16_close(a: u16, b: u16) -> bool {
    let ord = |x: u16| -> i32 {
        if x & 0x8000 != 0 {
            -i32::from(x & 0x7FFF)
        } else {
            i32::from(x)
        }
    };
    (ord(a) - ord(b)).abs() <= 1
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::reference::{e4m3_from_f32, e4m3_to_f32};

    #[test]
    fn widths_are_checked_by_name() {
        for input in ActIn::ALL {
            for output in ActOut::ALL {
                for bad in [0, 4, 12, 2044, MAX_WIDTH + 8, u32::MAX] {
                    let e = act_module(input, output, bad).unwrap_err();
                    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
                    let s = e.to_string();
                    assert!(
                        s.contains("moe activation") && s.contains("multiple of 8"),
                        "{s}"
                    );
                }
                for good in [8, 768, 2048, 2056, 14336, MAX_WIDTH] {
                    assert!(
                        act_module(input, output, good).is_ok(),
                        "{input:?} {output:?} {good}"
                    );
                }
            }
        }
    }

    #[test]
    fn launch_shapes() {
        let l = act_launch(ActIn::SiluMul, ActOut::PerToken, 16384).unwrap();
        assert_eq!(
            (l.threads, l.chunks_per_thread(), l.smem_bytes),
            (512, 4, 64)
        );
        let l = act_launch(ActIn::Bf16, ActOut::PerToken, 8).unwrap();
        assert_eq!((l.threads, l.chunks_per_thread(), l.smem_bytes), (32, 1, 0));
        let l = act_launch(ActIn::SiluMul, ActOut::Group128, 2056).unwrap();
        assert_eq!((l.threads, l.chunks_per_thread(), l.groups()), (288, 1, 17));
        assert_eq!(l.scales_len(5), 85);
        assert_eq!(l.grid(0), 1);
        assert_eq!(l.grid(37), 37);
        assert_eq!(l.grid(1 << 20), ACT_MAX_CTAS);
        let l = act_launch(ActIn::SiluMul, ActOut::Bf16, 768).unwrap();
        assert_eq!(
            (l.scales_len(9), l.src_row_bytes(), l.dst_row_bytes()),
            (0, 6144, 1536)
        );
        let l = act_launch(ActIn::Bf16, ActOut::StaticRow, 768).unwrap();
        assert_eq!(
            (l.scales_len(9), l.src_row_bytes(), l.dst_row_bytes()),
            (9, 1536, 768)
        );
    }

    #[test]
    fn module_is_deterministic_and_vectorized() {
        for input in ActIn::ALL {
            for output in ActOut::ALL {
                let (a, l) = act_module(input, output, 2048).unwrap();
                assert_eq!(a, act_module(input, output, 2048).unwrap().0);
                assert_eq!(
                    a.matches(&format!(".visible .entry {ACT_ENTRY}(")).count(),
                    1
                );
                let n = l.chunks_per_thread() as usize;
                let loads = n * match input {
                    ActIn::SiluMul => 4,
                    ActIn::Bf16 => 1,
                    ActIn::F32 => 2,
                };
                assert_eq!(a.matches("ld.global.nc.v4.b32").count(), loads);
                match input {
                    ActIn::SiluMul => {
                        assert_eq!(a.matches("ex2.approx.ftz.f32").count(), 8 * n);
                    }
                    ActIn::Bf16 | ActIn::F32 => assert!(!a.contains("ex2")),
                }
                match output {
                    ActOut::Bf16 => {
                        assert_eq!(a.matches("cvt.rn.bf16x2.f32").count(), 4 * n);
                        assert_eq!(a.matches("st.global.v4.b32").count(), n);
                    }
                    _ => {
                        assert_eq!(a.matches("cvt.rn.satfinite.e4m3x2.f32").count(), 4 * n);
                        assert_eq!(a.matches("st.global.v2.b32").count(), n);
                    }
                }
                assert_eq!(
                    a.contains("shfl.sync.bfly"),
                    matches!(output, ActOut::PerToken | ActOut::Group128)
                );
                assert_eq!(
                    a.contains("rcp.rn.f32"),
                    matches!(output, ActOut::Group128 | ActOut::StaticRow)
                );
            }
        }
    }

    #[test]
    fn silu_is_finite_at_the_extremes() {
        assert_eq!(silu_mul(0.0, 5.0), 0.0);
        // exp(-g) overflows: g * (1 / inf) = -0.
        let v = silu_mul(-1.0e4, 3.0);
        assert_eq!(v, 0.0);
        assert!(v.is_sign_negative());
        assert_eq!(silu_mul(1.0e4, 2.0), 2.0e4);
        let x = 1.5f32;
        let want = (x as f64 / (1.0 + (-x as f64).exp())) * 2.0;
        assert!((silu_mul(x, 2.0) as f64 - want).abs() < 1e-6);
    }

    #[test]
    fn reference_of_an_all_zero_row() {
        let w = 136;
        let src = vec![0.0f32; 2 * w];
        let (q, s) = reference(ActIn::SiluMul, ActOut::PerToken, &src, w, 1, &[]).unwrap();
        assert_eq!((q, s), (vec![0u8; w], vec![1.0]));
        let (q, s) = reference(ActIn::SiluMul, ActOut::Group128, &src, w, 1, &[]).unwrap();
        assert_eq!(q, vec![0u8; w]);
        assert_eq!(s, vec![1e-4f32 / 448.0; 2]);
        let (q, s) = reference(ActIn::Bf16, ActOut::Bf16, &src[..w], w, 1, &[]).unwrap();
        assert_eq!((q, s), (vec![0u8; 2 * w], vec![]));
        let (q, s) =
            reference(ActIn::Bf16, ActOut::StaticRow, &src[..w], w, 1, &[0.5, 9.0]).unwrap();
        assert_eq!((q, s), (vec![0u8; w], vec![0.5]));
    }

    #[test]
    fn group128_scales_are_group_major() {
        // 3 rows, W = 136: groups of 128 and 8; row r's value 7 (r + 1) in group j = r % 2.
        let (w, rows) = (136, 3);
        let mut x = vec![0.0f32; rows * w];
        for r in 0..rows {
            x[r * w + 128 * (r % 2)] = 7.0 * (r + 1) as f32;
        }
        let (q, s) = reference(ActIn::Bf16, ActOut::Group128, &x, w, rows, &[]).unwrap();
        let f = 1e-4f32 / 448.0;
        // [group 0: rows 0..3][group 1: rows 0..3].
        assert_eq!(s, vec![7.0 / 448.0, f, 21.0 / 448.0, f, 14.0 / 448.0, f]);
        assert_eq!(e4m3_to_f32(q[0]), 448.0);
        assert_eq!(e4m3_to_f32(q[w + 128]), 448.0);
    }

    #[test]
    fn reference_sizes_are_checked() {
        assert!(reference(ActIn::SiluMul, ActOut::Bf16, &[0.0; 16], 8, 2, &[]).is_err());
        assert!(reference(ActIn::SiluMul, ActOut::Bf16, &[0.0; 32], 8, 2, &[]).is_ok());
        assert!(reference(ActIn::Bf16, ActOut::StaticRow, &[0.0; 16], 8, 2, &[1.0]).is_err());
        assert!(reference(ActIn::Bf16, ActOut::Bf16, &[0.0; 12], 12, 1, &[]).is_err());
    }

    #[test]
    fn static_rows_multiply_by_the_reciprocal() {
        let x = [1.0f32, -3.0, 1000.0, 0.01, 0.0, -0.0, 2.5, 7.0];
        let src = [x, x].concat();
        let (q, s) = reference(ActIn::Bf16, ActOut::StaticRow, &src, 8, 2, &[0.5, 3.0]).unwrap();
        assert_eq!(s, vec![0.5, 3.0]);
        assert_eq!(e4m3_to_f32(q[0]), 2.0);
        assert_eq!(e4m3_to_f32(q[2]), 448.0);
        assert_eq!(e4m3_to_f32(q[9]), -1.0);
        let inv = 1.0f32 / 3.0;
        assert_eq!(q[8 + 7], e4m3_from_f32(7.0 * inv));
    }

    #[test]
    fn tolerances() {
        assert!(bf16_close(0x3F80, 0x3F81));
        assert!(bf16_close(0x8000, 0x0000));
        assert!(bf16_close(0x8001, 0x0000));
        assert!(!bf16_close(0x3F80, 0x3F82));
        assert!(e4m3_close((0x38, 1.0), (0x38, 1.0)));
        assert!(e4m3_close((0x39, 1.0), (0x38, 1.0)));
        assert!(!e4m3_close((0x3A, 1.0), (0x38, 1.0)));
        assert!(!e4m3_close((0x7F, 1.0), (0x7F, 1.0)));
    }
}
