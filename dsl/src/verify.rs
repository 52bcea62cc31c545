//! The verifier: proves the promises of a recipe before any code exists.
//!
//! 1. every view lands inside its param's storage, and a claimed bijection is one;
//! 2. every param is expert-major and contiguous (an expert is one byte range);
//! 3. no per-expert value derived from params lives outside a param or a view (checked while
//!    lowering: computing views, unregistered `let`s and kernels reading inputs are errors);
//! 4. the per-expert move set is derived here;
//! 5. shapes, dtypes and divisibility (lowering) and index widths (here) are checked.
//!
//! Each proof is *symbolic* (for every binding the where-clause admits, over the polynomial layout
//! algebra) where possible, else *exhaustive* (decided exactly at the bound shape). A symbolic
//! failure is checked at the bound shape or, without one, at the smallest admissible binding, so
//! that a recipe that is wrong is rejected with a concrete counterexample.

use std::fmt;

use crate::diag::Diagnostic;
use crate::ir::*;
use crate::layout::{IntTuple, Layout, Swizzle};
use crate::poly::{AtomValues, Poly};

/// How a promise was established.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// For every admissible binding.
    Symbolic,
    /// At the bound shape only.
    Exhaustive,
    /// Not proven symbolically; needs `--bind` to be checked.
    NeedsBinding,
}

impl Proof {
    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Proof::Symbolic => "symbolic",
            Proof::Exhaustive => "exhaustive",
            Proof::NeedsBinding => "needs binding",
        }
    }
}

impl fmt::Display for Proof {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Values for a recipe's dimensions that satisfy its where-clause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// `(name, value)` in declaration order.
    pub dims: Vec<(String, i64)>,
    atoms: AtomValues,
}

impl Binding {
    /// Values of the atoms, for evaluating polynomials.
    pub fn atoms(&self) -> &[i128] {
        &self.atoms
    }

    /// Evaluate a polynomial.
    pub fn eval(&self, p: &Poly) -> Option<i128> {
        p.eval(&self.atoms)
    }

    /// `E=8, H=2048, I=768`.
    pub fn describe(&self) -> String {
        self.dims
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Parse `E=8,H=2048,I=768`.
pub fn parse_binding(s: &str) -> Result<Vec<(String, i64)>, Diagnostic> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return Err(Diagnostic::error("E0503", format!("bad binding `{part}`"))
                .with_note("bindings look like `E=8,H=2048,I=768`"));
        };
        let v: i64 = v.trim().parse().map_err(|_| {
            Diagnostic::error("E0503", format!("bad value in binding `{part}`"))
                .with_note("each dimension is bound to a positive integer")
        })?;
        let k = k.trim().to_string();
        if out.iter().any(|(x, _): &(String, i64)| *x == k) {
            return Err(
                Diagnostic::error("E0503", format!("`{k}` is bound twice in `{s}`"))
                    .with_note("bind each dimension once"),
            );
        }
        out.push((k, v));
    }
    Ok(out)
}

