//! Differential soundness test of the verifier (issue \[5\]).
//!
//! Random recipes with symbolic extents (`ceil_div`, `round_up`, differences, products, constants,
//! several bounds per dimension, divisibility constraints), params with and without declared storage
//! layouts (hierarchical modes, swizzles, negative or bumped strides, the 128x4 tile layout of
//! `swizzle_128x4`), views (slices, indexing, `permute`, `reshape`, explicit layouts with broadcast
//! modes, `mma_sf_view`, `bijective` claims) and kernel bindings (`index i32` / `i64`). Each recipe
//! is also a model in this file, so every size, shape and storage offset has a reference value
//! computed here, without the verifier's polynomials.
//!
//! For every recipe that `moeforge_dsl::check(src, None)` accepts (a rejected recipe is retried
//! without the statements its diagnostics point at), every statement must have been verified, and at
//! admissible bindings chosen from the where-clause (every dimension at its smallest admissible
//! value, the next one, its largest where an upper bound is declared, one in between; combinations
//! kept small) the test binds the module (it must succeed, unless a tensor passes 2^63 elements or
//! bytes, where it must be refused) and checks every promise reported as `Proof::Symbolic`: every
//! extent is at least 1; every view's index map lies inside its param and a bijection is one (or a
//! proven non-bijection is not); each view's offsets are those its definition names (reference
//! model); every param is dense and expert-major (expert `e` owns exactly `[e*per, (e+1)*per)`), with
//! its declared storage map, and whole bytes per expert; every kernel operand's largest per-expert
//! offset is below 2^31 (`index i32`) or 2^63. It then verifies the module at that binding: it must be
//! accepted where every proof was symbolic, and whatever it then proves (exhaustively) must hold too.
//! Exhaustive enumeration up to a few thousand coordinates, sampled coordinates beyond (every mode at
//! both extremes, plus random ones). A panic anywhere is a failure.
//!
//! Replay: each run draws a fresh seed and prints it on stderr (`soundness: seed N ...`, visible with
//! `--nocapture`); a failure prints the seed, the recipe and the binding. Replay a run with
//! `PROPTEST_RNG_SEED=N cargo test -p moeforge-dsl --test soundness`; `PROPTEST_CASES=K` changes the
//! number of cases (default 160, about 7 s in debug). A failing case is shrunk (its choice stream
//! toward zero, that is toward simpler recipes) before it is reported; the printed recipe is a
//! ready-made regression test. The fixed tests at the end pin the known fixes and the bugs this test
//! found.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use moeforge_dsl::ir::{IndexWidth, Module, SymLayout};
use moeforge_dsl::layout::Swizzle;
use moeforge_dsl::verify::{self, Binding, ModuleInfo, Proof};
use moeforge_dsl::Diagnostic;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

/// Views up to this many coordinates (and params up to [`PARAM_BUDGET`] elements) are enumerated.
const VIEW_BUDGET: i128 = 1 << 12;
const PARAM_BUDGET: i128 = 1 << 13;
/// Random coordinates sampled beyond the budget (besides the extremes of every mode).
const SAMPLES: usize = 48;

// ---- panics are failures ------------------------------------------------------------------------

thread_local! {
    /// Set while [`guarded`] runs: the panic hook then records the panic instead of printing it.
    static QUIET: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, turning a panic into an error naming where and why (printed by the failure report,
/// not by the panic hook).
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let quiet = QUIET.with(|q| {
                let mut q = q.borrow_mut();
                if let Some(slot) = q.as_mut() {
                    *slot = info.to_string();
                    true
                } else {
                    false
                }
            });
            if !quiet {
                default(info);
            }
        }));
    });
    QUIET.with(|q| *q.borrow_mut() = Some(String::new()));
    let r = catch_unwind(AssertUnwindSafe(f));
    let msg = QUIET.with(|q| q.borrow_mut().take()).unwrap_or_default();
    r.map_err(|_| format!("{what} panicked: {msg}"))
}

// ---- a choice stream ----------------------------------------------------------------------------

/// Reads the generator's decisions from a vector proptest draws and shrinks: a choice of 0 is always
/// the simplest option, so shrinking toward zero simplifies the recipe.
struct Ch<'a> {
    xs: &'a [u32],
    i: usize,
}

impl Ch<'_> {
    fn pick(&mut self, n: usize) -> usize {
        let x = self.xs.get(self.i).copied().unwrap_or(0);
        self.i += 1;
        if n <= 1 {
            0
        } else {
            x as usize % n
        }
    }

    /// True with `pct`% probability (false for a zero choice).
    fn chance(&mut self, pct: usize) -> bool {
        self.pick(100) + pct >= 100
    }

    fn one<T: Clone>(&mut self, v: &[T]) -> T {
        v[self.pick(v.len())].clone()
    }

    /// A permutation of `0..n` (the identity for zero choices).
    fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = i - self.pick(i + 1);
            p.swap(i, j);
        }
        p
    }
}

/// A small deterministic generator for sampled coordinates.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: i128) -> i128 {
        if n <= 1 {
            0
        } else {
            (((self.next() as u128) << 64 | self.next() as u128) % n as u128) as i128
        }
    }
}

// ---- sizes --------------------------------------------------------------------------------------

const NAMES: [&str; 4] = ["E", "H", "I", "K"];

/// A size expression as written in the recipe, evaluated here exactly.
#[derive(Debug, Clone, PartialEq)]
enum Sz {
    C(i64),
    D(usize),
    Add(Box<Sz>, Box<Sz>),
    Sub(Box<Sz>, Box<Sz>),
    Mul(Box<Sz>, Box<Sz>),
    Div(Box<Sz>, i64),
    Cd(Box<Sz>, i64),
    Ru(Box<Sz>, i64),
}

/// Why a size has no value at a binding.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bad {
    Overflow,
    Inexact,
}

fn c(k: i64) -> Sz {
    Sz::C(k)
}

fn mul(a: Sz, b: Sz) -> Sz {
    match (&a, &b) {
        (Sz::C(1), _) => b,
        (_, Sz::C(1)) => a,
        _ => Sz::Mul(Box::new(a), Box::new(b)),
    }
}

fn add(a: Sz, b: Sz) -> Sz {
    Sz::Add(Box::new(a), Box::new(b))
}

fn sub(a: Sz, b: Sz) -> Sz {
    if b == c(0) {
        a
    } else {
        Sz::Sub(Box::new(a), Box::new(b))
    }
}

fn product(v: &[Sz]) -> Sz {
    v.iter().cloned().fold(c(1), mul)
}

impl Sz {
    fn prec(&self) -> u8 {
        match self {
            Sz::Add(..) | Sz::Sub(..) => 1,
            Sz::Mul(..) | Sz::Div(..) => 2,
            _ => 3,
        }
    }

    fn show(&self) -> String {
        let wrap = |s: &Sz, min: u8| {
            let t = s.show();
            if s.prec() < min {
                format!("({t})")
            } else {
                t
            }
        };
        match self {
            Sz::C(k) => k.to_string(),
            Sz::D(i) => NAMES[*i].to_string(),
            Sz::Add(a, b) => format!("{} + {}", wrap(a, 1), wrap(b, 2)),
            Sz::Sub(a, b) => format!("{} - {}", wrap(a, 1), wrap(b, 2)),
            Sz::Mul(a, b) => format!("{}*{}", wrap(a, 2), wrap(b, 3)),
            Sz::Div(a, k) => format!("{}/{k}", wrap(a, 2)),
            Sz::Cd(a, k) => format!("ceil_div({}, {k})", a.show()),
            Sz::Ru(a, k) => format!("round_up({}, {k})", a.show()),
        }
    }

    /// Inside a layout tuple a leading `(` would open a tuple: such a size is written `0 + ...`.
    fn show_in_tuple(&self) -> String {
        let t = self.show();
        if t.starts_with('(') {
            format!("0 + {t}")
        } else {
            t
        }
    }

    fn eval(&self, env: &[i128]) -> Result<i128, Bad> {
        let o = |x: Option<i128>| x.ok_or(Bad::Overflow);
        Ok(match self {
            Sz::C(k) => *k as i128,
            Sz::D(i) => env[*i],
            Sz::Add(a, b) => o(a.eval(env)?.checked_add(b.eval(env)?))?,
            Sz::Sub(a, b) => o(a.eval(env)?.checked_sub(b.eval(env)?))?,
            Sz::Mul(a, b) => o(a.eval(env)?.checked_mul(b.eval(env)?))?,
            Sz::Div(a, k) => {
                let v = a.eval(env)?;
                if v % *k as i128 != 0 {
                    return Err(Bad::Inexact);
                }
                v / *k as i128
            }
            Sz::Cd(a, k) => o(a.eval(env)?.checked_add(*k as i128 - 1))?.div_euclid(*k as i128),
            Sz::Ru(a, k) => {
                let q = o(a.eval(env)?.checked_add(*k as i128 - 1))?.div_euclid(*k as i128);
                o(q.checked_mul(*k as i128))?
            }
        })
    }

    /// `a*b` as two factors (to split a mode or a dimension).
    fn factors(&self) -> Option<(Sz, Sz)> {
        match self {
            Sz::Mul(a, b) => Some(((**a).clone(), (**b).clone())),
            Sz::C(k) if *k % 2 == 0 && *k > 2 => Some((c(2), c(k / 2))),
            _ => None,
        }
    }
}

