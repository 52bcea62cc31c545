//! Small instruction helpers over the typed PTX builder, shared by the GEMM kernels' generators.

use super::act_quant::{E4M3_MAX, GROUP_AMAX_FLOOR, PER_TOKEN_FLOOR};
use crate::ptx::{
    AsyncOp, BarrierId, BinOpcode, Builder, CmpOp, Entry, Inst, Operand, PtxTy, Reg, RegClass,
    SpecialReg, UnOpcode,
};
use crate::Result;

/// The instruction helpers every kernel generator's emitter shares (the GEMMs' [`K`] and the MoE
/// layer's kernels' `moe::emit::G`): each takes the builder it wraps.
pub(crate) trait Emit {
    /// The builder.
    fn builder(&mut self) -> &mut Builder;

    /// The builder, read only.
    fn builder_ref(&self) -> &Builder;

    /// `op.ty d, a, b` into an existing register.
    fn bin_to(&mut self, d: Reg, op: BinOpcode, ty: PtxTy, a: Reg, b: Operand) {
        self.builder().push(Inst::Bin {
            op,
            ty,
            d,
            a: Operand::Reg(a),
            b,
        });
    }

    /// A unary instruction into a fresh register of `class`.
    fn un(&mut self, op: UnOpcode, class: RegClass, a: Operand) -> Reg {
        let b = self.builder();
        let d = b.reg(class);
        b.push(Inst::Un { op, d, a });
        d
    }

    /// `silu(gate) * up` in f32, the one sequence both the activation kernel and the GEMMs' fused
    /// epilogue emit (so that they give the same bits): `e = ex2.approx.ftz(mul.rn(g, -log2 e))`,
    /// `r = rcp.approx(add.rn(e, 1))` (subnormal results kept: `g` down to -126 still gives a
    /// non-zero `a`, as the division did), `mul.rn(mul.rn(g, r), up)` (`crate::moe::act::silu_mul`
    /// on the host). A very negative `g` gives `e = +inf`, `r = +0` and `a = -0 * up`; a large
    /// positive one `e = 0`, `r = 1`.
    fn silu_mul(&mut self, gate: Reg, up: Reg) -> Reg {
        let t = self.fmul_rn(gate, Operand::F32(-std::f32::consts::LOG2_E));
        let e = self.un(
            UnOpcode::Ex2ApproxFtz(PtxTy::F32),
            RegClass::F32,
            Operand::Reg(t),
        );
        self.bin_to(e, BinOpcode::AddRn, PtxTy::F32, e, Operand::F32(1.0));
        let r = self.un(
            UnOpcode::RcpApprox(PtxTy::F32),
            RegClass::F32,
            Operand::Reg(e),
        );
        let q = self.fmul_rn(gate, Operand::Reg(r));
        self.fmul_rn(q, Operand::Reg(up))
    }

    /// `m = max(m, m of lane ^ d)` (`shfl.sync.bfly`, `max.u32`) for each XOR distance `d`: a
    /// butterfly reduction of magnitude bits over the lanes (all 32 take part).
    fn reduce_max_u32(&mut self, m: Reg, distances: &[i64]) {
        for &d in distances {
            let o = self.builder().reg(RegClass::B32);
            self.builder().push(Inst::ShflBfly {
                d: o,
                a: m,
                mask: d,
            });
            self.bin_to(m, BinOpcode::Max, PtxTy::U32, m, Operand::Reg(o));
        }
    }

    /// The per-token E4M3 scale of a row whose amax is `amax` (f32) and whose magnitude bits are
    /// `bits` (zero exactly for an all-zero row): `bits == 0 ? 1 : max(div.rn(amax, 448),
    /// 1/(448*512))`, what `gemm::reference::quantize_per_token` computes.
    fn e4m3_token_scale(&mut self, amax: Reg, bits: Reg) -> Reg {
        let s = self.builder().reg(RegClass::F32);
        self.bin_to(
            s,
            BinOpcode::DivRn,
            PtxTy::F32,
            amax,
            Operand::F32(E4M3_MAX),
        );
        self.bin_to(
            s,
            BinOpcode::Max,
            PtxTy::F32,
            s,
            Operand::F32(PER_TOKEN_FLOOR),
        );
        let zero = self.builder().reg(RegClass::Pred);
        self.builder().push(Inst::Setp {
            cmp: CmpOp::Eq,
            ty: PtxTy::U32,
            p: zero,
            a: Operand::Reg(bits),
            b: Operand::Int(0),
        });
        self.builder().push(Inst::Selp {
            ty: PtxTy::F32,
            d: s,
            a: Operand::F32(1.0),
            b: Operand::Reg(s),
            p: zero,
        });
        s
    }

