//! Lowering from the syntax tree to the typed IR, checking names, dtypes, shapes and divisibility as
//! it goes. Errors are collected (one per statement at most; a failed definition poisons its name so
//! that later uses do not cascade).

use std::collections::{HashMap, HashSet};

use crate::ast::{self, Arg, BinOp, Expr, ExprKind, SliceArg, Span, Stmt, SuffixKind, TupleLit};
use crate::diag::Diagnostic;
use crate::ir::*;
use crate::layout::Swizzle;
use crate::limits::{MAX_DEPTH, MAX_ERRORS, MAX_EXPANDED, MAX_WRITTEN};
use crate::poly::{Atoms, Poly, MAX_DEGREE, MAX_TERMS};

mod activation;

#[derive(Debug, Clone)]
enum Binding {
    Dim(Poly),
    Size(Poly),
    Index(IndexVec),
    Quant(ValueId),
    Tensor(TensorId),
    Poisoned,
}

const FUNCTIONS: &str = "`ceil_div`, `round_up`, `arange`, `swap_halves`, `interleave`, `swizzle_128x4`, `mma_sf_view`, `pad`, `reshape`, `permute`, `cat`, `reduce_max`, `broadcast`";

struct Lower<'s> {
    src: &'s str,
    m: Module,
    env: HashMap<String, Binding>,
    errors: Vec<Diagnostic>,
    consumed_by_param: HashSet<TensorId>,
    experts: Option<Poly>,
    /// Per value (parallel to `m.values`): its depth (a tensor or constant is 0, an operation one
    /// more than its deepest operand, a `let` one more than its definition) and how many operations
    /// it stands for once `let`s are substituted. Both bounded: see [`crate::limits`].
    measure: Vec<(usize, u64)>,
    kernel_names: HashSet<String>,
    /// Statements that failed without a diagnostic of their own.
    dropped: Vec<(String, Span)>,
}

/// Lower a parsed recipe to the IR, or return every error found.
pub fn lower(recipe: &ast::Recipe, src: &str) -> Result<Module, Vec<Diagnostic>> {
    let mut l = Lower {
        src,
        m: Module {
            name: recipe.name.name.clone(),
            dims: Vec::new(),
            atoms: Atoms::default(),
            checks: Vec::new(),
            tensors: Vec::new(),
            values: Vec::new(),
            kernels: Vec::new(),
            shadows: Vec::new(),
            activation: None,
        },
        env: HashMap::new(),
        errors: Vec::new(),
        consumed_by_param: HashSet::new(),
        experts: None,
        measure: Vec::new(),
        kernel_names: HashSet::new(),
        dropped: Vec::new(),
    };
    l.dims(recipe);
    if l.experts.is_none() {
        l.errors.push(
            Diagnostic::error("E0107", format!("recipe `{}` has no experts dimension", recipe.name.name))
                .with_label(recipe.name.span, "no dimension is marked `experts`")
                .with_note("help: mark the dimension that counts local experts, e.g. `recipe r(E: experts, H, I)`"),
        );
    }
    if l.errors.is_empty() {
        for s in &recipe.stmts {
            if l.errors.len() >= MAX_ERRORS {
                if let Some(last) = l.errors.pop() {
                    l.errors.push(last.with_note(format!(
                        "checking stopped after {MAX_ERRORS} errors; later statements were not checked"
                    )));
                }
                break;
            }
            l.stmt(s);
        }
        l.check_unregistered_lets();
        l.check_values_have_scales();
        if l.errors.is_empty() {
            l.check_activation_operands();
        }
        // Fail closed: an accepted recipe has every statement it declares.
        if l.errors.is_empty() {
            for (name, span) in std::mem::take(&mut l.dropped) {
                l.errors.push(
                    Diagnostic::error("E0106", format!("`{name}` cannot be lowered"))
                        .with_label(span, "this statement has no valid meaning here"),
                );
            }
        }
    }
    if l.errors.is_empty() {
        Ok(l.m)
    } else {
        Err(l.errors)
    }
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a.abs()
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: i64, b: i64) -> Option<i64> {
    (a / gcd(a, b)).checked_mul(b)
}

impl<'s> Lower<'s> {
    fn text(&self, span: Span) -> &str {
        self.src.get(span.start..span.end).unwrap_or("?")
    }

    fn err(&mut self, d: Diagnostic) {
        self.errors.push(d);
    }

    // ---- dimensions and constraints ----------------------------------------------------------

    fn dims(&mut self, r: &ast::Recipe) {
        let mut units: HashMap<String, i64> = HashMap::new();
        // Bounds in i128: `H > 9223372036854775807` is a bound no binding meets, not an overflow.
        let mut mins: HashMap<String, i128> = HashMap::new();
        let mut maxs: HashMap<String, i128> = HashMap::new();
        let names: Vec<&str> = r.dims.iter().map(|d| d.name.name.as_str()).collect();
        for (k, d) in r.dims.iter().enumerate() {
            if names[..k].contains(&d.name.name.as_str()) {
                self.err(
                    Diagnostic::error(
                        "E0102",
                        format!("dimension `{}` is declared twice", d.name.name),
                    )
                    .with_label(d.name.span, "declared again here"),
                );
            }
        }
        if r.dims.iter().filter(|d| d.experts).count() > 1 {
            if let Some(d) = r.dims.iter().filter(|d| d.experts).nth(1) {
                self.err(
                    Diagnostic::error("E0107", "only one dimension can count experts")
                        .with_label(d.name.span, "second `experts` dimension"),
                );
            }
        }
        for c in &r.constraints {
            match c {
                ast::Constraint::Divisible { expr, by, span } => {
                    if *by <= 0 {
                        self.err(
                            Diagnostic::error("E0108", "a divisor must be positive")
                                .with_label(*span, "here"),
                        );
                        continue;
                    }
                    let (coef, name) = match &expr.kind {
                        ExprKind::Name(n) => (1, n.clone()),
                        ExprKind::Chain { first, rest } => match (&first.kind, rest.as_slice()) {
                            (ExprKind::Int(c), [(BinOp::Mul, rhs)]) => match &rhs.kind {
                                ExprKind::Name(n) => (*c, n.clone()),
                                _ => (0, String::new()),
                            },
                            (ExprKind::Name(n), [(BinOp::Mul, rhs)]) => match &rhs.kind {
                                ExprKind::Int(c) => (*c, n.clone()),
                                _ => (0, String::new()),
                            },
                            _ => (0, String::new()),
                        },
                        _ => (0, String::new()),
                    };
                    if coef <= 0 || !names.contains(&name.as_str()) {
                        self.err(
                            Diagnostic::error("E0108", "unsupported constraint")
                                .with_label(expr.span, "expected a dimension or `C*DIM`")
                                .with_note("constraints have the forms `DIM % K == 0`, `C*DIM % K == 0`, `DIM <= N`, `DIM >= N`"),
                        );
                        continue;
                    }
                    let need = by / gcd(coef, *by);
                    let u = units.entry(name.clone()).or_insert(1);
                    match lcm(*u, need) {
                        Some(l) => *u = l,
                        None => self.err(
                            Diagnostic::error(
                                "E0108",
                                format!(
                                    "the divisors of `{name}` have no common multiple below 2^63"
                                ),
                            )
                            .with_label(
                                *span,
                                "no binding can meet this constraint with the others",
                            ),
                        ),
                    }
                }
                ast::Constraint::Bound {
                    dim,
                    op,
                    value,
                    span,
                } => {
                    if !names.contains(&dim.name.as_str()) {
                        self.err(
                            Diagnostic::error("E0101", format!("unknown dimension `{}`", dim.name))
                                .with_label(dim.span, "not a dimension of this recipe")
                                .with_note(format!(
                                    "the dimensions are {}",
                                    names
                                        .iter()
                                        .map(|n| format!("`{n}`"))
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                )),
                        );
                        continue;
                    }
                    let _ = span;
                    match op {
                        // Several bounds on one dimension all hold: keep the tightest.
                        ast::CmpOp::Le | ast::CmpOp::Lt => {
                            let v = if *op == ast::CmpOp::Le {
                                *value as i128
                            } else {
                                *value as i128 - 1
                            };
                            let e = maxs.entry(dim.name.clone()).or_insert(v);
                            *e = (*e).min(v);
                        }
                        ast::CmpOp::Ge | ast::CmpOp::Gt => {
                            let v = if *op == ast::CmpOp::Ge {
                                *value as i128
                            } else {
                                *value as i128 + 1
                            };
                            let e = mins.entry(dim.name.clone()).or_insert(v);
                            *e = (*e).max(v);
                        }
                    }
                }
            }
        }
        for d in &r.dims {
            let unit = units.get(&d.name.name).copied().unwrap_or(1);
            // Bindings are positive i64 values: the admissible ones are the multiples of `unit` in
            // `[min, max]` with `1 <= min` and `max <= i64::MAX`.
            let max = maxs
                .get(&d.name.name)
                .copied()
                .unwrap_or(i64::MAX as i128)
                .min(i64::MAX as i128);
            let raw_min = mins.get(&d.name.name).copied().unwrap_or(1).max(1);
            let min = (raw_min + unit as i128 - 1) / unit as i128 * unit as i128;
            if max < min {
                let why = if min > i64::MAX as i128 {
                    format!("at least {min}, past the largest binding {}", i64::MAX)
                } else {
                    format!("at least {min} but at most {max}")
                };
                self.err(
                    Diagnostic::error(
                        "E0108",
                        format!("no value of `{}` satisfies the where-clause", d.name.name),
                    )
                    .with_label(d.name.span, why),
                );
            }
            // Clamped so that lowering can go on to report other errors; the recipe is rejected.
            let min = min.min(i64::MAX as i128 / unit as i128 * unit as i128) as i64;
            let max = maxs.contains_key(&d.name.name).then_some(max as i64);
            let atom = self
                .m
                .atoms
                .dim_bounded(&d.name.name, unit, (min / unit) as i128, max);
            let poly = Poly::atom(atom).scale(unit as i128);
            if d.experts {
                self.experts = Some(poly.clone());
            }
            self.env
                .insert(d.name.name.clone(), Binding::Dim(poly.clone()));
            self.m.dims.push(Dim {
                name: d.name.name.clone(),
                poly,
                unit,
                min,
                max,
                experts: d.experts,
                span: d.name.span,
            });
        }
        for c in &r.constraints {
            let text = self.text(c.span()).to_string();
            match c {
                ast::Constraint::Divisible { expr, by, span } => {
                    if let Some(p) = self.size(expr) {
                        self.m.checks.push(BindCheck::Divisible {
                            poly: p,
                            by: *by,
                            text,
                            span: *span,
                        });
                    }
                }
                ast::Constraint::Bound {
                    dim,
                    op,
                    value,
                    span,
                } => {
                    self.m.checks.push(BindCheck::Bound {
                        dim: dim.name.clone(),
                        op: *op,
                        value: *value,
                        text,
                        span: *span,
                    });
                }
            }
        }
    }

    // ---- names --------------------------------------------------------------------------------

    fn lookup(&mut self, name: &str, span: Span) -> Option<Binding> {
        match self.env.get(name) {
            Some(Binding::Poisoned) => None,
            Some(b) => Some(b.clone()),
            None => {
                let mut known: Vec<&String> = self.env.keys().collect();
                known.sort();
                let near: Vec<String> = known
                    .iter()
                    .filter(|k| similar(k, name))
                    .map(|k| format!("`{k}`"))
                    .collect();
                let mut d = Diagnostic::error("E0101", format!("unknown name `{name}`"))
                    .with_label(span, "not defined before this use");
                if !near.is_empty() {
                    d = d.with_note(format!("help: did you mean {}?", near.join(" or ")));
                }
                self.err(d);
                None
            }
        }
    }

    fn define(&mut self, name: &ast::Ident, b: Binding) {
        self.env.insert(name.name.clone(), b);
    }

    fn check_fresh(&mut self, name: &ast::Ident, allow_shadow_input: bool) -> bool {
        match self.env.get(&name.name) {
            None => true,
            Some(Binding::Tensor(t)) if allow_shadow_input => {
                let is_input = matches!(
                    self.m.tensor(*t).map(|t| &t.kind),
                    Some(TensorKind::Input { .. })
                );
                if is_input {
                    return true;
                }
                self.dup(name);
                false
            }
            Some(_) => {
                self.dup(name);
                false
            }
        }
    }

