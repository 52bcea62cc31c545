//! The typed IR of a recipe: tensors and values in arenas addressed by typed ids (`t3`, `v7`),
//! shapes as symbolic polynomials, views as symbolic layouts over one param's storage.

use std::fmt;

use crate::ast::Span;
use crate::layout::Swizzle;
use crate::poly::{Atoms, Poly};

/// Index of a tensor (input, param, view or let) in [`Module::tensors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

/// Index of a value (expression node) in [`Module::values`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// FP8 E4M3 (`float8_e4m3fn`).
    E4m3,
    /// FP8 E5M2.
    E5m2,
    /// FP4 E2M1, packed two per byte (element 2j in the low nibble).
    E2m1,
    /// E8M0 power-of-two scale.
    E8m0,
    /// Unsigned 4-bit integer, packed two per byte (element 2j in the low nibble): group-wise INT4
    /// codes and zero points.
    U4,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 32-bit integer.
    I32,
}

impl DType {
    /// All dtypes, in the language's spelling order.
    pub const ALL: [DType; 11] = [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::E4m3,
        DType::E5m2,
        DType::E2m1,
        DType::E8m0,
        DType::U4,
        DType::I8,
        DType::U8,
        DType::I32,
    ];

    /// The name as written in recipes.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::E4m3 => "e4m3",
            DType::E5m2 => "e5m2",
            DType::E2m1 => "e2m1",
            DType::E8m0 => "e8m0",
            DType::U4 => "u4",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
        }
    }

    /// Parse a dtype name.
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Storage bits per element.
    pub fn bits(self) -> u32 {
        match self {
            DType::E2m1 | DType::U4 => 4,
            DType::E4m3 | DType::E5m2 | DType::E8m0 | DType::I8 | DType::U8 => 8,
            DType::Bf16 | DType::F16 => 16,
            DType::F32 | DType::I32 => 32,
        }
    }

    /// Whether elements are 4 bits, stored two per byte (element 2j in the low nibble).
    pub fn is_packed4(self) -> bool {
        self.bits() == 4
    }

    /// Whether values of this type can be quantized (a real-valued input).
    pub fn is_wide_float(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16 | DType::F32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The process group an amax reduction runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// No reduction: this process's values only.
    None,
    /// The shards of a dense tensor-parallel weight.
    Tp,
    /// The ranks that split one expert's tensors (the EP group when EP is off; one rank when on).
    MoeTp,
    /// The ranks holding different experts (activation scales, when EPLB is on).
    Ep,
}

impl Group {
    /// The name as written in recipes.
    pub fn name(self) -> &'static str {
        match self {
            Group::None => "none",
            Group::Tp => "tp",
            Group::MoeTp => "moe_tp",
            Group::Ep => "ep",
        }
    }

    /// Parse a group name.
    pub fn from_name(s: &str) -> Option<Group> {
        [Group::None, Group::Tp, Group::MoeTp, Group::Ep]
            .into_iter()
            .find(|g| g.name() == s)
    }
}

/// Over which elements an amax is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AmaxGranularity {
    /// One amax per expert (the whole per-expert tensor).
    PerExpert,
    /// One amax over the whole tensor (all experts).
    PerTensor,
}

/// FP8 scale granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Granularity {
    /// One scale per expert tensor.
    Tensor,
    /// One scale per output row (channel).
    Channel,
    /// One scale per 128x128 block (DeepGEMM's `per_block_cast_to_fp8`).
    Block128,
    /// One scale per `group` consecutive elements of a row (along the last dimension): the
    /// per-channel formula per group (README, "Group-wise FP8").
    Group {
        /// Elements per group (a power of two, at least 2).
        group: i64,
    },
}