    /// The E4M3 scale of a 1x128 group whose amax is `amax` (f32; floored in place) and its
    /// reciprocal: `s = div.rn(max(amax, 1e-4), 448)`, `inv = rcp.rn(s)`, what
    /// `gemm::reference::quantize_per_group128` computes.
    fn e4m3_group_scale(&mut self, amax: Reg) -> (Reg, Reg) {
        self.bin_to(
            amax,
            BinOpcode::Max,
            PtxTy::F32,
            amax,
            Operand::F32(GROUP_AMAX_FLOOR),
        );
        let s = self.builder().reg(RegClass::F32);
        self.bin_to(
            s,
            BinOpcode::DivRn,
            PtxTy::F32,
            amax,
            Operand::F32(E4M3_MAX),
        );
        let inv = self.un(UnOpcode::RcpRn(PtxTy::F32), RegClass::F32, Operand::Reg(s));
        (s, inv)
    }

    /// Eight f32 values as two words of E4M3 codes (`cvt.rn.satfinite.e4m3x2.f32`: round to
    /// nearest even, finite values past 448 saturate), value 0 in the low byte of word 0.
    fn e4m3_pack(&mut self, ys: &[Reg; 8]) -> [Reg; 2] {
        let out = [
            self.builder().reg(RegClass::B32),
            self.builder().reg(RegClass::B32),
        ];
        for (h, &d) in out.iter().enumerate() {
            self.builder().push(Inst::CvtE4m3Pack {
                d,
                vals: [ys[4 * h], ys[4 * h + 1], ys[4 * h + 2], ys[4 * h + 3]],
            });
        }
        out
    }

    /// `m = max(m, |v|)` over `vals` on the f32 magnitude bits (`bits & 0x7FFFFFFF`, `max.u32`,
    /// which orders finite values as `|v|` does): the amax of every E4M3 quantizer.
    fn amax_bits(&mut self, m: Reg, vals: &[Reg]) {
        for &v in vals {
            let b = self.un(UnOpcode::Mov(PtxTy::B32), RegClass::B32, Operand::Reg(v));
            self.bin_to(b, BinOpcode::And, PtxTy::B32, b, Operand::Int(0x7FFF_FFFF));
            self.bin_to(m, BinOpcode::Max, PtxTy::U32, m, Operand::Reg(b));
        }
    }

    /// The two code words of `vals op s` (`op` is `div.rn` or `mul.rn`), as [`Emit::e4m3_pack`].
    fn e4m3_codes(&mut self, vals: &[Reg; 8], op: BinOpcode, s: Reg) -> [Reg; 2] {
        let ys = vals.map(|v| {
            let d = self.builder().reg(RegClass::F32);
            self.bin_to(d, op, PtxTy::F32, v, Operand::Reg(s));
            d
        });
        self.e4m3_pack(&ys)
    }

    /// `mul.rn.f32 d, a, b` into a fresh f32 register.
    fn fmul_rn(&mut self, a: Reg, b: Operand) -> Reg {
        let d = self.builder().reg(RegClass::F32);
        self.bin_to(d, BinOpcode::MulRn, PtxTy::F32, a, b);
        d
    }

    /// A special register (`%tid.x`, ...) into a fresh 32-bit register.
    fn special(&mut self, name: SpecialReg) -> Reg {
        let b = self.builder();
        let d = b.reg(RegClass::B32);
        b.push(Inst::Special { d, name });
        d
    }

    /// The global address in the u64 parameter `name` (`ld.param` then `cvta.to.global`).
    fn global_param(&mut self, name: &str) -> Reg {
        let b = self.builder();
        let p = b.reg(RegClass::B64);
        b.push(Inst::LdParam {
            ty: PtxTy::U64,
            d: p,
            name: name.into(),
        });
        let g = b.reg(RegClass::B64);
        b.push(Inst::Cvta { d: g, a: p });
        g
    }

    /// The text of `entry` with this builder's declarations and instructions as its body (no
    /// module header), which begins with `griddepcontrol.wait` (programmatic dependent launch,
    /// `runtime::launch`).
    fn entry_text(&self, entry: &Entry) -> Result<String> {
        let b = self.builder_ref();
        let mut s = entry.header()?;
        s.push_str(&b.decls());
        s.push('\n');
        // Programmatic dependent launch: this kernel waits for its predecessor's completion
        // before its first access to global memory (a no-op for a kernel launched without the
        // dependency). It never triggers its dependents early (`griddepcontrol.launch_dependents`
        // at its start let the next persistent GEMM's CTAs take SMs while this one ran, and
        // graph replays of the layer ran up to 21% slower on the H200, run 44): they are
        // scheduled as its CTAs exit.
        s.push_str(&Inst::GridDepWait.to_string());
        s.push('\n');
        for inst in &b.insts {
            s.push_str(&inst.to_string());
            s.push('\n');
        }
        s.push_str("}\n");
        Ok(s)
    }
}