    fn dup(&mut self, name: &ast::Ident) {
        let prev = self
            .m
            .tensors
            .iter()
            .rev()
            .find(|t| t.name == name.name)
            .map(|t| t.name_span);
        let mut d = Diagnostic::error("E0102", format!("`{}` is defined twice", name.name))
            .with_label(name.span, "defined again here");
        if let Some(p) = prev {
            d = d.with_label(p, "first defined here");
        }
        self.err(d);
    }

    // ---- sizes ----------------------------------------------------------------------------------

    fn is_size_expr(&self, e: &Expr) -> bool {
        match &e.kind {
            ExprKind::Int(_) => true,
            ExprKind::Name(n) => matches!(
                self.env.get(n),
                Some(Binding::Dim(_)) | Some(Binding::Size(_))
            ),
            ExprKind::Chain { first, rest } => {
                self.is_size_expr(first) && rest.iter().all(|(_, x)| self.is_size_expr(x))
            }
            ExprKind::Neg(x) => self.is_size_expr(x),
            ExprKind::Call { func, .. } => {
                matches!(func.name.as_str(), "ceil_div" | "round_up" | "cd" | "ru")
            }
            _ => false,
        }
    }

    fn const_int(&mut self, e: &Expr, what: &str) -> Option<i64> {
        match self.size(e)?.as_const() {
            Some(c) if c > 0 && c <= i64::MAX as i128 => Some(c as i64),
            _ => {
                self.err(
                    Diagnostic::error(
                        "E0106",
                        format!("{what} must be a positive integer constant"),
                    )
                    .with_label(e.span, "not a positive constant"),
                );
                None
            }
        }
    }

    /// `ceil(p / k)`, refused (with the constraint to add) where `p` is not provably at least 1 for
    /// every admissible binding: a ceiling atom promises to be at least 1, and every symbolic proof
    /// relies on it.
    fn cdiv(&mut self, p: &Poly, k: i64, span: Span) -> Option<Poly> {
        // A new ceiling atom nests the atoms of `p` and is written with them.
        if k > 0 && p.div_exact(k).is_none() && p.as_const().is_none() {
            let (depth, written) = self.m.atoms.nesting(p);
            if depth >= MAX_DEPTH {
                self.err(
                    Diagnostic::error(
                        "E0002",
                        format!("nesting too deep: more than {MAX_DEPTH} levels"),
                    )
                    .with_label(span, format!("`ceil_div` of {depth} nested `ceil_div`s")),
                );
                return None;
            }
            if written >= MAX_WRITTEN {
                self.err(
                    Diagnostic::error(
                        "E0003",
                        format!("expression too long: a size written with more than {MAX_WRITTEN} terms"),
                    )
                    .with_label(span, "this `ceil_div` would be written out with its numerator's `ceil_div`s"),
                );
                return None;
            }
        }
        if let Some(q) = self.m.atoms.ceil_div(p, k) {
            return Some(q);
        }
        let shown = self.m.show(p);
        let mut d = Diagnostic::error(
            "E0206",
            format!("`{shown}` is not provably at least 1 for every admissible binding"),
        )
        .with_label(span, format!("`ceil_div` / `round_up` of `{shown}` by {k}"));
        d = match self.lower_bound_hint(p) {
            Some(h) => d.with_note(format!("help: add `where {h}`")),
            None => {
                d.with_note("help: add lower bounds (`where DIM >= N`) that make it at least 1")
            }
        };
        self.err(d);
        None
    }

    /// A `DIM >= N` making a one-dimension linear polynomial `c*DIM + d` at least 1.
    fn lower_bound_hint(&self, p: &Poly) -> Option<String> {
        let mut atom = None;
        let mut slope = 0i128;
        let mut konst = 0i128;
        for (m, c) in p.terms() {
            match m.as_slice() {
                [] => konst = *c,
                [(a, 1)] if atom.is_none() => {
                    atom = Some(*a);
                    slope = *c;
                }
                _ => return None,
            }
        }
        let a = atom?;
        if slope <= 0 {
            return None;
        }
        let d = self
            .m
            .dims
            .iter()
            .find(|d| d.poly.terms().any(|(m, _)| m.as_slice() == [(a, 1)]))?;
        // c*atom + konst >= 1 with DIM = unit*atom: atom >= ceil((1 - konst) / c).
        let need = (1 - konst + slope - 1).div_euclid(slope).max(1);
        Some(format!("{} >= {}", d.name, need * d.unit as i128))
    }

    fn size(&mut self, e: &Expr) -> Option<Poly> {
        let p = self.size_inner(e)?;
        if p.overflowed() {
            self.overflow(e.span);
            return None;
        }
        Some(p)
    }

    fn overflow(&mut self, span: Span) {
        self.err(
            Diagnostic::error("E0207", "size arithmetic overflows")
                .with_label(span, "this size leaves the range of symbolic sizes")
                .with_note(format!(
                    "sizes are polynomials with 128-bit coefficients, at most {MAX_TERMS} terms and degree at most {MAX_DEGREE}"
                )),
        );
    }

    fn size_inner(&mut self, e: &Expr) -> Option<Poly> {
        match &e.kind {
            ExprKind::Int(v) => Some(Poly::constant(*v as i128)),
            ExprKind::Name(n) => match self.lookup(n, e.span)? {
                Binding::Dim(p) | Binding::Size(p) => Some(p),
                _ => {
                    self.err(
                        Diagnostic::error("E0106", format!("expected a size, `{n}` is not one"))
                            .with_label(e.span, "a size (dimension expression) is needed here"),
                    );
                    None
                }
            },
            ExprKind::Neg(x) => Some(self.size(x)?.neg()),
            ExprKind::Chain { first, rest } => {
                // Left to right; `acc` is the value of the chain up to `lhs` (its span).
                let mut acc = self.size(first)?;
                let mut lhs = first.span;
                for (op, rhs) in rest {
                    let span = Span::new(first.span.start, rhs.span.end);
                    acc = match op {
                        BinOp::Add => acc.add(&self.size(rhs)?),
                        BinOp::Sub => acc.sub(&self.size(rhs)?),
                        BinOp::Mul => acc.mul(&self.size(rhs)?),
                        BinOp::Div => {
                            let k = self.const_int(rhs, "a size divisor")?;
                            self.div_exact(&acc, k, lhs, span)?
                        }
                        BinOp::Rem => {
                            self.err(
                                Diagnostic::error(
                                    "E0106",
                                    "`%` is only allowed in the where-clause",
                                )
                                .with_label(span, "remainder in a size"),
                            );
                            return None;
                        }
                    };
                    if acc.overflowed() {
                        self.overflow(span);
                        return None;
                    }
                    lhs = span;
                }
                Some(acc)
            }
            ExprKind::Call { func, args } => {
                match func.name.as_str() {
                    "ceil_div" | "cd" | "round_up" | "ru" => {
                        let [a, b] = self.positional::<2>(func, args)?;
                        let p = self.size(&a.value)?;
                        let k = self.const_int(&b.value, "the divisor")?;
                        let q = self.cdiv(&p, k, a.value.span)?;
                        if func.name.starts_with('r') {
                            Some(q.scale(k as i128))
                        } else {
                            Some(q)
                        }
                    }
                    _ => {
                        self.err(
                        Diagnostic::error("E0106", format!("expected a size, `{}(..)` is not one", func.name))
                            .with_label(e.span, "sizes use integers, dimensions, `+ - * /`, `ceil_div` and `round_up`"),
                    );
                        None
                    }
                }
            }
            _ => {
                self.err(Diagnostic::error("E0106", "expected a size").with_label(
                    e.span,
                    "sizes use integers, dimensions, `+ - * /`, `ceil_div` and `round_up`",
                ));
                None
            }
        }
    }

    fn div_exact(&mut self, p: &Poly, k: i64, num_span: Span, span: Span) -> Option<Poly> {
        match p.div_exact(k) {
            Some(q) => Some(q),
            None => {
                let shown = self.m.show(p);
                let d = Diagnostic::error(
                    "E0204",
                    format!("cannot prove that `{shown}` is divisible by {k}"),
                )
                .with_label(span, format!("`{shown}` / {k} needs `{shown} % {k} == 0`"))
                .with_label(num_span, "this size")
                .with_note(format!(
                    "help: add a constraint to the where-clause, e.g. `where {shown} % {k} == 0`"
                ));
                self.err(d);
                None
            }
        }
    }