/// A quantization scheme with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// NVFP4: E2M1 values, an E4M3 scale per 16 elements, an FP32 global scale (SPEC §4).
    Nvfp4 {
        /// Global-scale amax granularity.
        amax: AmaxGranularity,
        /// Group the amax is reduced over.
        group: Group,
    },
    /// FP8 E4M3 with per-tensor, per-channel, 128x128 block or per-group scales (SPEC §5).
    Fp8 {
        /// Scale granularity.
        granularity: Fp8Granularity,
        /// Group the amax is reduced over (per-tensor scales).
        group: Group,
    },
    /// MXFP4: E2M1 values, an E8M0 scale per 32 elements (SPEC §7).
    Mxfp4,
    /// INT8 with one f32 scale per row (SPEC §8).
    Int8Row,
    /// Group-wise INT8: one f32 scale per `group` consecutive elements along the last dimension,
    /// SPEC §8's formula per group (README, "Group-wise INT8").
    Int8Group {
        /// Elements per group along the last dimension (a power of two, at least 2).
        group: i64,
    },
    /// Group-wise INT4 (W4A16, GPTQ/AWQ style): u4 codes, one scale (and, asymmetric, one u4 zero
    /// point) per `group` consecutive elements along the last dimension (README, "Group-wise INT4").
    Int4 {
        /// Elements per group along the last dimension (a power of two, at least 2).
        group: i64,
        /// Asymmetric (u4 zero points `z = rne(-min/s)`) rather than symmetric (`z = 8`).
        zero_point: bool,
        /// The scales' dtype (`bf16`, `f16` or `f32`); scales are rounded to it before the codes
        /// are computed.
        scale: DType,
    },
}

impl QuantScheme {
    /// The scheme's name.
    pub fn name(&self) -> &'static str {
        match self {
            QuantScheme::Nvfp4 { .. } => "nvfp4",
            QuantScheme::Fp8 { .. } => "fp8",
            QuantScheme::Mxfp4 => "mxfp4",
            QuantScheme::Int8Row | QuantScheme::Int8Group { .. } => "int8",
            QuantScheme::Int4 { .. } => "int4",
        }
    }
}

/// The outputs of a quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantField {
    /// The quantized codes.
    Values,
    /// The block / row / tensor scales.
    Scales,
    /// NVFP4's encode scale `gs = 2688 / amax`.
    GlobalScale,
    /// NVFP4's decode scale `1 / gs` (vLLM's `weight_scale_2`).
    DecodeScale,
    /// Group-wise INT4's u4 zero points (asymmetric only).
    Zeros,
}

impl QuantField {
    /// The field name as written.
    pub fn name(self) -> &'static str {
        match self {
            QuantField::Values => "values",
            QuantField::Scales => "scales",
            QuantField::GlobalScale => "global_scale",
            QuantField::DecodeScale => "decode_scale",
            QuantField::Zeros => "zeros",
        }
    }
}

/// A permutation of `[0, n)` used to reorder rows.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IndexVec {
    /// `arange(n)`.
    Identity(Poly),
    /// `swap_halves(n)`: `[n/2 .. n, 0 .. n/2]`.
    SwapHalves(Poly),
    /// `interleave(base, group = g)`: output `j = t*2g + h*g + r` takes `base[h*(n/2) + t*g + r]`.
    Interleave {
        /// The vector being interleaved.
        base: Box<IndexVec>,
        /// The group size.
        group: i64,
    },
}

impl IndexVec {
    /// The length.
    pub fn len(&self) -> &Poly {
        match self {
            IndexVec::Identity(n) | IndexVec::SwapHalves(n) => n,
            IndexVec::Interleave { base, .. } => base.len(),
        }
    }

    /// Whether the vector is empty at every binding (never: lengths are positive).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The source index of output position `j` for a vector of bound length (`n` evaluated).
    pub fn map(&self, j: i128, atoms: &[i128]) -> Option<i128> {
        match self {
            IndexVec::Identity(_) => Some(j),
            IndexVec::SwapHalves(n) => {
                let half = n.eval(atoms)? / 2;
                Some(if j < half { j + half } else { j - half })
            }
            IndexVec::Interleave { base, group } => {
                let n = base.len().eval(atoms)?;
                let g = *group as i128;
                let (t, rem) = (j / (2 * g), j % (2 * g));
                let (h, r) = (rem / g, rem % g);
                base.map(h * (n / 2) + t * g + r, atoms)
            }
        }
    }
}

