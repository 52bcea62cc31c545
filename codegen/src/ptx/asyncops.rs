//! Hopper's (`sm_90a`) asynchronous, barrier and tensor-core instructions as typed values: `.shared`
//! declarations with alignment ([`SharedDecl`]), mbarriers and proxy fences, TMA tensor copies
//! (`cp.async.bulk.tensor` loads completing on an mbarrier, stores in bulk groups, prefetches),
//! `wgmma` (fence, `mma_async` from two shared-memory descriptors or with A from registers, commit
//! and wait), `setmaxnreg`, `elect.sync` and named barriers.
//!
//! Each instruction is an [`AsyncOp`] carried by [`Inst::Async`] (with an optional [`Guard`]); its
//! `Display` is the PTX text of the hand-written kernels that ran on the H200 (GEMM.md §1), in this
//! backend's spacing. Values with a range of their own are newtypes that only a checked constructor
//! makes ([`WgmmaN`], [`MaxNReg`], [`BarrierId`]); what depends on several operands (register
//! classes, the accumulator's length, transposes an operand type does not allow) is checked by
//! [`AsyncOp::validate`], which [`Builder::emit`] calls before it appends anything. Errors are
//! [`Error::Inst`].

use std::fmt;

use super::isa::{Builder, Inst, Operand, Reg, RegClass};
use crate::{Error, Result};

/// The largest transaction count or arrival count an mbarrier holds (`2^20 - 1`).
pub const MBARRIER_MAX_COUNT: i64 = (1 << 20) - 1;

fn bad(inst: &'static str, why: impl Into<String>) -> Error {
    Error::Inst {
        inst,
        why: why.into(),
    }
}

fn want(inst: &'static str, what: &str, r: Reg, class: RegClass) -> Result<()> {
    if r.class == class {
        Ok(())
    } else {
        Err(bad(
            inst,
            format!("{what} must be a {class:?} register, not `{r}`"),
        ))
    }
}

/// An operand that is a 32-bit register or an integer immediate in `lo..=hi`.
fn want_u32(inst: &'static str, what: &str, o: Operand, lo: i64, hi: i64) -> Result<()> {
    match o {
        Operand::Reg(r) => want(inst, what, r, RegClass::B32),
        Operand::Int(i) if (lo..=hi).contains(&i) => Ok(()),
        Operand::Int(i) => Err(bad(inst, format!("{what} {i} is not in {lo}..={hi}"))),
        Operand::F32(_) => Err(bad(inst, format!("{what} must be an integer"))),
    }
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(x) if x.is_ascii_alphabetic() || x == '_' || x == '$')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == '$')
}

/// The element type of a `.shared` variable (printed with its leading dot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedTy {
    /// `.b8` (tiles: byte arrays).
    B8,
    /// `.b16`.
    B16,
    /// `.b32`.
    B32,
    /// `.b64` (an mbarrier).
    B64,
    /// `.f32`.
    F32,
}

impl SharedTy {
    /// Size in bytes.
    pub const fn bytes(self) -> u32 {
        match self {
            SharedTy::B8 => 1,
            SharedTy::B16 => 2,
            SharedTy::B32 | SharedTy::F32 => 4,
            SharedTy::B64 => 8,
        }
    }
}

impl fmt::Display for SharedTy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SharedTy::B8 => ".b8",
            SharedTy::B16 => ".b16",
            SharedTy::B32 => ".b32",
            SharedTy::B64 => ".b64",
            SharedTy::F32 => ".f32",
        })
    }
}

/// A static `.shared` variable of the kernel body: `.shared .align A .TY NAME[LEN];` (an array) or
/// `.shared .align A .TY NAME;` (one element, e.g. an mbarrier). `mov.u32 r, NAME` (see
/// [`Builder::shared_addr`]) gives its 32-bit shared-window address. 128B-swizzled TMA tiles need
/// `.align 1024`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDecl {
    name: String,
    ty: SharedTy,
    len: Option<u32>,
    align: u32,
}

impl SharedDecl {
    /// An array of `len` elements aligned to `align` bytes.
    ///
    /// Errors: a name that is not a PTX identifier, `len == 0`, an alignment that is not a power of
    /// two or is smaller than the element.
    pub fn array(name: impl Into<String>, ty: SharedTy, len: u32, align: u32) -> Result<Self> {
        if len == 0 {
            return Err(bad(".shared", "an array of 0 elements"));
        }
        Self::checked(name.into(), ty, Some(len), align)
    }

    /// One element aligned to `align` bytes (an mbarrier is `scalar("bar", SharedTy::B64, 8)`).
    ///
    /// Errors: as [`SharedDecl::array`].
    pub fn scalar(name: impl Into<String>, ty: SharedTy, align: u32) -> Result<Self> {
        Self::checked(name.into(), ty, None, align)
    }

    fn checked(name: String, ty: SharedTy, len: Option<u32>, align: u32) -> Result<Self> {
        if !is_ident(&name) {
            return Err(bad(".shared", format!("`{name}` is not a PTX identifier")));
        }
        if !align.is_power_of_two() || align < ty.bytes() {
            return Err(bad(
                ".shared",
                format!(
                    "`{name}`: alignment {align} is not a power of two of at least {} bytes",
                    ty.bytes()
                ),
            ));
        }
        Ok(SharedDecl {
            name,
            ty,
            len,
            align,
        })
    }

    /// The variable's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its alignment in bytes.
    pub fn align(&self) -> u32 {
        self.align
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        u64::from(self.ty.bytes()) * u64::from(self.len.unwrap_or(1))
    }
}

impl fmt::Display for SharedDecl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let SharedDecl {
            name,
            ty,
            len,
            align,
        } = self;
        match len {
            Some(n) => write!(f, "\t.shared .align {align} {ty} \t{name}[{n}];"),
            None => write!(f, "\t.shared .align {align} {ty} \t{name};"),
        }
    }
}

/// A predicate guard: `@p` or `@!p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    /// The predicate register.
    pub pred: Reg,
    /// `@!p`: run where the predicate is false.
    pub negate: bool,
}

impl Guard {
    /// `@p`.
    pub const fn when(pred: Reg) -> Guard {
        Guard {
            pred,
            negate: false,
        }
    }

    /// `@!p`.
    pub const fn unless(pred: Reg) -> Guard {
        Guard { pred, negate: true }
    }
}

impl fmt::Display for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bang = if self.negate { "!" } else { "" };
        write!(f, "@{bang}{}", self.pred)
    }
}

/// The rank of a TMA tensor copy (printed `.1d` ... `.5d`); the coordinate list has that many
/// elements, innermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TmaDim {
    /// `.1d`
    D1,
    /// `.2d`
    D2,
    /// `.3d`
    D3,
    /// `.4d`
    D4,
    /// `.5d`
    D5,
}

impl TmaDim {
    /// The number of coordinates.
    pub const fn rank(self) -> usize {
        match self {
            TmaDim::D1 => 1,
            TmaDim::D2 => 2,
            TmaDim::D3 => 3,
            TmaDim::D4 => 4,
            TmaDim::D5 => 5,
        }
    }
}

impl fmt::Display for TmaDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, ".{}d", self.rank())
    }
}

