//! The recipe parser: nom 8 over located spans, recursive descent with one token of lookahead.
//!
//! Every node records its byte span. Once a statement's keyword is seen the parser is committed
//! (nom's `Failure`), so an error points at the first token that does not fit, saying what was
//! expected and what was found.
//!
//! Chains (`a + b - c`, `x * y / z`, `q.scales[:, rows, :] @ L`) are parsed in loops into flat
//! nodes ([`ExprKind::Chain`], [`ExprKind::Postfix`]), and every construct that nests (parentheses,
//! calls, `quant`, unary `-`, `[...]`, layout tuples) counts one level of a depth limit, so that
//! recursion in the parser and in every pass over the syntax tree is bounded: see
//! [`crate::limits`] for the limits and their error codes (E0002, E0003, E0004).

use nom::bytes::complete::{tag, take_while, take_while1};
use nom::character::complete::digit1;
use nom::error::{ErrorKind, ParseError};
use nom::{IResult, Input, Parser};
use nom_locate::LocatedSpan;

use crate::ast::*;
use crate::diag::Diagnostic;
use crate::limits::{MAX_CHAIN, MAX_DEPTH, MAX_SOURCE_BYTES};

type In<'a> = LocatedSpan<&'a str>;

/// A parse error: the byte offset where parsing stopped and what was expected there, or the limit
/// crossed there.
#[derive(Debug, Clone, PartialEq)]
pub struct PErr {
    offset: usize,
    expected: String,
    limit: Option<Limit>,
}

/// A limit of [`crate::limits`] crossed at a parse error's offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Limit {
    /// More than [`MAX_DEPTH`] nested levels.
    Depth,
    /// More than [`MAX_CHAIN`] operands or suffixes in one chain.
    Chain(ChainKind),
}

/// What a chain is made of, for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChainKind {
    Sum,
    Product,
    Suffixes,
}

impl<'a> ParseError<In<'a>> for PErr {
    fn from_error_kind(input: In<'a>, kind: ErrorKind) -> Self {
        PErr {
            offset: input.location_offset(),
            expected: kind.description().to_lowercase(),
            limit: None,
        }
    }

    fn append(_input: In<'a>, _kind: ErrorKind, other: Self) -> Self {
        other
    }

    fn or(self, other: Self) -> Self {
        if other.offset >= self.offset {
            other
        } else {
            self
        }
    }
}

type R<'a, T> = IResult<In<'a>, T, PErr>;

const KEYWORDS: &[&str] = &[
    "recipe", "where", "input", "param", "view", "let", "kernel", "quant",
];

fn off(i: &In<'_>) -> usize {
    i.location_offset()
}

