//! The recipe language's syntax tree: what the parser produces, every node carrying its source span.

use std::fmt;

/// A byte range in the recipe source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Span {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl Span {
    /// A span from byte offsets.
    pub fn new(start: usize, end: usize) -> Span {
        Span { start, end }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }
}

/// A name with its span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ident {
    /// The name.
    pub name: String,
    /// Where it is written.
    pub span: Span,
}

/// A whole recipe: `recipe NAME(DIMS) where CONSTRAINTS { STATEMENTS }`.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// The recipe's name.
    pub name: Ident,
    /// Symbolic dimensions, in order.
    pub dims: Vec<DimDecl>,
    /// The where-clause.
    pub constraints: Vec<Constraint>,
    /// The body.
    pub stmts: Vec<Stmt>,
    /// The whole recipe.
    pub span: Span,
}

/// A symbolic dimension: `E: experts` or `H`.
#[derive(Debug, Clone, PartialEq)]
pub struct DimDecl {
    /// The name.
    pub name: Ident,
    /// Whether this dimension counts the experts (dim 0 of every param).
    pub experts: bool,
}

/// Comparison operators of the where-clause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    /// `<=`
    Le,
    /// `<`
    Lt,
    /// `>=`
    Ge,
    /// `>`
    Gt,
}

impl fmt::Display for CmpOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CmpOp::Le => "<=",
            CmpOp::Lt => "<",
            CmpOp::Ge => ">=",
            CmpOp::Gt => ">",
        })
    }
}

/// One where-clause constraint.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// `EXPR % K == 0`.
    Divisible {
        /// The constrained expression.
        expr: Expr,
        /// The divisor.
        by: i64,
        /// The whole constraint.
        span: Span,
    },
    /// `DIM <= N` and friends.
    Bound {
        /// The constrained dimension.
        dim: Ident,
        /// The comparison.
        op: CmpOp,
        /// The bound.
        value: i64,
        /// The whole constraint.
        span: Span,
    },
}

impl Constraint {
    /// The constraint's span.
    pub fn span(&self) -> Span {
        match self {
            Constraint::Divisible { span, .. } | Constraint::Bound { span, .. } => *span,
        }
    }
}

/// `DTYPE[DIMS]` with an optional explicit storage layout `@ SHAPE:STRIDE`.
#[derive(Debug, Clone, PartialEq)]
pub struct TypeExpr {
    /// The element type's name.
    pub dtype: Ident,
    /// The shape (empty for a scalar).
    pub dims: Vec<Expr>,
    /// Explicit storage layout, if written.
    pub layout: Option<LayoutLit>,
    /// The whole type.
    pub span: Span,
}

/// A statement of the recipe body.
#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    /// `input NAME : TYPE [optional]`: a tensor the checkpoint holds.
    Input {
        /// Name.
        name: Ident,
        /// Type.
        ty: TypeExpr,
        /// Whether the checkpoint may lack it.
        optional: bool,
        /// Whole statement.
        span: Span,
    },
    /// `param NAME : TYPE = EXPR`: a registered, materialized, expert-major tensor.
    Param {
        /// Name.
        name: Ident,
        /// Declared type.
        ty: TypeExpr,
        /// Definition.
        value: Expr,
        /// Whole statement.
        span: Span,
    },
    /// `view NAME [: TYPE] = EXPR [bijective]`: an alias of one param.
    View {
        /// Name.
        name: Ident,
        /// Declared type, optional.
        ty: Option<TypeExpr>,
        /// Definition (layout operations only).
        value: Expr,
        /// Span of the `bijective` claim, when present.
        bijective: Option<Span>,
        /// Whole statement.
        span: Span,
    },
    /// `let NAME = EXPR`: an intermediate (size, row index or tensor value).
    Let {
        /// Name.
        name: Ident,
        /// Definition.
        value: Expr,
        /// Whole statement.
        span: Span,
    },
    /// `kernel NAME(OPERANDS) [on TARGETS] [index i32|i64]`: what a generated kernel reads.
    Kernel {
        /// Name.
        name: Ident,
        /// The params and views it reads.
        operands: Vec<Ident>,
        /// Targets (`sm_90a`, `sm_100a`, `host`).
        targets: Vec<Ident>,
        /// Declared index width.
        index: Option<Ident>,
        /// Whole statement.
        span: Span,
    },
    /// `activation SCHEME [(MODE [else MODE])]`: how the MoE layer's GEMMs take their activations
    /// (SPEC §9), e.g. `activation bf16`, `activation fp8(per_token)`,
    /// `activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) else per_token)`.
    Activation {
        /// The scheme: `bf16` or `fp8`.
        scheme: Ident,
        /// How activations are scaled, when written.
        mode: Option<ActMode>,
        /// What replaces the mode when its static scales are absent (`else MODE`).
        fallback: Option<ActMode>,
        /// Whole statement.
        span: Span,
    },
}

/// One activation scaling mode of an `activation` statement.
#[derive(Debug, Clone, PartialEq)]
pub struct ActMode {
    /// What it is.
    pub kind: ActModeKind,
    /// The whole mode.
    pub span: Span,
}