    fn positional<'a, const N: usize>(
        &mut self,
        func: &ast::Ident,
        args: &'a [Arg],
    ) -> Option<[&'a Arg; N]> {
        let pos: Vec<&Arg> = args.iter().filter(|a| a.name.is_none()).collect();
        if pos.len() != N || args.len() != N {
            self.err(
                Diagnostic::error(
                    "E0105",
                    format!(
                        "`{}` takes {N} positional argument{}",
                        func.name,
                        if N == 1 { "" } else { "s" }
                    ),
                )
                .with_label(func.span, format!("called with {} argument(s)", args.len())),
            );
            return None;
        }
        pos.try_into().ok()
    }

    // ---- index vectors ------------------------------------------------------------------------

    fn is_index_expr(&self, e: &Expr) -> bool {
        match &e.kind {
            ExprKind::Name(n) => matches!(self.env.get(n), Some(Binding::Index(_))),
            ExprKind::Call { func, .. } => {
                matches!(func.name.as_str(), "arange" | "swap_halves" | "interleave")
            }
            _ => false,
        }
    }

    fn index_vec(&mut self, e: &Expr) -> Option<IndexVec> {
        match &e.kind {
            ExprKind::Name(n) => match self.lookup(n, e.span)? {
                Binding::Index(v) => Some(v),
                Binding::Dim(p) | Binding::Size(p) => Some(IndexVec::Identity(p)),
                _ => {
                    self.err(
                        Diagnostic::error(
                            "E0106",
                            format!("expected a row index, `{n}` is not one"),
                        )
                        .with_label(e.span, "here"),
                    );
                    None
                }
            },
            ExprKind::Call { func, args } => match func.name.as_str() {
                "arange" => {
                    let [n] = self.positional::<1>(func, args)?;
                    Some(IndexVec::Identity(self.size(&n.value)?))
                }
                "swap_halves" => {
                    let [n] = self.positional::<1>(func, args)?;
                    let p = self.size(&n.value)?;
                    self.div_exact(&p, 2, n.value.span, n.value.span)?;
                    Some(IndexVec::SwapHalves(p))
                }
                "interleave" => {
                    let base = args.iter().find(|a| a.name.is_none());
                    let group = args
                        .iter()
                        .find(|a| a.name.as_ref().is_some_and(|n| n.name == "group"));
                    let (Some(base), Some(group)) = (base, group) else {
                        self.err(
                            Diagnostic::error(
                                "E0105",
                                "`interleave` takes a row index and `group = G`",
                            )
                            .with_label(
                                func.span,
                                "e.g. `interleave(swap_halves(2*I), group = 64)`",
                            ),
                        );
                        return None;
                    };
                    let g = self.const_int(&group.value, "`group`")?;
                    let b = if self.is_index_expr(&base.value) {
                        self.index_vec(&base.value)?
                    } else {
                        IndexVec::Identity(self.size(&base.value)?)
                    };
                    let mut depth = 1;
                    let mut inner = &b;
                    while let IndexVec::Interleave { base, .. } = inner {
                        depth += 1;
                        inner = base;
                    }
                    if depth > MAX_DEPTH {
                        self.err(
                            Diagnostic::error(
                                "E0002",
                                format!("nesting too deep: more than {MAX_DEPTH} levels"),
                            )
                            .with_label(
                                e.span,
                                format!("`interleave` of {} nested `interleave`s", depth - 1),
                            ),
                        );
                        return None;
                    }
                    self.div_exact(&b.len().clone(), 2 * g, base.value.span, base.value.span)?;
                    Some(IndexVec::Interleave {
                        base: Box::new(b),
                        group: g,
                    })
                }
                _ => {
                    self.err(
                        Diagnostic::error("E0106", "expected a row index")
                            .with_label(e.span, "row indices are `arange(n)`, `swap_halves(n)` and `interleave(x, group = g)`"),
                    );
                    None
                }
            },
            _ => {
                self.err(
                    Diagnostic::error("E0106", "expected a row index").with_label(e.span, "here"),
                );
                None
            }
        }
    }

    // ---- values -------------------------------------------------------------------------------

    /// Add a value, refused (E0002, E0003) where it would nest deeper than [`MAX_DEPTH`] or stand
    /// for more than [`MAX_EXPANDED`] operations, counting through the `let`s it reads: later
    /// passes (the code generator substitutes `let`s) recurse over it.
    fn push(&mut self, op: Op, dtype: DType, shape: Vec<Poly>, span: Span) -> Option<ValueId> {
        let measure = |v: ValueId| self.measure.get(v.0 as usize).copied().unwrap_or((0, 1));
        let (depth, expanded) = match &op {
            Op::Const(_) => (0, 1),
            Op::Tensor(t) => match self.m.tensor(*t) {
                Some(t) if t.kind == TensorKind::Let => match t.value {
                    Some(v) => {
                        let (d, n) = measure(v);
                        (d + 1, n)
                    }
                    None => (0, 1),
                },
                _ => (0, 1),
            },
            _ => op
                .operands()
                .into_iter()
                .map(measure)
                .fold((1, 1u64), |(d, n), (od, on)| {
                    (d.max(od + 1), n.saturating_add(on))
                }),
        };
        if depth > MAX_DEPTH {
            self.err(
                Diagnostic::error(
                    "E0002",
                    format!("nesting too deep: more than {MAX_DEPTH} levels"),
                )
                .with_label(
                    span,
                    format!("this is level {depth}, counting the operations inside the `let`s it reads"),
                )
                .with_note("help: a `let` names a tensor expression; it does not end the nesting (the code generator substitutes it where it is read)"),
            );
            return None;
        }
        if expanded > MAX_EXPANDED {
            self.err(
                Diagnostic::error(
                    "E0003",
                    format!("expression too long: more than {MAX_EXPANDED} operations once `let`s are substituted"),
                )
                .with_label(span, "this expression stands for too many operations")
                .with_note("the code generator substitutes a `let` wherever it is read, so each use of a `let` counts its whole definition"),
            );
            return None;
        }
        self.m.values.push(Value {
            op,
            dtype,
            shape,
            span,
        });
        self.measure.push((depth, expanded));
        Some(ValueId(self.m.values.len() as u32 - 1))
    }

    fn val(&self, v: ValueId) -> Option<&Value> {
        self.m.value(v)
    }

    fn shape_of(&self, v: ValueId) -> Vec<Poly> {
        self.val(v).map(|x| x.shape.clone()).unwrap_or_default()
    }

    fn dtype_of(&self, v: ValueId) -> DType {
        self.val(v).map(|x| x.dtype).unwrap_or(DType::F32)
    }

    fn value(&mut self, e: &Expr) -> Option<ValueId> {
        match &e.kind {
            ExprKind::Int(v) => self.push(Op::Const(*v), DType::F32, Vec::new(), e.span),
            ExprKind::Name(n) => match self.lookup(n, e.span)? {
                Binding::Tensor(t) => {
                    let (dtype, shape) = {
                        let t = self.m.tensor(t)?;
                        (t.dtype, t.shape.clone())
                    };
                    self.push(Op::Tensor(t), dtype, shape, e.span)
                }
                Binding::Quant(_) => {
                    self.err(
                        Diagnostic::error(
                            "E0106",
                            format!("`{n}` is a quantization, not a tensor"),
                        )
                        .with_label(
                            e.span,
                            format!("read one of its outputs: `{n}.values`, `{n}.scales`, ..."),
                        ),
                    );
                    None
                }
                Binding::Dim(_) | Binding::Size(_) => {
                    self.err(
                        Diagnostic::error("E0106", format!("expected a tensor, `{n}` is a size"))
                            .with_label(e.span, "a tensor is needed here"),
                    );
                    None
                }
                Binding::Index(_) => {
                    self.err(
                        Diagnostic::error(
                            "E0106",
                            format!("expected a tensor, `{n}` is a row index"),
                        )
                        .with_label(e.span, "use it inside `[...]`, e.g. `x[:, rows, :]`"),
                    );
                    None
                }
                Binding::Poisoned => None,
            },
            ExprKind::Quant { .. } => {
                self.err(
                    Diagnostic::error("E0106", "a quantization is not a tensor").with_label(
                        e.span,
                        "bind it with `let q = quant ...` and read `q.values` or `q.scales`",
                    ),
                );
                None
            }
            ExprKind::Neg(_) => {
                self.err(
                    Diagnostic::error("E0106", "negation is not defined on tensors")
                        .with_label(e.span, "here"),
                );
                None
            }
            ExprKind::Chain { first, rest } => self.arith(first, rest),
            ExprKind::Postfix { base, ops } => self.postfix(base, ops),
            ExprKind::Call { func, args } => self.call(func, args, e.span),
        }
    }

    /// A chain of tensor arithmetic, left to right: `((a * b) / c) * d`.
    fn arith(&mut self, first: &Expr, rest: &[(BinOp, Expr)]) -> Option<ValueId> {
        // The outermost (last) operator tensors do not support is the one reported.
        if let Some((k, (op, _))) = rest
            .iter()
            .enumerate()
            .rev()
            .find(|(_, (op, _))| !matches!(op, BinOp::Mul | BinOp::Div))
        {
            let span = Span::new(first.span.start, rest[k].1.span.end);
            self.err(
                Diagnostic::error("E0106", format!("`{op}` is not defined on tensors"))
                    .with_label(span, "tensors support `*` and `/` (f32, scalars broadcast)"),
            );
            return None;
        }
        let mut acc = self.value(first);
        let mut lhs_span = first.span;
        for (op, rhs) in rest {
            let span = Span::new(first.span.start, rhs.span.end);
            let aop = if *op == BinOp::Mul {
                Arith::Mul
            } else {
                Arith::Div
            };
            let b = self.value(rhs);
            acc = match (acc, b) {
                (Some(a), Some(b)) => self.arith1(*op, aop, (a, lhs_span), (b, rhs.span), span),
                _ => None,
            };
            lhs_span = span;
        }
        acc
    }

    /// One tensor operation `a OP b` of a chain.
    fn arith1(
        &mut self,
        op: BinOp,
        aop: Arith,
        (a, lhs): (ValueId, Span),
        (b, rhs): (ValueId, Span),
        span: Span,
    ) -> Option<ValueId> {
        for (v, ex) in [(a, lhs), (b, rhs)] {
            let dt = self.dtype_of(v);
            if dt != DType::F32 {
                self.err(
                    Diagnostic::error(
                        "E0202",
                        format!("dtype mismatch: `{op}` needs f32 operands, found {dt}"),
                    )
                    .with_label(ex, format!("this is {dt}")),
                );
                return None;
            }
        }
        let (sa, sb) = (self.shape_of(a), self.shape_of(b));
        let shape = if sa.is_empty() {
            sb
        } else if sb.is_empty() || sa == sb {
            sa
        } else {
            let d = Diagnostic::error(
                "E0201",
                format!(
                    "shape mismatch: `{op}` of {} and {}",
                    self.m.show_shape(&sa),
                    self.m.show_shape(&sb)
                ),
            )
            .with_label(
                span,
                "operands must have equal shapes, or one must be a scalar",
            );
            self.err(d);
            return None;
        };
        self.push(
            Op::Arith {
                op: aop,
                lhs: a,
                rhs: b,
            },
            DType::F32,
            shape,
            span,
        )
    }

    /// A run of suffixes, left to right: `q.scales[:, rows, :] @ L`.
    fn postfix(&mut self, base: &Expr, ops: &[ast::Suffix]) -> Option<ValueId> {
        // A field of anything but a quantization: the last one is reported, nothing is lowered.
        if let Some(k) = (1..ops.len())
            .rev()
            .find(|&k| matches!(ops[k].kind, SuffixKind::Field(_)))
        {
            if let SuffixKind::Field(field) = &ops[k].kind {
                self.err(
                    Diagnostic::error("E0106", format!("no field `{}` here", field.name))
                        .with_label(ops[k - 1].span, "only quantizations have fields"),
                );
            }
            return None;
        }
        let mut v = match ops.first().map(|o| &o.kind) {
            // A field reads an output of the quantization its base names.
            Some(SuffixKind::Field(field)) => self.field(base, field, ops[0].span)?,
            _ => self.value(base)?,
        };
        for op in ops {
            match &op.kind {
                SuffixKind::Field(_) => {}
                SuffixKind::Index(slices) => v = self.index(v, slices, op.span)?,
                SuffixKind::Apply(layout) => {
                    let lay = self.layout_lit(layout)?;
                    let shape = lay.shape();
                    let dtype = self.dtype_of(v);
                    v = self.push(
                        Op::Apply {
                            base: v,
                            layout: lay,
                        },
                        dtype,
                        shape,
                        op.span,
                    )?;
                }
            }
        }
        Some(v)
    }

    fn quant(&mut self, scheme: &ast::Ident, args: &[Arg], span: Span) -> Option<ValueId> {
        let input = args.iter().find(|a| a.name.is_none());
        let Some(input) = input else {
            self.err(
                Diagnostic::error(
                    "E0105",
                    format!("`quant {}` needs the tensor to quantize", scheme.name),
                )
                .with_label(
                    scheme.span,
                    "e.g. `quant nvfp4(w13, amax = per_expert reduce moe_tp)`",
                ),
            );
            return None;
        };
        if args.iter().filter(|a| a.name.is_none()).count() > 1 {
            self.err(
                Diagnostic::error("E0105", "`quant` takes one positional argument")
                    .with_label(span, "more than one tensor given"),
            );
            return None;
        }
        let x = self.value(&input.value)?;
        let allowed: &[&str] = match scheme.name.as_str() {
            "nvfp4" => &["block", "amax"],
            "fp8" => &["granularity", "amax", "group"],
            "mxfp4" => &["block"],
            "int8" => &["granularity", "group"],
            "int4" => &["group", "zero_point", "scale"],
            _ => {
                self.err(
                    Diagnostic::error(
                        "E0104",
                        format!("unknown quantization scheme `{}`", scheme.name),
                    )
                    .with_label(scheme.span, "not a scheme")
                    .with_note("the schemes are `nvfp4`, `fp8`, `mxfp4`, `int8` and `int4`"),
                );
                return None;
            }
        };
        let mut named: HashMap<&str, &Arg> = HashMap::new();
        for a in args {
            if let Some(n) = &a.name {
                if !allowed.contains(&n.name.as_str()) {
                    self.err(
                        Diagnostic::error(
                            "E0105",
                            format!("`quant {}` has no argument `{}`", scheme.name, n.name),
                        )
                        .with_label(
                            n.span,
                            format!(
                                "expected one of {}",
                                allowed
                                    .iter()
                                    .map(|a| format!("`{a}`"))
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        ),
                    );
                    return None;
                }
                named.insert(n.name.as_str(), a);
            }
        }
        let dt = self.dtype_of(x);
        if !dt.is_wide_float() {
            self.err(
                Diagnostic::error(
                    "E0202",
                    format!(
                        "dtype mismatch: `quant {}` needs a bf16, f16 or f32 tensor, found {dt}",
                        scheme.name
                    ),
                )
                .with_label(input.value.span, format!("this is {dt}")),
            );
            return None;
        }
        let shape = self.shape_of(x);
        if shape.len() < 2 {
            self.err(
                Diagnostic::error(
                    "E0201",
                    format!(
                        "shape mismatch: `quant {}` needs a tensor of rank 2 or more, found {}",
                        scheme.name,
                        self.m.show_shape(&shape)
                    ),
                )
                .with_label(input.value.span, "quantized along its last dimension"),
            );
            return None;
        }
        let expert_major = self.experts.as_ref() == shape.first();
        let (amax, group) = match named.get("amax") {
            Some(a) => {
                let g = match &a.value.kind {
                    ExprKind::Name(n) if n == "per_expert" => AmaxGranularity::PerExpert,
                    ExprKind::Name(n) if n == "per_tensor" => AmaxGranularity::PerTensor,
                    _ => {
                        self.err(
                            Diagnostic::error("E0104", "unknown amax granularity")
                                .with_label(a.value.span, "expected `per_expert` or `per_tensor`"),
                        );
                        return None;
                    }
                };
                let grp = match &a.reduce {
                    None => Group::None,
                    Some(id) => match Group::from_name(&id.name) {
                        Some(g) => g,
                        None => {
                            self.err(
                                Diagnostic::error(
                                    "E0104",
                                    format!("unknown process group `{}`", id.name),
                                )
                                .with_label(id.span, "expected `none`, `tp`, `moe_tp` or `ep`"),
                            );
                            return None;
                        }
                    },
                };
                if g == AmaxGranularity::PerExpert && grp == Group::Ep {
                    self.err(
                        Diagnostic::error("E0205", "a per-expert amax cannot reduce over `ep`")
                            .with_label(a.span, "the ranks of `ep` hold different experts")
                            .with_note("help: per-expert weight scales reduce over `moe_tp` (the ranks that split one expert)"),
                    );
                    return None;
                }
                if grp == Group::Tp && expert_major {
                    self.err(
                        Diagnostic::error("E0205", "expert weights do not reduce over `tp`")
                            .with_label(a.span, "`tp` is the shards of a dense tensor-parallel weight")
                            .with_note("help: use `reduce moe_tp`: the ranks that split one expert's tensors"),
                    );
                    return None;
                }
                if g == AmaxGranularity::PerExpert && !expert_major {
                    self.err(
                        Diagnostic::error(
                            "E0205",
                            "a per-expert amax needs an expert-major tensor",
                        )
                        .with_label(
                            input.value.span,
                            "dim 0 of this tensor is not the experts dimension",
                        ),
                    );
                    return None;
                }
                (g, grp)
            }
            None => (AmaxGranularity::PerExpert, Group::None),
        };
        let block = match named.get("block") {
            Some(a) => Some((self.const_int(&a.value, "`block`")?, a.value.span)),
            None => None,
        };
        let want_block = match scheme.name.as_str() {
            "nvfp4" => Some(16),
            "mxfp4" => Some(32),
            _ => None,
        };
        if let (Some((b, sp)), Some(w)) = (block, want_block) {
            if b != w {
                self.err(
                    Diagnostic::error(
                        "E0105",
                        format!("`{}` blocks are {w} elements", scheme.name),
                    )
                    .with_label(sp, format!("found {b}")),
                );
                return None;
            }
        }
        // An argument that would have no effect is an error, not silently ignored.
        if let (Some(a), "fp8") = (named.get("amax"), scheme.name.as_str()) {
            let per_tensor_scales = named
                .get("granularity")
                .is_some_and(|g| matches!(&g.value.kind, ExprKind::Name(n) if n == "tensor"));
            if !per_tensor_scales {
                self.err(
                    Diagnostic::error("E0105", "`amax` has no effect for this `quant fp8`")
                        .with_label(
                            a.span,
                            "channel, block128 and group scales take each row's, block's or group's own amax",
                        )
                        .with_note("help: remove `amax = ...`"),
                );
                return None;
            }
            if amax == AmaxGranularity::PerTensor {
                self.err(
                    Diagnostic::error("E0105", "`quant fp8(granularity = tensor)` scales are per expert")
                        .with_label(a.span, "`per_tensor` would be ignored")
                        .with_note("help: write `amax = per_expert` (with `reduce moe_tp` where one expert is split over ranks)"),
                );
                return None;
            }
        }
        let q = match scheme.name.as_str() {
            "int4" => self.int4_scheme(&named)?,
            "nvfp4" => QuantScheme::Nvfp4 { amax, group },
            "mxfp4" => QuantScheme::Mxfp4,
            "fp8" => match (named.get("granularity"), named.get("group")) {
                (None, None) => {
                    self.err(
                        Diagnostic::error(
                            "E0105",
                            "`quant fp8` needs `granularity = tensor | channel | block128` or `group = g`",
                        )
                        .with_label(scheme.span, "no granularity given"),
                    );
                    return None;
                }
                (Some(a), Some(g)) => {
                    self.err(
                        Diagnostic::error(
                            "E0105",
                            "`quant fp8` takes `granularity = ...` or `group = g`, not both",
                        )
                        .with_label(g.span, "a scale per group")
                        .with_label(a.span, "another granularity"),
                    );
                    return None;
                }
                // Group-wise: a scale per `g` elements of a row.
                (None, Some(g)) => QuantScheme::Fp8 {
                    granularity: Fp8Granularity::Group {
                        group: self.scale_group(g, "fp8")?,
                    },
                    group,
                },
                (Some(a), None) => {
                    let g = match &a.value.kind {
                        ExprKind::Name(n) if n == "tensor" => Fp8Granularity::Tensor,
                        ExprKind::Name(n) if n == "channel" => Fp8Granularity::Channel,
                        ExprKind::Name(n) if n == "block128" => Fp8Granularity::Block128,
                        _ => {
                            self.err(
                                Diagnostic::error("E0104", "unknown fp8 granularity").with_label(
                                    a.value.span,
                                    "expected `tensor`, `channel` or `block128`",
                                ),
                            );
                            return None;
                        }
                    };
                    QuantScheme::Fp8 {
                        granularity: g,
                        group,
                    }
                }
            },
            _ => {
                if let Some(a) = named.get("granularity") {
                    if !matches!(&a.value.kind, ExprKind::Name(n) if n == "row") {
                        self.err(
                            Diagnostic::error("E0104", "unknown int8 granularity")
                                .with_label(a.value.span, "expected `row`"),
                        );
                        return None;
                    }
                }
                match (named.get("group"), named.get("granularity")) {
                    (Some(g), Some(a)) => {
                        self.err(
                            Diagnostic::error(
                                "E0105",
                                "`quant int8` takes `granularity = row` or `group = g`, not both",
                            )
                            .with_label(g.span, "a scale per group")
                            .with_label(a.span, "a scale per row"),
                        );
                        return None;
                    }
                    (Some(a), None) => QuantScheme::Int8Group {
                        group: self.scale_group(a, "int8")?,
                    },
                    (None, _) => QuantScheme::Int8Row,
                }
            }
        };
        let (values, blk) = match q {
            QuantScheme::Nvfp4 { .. } => (DType::E2m1, Some(16)),
            QuantScheme::Mxfp4 => (DType::E2m1, Some(32)),
            QuantScheme::Fp8 {
                granularity: Fp8Granularity::Group { group },
                ..
            } => (DType::E4m3, Some(group)),
            QuantScheme::Fp8 { .. } => (DType::E4m3, None),
            QuantScheme::Int8Row => (DType::I8, None),
            QuantScheme::Int8Group { group } => (DType::I8, Some(group)),
            QuantScheme::Int4 { group, .. } => (DType::U4, Some(group)),
        };
        if let Some(b) = blk {
            let k = shape.last().cloned().unwrap_or_default();
            if k.div_exact(b).is_none() {
                let shown = self.m.show(&k);
                self.err(
                    Diagnostic::error("E0204", format!("cannot prove that `{shown}` is divisible by {b}"))
                        .with_label(input.value.span, format!("`quant {}` blocks the last dimension `{shown}` of this tensor by {b}", scheme.name))
                        .with_note(format!("help: add a constraint to the where-clause, e.g. `where {shown} % {b} == 0`")),
                );
                return None;
            }
        }
        self.push(
            Op::Quant {
                scheme: q,
                input: x,
            },
            values,
            shape,
            span,
        )
    }

    /// A `group = g` argument of `quant int4` or `quant int8`: a power of two, at least 2.
    fn scale_group(&mut self, a: &Arg, scheme: &str) -> Option<i64> {
        let g = self.const_int(&a.value, "`group`")?;
        if g < 2 || g.count_ones() != 1 {
            self.err(
                Diagnostic::error(
                    "E0105",
                    format!("`quant {scheme}` groups are a power of two, at least 2"),
                )
                .with_label(a.value.span, format!("found {g}"))
                .with_note(if scheme == "fp8" {
                    "group-wise FP8 checkpoints use 128"
                } else {
                    "GPTQ and AWQ checkpoints use 32, 64 or 128"
                }),
            );
            return None;
        }
        Some(g)
    }

    /// `quant int4(x, group = g, zero_point = false|true, scale = bf16|f16|f32)`: the group (a
    /// power of two, at least 2; default 128), symmetric unless `zero_point = true`, bf16 scales
    /// unless said.
    fn int4_scheme(&mut self, named: &HashMap<&str, &Arg>) -> Option<QuantScheme> {
        let group = match named.get("group") {
            Some(a) => self.scale_group(a, "int4")?,
            None => 128,
        };
        let zero_point = match named.get("zero_point") {
            Some(a) => match &a.value.kind {
                ExprKind::Name(n) if n == "true" => true,
                ExprKind::Name(n) if n == "false" => false,
                _ => {
                    self.err(
                        Diagnostic::error("E0104", "unknown `zero_point` value")
                            .with_label(a.value.span, "expected `true` or `false`"),
                    );
                    return None;
                }
            },
            None => false,
        };
        let scale = match named.get("scale") {
            Some(a) => match &a.value.kind {
                ExprKind::Name(n) if matches!(n.as_str(), "bf16" | "f16" | "f32") => {
                    DType::from_name(n)?
                }
                _ => {
                    self.err(
                        Diagnostic::error("E0104", "unknown `int4` scale dtype")
                            .with_label(a.value.span, "expected `bf16`, `f16` or `f32`"),
                    );
                    return None;
                }
            },
            None => DType::Bf16,
        };
        Some(QuantScheme::Int4 {
            group,
            zero_point,
            scale,
        })
    }

    fn field(&mut self, base: &Expr, field: &ast::Ident, span: Span) -> Option<ValueId> {
        let q = match &base.kind {
            ExprKind::Name(n) => match self.lookup(n, base.span)? {
                Binding::Quant(q) => q,
                _ => {
                    self.err(
                        Diagnostic::error("E0106", format!("`{n}` has no field `{}`", field.name))
                            .with_label(base.span, "only quantizations have fields"),
                    );
                    return None;
                }
            },
            ExprKind::Quant { scheme, args } => self.quant(scheme, args, base.span)?,
            _ => {
                self.err(
                    Diagnostic::error("E0106", format!("no field `{}` here", field.name))
                        .with_label(base.span, "only quantizations have fields"),
                );
                return None;
            }
        };
        let qv = self.val(q)?.clone();
        let Op::Quant { scheme, .. } = qv.op else {
            return None;
        };
        let shape = qv.shape.clone();
        let e = shape[0].clone();
        let last = shape.len() - 1;
        let with_last = |k: Poly| {
            let mut s = shape.clone();
            s[last] = k;
            s
        };
        let per = |amax: AmaxGranularity| match amax {
            AmaxGranularity::PerExpert => vec![e.clone()],
            AmaxGranularity::PerTensor => Vec::new(),
        };
        let f = match field.name.as_str() {
            "values" => QuantField::Values,
            "scales" => QuantField::Scales,
            "global_scale" => QuantField::GlobalScale,
            "decode_scale" => QuantField::DecodeScale,
            "zeros" => QuantField::Zeros,
            _ => QuantField::Values,
        };
        let known = match scheme {
            QuantScheme::Nvfp4 { .. } => "`values`, `scales`, `global_scale`, `decode_scale`",
            QuantScheme::Int4 {
                zero_point: true, ..
            } => "`values`, `scales`, `zeros`",
            _ => "`values`, `scales`",
        };
        let out = match (field.name.as_str(), scheme) {
            ("values", _) => Some((qv.dtype, shape.clone())),
            ("scales", QuantScheme::Nvfp4 { .. }) => {
                Some((DType::E4m3, with_last(shape[last].div_exact(16)?)))
            }
            ("scales", QuantScheme::Mxfp4) => {
                Some((DType::E8m0, with_last(shape[last].div_exact(32)?)))
            }
            ("scales", QuantScheme::Fp8 { granularity, .. }) => Some((
                DType::F32,
                match granularity {
                    Fp8Granularity::Tensor => per(AmaxGranularity::PerExpert),
                    Fp8Granularity::Channel => shape[..last].to_vec(),
                    Fp8Granularity::Group { group } => with_last(shape[last].div_exact(group)?),
                    Fp8Granularity::Block128 => {
                        let mut s = shape[..last - 1].to_vec();
                        let m = self.cdiv(&shape[last - 1], 128, base.span)?;
                        let k = self.cdiv(&shape[last], 128, base.span)?;
                        s.push(m);
                        s.push(k);
                        s
                    }
                },
            )),
            ("scales", QuantScheme::Int8Row) => Some((DType::F32, shape[..last].to_vec())),
            ("scales", QuantScheme::Int8Group { group }) => {
                Some((DType::F32, with_last(shape[last].div_exact(group)?)))
            }
            ("scales", QuantScheme::Int4 { group, scale, .. }) => {
                Some((scale, with_last(shape[last].div_exact(group)?)))
            }
            (
                "zeros",
                QuantScheme::Int4 {
                    group,
                    zero_point: true,
                    ..
                },
            ) => {
                // Two groups' zero points share a byte: the groups of a row pair up.
                if shape[last].div_exact(2 * group).is_none() {
                    let shown = self.m.show(&shape[last]);
                    self.err(
                        Diagnostic::error(
                            "E0204",
                            format!("cannot prove that `{shown}` is divisible by {}", 2 * group),
                        )
                        .with_label(
                            field.span,
                            format!("u4 zero points pack two groups of {group} per byte"),
                        )
                        .with_note(format!(
                            "help: add a constraint to the where-clause, e.g. `where {shown} % {} == 0`",
                            2 * group
                        )),
                    );
                    return None;
                }
                Some((DType::U4, with_last(shape[last].div_exact(group)?)))
            }
            ("global_scale" | "decode_scale", QuantScheme::Nvfp4 { amax, .. }) => {
                Some((DType::F32, per(amax)))
            }
            _ => None,
        };
        let Some((dtype, shape)) = out else {
            self.err(
                Diagnostic::error(
                    "E0104",
                    format!("`quant {}` has no output `{}`", scheme.name(), field.name),
                )
                .with_label(field.span, format!("expected one of {known}")),
            );
            return None;
        };
        self.push(Op::Field { quant: q, field: f }, dtype, shape, span)
    }

    fn index(&mut self, base: ValueId, slices: &[SliceArg], span: Span) -> Option<ValueId> {
        let mut v = base;
        let shape = self.shape_of(v);
        if slices.len() != shape.len() {
            self.err(
                Diagnostic::error(
                    "E0201",
                    format!(
                        "shape mismatch: {} indices for a tensor of rank {}",
                        slices.len(),
                        shape.len()
                    ),
                )
                .with_label(
                    span,
                    format!("the tensor has shape {}", self.m.show_shape(&shape)),
                ),
            );
            return None;
        }
        // Right to left, so that dropping a dimension does not renumber the ones still to do.
        for (dim, s) in slices.iter().enumerate().rev() {
            let ext = shape[dim].clone();
            let dtype = self.dtype_of(v);
            let mut cur = self.shape_of(v);
            match s {
                SliceArg::Full(_) => {}
                SliceArg::Range {
                    start,
                    end,
                    span: sp,
                } => {
                    let a = match start {
                        Some(e) => self.size(e)?,
                        None => Poly::zero(),
                    };
                    let b = match end {
                        Some(e) => self.size(e)?,
                        None => ext.clone(),
                    };
                    let at = &self.m.atoms;
                    let ok = at.nonneg(&a)
                        && at.nonneg(&b.sub(&a).sub(&Poly::constant(1)))
                        && at.nonneg(&ext.sub(&b));
                    if !ok {
                        self.err(
                            Diagnostic::error("E0304", format!("slice `{}` is not provably inside dimension {dim} of extent `{}`", self.text(*sp), self.m.show(&ext)))
                                .with_label(*sp, "needs 0 <= start < end <= extent for every admissible binding"),
                        );
                        return None;
                    }
                    cur[dim] = b.sub(&a);
                    v = self.push(
                        Op::Slice {
                            base: v,
                            dim,
                            start: a,
                            end: b,
                        },
                        dtype,
                        cur,
                        *sp,
                    )?;
                }
                SliceArg::Expr(e) if self.is_index_expr(e) => {
                    let iv = self.index_vec(e)?;
                    if *iv.len() != ext {
                        self.err(
                            Diagnostic::error("E0201", format!("shape mismatch: row index of length `{}` for dimension {dim} of extent `{}`", self.m.show(iv.len()), self.m.show(&ext)))
                                .with_label(e.span, "the index must cover the whole dimension"),
                        );
                        return None;
                    }
                    v = self.push(
                        Op::Gather {
                            base: v,
                            dim,
                            index: iv,
                        },
                        dtype,
                        cur,
                        e.span,
                    )?;
                }
                SliceArg::Expr(e) => {
                    let i = self.size(e)?;
                    let at = &self.m.atoms;
                    if !(at.nonneg(&i) && at.nonneg(&ext.sub(&i).sub(&Poly::constant(1)))) {
                        self.err(
                            Diagnostic::error("E0304", format!("index `{}` is not provably inside dimension {dim} of extent `{}`", self.text(e.span), self.m.show(&ext)))
                                .with_label(e.span, "out of bounds for some admissible binding"),
                        );
                        return None;
                    }
                    cur.remove(dim);
                    v = self.push(
                        Op::Select {
                            base: v,
                            dim,
                            index: i,
                        },
                        dtype,
                        cur,
                        e.span,
                    )?;
                }
            }
        }
        Some(v)
    }

    fn call(&mut self, func: &ast::Ident, args: &[Arg], span: Span) -> Option<ValueId> {
        let name = func.name.as_str();
        match name {
            "swizzle_128x4" | "mma_sf_view" => {
                let [a] = self.positional::<1>(func, args)?;
                let x = self.value(&a.value)?;
                let shape = self.shape_of(x);
                let dt = self.dtype_of(x);
                if dt.bits() != 8 {
                    self.err(
                        Diagnostic::error(
                            "E0202",
                            format!("dtype mismatch: `{name}` needs 1-byte scales, found {dt}"),
                        )
                        .with_label(a.value.span, format!("this is {dt}")),
                    );
                    return None;
                }
                if name == "swizzle_128x4" {
                    if shape.len() < 2 {
                        self.err(
                            Diagnostic::error(
                                "E0201",
                                "shape mismatch: `swizzle_128x4` needs a tensor of rank 2 or more",
                            )
                            .with_label(
                                a.value.span,
                                format!("shape {}", self.m.show_shape(&shape)),
                            ),
                        );
                        return None;
                    }
                    let n = shape.len();
                    let mut out = shape.clone();
                    out[n - 2] = self.cdiv(&shape[n - 2], 128, a.value.span)?.scale(128);
                    out[n - 1] = self.cdiv(&shape[n - 1], 4, a.value.span)?.scale(4);
                    self.push(Op::Swizzle128x4 { base: x }, dt, out, span)
                } else {
                    if shape.len() != 3 {
                        self.err(
                            Diagnostic::error("E0201", "shape mismatch: `mma_sf_view` needs swizzled scales of shape [G, Mp, Kp]")
                                .with_label(a.value.span, format!("shape {}", self.m.show_shape(&shape))),
                        );
                        return None;
                    }
                    let (mt, kt) = (shape[1].div_exact(128), shape[2].div_exact(4));
                    let (Some(mt), Some(kt)) = (mt, kt) else {
                        self.err(
                            Diagnostic::error("E0204", "`mma_sf_view` needs rows padded to a multiple of 128 and columns to a multiple of 4")
                                .with_label(a.value.span, format!("shape {}: swizzle it with `swizzle_128x4` first", self.m.show_shape(&shape))),
                        );
                        return None;
                    };
                    let out = vec![
                        Poly::constant(32),
                        Poly::constant(4),
                        mt,
                        Poly::constant(4),
                        kt,
                        shape[0].clone(),
                    ];
                    self.push(Op::MmaSfView { base: x }, dt, out, span)
                }
            }
            "pad" | "reshape" | "permute" | "broadcast" => {
                let Some(first) = args.first().filter(|a| a.name.is_none()) else {
                    self.err(
                        Diagnostic::error("E0105", format!("`{name}` needs a tensor first"))
                            .with_label(func.span, "no tensor given"),
                    );
                    return None;
                };
                let x = self.value(&first.value)?;
                let shape = self.shape_of(x);
                let dt = self.dtype_of(x);
                let mut rest = Vec::new();
                for a in &args[1..] {
                    if a.name.is_some() {
                        self.err(
                            Diagnostic::error(
                                "E0105",
                                format!("`{name}` takes positional arguments only"),
                            )
                            .with_label(a.span, "named argument"),
                        );
                        return None;
                    }
                    rest.push(self.size(&a.value)?);
                }
                match name {
                    "pad" => {
                        if rest.len() != shape.len() {
                            self.err(
                                Diagnostic::error("E0201", format!("shape mismatch: `pad` needs one multiple per dimension ({})", shape.len()))
                                    .with_label(span, format!("{} given", rest.len())),
                            );
                            return None;
                        }
                        let mut mult = Vec::new();
                        let mut out = Vec::new();
                        for (k, (p, a)) in rest.iter().zip(&args[1..]).enumerate() {
                            let Some(c) = p.as_const().filter(|c| *c > 0) else {
                                self.err(
                                    Diagnostic::error(
                                        "E0106",
                                        "`pad` multiples must be positive constants",
                                    )
                                    .with_label(a.span, "not a constant"),
                                );
                                return None;
                            };
                            mult.push(c as i64);
                            out.push(self.cdiv(&shape[k], c as i64, a.span)?.scale(c));
                        }
                        self.push(
                            Op::Pad {
                                base: x,
                                multiples: mult,
                            },
                            dt,
                            out,
                            span,
                        )
                    }
                    "reshape" => {
                        self.positive_extents(name, &rest, &args[1..])?;
                        let a = rest.iter().fold(Poly::constant(1), |a, s| a.mul(s));
                        let b = shape.iter().fold(Poly::constant(1), |a, s| a.mul(s));
                        if a != b {
                            self.err(
                                Diagnostic::error(
                                    "E0201",
                                    format!(
                                        "shape mismatch: cannot reshape {} into {}",
                                        self.m.show_shape(&shape),
                                        self.m.show_shape(&rest)
                                    ),
                                )
                                .with_label(span, "the numbers of elements differ"),
                            );
                            return None;
                        }
                        self.push(
                            Op::Reshape {
                                base: x,
                                shape: rest.clone(),
                            },
                            dt,
                            rest,
                            span,
                        )
                    }
                    "permute" => {
                        let mut perm = Vec::new();
                        for p in &rest {
                            perm.push(p.as_const().unwrap_or(-1));
                        }
                        let mut sorted = perm.clone();
                        sorted.sort();
                        if sorted != (0..shape.len() as i128).collect::<Vec<_>>() {
                            self.err(
                                Diagnostic::error(
                                    "E0201",
                                    format!("`permute` needs a permutation of 0..{}", shape.len()),
                                )
                                .with_label(span, "not a permutation of the dimensions"),
                            );
                            return None;
                        }
                        let perm: Vec<usize> = perm.iter().map(|&p| p as usize).collect();
                        let out = perm.iter().map(|&p| shape[p].clone()).collect();
                        self.push(Op::Permute { base: x, perm }, dt, out, span)
                    }
                    _ => {
                        if !shape.is_empty() {
                            self.err(
                                Diagnostic::error(
                                    "E0201",
                                    format!(
                                        "shape mismatch: `broadcast` needs a scalar, found {}",
                                        self.m.show_shape(&shape)
                                    ),
                                )
                                .with_label(first.value.span, "not a scalar"),
                            );
                            return None;
                        }
                        self.positive_extents(name, &rest, &args[1..])?;
                        self.push(Op::Broadcast { base: x }, dt, rest, span)
                    }
                }
            }
            "cat" => {
                let dim_arg = args
                    .iter()
                    .find(|a| a.name.as_ref().is_some_and(|n| n.name == "dim"));
                let dim = match dim_arg {
                    Some(a) => self.size(&a.value)?.as_const().unwrap_or(-1),
                    None => 0,
                };
                let mut parts = Vec::new();
                for a in args.iter().filter(|a| a.name.is_none()) {
                    parts.push(self.value(&a.value)?);
                }
                let Some(&first) = parts.first() else {
                    self.err(
                        Diagnostic::error("E0105", "`cat` needs at least one tensor")
                            .with_label(func.span, "no tensors"),
                    );
                    return None;
                };
                let mut shape = self.shape_of(first);
                let dt = self.dtype_of(first);
                if dim < 0 || dim as usize >= shape.len() {
                    self.err(
                        Diagnostic::error(
                            "E0201",
                            format!("`cat` dimension {dim} is out of range"),
                        )
                        .with_label(span, format!("the tensors have rank {}", shape.len())),
                    );
                    return None;
                }
                let dim = dim as usize;
                for &p in &parts[1..] {
                    let s = self.shape_of(p);
                    let same = s.len() == shape.len()
                        && s.iter()
                            .zip(&shape)
                            .enumerate()
                            .all(|(k, (a, b))| k == dim || a == b);
                    if !same || self.dtype_of(p) != dt {
                        self.err(
                            Diagnostic::error("E0201", format!("shape mismatch: `cat` of {} and {}", self.m.show_shape(&shape), self.m.show_shape(&s)))
                                .with_label(span, format!("all parts must agree outside dimension {dim} and have one dtype")),
                        );
                        return None;
                    }
                    shape[dim] = shape[dim].add(&s[dim]);
                }
                self.push(Op::Cat { parts, dim }, dt, shape, span)
            }
            "reduce_max" => {
                let base = args.iter().find(|a| a.name.is_none());
                let group = args
                    .iter()
                    .find(|a| a.name.as_ref().is_some_and(|n| n.name == "group"));
                let (Some(base), Some(group)) = (base, group) else {
                    self.err(
                        Diagnostic::error(
                            "E0105",
                            "`reduce_max` takes a tensor and `group = none | tp | moe_tp | ep`",
                        )
                        .with_label(func.span, "e.g. `reduce_max(w13_input_scale, group = ep)`"),
                    );
                    return None;
                };
                let x = self.value(&base.value)?;
                let g = match &group.value.kind {
                    ExprKind::Name(n) => Group::from_name(n),
                    _ => None,
                };
                let Some(g) = g else {
                    self.err(
                        Diagnostic::error("E0104", "unknown process group").with_label(
                            group.value.span,
                            "expected `none`, `tp`, `moe_tp` or `ep`",
                        ),
                    );
                    return None;
                };
                if self.dtype_of(x) != DType::F32 {
                    let dt = self.dtype_of(x);
                    self.err(
                        Diagnostic::error(
                            "E0202",
                            format!("dtype mismatch: `reduce_max` needs f32, found {dt}"),
                        )
                        .with_label(base.value.span, format!("this is {dt}")),
                    );
                    return None;
                }
                self.push(
                    Op::ReduceMax { base: x, group: g },
                    DType::F32,
                    Vec::new(),
                    span,
                )
            }
            "arange" | "swap_halves" | "interleave" => {
                self.err(
                    Diagnostic::error("E0106", format!("`{name}` is a row index, not a tensor"))
                        .with_label(span, "use it inside `[...]`, e.g. `x[:, rows, :]`"),
                );
                None
            }
            "ceil_div" | "round_up" | "cd" | "ru" => {
                self.err(
                    Diagnostic::error("E0106", format!("`{name}` is a size, not a tensor"))
                        .with_label(span, "a tensor is needed here"),
                );
                None
            }
            _ => {
                self.err(
                    Diagnostic::error("E0104", format!("unknown function `{name}`"))
                        .with_label(func.span, "not a function of the recipe language")
                        .with_note(format!("the functions are {FUNCTIONS}")),
                );
                None
            }
        }
    }

    fn tuple(&mut self, t: &TupleLit) -> Option<Vec<Vec<Poly>>> {
        // Top-level entries; each flattened to its leaves.
        fn leaves(l: &mut Lower<'_>, t: &TupleLit, out: &mut Vec<Poly>) -> Option<()> {
            match t {
                TupleLit::Leaf(e) => {
                    out.push(l.size(e)?);
                }
                TupleLit::Tuple(ts, _) => {
                    for x in ts {
                        leaves(l, x, out)?;
                    }
                }
            }
            Some(())
        }
        match t {
            TupleLit::Leaf(_) => {
                let mut v = Vec::new();
                leaves(self, t, &mut v)?;
                Some(vec![v])
            }
            TupleLit::Tuple(ts, _) => {
                let mut out = Vec::new();
                for x in ts {
                    let mut v = Vec::new();
                    leaves(self, x, &mut v)?;
                    out.push(v);
                }
                Some(out)
            }
        }
    }

    fn layout_lit(&mut self, l: &ast::LayoutLit) -> Option<SymLayout> {
        let shape = self.tuple(&l.shape)?;
        let stride = self.tuple(&l.stride)?;
        let congruent = shape.len() == stride.len()
            && shape.iter().zip(&stride).all(|(a, b)| a.len() == b.len());
        if !congruent {
            self.err(
                Diagnostic::error("E0201", "shape and stride of a layout are not congruent")
                    .with_label(
                        l.span,
                        "each shape entry needs a stride entry of the same form",
                    ),
            );
            return None;
        }
        for (k, s) in shape.iter().flatten().enumerate() {
            if !self.m.atoms.nonneg(&s.sub(&Poly::constant(1))) {
                self.err(
                    Diagnostic::error(
                        "E0201",
                        format!("layout extent #{k} is not provably positive"),
                    )
                    .with_label(l.span, "extents must be at least 1"),
                );
                return None;
            }
        }
        let swizzle = match l.swizzle {
            Some((b, m, s, sp)) => {
                if !(0..=16).contains(&b) || !(0..=16).contains(&m) || s.abs() > 16 || s.abs() < b {
                    self.err(
                        Diagnostic::error(
                            "E0201",
                            format!("`S<{b},{m},{s}>` is not a valid swizzle"),
                        )
                        .with_label(sp, "need 0 <= B, M <= 16 and B <= |S| <= 16"),
                    );
                    return None;
                }
                Some(Swizzle::new(b as u32, m as u32, s as i32))
            }
            None => None,
        };
        Some(SymLayout {
            dims: shape
                .into_iter()
                .zip(stride)
                .map(|(a, b)| a.into_iter().zip(b).collect())
                .collect(),
            offset: Poly::zero(),
            swizzle,
        })
    }

    // ---- types ----------------------------------------------------------------------------------

    fn type_expr(&mut self, t: &ast::TypeExpr) -> Option<(DType, Vec<Poly>)> {
        let Some(dt) = DType::from_name(&t.dtype.name) else {
            self.err(
                Diagnostic::error("E0103", format!("unknown dtype `{}`", t.dtype.name))
                    .with_label(t.dtype.span, "not a dtype")
                    .with_note(format!(
                        "the dtypes are {}",
                        DType::ALL
                            .iter()
                            .map(|d| format!("`{d}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
            );
            return None;
        };
        let mut shape = Vec::new();
        for d in &t.dims {
            let p = self.size(d)?;
            if !self.m.atoms.nonneg(&p.sub(&Poly::constant(1))) {
                self.err(
                    Diagnostic::error(
                        "E0201",
                        format!("extent `{}` is not provably positive", self.text(d.span)),
                    )
                    .with_label(
                        d.span,
                        "extents must be at least 1 for every admissible binding",
                    ),
                );
                return None;
            }
            shape.push(p);
        }
        let bits = shape
            .iter()
            .fold(Poly::constant(1), |a, s| a.mul(s))
            .scale(dt.bits() as i128);
        if bits.overflowed() {
            self.err(
                Diagnostic::error("E0207", "size arithmetic overflows").with_label(
                    t.span,
                    "the size of this tensor in bits leaves the 128-bit range",
                ),
            );
            return None;
        }
        Some((dt, shape))
    }

    /// Extents computed by an operation (`reshape`, `broadcast`) must be provably at least 1, as
    /// declared ones are.
    fn positive_extents(&mut self, name: &str, extents: &[Poly], args: &[Arg]) -> Option<()> {
        for (p, a) in extents.iter().zip(args) {
            if !self.m.atoms.nonneg(&p.sub(&Poly::constant(1))) {
                self.err(
                    Diagnostic::error(
                        "E0201",
                        format!(
                            "`{name}` extent `{}` is not provably positive",
                            self.text(a.value.span)
                        ),
                    )
                    .with_label(
                        a.value.span,
                        "extents must be at least 1 for every admissible binding",
                    ),
                );
                return None;
            }
        }
        Some(())
    }

    fn add_tensor(&mut self, t: Tensor) -> TensorId {
        self.m.tensors.push(t);
        TensorId(self.m.tensors.len() as u32 - 1)
    }

    fn is_optional(&self, v: ValueId) -> bool {
        self.m
            .tensors_read(v)
            .iter()
            .any(|t| self.m.tensor(*t).is_some_and(|t| t.optional))
    }

    // ---- statements ---------------------------------------------------------------------------

    fn stmt(&mut self, s: &Stmt) {
        let before = self.errors.len();
        let name = match s {
            Stmt::Input { name, .. }
            | Stmt::Param { name, .. }
            | Stmt::View { name, .. }
            | Stmt::Let { name, .. }
            | Stmt::Kernel { name, .. } => name.clone(),
            Stmt::Activation { scheme, .. } => scheme.clone(),
        };
        let ok = self.stmt_inner(s).is_some();
        if !ok && self.errors.len() == before {
            // Nothing said why: a use of a name poisoned by an earlier error, or a gap. Remembered,
            // so that a recipe never verifies without one of its statements.
            self.dropped.push((name.name.clone(), name.span));
        }
        if !ok
            && !matches!(s, Stmt::Kernel { .. } | Stmt::Activation { .. })
            && self.errors.len() > before
        {
            self.define(&name, Binding::Poisoned);
        }
    }

    fn stmt_inner(&mut self, s: &Stmt) -> Option<()> {
        match s {
            Stmt::Input {
                name,
                ty,
                optional,
                span,
            } => {
                if !self.check_fresh(name, false) {
                    return None;
                }
                if let Some(l) = &ty.layout {
                    self.err(
                        Diagnostic::error("E0106", "an input has no storage layout")
                            .with_label(l.span, "inputs are read from the checkpoint as they are"),
                    );
                    return None;
                }
                let (dtype, shape) = self.type_expr(ty)?;
                let id = self.add_tensor(Tensor {
                    name: name.name.clone(),
                    kind: TensorKind::Input {
                        optional: *optional,
                    },
                    dtype,
                    shape,
                    value: None,
                    declared_layout: None,
                    alias: None,
                    optional: *optional,
                    span: *span,
                    name_span: name.span,
                });
                self.define(name, Binding::Tensor(id));
                Some(())
            }
            Stmt::Param {
                name,
                ty,
                value,
                span,
            } => {
                if !self.check_fresh(name, true) {
                    return None;
                }
                let shadowed = match self.env.get(&name.name) {
                    Some(Binding::Tensor(t)) => Some(*t),
                    _ => None,
                };
                let (dtype, shape) = self.type_expr(ty)?;
                let v = self.value(value)?;
                self.check_type(&name.name, ty, dtype, &shape, v, value.span)?;
                let declared_layout = match &ty.layout {
                    Some(l) => {
                        let lay = self.layout_lit(l)?;
                        let ls = lay.shape();
                        if ls != shape {
                            self.err(
                                Diagnostic::error("E0201", format!("shape mismatch: the layout of `{}` has shape {} but the param is {}", name.name, self.m.show_shape(&ls), self.m.show_shape(&shape)))
                                    .with_label(l.span, "the layout's modes must multiply to the declared extents"),
                            );
                            return None;
                        }
                        Some((lay, l.span))
                    }
                    // `swizzle_128x4` pads; its storage is the 128x4 tile layout unless one is declared.
                    None => match self.val(v).map(|x| &x.op) {
                        Some(Op::Swizzle128x4 { .. }) => {
                            swizzle_128x4_storage(&shape).map(|l| (l, value.span))
                        }
                        _ => None,
                    },
                };
                for t in self.m.tensors_read(v) {
                    self.consumed_by_param.insert(t);
                }
                let optional = self.is_optional(v);
                let id = self.add_tensor(Tensor {
                    name: name.name.clone(),
                    kind: TensorKind::Param,
                    dtype,
                    shape,
                    value: Some(v),
                    declared_layout,
                    alias: None,
                    optional,
                    span: *span,
                    name_span: name.span,
                });
                if let Some(old) = shadowed {
                    self.m.shadows.push((old, id));
                }
                self.define(name, Binding::Tensor(id));
                Some(())
            }
            Stmt::View {
                name,
                ty,
                value,
                bijective,
                span,
            } => {
                if !self.check_fresh(name, false) {
                    return None;
                }
                let v = self.value(value)?;
                let (param, layout) = self.view_source(&name.name, v, value.span)?;
                let (dtype, shape) = {
                    let val = self.val(v)?;
                    (val.dtype, val.shape.clone())
                };
                if let Some(ty) = ty {
                    let (dt, sh) = self.type_expr(ty)?;
                    self.check_type(&name.name, ty, dt, &sh, v, value.span)?;
                }
                let optional = self.m.tensor(param).is_some_and(|t| t.optional);
                let id = self.add_tensor(Tensor {
                    name: name.name.clone(),
                    kind: TensorKind::View {
                        bijective: *bijective,
                    },
                    dtype,
                    shape,
                    value: Some(v),
                    declared_layout: None,
                    alias: Some((param, layout)),
                    optional,
                    span: *span,
                    name_span: name.span,
                });
                self.define(name, Binding::Tensor(id));
                Some(())
            }
            Stmt::Let { name, value, span } => {
                if !self.check_fresh(name, false) {
                    return None;
                }
                if let ExprKind::Quant { scheme, args } = &value.kind {
                    let q = self.quant(scheme, args, value.span)?;
                    self.define(name, Binding::Quant(q));
                    return Some(());
                }
                if self.is_index_expr(value) {
                    let iv = self.index_vec(value)?;
                    self.define(name, Binding::Index(iv));
                    return Some(());
                }
                if self.is_size_expr(value) {
                    let p = self.size(value)?;
                    self.define(name, Binding::Size(p));
                    return Some(());
                }
                let v = self.value(value)?;
                let (dtype, shape) = {
                    let val = self.val(v)?;
                    (val.dtype, val.shape.clone())
                };
                let optional = self.is_optional(v);
                let id = self.add_tensor(Tensor {
                    name: name.name.clone(),
                    kind: TensorKind::Let,
                    dtype,
                    shape,
                    value: Some(v),
                    declared_layout: None,
                    alias: None,
                    optional,
                    span: *span,
                    name_span: name.span,
                });
                self.define(name, Binding::Tensor(id));
                Some(())
            }
            Stmt::Kernel {
                name,
                operands,
                targets,
                index,
                span,
            } => {
                if !self.kernel_names.insert(name.name.clone()) {
                    self.err(
                        Diagnostic::error(
                            "E0102",
                            format!("kernel `{}` is defined twice", name.name),
                        )
                        .with_label(name.span, "defined again here"),
                    );
                    return None;
                }
                let mut ops = Vec::new();
                for o in operands {
                    let Binding::Tensor(t) = self.lookup(&o.name, o.span)? else {
                        self.err(
                            Diagnostic::error(
                                "E0404",
                                format!(
                                    "kernel `{}` reads `{}`, which is not a tensor",
                                    name.name, o.name
                                ),
                            )
                            .with_label(o.span, "kernels read params and views"),
                        );
                        return None;
                    };
                    let kind = self.m.tensor(t)?.kind.clone();
                    match kind {
                        TensorKind::Param | TensorKind::View { .. } => ops.push((t, o.span)),
                        TensorKind::Input { .. } | TensorKind::Let => {
                            let what = if matches!(kind, TensorKind::Let) {
                                "a `let` value"
                            } else {
                                "an input"
                            };
                            self.err(
                                Diagnostic::error("E0404", format!("kernel `{}` reads `{}`, {what} that is not registered", name.name, o.name))
                                    .with_label(o.span, "not a param or a view")
                                    .with_note("a value a kernel reads must be a `param` (or a `view` of one) so that EPLB moves it with its expert"),
                            );
                            return None;
                        }
                    }
                }
                let mut ts = Vec::new();
                for t in targets {
                    match Target::from_name(&t.name) {
                        Some(x) => ts.push(x),
                        None => {
                            self.err(
                                Diagnostic::error("E0104", format!("unknown target `{}`", t.name))
                                    .with_label(t.span, "expected `sm_90a`, `sm_100a` or `host`"),
                            );
                            return None;
                        }
                    }
                }
                let idx = match index {
                    None => (IndexWidth::I64, None),
                    Some(w) if w.name == "i32" => (IndexWidth::I32, Some(w.span)),
                    Some(w) if w.name == "i64" => (IndexWidth::I64, Some(w.span)),
                    Some(w) => {
                        self.err(
                            Diagnostic::error("E0104", format!("unknown index width `{}`", w.name))
                                .with_label(w.span, "expected `i32` or `i64`"),
                        );
                        return None;
                    }
                };
                self.m.kernels.push(KernelBinding {
                    name: name.name.clone(),
                    operands: ops,
                    targets: ts,
                    index: idx,
                    span: *span,
                });
                Some(())
            }
            Stmt::Activation {
                scheme,
                mode,
                fallback,
                span,
            } => self.activation_stmt(scheme, mode.as_ref(), fallback.as_ref(), *span),
        }
    }

    fn check_type(
        &mut self,
        name: &str,
        ty: &ast::TypeExpr,
        dtype: DType,
        shape: &[Poly],
        v: ValueId,
        vspan: Span,
    ) -> Option<()> {
        let (vd, vs) = {
            let val = self.val(v)?;
            (val.dtype, val.shape.clone())
        };
        if vd != dtype {
            self.err(
                Diagnostic::error(
                    "E0202",
                    format!("dtype mismatch: `{name}` is declared {dtype} but its value is {vd}"),
                )
                .with_label(ty.dtype.span, format!("declared {dtype}"))
                .with_label(vspan, format!("this is {vd}")),
            );
            return None;
        }
        if vs.len() != shape.len() {
            self.err(
                Diagnostic::error(
                    "E0201",
                    format!(
                        "shape mismatch: `{name}` is declared {} but its value has shape {}",
                        self.m.show_shape(shape),
                        self.m.show_shape(&vs)
                    ),
                )
                .with_label(ty.span, format!("rank {}", shape.len()))
                .with_label(vspan, format!("rank {}", vs.len())),
            );
            return None;
        }
        for (k, (a, b)) in shape.iter().zip(&vs).enumerate() {
            if a != b {
                let sp = ty.dims.get(k).map(|d| d.span).unwrap_or(ty.span);
                self.err(
                    Diagnostic::error(
                        "E0201",
                        format!(
                            "shape mismatch: `{name}` is declared {} but its value has shape {}",
                            self.m.show_shape(shape),
                            self.m.show_shape(&vs)
                        ),
                    )
                    .with_label(
                        sp,
                        format!("dimension {k} is declared `{}`", self.m.show(a)),
                    )
                    .with_label(
                        vspan,
                        format!("dimension {k} of the value is `{}`", self.m.show(b)),
                    ),
                );
                return None;
            }
        }
        Some(())
    }

    /// Classify a view's definition: exactly one param, layout operations only.
    fn view_source(&mut self, name: &str, v: ValueId, span: Span) -> Option<(TensorId, SymLayout)> {
        let mut params: Vec<(TensorId, Span)> = Vec::new();
        let mut others: Vec<(TensorId, Span)> = Vec::new();
        let mut computes: Option<(String, Span)> = None;
        let mut stack = vec![v];
        while let Some(x) = stack.pop() {
            let val = self.val(x)?.clone();
            if let Op::Tensor(t) = val.op {
                let tk = self.m.tensor(t)?;
                if tk.kind == TensorKind::Param {
                    if !params.iter().any(|p| p.0 == t) {
                        params.push((t, val.span));
                    }
                } else {
                    others.push((t, val.span));
                }
            } else if !val.op.is_layout_only() && computes.is_none() {
                computes = Some((val.op.describe().to_string(), val.span));
            }
            stack.extend(val.op.operands());
        }
        params.sort_by_key(|p| p.1.start);
        if params.len() >= 2 {
            let names: Vec<String> = params
                .iter()
                .map(|p| {
                    format!(
                        "`{}`",
                        self.m.tensor(p.0).map(|t| t.name.as_str()).unwrap_or("?")
                    )
                })
                .collect();
            let mut d = Diagnostic::error(
                "E0302",
                format!(
                    "view `{name}` reads {} params ({})",
                    params.len(),
                    names.join(", ")
                ),
            )
            .with_label(span, "a view aliases exactly one param");
            for p in &params {
                d = d.with_label(p.1, "a param");
            }
            self.err(d.with_note(
                "help: a value built from several params is new storage: declare it as a `param`",
            ));
            return None;
        }
        if let Some((what, sp)) = computes {
            let shape = self.shape_of(v);
            let dt = self.dtype_of(v);
            self.err(
                Diagnostic::error("E0301", format!("view `{name}` computes a new value, it is not a view"))
                    .with_label(sp, format!("{what} computes new values; a view only re-indexes one param's storage"))
                    .with_note(format!("help: make it a param so that EPLB moves it with its expert: `param {name} : {dt}{} = ...`", self.m.show_shape(&shape))),
            );
            return None;
        }
        if let Some((t, sp)) = others.first() {
            let tn = self.m.tensor(*t)?.name.clone();
            let kind = match self.m.tensor(*t)?.kind {
                TensorKind::Let => "a `let` value",
                TensorKind::View { .. } => {
                    "a view (a view of a view aliases the view's param: write it over the param)"
                }
                _ => "an input",
            };
            self.err(
                Diagnostic::error(
                    "E0303",
                    format!("view `{name}` aliases `{tn}`, {kind}, not a param"),
                )
                .with_label(*sp, "only params have storage after packing"),
            );
            return None;
        }
        let Some(&(param, _)) = params.first() else {
            self.err(
                Diagnostic::error("E0303", format!("view `{name}` reads no param"))
                    .with_label(span, "a view aliases exactly one param"),
            );
            return None;
        };
        let lay = self.view_layout(name, v)?;
        Some((param, lay))
    }

    fn contiguous(&self, l: &SymLayout) -> bool {
        let shape = l.shape();
        l.swizzle.is_none() && l.offset.is_const(0) && *l == SymLayout::row_major(&shape)
    }

    /// The layout of a view's value over its param's storage: down the chain of bases to the
    /// tensor, then each layout operation applied from the tensor up (a loop: the chain may be long).
    fn view_layout(&mut self, name: &str, v: ValueId) -> Option<SymLayout> {
        let mut chain = Vec::new();
        let mut x = v;
        let mut l = loop {
            match &self.val(x)?.op {
                Op::Tensor(t) => break self.m.tensor(*t)?.storage_layout(),
                Op::Slice { base, .. }
                | Op::Select { base, .. }
                | Op::Permute { base, .. }
                | Op::Reshape { base, .. }
                | Op::MmaSfView { base }
                | Op::Apply { base, .. } => {
                    chain.push(x);
                    x = *base;
                }
                _ => return None,
            }
        };
        for &x in chain.iter().rev() {
            l = self.view_step(name, x, l)?;
        }
        Some(l)
    }

    /// One layout operation `v` applied to the layout `l` of its base.
    fn view_step(&mut self, name: &str, v: ValueId, l: SymLayout) -> Option<SymLayout> {
        let val = self.val(v)?.clone();
        let span = val.span;
        let need_single =
            |l: &mut Lower<'_>, lay: &SymLayout, dim: usize| -> Option<(Poly, Poly)> {
                match lay.dims.get(dim) {
                    Some(d) if d.len() == 1 => Some(d[0].clone()),
                    _ => {
                        l.err(
                            Diagnostic::error(
                                "E0306",
                                format!("view `{name}` slices a hierarchical mode"),
                            )
                            .with_label(
                                span,
                                "slice a dimension with a single stride, or reshape first",
                            ),
                        );
                        None
                    }
                }
            };
        match &val.op {
            Op::Slice {
                dim, start, end, ..
            } => {
                let mut l = l;
                // A hierarchical mode slices along its last (slowest) sub-mode, where the bounds are
                // multiples of the inner sub-modes' extent: (s0,..,sk):(d0,..,dk)[a:b] is
                // (s0,..,(b-a)/P):(d0,..,dk) at offset (a/P)*dk, P = s0*..*s(k-1).
                if let Some(mode) = l.dims.get(*dim).filter(|m| m.len() > 1) {
                    let (last, inner) = mode.split_last()?;
                    let p = inner.iter().fold(Poly::constant(1), |a, (s, _)| a.mul(s));
                    if let (Some(a), Some(n)) =
                        (start.div_monomial(&p), end.sub(start).div_monomial(&p))
                    {
                        let mut m = inner.to_vec();
                        m.push((n, last.1.clone()));
                        l.offset = l.offset.add(&a.mul(&last.1));
                        l.dims[*dim] = m;
                        return Some(l);
                    }
                }
                let (_, d) = need_single(self, &l, *dim)?;
                l.offset = l.offset.add(&start.mul(&d));
                l.dims[*dim] = vec![(end.sub(start), d)];
                Some(l)
            }
            Op::Select { dim, index, .. } => {
                let mut l = l;
                let (_, d) = need_single(self, &l, *dim)?;
                l.offset = l.offset.add(&index.mul(&d));
                l.dims.remove(*dim);
                Some(l)
            }
            Op::Permute { perm, .. } => Some(SymLayout {
                dims: perm.iter().map(|&p| l.dims[p].clone()).collect(),
                ..l
            }),
            Op::Reshape { shape, .. } => {
                if l.swizzle.is_none()
                    && SymLayout::row_major(&l.shape())
                        == (SymLayout {
                            offset: Poly::zero(),
                            ..l.clone()
                        })
                {
                    // Compact row-major storage: any reshape is a reinterpretation.
                    return Some(SymLayout {
                        offset: l.offset,
                        ..SymLayout::row_major(shape)
                    });
                }
                self.reshape(name, &l, shape, span)
            }
            Op::MmaSfView { .. } => {
                // SPEC §2: view coordinate (r%32, (r%128)/32, r/128, c%4, c/4, g) stands for the
                // logical scale S_g[r, c]: the logical modes split, composed with the storage layout.
                let s = l.shape();
                let (mt, kt) = (s[1].div_exact(128)?, s[2].div_exact(4)?);
                let c = |x: i128| Poly::constant(x);
                let split = |d: &[(Poly, Poly)], parts: &[Poly]| split_mode(d, parts);
                let composed = match (
                    l.dims.first(),
                    split(&l.dims[1], &[c(32), c(4), mt.clone()]),
                    split(&l.dims[2], &[c(4), kt.clone()]),
                ) {
                    (Some(g), Some(r), Some(k)) if g.len() == 1 && l.swizzle.is_none() => {
                        Some(SymLayout {
                            dims: vec![
                                vec![r[0].clone()],
                                vec![r[1].clone()],
                                vec![r[2].clone()],
                                vec![k[0].clone()],
                                vec![k[1].clone()],
                                g.clone(),
                            ],
                            offset: l.offset.clone(),
                            swizzle: None,
                        })
                    }
                    _ => None,
                };
                let tile = kt.scale(512);
                let canonical = SymLayout {
                    dims: vec![
                        vec![(c(32), c(16))],
                        vec![(c(4), c(4))],
                        vec![(mt.clone(), tile.clone())],
                        vec![(c(4), c(1))],
                        vec![(kt.clone(), c(512))],
                        vec![(s[0].clone(), mt.mul(&tile))],
                    ],
                    offset: Poly::zero(),
                    swizzle: None,
                };
                match composed {
                    Some(v) if v == canonical => Some(v),
                    other => {
                        let got = match &other {
                            Some(v) => format!("its storage gives {}", v.display(&self.m.atoms)),
                            None => format!(
                                "its storage {} does not split into the MMA modes",
                                l.display(&self.m.atoms)
                            ),
                        };
                        self.err(
                            Diagnostic::error(
                                "E0306",
                                format!(
                                    "view `{name}`: `mma_sf_view` needs scales stored in the 128x4 tile layout"
                                ),
                            )
                            .with_label(span, got)
                            .with_note(format!(
                                "the MMA reads {}",
                                canonical.display(&self.m.atoms)
                            ))
                            .with_note("help: store the scales with `swizzle_128x4(...)` (a padded param alone is not swizzled)"),
                        );
                        None
                    }
                }
            }
            Op::Apply { layout, .. } => {
                if !self.contiguous(&l) {
                    self.err(
                        Diagnostic::error(
                            "E0306",
                            format!("view `{name}`: an explicit layout needs contiguous storage"),
                        )
                        .with_label(span, "apply the layout to the param itself"),
                    );
                    return None;
                }
                Some(layout.clone())
            }
            _ => None,
        }
    }

    /// Row-major reshape of a symbolic layout without a copy: splits a mode when the new extent
    /// divides it, groups whole modes into a hierarchical mode when it is their product.
    fn reshape(
        &mut self,
        name: &str,
        l: &SymLayout,
        shape: &[Poly],
        span: Span,
    ) -> Option<SymLayout> {
        if l.swizzle.is_some() {
            self.err(
                Diagnostic::error(
                    "E0306",
                    format!("view `{name}`: cannot reshape a swizzled layout"),
                )
                .with_label(span, "here"),
            );
            return None;
        }
        // Leaves from slowest to fastest (row-major): within a dim, CuTe's first sub-mode is fastest.
        let mut leaves: Vec<(Poly, Poly)> = Vec::new();
        for d in &l.dims {
            for m in d.iter().rev() {
                if !m.0.is_const(1) {
                    leaves.push(m.clone());
                }
            }
        }
        leaves.reverse(); // pop() yields the slowest first
        let fail = |l: &mut Lower<'_>| {
            l.err(
                Diagnostic::error("E0306", format!("view `{name}`: this reshape needs a copy"))
                    .with_label(span, "the new extents do not split or merge the source's modes")
                    .with_note("help: a reshape view may split a mode by a factor of its extent or group whole modes"),
            );
            None
        };
        let mut dims = Vec::new();
        for t in shape {
            let mut need = t.clone();
            let mut group: Vec<(Poly, Poly)> = Vec::new();
            while !need.is_const(1) {
                let Some((s, d)) = leaves.pop() else {
                    return fail(self);
                };
                if s == need {
                    group.push((s, d));
                    need = Poly::constant(1);
                } else if let Some(q) = s.div_monomial(&need) {
                    group.push((need.clone(), q.mul(&d)));
                    leaves.push((q, d));
                    need = Poly::constant(1);
                } else if let Some(q) = need.div_monomial(&s) {
                    group.push((s, d));
                    need = q;
                } else {
                    return fail(self);
                }
            }
            if group.is_empty() {
                group.push((Poly::constant(1), Poly::zero()));
            }
            group.reverse(); // colexicographic: fastest first
            dims.push(group);
        }
        if !leaves.is_empty() {
            return fail(self);
        }
        Some(SymLayout {
            dims,
            offset: l.offset.clone(),
            swizzle: None,
        })
    }

    /// A quantization's codes mean nothing without their scales: a recipe that registers `.values`
    /// must register `.scales` (and NVFP4's `.decode_scale` or `.global_scale`) of that quantization.
    fn check_values_have_scales(&mut self) {
        // quantization node -> (values param span and name, fields held)
        type Held = (ValueId, Option<(Span, String)>, Vec<QuantField>);
        let mut held: Vec<Held> = Vec::new();
        for (_, t) in self.m.tensors_with_ids() {
            if t.kind != TensorKind::Param {
                continue;
            }
            let Some(v) = t.value else { continue };
            let (v, _, _) = crate::roles::peel(&self.m, v);
            let Some(Op::Field { quant, field }) = self.m.value(v).map(|x| x.op.clone()) else {
                continue;
            };
            let k = match held.iter().position(|h| h.0 == quant) {
                Some(k) => k,
                None => {
                    held.push((quant, None, Vec::new()));
                    held.len() - 1
                }
            };
            if field == QuantField::Values {
                held[k].1 = Some((t.name_span, t.name.clone()));
            }
            held[k].2.push(field);
        }
        for (q, values, fields) in held {
            let Some((span, name)) = values else { continue };
            let nvfp4 = matches!(
                self.m.value(q).map(|x| &x.op),
                Some(Op::Quant {
                    scheme: QuantScheme::Nvfp4 { .. },
                    ..
                })
            );
            let asymmetric = matches!(
                self.m.value(q).map(|x| &x.op),
                Some(Op::Quant {
                    scheme: QuantScheme::Int4 {
                        zero_point: true,
                        ..
                    },
                    ..
                })
            );
            let mut missing = Vec::new();
            if !fields.contains(&QuantField::Scales) {
                missing.push("`.scales`");
            }
            if asymmetric && !fields.contains(&QuantField::Zeros) {
                missing.push("`.zeros`");
            }
            if nvfp4
                && !fields.contains(&QuantField::DecodeScale)
                && !fields.contains(&QuantField::GlobalScale)
            {
                missing.push("`.decode_scale` (or `.global_scale`)");
            }
            if !missing.is_empty() {
                self.err(
                    Diagnostic::error(
                        "E0405",
                        format!(
                            "param `{name}` holds quantized codes whose scales are not registered"
                        ),
                    )
                    .with_label(
                        span,
                        format!(
                            "no param holds {} of this quantization",
                            missing.join(" or ")
                        ),
                    )
                    .with_note(
                        "the codes mean nothing without their scales, and EPLB moves only params",
                    )
                    .with_note("help: add a `param` for each missing output"),
                );
            }
        }
    }

    /// Whether a value reads a param's elements other than through `reduce_max` (through lets).
    fn reads_params_unreduced(&self, v: ValueId, depth: usize) -> bool {
        let Some(val) = self.m.value(v) else {
            return false;
        };
        if depth > 10_000 {
            return true;
        }
        match &val.op {
            Op::ReduceMax { .. } => false,
            Op::Tensor(t) => match self.m.tensor(*t) {
                Some(x) if x.kind == TensorKind::Param => true,
                Some(x) if x.kind == TensorKind::Let => x
                    .value
                    .is_some_and(|d| self.reads_params_unreduced(d, depth + 1)),
                _ => false,
            },
            op => op
                .operands()
                .into_iter()
                .any(|o| self.reads_params_unreduced(o, depth + 1)),
        }
    }

    fn check_unregistered_lets(&mut self) {
        let experts = self.experts.clone();
        let lets: Vec<(TensorId, Tensor)> = self
            .m
            .tensors_with_ids()
            .filter(|(_, t)| t.kind == TensorKind::Let)
            .map(|(i, t)| (i, t.clone()))
            .collect();
        for (id, t) in lets {
            let Some(v) = t.value else { continue };
            let from_params: Vec<String> = self
                .m
                .tensors_read(v)
                .iter()
                .filter_map(|x| self.m.tensor(*x))
                .filter(|x| x.kind == TensorKind::Param)
                .map(|x| format!("`{}`", x.name))
                .collect();
            // Per-expert data survives any re-indexing (permute, reshape, slices, cat, pad,
            // indexing an expert, arithmetic): only a reduction over every expert leaves it.
            let per_expert = self.reads_params_unreduced(v, 0);
            if !from_params.is_empty() && per_expert && !self.consumed_by_param.contains(&id) {
                self.err(
                    Diagnostic::error(
                        "E0403",
                        format!(
                            "`{}` is a per-expert value derived from params but is not registered",
                            t.name
                        ),
                    )
                    .with_label(
                        t.name_span,
                        format!("derived from {}", from_params.join(", ")),
                    )
                    .with_note(format!(
                        "EPLB moves params only, so `{}` would go stale after a rearrangement",
                        t.name
                    ))
                    .with_note(if t.shape.first() == experts.as_ref() {
                        format!(
                            "help: declare it as `param {} : {}{} = ...`",
                            t.name,
                            t.dtype,
                            self.m.show_shape(&t.shape)
                        )
                    } else {
                        format!(
                            "help: register it as a `param` with the experts dimension first, or, where it only re-indexes one param, make it a `view` (its shape is {})",
                            self.m.show_shape(&t.shape)
                        )
                    }),
                );
            }
        }
    }
}

fn similar(a: &str, b: &str) -> bool {
    if a == b || a.len().abs_diff(b.len()) > 2.max(b.len() / 4) {
        return false;
    }
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let sub = prev[j - 1] + usize::from(a[i - 1] != b[j - 1]);
            cur[j] = sub.min(prev[j] + 1).min(cur[j - 1] + 1);
        }
        prev = cur;
    }
    prev[b.len()] <= 2.max(b.len() / 4)
}