/// A symbolic layout over one param's storage (element offsets): one entry per logical dimension,
/// each a list of `(shape, stride)` sub-modes in CuTe's colexicographic order, plus a base offset and
/// an optional swizzle applied last.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SymLayout {
    /// Top-level modes.
    pub dims: Vec<Vec<(Poly, Poly)>>,
    /// Base offset.
    pub offset: Poly,
    /// Swizzle applied to the final offset.
    pub swizzle: Option<Swizzle>,
}

impl SymLayout {
    /// The compact row-major layout of a shape.
    pub fn row_major(shape: &[Poly]) -> SymLayout {
        let mut dims = vec![Vec::new(); shape.len()];
        let mut acc = Poly::constant(1);
        for i in (0..shape.len()).rev() {
            dims[i] = vec![(shape[i].clone(), acc.clone())];
            acc = acc.mul(&shape[i]);
        }
        SymLayout {
            dims,
            offset: Poly::zero(),
            swizzle: None,
        }
    }

    /// The extent of each logical dimension.
    pub fn shape(&self) -> Vec<Poly> {
        self.dims
            .iter()
            .map(|d| d.iter().fold(Poly::constant(1), |a, (s, _)| a.mul(s)))
            .collect()
    }

    /// All sub-modes, flattened in order.
    pub fn leaves(&self) -> Vec<(Poly, Poly)> {
        self.dims.iter().flatten().cloned().collect()
    }

    /// Number of coordinates.
    pub fn size(&self) -> Poly {
        self.leaves()
            .iter()
            .fold(Poly::constant(1), |a, (s, _)| a.mul(s))
    }

    /// Printable in CuTe notation using the atom table.
    pub fn display<'a>(&'a self, atoms: &'a Atoms) -> SymLayoutDisplay<'a> {
        SymLayoutDisplay { l: self, atoms }
    }
}

/// Display adapter for [`SymLayout`].
pub struct SymLayoutDisplay<'a> {
    l: &'a SymLayout,
    atoms: &'a Atoms,
}

impl fmt::Display for SymLayoutDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(s) = &self.l.swizzle {
            write!(f, "{s} o ")?;
        }
        if !self.l.offset.is_const(0) {
            write!(f, "{} + ", self.l.offset.display(self.atoms))?;
        }
        let part = |f: &mut fmt::Formatter<'_>, which: usize| -> fmt::Result {
            let one = self.l.dims.len() == 1 && self.l.dims[0].len() == 1;
            if !one {
                write!(f, "(")?;
            }
            for (k, d) in self.l.dims.iter().enumerate() {
                if k > 0 {
                    write!(f, ",")?;
                }
                if d.len() != 1 {
                    write!(f, "(")?;
                }
                for (j, (s, st)) in d.iter().enumerate() {
                    if j > 0 {
                        write!(f, ",")?;
                    }
                    let p = if which == 0 { s } else { st };
                    write!(f, "{}", p.display(self.atoms))?;
                }
                if d.len() != 1 {
                    write!(f, ")")?;
                }
            }
            if !one {
                write!(f, ")")?;
            }
            Ok(())
        };
        part(f, 0)?;
        write!(f, ":")?;
        part(f, 1)
    }
}

/// What a tensor is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorKind {
    /// A checkpoint tensor.
    Input {
        /// Whether the checkpoint may lack it.
        optional: bool,
    },
    /// A registered, materialized, expert-major parameter (EPLB moves it).
    Param,
    /// An alias of one param.
    View {
        /// Span of the `bijective` claim, if any.
        bijective: Option<Span>,
    },
    /// An intermediate value.
    Let,
}

/// A named tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: TensorKind,
    /// Element type.
    pub dtype: DType,
    /// Logical shape (a param's storage shape).
    pub shape: Vec<Poly>,
    /// Definition (none for inputs).
    pub value: Option<ValueId>,
    /// Explicit storage layout declared for a param.
    pub declared_layout: Option<(SymLayout, Span)>,
    /// For a view: the param it aliases and the layout from view coordinates to that param's
    /// storage offsets (elements).
    pub alias: Option<(TensorId, SymLayout)>,
    /// Whether this tensor exists only when an optional input is present.
    pub optional: bool,
    /// The statement.
    pub span: Span,
    /// The name.
    pub name_span: Span,
}

/// Arithmetic operators on tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arith {
    /// Elementwise product (scalars broadcast).
    Mul,
    /// Elementwise quotient (scalars broadcast), IEEE correctly rounded.
    Div,
}