/// A TMA tile load: `cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes
/// [dst], [tmap, {coords}], [bar]` (with `.L2::cache_hint` and the policy operand where
/// `cache_hint` is set). The bytes it writes count against `bar`'s expected transaction bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TmaLoad {
    /// Rank.
    pub dim: TmaDim,
    /// Destination tile's shared address (32-bit).
    pub dst: Reg,
    /// The tensor map's generic address (64-bit, see [`Builder::tensor_map_addr`]).
    pub tmap: Reg,
    /// Tile coordinates in elements, innermost first (32-bit, signed).
    pub coords: Vec<Reg>,
    /// The mbarrier's shared address (32-bit).
    pub bar: Reg,
    /// An L2 cache policy (64-bit; `createpolicy` or a constant such as EVICT_FIRST).
    pub cache_hint: Option<Reg>,
}

/// `N` of a `wgmma` shape `m64nNkK`: a multiple of 8 in `8..=256`. Each thread of the warpgroup
/// holds `N/2` f32 accumulators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WgmmaN(u32);

impl WgmmaN {
    /// Checked: `n` must be a multiple of 8 in `8..=256`.
    pub fn new(n: u32) -> Result<WgmmaN> {
        if n.is_multiple_of(8) && (8..=256).contains(&n) {
            Ok(WgmmaN(n))
        } else {
            Err(bad(
                "wgmma.mma_async",
                format!("N = {n} is not a multiple of 8 in 8..=256"),
            ))
        }
    }

    /// The value.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// Accumulator registers per thread (`N/2` f32).
    pub const fn accumulators(self) -> usize {
        (self.0 / 2) as usize
    }
}

/// The type of `wgmma`'s A and B operands (both the same; printed with its leading dot). It fixes
/// the shape's K: 16 for the 16-bit types, 32 for the 8-bit ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaTy {
    /// `.f16`
    F16,
    /// `.bf16`
    Bf16,
    /// `.e4m3`
    E4m3,
    /// `.e5m2`
    E5m2,
}

impl WgmmaTy {
    /// K of one instruction.
    pub const fn k(self) -> u32 {
        match self {
            WgmmaTy::F16 | WgmmaTy::Bf16 => 16,
            WgmmaTy::E4m3 | WgmmaTy::E5m2 => 32,
        }
    }

    /// Whether the type allows the transpose operands (only the 16-bit types do: 8-bit operands
    /// must be K-major).
    pub const fn transposable(self) -> bool {
        matches!(self, WgmmaTy::F16 | WgmmaTy::Bf16)
    }
}

impl fmt::Display for WgmmaTy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WgmmaTy::F16 => ".f16",
            WgmmaTy::Bf16 => ".bf16",
            WgmmaTy::E4m3 => ".e4m3",
            WgmmaTy::E5m2 => ".e5m2",
        })
    }
}

/// `wgmma`'s A operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaA {
    /// A shared-memory matrix descriptor (64-bit).
    Desc(Reg),
    /// The fragment in four 32-bit registers per thread (`{a0, a1, a2, a3}`; GEMM.md §1.6).
    Regs([Reg; 4]),
}

impl fmt::Display for WgmmaA {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WgmmaA::Desc(r) => write!(f, "{r}"),
            WgmmaA::Regs([a, b, c, d]) => write!(f, "{{{a}, {b}, {c}, {d}}}"),
        }
    }
}

/// `wgmma`'s scale-d operand: `D = A*B + D` where true, `D = A*B` where false.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleD {
    /// A predicate register.
    Pred(Reg),
    /// A constant (printed `1` or `0`).
    Imm(bool),
}

impl fmt::Display for ScaleD {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScaleD::Pred(p) => write!(f, "{p}"),
            ScaleD::Imm(b) => write!(f, "{}", u8::from(*b)),
        }
    }
}

/// `wgmma`'s imm-scale-a / imm-scale-b: `1`, or `-1` to negate the operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImmScale {
    /// `1`.
    #[default]
    One,
    /// `-1`.
    MinusOne,
}

impl fmt::Display for ImmScale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ImmScale::One => "1",
            ImmScale::MinusOne => "-1",
        })
    }
}

/// `wgmma.mma_async.sync.aligned.m64nNkK.f32.T.T d, a, b-desc, scale-d, imm-scale-a, imm-scale-b
/// [, imm-trans-a][, imm-trans-b]`: the trailing transposes exist for 16-bit types only, and
/// imm-trans-a only where A is a descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wgmma {
    /// N of the shape.
    pub n: WgmmaN,
    /// Type of A and B.
    pub ty: WgmmaTy,
    /// The accumulator: `N/2` f32 registers.
    pub d: Vec<Reg>,
    /// A.
    pub a: WgmmaA,
    /// B's shared-memory descriptor (64-bit).
    pub b: Reg,
    /// Accumulate into `d` (else overwrite it).
    pub scale_d: ScaleD,
    /// imm-scale-a.
    pub scale_a: ImmScale,
    /// imm-scale-b.
    pub scale_b: ImmScale,
    /// imm-trans-a: A is M-major (16-bit types, descriptor A only).
    pub trans_a: bool,
    /// imm-trans-b: B is N-major (16-bit types only).
    pub trans_b: bool,
}

impl Wgmma {
    /// Both operands from shared-memory descriptors, K-major, not negated.
    pub fn ss(n: WgmmaN, ty: WgmmaTy, d: Vec<Reg>, a: Reg, b: Reg, scale_d: ScaleD) -> Wgmma {
        Wgmma {
            n,
            ty,
            d,
            a: WgmmaA::Desc(a),
            b,
            scale_d,
            scale_a: ImmScale::One,
            scale_b: ImmScale::One,
            trans_a: false,
            trans_b: false,
        }
    }

    /// A from registers, B from a descriptor, K-major, not negated.
    pub fn rs(n: WgmmaN, ty: WgmmaTy, d: Vec<Reg>, a: [Reg; 4], b: Reg, scale_d: ScaleD) -> Wgmma {
        Wgmma {
            a: WgmmaA::Regs(a),
            ..Wgmma::ss(n, ty, d, a[0], b, scale_d)
        }
    }