/// SPEC §1's storage of a `swizzle_128x4` param of padded shape `[.., Mp, Kp]`: leading dims
/// row-major over whole `Mp x Kp` planes, then `((32,4,MT),(4,KT)):((16,4,KT*512),(1,512))`.
fn swizzle_128x4_storage(shape: &[Poly]) -> Option<SymLayout> {
    let n = shape.len();
    if n < 2 {
        return None;
    }
    let c = |x: i128| Poly::constant(x);
    let (mt, kt) = (shape[n - 2].div_exact(128)?, shape[n - 1].div_exact(4)?);
    let mut dims = vec![Vec::new(); n];
    let mut acc = shape[n - 2].mul(&shape[n - 1]);
    for i in (0..n - 2).rev() {
        dims[i] = vec![(shape[i].clone(), acc.clone())];
        acc = acc.mul(&shape[i]);
    }
    dims[n - 2] = vec![(c(32), c(16)), (c(4), c(4)), (mt, kt.scale(512))];
    dims[n - 1] = vec![(c(4), c(1)), (kt, c(512))];
    Some(SymLayout {
        dims,
        offset: Poly::zero(),
        swizzle: None,
    })
}

/// Split one mode (sub-modes fastest first) into `parts` (fastest first) without a copy: each
/// part takes a whole sub-mode or divides one. `None` where the extents do not line up.
fn split_mode(mode: &[(Poly, Poly)], parts: &[Poly]) -> Option<Vec<(Poly, Poly)>> {
    let mut subs: Vec<(Poly, Poly)> = mode
        .iter()
        .filter(|(s, _)| !s.is_const(1))
        .cloned()
        .collect();
    subs.reverse(); // pop() yields the fastest
    let mut out = Vec::new();
    for p in parts {
        if p.is_const(1) {
            out.push((Poly::constant(1), Poly::zero()));
            continue;
        }
        let (s, d) = subs.pop()?;
        if s == *p {
            out.push((s, d));
        } else {
            let rest = match p.as_const() {
                Some(k) => s.div_exact(i64::try_from(k).ok()?)?,
                None => s.div_monomial(p)?,
            };
            out.push((p.clone(), d.clone()));
            subs.push((rest, d.mul(p)));
        }
    }
    subs.is_empty().then_some(out)
}
