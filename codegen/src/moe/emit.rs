//! Small instruction helpers over the typed PTX builder, shared by the MoE layer's kernel
//! generators.

use crate::gemm::emit::Emit;
use crate::ptx::{
    BinOpcode, Builder, CmpOp, Entry, Inst, Operand, Param, PtxTy, Reg, RegClass, SpecialReg,
    UnOpcode,
};
use crate::Result;

/// Instruction helpers over the typed builder, shared by the MoE layer's kernel generators
/// (`permute`, `act`, `combine`).
#[derive(Default)]
pub(super) struct G {
    pub(super) b: Builder,
}

/// Append one entry (header, declarations, body) to a module's text.
pub(super) fn push_entry(s: &mut String, e: &Entry, g: &G) -> Result<()> {
    s.push('\n');
    s.push_str(&g.entry_text(e)?);
    Ok(())
}

/// An entry's parameters: the first `pointers` of `names` u64 global pointers (the `k`-th aligned
/// to `align(k)` bytes), the rest u32 scalars.
pub(super) fn entry_params(
    names: &[&str],
    pointers: usize,
    align: impl Fn(usize) -> u32,
) -> Vec<Param> {
    names
        .iter()
        .enumerate()
        .map(|(k, n)| {
            if k < pointers {
                Param::global_ptr(*n, align(k))
            } else {
                Param::scalar(*n, PtxTy::U32)
            }
        })
        .collect()
}

impl Emit for G {
    fn builder(&mut self) -> &mut Builder {
        &mut self.b
    }

    fn builder_ref(&self) -> &Builder {
        &self.b
    }
}

impl G {
    pub(super) fn r32(&mut self) -> Reg {
        self.b.reg(RegClass::B32)
    }

    pub(super) fn f32(&mut self) -> Reg {
        self.b.reg(RegClass::F32)
    }

    pub(super) fn mov(&mut self, d: Reg, a: Operand) {
        let ty = match d.class {
            RegClass::B64 => PtxTy::U64,
            RegClass::F32 => PtxTy::F32,
            _ => PtxTy::B32,
        };
        self.b.push(Inst::Un {
            op: UnOpcode::Mov(ty),
            d,
            a,
        });
    }

    pub(super) fn bin(&mut self, op: BinOpcode, ty: PtxTy, a: Reg, b: Operand) -> Reg {
        let class = match (op, ty) {
            (BinOpcode::MulWide, _) | (_, PtxTy::U64 | PtxTy::B64 | PtxTy::S64) => RegClass::B64,
            (BinOpcode::CvtRnBf16x2, _) => RegClass::B32,
            (_, PtxTy::F32) => RegClass::F32,
            _ => RegClass::B32,
        };
        let d = self.b.reg(class);
        self.bin_to(d, op, ty, a, b);
        d
    }

    pub(super) fn setp(&mut self, cmp: CmpOp, ty: PtxTy, a: Reg, b: Operand) -> Reg {
        let p = self.b.reg(RegClass::Pred);
        self.b.push(Inst::Setp {
            cmp,
            ty,
            p,
            a: Operand::Reg(a),
            b,
        });
        p
    }

    pub(super) fn u32_param(&mut self, name: &str) -> Reg {
        let d = self.r32();
        self.b.push(Inst::LdParam {
            ty: PtxTy::U32,
            d,
            name: name.into(),
        });
        d
    }

    /// `base + index * scale` (64-bit; `index` unsigned).
    pub(super) fn elem(&mut self, base: Reg, index: Reg, scale: i64) -> Reg {
        let off = self.bin(BinOpcode::MulWide, PtxTy::U32, index, Operand::Int(scale));
        self.bin(BinOpcode::Add, PtxTy::U64, base, Operand::Reg(off))
    }