    fn validate(&self) -> Result<()> {
        const I: &str = "wgmma.mma_async";
        if self.d.len() != self.n.accumulators() {
            return Err(bad(
                I,
                format!(
                    "m64n{} needs {} accumulator registers, got {}",
                    self.n.get(),
                    self.n.accumulators(),
                    self.d.len()
                ),
            ));
        }
        for &r in &self.d {
            want(I, "an accumulator", r, RegClass::F32)?;
        }
        match self.a {
            WgmmaA::Desc(r) => want(I, "A's descriptor", r, RegClass::B64)?,
            WgmmaA::Regs(rs) => {
                for r in rs {
                    want(I, "A's fragment", r, RegClass::B32)?;
                }
                if self.trans_a {
                    return Err(bad(I, "A from registers cannot be transposed"));
                }
            }
        }
        want(I, "B's descriptor", self.b, RegClass::B64)?;
        if let ScaleD::Pred(p) = self.scale_d {
            want(I, "scale-d", p, RegClass::Pred)?;
        }
        if !self.ty.transposable() && (self.trans_a || self.trans_b) {
            return Err(bad(
                I,
                format!("{} operands must be K-major (no transpose)", self.ty),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Wgmma {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Wgmma {
            n,
            ty,
            d,
            a,
            b,
            scale_d,
            scale_a,
            scale_b,
            trans_a,
            trans_b,
        } = self;
        write!(
            f,
            "wgmma.mma_async.sync.aligned.m64n{}k{}.f32{ty}{ty} \t{{",
            n.get(),
            ty.k()
        )?;
        for (i, r) in d.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{r}")?;
        }
        write!(f, "}}, {a}, {b}, {scale_d}, {scale_a}, {scale_b}")?;
        if ty.transposable() {
            if let WgmmaA::Desc(_) = a {
                write!(f, ", {}", u8::from(*trans_a))?;
            }
            write!(f, ", {}", u8::from(*trans_b))?;
        }
        f.write_str(";")
    }
}

/// The register count of `setmaxnreg`: a multiple of 8 in `24..=256`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MaxNReg(u32);

impl MaxNReg {
    /// Checked: `n` must be a multiple of 8 in `24..=256`.
    pub fn new(n: u32) -> Result<MaxNReg> {
        if n.is_multiple_of(8) && (24..=256).contains(&n) {
            Ok(MaxNReg(n))
        } else {
            Err(bad(
                "setmaxnreg",
                format!("{n} registers is not a multiple of 8 in 24..=256"),
            ))
        }
    }

    /// The value.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// Whether `setmaxnreg` raises or lowers the warpgroup's register count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegDelta {
    /// `.inc` (consumers: wait for registers, then own them).
    Inc,
    /// `.dec` (producers: give registers back).
    Dec,
}

/// A named barrier's id, `0..=15` (`bar.sync 0` is the one `__syncthreads` uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BarrierId(u32);

impl BarrierId {
    /// Checked: `id` must be in `0..=15`.
    pub fn new(id: u32) -> Result<BarrierId> {
        if id < 16 {
            Ok(BarrierId(id))
        } else {
            Err(bad("bar.sync", format!("barrier id {id} is not in 0..=15")))
        }
    }

    /// The value.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// Hopper's asynchronous, barrier and tensor-core instructions (see the module documentation).
/// Addresses in the shared window are 32-bit registers; tensor maps are 64-bit generic addresses.
#[derive(Debug, Clone, PartialEq)]
pub enum AsyncOp {
    /// `mbarrier.init.shared::cta.b64 [bar], count`: the arrivals one phase waits for.
    MbarrierInit {
        /// The mbarrier's shared address.
        bar: Reg,
        /// Expected arrivals (`1..=2^20-1`).
        count: Operand,
    },
    /// `mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], tx`: arrive once and expect `tx` more
    /// bytes of TMA transactions in the current phase.
    MbarrierArriveExpectTx {
        /// The mbarrier's shared address.
        bar: Reg,
        /// Bytes expected (the sum of the boxes of the loads that complete on `bar`; `0..=2^20-1`).
        tx_bytes: Operand,
    },
    /// `mbarrier.arrive.shared::cta.b64 _, [bar]`.
    MbarrierArrive {
        /// The mbarrier's shared address.
        bar: Reg,
    },
    /// `cp.async.ca.shared.global [dst], [src], 4`: an asynchronous 4-byte copy from global to
    /// shared memory (both 4-byte aligned), tracked by the thread's cp.async state.
    CpAsync4 {
        /// The shared destination (32-bit shared-window address).
        dst: Reg,
        /// The global source (64-bit generic address of global memory).
        src: Reg,
    },
    /// `cp.async.mbarrier.arrive.noinc.shared::cta.b64 [bar]`: the mbarrier receives this thread's
    /// arrival once all of its prior `cp.async` copies have completed (`noinc`: the arrival counts
    /// against the barrier's expected count, which must include it).
    CpAsyncMbarrierArriveNoinc {
        /// The mbarrier's shared address.
        bar: Reg,
    },
    /// `mbarrier.arrive.release.cluster.shared::cluster.b64 _, [bar]`: arrive on an mbarrier of a
    /// CTA of the cluster (its address from [`AsyncOp::Mapa`]).
    MbarrierArriveCluster {
        /// The mbarrier's shared::cluster address.
        bar: Reg,
    },
    /// `mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity`: `p` = the phase of parity
    /// `parity` has completed (see [`Builder::mbarrier_wait`] for the loop around it).
    MbarrierTryWaitParity {
        /// Result.
        p: Reg,
        /// The mbarrier's shared address.
        bar: Reg,
        /// Phase parity (a register, or 0 or 1).
        parity: Operand,
    },
    /// `fence.mbarrier_init.release.cluster`: makes mbarrier inits visible to the async proxy and
    /// the cluster.
    FenceMbarrierInit,
    /// `fence.proxy.async.shared::cta`: orders generic-proxy shared-memory writes before async-proxy
    /// reads (TMA store, wgmma).
    FenceProxyAsyncShared,
    /// `mapa.shared::cluster.u32 d, a, cta`: the address of `a`'s counterpart in CTA `cta` of the
    /// cluster.
    Mapa {
        /// Destination.
        d: Reg,
        /// A shared::cta address.
        a: Reg,
        /// The target CTA's rank in the cluster.
        cta: Operand,
    },
    /// `barrier.cluster.arrive.release.aligned`.
    BarrierClusterArrive,
    /// `barrier.cluster.wait.acquire.aligned`.
    BarrierClusterWait,
    /// `mov.u64 d, param`: a kernel parameter's address in the param space (for a tensor map
    /// parameter; then [`AsyncOp::CvtaParam`]).
    ParamAddr {
        /// Destination (64-bit).
        d: Reg,
        /// The parameter's name.
        param: String,
    },
    /// `cvta.param.u64 d, a`: a param-space address to a generic one.
    CvtaParam {
        /// Destination (64-bit).
        d: Reg,
        /// Param-space address (64-bit).
        a: Reg,
    },
    /// `prefetch.tensormap [tmap]`.
    PrefetchTensorMap {
        /// The tensor map's generic address.
        tmap: Reg,
    },
    /// A TMA tile load (see [`TmaLoad`]).
    TmaLoad(TmaLoad),
    /// `cp.async.bulk.prefetch.tensor.Nd.L2.global [tmap, {coords}]`: a tile into L2.
    TmaPrefetch {
        /// Rank.
        dim: TmaDim,
        /// The tensor map's generic address.
        tmap: Reg,
        /// Coordinates, innermost first.
        coords: Vec<Reg>,
    },
    /// `cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group [tmap, {coords}], [src]`: a tile
    /// store, in the thread's current bulk group.
    TmaStore {
        /// Rank.
        dim: TmaDim,
        /// The tensor map's generic address.
        tmap: Reg,
        /// Coordinates, innermost first.
        coords: Vec<Reg>,
        /// The source tile's shared address.
        src: Reg,
    },
    /// `cp.async.bulk.commit_group`.
    BulkCommitGroup,
    /// `cp.async.bulk.wait_group.read N`: wait until at most `N` bulk groups still read their
    /// shared-memory source.
    BulkWaitGroupRead(u32),
    /// `wgmma.fence.sync.aligned`.
    WgmmaFence,
    /// `wgmma.commit_group.sync.aligned`.
    WgmmaCommitGroup,
    /// `wgmma.wait_group.sync.aligned N`: wait until at most `N` wgmma groups are pending.
    WgmmaWaitGroup(u32),
    /// `wgmma.mma_async` (see [`Wgmma`]).
    Wgmma(Wgmma),
    /// `mov.b64 d, {lo, hi}`: a 64-bit value (a matrix descriptor) from two 32-bit halves.
    PackB64 {
        /// Destination (64-bit).
        d: Reg,
        /// Low half (32-bit).
        lo: Reg,
        /// High half (32-bit).
        hi: Reg,
    },
    /// `setmaxnreg.{inc,dec}.sync.aligned.u32 N` (every warp of the warpgroup executes it).
    SetMaxNReg {
        /// Raise or lower.
        delta: RegDelta,
        /// The new per-thread register count.
        count: MaxNReg,
    },
    /// `elect.sync d|p, mask`: `p` is true in one leader lane of `mask`, `d` its lane (`_` where
    /// `d` is `None`).
    ElectSync {
        /// The leader's lane (32-bit).
        d: Option<Reg>,
        /// True in the leader.
        p: Reg,
        /// Participating lanes.
        mask: u32,
    },
    /// `bar.sync id[, count]`: a named barrier over `count` threads (a multiple of 32; all of the
    /// CTA without it).
    Bar {
        /// Barrier id.
        id: BarrierId,
        /// Participating threads.
        count: Option<u32>,
    },
}

fn coords_ok(inst: &'static str, dim: TmaDim, coords: &[Reg]) -> Result<()> {
    if coords.len() != dim.rank() {
        return Err(bad(
            inst,
            format!(
                "a {}d copy takes {} coordinates, got {}",
                dim.rank(),
                dim.rank(),
                coords.len()
            ),
        ));
    }
    for &c in coords {
        want(inst, "a coordinate", c, RegClass::B32)?;
    }
    Ok(())
}

struct Coords<'a>(&'a [Reg]);

impl fmt::Display for Coords<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, r) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{r}")?;
        }
        f.write_str("}")
    }
}