/// Skip whitespace and comments (`# ...` and `// ...` to end of line).
fn ws(mut i: In<'_>) -> In<'_> {
    loop {
        let s = i.fragment();
        let trimmed = s.trim_start();
        let mut skip = s.len() - trimmed.len();
        if trimmed.starts_with('#') || trimmed.starts_with("//") {
            skip += trimmed.find('\n').unwrap_or(trimmed.len());
        }
        if skip == 0 {
            return i;
        }
        i = i.take_from(skip);
    }
}

fn fail<T>(i: &In<'_>, expected: impl Into<String>) -> R<'static, T> {
    Err(nom::Err::Error(PErr {
        offset: off(i),
        expected: expected.into(),
        limit: None,
    }))
}

/// A committed error: `limit` crossed at the token that starts at `i` (after whitespace).
fn crossed(i: In<'_>, limit: Limit) -> nom::Err<PErr> {
    nom::Err::Failure(PErr {
        offset: off(&ws(i)),
        expected: String::new(),
        limit: Some(limit),
    })
}

/// The depth one level inside `d`, for the construct whose opening token starts at `i`.
fn nest(i: In<'_>, d: usize) -> Result<usize, nom::Err<PErr>> {
    if d >= MAX_DEPTH {
        return Err(crossed(i, Limit::Depth));
    }
    Ok(d + 1)
}

/// Refuse a chain that already has [`MAX_CHAIN`] members before adding the one at `i`.
fn grow(i: In<'_>, len: usize, kind: ChainKind) -> Result<(), nom::Err<PErr>> {
    if len >= MAX_CHAIN {
        return Err(crossed(i, Limit::Chain(kind)));
    }
    Ok(())
}

/// Turn a recoverable error into a committed one.
fn commit<T>(r: Result<T, nom::Err<PErr>>) -> Result<T, nom::Err<PErr>> {
    r.map_err(|e| match e {
        nom::Err::Error(e) => nom::Err::Failure(e),
        other => other,
    })
}

fn punct<'a>(i: In<'a>, p: &'static str) -> R<'a, Span> {
    let i = ws(i);
    let start = off(&i);
    match tag::<_, _, PErr>(p).parse(i) {
        Ok((rest, _)) => Ok((rest, Span::new(start, off(&rest)))),
        Err(_) => fail(&i, format!("`{p}`")),
    }
}

fn peek_punct(i: In<'_>, p: &str) -> bool {
    ws(i).fragment().starts_with(p)
}

fn raw_ident(i: In<'_>) -> R<'_, Ident> {
    let i = ws(i);
    let start = off(&i);
    let first = i.fragment().chars().next();
    if !matches!(first, Some(c) if c.is_ascii_alphabetic() || c == '_') {
        return fail(&i, "a name");
    }
    let (rest, name) = take_while1(|c: char| c.is_ascii_alphanumeric() || c == '_').parse(i)?;
    Ok((
        rest,
        Ident {
            name: name.fragment().to_string(),
            span: Span::new(start, off(&rest)),
        },
    ))
}

/// A name that is not a reserved keyword.
fn ident(i: In<'_>) -> R<'_, Ident> {
    let (rest, id) = raw_ident(i)?;
    if KEYWORDS.contains(&id.name.as_str()) {
        return fail(&ws(i), "a name (not a keyword)");
    }
    Ok((rest, id))
}

fn peek_keyword(i: In<'_>, kw: &str) -> bool {
    matches!(raw_ident(i), Ok((_, id)) if id.name == kw)
}

fn keyword<'a>(i: In<'a>, kw: &'static str) -> R<'a, Span> {
    match raw_ident(i) {
        Ok((rest, id)) if id.name == kw => Ok((rest, id.span)),
        _ => fail(&ws(i), format!("`{kw}`")),
    }
}

fn int(i: In<'_>) -> R<'_, (i64, Span)> {
    let i = ws(i);
    let start = off(&i);
    let (rest, d) = match digit1::<_, PErr>(i) {
        Ok(x) => x,
        Err(_) => return fail(&i, "an integer"),
    };
    match d.fragment().parse::<i64>() {
        Ok(v) => Ok((rest, (v, Span::new(start, off(&rest))))),
        Err(_) => fail(&i, "an integer that fits in 64 bits"),
    }
}

// ---- expressions ------------------------------------------------------------------------------
//
// Every function takes the nesting depth `d` of the point it parses at; a construct that nests
// parses its contents at `nest(..)`, one level deeper.

/// `a (+|-) b (+|-) c ...`, one flat chain.
fn expr(i: In<'_>, d: usize) -> R<'_, Expr> {
    let (mut i, first) = mul_expr(i, d)?;
    let mut rest = Vec::new();
    loop {
        let op = if peek_punct(i, "+") {
            BinOp::Add
        } else if peek_punct(i, "-") {
            BinOp::Sub
        } else {
            return Ok((i, chain(first, rest)));
        };
        grow(i, rest.len() + 1, ChainKind::Sum)?;
        let (r, _) = punct(i, if op == BinOp::Add { "+" } else { "-" })?;
        let (r, rhs) = commit(mul_expr(r, d))?;
        rest.push((op, rhs));
        i = r;
    }
}

/// `a (*|/|%) b ...`, one flat chain.
fn mul_expr(i: In<'_>, d: usize) -> R<'_, Expr> {
    let (mut i, first) = unary(i, d)?;
    let mut rest = Vec::new();
    loop {
        let (op, p) = if peek_punct(i, "*") {
            (BinOp::Mul, "*")
        } else if peek_punct(i, "/") && !peek_punct(i, "//") {
            (BinOp::Div, "/")
        } else if peek_punct(i, "%") {
            (BinOp::Rem, "%")
        } else {
            return Ok((i, chain(first, rest)));
        };
        grow(i, rest.len() + 1, ChainKind::Product)?;
        let (r, _) = punct(i, p)?;
        let (r, rhs) = commit(unary(r, d))?;
        rest.push((op, rhs));
        i = r;
    }
}

/// A chain node, or its only operand.
fn chain(first: Expr, rest: Vec<(BinOp, Expr)>) -> Expr {
    match rest.last() {
        None => first,
        Some((_, last)) => Expr {
            span: first.span.to(last.span),
            kind: ExprKind::Chain {
                first: Box::new(first),
                rest,
            },
        },
    }
}

/// `- - x`: the signs are counted in a loop (each one a level), then applied inside out.
fn unary(i: In<'_>, d: usize) -> R<'_, Expr> {
    let mut signs = Vec::new();
    let (mut i, mut d) = (i, d);
    while peek_punct(i, "-") {
        d = nest(i, d)?;
        let (r, s) = punct(i, "-")?;
        signs.push(s);
        i = r;
    }
    let (r, mut e) = if signs.is_empty() {
        postfix(i, d)?
    } else {
        commit(postfix(i, d))?
    };
    while let Some(s) = signs.pop() {
        e = Expr {
            span: s.to(e.span),
            kind: ExprKind::Neg(Box::new(e)),
        };
    }
    Ok((r, e))
}

/// A primary followed by suffixes (`.field`, `[slices]`, `@ LAYOUT`), one flat node.
fn postfix(i: In<'_>, d: usize) -> R<'_, Expr> {
    let (mut i, base) = primary(i, d)?;
    let start = base.span.start;
    let mut ops: Vec<Suffix> = Vec::new();
    loop {
        let (r, kind, end) = if peek_punct(i, ".") {
            grow(i, ops.len(), ChainKind::Suffixes)?;
            let (r, _) = punct(i, ".")?;
            let (r, field) = commit(ident(r))?;
            let end = field.span.end;
            (r, SuffixKind::Field(field), end)
        } else if peek_punct(i, "[") {
            grow(i, ops.len(), ChainKind::Suffixes)?;
            let inner = nest(i, d)?;
            let (r, _) = punct(i, "[")?;
            let (r, slices) = commit(slice_list(r, inner))?;
            let (r, close) = commit(punct(r, "]"))?;
            (r, SuffixKind::Index(slices), close.end)
        } else if peek_punct(i, "@") {
            grow(i, ops.len(), ChainKind::Suffixes)?;
            let inner = nest(i, d)?;
            let (r, _) = punct(i, "@")?;
            let (r, layout) = commit(layout_lit(r, inner))?;
            let end = layout.span.end;
            (r, SuffixKind::Apply(Box::new(layout)), end)
        } else {
            break;
        };
        ops.push(Suffix {
            kind,
            span: Span::new(start, end),
        });
        i = r;
    }
    let Some(last) = ops.last() else {
        return Ok((i, base));
    };
    let span = Span::new(start, last.span.end);
    Ok((
        i,
        Expr {
            kind: ExprKind::Postfix {
                base: Box::new(base),
                ops,
            },
            span,
        },
    ))
}

fn primary(i: In<'_>, d: usize) -> R<'_, Expr> {
    let i = ws(i);
    if i.fragment().starts_with(|c: char| c.is_ascii_digit()) {
        let (r, (v, span)) = int(i)?;
        return Ok((
            r,
            Expr {
                kind: ExprKind::Int(v),
                span,
            },
        ));
    }
    if peek_punct(i, "(") {
        let inner = nest(i, d)?;
        let (r, _) = punct(i, "(")?;
        let (r, e) = commit(expr(r, inner))?;
        let (r, _) = commit(punct(r, ")"))?;
        return Ok((r, e));
    }
    if peek_keyword(i, "quant") {
        let (r, kw) = keyword(i, "quant")?;
        let (r, scheme) = commit(ident(r))?;
        let inner = nest(r, d)?;
        let (r, _) = commit(punct(r, "("))?;
        let (r, args) = commit(arg_list(r, inner))?;
        let (r, close) = commit(punct(r, ")"))?;
        return Ok((
            r,
            Expr {
                kind: ExprKind::Quant { scheme, args },
                span: kw.to(close),
            },
        ));
    }
    let (r, name) = match ident(i) {
        Ok(x) => x,
        Err(_) => return fail(&i, "an expression"),
    };
    if peek_punct(r, "(") {
        let inner = nest(r, d)?;
        let (r, _) = punct(r, "(")?;
        let (r, args) = commit(arg_list(r, inner))?;
        let (r, close) = commit(punct(r, ")"))?;
        let span = name.span.to(close);
        return Ok((
            r,
            Expr {
                kind: ExprKind::Call { func: name, args },
                span,
            },
        ));
    }
    Ok((
        r,
        Expr {
            span: name.span,
            kind: ExprKind::Name(name.name),
        },
    ))
}

fn arg_list(i: In<'_>, d: usize) -> R<'_, Vec<Arg>> {
    let mut out = Vec::new();
    if peek_punct(i, ")") {
        return Ok((i, out));
    }
    let mut i = i;
    loop {
        let (r, a) = arg(i, d)?;
        out.push(a);
        if peek_punct(r, ",") {
            let (r, _) = punct(r, ",")?;
            i = r;
        } else {
            return Ok((r, out));
        }
    }
}

fn arg(i: In<'_>, d: usize) -> R<'_, Arg> {
    // `NAME = VALUE [reduce GROUP]` or a positional expression.
    if let Ok((r, name)) = ident(i) {
        if peek_punct(r, "=") && !peek_punct(r, "==") {
            let (r, _) = punct(r, "=")?;
            let (r, value) = commit(expr(r, d))?;
            let (r, reduce) = if peek_keyword(r, "reduce") {
                let (r, _) = keyword(r, "reduce")?;
                let (r, g) = commit(ident(r))?;
                (r, Some(g))
            } else {
                (r, None)
            };
            let end = reduce.as_ref().map(|g| g.span).unwrap_or(value.span);
            return Ok((
                r,
                Arg {
                    span: name.span.to(end),
                    name: Some(name),
                    value,
                    reduce,
                },
            ));
        }
    }
    let (r, value) = expr(i, d)?;
    Ok((
        r,
        Arg {
            span: value.span,
            name: None,
            value,
            reduce: None,
        },
    ))
}

fn slice_list(i: In<'_>, d: usize) -> R<'_, Vec<SliceArg>> {
    let mut out = Vec::new();
    let mut i = i;
    loop {
        let (r, s) = slice(i, d)?;
        out.push(s);
        if peek_punct(r, ",") {
            let (r, _) = punct(r, ",")?;
            i = r;
        } else {
            return Ok((r, out));
        }
    }
}

fn slice(i: In<'_>, d: usize) -> R<'_, SliceArg> {
    if peek_punct(i, ":") {
        let (r, colon) = punct(i, ":")?;
        if peek_punct(r, ",") || peek_punct(r, "]") {
            return Ok((r, SliceArg::Full(colon)));
        }
        let (r, end) = expr(r, d)?;
        let span = colon.to(end.span);
        return Ok((
            r,
            SliceArg::Range {
                start: None,
                end: Some(end),
                span,
            },
        ));
    }
    let (r, e) = expr(i, d)?;
    if peek_punct(r, ":") {
        let (r, colon) = punct(r, ":")?;
        if peek_punct(r, ",") || peek_punct(r, "]") {
            let span = e.span.to(colon);
            return Ok((
                r,
                SliceArg::Range {
                    start: Some(e),
                    end: None,
                    span,
                },
            ));
        }
        let (r, end) = expr(r, d)?;
        let span = e.span.to(end.span);
        return Ok((
            r,
            SliceArg::Range {
                start: Some(e),
                end: Some(end),
                span,
            },
        ));
    }
    Ok((r, SliceArg::Expr(e)))
}

fn tuple_lit(i: In<'_>, d: usize) -> R<'_, TupleLit> {
    if peek_punct(i, "(") {
        let inner = nest(i, d)?;
        let (mut r, open) = punct(i, "(")?;
        let mut elems = Vec::new();
        loop {
            let (r2, e) = tuple_lit(r, inner)?;
            elems.push(e);
            if peek_punct(r2, ",") {
                let (r3, _) = punct(r2, ",")?;
                r = r3;
            } else {
                let (r3, close) = punct(r2, ")")?;
                let span = open.to(close);
                // `(x)` is the leaf `x`.
                if elems.len() == 1 {
                    if let Some(TupleLit::Leaf(e)) = elems.pop() {
                        return Ok((r3, TupleLit::Leaf(e)));
                    }
                    return fail(&r2, "a tuple element");
                }
                return Ok((r3, TupleLit::Tuple(elems, span)));
            }
        }
    }
    let (r, e) = expr(i, d)?;
    Ok((r, TupleLit::Leaf(e)))
}

fn layout_lit(i: In<'_>, d: usize) -> R<'_, LayoutLit> {
    let i = ws(i);
    let start = off(&i);
    let (i, swizzle) = if i.fragment().starts_with("S<") {
        let (r, _) = punct(i, "S")?;
        let (r, _) = punct(r, "<")?;
        let (r, (b, _)) = int(r)?;
        let (r, _) = punct(r, ",")?;
        let (r, (m, _)) = int(r)?;
        let (r, _) = punct(r, ",")?;
        let neg = peek_punct(r, "-");
        let r = if neg { punct(r, "-")?.0 } else { r };
        let (r, (s, _)) = int(r)?;
        let (r, close) = punct(r, ">")?;
        let (r, _) = keyword(r, "o")?;
        (
            r,
            Some((b, m, if neg { -s } else { s }, Span::new(start, close.end))),
        )
    } else {
        (i, None)
    };
    let (r, shape) = tuple_lit(i, d)?;
    let (r, _) = punct(r, ":")?;
    let (r, stride) = tuple_lit(r, d)?;
    let span = Span::new(start, stride.span().end);
    Ok((
        r,
        LayoutLit {
            swizzle,
            shape,
            stride,
            span,
        },
    ))
}

// ---- statements -------------------------------------------------------------------------------

fn type_expr(i: In<'_>) -> R<'_, TypeExpr> {
    let (r, dtype) = ident(i)?;
    let (r, _) = punct(r, "[")?;
    let mut dims = Vec::new();
    let mut r = r;
    if !peek_punct(r, "]") {
        loop {
            let (r2, d) = expr(r, 0)?;
            dims.push(d);
            if peek_punct(r2, ",") {
                r = punct(r2, ",")?.0;
            } else {
                r = r2;
                break;
            }
        }
    }
    let (r, close) = punct(r, "]")?;
    let (r, layout) = if peek_punct(r, "@") {
        let (r, _) = punct(r, "@")?;
        let (r, l) = layout_lit(r, 0)?;
        (r, Some(l))
    } else {
        (r, None)
    };
    let end = layout.as_ref().map(|l| l.span).unwrap_or(close);
    Ok((
        r,
        TypeExpr {
            span: dtype.span.to(end),
            dtype,
            dims,
            layout,
        },
    ))
}

/// What a statement position expects: each statement keyword, or the recipe's end.
const STATEMENT: &str =
    "a statement (`input`, `param`, `view`, `let`, `kernel` or `activation`) or `}`";

fn stmt(i: In<'_>) -> R<'_, Stmt> {
    let i = ws(i);
    let start = off(&i);
    let (r, kw) = match raw_ident(i) {
        Ok(x) => x,
        Err(_) => return fail(&i, STATEMENT),
    };
    let sp = |r: &In<'_>| Span::new(start, off(r));
    match kw.name.as_str() {
        "input" => {
            let (r, name) = commit(ident(r))?;
            let (r, _) = commit(punct(r, ":"))?;
            let (r, ty) = commit(type_expr(r))?;
            let (r, optional) = if peek_keyword(r, "optional") {
                (keyword(r, "optional")?.0, true)
            } else {
                (r, false)
            };
            Ok((
                r,
                Stmt::Input {
                    name,
                    ty,
                    optional,
                    span: sp(&r),
                },
            ))
        }
        "param" => {
            let (r, name) = commit(ident(r))?;
            let (r, _) = commit(punct(r, ":"))?;
            let (r, ty) = commit(type_expr(r))?;
            let (r, _) = commit(punct(r, "="))?;
            let (r, value) = commit(expr(r, 0))?;
            Ok((
                r,
                Stmt::Param {
                    name,
                    ty,
                    value,
                    span: sp(&r),
                },
            ))
        }
        "view" => {
            let (r, name) = commit(ident(r))?;
            let (r, ty) = if peek_punct(r, ":") {
                let (r, _) = punct(r, ":")?;
                let (r, t) = commit(type_expr(r))?;
                (r, Some(t))
            } else {
                (r, None)
            };
            let (r, _) = commit(punct(r, "="))?;
            let (r, value) = commit(expr(r, 0))?;
            let (r, bijective) = if peek_keyword(r, "bijective") {
                let (r, s) = keyword(r, "bijective")?;
                (r, Some(s))
            } else {
                (r, None)
            };
            Ok((
                r,
                Stmt::View {
                    name,
                    ty,
                    value,
                    bijective,
                    span: sp(&r),
                },
            ))
        }
        "let" => {
            let (r, name) = commit(ident(r))?;
            let (r, _) = commit(punct(r, "="))?;
            let (r, value) = commit(expr(r, 0))?;
            Ok((
                r,
                Stmt::Let {
                    name,
                    value,
                    span: sp(&r),
                },
            ))
        }
        "kernel" => {
            let (r, name) = commit(ident(r))?;
            let (r, _) = commit(punct(r, "("))?;
            let (r, operands) = commit(ident_list(r))?;
            let (r, _) = commit(punct(r, ")"))?;
            let (r, targets) = if peek_keyword(r, "on") {
                let (r, _) = keyword(r, "on")?;
                commit(ident_list(r))?
            } else {
                (r, Vec::new())
            };
            let (r, index) = if peek_keyword(r, "index") {
                let (r, _) = keyword(r, "index")?;
                let (r, w) = commit(ident(r))?;
                (r, Some(w))
            } else {
                (r, None)
            };
            Ok((
                r,
                Stmt::Kernel {
                    name,
                    operands,
                    targets,
                    index,
                    span: sp(&r),
                },
            ))
        }
        "activation" => {
            let (r, scheme) = commit(ident(r))?;
            let (r, mode, fallback) = if peek_punct(r, "(") {
                let (r, _) = punct(r, "(")?;
                let (r, mode) = commit(act_mode(r))?;
                let (r, fallback) = if peek_keyword(r, "else") {
                    let (r, _) = keyword(r, "else")?;
                    let (r, m) = commit(act_mode(r))?;
                    (r, Some(m))
                } else {
                    (r, None)
                };
                let (r, _) = commit(punct(r, ")"))?;
                (r, Some(mode), fallback)
            } else {
                (r, None, None)
            };
            Ok((
                r,
                Stmt::Activation {
                    scheme,
                    mode,
                    fallback,
                    span: sp(&r),
                },
            ))
        }
        _ => fail(&i, STATEMENT),
    }
}

/// One activation mode: `NAME`, `NAME = INT` or `static(GEMM = PARAM, ...)`.
fn act_mode(i: In<'_>) -> R<'_, ActMode> {
    let (r, name) = ident(i)?;
    if name.name == "static" && peek_punct(r, "(") {
        let (mut r, _) = punct(r, "(")?;
        let mut scales = Vec::new();
        loop {
            let (r2, gemm) = commit(ident(r))?;
            let (r2, _) = commit(punct(r2, "="))?;
            let (r2, param) = commit(ident(r2))?;
            scales.push((gemm, param));
            if peek_punct(r2, ",") {
                r = punct(r2, ",")?.0;
            } else {
                r = r2;
                break;
            }
        }
        let (r, close) = commit(punct(r, ")"))?;
        return Ok((
            r,
            ActMode {
                span: name.span.to(close),
                kind: ActModeKind::Static { scales },
            },
        ));
    }
    if peek_punct(r, "=") && !peek_punct(r, "==") {
        let (r, _) = punct(r, "=")?;
        let (r, (v, vspan)) = commit(int(r))?;
        return Ok((
            r,
            ActMode {
                span: name.span.to(vspan),
                kind: ActModeKind::Dynamic {
                    name,
                    size: Some((v, vspan)),
                },
            },
        ));
    }
    Ok((
        r,
        ActMode {
            span: name.span,
            kind: ActModeKind::Dynamic { name, size: None },
        },
    ))
}

fn ident_list(i: In<'_>) -> R<'_, Vec<Ident>> {
    let mut out = Vec::new();
    let mut i = i;
    loop {
        let (r, id) = ident(i)?;
        out.push(id);
        if peek_punct(r, ",") {
            i = punct(r, ",")?.0;
        } else {
            return Ok((r, out));
        }
    }
}

fn constraint(i: In<'_>) -> R<'_, Constraint> {
    let (r, e) = expr(i, 0)?;
    if peek_punct(r, "==") {
        let (r, _) = punct(r, "==")?;
        let (r, (z, zspan)) = commit(int(r))?;
        if let ExprKind::Chain { first, rest } = &e.kind {
            if let (Some(((BinOp::Rem, rhs), init)), 0) = (rest.split_last(), z) {
                if let ExprKind::Int(k) = rhs.kind {
                    // `EXPR % K`: EXPR is the chain without its last link.
                    let expr = chain((**first).clone(), init.to_vec());
                    return Ok((
                        r,
                        Constraint::Divisible {
                            expr,
                            by: k,
                            span: e.span.to(zspan),
                        },
                    ));
                }
            }
        }
        return Err(nom::Err::Failure(PErr {
            offset: e.span.start,
            expected: "a constraint of the form `EXPR % K == 0` or `DIM <= N`".into(),
            limit: None,
        }));
    }
    for (p, op) in [
        ("<=", CmpOp::Le),
        (">=", CmpOp::Ge),
        ("<", CmpOp::Lt),
        (">", CmpOp::Gt),
    ] {
        if peek_punct(r, p) {
            let (r, _) = punct(r, p)?;
            let (r, (v, vspan)) = commit(int(r))?;
            let ExprKind::Name(n) = &e.kind else {
                return Err(nom::Err::Failure(PErr {
                    offset: e.span.start,
                    expected: "a dimension name on the left of a bound".into(),
                    limit: None,
                }));
            };
            return Ok((
                r,
                Constraint::Bound {
                    dim: Ident {
                        name: n.clone(),
                        span: e.span,
                    },
                    op,
                    value: v,
                    span: e.span.to(vspan),
                },
            ));
        }
    }
    fail(&r, "`==`, `<=`, `>=`, `<` or `>` in a constraint")
}

fn recipe(i: In<'_>) -> R<'_, Recipe> {
    let i = ws(i);
    let start = off(&i);
    let (r, _) = keyword(i, "recipe")?;
    let (r, name) = commit(ident(r))?;
    let (r, _) = commit(punct(r, "("))?;
    let mut dims = Vec::new();
    let mut r = r;
    loop {
        let (r2, d) = commit(ident(r))?;
        let (r2, experts) = if peek_punct(r2, ":") {
            let (r3, _) = punct(r2, ":")?;
            let (r3, _) = commit(keyword(r3, "experts"))?;
            (r3, true)
        } else {
            (r2, false)
        };
        dims.push(DimDecl { name: d, experts });
        if peek_punct(r2, ",") {
            r = punct(r2, ",")?.0;
        } else {
            r = r2;
            break;
        }
    }
    let (r, _) = commit(punct(r, ")"))?;
    let mut constraints = Vec::new();
    let mut r = r;
    if peek_keyword(r, "where") {
        r = keyword(r, "where")?.0;
        loop {
            let (r2, c) = commit(constraint(r))?;
            constraints.push(c);
            if peek_punct(r2, ",") {
                r = punct(r2, ",")?.0;
            } else {
                r = r2;
                break;
            }
        }
    }
    let (mut r, _) = commit(punct(r, "{"))?;
    let mut stmts = Vec::new();
    loop {
        if peek_punct(r, ";") {
            r = punct(r, ";")?.0;
            continue;
        }
        if peek_punct(r, "}") {
            break;
        }
        let (r2, s) = commit(stmt(r))?;
        stmts.push(s);
        r = r2;
    }
    let (r, close) = commit(punct(r, "}"))?;
    let rest = ws(r);
    if !rest.fragment().is_empty() {
        return Err(nom::Err::Failure(PErr {
            offset: off(&rest),
            expected: "the end of the file after the recipe's `}`".into(),
            limit: None,
        }));
    }
    let (r, _) = take_while(|_| false).parse(rest)?;
    Ok((
        r,
        Recipe {
            name,
            dims,
            constraints,
            stmts,
            span: Span::new(start, close.end),
        },
    ))
}

/// Describe the token at `offset` for an error message.
fn found_at(src: &str, offset: usize) -> String {
    let rest = src.get(offset..).unwrap_or("");
    let rest = rest.trim_start();
    if rest.is_empty() {
        return "the end of the file".into();
    }
    let tok: String = if rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
        rest.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    } else {
        rest.chars().take(1).collect()
    };
    format!("`{tok}`")
}

/// Parse a recipe source into its syntax tree.
///
/// A source larger than [`MAX_SOURCE_BYTES`] is refused (E0004) before it is read; nesting deeper
/// than [`MAX_DEPTH`] levels (E0002) and chains longer than [`MAX_CHAIN`] (E0003) are refused where
/// the limit is crossed.
pub fn parse(src: &str) -> Result<Recipe, Diagnostic> {
    if src.len() > MAX_SOURCE_BYTES {
        return Err(too_large(src));
    }
    match recipe(LocatedSpan::new(src)) {
        Ok((_, r)) => Ok(r),
        Err(nom::Err::Error(e)) | Err(nom::Err::Failure(e)) => {
            // Point at the offending token, not at the whitespace before it.
            let skip = src
                .get(e.offset..)
                .map(|s| s.len() - ws(LocatedSpan::new(s)).fragment().len())
                .unwrap_or(0);
            let at = (e.offset + skip).min(src.len());
            let found = found_at(src, at);
            let len = if found.starts_with("`") {
                found.len().saturating_sub(2).max(1)
            } else {
                0
            };
            let end = (at + len).min(src.len());
            let span = Span::new(at, end);
            Err(match e.limit {
                Some(limit) => limit_diagnostic(limit, span),
                None => Diagnostic::error(
                    "E0001",
                    format!("syntax error: expected {}, found {found}", e.expected),
                )
                .with_label(span, format!("expected {}", e.expected)),
            })
        }
        Err(nom::Err::Incomplete(_)) => Err(Diagnostic::error(
            "E0001",
            "syntax error: unexpected end of input",
        )
        .with_label(Span::new(src.len(), src.len()), "input ends here")),
    }
}

/// E0004: the source is larger than [`MAX_SOURCE_BYTES`]; the label marks the first character past
/// the limit.
fn too_large(src: &str) -> Diagnostic {
    let mut at = MAX_SOURCE_BYTES;
    while !src.is_char_boundary(at) {
        at += 1;
    }
    let end = src
        .get(at..)
        .and_then(|s| s.chars().next())
        .map_or(at, |c| at + c.len_utf8());
    Diagnostic::error(
        "E0004",
        format!(
            "recipe too large: more than {MAX_SOURCE_BYTES} bytes ({} MiB)",
            MAX_SOURCE_BYTES >> 20
        ),
    )
    .with_label(Span::new(at, end), "the limit is crossed here")
    .with_note(format!("the recipe has {} bytes", src.len()))
}

/// E0002 or E0003 for a limit crossed at `span`.
fn limit_diagnostic(limit: Limit, span: Span) -> Diagnostic {
    match limit {
        Limit::Depth => Diagnostic::error(
            "E0002",
            format!("nesting too deep: more than {MAX_DEPTH} levels"),
        )
        .with_label(span, format!("level {} starts here", MAX_DEPTH + 1))
        .with_note(format!(
            "parentheses, calls, `quant`, unary `-`, `[...]`, `@` layouts and layout tuples nest at most {MAX_DEPTH} levels deep"
        )),
        Limit::Chain(kind) => {
            let (what, one, each) = match kind {
                ChainKind::Sum => ("terms", "sum", "term"),
                ChainKind::Product => ("factors", "product", "factor"),
                ChainKind::Suffixes => (
                    "suffixes (`.f`, `[...]`, `@ L`)",
                    "run after one operand",
                    "suffix",
                ),
            };
            Diagnostic::error(
                "E0003",
                format!("expression too long: more than {MAX_CHAIN} {what} in one {one}"),
            )
            .with_label(span, format!("{each} {} starts here", MAX_CHAIN + 1))
            .with_note("help: name parts of it with `let`")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_small_recipe() {
        let src = "recipe r(E: experts, H) where H % 16 == 0, H <= 8192 {\n  input w : bf16[E, H]\n  param p : bf16[E, H] = w\n  view v = p[:, 0:H/2] @ (E,4):(H,1) bijective\n  kernel k(p, v) on sm_90a index i32\n}\n";
        let r = parse(src);
        assert!(r.is_ok(), "{r:?}");
        let r = r.unwrap_or_else(|_| unreachable!());
        assert_eq!(r.name.name, "r");
        assert_eq!(r.dims.len(), 2);
        assert!(r.dims[0].experts);
        assert_eq!(r.constraints.len(), 2);
        assert_eq!(r.stmts.len(), 4);
    }

    #[test]
    fn reports_position_of_syntax_errors() {
        let src = "recipe r(E: experts) {\n  input w bf16[E]\n}";
        let d = parse(src).err();
        let d = d.map(|d| (d.message.clone(), d.labels[0].0));
        assert_eq!(
            d,
            Some((
                "syntax error: expected `:`, found `bf16`".to_string(),
                Span::new(33, 37)
            ))
        );
    }
}