/// Value operations.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// A named tensor.
    Tensor(TensorId),
    /// An integer constant (as f32).
    Const(i64),
    /// A quantization (tuple-valued; read through [`Op::Field`]).
    Quant {
        /// Scheme.
        scheme: QuantScheme,
        /// The tensor quantized.
        input: ValueId,
    },
    /// One output of a quantization.
    Field {
        /// The quantization.
        quant: ValueId,
        /// Which output.
        field: QuantField,
    },
    /// Elementwise arithmetic.
    Arith {
        /// Operator.
        op: Arith,
        /// Left.
        lhs: ValueId,
        /// Right.
        rhs: ValueId,
    },
    /// Reorder along `dim` by an index vector (a copy).
    Gather {
        /// Source.
        base: ValueId,
        /// Dimension.
        dim: usize,
        /// Source index for each output position.
        index: IndexVec,
    },
    /// `[start, end)` along `dim`.
    Slice {
        /// Source.
        base: ValueId,
        /// Dimension.
        dim: usize,
        /// Start.
        start: Poly,
        /// End.
        end: Poly,
    },
    /// Fix one index along `dim`, dropping it.
    Select {
        /// Source.
        base: ValueId,
        /// Dimension.
        dim: usize,
        /// Index.
        index: Poly,
    },
    /// SPEC §1: zero-pad the last two dims to multiples of (128, 4), store in 128x4 tile order.
    Swizzle128x4 {
        /// Source `[.., M, K]` of 1-byte scales.
        base: ValueId,
    },
    /// SPEC §2: FlashInfer's MMA view of swizzled scale storage.
    MmaSfView {
        /// The swizzled scale param.
        base: ValueId,
    },
    /// Zero-pad each dimension up to a multiple.
    Pad {
        /// Source.
        base: ValueId,
        /// Multiple per dimension.
        multiples: Vec<i64>,
    },
    /// Row-major reshape.
    Reshape {
        /// Source.
        base: ValueId,
        /// New shape.
        shape: Vec<Poly>,
    },
    /// Permute dimensions.
    Permute {
        /// Source.
        base: ValueId,
        /// `out dim k = in dim perm[k]`.
        perm: Vec<usize>,
    },
    /// Reinterpret the storage through an explicit layout.
    Apply {
        /// Source.
        base: ValueId,
        /// The layout.
        layout: SymLayout,
    },
    /// Concatenate along `dim`.
    Cat {
        /// Parts.
        parts: Vec<ValueId>,
        /// Dimension.
        dim: usize,
    },
    /// Max over all elements, then MAX all-reduce over a group: a scalar.
    ReduceMax {
        /// Source.
        base: ValueId,
        /// Group.
        group: Group,
    },
    /// Broadcast a scalar to a shape.
    Broadcast {
        /// Source scalar.
        base: ValueId,
    },
}

impl Op {
    /// The operation's name, as written (for diagnostics).
    pub fn describe(&self) -> &'static str {
        match self {
            Op::Tensor(_) => "a tensor",
            Op::Const(_) => "a constant",
            Op::Quant { .. } => "a quantization",
            Op::Field { .. } => "a quantization output",
            Op::Arith { op: Arith::Mul, .. } => "`*`",
            Op::Arith { op: Arith::Div, .. } => "`/`",
            Op::Gather { .. } => "a row gather",
            Op::Slice { .. } => "a slice",
            Op::Select { .. } => "an index",
            Op::Swizzle128x4 { .. } => "`swizzle_128x4`",
            Op::MmaSfView { .. } => "`mma_sf_view`",
            Op::Pad { .. } => "`pad`",
            Op::Reshape { .. } => "`reshape`",
            Op::Permute { .. } => "`permute`",
            Op::Apply { .. } => "a layout",
            Op::Cat { .. } => "`cat`",
            Op::ReduceMax { .. } => "`reduce_max`",
            Op::Broadcast { .. } => "`broadcast`",
        }
    }

    /// Whether the operation only re-indexes existing storage (no arithmetic, no copy).
    pub fn is_layout_only(&self) -> bool {
        matches!(
            self,
            Op::Tensor(_)
                | Op::Slice { .. }
                | Op::Select { .. }
                | Op::MmaSfView { .. }
                | Op::Reshape { .. }
                | Op::Permute { .. }
                | Op::Apply { .. }
        )
    }

    /// The operands.
    pub fn operands(&self) -> Vec<ValueId> {
        match self {
            Op::Tensor(_) | Op::Const(_) => Vec::new(),
            Op::Quant { input, .. } => vec![*input],
            Op::Field { quant, .. } => vec![*quant],
            Op::Arith { lhs, rhs, .. } => vec![*lhs, *rhs],
            Op::Gather { base, .. }
            | Op::Slice { base, .. }
            | Op::Select { base, .. }
            | Op::Swizzle128x4 { base }
            | Op::MmaSfView { base }
            | Op::Pad { base, .. }
            | Op::Reshape { base, .. }
            | Op::Permute { base, .. }
            | Op::Apply { base, .. }
            | Op::ReduceMax { base, .. }
            | Op::Broadcast { base } => vec![*base],
            Op::Cat { parts, .. } => parts.clone(),
        }
    }
}