/// A few instruction helpers over the builder.
pub(crate) struct K {
    pub(crate) b: Builder,
}

impl Emit for K {
    fn builder(&mut self) -> &mut Builder {
        &mut self.b
    }

    fn builder_ref(&self) -> &Builder {
        &self.b
    }
}

impl K {
    pub(crate) fn reg32(&mut self) -> Reg {
        self.b.reg(RegClass::B32)
    }

    pub(crate) fn mov(&mut self, d: Reg, a: Operand) {
        self.b.push(Inst::Un {
            op: UnOpcode::Mov(PtxTy::U32),
            d,
            a,
        });
    }

    pub(crate) fn imm(&mut self, v: i64) -> Reg {
        let d = self.reg32();
        self.mov(d, Operand::Int(v));
        d
    }

    pub(crate) fn bin(&mut self, op: BinOpcode, ty: PtxTy, a: Reg, b: Operand) -> Reg {
        let class = match ty {
            PtxTy::U64 | PtxTy::B64 | PtxTy::S64 => RegClass::B64,
            PtxTy::Pred => RegClass::Pred,
            PtxTy::F32 => RegClass::F32,
            _ => RegClass::B32,
        };
        let d = self.b.reg(class);
        self.bin_to(d, op, ty, a, b);
        d
    }

    /// `mul.wide.u32`: the 64-bit product `a * b`.
    pub(crate) fn wide(&mut self, a: Reg, b: i64) -> Reg {
        let d = self.b.reg(RegClass::B64);
        self.b.push(Inst::Bin {
            op: BinOpcode::MulWide,
            ty: PtxTy::U32,
            d,
            a: Operand::Reg(a),
            b: Operand::Int(b),
        });
        d
    }

    /// `selp.ty d, a, b, p` into a new register of `ty`'s class: `p ? a : b`.
    pub(crate) fn selp(&mut self, ty: PtxTy, a: Operand, b: Operand, p: Reg) -> Reg {
        let class = match ty {
            PtxTy::U64 | PtxTy::B64 | PtxTy::S64 => RegClass::B64,
            PtxTy::F32 => RegClass::F32,
            _ => RegClass::B32,
        };
        let d = self.b.reg(class);
        self.b.push(Inst::Selp { ty, d, a, b, p });
        d
    }

    pub(crate) fn setp(&mut self, cmp: CmpOp, a: Reg, b: Operand) -> Reg {
        let p = self.b.reg(RegClass::Pred);
        self.b.push(Inst::Setp {
            cmp,
            ty: PtxTy::U32,
            p,
            a: Operand::Reg(a),
            b,
        });
        p
    }

    pub(crate) fn bra(&mut self, label: &str, pred: Option<(Reg, bool)>) {
        self.b.push(Inst::Bra {
            label: label.into(),
            pred,
        });
    }

    /// After every consumer thread's global stores: count this CTA's arrival on a global u32
    /// counter, and send every CTA but the one that completes `count` arrivals to `skip`. Every
    /// thread fences (`fence.acq_rel.gpu`) and the `nthreads` consumer threads meet at named
    /// barrier 1; consumer thread 0
    /// (`ctid == 0`) adds one with `atom.acq_rel.gpu` at the address `counter` emits (on that
    /// thread's path only), resets the counter to zero when it completed the count (for the next
    /// launch), and leaves the answer in the CTA's shared u32 `flag` (a declared symbol); after
    /// the barrier again every thread reads it. The last CTA fences once more before it reads what the
    /// others stored (split-K's partial sums, the fused epilogue's `a`).
    pub(crate) fn last_arrival(
        &mut self,
        ctid: Reg,
        counter: impl FnOnce(&mut Self) -> Reg,
        count: i64,
        (nthreads, flag, stem): (u32, &str, &str),
        skip: &str,
    ) -> Result<()> {
        let bar = AsyncOp::Bar {
            id: BarrierId::new(1)?,
            count: Some(nthreads),
        };
        self.b.push(Inst::FenceAcqRelGpu);
        self.b.emit(bar.clone())?;
        let flag = self.b.shared_addr(flag);
        let not_first = self.setp(CmpOp::Ne, ctid, Operand::Int(0));
        let counted = self.b.label(stem);
        self.bra(&counted, Some((not_first, false)));
        let cnt = counter(self);
        let old = self.reg32();
        self.b.push(Inst::AtomAddAcqRelU32 {
            d: old,
            addr: cnt,
            v: Operand::Int(1),
        });
        let last = self.setp(CmpOp::Eq, old, Operand::Int(count - 1));
        let zero = self.imm(0);
        self.b.push(Inst::StGuarded {
            pred: last,
            negate: false,
            ty: PtxTy::U32,
            addr: cnt,
            off: 0,
            v: zero,
        });
        let is_last = self.selp(PtxTy::U32, Operand::Int(1), Operand::Int(0), last);
        self.b.push(Inst::StShared {
            addr: flag,
            v: is_last,
        });
        self.b.push(Inst::Label(counted));
        self.b.emit(bar)?;
        let got = self.reg32();
        self.b.push(Inst::LdShared {
            d: got,
            addr: flag,
            off: 0,
        });
        let not_last = self.setp(CmpOp::Eq, got, Operand::Int(0));
        self.bra(skip, Some((not_last, false)));
        self.b.push(Inst::FenceAcqRelGpu);
        Ok(())
    }