/// A size over the dimensions: mostly the forms recipes use (a dimension, a multiple, a quotient by
/// a declared divisor, `ceil_div`, `round_up`, a difference within a declared lower bound), sometimes
/// arbitrary sums, differences and products, rarely huge constants.
fn gen_size(ch: &mut Ch<'_>, dims: &[Dim], depth: u32) -> Sz {
    let nd = dims.len();
    let any_dim = |ch: &mut Ch<'_>| 1 + ch.pick(nd - 1);
    let k = ch.pick(if depth == 0 { 12 } else { 18 });
    let inner = |ch: &mut Ch<'_>| gen_size(ch, dims, depth.saturating_sub(1));
    match k {
        0..=3 => Sz::D(any_dim(ch)),
        4 => mul(c(ch.one(&[2, 4, 16])), Sz::D(any_dim(ch))),
        5 => c(1 + ch.pick(8) as i64),
        6 => {
            if ch.chance(4) {
                c(ch.one(&[1 << 40, 1 << 62]))
            } else {
                c(ch.one(&[16, 32, 64, 128, 3]))
            }
        }
        7 => {
            // A quotient by (a divisor of) the declared divisor, or by anything.
            let d = any_dim(ch);
            let u = dims[d].step();
            let k = [128, 64, 16, 8, 4, 2]
                .into_iter()
                .find(|k| u % k == 0 && ch.chance(70))
                .unwrap_or_else(|| ch.one(&[2, 4, 16]));
            Sz::Div(Box::new(Sz::D(d)), k as i64)
        }
        8 => {
            // `D - k`: within the declared lower bound, or not.
            let d = any_dim(ch);
            let lo = dims[d].lo().min(200) as i64;
            let k = if lo > 1 && ch.chance(75) {
                1 + ch.pick((lo - 1) as usize) as i64
            } else {
                1 + ch.pick(4) as i64
            };
            sub(Sz::D(d), c(k))
        }
        9 => {
            let d = any_dim(ch);
            let lo = dims[d].lo().min(200) as i64;
            let k = if lo > 1 && ch.chance(70) {
                ch.pick(lo as usize) as i64
            } else {
                ch.pick(5) as i64
            };
            Sz::Cd(Box::new(sub(Sz::D(d), c(k))), ch.one(&[2, 3, 16, 128]))
        }
        10 => Sz::Ru(Box::new(Sz::D(any_dim(ch))), ch.one(&[4, 16, 128])),
        11 => Sz::D(ch.pick(nd)),
        12 | 13 => mul(inner(ch), inner(ch)),
        14 => add(inner(ch), inner(ch)),
        15 => Sz::Cd(Box::new(inner(ch)), ch.one(&[2, 3, 16, 128])),
        16 => Sz::Ru(Box::new(inner(ch)), ch.one(&[4, 16, 128])),
        _ => sub(inner(ch), inner(ch)),
    }
}

// ---- dimensions and the where-clause ------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq)]
enum Cmp {
    Ge,
    Gt,
    Le,
    Lt,
}

#[derive(Debug, Clone)]
struct Dim {
    /// `C*DIM % K == 0` as `(C, K)`.
    divs: Vec<(i64, i64)>,
    bounds: Vec<(Cmp, i64)>,
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 {
        a.abs()
    } else {
        gcd(b, a % b)
    }
}

impl Dim {
    /// Admissible values are the multiples of this.
    fn step(&self) -> i128 {
        self.divs.iter().fold(1, |u, &(c, k)| {
            let need = k as i128 / gcd(c as i128, k as i128);
            u / gcd(u, need) * need
        })
    }

    fn lo(&self) -> i128 {
        let from = |&(c, v): &(Cmp, i64)| match c {
            Cmp::Ge => Some(v as i128),
            Cmp::Gt => Some(v as i128 + 1),
            _ => None,
        };
        self.bounds.iter().filter_map(from).fold(1, i128::max)
    }

    fn hi(&self) -> Option<i128> {
        let from = |&(c, v): &(Cmp, i64)| match c {
            Cmp::Le => Some(v as i128),
            Cmp::Lt => Some(v as i128 - 1),
            _ => None,
        };
        self.bounds.iter().filter_map(from).min()
    }

    /// The smallest admissible value, if any.
    fn first(&self) -> Option<i128> {
        let u = self.step();
        let f = (self.lo() + u - 1) / u * u;
        (self.hi().is_none_or(|h| f <= h) && f <= i64::MAX as i128).then_some(f)
    }

    /// The largest admissible value where an upper bound is declared.
    fn last(&self) -> Option<i128> {
        let u = self.step();
        self.hi().map(|h| h.div_euclid(u) * u)
    }

    fn constraints(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        for &(c, k) in &self.divs {
            if c == 1 {
                out.push(format!("{name} % {k} == 0"));
            } else {
                out.push(format!("{c}*{name} % {k} == 0"));
            }
        }
        for &(c, v) in &self.bounds {
            let op = match c {
                Cmp::Ge => ">=",
                Cmp::Gt => ">",
                Cmp::Le => "<=",
                Cmp::Lt => "<",
            };
            out.push(format!("{name} {op} {v}"));
        }
        out
    }
}

fn gen_dim(ch: &mut Ch<'_>, experts: bool) -> Dim {
    let divs = match ch.pick(12) {
        0..=6 => Vec::new(),
        7 => vec![(1, ch.one(&[2, 4, 16, 64, 128]))],
        8 if !experts => vec![(1, ch.one(&[16, 64]))],
        9 => vec![(ch.one(&[2, 3]), ch.one(&[4, 6, 8, 128]))],
        10 => vec![(1, 4), (1, ch.one(&[6, 8]))],
        _ => Vec::new(),
    };
    let n = ch.one(&[0, 0, 1, 1, 1, 2, 2, 3]);
    let mut bounds = Vec::new();
    for _ in 0..n {
        let b = match ch.pick(4) {
            0 if ch.chance(3) => (
                ch.one(&[Cmp::Ge, Cmp::Gt]),
                ch.one(&[i64::MAX, i64::MAX - 1, 1 << 62]),
            ),
            0 => (Cmp::Ge, ch.one(&[2, 1, 0, 3, 4, 5, 8, 17, 129])),
            1 => (Cmp::Gt, ch.one(&[0, 1, 2, 3, 7, 16])),
            2 => (
                Cmp::Le,
                ch.one(&[
                    64,
                    1,
                    2,
                    8,
                    16,
                    100,
                    128,
                    1024,
                    4096,
                    46340,
                    46341,
                    65536,
                    1 << 20,
                    (1 << 31) - 1,
                    1 << 31,
                ]),
            ),
            _ => (Cmp::Lt, ch.one(&[64, 3, 17, 129, 46341, 65537, 1 << 31])),
        };
        bounds.push(b);
    }
    Dim { divs, bounds }
}

// ---- the recipe model ---------------------------------------------------------------------------

/// A layout literal: top-level modes of `(extent, stride)` sub-modes (first fastest), a swizzle.
#[derive(Debug, Clone)]
struct Lay {
    modes: Vec<Vec<(Sz, Sz)>>,
    swizzle: Option<Swizzle>,
}

impl Lay {
    fn show(&self) -> String {
        let part = |which: usize| {
            let modes: Vec<String> = self
                .modes
                .iter()
                .map(|m| {
                    let xs: Vec<String> = m
                        .iter()
                        .map(|(s, d)| if which == 0 { s } else { d }.show_in_tuple())
                        .collect();
                    if xs.len() == 1 {
                        xs[0].clone()
                    } else {
                        format!("({})", xs.join(", "))
                    }
                })
                .collect();
            if modes.len() == 1 {
                modes[0].clone()
            } else {
                format!("({})", modes.join(", "))
            }
        };
        let sw = self
            .swizzle
            .map(|s| format!("S<{},{},{}> o ", s.bits, s.base, s.shift))
            .unwrap_or_default();
        format!("{sw}{}:{}", part(0), part(1))
    }

    fn eval(&self, env: &[i128]) -> Result<NumLay, Bad> {
        let mut dims = Vec::new();
        for m in &self.modes {
            let mut d = Vec::new();
            for (s, st) in m {
                d.push((s.eval(env)?, st.eval(env)?));
            }
            dims.push(d);
        }
        Ok(NumLay {
            dims,
            offset: 0,
            swizzle: self.swizzle,
        })
    }
}

#[derive(Debug, Clone)]
enum Storage {
    RowMajor,
    /// `swizzle_128x4`'s implicit 128x4 tile layout.
    Tile,
    Declared(Lay),
}

#[derive(Debug, Clone)]
struct Param {
    dtype: &'static str,
    shape: Vec<Sz>,
    storage: Storage,
    /// `(M, K)` of a `swizzle_128x4` param over an `[E, M, K]` input.
    tile: Option<(Sz, Sz)>,
}