/// An expression node.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    /// Operation.
    pub op: Op,
    /// Element type (a quantization's own node reports its values' type).
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<Poly>,
    /// Source.
    pub span: Span,
}

/// Code-generation targets a kernel binding names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Hopper.
    Sm90a,
    /// Blackwell.
    Sm100a,
    /// The host CPU (Cranelift).
    Host,
}

impl Target {
    /// The name as written.
    pub fn name(self) -> &'static str {
        match self {
            Target::Sm90a => "sm_90a",
            Target::Sm100a => "sm_100a",
            Target::Host => "host",
        }
    }

    /// Whether the target is a GPU (PTX), not the host.
    pub fn is_gpu(self) -> bool {
        self != Target::Host
    }

    /// Parse a target name.
    pub fn from_name(s: &str) -> Option<Target> {
        [Target::Sm90a, Target::Sm100a, Target::Host]
            .into_iter()
            .find(|t| t.name() == s)
    }
}

/// Index width a kernel computes offsets in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexWidth {
    /// 32-bit offsets within one expert.
    I32,
    /// 64-bit offsets.
    I64,
}

/// `kernel NAME(OPERANDS) on TARGETS index W`.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelBinding {
    /// Name.
    pub name: String,
    /// Params and views read, with the span of each mention.
    pub operands: Vec<(TensorId, Span)>,
    /// Targets.
    pub targets: Vec<Target>,
    /// Index width and the span of its declaration.
    pub index: (IndexWidth, Option<Span>),
    /// Statement.
    pub span: Span,
}

/// A symbolic dimension of the recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct Dim {
    /// Name.
    pub name: String,
    /// Its value as a polynomial (`unit * atom`).
    pub poly: Poly,
    /// The divisor the where-clause guarantees.
    pub unit: i64,
    /// Lower bound (at least 1).
    pub min: i64,
    /// Upper bound, if declared.
    pub max: Option<i64>,
    /// Whether it counts experts.
    pub experts: bool,
    /// Declaration.
    pub span: Span,
}

/// A where-clause constraint, kept for bind-time checks.
#[derive(Debug, Clone, PartialEq)]
pub enum BindCheck {
    /// `poly % by == 0`.
    Divisible {
        /// The expression.
        poly: Poly,
        /// Divisor.
        by: i64,
        /// Source text of the constraint.
        text: String,
        /// Span.
        span: Span,
    },
    /// `dim OP value`.
    Bound {
        /// Dimension name.
        dim: String,
        /// Comparison.
        op: crate::ast::CmpOp,
        /// Bound.
        value: i64,
        /// Source text of the constraint.
        text: String,
        /// Span.
        span: Span,
    },
}