    /// The consumer thread's index `0 .. 128 C` from the CTA's `tid` (the consumers come first
    /// behind a producer warp, else after the producer warpgroup).
    pub(crate) fn consumer_tid(&mut self, producer_warp: bool, tid: Reg) -> Reg {
        let first = if producer_warp { 0 } else { 128 };
        self.bin(BinOpcode::Sub, PtxTy::U32, tid, Operand::Int(first))
    }

    /// `base + stage * stage_bytes` and `bars + 8 * stage` for a stage in a register.
    pub(crate) fn stage_addrs(
        &mut self,
        stage: Reg,
        stage_bytes: u32,
        base: Reg,
        bars: Reg,
    ) -> (Reg, Reg) {
        let a = self.bin(
            BinOpcode::MulLo,
            PtxTy::U32,
            stage,
            Operand::Int(stage_bytes.into()),
        );
        self.bin_to(a, BinOpcode::Add, PtxTy::U32, a, Operand::Reg(base));
        let bar = self.bin(BinOpcode::Shl, PtxTy::B32, stage, Operand::Int(3));
        self.bin_to(bar, BinOpcode::Add, PtxTy::U32, bar, Operand::Reg(bars));
        (a, bar)
    }

    /// `stage += 1`, wrapping at `stages` and flipping `phase` on the wrap (an mbarrier ring's
    /// position).
    pub(crate) fn advance_stage(&mut self, stage: Reg, phase: Reg, stages: u32) {
        self.bin_to(stage, BinOpcode::Add, PtxTy::U32, stage, Operand::Int(1));
        let wrap = self.setp(CmpOp::Eq, stage, Operand::Int(stages.into()));
        self.b.push(Inst::Selp {
            ty: PtxTy::U32,
            d: stage,
            a: Operand::Int(0),
            b: Operand::Reg(stage),
            p: wrap,
        });
        let flip = self.reg32();
        self.b.push(Inst::Selp {
            ty: PtxTy::U32,
            d: flip,
            a: Operand::Int(1),
            b: Operand::Int(0),
            p: wrap,
        });
        self.bin_to(phase, BinOpcode::Xor, PtxTy::B32, phase, Operand::Reg(flip));
    }

    /// The next k-tile: advance the ring, `kt += 1`, and the predicate `kt < end`.
    pub(crate) fn next_ktile(
        &mut self,
        stage: Reg,
        phase: Reg,
        stages: u32,
        kt: Reg,
        end: Operand,
    ) -> Reg {
        self.advance_stage(stage, phase, stages);
        self.bin_to(kt, BinOpcode::Add, PtxTy::U32, kt, Operand::Int(1));
        self.setp(CmpOp::Lt, kt, end)
    }

    /// The shared address of the dynamic shared array `name` rounded up to `align` bytes (a power
    /// of two; the launch asks for `align` bytes more than it needs).
    pub(crate) fn aligned_shared_base(&mut self, name: &str, align: u32) -> Reg {
        let dynamic = self.b.shared_addr(name);
        let base = self.bin(
            BinOpcode::Add,
            PtxTy::U32,
            dynamic,
            Operand::Int((align - 1).into()),
        );
        self.bin_to(
            base,
            BinOpcode::And,
            PtxTy::B32,
            base,
            Operand::Int(i64::from(!(align - 1))),
        );
        base
    }

    /// `base + index * scale` as a 64-bit address (`mul.wide.u32` of a 32-bit index).
    pub(crate) fn addr(&mut self, base: Reg, index: Reg, scale: i64) -> Reg {
        let off = self.wide(index, scale);
        self.bin(BinOpcode::Add, PtxTy::U64, base, Operand::Reg(off))
    }
}

/// A PTX identifier: a letter or `_`, then letters, digits, `_` or `$`.
pub(crate) fn is_ptx_ident(name: &str) -> bool {
    name.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
}