impl Module {
    /// Bind every dimension, checking the where-clause.
    pub fn bind(&self, values: &[(String, i64)]) -> Result<Binding, Vec<Diagnostic>> {
        let mut errs = Vec::new();
        for (k, v) in values {
            if !self.dims.iter().any(|d| &d.name == k) {
                errs.push(
                    Diagnostic::error(
                        "E0503",
                        format!("`{k}` is not a dimension of recipe `{}`", self.name),
                    )
                    .with_note(format!("the dimensions are {}", self.dim_list())),
                );
            } else if *v <= 0 {
                errs.push(Diagnostic::error(
                    "E0503",
                    format!("dimension `{k}` must be positive, got {v}"),
                ));
            }
        }
        let mut dims = Vec::new();
        for d in &self.dims {
            match values.iter().find(|(k, _)| *k == d.name) {
                Some((_, v)) => dims.push((d.name.clone(), *v)),
                None => errs.push(
                    Diagnostic::error(
                        "E0503",
                        format!("missing binding for dimension `{}`", d.name),
                    )
                    .with_label(d.span, "declared here")
                    .with_note(format!("bind every dimension: {}", self.dim_list())),
                ),
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let get = |n: &str| dims.iter().find(|(k, _)| k == n).map(|x| x.1);
        let describe = dims
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(", ");
        for c in &self.checks {
            match c {
                BindCheck::Divisible {
                    poly,
                    by,
                    text,
                    span,
                } => {
                    let val = self.eval_raw(poly, &get);
                    if let Some(v) = val {
                        if v % *by as i128 != 0 {
                            errs.push(
                                Diagnostic::error(
                                    "E0501",
                                    format!("constraint `{text}` does not hold at {describe}"),
                                )
                                .with_label(*span, format!("this is {} here", v % *by as i128))
                                .with_note(format!("the value is {v}, not a multiple of {by}")),
                            );
                        }
                    }
                }
                BindCheck::Bound {
                    dim,
                    op,
                    value,
                    text,
                    span,
                } => {
                    if let Some(v) = get(dim) {
                        let ok = match op {
                            crate::ast::CmpOp::Le => v <= *value,
                            crate::ast::CmpOp::Lt => v < *value,
                            crate::ast::CmpOp::Ge => v >= *value,
                            crate::ast::CmpOp::Gt => v > *value,
                        };
                        if !ok {
                            errs.push(
                                Diagnostic::error(
                                    "E0501",
                                    format!("constraint `{text}` does not hold at {describe}"),
                                )
                                .with_label(*span, format!("`{dim}` is {v} here")),
                            );
                        }
                    }
                }
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        let Some(atoms) = self.atoms.evaluate(&|n| get(n)) else {
            return Err(vec![Diagnostic::error(
                "E0503",
                "binding overflows 128-bit arithmetic",
            )]);
        };
        // Every tensor must be addressable with 64-bit offsets at this binding: at most
        // `i64::MAX` elements and bytes. A larger size is refused here, not silently skipped (or
        // wrapped) by the proofs and the index arithmetic that need it; `index i64` rests on it.
        for t in &self.tensors {
            let numel = t.numel();
            let bits = numel.scale(t.dtype.bits() as i128);
            let limit = i64::MAX as i128;
            let fits = match (numel.eval(&atoms), bits.eval(&atoms)) {
                (Some(n), Some(b)) if !bits.overflowed() => n <= limit && b / 8 < limit,
                _ => false,
            };
            if !fits {
                errs.push(
                    Diagnostic::error(
                        "E0503",
                        format!("the size of `{}` overflows at {describe}", t.name),
                    )
                    .with_label(
                        t.name_span,
                        "its elements or bytes pass 64-bit offsets at this binding",
                    ),
                );
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        Ok(Binding { dims, atoms })
    }

    /// Evaluate a constraint polynomial with raw dimension values, before units are known to divide.
    fn eval_raw(&self, p: &Poly, get: &dyn Fn(&str) -> Option<i64>) -> Option<i128> {
        // A constraint polynomial is `c * unit * atom` for one dimension: value = c * unit * (v / unit)
        // only when v divides; use rational evaluation instead: c * v.
        let mut total: i128 = 0;
        for (m, c) in p.terms() {
            let mut t = *c;
            for &(a, e) in m {
                let crate::poly::AtomKind::Dim { name, unit, .. } = self.atoms.kind(a)? else {
                    return None;
                };
                let v = get(name)? as i128;
                for _ in 0..e {
                    // c is a multiple of unit for each dim factor (the polynomial was built as unit*atom).
                    t = t.checked_mul(v)?;
                    if t % *unit as i128 != 0 {
                        return None;
                    }
                    t /= *unit as i128;
                }
            }
            total = total.checked_add(t)?;
        }
        Some(total)
    }

    fn dim_list(&self) -> String {
        self.dims
            .iter()
            .map(|d| format!("`{}`", d.name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The smallest binding the where-clause admits (each dimension at its lower bound).
    pub fn witness_binding(&self) -> Option<Binding> {
        let dims: Vec<(String, i64)> = self.dims.iter().map(|d| (d.name.clone(), d.min)).collect();
        self.bind(&dims).ok()
    }
}

/// What the verifier established about a param.
#[derive(Debug, Clone)]
pub struct ParamInfo {
    /// The param.
    pub id: TensorId,
    /// Storage layout (element offsets).
    pub layout: SymLayout,
    /// Elements per expert.
    pub per_expert_elems: Poly,
    /// How expert-majorness and contiguity were proven.
    pub proof: Proof,
}

/// What the verifier established about a view.
#[derive(Debug, Clone)]
pub struct ViewInfo {
    /// The view.
    pub id: TensorId,
    /// The param it aliases.
    pub source: TensorId,
    /// Layout from view coordinates to the param's storage offsets.
    pub layout: SymLayout,
    /// How in-bounds was proven.
    pub in_bounds: Proof,
    /// Whether the view is a bijection onto its param's storage (`None`: not decided).
    pub bijective: Option<bool>,
    /// How bijectivity (or its absence) was established.
    pub bijective_proof: Proof,
    /// Whether the recipe claims a bijection.
    pub claimed: bool,
    /// Whether no two coordinates share an offset (`Some(false)`: a broadcast (stride 0) or an
    /// overlap; `None`: not decided).
    pub injective: Option<bool>,
}

/// What the verifier established about a kernel binding.
#[derive(Debug, Clone)]
pub struct KernelInfo {
    /// Index in [`Module::kernels`].
    pub index: usize,
    /// How the index width was proven sufficient.
    pub proof: Proof,
}

/// One param's share of the per-expert move set.
#[derive(Debug, Clone)]
pub struct MoveEntry {
    /// The param.
    pub param: TensorId,
    /// Bits of one expert (expert `e` owns bytes `[e*B, (e+1)*B)` of the param's storage, `B` =
    /// bits / 8).
    pub bits_per_expert: Poly,
}

impl MoveEntry {
    /// Bytes per expert as a polynomial, when it is one for every binding.
    pub fn bytes_symbolic(&self) -> Option<Poly> {
        self.bits_per_expert.div_exact(8)
    }
}

/// A verified module: only [`verify`] creates one, and backends accept nothing else.
#[derive(Debug, Clone)]
pub struct ModuleInfo {
    module: Module,
    binding: Option<Binding>,
    /// Params, in definition order.
    pub params: Vec<ParamInfo>,
    /// Views, in definition order.
    pub views: Vec<ViewInfo>,
    /// Kernel bindings.
    pub kernels: Vec<KernelInfo>,
    /// The per-expert move set.
    pub move_set: Vec<MoveEntry>,
}

impl ModuleInfo {
    /// The verified module.
    pub fn module(&self) -> &Module {
        &self.module
    }

    /// The binding it was verified at, if any.
    pub fn binding(&self) -> Option<&Binding> {
        self.binding.as_ref()
    }

    /// Evaluate a polynomial at the binding.
    pub fn eval(&self, p: &Poly) -> Option<i128> {
        self.binding.as_ref()?.eval(p)
    }

    /// A view by name.
    pub fn view(&self, name: &str) -> Option<&ViewInfo> {
        self.views
            .iter()
            .find(|v| self.module.tensor(v.id).is_some_and(|t| t.name == name))
    }

    /// The numeric (hierarchical) layout of a symbolic layout at the binding, with its offset.
    pub fn numeric(&self, l: &SymLayout) -> Option<(Layout, i64)> {
        numeric(l, self.binding.as_ref()?)
    }

    /// Source element offsets of every element of a view, in row-major order over its flattened
    /// shape (last index fastest), at the binding.
    pub fn index_map(&self, view: &ViewInfo) -> Option<Vec<i64>> {
        let b = self.binding.as_ref()?;
        index_map(&view.layout, b)
    }

    /// Bytes per expert of a move-set entry at the binding.
    pub fn bytes_per_expert(&self, e: &MoveEntry) -> Option<i128> {
        Some(self.eval(&e.bits_per_expert)? / 8)
    }

    /// The activation scheme the MoE layer's GEMMs use (SPEC §9), as the recipe declares it
    /// (bf16 when it declares none): checked against the GEMM weights' dtypes and, for static
    /// scales, against the params they name.
    pub fn activation(&self) -> Activation {
        self.module.activation()
    }

    /// How the GEMM `gemm` (`w13` or `w2`) may scale its E4M3 input: see
    /// [`Module::activation_scales`].
    pub fn activation_scales(&self, gemm: &str) -> Vec<ActScale> {
        self.module.activation_scales(gemm)
    }
}

/// The numeric layout (and base offset) of a symbolic layout at a binding.
pub fn numeric(l: &SymLayout, b: &Binding) -> Option<(Layout, i64)> {
    let mut shape = Vec::new();
    let mut stride = Vec::new();
    for d in &l.dims {
        let mut s = Vec::new();
        let mut t = Vec::new();
        for (x, y) in d {
            s.push(i64::try_from(b.eval(x)?).ok()?);
            t.push(i64::try_from(b.eval(y)?).ok()?);
        }
        shape.push(IntTuple::flat(&s));
        stride.push(IntTuple::flat(&t));
    }
    let (shape, stride) = if shape.len() == 1 {
        (shape.pop()?, stride.pop()?)
    } else {
        (IntTuple::Tuple(shape), IntTuple::Tuple(stride))
    };
    let lay = Layout::new(shape, stride).ok()?;
    let off = i64::try_from(b.eval(&l.offset)?).ok()?;
    // Every number the layout algebra computes on it (size, cosize, smallest offset, and any
    // offset plus the base) must fit 64 bits: `None` rather than an overflow there.
    let (mut size, mut lo, mut hi) = (1i128, off as i128, off as i128);
    for (s, d) in lay.flat_modes() {
        size = size.checked_mul(s as i128)?;
        let reach = (s as i128 - 1) * d as i128;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
        if size > i64::MAX as i128 || lo < i64::MIN as i128 || hi >= i64::MAX as i128 {
            return None;
        }
    }
    Some((lay, off))
}

/// The number of elements of a symbolic layout at a binding (checked: `None` past `u64`).
pub fn index_map_len(l: &SymLayout, b: &Binding) -> Option<u64> {
    let mut n: u64 = 1;
    for (s, _) in l.leaves() {
        n = n.checked_mul(u64::try_from(b.eval(&s)?).ok()?)?;
    }
    Some(n)
}

/// Every offset of a symbolic layout at a binding, row-major over its flattened shape, handed to
/// `f` one at a time (nothing is held whole). Does nothing where the layout does not evaluate.
pub fn index_map_each(l: &SymLayout, b: &Binding, f: &mut dyn FnMut(i64)) {
    // Every offset fits i64 (else nothing is produced).
    if numeric(l, b).is_none() {
        return;
    }
    let Some(leaves) = l
        .leaves()
        .iter()
        .map(|(s, d)| {
            Some((
                i64::try_from(b.eval(s)?).ok()?,
                i64::try_from(b.eval(d)?).ok()?,
            ))
        })
        .collect::<Option<Vec<(i64, i64)>>>()
    else {
        return;
    };
    let Some(base) = b.eval(&l.offset).and_then(|x| i64::try_from(x).ok()) else {
        return;
    };
    if leaves.iter().any(|x| x.0 <= 0) {
        return;
    }
    let mut coord = vec![0i64; leaves.len()];
    loop {
        let off = base
            + coord
                .iter()
                .zip(&leaves)
                .map(|(c, (_, d))| c * d)
                .sum::<i64>();
        f(match l.swizzle {
            Some(s) => s.apply(off),
            None => off,
        });
        let mut k = leaves.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            coord[k] += 1;
            if coord[k] < leaves[k].0 {
                break;
            }
            coord[k] = 0;
        }
    }
}

/// Offsets of a symbolic layout at a binding, row-major over its flattened shape.
pub fn index_map(l: &SymLayout, b: &Binding) -> Option<Vec<i64>> {
    // `None` where an offset or the number of coordinates passes 64 bits, or the map does not fit
    // in memory (no overflow, no allocation failure).
    numeric(l, b)?;
    let n = usize::try_from(index_map_len(l, b)?).ok()?;
    let mut out = Vec::new();
    out.try_reserve_exact(n).ok()?;
    index_map_each(l, b, &mut |o| out.push(o));
    (out.len() == n).then_some(out)
}

// ---- symbolic proofs ----------------------------------------------------------------------------

fn leaves_nontrivial(l: &SymLayout) -> Vec<(Poly, Poly)> {
    l.leaves()
        .into_iter()
        .filter(|(s, _)| !s.is_const(1))
        .collect()
}

/// `l` maps into `[0, n)` for every binding with all atoms at least 1.
pub fn sym_in_bounds(l: &SymLayout, n: &Poly) -> bool {
    sym_in_bounds_with(l, n, &[])
}

/// [`sym_in_bounds`] for every admissible binding: atom `a` at least `mins[a]` (the where-clause's
/// lower bounds, `Atoms::lower_bounds`).
pub fn sym_in_bounds_with(l: &SymLayout, n: &Poly, mins: &[i128]) -> bool {
    let nonneg = |p: &Poly| p.provably_nonneg_with(mins);
    if !nonneg(&l.offset) {
        return false;
    }
    let mut max = l.offset.clone();
    for (s, d) in l.leaves() {
        if !nonneg(&d) {
            return false;
        }
        max = max.add(&s.sub(&Poly::constant(1)).mul(&d));
    }
    if !nonneg(&n.sub(&max).sub(&Poly::constant(1))) {
        return false;
    }
    match l.swizzle {
        Some(sw) => n.div_exact(sw.period()).is_some(),
        None => true,
    }
}

/// `l` is a bijection from its coordinates onto `[0, n)` for every admissible binding: sorted by
/// stride, each stride equals the product of the smaller modes' extents (polynomial identity).
pub fn sym_bijective(l: &SymLayout, n: &Poly) -> bool {
    if !l.offset.is_const(0) {
        return false;
    }
    let mut rest = leaves_nontrivial(l);
    let mut span = Poly::constant(1);
    while !rest.is_empty() {
        let Some(k) = rest.iter().position(|(_, d)| *d == span) else {
            return false;
        };
        let (s, _) = rest.remove(k);
        span = span.mul(&s);
    }
    if span != *n {
        return false;
    }
    match l.swizzle {
        Some(sw) => n.div_exact(sw.period()).is_some(),
        None => true,
    }
}

/// `l` is injective for every admissible binding: an order of the modes exists in which each stride
/// provably exceeds the span of the ones before.
pub fn sym_injective(l: &SymLayout) -> bool {
    sym_injective_with(l, &[])
}

/// [`sym_injective`] with atom `a` at least `mins[a]`.
pub fn sym_injective_with(l: &SymLayout, mins: &[i128]) -> bool {
    let nonneg = |p: &Poly| p.provably_nonneg_with(mins);
    let mut rest = leaves_nontrivial(l);
    let mut span = Poly::constant(1);
    while !rest.is_empty() {
        let pick = rest.iter().position(|(_, d)| {
            nonneg(&d.sub(&span)) && rest.iter().all(|(_, o)| nonneg(&o.sub(d)))
        });
        let Some(k) = pick else {
            return false;
        };
        let (s, d) = rest.remove(k);
        span = span.add(&s.sub(&Poly::constant(1)).mul(&d));
    }
    true
}

// ---- numeric decisions at a binding -----------------------------------------------------------

/// Largest offset, or a description of why it is out of `[0, n)`.
fn num_in_bounds(l: &SymLayout, n: i128, b: &Binding) -> Result<(), String> {
    let (lay, off) = numeric(l, b).ok_or("the layout overflows 64-bit offsets")?;
    let lo = off as i128 + lay.min_offset() as i128;
    let hi = off as i128 + lay.cosize() as i128 - 1;
    if lo < 0 {
        return Err(format!("the smallest offset is {lo}"));
    }
    match l.swizzle {
        None if hi < n => Ok(()),
        None => Err(format!(
            "the largest offset is {hi}, but the storage has {n} element(s)"
        )),
        Some(sw) => {
            if hi < n && n % sw.period() as i128 == 0 {
                return Ok(());
            }
            let size = lay.size();
            if size > 1 << 26 {
                return Err("too large to check a swizzled layout exhaustively".into());
            }
            for i in 0..size {
                let o = sw.apply(off + lay.call(i)) as i128;
                if o >= n || o < 0 {
                    return Err(format!(
                        "coordinate {i} lands at offset {o}, outside [0, {n})"
                    ));
                }
            }
            Ok(())
        }
    }
}

/// A decision at a binding, with the reason when it is not "yes".
enum Decision {
    /// A bijection onto `[0, n)`.
    Yes,
    /// Not one.
    No(String),
    /// Too large to decide (a swizzled layout past the enumeration limit).
    Unknown(String),
}

/// Whether the layout is a bijection onto `[0, n)` at the binding.
fn num_bijective(l: &SymLayout, n: i128, b: &Binding) -> Decision {
    let Some((lay, off)) = numeric(l, b) else {
        return Decision::Unknown("the layout overflows 64-bit offsets".into());
    };
    let size = lay.size() as i128;
    if size != n {
        return Decision::No(format!("it has {size} elements but the storage has {n}"));
    }
    let mut modes: Vec<(i64, i64)> = lay.flat_modes().into_iter().filter(|m| m.0 > 1).collect();
    let nonneg = modes.iter().all(|m| m.1 >= 0);
    modes.sort_by_key(|m| (m.1, m.0));
    let mut span = 1i64;
    let mut chain = true;
    for (s, d) in &modes {
        if *d != span {
            chain = false;
            break;
        }
        span *= s;
    }
    match l.swizzle {
        // Non-negative strides: a bijection onto [0, n) is exactly a chain from offset 0.
        None if nonneg && off != 0 => {
            return Decision::No(format!(
                "it starts at offset {off}, so offset 0 is never reached"
            ))
        }
        None if nonneg && chain => return Decision::Yes,
        Some(sw) if nonneg && chain && off == 0 && n % sw.period() as i128 == 0 => {
            return Decision::Yes
        }
        _ => {}
    }
    // Otherwise enumerate (the swizzle applied to the full offset, base included).
    if size <= 1 << 24 {
        let mut seen: Vec<Option<i64>> = vec![None; size as usize];
        for i in 0..size as i64 {
            let o = off + lay.call(i);
            let o = l.swizzle.map_or(o, |sw| sw.apply(o));
            if o < 0 || o as i128 >= n {
                return Decision::No(format!(
                    "coordinate {i} lands at offset {o}, outside the storage"
                ));
            }
            if let Some(j) = seen[o as usize] {
                return Decision::No(format!("coordinates {j} and {i} both land at offset {o}"));
            }
            seen[o as usize] = Some(i);
        }
        return Decision::Yes;
    }
    if l.swizzle.is_none() && nonneg {
        return Decision::No("its strides do not tile the storage (sorted by stride, each stride must be the product of the smaller extents)".into());
    }
    Decision::Unknown(format!(
        "too large ({size} coordinates) to decide exhaustively"
    ))
}

/// Promise 2 for a declared param layout: the experts mode is outermost (its stride exceeds every
/// offset inside one expert) and the layout is dense (expert stride = elements per expert, the rest a
/// bijection onto them). Returns how it was proven, or the violated promise's code and why.
fn check_param_layout(
    layout: &SymLayout,
    per: &Poly,
    at: Option<&Binding>,
) -> Result<Proof, (&'static str, String)> {
    let Some(e_mode) = layout
        .dims
        .first()
        .filter(|d| d.len() == 1)
        .map(|d| d[0].clone())
    else {
        return Err((
            "E0401",
            "the experts dimension is split into several modes".into(),
        ));
    };
    let rest = SymLayout {
        dims: layout.dims[1..].to_vec(),
        offset: layout.offset.clone(),
        swizzle: layout.swizzle,
    };
    let stride = e_mode.1;
    // Expert-major: the expert stride exceeds the largest offset inside an expert.
    let mut inner_max = rest.offset.clone();
    for (s, d) in rest.leaves() {
        inner_max = inner_max.add(&s.sub(&Poly::constant(1)).mul(&d));
    }
    let mut proof = Proof::Symbolic;
    if !stride
        .sub(&inner_max)
        .sub(&Poly::constant(1))
        .provably_nonneg()
    {
        match at {
            Some(b) => {
                let (st, mx) = (
                    b.eval(&stride).unwrap_or(0),
                    b.eval(&inner_max).unwrap_or(0),
                );
                if st <= mx {
                    return Err((
                        "E0401",
                        format!("the experts stride is {st} but one expert reaches offset {mx}: experts interleave"),
                    ));
                }
                proof = Proof::NeedsBinding;
            }
            None => proof = Proof::NeedsBinding,
        }
    }
    // Dense: stride = elements per expert, and the rest tiles them exactly. A swizzle applies to
    // the whole offset, experts included: symbolically it must permute inside period blocks that
    // one expert's size is a multiple of (`sym_bijective` asks that of `per`); at a binding the
    // unswizzled rest must tile one expert and the swizzle must keep every expert's range.
    if stride != *per || !sym_bijective(&rest, per) {
        let Some(b) = at else {
            return Ok(Proof::NeedsBinding);
        };
        let (st, n) = (b.eval(&stride).unwrap_or(0), b.eval(per).unwrap_or(0));
        if st != n {
            return Err((
                "E0402",
                format!("the experts stride is {st} but one expert has {n} elements"),
            ));
        }
        let unswizzled = SymLayout {
            swizzle: None,
            ..rest.clone()
        };
        match num_bijective(&unswizzled, n, b) {
            Decision::Yes => {}
            Decision::No(why) | Decision::Unknown(why) => return Err(("E0402", why)),
        }
        if let Some(sw) = layout.swizzle {
            let experts = b.eval(&e_mode.0).unwrap_or(0);
            swizzle_keeps_experts(sw, n, experts).map_err(|why| ("E0402", why))?;
        }
        proof = Proof::NeedsBinding;
    }
    Ok(proof)
}

/// Whether a swizzle applied to offsets `[0, experts*per)` keeps each `[e*per, (e+1)*per)` in
/// place. Only period blocks that straddle an expert boundary can move an offset across one; they
/// are checked one by one (up to 2^24 offsets, else refused as undecided).
fn swizzle_keeps_experts(sw: Swizzle, per: i128, experts: i128) -> Result<(), String> {
    let p = sw.period() as i128;
    if sw.bits == 0 || per % p == 0 {
        return Ok(());
    }
    let total = per.saturating_mul(experts);
    if total > i64::MAX as i128 {
        return Err("the swizzled offsets pass 64 bits".into());
    }
    let mut checked: i128 = 0;
    for k in 1..=experts {
        let boundary = k * per;
        if boundary % p == 0 {
            continue;
        }
        let block = boundary / p * p;
        for o in block..(block + p).min(total) {
            checked += 1;
            if checked > 1 << 24 {
                return Err(format!(
                    "too many offsets to check that the swizzle {sw} keeps experts apart (an expert's {per} elements are not a multiple of its period {p})"
                ));
            }
            let to = sw.apply(o as i64) as i128;
            if to < 0 || to >= total || to / per != o / per {
                return Err(format!(
                    "the swizzle {sw} moves offset {o} of expert {} to offset {to} (an expert's {per} elements are not a multiple of its period {p})",
                    o / per
                ));
            }
        }
    }
    Ok(())
}

// ---- the verifier -------------------------------------------------------------------------------

/// Verify a lowered module, optionally at a binding. Returns the verified module or every violation.
pub fn verify(module: Module, binding: Option<Binding>) -> Result<ModuleInfo, Vec<Diagnostic>> {
    let mut errs = Vec::new();
    // Without a binding, failed symbolic proofs are decided at the smallest admissible binding; a
    // recipe whose sizes overflow even there is refused (no binding of it could be checked).
    let witness = match &binding {
        Some(_) => None,
        None => {
            let dims: Vec<(String, i64)> = module
                .dims
                .iter()
                .map(|d| (d.name.clone(), d.min))
                .collect();
            match module.bind(&dims) {
                Ok(w) => Some(w),
                Err(ds) => {
                    errs.extend(ds.into_iter().map(|d| {
                        d.with_note("the smallest admissible binding: a recipe must fit it")
                    }));
                    None
                }
            }
        }
    };
    let at = binding.as_ref().or(witness.as_ref());
    let at_note = |b: &Binding| {
        if binding.is_some() {
            format!("at the bound shape {}", b.describe())
        } else {
            format!("at the smallest admissible binding {}", b.describe())
        }
    };
    let experts = module.experts_dim().map(|d| d.poly.clone());
    // The least value of every atom (the where-clause's lower bounds): symbolic proofs use them.
    let mins = module.atoms.lower_bounds();
    let mut params = Vec::new();
    let mut move_set = Vec::new();
    for (id, t) in module.tensors_with_ids() {
        if t.kind != TensorKind::Param {
            continue;
        }
        let shape_s = module.show_shape(&t.shape);
        let ename = module
            .experts_dim()
            .map(|d| d.name.clone())
            .unwrap_or_default();
        let Some(e) = experts.as_ref().filter(|e| t.shape.first() == Some(*e)) else {
            let dim0 = t
                .shape
                .first()
                .map(|p| format!("dimension 0 is `{}`", module.show(p)));
            errs.push(
                Diagnostic::error("E0401", format!("param `{}` is not expert-major", t.name))
                    .with_label(t.name_span, format!("{}, not the experts dimension `{ename}`", dim0.unwrap_or_else(|| "it is a scalar".into())))
                    .with_note(format!("`{}` has shape {shape_s}; EPLB moves params by their leading experts dimension", t.name))
                    .with_note(format!("help: give it shape [{ename}, ...] (broadcast a scalar with `broadcast(x, {ename})`)")),
            );
            continue;
        };
        let numel = t.numel();
        let Some(per) = numel.div_monomial(e) else {
            continue;
        };
        let layout = t.storage_layout();
        let lspan = t
            .declared_layout
            .as_ref()
            .map(|x| x.1)
            .unwrap_or(t.name_span);
        let mut proof = Proof::Symbolic;
        if t.declared_layout.is_some() {
            match check_param_layout(&layout, &per, at) {
                Ok(p) => {
                    proof = match p {
                        Proof::NeedsBinding if binding.is_some() => Proof::Exhaustive,
                        other => other,
                    }
                }
                Err((code, why)) => {
                    let (head, label) = if code == "E0401" {
                        (
                            format!("param `{}` is not expert-major", t.name),
                            "the experts mode is not the outermost one".to_string(),
                        )
                    } else {
                        (
                            format!("param `{}` is not contiguous", t.name),
                            format!(
                                "one expert's elements do not fill `{}` consecutive offsets",
                                module.show(&per)
                            ),
                        )
                    };
                    let mut d = Diagnostic::error(code, head)
                        .with_label(lspan, label)
                        .with_note(format!("layout {}: {why}", layout.display(&module.atoms)))
                        .with_note("an expert must be one dense, contiguous range of the param so that EPLB moves it as a unit");
                    if let Some(b) = at {
                        d = d.with_note(at_note(b));
                    }
                    errs.push(d);
                    continue;
                }
            }
        }
        // Bits per expert (FP4 packs two per byte: one expert must be whole bytes).
        let bits = per.scale(t.dtype.bits() as i128);
        if bits.div_exact(8).is_none() {
            match at.and_then(|b| b.eval(&bits).map(|v| (b, v))) {
                Some((b, v)) if v % 8 != 0 => {
                    errs.push(
                        Diagnostic::error(
                            "E0504",
                            format!("one expert of `{}` is not a whole number of bytes", t.name),
                        )
                        .with_label(
                            t.name_span,
                            format!(
                                "{} {} elements per expert",
                                b.eval(&per).unwrap_or(0),
                                t.dtype
                            ),
                        )
                        .with_note(at_note(b)),
                    );
                    continue;
                }
                Some(_) if binding.is_some() => proof = Proof::Exhaustive,
                _ => proof = Proof::NeedsBinding,
            }
        }
        move_set.push(MoveEntry {
            param: id,
            bits_per_expert: bits,
        });
        params.push(ParamInfo {
            id,
            layout,
            per_expert_elems: per,
            proof,
        });
    }

    let mut views = Vec::new();
    for (id, t) in module.tensors_with_ids() {
        let TensorKind::View { bijective: claim } = &t.kind else {
            continue;
        };
        let Some((src, layout)) = &t.alias else {
            continue;
        };
        let Some(p) = module.tensor(*src) else {
            continue;
        };
        let n = p.numel();
        // Promise 1a: in bounds.
        let in_bounds = if sym_in_bounds_with(layout, &n, &mins) {
            Proof::Symbolic
        } else {
            match at.map(|b| (b, num_in_bounds(layout, b.eval(&n).unwrap_or(0), b))) {
                Some((_, Ok(()))) if binding.is_some() => Proof::Exhaustive,
                Some((_, Ok(()))) => Proof::NeedsBinding,
                Some((b, Err(why))) => {
                    errs.push(
                        Diagnostic::error(
                            "E0304",
                            format!("view `{}` reads outside `{}`", t.name, p.name),
                        )
                        .with_label(t.name_span, why.clone())
                        .with_note(format!(
                            "`{}` has {} elements ({}); the view's layout is {}",
                            p.name,
                            b.eval(&n).unwrap_or(0),
                            module.show_shape(&p.shape),
                            layout.display(&module.atoms)
                        ))
                        .with_note(at_note(b)),
                    );
                    continue;
                }
                None => Proof::NeedsBinding,
            }
        };
        // Promise 1b: bijections.
        let (bij, bproof) = if sym_bijective(layout, &n) {
            (Some(true), Proof::Symbolic)
        } else if claim.is_none()
            && sym_injective_with(layout, &mins)
            && !layout.size().sub(&n).is_const(0)
            && n.sub(&layout.size())
                .sub(&Poly::constant(1))
                .provably_nonneg_with(&mins)
        {
            // Injective and strictly smaller than its storage: never onto.
            (Some(false), Proof::Symbolic)
        } else {
            match at.map(|b| (b, num_bijective(layout, b.eval(&n).unwrap_or(0), b))) {
                Some((_, Decision::Yes)) if binding.is_some() => (Some(true), Proof::Exhaustive),
                Some((_, Decision::Yes)) => (None, Proof::NeedsBinding),
                // Undecided: a claim fails closed, otherwise nothing is said.
                Some((b, Decision::Unknown(why))) => {
                    if let Some(cs) = claim {
                        errs.push(
                            Diagnostic::error(
                                "E0305",
                                format!(
                                    "view `{}` is claimed to be a bijection but is not proven one",
                                    t.name
                                ),
                            )
                            .with_label(*cs, why)
                            .with_label(
                                t.name_span,
                                format!("layout {}", layout.display(&module.atoms)),
                            )
                            .with_note(at_note(b)),
                        );
                        continue;
                    }
                    (None, Proof::NeedsBinding)
                }
                Some((b, Decision::No(why))) => {
                    if let Some(cs) = claim {
                        errs.push(
                            Diagnostic::error("E0305", format!("view `{}` is claimed to be a bijection but is not one", t.name))
                                .with_label(*cs, why.clone())
                                .with_label(t.name_span, format!("layout {}", layout.display(&module.atoms)))
                                .with_note(format!("a bijection onto `{}` must reach each of its {} elements exactly once", p.name, b.eval(&n).unwrap_or(0)))
                                .with_note(at_note(b)),
                        );
                        continue;
                    }
                    if binding.is_some() {
                        (Some(false), Proof::Exhaustive)
                    } else {
                        (None, Proof::NeedsBinding)
                    }
                }
                None => (None, Proof::NeedsBinding),
            }
        };
        let injective = if bij == Some(true) || sym_injective_with(layout, &mins) {
            Some(true)
        } else {
            at.and_then(|b| numeric(layout, b))
                .filter(|(l, _)| layout.swizzle.is_none() || l.size() > 0)
                .map(|(l, _)| l.is_injective())
        };
        views.push(ViewInfo {
            id,
            source: *src,
            layout: layout.clone(),
            in_bounds,
            injective,
            bijective: bij,
            bijective_proof: bproof,
            claimed: claim.is_some(),
        });
    }

    // Promise 5: index widths.
    let mut kernels = Vec::new();
    let bounds = module.atoms.upper_bounds();
    for (k, kb) in module.kernels.iter().enumerate() {
        let mut proof = Proof::Symbolic;
        if kb.index.0 == IndexWidth::I32 {
            for (t, sp) in &kb.operands {
                let Some(tt) = module.tensor(*t) else {
                    continue;
                };
                let src = tt.alias.as_ref().map(|a| a.0).unwrap_or(*t);
                let Some(pi) = params.iter().find(|p| p.id == src) else {
                    continue;
                };
                let limit = i32::MAX as i128;
                if pi
                    .per_expert_elems
                    .upper_bound(&bounds)
                    .is_some_and(|m| m - 1 <= limit)
                {
                    continue;
                }
                match binding
                    .as_ref()
                    .and_then(|b| b.eval(&pi.per_expert_elems).map(|v| (b, v)))
                {
                    Some((b, v)) if v - 1 > limit => {
                        let pname = module
                            .tensor(src)
                            .map(|x| x.name.clone())
                            .unwrap_or_default();
                        let mut d = Diagnostic::error("E0502", format!("kernel `{}` declares 32-bit offsets but `{}` needs more", kb.name, tt.name))
                            .with_label(kb.index.1.unwrap_or(kb.span), "offsets within one expert must fit in i32")
                            .with_label(*sp, if v - 1 > limit {
                                format!("one expert of `{pname}` has {v} elements; the largest offset {} exceeds {limit}", v - 1)
                            } else {
                                // Offsets fit, but not the element count: 32-bit kernels count too.
                                format!("one expert of `{pname}` has {v} elements; the element count exceeds {limit}")
                            });
                        d = d.with_note(format!("at the bound shape {}", b.describe()))
                            .with_note("help: declare `index i64`, or bound the dimensions in the where-clause");
                        errs.push(d);
                    }
                    Some(_) => proof = Proof::Exhaustive,
                    None => proof = Proof::NeedsBinding,
                }
            }
        }
        kernels.push(KernelInfo { index: k, proof });
    }

    if errs.is_empty() {
        Ok(ModuleInfo {
            module,
            binding,
            params,
            views,
            kernels,
            move_set,
        })
    } else {
        Err(errs)
    }
}