impl Tensor {
    /// The storage layout of a param or input: the declared one, else compact row-major.
    pub fn storage_layout(&self) -> SymLayout {
        match &self.declared_layout {
            Some((l, _)) => l.clone(),
            None => SymLayout::row_major(&self.shape),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> Poly {
        self.shape.iter().fold(Poly::constant(1), |a, s| a.mul(s))
    }
}

/// A lowered recipe.
#[derive(Debug, Clone)]
pub struct Module {
    /// Recipe name.
    pub name: String,
    /// Dimensions, in declaration order.
    pub dims: Vec<Dim>,
    /// Atom table for all polynomials.
    pub atoms: Atoms,
    /// Where-clause checks.
    pub checks: Vec<BindCheck>,
    /// Tensors, in definition order.
    pub tensors: Vec<Tensor>,
    /// Values.
    pub values: Vec<Value>,
    /// Kernel bindings.
    pub kernels: Vec<KernelBinding>,
    /// Where a later param shadows an input of the same name: (input, param).
    pub shadows: Vec<(TensorId, TensorId)>,
    /// The declared activation scheme and its statement (`None`: not declared, bf16).
    pub activation: Option<(Activation, Span)>,
}

impl Module {
    /// A tensor by id.
    pub fn tensor(&self, id: TensorId) -> Option<&Tensor> {
        self.tensors.get(id.0 as usize)
    }

    /// A value by id.
    pub fn value(&self, id: ValueId) -> Option<&Value> {
        self.values.get(id.0 as usize)
    }

    /// Iterate tensors with their ids.
    pub fn tensors_with_ids(&self) -> impl Iterator<Item = (TensorId, &Tensor)> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (TensorId(i as u32), t))
    }

    /// The last-defined tensor of a name (params shadow inputs).
    pub fn find(&self, name: &str) -> Option<TensorId> {
        self.tensors_with_ids()
            .filter(|(_, t)| t.name == name)
            .map(|(i, _)| i)
            .last()
    }

    /// The experts dimension.
    pub fn experts_dim(&self) -> Option<&Dim> {
        self.dims.iter().find(|d| d.experts)
    }

    /// Print a polynomial with this module's atoms.
    pub fn show(&self, p: &Poly) -> String {
        p.display(&self.atoms).to_string()
    }

    /// Print a shape `[E, 2*I, H]`.
    pub fn show_shape(&self, s: &[Poly]) -> String {
        let parts: Vec<String> = s.iter().map(|p| self.show(p)).collect();
        format!("[{}]", parts.join(", "))
    }

    /// All tensors a value reads, transitively through values (not through other tensors).
    pub fn tensors_read(&self, v: ValueId) -> Vec<TensorId> {
        let mut out = Vec::new();
        let mut stack = vec![v];
        while let Some(v) = stack.pop() {
            let Some(val) = self.value(v) else { continue };
            if let Op::Tensor(t) = val.op {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
            stack.extend(val.op.operands());
        }
        out
    }
}

/// The MoE layer's two GEMMs and the weight param each reads (vLLM's names): the GEMM names are
/// the keys of `static(..)` in an `activation` declaration.
pub const GEMM_WEIGHTS: [(&str, &str); 2] = [("w13", "w13_weight"), ("w2", "w2_weight")];

/// Activation scales computed from the activations themselves, at run time (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActDynamic {
    /// One scale per token: `s_t = max(amax_t / 448, 1/(448*512))`.
    PerToken,
    /// One scale per token per `group` consecutive columns, `s = max(amax, 1e-4) / 448`
    /// (DeepSeek-V3's scheme; `group` is 128, one weight-scale block).
    PerTokenGroup {
        /// Columns per scale.
        group: u32,
    },
}

impl fmt::Display for ActDynamic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ActDynamic::PerToken => f.write_str("per_token"),
            ActDynamic::PerTokenGroup { group } => write!(f, "per_token_group = {group}"),
        }
    }
}

/// How the MoE layer's GEMMs take their activations (`x` for the first, `a = silu(g) * u` for
/// the second), as the recipe's `activation` statement declares it (SPEC §9). The GEMM operands
/// must match: e4m3 activations with e4m3 weights, bf16 activations with every other weight dtype
/// (weights-only schemes are dequantized to bf16 on Hopper); the verifier refuses anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// Activations stay bf16 (the default when a recipe declares none).
    Bf16,
    /// E4M3 activations with scales computed at run time.
    Fp8Dynamic(ActDynamic),
    /// E4M3 activations divided by a registered static scale per GEMM (`q = e4m3(clamp(x / s,
    /// ±448))`): `w13` for the first GEMM's input, `w2` for the second's. Each is an f32 `[E]`
    /// param holding one value for all experts. Where a scale is optional (computed from an
    /// optional input), `fallback` says how that GEMM scales its input when the checkpoint lacks it.
    Fp8Static {
        /// The first GEMM's input scale.
        w13: TensorId,
        /// The second GEMM's input scale.
        w2: TensorId,
        /// The dynamic scaling used where a static scale is absent.
        fallback: Option<ActDynamic>,
    },
}