impl AsyncOp {
    /// Checks the operands against the instruction's form: register classes, immediate ranges,
    /// the coordinate count of a TMA copy, the accumulator length and transposes of a `wgmma`.
    pub fn validate(&self) -> Result<()> {
        use RegClass::{Pred, B32, B64};
        match self {
            AsyncOp::MbarrierInit { bar, count } => {
                const I: &str = "mbarrier.init";
                want(I, "the mbarrier", *bar, B32)?;
                want_u32(I, "the count", *count, 1, MBARRIER_MAX_COUNT)
            }
            AsyncOp::MbarrierArriveExpectTx { bar, tx_bytes } => {
                const I: &str = "mbarrier.arrive.expect_tx";
                want(I, "the mbarrier", *bar, B32)?;
                want_u32(I, "the transaction bytes", *tx_bytes, 0, MBARRIER_MAX_COUNT)
            }
            AsyncOp::MbarrierArrive { bar } => want("mbarrier.arrive", "the mbarrier", *bar, B32),
            AsyncOp::CpAsync4 { dst, src } => {
                want("cp.async", "the destination", *dst, B32)?;
                want("cp.async", "the source", *src, B64)
            }
            AsyncOp::CpAsyncMbarrierArriveNoinc { bar } => {
                want("cp.async.mbarrier.arrive", "the mbarrier", *bar, B32)
            }
            AsyncOp::MbarrierArriveCluster { bar } => {
                want("mbarrier.arrive", "the mbarrier", *bar, B32)
            }
            AsyncOp::MbarrierTryWaitParity { p, bar, parity } => {
                const I: &str = "mbarrier.try_wait.parity";
                want(I, "the result", *p, Pred)?;
                want(I, "the mbarrier", *bar, B32)?;
                want_u32(I, "the parity", *parity, 0, 1)
            }
            AsyncOp::Mapa { d, a, cta } => {
                want("mapa", "the destination", *d, B32)?;
                want("mapa", "the address", *a, B32)?;
                want_u32("mapa", "the CTA rank", *cta, 0, 15)
            }
            AsyncOp::ParamAddr { d, param } => {
                want("mov.u64", "the destination", *d, B64)?;
                if is_ident(param) {
                    Ok(())
                } else {
                    Err(bad("mov.u64", format!("`{param}` is not a PTX identifier")))
                }
            }
            AsyncOp::CvtaParam { d, a } => {
                want("cvta.param", "the destination", *d, B64)?;
                want("cvta.param", "the address", *a, B64)
            }
            AsyncOp::PrefetchTensorMap { tmap } => {
                want("prefetch.tensormap", "the tensor map", *tmap, B64)
            }
            AsyncOp::TmaLoad(t) => {
                const I: &str = "cp.async.bulk.tensor";
                want(I, "the destination", t.dst, B32)?;
                want(I, "the tensor map", t.tmap, B64)?;
                want(I, "the mbarrier", t.bar, B32)?;
                if let Some(h) = t.cache_hint {
                    want(I, "the cache policy", h, B64)?;
                }
                coords_ok(I, t.dim, &t.coords)
            }
            AsyncOp::TmaPrefetch { dim, tmap, coords } => {
                const I: &str = "cp.async.bulk.prefetch.tensor";
                want(I, "the tensor map", *tmap, B64)?;
                coords_ok(I, *dim, coords)
            }
            AsyncOp::TmaStore {
                dim,
                tmap,
                coords,
                src,
            } => {
                const I: &str = "cp.async.bulk.tensor";
                want(I, "the tensor map", *tmap, B64)?;
                want(I, "the source", *src, B32)?;
                coords_ok(I, *dim, coords)
            }
            AsyncOp::Wgmma(w) => w.validate(),
            AsyncOp::PackB64 { d, lo, hi } => {
                want("mov.b64", "the destination", *d, B64)?;
                want("mov.b64", "the low half", *lo, B32)?;
                want("mov.b64", "the high half", *hi, B32)
            }
            AsyncOp::ElectSync { d, p, .. } => {
                if let Some(d) = d {
                    want("elect.sync", "the leader's lane", *d, B32)?;
                }
                want("elect.sync", "the predicate", *p, Pred)
            }
            AsyncOp::Bar { count, .. } => match count {
                Some(n) if *n == 0 || !n.is_multiple_of(32) => Err(bad(
                    "bar.sync",
                    format!("a thread count of {n} is not a positive multiple of 32"),
                )),
                _ => Ok(()),
            },
            AsyncOp::FenceMbarrierInit
            | AsyncOp::FenceProxyAsyncShared
            | AsyncOp::BarrierClusterArrive
            | AsyncOp::BarrierClusterWait
            | AsyncOp::BulkCommitGroup
            | AsyncOp::BulkWaitGroupRead(_)
            | AsyncOp::WgmmaFence
            | AsyncOp::WgmmaCommitGroup
            | AsyncOp::WgmmaWaitGroup(_)
            | AsyncOp::SetMaxNReg { .. } => Ok(()),
        }
    }
}