    /// The grid-stride loop's first index and step: `ctaid * ntid + tid`, `nctaid * ntid`.
    pub(super) fn grid_stride(&mut self) -> (Reg, Reg) {
        let tid = self.special(SpecialReg::TidX);
        let ntid = self.special(SpecialReg::NtidX);
        let cta = self.special(SpecialReg::CtaidX);
        let ncta = self.special(SpecialReg::NctaidX);
        let i = self.bin(BinOpcode::MulLo, PtxTy::U32, cta, Operand::Reg(ntid));
        self.bin_to(i, BinOpcode::Add, PtxTy::U32, i, Operand::Reg(tid));
        let step = self.bin(BinOpcode::MulLo, PtxTy::U32, ncta, Operand::Reg(ntid));
        (i, step)
    }

    /// The shared-memory address of word `index` of the array at `base` (32-bit): `base + 4 index`.
    pub(super) fn shared_word(&mut self, base: Reg, index: Reg) -> Reg {
        let a = self.bin(BinOpcode::Shl, PtxTy::B32, index, Operand::Int(2));
        self.bin_to(a, BinOpcode::Add, PtxTy::U32, a, Operand::Reg(base));
        a
    }

    /// `base + off` (64-bit, a constant byte offset).
    pub(super) fn offset(&mut self, base: Reg, off: i64) -> Reg {
        if off == 0 {
            return base;
        }
        self.bin(BinOpcode::Add, PtxTy::U64, base, Operand::Int(off))
    }

    pub(super) fn ld(&mut self, ty: PtxTy, addr: Reg) -> Reg {
        let d = if ty == PtxTy::F32 {
            self.f32()
        } else {
            self.r32()
        };
        self.b.push(Inst::Ld { ty, d, addr });
        d
    }

    pub(super) fn bra(&mut self, label: &str, pred: Option<(Reg, bool)>) {
        self.b.push(Inst::Bra {
            label: label.into(),
            pred,
        });
    }

    pub(super) fn label(&mut self, l: &str) {
        self.b.push(Inst::Label(l.into()));
    }

    /// `min(max(offsets[slots], 0), bound)`: the rows the grouped GEMM filled, capped (`offsets`
    /// holds `slots + 1` i32).
    pub(super) fn filled_rows(&mut self, offsets: Reg, slots: Reg, bound: Reg) -> Reg {
        let a = self.elem(offsets, slots, 4);
        let total = self.ld(PtxTy::S32, a);
        self.bin_to(total, BinOpcode::Max, PtxTy::S32, total, Operand::Int(0));
        self.bin_to(
            total,
            BinOpcode::Min,
            PtxTy::U32,
            total,
            Operand::Reg(bound),
        );
        total
    }

    /// A 16-byte load of four f32 (`ld.global.nc.v4.b32`).
    pub(super) fn ld4_f32(&mut self, addr: Reg) -> [Reg; 4] {
        let w = [self.f32(), self.f32(), self.f32(), self.f32()];
        self.b.push(Inst::LdV {
            nc: true,
            words: w.to_vec(),
            addr,
        });
        w
    }

    /// The bf16 word (`cvt.rn.bf16x2.f32`) of `lo` (low half) and `hi` (high half).
    pub(super) fn bf16x2(&mut self, lo: Reg, hi: Reg) -> Reg {
        self.bin(BinOpcode::CvtRnBf16x2, PtxTy::F32, hi, Operand::Reg(lo))
    }

    /// The guards of a thread's `per_thread` chunks when chunk `i` of thread `tid` is `tid + i *
    /// threads` of `chunks`: `None` where every thread's chunk `i` exists (`(i + 1) * threads <=
    /// chunks`), else the predicate `tid < chunks - i * threads`.
    pub(super) fn chunk_guards(
        &mut self,
        tid: Reg,
        chunks: u32,
        threads: u32,
        per_thread: u32,
    ) -> Vec<Option<Reg>> {
        (0..per_thread)
            .map(|i| {
                ((i + 1) * threads > chunks).then(|| {
                    self.setp(
                        CmpOp::Lt,
                        PtxTy::U32,
                        tid,
                        Operand::Int(i64::from(chunks - i * threads)),
                    )
                })
            })
            .collect()
    }
}