/// Activation scaling modes, as written (checked when lowering).
#[derive(Debug, Clone, PartialEq)]
pub enum ActModeKind {
    /// `NAME` or `NAME = INT`: a dynamic mode (`per_token`, `per_token_group = 128`).
    Dynamic {
        /// The mode's name.
        name: Ident,
        /// Its size argument and the argument's span.
        size: Option<(i64, Span)>,
    },
    /// `static(GEMM = PARAM, ...)`: the registered scale each GEMM's input is divided by.
    Static {
        /// `(GEMM, PARAM)` pairs, in order (`w13 = w13_input_scale`).
        scales: Vec<(Ident, Ident)>,
    },
}

impl Stmt {
    /// The statement's span.
    pub fn span(&self) -> Span {
        match self {
            Stmt::Input { span, .. }
            | Stmt::Param { span, .. }
            | Stmt::View { span, .. }
            | Stmt::Let { span, .. }
            | Stmt::Kernel { span, .. }
            | Stmt::Activation { span, .. } => *span,
        }
    }
}

/// Binary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/`
    Div,
    /// `%`
    Rem,
}

impl fmt::Display for BinOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
        })
    }
}

/// An expression with its span.
#[derive(Debug, Clone, PartialEq)]
pub struct Expr {
    /// What it is.
    pub kind: ExprKind,
    /// Where.
    pub span: Span,
}

/// Expression forms.
#[derive(Debug, Clone, PartialEq)]
pub enum ExprKind {
    /// An integer literal.
    Int(i64),
    /// A name.
    Name(String),
    /// `a OP b OP c ...`: operands joined by operators of one precedence level (`+ -`, or
    /// `* / %`), left-associative. Flat, so that a long sum is not a deep tree; never fewer than
    /// one link (a lone operand is the operand itself).
    Chain {
        /// The first operand.
        first: Box<Expr>,
        /// Each further operator with its right operand, left to right.
        rest: Vec<(BinOp, Expr)>,
    },
    /// `-a`.
    Neg(Box<Expr>),
    /// `f(args)`.
    Call {
        /// Function name.
        func: Ident,
        /// Arguments.
        args: Vec<Arg>,
    },
    /// `quant SCHEME(args)`.
    Quant {
        /// Scheme name.
        scheme: Ident,
        /// Arguments.
        args: Vec<Arg>,
    },
    /// `base` followed by suffixes: `.field`, `[slices]`, `@ LAYOUT`, applied left to right. Flat,
    /// so that a long run of suffixes is not a deep tree; never without a suffix.
    Postfix {
        /// The value the first suffix applies to.
        base: Box<Expr>,
        /// The suffixes, left to right.
        ops: Vec<Suffix>,
    },
}

/// One suffix of [`ExprKind::Postfix`].
#[derive(Debug, Clone, PartialEq)]
pub struct Suffix {
    /// What it does.
    pub kind: SuffixKind,
    /// The expression up to and including this suffix (from the start of the base).
    pub span: Span,
}

/// Suffix forms.
#[derive(Debug, Clone, PartialEq)]
pub enum SuffixKind {
    /// `.field`.
    Field(Ident),
    /// `[slices]`: one entry per dimension.
    Index(Vec<SliceArg>),
    /// `@ LAYOUT`: reinterpret the storage through an explicit layout.
    Apply(Box<LayoutLit>),
}

/// A call argument: positional `EXPR` or named `NAME = EXPR [reduce GROUP]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Arg {
    /// The name, for a named argument.
    pub name: Option<Ident>,
    /// The value.
    pub value: Expr,
    /// `reduce GROUP` suffix (amax arguments).
    pub reduce: Option<Ident>,
    /// Whole argument.
    pub span: Span,
}

/// One entry of an index expression.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceArg {
    /// `:`.
    Full(Span),
    /// `a:b` with either end optional.
    Range {
        /// Start (default 0).
        start: Option<Expr>,
        /// End (default the extent).
        end: Option<Expr>,
        /// Whole entry.
        span: Span,
    },
    /// A single expression: an index vector (gather) or a scalar index.
    Expr(Expr),
}

/// A layout literal: `[S<B,M,S> o] SHAPE:STRIDE`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutLit {
    /// Swizzle `(B, M, S)` and its span.
    pub swizzle: Option<(i64, i64, i64, Span)>,
    /// Shape tuple.
    pub shape: TupleLit,
    /// Stride tuple.
    pub stride: TupleLit,
    /// Whole literal.
    pub span: Span,
}

/// A hierarchical tuple literal of expressions.
#[derive(Debug, Clone, PartialEq)]
pub enum TupleLit {
    /// A leaf expression.
    Leaf(Expr),
    /// `(a, b, ...)`.
    Tuple(Vec<TupleLit>, Span),
}

impl TupleLit {
    /// The tuple's span.
    pub fn span(&self) -> Span {
        match self {
            TupleLit::Leaf(e) => e.span,
            TupleLit::Tuple(_, s) => *s,
        }
    }
}