impl fmt::Display for AsyncOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AsyncOp::MbarrierInit { bar, count } => {
                write!(f, "mbarrier.init.shared::cta.b64 \t[{bar}], {count};")
            }
            AsyncOp::MbarrierArriveExpectTx { bar, tx_bytes } => write!(
                f,
                "mbarrier.arrive.expect_tx.shared::cta.b64 \t_, [{bar}], {tx_bytes};"
            ),
            AsyncOp::MbarrierArrive { bar } => {
                write!(f, "mbarrier.arrive.shared::cta.b64 \t_, [{bar}];")
            }
            AsyncOp::CpAsync4 { dst, src } => {
                write!(f, "cp.async.ca.shared.global \t[{dst}], [{src}], 4;")
            }
            AsyncOp::CpAsyncMbarrierArriveNoinc { bar } => {
                write!(
                    f,
                    "cp.async.mbarrier.arrive.noinc.shared::cta.b64 \t[{bar}];"
                )
            }
            AsyncOp::MbarrierArriveCluster { bar } => write!(
                f,
                "mbarrier.arrive.release.cluster.shared::cluster.b64 \t_, [{bar}];"
            ),
            AsyncOp::MbarrierTryWaitParity { p, bar, parity } => write!(
                f,
                "mbarrier.try_wait.parity.shared::cta.b64 \t{p}, [{bar}], {parity};"
            ),
            AsyncOp::FenceMbarrierInit => f.write_str("fence.mbarrier_init.release.cluster;"),
            AsyncOp::FenceProxyAsyncShared => f.write_str("fence.proxy.async.shared::cta;"),
            AsyncOp::Mapa { d, a, cta } => write!(f, "mapa.shared::cluster.u32 \t{d}, {a}, {cta};"),
            AsyncOp::BarrierClusterArrive => f.write_str("barrier.cluster.arrive.release.aligned;"),
            AsyncOp::BarrierClusterWait => f.write_str("barrier.cluster.wait.acquire.aligned;"),
            AsyncOp::ParamAddr { d, param } => write!(f, "mov.u64 \t{d}, {param};"),
            AsyncOp::CvtaParam { d, a } => write!(f, "cvta.param.u64 \t{d}, {a};"),
            AsyncOp::PrefetchTensorMap { tmap } => write!(f, "prefetch.tensormap \t[{tmap}];"),
            AsyncOp::TmaLoad(t) => {
                let hint = if t.cache_hint.is_some() {
                    ".L2::cache_hint"
                } else {
                    ""
                };
                write!(
                    f,
                    "cp.async.bulk.tensor{}.shared::cluster.global.mbarrier::complete_tx::bytes{hint} \t[{}], [{}, {}], [{}]",
                    t.dim,
                    t.dst,
                    t.tmap,
                    Coords(&t.coords),
                    t.bar
                )?;
                if let Some(h) = t.cache_hint {
                    write!(f, ", {h}")?;
                }
                f.write_str(";")
            }
            AsyncOp::TmaPrefetch { dim, tmap, coords } => write!(
                f,
                "cp.async.bulk.prefetch.tensor{dim}.L2.global \t[{tmap}, {}];",
                Coords(coords)
            ),
            AsyncOp::TmaStore {
                dim,
                tmap,
                coords,
                src,
            } => write!(
                f,
                "cp.async.bulk.tensor{dim}.global.shared::cta.bulk_group \t[{tmap}, {}], [{src}];",
                Coords(coords)
            ),
            AsyncOp::BulkCommitGroup => f.write_str("cp.async.bulk.commit_group;"),
            AsyncOp::BulkWaitGroupRead(n) => write!(f, "cp.async.bulk.wait_group.read \t{n};"),
            AsyncOp::WgmmaFence => f.write_str("wgmma.fence.sync.aligned;"),
            AsyncOp::WgmmaCommitGroup => f.write_str("wgmma.commit_group.sync.aligned;"),
            AsyncOp::WgmmaWaitGroup(n) => write!(f, "wgmma.wait_group.sync.aligned \t{n};"),
            AsyncOp::Wgmma(w) => write!(f, "{w}"),
            AsyncOp::PackB64 { d, lo, hi } => write!(f, "mov.b64 \t{d}, {{{lo}, {hi}}};"),
            AsyncOp::SetMaxNReg { delta, count } => {
                let delta = match delta {
                    RegDelta::Inc => "inc",
                    RegDelta::Dec => "dec",
                };
                write!(f, "setmaxnreg.{delta}.sync.aligned.u32 \t{};", count.get())
            }
            AsyncOp::ElectSync { d, p, mask } => match d {
                Some(d) => write!(f, "elect.sync \t{d}|{p}, {mask:#x};"),
                None => write!(f, "elect.sync \t_|{p}, {mask:#x};"),
            },
            AsyncOp::Bar { id, count: None } => write!(f, "bar.sync \t{};", id.get()),
            AsyncOp::Bar { id, count: Some(n) } => write!(f, "bar.sync \t{}, {n};", id.get()),
        }
    }
}

impl From<AsyncOp> for Inst {
    fn from(op: AsyncOp) -> Inst {
        Inst::Async { guard: None, op }
    }
}

impl Builder {
    /// Declare a `.shared` variable (printed by [`Builder::decls`], after the registers).
    ///
    /// Errors: a variable of that name was already declared.
    pub fn declare_shared(&mut self, decl: SharedDecl) -> Result<()> {
        if self.shared.iter().any(|d| d.name() == decl.name()) {
            return Err(bad(
                ".shared",
                format!("`{}` is declared twice", decl.name()),
            ));
        }
        self.shared.push(decl);
        Ok(())
    }

    /// `mov.u32 r, NAME`: the 32-bit shared-window address of a shared variable (a fresh register).
    pub fn shared_addr(&mut self, name: &str) -> Reg {
        let d = self.reg(RegClass::B32);
        self.push(Inst::MovSym {
            d,
            sym: name.to_string(),
        });
        d
    }

    /// Validate `op` ([`AsyncOp::validate`]) and append it.
    pub fn emit(&mut self, op: AsyncOp) -> Result<()> {
        op.validate()?;
        self.push(op.into());
        Ok(())
    }

    /// Validate `op` and append it under `guard`.
    ///
    /// Errors: as [`AsyncOp::validate`], or a guard that is not a predicate register.
    pub fn emit_guarded(&mut self, guard: Guard, op: AsyncOp) -> Result<()> {
        want("guard", "a guard", guard.pred, RegClass::Pred)?;
        op.validate()?;
        self.push(Inst::Async {
            guard: Some(guard),
            op,
        });
        Ok(())
    }

    /// `mov.u64 a, PARAM; cvta.param.u64 t, a`: the generic address of a tensor-map parameter
    /// (what `prefetch.tensormap` and `cp.async.bulk.tensor` take).
    pub fn tensor_map_addr(&mut self, param: &str) -> Result<Reg> {
        let a = self.reg(RegClass::B64);
        self.emit(AsyncOp::ParamAddr {
            d: a,
            param: param.to_string(),
        })?;
        let t = self.reg(RegClass::B64);
        self.emit(AsyncOp::CvtaParam { d: t, a })?;
        Ok(t)
    }

    /// The wait loop on an mbarrier phase:
    /// `L: mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity; @!p bra L;`.
    pub fn mbarrier_wait(&mut self, bar: Reg, parity: Operand) -> Result<()> {
        let label = self.label("mbar_wait");
        let p = self.reg(RegClass::Pred);
        let op = AsyncOp::MbarrierTryWaitParity { p, bar, parity };
        op.validate()?;
        self.push(Inst::Label(label.clone()));
        self.push(op.into());
        self.push(Inst::Bra {
            label,
            pred: Some((p, true)),
        });
        Ok(())
    }