impl Param {
    fn bits(&self) -> i128 {
        match self.dtype {
            "e2m1" => 4,
            "f32" | "i32" => 32,
            "bf16" | "f16" => 16,
            _ => 8,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Slice {
        dim: usize,
        start: Sz,
        end: Sz,
        text: String,
    },
    Index {
        dim: usize,
        at: Sz,
    },
    Permute(Vec<usize>),
    Reshape(Vec<Sz>),
    Apply(Lay),
    Mma,
}

#[derive(Debug, Clone)]
struct View {
    param: usize,
    ops: Vec<Op>,
    claim: bool,
    /// Write the view's type (`view v : f32[..] = ...`).
    typed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Operand {
    P(usize),
    V(usize),
}

#[derive(Debug, Clone)]
struct Kernel {
    operands: Vec<Operand>,
    index: Option<&'static str>,
}

#[derive(Debug, Clone)]
struct Case {
    dims: Vec<Dim>,
    params: Vec<Param>,
    views: Vec<View>,
    kernels: Vec<Kernel>,
    p_alive: Vec<bool>,
    v_alive: Vec<bool>,
}

/// What a line of the rendered recipe holds.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Item {
    Header,
    Param(usize),
    View(usize),
    Kernel(usize),
    End,
}

fn shape_after(shape: &[Sz], op: &Op, p: &Param) -> Vec<Sz> {
    let mut s = shape.to_vec();
    match op {
        Op::Slice {
            dim, start, end, ..
        } => s[*dim] = sub(end.clone(), start.clone()),
        Op::Index { dim, .. } => {
            s.remove(*dim);
        }
        Op::Permute(perm) => s = perm.iter().map(|&k| shape[k].clone()).collect(),
        Op::Reshape(n) => s = n.clone(),
        Op::Apply(l) => {
            s = l
                .modes
                .iter()
                .map(|m| product(&m.iter().map(|x| x.0.clone()).collect::<Vec<_>>()))
                .collect()
        }
        Op::Mma => {
            let (m, k) = p.tile.clone().unwrap_or((c(1), c(1)));
            s = vec![
                c(32),
                c(4),
                Sz::Cd(Box::new(m), 128),
                c(4),
                Sz::Cd(Box::new(k), 4),
                shape[0].clone(),
            ];
        }
    }
    s
}

impl Case {
    fn view_shapes(&self, v: &View) -> Vec<Vec<Sz>> {
        let p = &self.params[v.param];
        let mut out = vec![p.shape.clone()];
        for op in &v.ops {
            let next = shape_after(out.last().unwrap(), op, p);
            out.push(next);
        }
        out
    }

    fn operand_alive(&self, o: Operand) -> bool {
        match o {
            Operand::P(i) => self.p_alive[i],
            Operand::V(j) => self.v_alive[j] && self.p_alive[self.views[j].param],
        }
    }

    fn render(&self) -> (String, Vec<Item>) {
        let mut lines: Vec<(Item, String)> = Vec::new();
        let dims: Vec<String> = (0..self.dims.len())
            .map(|i| {
                if i == 0 {
                    "E: experts".to_string()
                } else {
                    NAMES[i].to_string()
                }
            })
            .collect();
        let cons: Vec<String> = self
            .dims
            .iter()
            .enumerate()
            .flat_map(|(i, d)| d.constraints(NAMES[i]))
            .collect();
        let wh = if cons.is_empty() {
            String::new()
        } else {
            format!(" where {}", cons.join(", "))
        };
        lines.push((
            Item::Header,
            format!("recipe soundness({}){wh} {{", dims.join(", ")),
        ));
        let shape = |s: &[Sz]| s.iter().map(Sz::show).collect::<Vec<_>>().join(", ");
        for (i, p) in self.params.iter().enumerate() {
            if !self.p_alive[i] {
                continue;
            }
            let (input, value) = match &p.tile {
                Some((m, k)) => (
                    format!("  input x{i} : {}[E, {}, {}]", p.dtype, m.show(), k.show()),
                    format!("swizzle_128x4(x{i})"),
                ),
                None => (
                    format!("  input x{i} : {}[{}]", p.dtype, shape(&p.shape)),
                    format!("x{i}"),
                ),
            };
            lines.push((Item::Param(i), input));
            let lay = match &p.storage {
                Storage::Declared(l) => format!(" @ {}", l.show()),
                _ => String::new(),
            };
            lines.push((
                Item::Param(i),
                format!(
                    "  param p{i} : {}[{}]{lay} = {value}",
                    p.dtype,
                    shape(&p.shape)
                ),
            ));
        }
        for (j, v) in self.views.iter().enumerate() {
            if !self.v_alive[j] || !self.p_alive[v.param] {
                continue;
            }
            let shapes = self.view_shapes(v);
            let mut e = format!("p{}", v.param);
            let mut atomic = true;
            for (op, before) in v.ops.iter().zip(&shapes) {
                let base = if atomic { e.clone() } else { format!("({e})") };
                atomic = true;
                e = match op {
                    Op::Slice { dim, text, .. } => {
                        let mut idx = vec![":".to_string(); before.len()];
                        idx[*dim] = text.clone();
                        format!("{base}[{}]", idx.join(", "))
                    }
                    Op::Index { dim, at } => {
                        let mut idx = vec![":".to_string(); before.len()];
                        idx[*dim] = at.show();
                        format!("{base}[{}]", idx.join(", "))
                    }
                    Op::Permute(perm) => {
                        let ps: Vec<String> = perm.iter().map(|k| k.to_string()).collect();
                        format!("permute({e}, {})", ps.join(", "))
                    }
                    Op::Reshape(n) => format!("reshape({e}, {})", shape(n)),
                    Op::Apply(l) => {
                        atomic = false;
                        format!("{e} @ {}", l.show())
                    }
                    Op::Mma => format!("mma_sf_view({e})"),
                };
            }
            let ty = if v.typed {
                let p = &self.params[v.param];
                format!(" : {}[{}]", p.dtype, shape(shapes.last().unwrap()))
            } else {
                String::new()
            };
            let claim = if v.claim { " bijective" } else { "" };
            lines.push((Item::View(j), format!("  view v{j}{ty} = {e}{claim}")));
        }
        for (k, kb) in self.kernels.iter().enumerate() {
            let ops: Vec<String> = kb
                .operands
                .iter()
                .filter(|o| self.operand_alive(**o))
                .map(|o| match o {
                    Operand::P(i) => format!("p{i}"),
                    Operand::V(j) => format!("v{j}"),
                })
                .collect();
            if ops.is_empty() {
                continue;
            }
            let idx = kb.index.map(|w| format!(" index {w}")).unwrap_or_default();
            lines.push((
                Item::Kernel(k),
                format!("  kernel k{k}({}) on host{idx}", ops.join(", ")),
            ));
        }
        lines.push((Item::End, "}".to_string()));
        let src = lines
            .iter()
            .map(|l| l.1.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        (src + "\n", lines.into_iter().map(|l| l.0).collect())
    }

    /// Drop the statements the diagnostics point at (and what depends on them). False when a
    /// diagnostic is about the header or points nowhere: the recipe is then rejected as a whole.
    fn drop_blamed(&mut self, ds: &[Diagnostic], src: &str, items: &[Item]) -> bool {
        let mut any = false;
        for d in ds {
            if d.labels.is_empty() {
                return false;
            }
            for (span, _) in &d.labels {
                let line = src[..span.start.min(src.len())].matches('\n').count();
                match items.get(line) {
                    Some(Item::Param(i)) => {
                        any |= self.p_alive[*i];
                        self.p_alive[*i] = false;
                    }
                    Some(Item::View(j)) => {
                        any |= self.v_alive[*j];
                        self.v_alive[*j] = false;
                    }
                    Some(Item::Kernel(k)) => {
                        any |= !self.kernels[*k].operands.is_empty();
                        self.kernels[*k].operands.clear();
                    }
                    _ => return false,
                }
            }
        }
        any
    }
}

// ---- generating recipes -------------------------------------------------------------------------

fn gen_extent(ch: &mut Ch<'_>, dims: &[Dim]) -> Sz {
    let s = gen_size(ch, dims, 1);
    if ch.chance(30) {
        mul(c(ch.one(&[2, 4, 128])), s)
    } else {
        s
    }
}

/// A compact (dense) layout of `shape` with modes optionally split, stored in a random order, the
/// experts mode outermost; sometimes perturbed (a stride bumped or swapped, the experts mode moved
/// inside, a swizzle).
fn gen_storage(ch: &mut Ch<'_>, shape: &[Sz]) -> Lay {
    let mut modes: Vec<Vec<Sz>> = Vec::new();
    for (d, s) in shape.iter().enumerate() {
        match s.factors() {
            Some((a, b)) if d > 0 && ch.chance(35) => {
                if ch.chance(50) {
                    modes.push(vec![b, a]);
                } else {
                    modes.push(vec![a, b]);
                }
            }
            _ => modes.push(vec![s.clone()]),
        }
    }
    let mut leaves: Vec<(usize, usize)> = Vec::new();
    for (d, m) in modes.iter().enumerate().skip(1) {
        for j in 0..m.len() {
            leaves.push((d, j));
        }
    }
    let order = ch.perm(leaves.len());
    let mut order: Vec<(usize, usize)> = order.iter().map(|&k| leaves[k]).collect();
    // Storage order, fastest first: the experts leaf last (outermost) unless moved.
    if ch.chance(6) {
        let at = ch.pick(order.len() + 1);
        order.insert(at, (0, 0));
    } else {
        order.push((0, 0));
    }
    let mut strides: Vec<Vec<Sz>> = modes.iter().map(|m| vec![c(0); m.len()]).collect();
    let mut acc = c(1);
    for &(d, j) in &order {
        strides[d][j] = acc.clone();
        acc = mul(acc, modes[d][j].clone());
    }
    if ch.chance(8) {
        let (d, j) = order[ch.pick(order.len())];
        strides[d][j] = add(strides[d][j].clone(), c(1));
    }
    if ch.chance(3) {
        let (d, j) = order[ch.pick(order.len())];
        strides[d][j] = sub(c(0), strides[d][j].clone());
    }
    if ch.chance(5) && order.len() >= 2 {
        let (a, b) = (order[0], order[1]);
        let t = strides[a.0][a.1].clone();
        strides[a.0][a.1] = strides[b.0][b.1].clone();
        strides[b.0][b.1] = t;
    }
    let swizzle = ch.chance(12).then(|| gen_swizzle(ch));
    Lay {
        modes: modes
            .into_iter()
            .zip(strides)
            .map(|(m, s)| m.into_iter().zip(s).collect())
            .collect(),
        swizzle,
    }
}

fn gen_swizzle(ch: &mut Ch<'_>) -> Swizzle {
    let b = ch.pick(3) as u32;
    let m = ch.pick(4) as u32;
    let s = b as i32 + ch.pick(3) as i32;
    Swizzle::new(b, m, if ch.chance(15) { -s } else { s })
}

fn gen_param(ch: &mut Ch<'_>, dims: &[Dim]) -> Param {
    if ch.chance(20) {
        // 1-byte scales swizzled into 128x4 tiles.
        let m = gen_extent(ch, dims);
        let k = gen_size(ch, dims, 0);
        let (mp, kp) = (
            Sz::Ru(Box::new(m.clone()), 128),
            Sz::Ru(Box::new(k.clone()), 4),
        );
        let shape = vec![Sz::D(0), mp.clone(), kp.clone()];
        let storage = match ch.pick(8) {
            0..=5 => Storage::Tile,
            6 => {
                let (mt, kt) = (
                    Sz::Cd(Box::new(m.clone()), 128),
                    Sz::Cd(Box::new(k.clone()), 4),
                );
                Storage::Declared(Lay {
                    modes: vec![
                        vec![(Sz::D(0), mul(mp, kp))],
                        vec![(c(32), c(16)), (c(4), c(4)), (mt, mul(kt.clone(), c(512)))],
                        vec![(c(4), c(1)), (kt, c(512))],
                    ],
                    swizzle: None,
                })
            }
            _ => Storage::Declared(gen_storage(ch, &shape)),
        };
        return Param {
            dtype: ch.one(&["e4m3", "e8m0"]),
            shape,
            storage,
            tile: Some((m, k)),
        };
    }
    let rank = 1 + ch.pick(3);
    let mut shape = vec![Sz::D(0)];
    for _ in 0..rank {
        shape.push(gen_extent(ch, dims));
    }
    let storage = if ch.chance(40) {
        Storage::Declared(gen_storage(ch, &shape))
    } else {
        Storage::RowMajor
    };
    Param {
        dtype: ch.one(&["f32", "bf16", "e4m3", "e2m1", "i32"]),
        shape,
        storage,
        tile: None,
    }
}

fn pick_dim(ch: &mut Ch<'_>, rank: usize) -> usize {
    if rank > 1 && !ch.chance(10) {
        1 + ch.pick(rank - 1)
    } else {
        ch.pick(rank)
    }
}

fn gen_slice(ch: &mut Ch<'_>, shape: &[Sz], dims: &[Dim]) -> Op {
    let dim = pick_dim(ch, shape.len());
    let ext = shape[dim].clone();
    let (start, end) = match ch.pick(7) {
        0 => (c(0), c(1)),
        1 => match ext.factors() {
            Some((Sz::C(k), b)) => {
                let q = ch.pick(k as usize) as i64;
                (mul(c(q), b.clone()), mul(c(q + 1), b))
            }
            Some((a, Sz::C(k))) => {
                let q = ch.pick(k as usize) as i64;
                (mul(c(q), a.clone()), mul(c(q + 1), a))
            }
            Some((a, _)) => (c(0), a),
            None => (c(0), ext.clone()),
        },
        2 => (c(1), ext.clone()),
        3 => (c(1), sub(ext.clone(), c(1))),
        4 => (c(0), c(2 + ch.pick(3) as i64)),
        5 => (c(ch.one(&[128, 4])), ext.clone()),
        _ => (gen_size(ch, dims, 0), gen_size(ch, dims, 0)),
    };
    let a = if start == c(0) && ch.chance(50) {
        String::new()
    } else {
        start.show()
    };
    let b = if end == ext && ch.chance(50) {
        String::new()
    } else {
        end.show()
    };
    Op::Slice {
        dim,
        start,
        end,
        text: format!("{a}:{b}"),
    }
}

fn gen_reshape(ch: &mut Ch<'_>, shape: &[Sz]) -> Option<Op> {
    let rank = shape.len();
    let mut s = shape.to_vec();
    match ch.pick(6) {
        0 | 1 => {
            let d = pick_dim(ch, rank);
            let (a, b) = shape[d].factors()?;
            s.remove(d);
            if ch.chance(30) {
                s.insert(d, a);
                s.insert(d, b);
            } else {
                s.insert(d, b);
                s.insert(d, a);
            }
        }
        2 if rank >= 2 => {
            let d = ch.pick(rank - 1);
            let m = mul(s[d].clone(), s[d + 1].clone());
            s.splice(d..d + 2, [m]);
        }
        3 if rank >= 3 => s = vec![s[0].clone(), product(&s[1..])],
        4 if rank >= 2 => {
            // Negative extents whose product is the right one: must never be accepted.
            let d = ch.pick(rank - 1);
            s[d] = sub(c(0), s[d].clone());
            s[d + 1] = sub(c(0), s[d + 1].clone());
        }
        _ => {
            let d = pick_dim(ch, rank);
            let k = ch.one(&[2, 4]);
            let x = s[d].clone();
            s.splice(d..d + 1, [c(k), Sz::Div(Box::new(x), k)]);
        }
    }
    Some(Op::Reshape(s))
}

/// An explicit layout over a param's storage: its dimensions (optionally split) with row-major
/// strides, in a random mode order; sometimes perturbed or swizzled.
fn gen_apply(ch: &mut Ch<'_>, shape: &[Sz]) -> Op {
    let mut rm = vec![c(1); shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        rm[d] = mul(rm[d + 1].clone(), shape[d + 1].clone());
    }
    let order = ch.perm(shape.len());
    let mut modes: Vec<Vec<(Sz, Sz)>> = Vec::new();
    for &d in &order {
        match shape[d].factors() {
            Some((a, b)) if ch.chance(30) => {
                modes.push(vec![(a.clone(), rm[d].clone()), (b, mul(a, rm[d].clone()))])
            }
            _ => modes.push(vec![(shape[d].clone(), rm[d].clone())]),
        }
    }
    if ch.chance(15) {
        let m = ch.pick(modes.len());
        let j = ch.pick(modes[m].len());
        modes[m][j].1 = add(modes[m][j].1.clone(), c(1));
    }
    if ch.chance(15) {
        let m = ch.pick(modes.len());
        modes[m][0].0 = c(1);
    }
    if ch.chance(5) {
        // A negative stride.
        let m = ch.pick(modes.len());
        modes[m][0].1 = sub(c(0), modes[m][0].1.clone());
    }
    if ch.chance(5) {
        // A broadcast mode (stride 0), possibly with more coordinates than 64 bits count.
        let e = ch.one(&[c(3), Sz::D(1), c(1 << 62), mul(c(1 << 40), c(1 << 40))]);
        let at = ch.pick(modes.len() + 1);
        modes.insert(at, vec![(e, c(0))]);
    }
    let swizzle = ch.chance(10).then(|| gen_swizzle(ch));
    Op::Apply(Lay { modes, swizzle })
}

fn gen_view(ch: &mut Ch<'_>, params: &[Param], dims: &[Dim]) -> View {
    let pi = ch.pick(params.len());
    let p = &params[pi];
    let mut ops = Vec::new();
    let mut shape = p.shape.clone();
    if p.tile.is_some() && ch.chance(50) {
        ops.push(Op::Mma);
    } else if ch.chance(15) {
        ops.push(gen_apply(ch, &shape));
    }
    if let Some(op) = ops.last() {
        shape = shape_after(&shape, op, p);
    }
    let extra = ch.pick(3) + usize::from(ops.is_empty());
    for _ in 0..extra {
        let op = match ch.pick(4) {
            0 => Some(gen_slice(ch, &shape, dims)),
            1 if shape.len() > 1 => {
                let dim = pick_dim(ch, shape.len());
                let at = match ch.pick(4) {
                    0 => c(0),
                    1 => sub(shape[dim].clone(), c(1)),
                    2 => c(1),
                    _ => gen_size(ch, dims, 0),
                };
                Some(Op::Index { dim, at })
            }
            2 => Some(Op::Permute(ch.perm(shape.len()))),
            _ => gen_reshape(ch, &shape),
        };
        if let Some(op) = op {
            shape = shape_after(&shape, &op, p);
            ops.push(op);
        }
    }
    View {
        param: pi,
        ops,
        claim: ch.chance(30),
        typed: ch.chance(10),
    }
}

fn gen_case(ch: &mut Ch<'_>) -> Case {
    let nd = 2 + ch.pick(3);
    let dims: Vec<Dim> = (0..nd).map(|i| gen_dim(ch, i == 0)).collect();
    let np = 1 + ch.pick(3);
    let params: Vec<Param> = (0..np).map(|_| gen_param(ch, &dims)).collect();
    let nv = ch.pick(5);
    let views: Vec<View> = (0..nv).map(|_| gen_view(ch, &params, &dims)).collect();
    let nk = ch.pick(3);
    let mut kernels = Vec::new();
    for _ in 0..nk {
        let n = 1 + ch.pick(3);
        let mut operands = Vec::new();
        for _ in 0..n {
            if !views.is_empty() && ch.chance(50) {
                operands.push(Operand::V(ch.pick(views.len())));
            } else {
                operands.push(Operand::P(ch.pick(params.len())));
            }
        }
        operands.dedup();
        let index = match ch.pick(5) {
            0 => None,
            1 => Some("i64"),
            _ => Some("i32"),
        };
        kernels.push(Kernel { operands, index });
    }
    Case {
        p_alive: vec![true; params.len()],
        v_alive: vec![true; views.len()],
        dims,
        params,
        views,
        kernels,
    }
}

// ---- numeric layouts and the reference model ----------------------------------------------------

/// A layout evaluated at a binding: per logical dimension, `(extent, stride)` sub-modes (first
/// fastest), a base offset and a swizzle.
#[derive(Debug, Clone)]
struct NumLay {
    dims: Vec<Vec<(i128, i128)>>,
    offset: i128,
    swizzle: Option<Swizzle>,
}

fn swizzle(sw: Swizzle, o: i128) -> i128 {
    let msk = (1i128 << sw.bits) - 1;
    let yyy = msk << (sw.base as i32 + sw.shift.max(0));
    if sw.shift >= 0 {
        o ^ ((o & yyy) >> sw.shift)
    } else {
        o ^ ((o & yyy) << -sw.shift)
    }
}

impl NumLay {
    fn from_sym(l: &SymLayout, b: &Binding) -> Option<NumLay> {
        let mut dims = Vec::new();
        for d in &l.dims {
            let mut m = Vec::new();
            for (s, st) in d {
                m.push((b.eval(s)?, b.eval(st)?));
            }
            dims.push(m);
        }
        Some(NumLay {
            dims,
            offset: b.eval(&l.offset)?,
            swizzle: l.swizzle,
        })
    }

    fn shape(&self) -> Vec<i128> {
        self.dims
            .iter()
            .map(|m| m.iter().map(|x| x.0).product())
            .collect()
    }

    fn leaves(&self) -> Vec<(i128, i128)> {
        self.dims.iter().flatten().copied().collect()
    }

    /// Offset of a logical coordinate (split over each dimension's sub-modes, first fastest).
    fn at(&self, coord: &[i128]) -> i128 {
        let mut o = self.offset;
        for (m, &x) in self.dims.iter().zip(coord) {
            let mut rest = x;
            for (k, &(s, d)) in m.iter().enumerate() {
                let v = if k + 1 == m.len() { rest } else { rest % s };
                rest /= s.max(1);
                o += v * d;
            }
        }
        match self.swizzle {
            Some(sw) => swizzle(sw, o),
            None => o,
        }
    }

    /// Whether the layout is a bijection onto `[0, n)`: by the sorted-stride argument where the
    /// strides are non-negative (a chain from offset 0, and a swizzle that maps `[0, n)` onto
    /// itself), else by enumeration up to 2^20 coordinates; `None` when undecided.
    fn bijective_onto(&self, n: i128) -> Option<bool> {
        let mut modes: Vec<(i128, i128)> = self.leaves().into_iter().filter(|m| m.0 > 1).collect();
        let size: i128 = modes.iter().map(|m| m.0).product();
        if size != n {
            return Some(false);
        }
        if modes.iter().all(|m| m.1 >= 0) {
            modes.sort_by_key(|m| (m.1, m.0));
            let mut span = 1i128;
            let mut chain = self.offset == 0;
            for &(s, d) in &modes {
                chain &= d == span;
                span *= s;
            }
            match self.swizzle {
                None => return Some(chain),
                Some(sw) if chain => {
                    // Whole period blocks map onto themselves: only the last, partial one can leave.
                    let p = 1i128 << (sw.bits + sw.base + sw.shift.unsigned_abs());
                    if sw.bits == 0 || n % p == 0 {
                        return Some(true);
                    }
                    if p <= 1 << 20 {
                        return Some((n / p * p..n).all(|o| swizzle(sw, o) < n));
                    }
                }
                Some(_) => {}
            }
        }
        if size > 1 << 20 {
            return None;
        }
        let mut seen = vec![false; size as usize];
        let mut ok = true;
        self.for_each_offset(|o| {
            if o < 0 || o >= n || seen[o as usize] {
                ok = false;
            } else {
                seen[o as usize] = true;
            }
        });
        Some(ok)
    }

    /// Every offset, coordinates in row-major order over the leaves.
    fn for_each_offset(&self, mut f: impl FnMut(i128)) {
        let leaves = self.leaves();
        let size: i128 = leaves.iter().map(|m| m.0).product();
        let mut coord = vec![0i128; leaves.len()];
        let mut o = self.offset;
        for _ in 0..size {
            f(self.swizzle.map_or(o, |sw| swizzle(sw, o)));
            for k in (0..leaves.len()).rev() {
                coord[k] += 1;
                o += leaves[k].1;
                if coord[k] < leaves[k].0 {
                    break;
                }
                o -= leaves[k].1 * leaves[k].0;
                coord[k] = 0;
            }
        }
    }

    /// Logical coordinates to test: all of them up to `budget`, else every leaf at both extremes
    /// (at most 256 combinations) and random ones.
    fn coords(&self, budget: i128, rng: &mut Rng) -> Vec<Vec<i128>> {
        let shape = self.shape();
        let size: i128 = shape.iter().product();
        if size <= budget {
            return all_coords(&shape);
        }
        let leaves: Vec<(usize, usize, i128)> = self
            .dims
            .iter()
            .enumerate()
            .flat_map(|(d, m)| m.iter().enumerate().map(move |(j, x)| (d, j, x.0)))
            .collect();
        let combos: u64 = if leaves.len() <= 8 {
            1 << leaves.len()
        } else {
            256
        };
        let mut out = Vec::new();
        for k in 0..combos {
            let bits = if leaves.len() <= 8 { k } else { rng.next() };
            let mut coord = vec![0i128; self.dims.len()];
            let mut scale: Vec<i128> = vec![1; self.dims.len()];
            for (li, &(d, _, s)) in leaves.iter().enumerate() {
                let v = if bits >> (li % 64) & 1 == 1 { s - 1 } else { 0 };
                coord[d] += v * scale[d];
                scale[d] *= s;
            }
            out.push(coord);
        }
        for _ in 0..SAMPLES {
            out.push(shape.iter().map(|&s| rng.below(s)).collect());
        }
        out
    }
}

fn all_coords(shape: &[i128]) -> Vec<Vec<i128>> {
    let size: i128 = shape.iter().product();
    let mut out = Vec::with_capacity(size.max(0) as usize);
    let mut coord = vec![0i128; shape.len()];
    for _ in 0..size.max(0) {
        out.push(coord.clone());
        for k in (0..shape.len()).rev() {
            coord[k] += 1;
            if coord[k] < shape[k] {
                break;
            }
            coord[k] = 0;
        }
    }
    out
}

fn unravel(mut lin: i128, shape: &[i128]) -> Vec<i128> {
    let mut out = vec![0i128; shape.len()];
    for k in (0..shape.len()).rev() {
        out[k] = lin % shape[k];
        lin /= shape[k];
    }
    out
}

fn ravel(coord: &[i128], shape: &[i128]) -> i128 {
    coord.iter().zip(shape).fold(0, |acc, (&x, &s)| acc * s + x)
}

/// The reference: the case's sizes and storage maps evaluated at one binding.
struct Reference<'a> {
    case: &'a Case,
    env: Vec<i128>,
}

impl Reference<'_> {
    fn shape(&self, s: &[Sz]) -> Result<Vec<i128>, Bad> {
        s.iter().map(|x| x.eval(&self.env)).collect()
    }

    /// Storage offset of a logical coordinate of param `i`.
    fn storage(&self, i: usize, coord: &[i128]) -> Result<i128, Bad> {
        let p = &self.case.params[i];
        let shape = self.shape(&p.shape)?;
        Ok(match &p.storage {
            Storage::RowMajor => ravel(coord, &shape),
            Storage::Declared(l) => l.eval(&self.env)?.at(coord),
            Storage::Tile => {
                // docs/FORMATS.md §1.
                let (mp, kp) = (shape[1], shape[2]);
                let (g, r, col) = (coord[0], coord[1], coord[2]);
                g * mp * kp
                    + (r / 128) * (kp / 4) * 512
                    + (col / 4) * 512
                    + (r % 32) * 16
                    + ((r % 128) / 32) * 4
                    + col % 4
            }
        })
    }

    /// The param storage offset a view coordinate stands for, by its definition.
    fn view_offset(&self, v: &View, coord: &[i128]) -> Result<i128, Bad> {
        let shapes: Vec<Vec<i128>> = self
            .case
            .view_shapes(v)
            .iter()
            .map(|s| self.shape(s))
            .collect::<Result<_, _>>()?;
        let mut x = coord.to_vec();
        for (k, op) in v.ops.iter().enumerate().rev() {
            match op {
                Op::Slice { dim, start, .. } => x[*dim] += start.eval(&self.env)?,
                Op::Index { dim, at } => x.insert(*dim, at.eval(&self.env)?),
                Op::Permute(perm) => {
                    let mut y = vec![0; x.len()];
                    for (k, &p) in perm.iter().enumerate() {
                        y[p] = x[k];
                    }
                    x = y;
                }
                Op::Reshape(_) => x = unravel(ravel(&x, &shapes[k + 1]), &shapes[k]),
                Op::Apply(l) => {
                    // Offsets of the (contiguous) param, read through its storage map.
                    let o = l.eval(&self.env)?.at(&x);
                    let numel: i128 = shapes[0].iter().product();
                    if o < 0 || o >= numel {
                        return Ok(o);
                    }
                    return self.storage(v.param, &unravel(o, &shapes[0]));
                }
                Op::Mma => {
                    // docs/FORMATS.md §2: (r%32, (r%128)/32, r/128, c%4, c/4, g) holds S_g[r, c].
                    x = vec![x[5], x[0] + 32 * x[1] + 128 * x[2], x[3] + 4 * x[4]];
                }
            }
        }
        self.storage(v.param, &x)
    }
}

// ---- checking a verified module at a binding ----------------------------------------------------

fn proof_claims(p: Proof, only_symbolic: bool) -> bool {
    match p {
        Proof::Symbolic => true,
        Proof::Exhaustive => !only_symbolic,
        Proof::NeedsBinding => false,
    }
}

/// Counts of what the run checked.
struct Stats {
    cases: AtomicUsize,
    accepted: AtomicUsize,
    bindings: AtomicUsize,
    symbolic_views: AtomicUsize,
    symbolic_layouts: AtomicUsize,
    symbolic_i32: AtomicUsize,
    coords: AtomicUsize,
}

static STATS: Stats = Stats {
    cases: AtomicUsize::new(0),
    accepted: AtomicUsize::new(0),
    bindings: AtomicUsize::new(0),
    symbolic_views: AtomicUsize::new(0),
    symbolic_layouts: AtomicUsize::new(0),
    symbolic_i32: AtomicUsize::new(0),
    coords: AtomicUsize::new(0),
};

fn bump(c: &AtomicUsize, n: usize) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Every promise `info` makes (only the symbolic ones when `only_symbolic`) at binding `b`.
fn check_promises(
    case: &Case,
    info: &ModuleInfo,
    b: &Binding,
    r: &Reference<'_>,
    only_symbolic: bool,
    rng: &mut Rng,
) -> Result<(), String> {
    let m = info.module();
    let bad = |what: &str, e: Bad| format!("{what}: the reference has no value ({e:?})");
    // Every extent of every tensor is at least 1.
    for t in &m.tensors {
        for (k, s) in t.shape.iter().enumerate() {
            match b.eval(s) {
                Some(v) if v >= 1 => {}
                v => {
                    return Err(format!(
                        "extent {k} of `{}` (`{}`) is {v:?}",
                        t.name,
                        m.show(s)
                    ))
                }
            }
        }
    }
    let param_index = |name: &str| name.strip_prefix('p').and_then(|x| x.parse::<usize>().ok());
    let mut per_of = std::collections::HashMap::new();
    // Params: dense, expert-major, the declared storage map, whole bytes per expert.
    for pi in &info.params {
        let t = m.tensor(pi.id).unwrap();
        let i = param_index(&t.name).ok_or("unknown param")?;
        let p = &case.params[i];
        let shape = r.shape(&p.shape).map_err(|e| bad(&t.name, e))?;
        let numel: i128 = shape.iter().product();
        let per = numel / shape[0];
        per_of.insert(pi.id, per);
        let got = b.eval(&t.numel());
        if got != Some(numel) || b.eval(&pi.per_expert_elems) != Some(per) {
            return Err(format!(
                "`{}` has {numel} elements ({per} per expert) but the verifier says {got:?} ({:?} per expert)",
                t.name,
                b.eval(&pi.per_expert_elems)
            ));
        }
        if !proof_claims(pi.proof, only_symbolic) {
            continue;
        }
        if only_symbolic && matches!(p.storage, Storage::Declared(_)) {
            bump(&STATS.symbolic_layouts, 1);
        }
        let nl = NumLay::from_sym(&pi.layout, b).ok_or("the param's layout has no value")?;
        if nl.shape() != shape {
            return Err(format!(
                "`{}`'s storage layout has shape {:?}, the param {shape:?}",
                t.name,
                nl.shape()
            ));
        }
        let coords = nl.coords(PARAM_BUDGET, rng);
        let exhaustive = numel <= PARAM_BUDGET;
        let mut seen = vec![false; if exhaustive { numel as usize } else { 0 }];
        bump(&STATS.coords, coords.len());
        for x in &coords {
            let o = nl.at(x);
            let want = r.storage(i, x).map_err(|e| bad(&t.name, e))?;
            if o != want {
                return Err(format!(
                    "`{}` at {x:?}: the verifier's storage map gives {o}, the declared layout {want}",
                    t.name
                ));
            }
            let e = x[0];
            if o < e * per || o >= (e + 1) * per {
                return Err(format!(
                    "`{}` at {x:?} is stored at {o}, outside expert {e}'s range [{}, {}) (proof {})",
                    t.name,
                    e * per,
                    (e + 1) * per,
                    pi.proof
                ));
            }
            if exhaustive {
                if seen[o as usize] {
                    return Err(format!(
                        "`{}`: two coordinates share offset {o} (proof {})",
                        t.name, pi.proof
                    ));
                }
                seen[o as usize] = true;
            }
        }
        if !exhaustive && nl.bijective_onto(numel) == Some(false) {
            return Err(format!(
                "`{}`'s storage is not dense: {:?} (proof {})",
                t.name, nl.dims, pi.proof
            ));
        }
        let bits = per * p.bits();
        let entry = info.move_set.iter().find(|e| e.param == pi.id);
        if bits % 8 != 0 || entry.and_then(|e| b.eval(&e.bits_per_expert)) != Some(bits) {
            return Err(format!(
                "`{}`: {bits} bits per expert, the move set says {:?} (proof {})",
                t.name,
                entry.and_then(|e| b.eval(&e.bits_per_expert)),
                pi.proof
            ));
        }
    }
    // Views: in bounds, bijections, and the offsets their definitions name.
    for vi in &info.views {
        let t = m.tensor(vi.id).unwrap();
        let j: usize = t.name[1..].parse().map_err(|_| "unknown view")?;
        let v = &case.views[j];
        if m.tensor(vi.source).map(|p| p.name.clone()) != Some(format!("p{}", v.param)) {
            return Err(format!("`{}` aliases the wrong param", t.name));
        }
        if vi.claimed != v.claim {
            return Err(format!("`{}`: claim recorded as {}", t.name, vi.claimed));
        }
        let pshape = r
            .shape(&case.params[v.param].shape)
            .map_err(|e| bad(&t.name, e))?;
        let n: i128 = pshape.iter().product();
        let want_shape = r
            .shape(case.view_shapes(v).last().unwrap())
            .map_err(|e| bad(&t.name, e))?;
        let nl = NumLay::from_sym(&vi.layout, b).ok_or("the view's layout has no value")?;
        let got_shape: Vec<Option<i128>> = t.shape.iter().map(|s| b.eval(s)).collect();
        if nl.shape() != want_shape
            || got_shape != want_shape.iter().map(|&x| Some(x)).collect::<Vec<_>>()
        {
            return Err(format!(
                "`{}` has shape {want_shape:?} by its definition, the verifier says {got_shape:?} (layout {:?})",
                t.name,
                nl.shape()
            ));
        }
        let size: i128 = want_shape.iter().product();
        let in_bounds = proof_claims(vi.in_bounds, only_symbolic);
        let bij = proof_claims(vi.bijective_proof, only_symbolic)
            .then_some(vi.bijective)
            .flatten();
        if only_symbolic && (in_bounds || bij.is_some()) {
            bump(&STATS.symbolic_views, 1);
        }
        if v.claim && vi.bijective_proof == Proof::Symbolic && vi.bijective != Some(true) {
            return Err(format!(
                "`{}`: a claimed bijection proven {:?}",
                t.name, vi.bijective
            ));
        }
        if size <= VIEW_BUDGET && (in_bounds || bij.is_some()) {
            // The verifier's own index map, whole.
            let offs = verify::index_map(&vi.layout, b).ok_or("no index map")?;
            if in_bounds {
                if let Some(o) = offs.iter().find(|&&o| o < 0 || o as i128 >= n) {
                    return Err(format!(
                        "`{}` reads offset {o} of a param with {n} elements (in bounds: {})",
                        t.name, vi.in_bounds
                    ));
                }
            }
            if let Some(claim) = bij {
                let mut sorted = offs.clone();
                sorted.sort_unstable();
                let is = sorted.len() as i128 == n
                    && sorted.iter().enumerate().all(|(k, &o)| o == k as i64);
                if is != claim {
                    return Err(format!(
                        "`{}` is proven {} a bijection onto {n} elements ({}), but is {}",
                        t.name,
                        if claim { "" } else { "not" },
                        vi.bijective_proof,
                        if is { "one" } else { "not" }
                    ));
                }
            }
        }
        if size > VIEW_BUDGET
            && bij.is_some()
            && nl.bijective_onto(n).is_some_and(|x| Some(x) != bij)
        {
            return Err(format!(
                "`{}` is proven bijective: {bij:?} ({}) onto {n} elements, wrongly: {:?}",
                t.name, vi.bijective_proof, nl.dims
            ));
        }
        let coords = nl.coords(VIEW_BUDGET, rng);
        bump(&STATS.coords, coords.len());
        for x in &coords {
            let o = nl.at(x);
            if in_bounds && (o < 0 || o >= n) {
                return Err(format!(
                    "`{}` at {x:?} reads offset {o} of a param with {n} elements (in bounds: {})",
                    t.name, vi.in_bounds
                ));
            }
            let want = r.view_offset(v, x).map_err(|e| bad(&t.name, e))?;
            if o != want {
                return Err(format!(
                    "`{}` at {x:?}: the verifier's layout gives offset {o}, the definition names {want}",
                    t.name
                ));
            }
        }
    }
    // Index widths: every operand's largest per-expert offset fits the declared width.
    for ki in &info.kernels {
        let kb = &m.kernels[ki.index];
        if !proof_claims(ki.proof, only_symbolic) {
            continue;
        }
        let bits = if kb.index.0 == IndexWidth::I32 {
            31
        } else {
            63
        };
        if only_symbolic && bits == 31 {
            bump(&STATS.symbolic_i32, 1);
        }
        for (op, _) in &kb.operands {
            let t = m.tensor(*op).unwrap();
            let src = t.alias.as_ref().map(|a| a.0).unwrap_or(*op);
            let per = per_of
                .get(&src)
                .copied()
                .ok_or("a kernel operand without a param")?;
            if per > 1i128 << bits {
                return Err(format!(
                    "kernel `{}` is proven {}-bit ({}) but `{}` reaches per-expert offset {}",
                    kb.name,
                    bits + 1,
                    ki.proof,
                    t.name,
                    per - 1
                ));
            }
        }
    }
    Ok(())
}

/// Bindings to try: all combinations of each dimension's two smallest admissible values, each
/// dimension alone at its largest (or a larger) admissible value and in between, all at once.
fn bindings(case: &Case, rng: &mut Rng) -> Vec<Vec<i128>> {
    let firsts: Vec<i128> = case.dims.iter().map(|d| d.first().unwrap()).collect();
    let mut per_dim: Vec<(Vec<i128>, i128, i128)> = Vec::new();
    for d in &case.dims {
        let (f, u) = (d.first().unwrap(), d.step());
        let last = d.last().filter(|&l| l >= f);
        let small: Vec<i128> = [f, f + u]
            .into_iter()
            .filter(|&x| last.is_none_or(|l| x <= l) && x <= i64::MAX as i128)
            .collect();
        let big = last.unwrap_or(f + 1000 * u).min(i64::MAX as i128 / u * u);
        let mid = f + (big - f) / u / 2 * u;
        let mid = if big > f {
            f + rng.below((big - f) / u + 1) * u
        } else {
            mid
        };
        per_dim.push((small, big, mid));
    }
    let mut out: Vec<Vec<i128>> = vec![Vec::new()];
    for (small, _, _) in &per_dim {
        out = out
            .into_iter()
            .flat_map(|b| {
                small.iter().map(move |&x| {
                    let mut b = b.clone();
                    b.push(x);
                    b
                })
            })
            .collect();
    }
    for (k, (_, big, mid)) in per_dim.iter().enumerate() {
        for x in [*big, *mid] {
            let mut b = firsts.clone();
            b[k] = x;
            out.push(b);
        }
    }
    out.push(per_dim.iter().map(|x| x.1).collect());
    out.push(per_dim.iter().map(|x| x.2).collect());
    let mut seen = std::collections::HashSet::new();
    out.retain(|b| seen.insert(b.clone()));
    out
}

/// The largest element or byte count of a tensor the model declares (`None`: past 128 bits;
/// `Err`: a division that is not exact at this binding).
fn largest_size(case: &Case, env: &[i128]) -> Result<Option<i128>, String> {
    let mut max = 0i128;
    // Every param's shapes, and every view's own shape (its elements: a broadcast view counts its
    // coordinates; the intermediate layouts of its definition are not tensors of the module).
    let mut all: Vec<(&Param, Vec<Vec<Sz>>)> = Vec::new();
    for (i, p) in case.params.iter().enumerate() {
        if !case.p_alive[i] {
            continue;
        }
        let mut shapes = vec![p.shape.clone()];
        if let Some((m, k)) = &p.tile {
            shapes.push(vec![Sz::D(0), m.clone(), k.clone()]);
        }
        all.push((p, shapes));
    }
    for (i, v) in case.views.iter().enumerate() {
        if !case.v_alive[i] || !case.p_alive[v.param] {
            continue;
        }
        // (A view whose extents do not divide exactly here is not rendered as a valid one: its
        // own checks cover it.)
        let Some(last) = case.view_shapes(v).pop() else {
            continue;
        };
        if last
            .iter()
            .all(|x| !matches!(x.eval(env), Err(Bad::Inexact)))
        {
            all.push((&case.params[v.param], vec![last]));
        }
    }
    for (p, shapes) in all {
        for s in shapes {
            let mut n = Some(1i128);
            for x in &s {
                match x.eval(env) {
                    Ok(v) => n = n.and_then(|b| b.checked_mul(v)),
                    Err(Bad::Overflow) => n = None,
                    Err(Bad::Inexact) => {
                        return Err(format!("`{}` is not an exact division here", x.show()))
                    }
                }
            }
            match n.and_then(|n| Some((n, n.checked_mul(p.bits())? / 8))) {
                Some((n, bytes)) => max = max.max(n).max(bytes),
                None => return Ok(None),
            }
        }
    }
    Ok(Some(max))
}

/// The whole check of one accepted recipe.
fn check_accepted(case: &Case, src: &str, info: &ModuleInfo, rng: &mut Rng) -> Result<(), String> {
    if case.dims.iter().any(|d| d.first().is_none()) {
        return Err("accepted, but the where-clause admits no binding".into());
    }
    // Everything the recipe declares was verified (nothing dropped on the way).
    let names = |ids: Vec<moeforge_dsl::ir::TensorId>| -> Vec<String> {
        ids.iter()
            .filter_map(|id| info.module().tensor(*id).map(|t| t.name.clone()))
            .collect()
    };
    let params = names(info.params.iter().map(|p| p.id).collect());
    let views = names(info.views.iter().map(|v| v.id).collect());
    for (i, _) in case
        .params
        .iter()
        .enumerate()
        .filter(|(i, _)| case.p_alive[*i])
    {
        if !params.contains(&format!("p{i}")) {
            return Err(format!("accepted, but param `p{i}` was not verified"));
        }
    }
    for (j, v) in case.views.iter().enumerate() {
        if case.v_alive[j] && case.p_alive[v.param] && !views.contains(&format!("v{j}")) {
            return Err(format!("accepted, but view `v{j}` was not verified"));
        }
    }
    let kernels = case
        .kernels
        .iter()
        .filter(|k| k.operands.iter().any(|o| case.operand_alive(*o)))
        .count();
    if info.kernels.len() != kernels {
        return Err(format!(
            "accepted with {} kernel bindings verified, {kernels} declared",
            info.kernels.len()
        ));
    }
    let module: Module = info.module().clone();
    let all_symbolic = info.params.iter().all(|p| p.proof == Proof::Symbolic)
        && info.views.iter().all(|v| {
            v.in_bounds == Proof::Symbolic && (!v.claimed || v.bijective_proof == Proof::Symbolic)
        })
        && info.kernels.iter().all(|k| k.proof == Proof::Symbolic);
    for (bi, env) in bindings(case, rng).into_iter().enumerate() {
        let vals: Vec<(String, i64)> = env
            .iter()
            .enumerate()
            .map(|(k, &v)| (NAMES[k].to_string(), v as i64))
            .collect();
        let at = vals
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let wrap = |msg: String| format!("at binding {at}: {msg}");
        // Bindings whose tensors cannot be addressed with 64-bit offsets are refused (E0503);
        // every other admissible binding must bind.
        let size = largest_size(case, &env).map_err(wrap)?;
        let bound = guarded("`Module::bind`", || module.bind(&vals)).map_err(wrap)?;
        let limit = i64::MAX as i128;
        let b = match (bound, size) {
            (Ok(b), Some(n)) if n <= limit => b,
            (Ok(_), _) => {
                return Err(wrap(format!(
                    "bound although a tensor has {size:?} elements or bytes (past 64-bit offsets)"
                )))
            }
            (Err(ds), Some(n)) if n < 1 << 62 => {
                return Err(wrap(format!(
                    "an admissible binding is refused: {}",
                    ds.iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                )))
            }
            (Err(_), _) if bi == 0 => {
                return Err(wrap(
                    "accepted, but sizes at the smallest admissible binding overflow".into(),
                ))
            }
            (Err(_), _) => continue,
        };
        bump(&STATS.bindings, 1);
        let r = Reference {
            case,
            env: env.clone(),
        };
        guarded("checking", || check_promises(case, info, &b, &r, true, rng))
            .and_then(|x| x)
            .map_err(wrap)?;
        let bound = guarded("`verify` at the binding", || {
            verify::verify(module.clone(), Some(b.clone()))
        })
        .map_err(wrap)?;
        match bound {
            Ok(binfo) => guarded("checking", || {
                check_promises(case, &binfo, &b, &r, false, rng)
            })
            .and_then(|x| x)
            .map_err(|e| wrap(format!("(verified at the binding) {e}")))?,
            Err(ds) => {
                let rendered = moeforge_dsl::diag::render_all(&ds, "soundness.recipe", src);
                if all_symbolic {
                    return Err(wrap(format!(
                        "every promise was proven symbolically, yet verifying at the binding fails:\n{rendered}"
                    )));
                }
                let allowed = [
                    "E0304", "E0305", "E0401", "E0402", "E0502", "E0503", "E0504",
                ];
                if let Some(d) = ds.iter().find(|d| !allowed.contains(&d.code.as_str())) {
                    return Err(wrap(format!("verifying at the binding fails with {d}")));
                }
            }
        }
    }
    Ok(())
}

/// Generate a recipe from the choice stream, check it, retry without blamed statements, and check
/// the promises of the accepted one. `Err` describes a soundness failure.
fn run_case(xs: &[u32]) -> Result<(), String> {
    let mut ch = Ch { xs, i: 0 };
    let mut case = gen_case(&mut ch);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    xs.hash(&mut h);
    let mut rng = Rng(h.finish());
    bump(&STATS.cases, 1);
    for _ in 0..8 {
        let (src, items) = case.render();
        let fail = |msg: String| format!("{msg}\n--- recipe ---\n{src}");
        let res = guarded("`check`", || moeforge_dsl::check(&src, None)).map_err(fail)?;
        match res {
            Ok(info) => {
                bump(&STATS.accepted, 1);
                return check_accepted(&case, &src, &info, &mut rng).map_err(fail);
            }
            Err(ds) => {
                if !case.drop_blamed(&ds, &src, &items) {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

fn seed() -> u64 {
    match std::env::var("PROPTEST_RNG_SEED") {
        Ok(s) => s.trim().parse().expect("PROPTEST_RNG_SEED must be a u64"),
        Err(_) => RandomState::new().hash_one("soundness"),
    }
}

#[test]
fn accepted_recipes_keep_their_promises() {
    let seed = seed();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(160);
    eprintln!("soundness: seed {seed} (replay: PROPTEST_RNG_SEED={seed}), {cases} cases");
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 512,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let started = std::time::Instant::now();
    let result = runner.run(&prop::collection::vec(any::<u32>(), 320), |xs| {
        run_case(&xs).map_err(TestCaseError::fail)
    });
    let n = |c: &AtomicUsize| c.load(Ordering::Relaxed);
    eprintln!(
        "soundness: {} recipes generated (shrinking included), {} accepted, {} bindings checked; symbolic promises checked at a binding: {} of views, {} of declared param layouts, {} of i32 kernels; {} coordinates; {:.1} s",
        n(&STATS.cases),
        n(&STATS.accepted),
        n(&STATS.bindings),
        n(&STATS.symbolic_views),
        n(&STATS.symbolic_layouts),
        n(&STATS.symbolic_i32),
        n(&STATS.coords),
        started.elapsed().as_secs_f64()
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, _)) => {
            panic!("soundness failure (seed {seed}; replay with PROPTEST_RNG_SEED={seed}):\n{why}")
        }
        Err(e) => panic!("seed {seed}: {e}"),
    }
}

// ---- the known fixes, and the bugs this test found ----------------------------------------------

fn codes(src: &str, bind: Option<&[(String, i64)]>) -> Vec<String> {
    match guarded("`check`", || moeforge_dsl::check(src, bind)).unwrap() {
        Ok(_) => Vec::new(),
        Err(ds) => ds.into_iter().map(|d| d.code).collect(),
    }
}

fn binding(v: &[(&str, i64)]) -> Vec<(String, i64)> {
    v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
}

fn case(dims: Vec<Dim>, params: Vec<Param>, views: Vec<View>, kernels: Vec<Kernel>) -> Case {
    Case {
        p_alive: vec![true; params.len()],
        v_alive: vec![true; views.len()],
        dims,
        params,
        views,
        kernels,
    }
}

fn row_major(dtype: &'static str, shape: Vec<Sz>) -> Param {
    Param {
        dtype,
        shape,
        storage: Storage::RowMajor,
        tile: None,
    }
}

/// Check a hand-written model: it must be accepted and keep its promises at every binding.
fn accepted(case: &Case) -> ModuleInfo {
    let (src, _) = case.render();
    let info = moeforge_dsl::check(&src, None).unwrap_or_else(|ds| {
        panic!(
            "rejected:\n{}",
            moeforge_dsl::diag::render_all(&ds, "model.recipe", &src)
        )
    });
    if let Err(e) = check_accepted(case, &src, &info, &mut Rng(1)) {
        panic!("{e}\n{src}");
    }
    info
}

fn ceil_div_recipe(lower: Option<i64>) -> Case {
    // [E, ceil_div(H - 3, 2)], read by a 32-bit kernel through a slice.
    let ext = Sz::Cd(Box::new(sub(Sz::D(1), c(3))), 2);
    let bounds = lower.map(|v| vec![(Cmp::Ge, v)]).unwrap_or_default();
    case(
        vec![
            Dim {
                divs: vec![],
                bounds: vec![],
            },
            Dim {
                divs: vec![],
                bounds,
            },
        ],
        vec![row_major("f32", vec![Sz::D(0), ext.clone(), c(4)])],
        vec![View {
            param: 0,
            ops: vec![Op::Slice {
                dim: 1,
                start: c(0),
                end: ext,
                text: ":".into(),
            }],
            claim: true,
            typed: false,
        }],
        vec![Kernel {
            operands: vec![Operand::V(0)],
            index: Some("i32"),
        }],
    )
}

#[test]
fn ceil_div_of_a_difference_needs_a_lower_bound() {
    let (src, _) = ceil_div_recipe(None).render();
    let ds = moeforge_dsl::check(&src, None).unwrap_err();
    assert!(ds.iter().any(|d| d.code == "E0206"), "{ds:?}");
    assert!(ds.iter().all(|d| d.code != "E0106"), "{ds:?}");
    assert!(
        ds[0].notes.iter().any(|n| n.contains("where H >= 4")),
        "{ds:?}"
    );
    // A bound that is too weak is still refused; `H >= 4` is enough.
    assert!(codes(&ceil_div_recipe(Some(3)).render().0, None).contains(&"E0206".to_string()));
    let info = accepted(&ceil_div_recipe(Some(4)));
    assert!(info.views.iter().all(|v| v.in_bounds == Proof::Symbolic));
    assert!(info.params.iter().all(|p| p.proof == Proof::Symbolic));
}

#[test]
fn several_bounds_on_one_dimension_keep_the_tightest() {
    for bounds in [
        vec![
            (Cmp::Ge, 2),
            (Cmp::Ge, 1),
            (Cmp::Le, 64),
            (Cmp::Le, 100_000),
        ],
        vec![
            (Cmp::Le, 100_000),
            (Cmp::Lt, 65),
            (Cmp::Gt, 0),
            (Cmp::Gt, 1),
        ],
    ] {
        let h = Sz::D(1);
        // 64^5 = 2^30 elements per expert: 32-bit offsets hold only with the tightest upper bound;
        // `ceil_div(H - 1, 2)` needs the tightest lower bound.
        let wide = vec![
            Sz::D(0),
            h.clone(),
            h.clone(),
            h.clone(),
            h.clone(),
            h.clone(),
        ];
        let half = vec![Sz::D(0), Sz::Cd(Box::new(sub(h, c(1))), 2)];
        let model = case(
            vec![
                Dim {
                    divs: vec![],
                    bounds: vec![],
                },
                Dim {
                    divs: vec![],
                    bounds,
                },
            ],
            vec![row_major("f32", wide), row_major("bf16", half)],
            vec![],
            vec![Kernel {
                operands: vec![Operand::P(0), Operand::P(1)],
                index: Some("i32"),
            }],
        );
        let info = accepted(&model);
        let d = &info.module().dims[1];
        assert_eq!((d.min, d.max), (2, Some(64)));
        assert_eq!(info.kernels[0].proof, Proof::Symbolic);
    }
    // Contradictory bounds admit no binding.
    let src = "recipe r(E: experts, H) where H >= 65, H <= 64 {\n  input x : f32[E, H]\n  param p : f32[E, H] = x\n}\n";
    assert_eq!(codes(src, None), ["E0108"]);
}

#[test]
fn bounds_past_the_largest_binding_are_refused_not_panicked_on() {
    for wh in [
        "H > 9223372036854775807",
        "H >= 9223372036854775807, H % 2 == 0",
        "H % 9223372036854775807 == 0, H % 9223372036854775806 == 0",
    ] {
        let src = format!(
            "recipe r(E: experts, H) where {wh} {{\n  input x : f32[E, H]\n  param p : f32[E, H] = x\n}}\n"
        );
        assert_eq!(codes(&src, None), ["E0108"], "{wh}");
    }
    // The largest binding itself is admissible, and refused only because the sizes overflow.
    let src = "recipe r(E: experts, H) where H >= 9223372036854775807 {\n  input x : f32[E, H]\n  param p : f32[E, H] = x\n}\n";
    assert!(codes(src, None).iter().all(|c| c == "E0503"));
    let src = "recipe r(E: experts, H) where H >= 9223372036854775807 {\n  input x : u8[E]\n  param p : u8[E] = x\n}\n";
    assert!(codes(src, None).is_empty());
}

#[test]
fn sizes_that_overflow_are_rejected() {
    let big = 1i64 << 62;
    let recipe = |ty: &str| {
        format!("recipe r(E: experts, H) {{\n  input x : {ty}\n  param p : {ty} = x\n}}\n")
    };
    // A size, a tensor's element count, or its bits past 128 bits: E0207 at the type.
    for ty in [
        format!("f32[E, {big}*{big}*{big}]"),
        format!("f32[E, {big}, {big}, {big}]"),
        format!("f32[E, {big}*{big}*4]"),
    ] {
        assert!(
            codes(&recipe(&ty), None).contains(&"E0207".to_string()),
            "{ty}"
        );
    }
    // Past 64-bit offsets at the smallest admissible binding: refused at check.
    for ty in [format!("f32[E, {big}, 4]"), format!("e2m1[E, {big}, 4]")] {
        assert!(
            codes(&recipe(&ty), None).iter().all(|c| c == "E0503")
                && !codes(&recipe(&ty), None).is_empty(),
            "{ty}"
        );
    }
    // Past 64-bit offsets at a larger binding: that binding is refused (E0503), and a kernel's
    // `index i64` holds at every binding that is accepted.
    let src = "recipe r(E: experts, H) {\n  input x : e4m3[E, H, H]\n  param p : e4m3[E, H, H] = x\n  kernel k(p) on host\n}\n";
    let info = moeforge_dsl::check(src, None).unwrap();
    assert_eq!(info.kernels[0].proof, Proof::Symbolic);
    let refused = |e: i64, h: i64| {
        let c = codes(src, Some(&binding(&[("E", e), ("H", h)])));
        !c.is_empty() && c.iter().all(|c| c == "E0503")
    };
    assert!(refused(1, 1 << 32));
    assert!(codes(src, Some(&binding(&[("E", 1), ("H", 1 << 31)]))).is_empty());
    assert!(refused(4, 1 << 31));
}

#[test]
fn computed_extents_must_be_positive() {
    // `reshape` to negative extents whose product is right: refused, not a view of -H rows (or
    // a param silently dropped when a quantization's scales are sized by them).
    let view = "recipe r(E: experts, H) {\n  input x : f32[E, H]\n  param p : f32[E, H] = x\n  view v = reshape(p, E, 0 - H, 0 - 1)\n}\n";
    assert_eq!(codes(view, None), ["E0201"]);
    let quant = "recipe r(E: experts, H) {\n  input x : f32[E, H]\n  let q = quant fp8(reshape(x, E, 0 - H, 0 - 1), granularity = block128)\n  param s : f32[E, 1, 1] = q.scales\n}\n";
    assert_eq!(codes(quant, None), ["E0201"]);
    let bc = "recipe r(E: experts, H) {\n  input x : f32[]\n  param p : f32[E, 1 - H] = broadcast(x, E, 1 - H)\n}\n";
    assert!(codes(bc, None).iter().all(|c| c == "E0201"));
}

#[test]
fn a_swizzle_must_not_move_elements_across_experts() {
    // S<2,2,3> permutes inside blocks of 128 elements; an expert has 8: expert 8's first element
    // (offset 64) would land at 72, in expert 9.
    let src = "recipe r(E: experts) {\n  input x : i32[E, 8]\n  param p : i32[E, 8] @ S<2,2,3> o (E, 8):(8, 1) = x\n}\n";
    assert!(codes(src, Some(&binding(&[("E", 8)]))).is_empty());
    assert_eq!(codes(src, Some(&binding(&[("E", 9)]))), ["E0402"]);
    let info = moeforge_dsl::check(src, None).unwrap();
    assert_eq!(info.params[0].proof, Proof::NeedsBinding);
    // A multiple of the period per expert: proven for every binding.
    let src = "recipe r(E: experts) {\n  input x : i32[E, 128]\n  param p : i32[E, 128] @ S<2,2,3> o (E, 128):(128, 1) = x\n}\n";
    let info = moeforge_dsl::check(src, None).unwrap();
    assert_eq!(info.params[0].proof, Proof::Symbolic);
    // The identity swizzle S<0,..> never moves anything.
    let src = "recipe r(E: experts) {\n  input x : i32[E, 1]\n  param p : i32[E, 1] @ S<0,3,-1> o (E, 1):(1, 1) = x\n}\n";
    assert!(codes(src, Some(&binding(&[("E", 1000)]))).is_empty());
}

#[test]
fn a_swizzled_bijection_is_not_reported_as_none() {
    // At E=2, H=2 the storage has 8 elements and the swizzle's period is 32: it does not divide 8,
    // yet S<1,1,3> keeps [0, 8) in place, so the view is a bijection.
    let src = "recipe r(E: experts, H) {\n  input x : bf16[E, H, H]\n  param p : bf16[E, H, H] = x\n  view v = p @ S<1,1,3> o (H, E, H):(1, H*H, H) bijective\n}\n";
    let info = moeforge_dsl::check(src, Some(&binding(&[("E", 2), ("H", 2)]))).unwrap();
    assert_eq!(info.views[0].bijective, Some(true));
    assert_eq!(info.views[0].bijective_proof, Proof::Exhaustive);
}

#[test]
fn views_with_more_coordinates_than_64_bits_count() {
    // A broadcast view (stride 0) past 2^63 coordinates: refused like any size past 64 bits.
    let src = |n: i64| {
        format!(
            "recipe r(E: experts) {{\n  input x : f32[E]\n  param p : f32[E] = x\n  view v = p @ (E, {n}, 4):(1, 0, 0)\n}}\n"
        )
    };
    assert_eq!(codes(&src(1 << 62), None), ["E0503"]);
    // Just below: accepted, proven in bounds, and nothing overflows at a binding.
    let ok = src(1 << 58);
    let info = moeforge_dsl::check(&ok, None).unwrap();
    assert_eq!(info.views[0].in_bounds, Proof::Symbolic);
    let info = moeforge_dsl::check(&ok, Some(&binding(&[("E", 1)]))).unwrap();
    assert_eq!(info.views[0].bijective, Some(false));
    assert!(info.index_map(&info.views[0]).is_none());
    assert_eq!(
        codes(&ok.replace("0, 0)\n", "0, 0) bijective\n"), None),
        ["E0305"]
    );
}