/// How one GEMM scales its E4M3 input in one variant: see [`Module::activation_scales`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActScale {
    /// Divided by this registered static scale.
    Static(TensorId),
    /// Scaled at run time.
    Dynamic(ActDynamic),
}

impl Activation {
    /// The element type the GEMMs read activations in: bf16 or e4m3.
    pub fn dtype(&self) -> DType {
        match self {
            Activation::Bf16 => DType::Bf16,
            Activation::Fp8Dynamic(_) | Activation::Fp8Static { .. } => DType::E4m3,
        }
    }

    /// The scheme's name as written: `bf16` or `fp8`.
    pub fn scheme(&self) -> &'static str {
        match self {
            Activation::Bf16 => "bf16",
            Activation::Fp8Dynamic(_) | Activation::Fp8Static { .. } => "fp8",
        }
    }

    /// The static scale of a GEMM (`w13` or `w2`), if the scheme has one.
    pub fn static_scale(&self, gemm: &str) -> Option<TensorId> {
        match (self, gemm) {
            (Activation::Fp8Static { w13, .. }, "w13") => Some(*w13),
            (Activation::Fp8Static { w2, .. }, "w2") => Some(*w2),
            _ => None,
        }
    }

    /// The declaration in the language's syntax, e.g.
    /// `fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)`.
    pub fn text(&self, m: &Module) -> String {
        let name = |t: TensorId| m.tensor(t).map(|t| t.name.clone()).unwrap_or_default();
        match self {
            Activation::Bf16 => "bf16".into(),
            Activation::Fp8Dynamic(d) => format!("fp8({d})"),
            Activation::Fp8Static { w13, w2, fallback } => {
                let fb = fallback.map(|d| format!(" else {d}")).unwrap_or_default();
                format!("fp8(static(w13 = {}, w2 = {}){fb})", name(*w13), name(*w2))
            }
        }
    }
}

/// The activation dtype a GEMM with `weight` weights needs: e4m3 (or e5m2) weights take e4m3
/// activations, every other weight dtype bf16 (SPEC §9: weights-only schemes stay bf16 on Hopper).
pub fn activation_dtype_for_weight(weight: DType) -> DType {
    match weight {
        DType::E4m3 | DType::E5m2 => DType::E4m3,
        _ => DType::Bf16,
    }
}

impl Module {
    /// The declared activation scheme, or bf16 when the recipe declares none.
    pub fn activation(&self) -> Activation {
        self.activation.map(|(a, _)| a).unwrap_or(Activation::Bf16)
    }

    /// Whether the recipe declares its activation scheme (and where).
    pub fn activation_span(&self) -> Option<Span> {
        self.activation.map(|(_, s)| s)
    }

    /// The ways the GEMM `gemm` (`w13` or `w2`) may scale its E4M3 input at run time: dynamic
    /// first, then static. A static scale from an optional input gives both (the fallback where
    /// the checkpoint lacks it); one that is always present gives only itself. Empty for bf16.
    pub fn activation_scales(&self, gemm: &str) -> Vec<ActScale> {
        match self.activation() {
            Activation::Bf16 => Vec::new(),
            Activation::Fp8Dynamic(d) => vec![ActScale::Dynamic(d)],
            a @ Activation::Fp8Static { fallback, .. } => {
                let Some(s) = a.static_scale(gemm) else {
                    return Vec::new();
                };
                let optional = self.tensor(s).is_some_and(|t| t.optional);
                match fallback {
                    Some(d) if optional => vec![ActScale::Dynamic(d), ActScale::Static(s)],
                    _ => vec![ActScale::Static(s)],
                }
            }
        }
    }
}