    /// `N/2` fresh f32 registers: a `wgmma` accumulator of shape `m64nN`.
    pub fn accumulator(&mut self, n: WgmmaN) -> Vec<Reg> {
        (0..n.accumulators())
            .map(|_| self.reg(RegClass::F32))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(class: RegClass, n: u32) -> Reg {
        Reg { class, n }
    }
    fn b32(n: u32) -> Reg {
        r(RegClass::B32, n)
    }
    fn b64(n: u32) -> Reg {
        r(RegClass::B64, n)
    }
    fn pred(n: u32) -> Reg {
        r(RegClass::Pred, n)
    }
    fn f32s(n: u32) -> Vec<Reg> {
        (0..n).map(|i| r(RegClass::F32, i)).collect()
    }

    /// One statement with its spacing normalized: no whitespace around `,` `|` `{` `}`, runs of
    /// other whitespace as one space. The hand-written examples use both `a,b` and `a, b`.
    fn norm(s: &str) -> String {
        let words: Vec<&str> = s.split_whitespace().collect();
        let mut out = words.join(" ");
        for c in [",", "|", "{", "}"] {
            out = out
                .replace(&format!(" {c}"), c)
                .replace(&format!("{c} "), c);
        }
        out
    }

    /// The printed instruction is the example's statement (`example` is quoted verbatim from
    /// `gemm-examples/`, one statement of the line).
    #[track_caller]
    fn same(inst: impl Into<Inst>, example: &str) {
        let inst = inst.into();
        if let Inst::Async { op, .. } = &inst {
            op.validate().unwrap();
        }
        let got = inst.to_string();
        assert!(got.starts_with('\t'), "{got:?}");
        assert_eq!(norm(&got), norm(example), "\n got: {got}\nwant: {example}");
    }

    fn guarded(p: u32, negate: bool, op: AsyncOp) -> Inst {
        Inst::Async {
            guard: Some(Guard {
                pred: pred(p),
                negate,
            }),
            op,
        }
    }

    #[test]
    fn shared_declarations_print_as_the_examples() {
        // sm90_bf16_generated.ptx line 7:
        // `.shared .align 1024 .b8 sA[8192];.shared .align 1024 .b8 sB[16384];.shared .align 8 .b64 bar;`
        let sa = SharedDecl::array("sA", SharedTy::B8, 8192, 1024).unwrap();
        assert_eq!(sa.to_string(), "\t.shared .align 1024 .b8 \tsA[8192];");
        same_decl(&sa, ".shared .align 1024 .b8 sA[8192];");
        same_decl(
            &SharedDecl::array("sB", SharedTy::B8, 16384, 1024).unwrap(),
            ".shared .align 1024 .b8 sB[16384];",
        );
        same_decl(
            &SharedDecl::scalar("bar", SharedTy::B64, 8).unwrap(),
            ".shared .align 8 .b64 bar;",
        );
        // sm90_misc_syntax.ptx: `.shared .align 128 .b8 sTmap[128];`
        same_decl(
            &SharedDecl::array("sTmap", SharedTy::B8, 128, 128).unwrap(),
            ".shared .align 128 .b8 sTmap[128];",
        );
        assert_eq!(sa.bytes(), 8192);
        assert_eq!(sa.align(), 1024);
    }

    fn same_decl(d: &SharedDecl, example: &str) {
        assert_eq!(norm(&d.to_string()), norm(example));
    }

    #[test]
    fn malformed_shared_declarations_are_refused() {
        assert!(matches!(
            SharedDecl::array("sA", SharedTy::B8, 8192, 1000),
            Err(Error::Inst {
                inst: ".shared",
                ..
            })
        ));
        assert!(SharedDecl::scalar("bar", SharedTy::B64, 4).is_err());
        assert!(SharedDecl::array("sA", SharedTy::B8, 0, 1024).is_err());
        assert!(SharedDecl::array("1sA", SharedTy::B8, 8, 8).is_err());
        let mut b = Builder::default();
        b.declare_shared(SharedDecl::scalar("bar", SharedTy::B64, 8).unwrap())
            .unwrap();
        assert!(b
            .declare_shared(SharedDecl::array("bar", SharedTy::B8, 8, 8).unwrap())
            .is_err());
    }

    #[test]
    fn builder_prints_shared_after_registers_and_shared_addresses() {
        let mut b = Builder::default();
        b.declare_shared(SharedDecl::array("sA", SharedTy::B8, 8192, 1024).unwrap())
            .unwrap();
        b.declare_shared(SharedDecl::scalar("bar", SharedTy::B64, 8).unwrap())
            .unwrap();
        let a = b.shared_addr("bar");
        assert_eq!(a, b32(1));
        assert_eq!(
            b.decls(),
            "\t.reg .b32 \t%r<2>;\n\t.shared .align 1024 .b8 \tsA[8192];\n\t.shared .align 8 .b64 \tbar;\n"
        );
        // sm90_bf16_generated.ptx line 8: `mov.u32 %r1,bar;`
        assert_eq!(norm(&b.insts[0].to_string()), norm("mov.u32 %r1,bar;"));
    }

    #[test]
    fn mbarrier_and_fences_print_as_the_examples() {
        // sm90_bf16_generated.ptx line 8: `@%p0 mbarrier.init.shared::cta.b64 [%r1],1;`
        same(
            guarded(
                0,
                false,
                AsyncOp::MbarrierInit {
                    bar: b32(1),
                    count: Operand::Int(1),
                },
            ),
            "@%p0 mbarrier.init.shared::cta.b64 [%r1],1;",
        );
        // line 8: `@%p0 fence.mbarrier_init.release.cluster;`
        same(
            guarded(0, false, AsyncOp::FenceMbarrierInit),
            "@%p0 fence.mbarrier_init.release.cluster;",
        );
        // line 11: `@%p0 mbarrier.arrive.expect_tx.shared::cta.b64 _,[%r1],24576;`
        same(
            guarded(
                0,
                false,
                AsyncOp::MbarrierArriveExpectTx {
                    bar: b32(1),
                    tx_bytes: Operand::Int(24576),
                },
            ),
            "@%p0 mbarrier.arrive.expect_tx.shared::cta.b64 _,[%r1],24576;",
        );
        // line 15: `mbarrier.try_wait.parity.shared::cta.b64 %p1,[%r1],%r10;`
        same(
            AsyncOp::MbarrierTryWaitParity {
                p: pred(1),
                bar: b32(1),
                parity: Operand::Reg(b32(10)),
            },
            "mbarrier.try_wait.parity.shared::cta.b64 %p1,[%r1],%r10;",
        );
        // sm90_warpspec_syntax.ptx: `@%p5 mbarrier.arrive.shared::cta.b64 _, [%r3];`
        same(
            guarded(5, false, AsyncOp::MbarrierArrive { bar: b32(3) }),
            "@%p5 mbarrier.arrive.shared::cta.b64 _, [%r3];",
        );
        // sm90_warpspec_syntax.ptx: `fence.proxy.async.shared::cta;`
        same(
            AsyncOp::FenceProxyAsyncShared,
            "fence.proxy.async.shared::cta;",
        );
        // sm90_misc_syntax.ptx: `mapa.shared::cluster.u32 %r6, %r1, 1;`
        same(
            AsyncOp::Mapa {
                d: b32(6),
                a: b32(1),
                cta: Operand::Int(1),
            },
            "mapa.shared::cluster.u32 %r6, %r1, 1;",
        );
        // `mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%r6];`
        same(
            AsyncOp::MbarrierArriveCluster { bar: b32(6) },
            "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%r6];",
        );
        // `barrier.cluster.arrive.release.aligned;` / `barrier.cluster.wait.acquire.aligned;`
        same(
            AsyncOp::BarrierClusterArrive,
            "barrier.cluster.arrive.release.aligned;",
        );
        same(
            AsyncOp::BarrierClusterWait,
            "barrier.cluster.wait.acquire.aligned;",
        );
    }

    #[test]
    fn the_wait_loop_is_the_examples_idiom() {
        // sm90_bf16_generated.ptx lines 14-16:
        // `W:` / `mbarrier.try_wait.parity.shared::cta.b64 %p1,[%r1],%r10;` / `@!%p1 bra W;`
        let mut b = Builder::default();
        let bar = b.reg(RegClass::B32);
        let phase = b.reg(RegClass::B32);
        b.mbarrier_wait(bar, Operand::Reg(phase)).unwrap();
        let text: Vec<String> = b.insts.iter().map(|i| norm(&i.to_string())).collect();
        assert_eq!(
            text,
            [
                "$L_mbar_wait_1:",
                "mbarrier.try_wait.parity.shared::cta.b64 %p1,[%r1],%r2;",
                "@!%p1 bra $L_mbar_wait_1;",
            ]
        );
        assert!(b.mbarrier_wait(bar, Operand::Int(2)).is_err());
    }

    #[test]
    fn tma_prints_as_the_examples() {
        // sm90_bf16_generated.ptx line 8:
        // `mov.u64 %rd0,tA;` `cvta.param.u64 %rd0,%rd0;` `@%p0 prefetch.tensormap [%rd0];`
        same(
            AsyncOp::ParamAddr {
                d: b64(0),
                param: "tA".into(),
            },
            "mov.u64 %rd0,tA;",
        );
        same(
            AsyncOp::CvtaParam {
                d: b64(0),
                a: b64(0),
            },
            "cvta.param.u64 %rd0,%rd0;",
        );
        same(
            guarded(0, false, AsyncOp::PrefetchTensorMap { tmap: b64(0) }),
            "@%p0 prefetch.tensormap [%rd0];",
        );
        // line 12:
        let load = TmaLoad {
            dim: TmaDim::D2,
            dst: b32(2),
            tmap: b64(0),
            coords: vec![b32(12), b32(13)],
            bar: b32(1),
            cache_hint: None,
        };
        same(
            guarded(0, false, AsyncOp::TmaLoad(load.clone())),
            "@%p0 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r2],[%rd0,{%r12,%r13}],[%r1];",
        );
        // sm90_warpspec_syntax.ptx:
        same(
            AsyncOp::TmaLoad(TmaLoad {
                dst: b32(4),
                coords: vec![b32(6), b32(7)],
                bar: b32(2),
                cache_hint: Some(b64(9)),
                ..load.clone()
            }),
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%r4], [%rd0, {%r6, %r7}], [%r2], %rd9;",
        );
        // The 3d form (GEMM.md §1.2: batched/masked maps): the same with three coordinates.
        let three = AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D3,
            coords: vec![b32(12), b32(13), b32(14)],
            ..load.clone()
        });
        three.validate().unwrap();
        assert_eq!(
            norm(&three.to_string()),
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%r2],[%rd0,{%r12,%r13,%r14}],[%r1];"
        );
        // sm90_misc_syntax.ptx: `cp.async.bulk.prefetch.tensor.2d.L2.global [%rd0, {%r4, %r5}];`
        same(
            AsyncOp::TmaPrefetch {
                dim: TmaDim::D2,
                tmap: b64(0),
                coords: vec![b32(4), b32(5)],
            },
            "cp.async.bulk.prefetch.tensor.2d.L2.global [%rd0, {%r4, %r5}];",
        );
        // sm90_warpspec_syntax.ptx: the TMA store and its bulk group.
        same(
            guarded(
                5,
                false,
                AsyncOp::TmaStore {
                    dim: TmaDim::D2,
                    tmap: b64(0),
                    coords: vec![b32(6), b32(7)],
                    src: b32(4),
                },
            ),
            "@%p5 cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd0, {%r6, %r7}], [%r4];",
        );
        same(
            guarded(5, false, AsyncOp::BulkCommitGroup),
            "@%p5 cp.async.bulk.commit_group;",
        );
        same(
            guarded(5, false, AsyncOp::BulkWaitGroupRead(0)),
            "@%p5 cp.async.bulk.wait_group.read 0;",
        );
    }

    #[test]
    fn malformed_tma_is_refused() {
        let load = TmaLoad {
            dim: TmaDim::D3,
            dst: b32(2),
            tmap: b64(0),
            coords: vec![b32(12), b32(13)],
            bar: b32(1),
            cache_hint: None,
        };
        let e = AsyncOp::TmaLoad(load.clone()).validate().unwrap_err();
        assert!(e.to_string().contains("3 coordinates, got 2"), "{e}");
        let e = AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D2,
            tmap: b32(0),
            ..load.clone()
        })
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("tensor map"), "{e}");
        assert!(AsyncOp::MbarrierArriveExpectTx {
            bar: b32(1),
            tx_bytes: Operand::Int(1 << 20)
        }
        .validate()
        .is_err());
        assert!(AsyncOp::MbarrierInit {
            bar: b64(1),
            count: Operand::Int(1)
        }
        .validate()
        .is_err());
        let mut b = Builder::default();
        assert!(b
            .emit_guarded(Guard::when(b32(0)), AsyncOp::WgmmaFence)
            .is_err());
        assert!(b.insts.is_empty());
    }

    #[test]
    fn wgmma_prints_as_the_examples() {
        let n128 = WgmmaN::new(128).unwrap();
        // sm90_bf16_generated.ptx lines 17 and 19:
        same(AsyncOp::WgmmaFence, "wgmma.fence.sync.aligned;");
        same(
            AsyncOp::PackB64 {
                d: b64(2),
                lo: b32(7),
                hi: b32(6),
            },
            "mov.b64 %rd2,{%r7,%r6};",
        );
        same(
            AsyncOp::Wgmma(Wgmma::ss(
                n128,
                WgmmaTy::Bf16,
                f32s(64),
                b64(2),
                b64(3),
                ScaleD::Pred(pred(2)),
            )),
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f0,%f1,%f2,%f3,%f4,%f5,%f6,%f7,%f8,%f9,%f10,%f11,%f12,%f13,%f14,%f15,%f16,%f17,%f18,%f19,%f20,%f21,%f22,%f23,%f24,%f25,%f26,%f27,%f28,%f29,%f30,%f31,%f32,%f33,%f34,%f35,%f36,%f37,%f38,%f39,%f40,%f41,%f42,%f43,%f44,%f45,%f46,%f47,%f48,%f49,%f50,%f51,%f52,%f53,%f54,%f55,%f56,%f57,%f58,%f59,%f60,%f61,%f62,%f63},%rd2,%rd3,%p2,1,1,0,0;",
        );
        // line 26: `wgmma.commit_group.sync.aligned;wgmma.wait_group.sync.aligned 0;bar.sync 0;`
        same(
            AsyncOp::WgmmaCommitGroup,
            "wgmma.commit_group.sync.aligned;",
        );
        same(
            AsyncOp::WgmmaWaitGroup(0),
            "wgmma.wait_group.sync.aligned 0;",
        );
        same(
            AsyncOp::Bar {
                id: BarrierId::new(0).unwrap(),
                count: None,
            },
            "bar.sync 0;",
        );
        // sm90_e4m3_generated.ptx line 19:
        same(
            AsyncOp::Wgmma(Wgmma::ss(
                n128,
                WgmmaTy::E4m3,
                f32s(64),
                b64(2),
                b64(3),
                ScaleD::Pred(pred(2)),
            )),
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f0,%f1,%f2,%f3,%f4,%f5,%f6,%f7,%f8,%f9,%f10,%f11,%f12,%f13,%f14,%f15,%f16,%f17,%f18,%f19,%f20,%f21,%f22,%f23,%f24,%f25,%f26,%f27,%f28,%f29,%f30,%f31,%f32,%f33,%f34,%f35,%f36,%f37,%f38,%f39,%f40,%f41,%f42,%f43,%f44,%f45,%f46,%f47,%f48,%f49,%f50,%f51,%f52,%f53,%f54,%f55,%f56,%f57,%f58,%f59,%f60,%f61,%f62,%f63},%rd2,%rd3,%p2,1,1;",
        );
        // sm90_rs_generated.ptx line 35 (A from registers):
        same(
            AsyncOp::Wgmma(Wgmma::rs(
                n128,
                WgmmaTy::Bf16,
                f32s(64),
                [b32(44), b32(45), b32(46), b32(47)],
                b64(3),
                ScaleD::Pred(pred(2)),
            )),
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f0,%f1,%f2,%f3,%f4,%f5,%f6,%f7,%f8,%f9,%f10,%f11,%f12,%f13,%f14,%f15,%f16,%f17,%f18,%f19,%f20,%f21,%f22,%f23,%f24,%f25,%f26,%f27,%f28,%f29,%f30,%f31,%f32,%f33,%f34,%f35,%f36,%f37,%f38,%f39,%f40,%f41,%f42,%f43,%f44,%f45,%f46,%f47,%f48,%f49,%f50,%f51,%f52,%f53,%f54,%f55,%f56,%f57,%f58,%f59,%f60,%f61,%f62,%f63},{%r44,%r45,%r46,%r47},%rd3,%p2,1,1,0;",
        );
        // sm90_warpspec_syntax.ptx (a constant scale-d):
        same(
            AsyncOp::Wgmma(Wgmma::ss(
                n128,
                WgmmaTy::Bf16,
                f32s(64),
                b64(2),
                b64(2),
                ScaleD::Imm(false),
            )),
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f0,%f1,%f2,%f3,%f4,%f5,%f6,%f7,%f8,%f9,%f10,%f11,%f12,%f13,%f14,%f15,%f16,%f17,%f18,%f19,%f20,%f21,%f22,%f23,%f24,%f25,%f26,%f27,%f28,%f29,%f30,%f31,%f32,%f33,%f34,%f35,%f36,%f37,%f38,%f39,%f40,%f41,%f42,%f43,%f44,%f45,%f46,%f47,%f48,%f49,%f50,%f51,%f52,%f53,%f54,%f55,%f56,%f57,%f58,%f59,%f60,%f61,%f62,%f63}, %rd2, %rd2, 0, 1, 1, 0, 0;",
        );
    }

    #[test]
    fn every_wgmma_n_prints_its_accumulator_and_shape() {
        for n in (8..=256).step_by(8) {
            let wn = WgmmaN::new(n).unwrap();
            for ty in [WgmmaTy::Bf16, WgmmaTy::E4m3] {
                let w = AsyncOp::Wgmma(Wgmma::ss(
                    wn,
                    ty,
                    f32s(n / 2),
                    b64(2),
                    b64(3),
                    ScaleD::Imm(true),
                ));
                w.validate().unwrap();
                let text = w.to_string();
                let k = if ty == WgmmaTy::Bf16 { 16 } else { 32 };
                assert!(
                    text.starts_with(&format!(
                        "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32{ty}{ty} \t{{%f0, "
                    )),
                    "{text}"
                );
                assert!(text.contains(&format!("%f{}}}", n / 2 - 1)), "{text}");
                assert_eq!(text.matches("%f").count(), (n / 2) as usize);
            }
        }
    }

    #[test]
    fn malformed_wgmma_is_refused() {
        for n in [0, 4, 12, 100, 264, 512] {
            let e = WgmmaN::new(n).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Inst {
                        inst: "wgmma.mma_async",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains(&format!("N = {n}")), "{e}");
        }
        let n64 = WgmmaN::new(64).unwrap();
        let ok = Wgmma::ss(
            n64,
            WgmmaTy::Bf16,
            f32s(32),
            b64(2),
            b64(3),
            ScaleD::Imm(true),
        );
        AsyncOp::Wgmma(ok.clone()).validate().unwrap();
        let cases = [
            (
                Wgmma {
                    d: f32s(31),
                    ..ok.clone()
                },
                "needs 32 accumulator registers, got 31",
            ),
            (
                Wgmma {
                    d: (0..32).map(b32).collect(),
                    ..ok.clone()
                },
                "an accumulator",
            ),
            (
                Wgmma {
                    ty: WgmmaTy::E4m3,
                    trans_b: true,
                    ..ok.clone()
                },
                "K-major",
            ),
            (
                Wgmma {
                    a: WgmmaA::Regs([b32(1), b32(2), b32(3), b32(4)]),
                    trans_a: true,
                    ..ok.clone()
                },
                "cannot be transposed",
            ),
            (
                Wgmma {
                    a: WgmmaA::Regs([b32(1), b32(2), b32(3), b64(4)]),
                    ..ok.clone()
                },
                "A's fragment",
            ),
            (
                Wgmma {
                    b: b32(3),
                    ..ok.clone()
                },
                "B's descriptor",
            ),
            (
                Wgmma {
                    scale_d: ScaleD::Pred(b32(1)),
                    ..ok.clone()
                },
                "scale-d",
            ),
        ];
        for (w, why) in cases {
            let e = AsyncOp::Wgmma(w).validate().unwrap_err();
            assert!(e.to_string().contains(why), "{e} (want {why})");
        }
        // Transposes and negation print where the form has them.
        let t = Wgmma {
            scale_a: ImmScale::MinusOne,
            trans_a: true,
            trans_b: true,
            ..ok
        };
        assert!(t.to_string().ends_with("}, %rd2, %rd3, 1, -1, 1, 1, 1;"));
    }

    #[test]
    fn setmaxnreg_elect_and_named_barriers_print_as_the_examples() {
        // sm90_warpspec_syntax.ptx:
        same(
            AsyncOp::SetMaxNReg {
                delta: RegDelta::Dec,
                count: MaxNReg::new(40).unwrap(),
            },
            "setmaxnreg.dec.sync.aligned.u32 40;",
        );
        same(
            AsyncOp::SetMaxNReg {
                delta: RegDelta::Inc,
                count: MaxNReg::new(232).unwrap(),
            },
            "setmaxnreg.inc.sync.aligned.u32 232;",
        );
        same(
            AsyncOp::ElectSync {
                d: Some(b32(5)),
                p: pred(2),
                mask: 0xffff_ffff,
            },
            "elect.sync %r5|%p2, 0xffffffff;",
        );
        same(
            AsyncOp::Bar {
                id: BarrierId::new(1).unwrap(),
                count: Some(256),
            },
            "bar.sync 1, 256;",
        );
        assert_eq!(
            norm(
                &AsyncOp::ElectSync {
                    d: None,
                    p: pred(2),
                    mask: 0xffff_ffff
                }
                .to_string()
            ),
            "elect.sync _|%p2,0xffffffff;"
        );
    }

    #[test]
    fn malformed_setmaxnreg_elect_and_barriers_are_refused() {
        for n in [0, 16, 20, 41, 236, 264] {
            let e = MaxNReg::new(n).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Inst {
                        inst: "setmaxnreg",
                        ..
                    }
                ),
                "{e}"
            );
        }
        for n in (24..=256).step_by(8) {
            assert_eq!(MaxNReg::new(n).unwrap().get(), n);
        }
        assert!(BarrierId::new(16).is_err());
        assert_eq!(BarrierId::new(15).unwrap().get(), 15);
        for count in [0, 100] {
            assert!(AsyncOp::Bar {
                id: BarrierId::new(1).unwrap(),
                count: Some(count),
            }
            .validate()
            .is_err());
        }
        assert!(AsyncOp::ElectSync {
            d: Some(pred(1)),
            p: pred(2),
            mask: 1
        }
        .validate()
        .is_err());
    }
}
