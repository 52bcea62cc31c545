//! Symbolic integer polynomials over a recipe's dimensions.
//!
//! Sizes, strides and offsets of a recipe are polynomials with integer coefficients in *atoms*: a
//! dimension measured in units of its declared divisor (`I` with `where I % 64 == 0` is `64*i`, `i >= 1`),
//! or a ceiling division `ceil(p / k)` that does not divide exactly. Every atom is at least 1 for every
//! admissible binding, which is what the verifier's symbolic proofs rely on: `p >= 0` is proven when
//! substituting `a = 1 + a'` for every atom leaves only non-negative coefficients.
//!
//! Arithmetic is bounded: a coefficient outside `i128`, more than [`MAX_TERMS`] terms or a monomial
//! of degree above [`MAX_DEGREE`] marks the result as overflowed ([`Poly::overflowed`]) instead of
//! wrapping, panicking or growing without end (`let b = a * a` repeated squares the degree).

use std::collections::BTreeMap;
use std::fmt;

/// Index of an atom in an [`Atoms`] table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AtomId(pub u32);

/// What an atom stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtomKind {
    /// `dim / unit` for a recipe dimension (the dimension is a multiple of `unit`).
    Dim {
        /// Dimension name.
        name: String,
        /// The divisor the where-clause guarantees.
        unit: i64,
        /// Upper bound on the dimension, if declared.
        max: Option<i64>,
        /// Lower bound on the atom (in units), at least 1.
        min: i128,
    },
    /// `ceil(num / den)` where `num` is not provably a multiple of `den`.
    CeilDiv {
        /// Numerator.
        num: Poly,
        /// Denominator (positive).
        den: i64,
    },
}

/// Most terms a polynomial may have; more marks it overflowed.
pub const MAX_TERMS: usize = 256;

/// Highest total degree of a monomial; more marks the polynomial overflowed.
pub const MAX_DEGREE: u32 = 1024;

/// The atoms of one recipe.
#[derive(Debug, Clone, Default)]
pub struct Atoms {
    kinds: Vec<AtomKind>,
    /// Per atom: its least value over the admissible bindings (kept as atoms are added).
    mins: Vec<i128>,
    /// Per atom: how many `ceil_div`s it nests and how many atom occurrences it is written with.
    nest: Vec<(usize, u64)>,
    /// The ceiling atoms by `(numerator, denominator)`, for deduplication.
    ceil_ids: BTreeMap<(Poly, i64), AtomId>,
}

/// A binding of atoms to values (indexed by [`AtomId`]).
pub type AtomValues = Vec<i128>;

impl Atoms {
    /// Register a dimension atom (at least 1 unit).
    pub fn dim(&mut self, name: &str, unit: i64, max: Option<i64>) -> AtomId {
        self.dim_bounded(name, unit, 1, max)
    }

    /// Register a dimension atom of at least `min` units (`min >= 1`).
    pub fn dim_bounded(&mut self, name: &str, unit: i64, min: i128, max: Option<i64>) -> AtomId {
        self.push(AtomKind::Dim {
            name: name.to_string(),
            unit,
            max,
            min: min.max(1),
        })
    }

    fn push(&mut self, kind: AtomKind) -> AtomId {
        let (min, nest) = match &kind {
            AtomKind::Dim { min, .. } => (*min, (0, 1)),
            AtomKind::CeilDiv { num, den } => {
                let min = num
                    .lower_bound(&self.mins)
                    .map(|n| (n + *den as i128 - 1).div_euclid(*den as i128))
                    .unwrap_or(1)
                    .max(1);
                let (depth, written) = self.nesting(num);
                (min, (depth + 1, written.saturating_add(1)))
            }
        };
        self.kinds.push(kind);
        self.mins.push(min);
        self.nest.push(nest);
        AtomId(self.kinds.len() as u32 - 1)
    }

    /// The least value of every atom over the admissible bindings (each at least 1).
    pub fn lower_bounds(&self) -> Vec<i128> {
        self.mins.clone()
    }

    /// How deeply the atoms of `p` nest `ceil_div`s, and how many atom occurrences `p` is written
    /// with (each `ceil_div` atom counting its numerator's).
    pub fn nesting(&self, p: &Poly) -> (usize, u64) {
        let mut depth = 0;
        let mut written = 0u64;
        for (m, _) in p.terms() {
            written = written.saturating_add(1);
            for &(a, e) in m {
                let (d, w) = self.nest.get(a.0 as usize).copied().unwrap_or((0, 1));
                depth = depth.max(d);
                written = written.saturating_add(w.saturating_mul(u64::from(e)));
            }
        }
        (depth, written)
    }

    /// Proves `p >= 0` for every admissible binding, using each atom's lower bound.
    pub fn nonneg(&self, p: &Poly) -> bool {
        p.provably_nonneg_with(&self.mins)
    }

    /// The kind of an atom.
    pub fn kind(&self, a: AtomId) -> Option<&AtomKind> {
        self.kinds.get(a.0 as usize)
    }

    /// Number of atoms.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Whether there are no atoms.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// `ceil(p / k)`, exact when every coefficient of `p` is a multiple of `k`, else a (deduplicated)
    /// ceiling atom.
    ///
    /// `None` where the numerator is not provably at least 1 for every admissible binding: the atom's
    /// own promise (`>= 1`), on which every symbolic proof rests, would not hold.
    pub fn ceil_div(&mut self, p: &Poly, k: i64) -> Option<Poly> {
        if p.overflowed() || k <= 0 {
            return None;
        }
        if let Some(q) = p.div_exact(k) {
            return Some(q);
        }
        if let Some(c) = p.as_const() {
            return Some(Poly::constant((c + k as i128 - 1).div_euclid(k as i128)));
        }
        if !self.nonneg(&p.sub(&Poly::constant(1))) {
            return None;
        }
        let key = (p.clone(), k);
        let id = match self.ceil_ids.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.push(AtomKind::CeilDiv {
                    num: p.clone(),
                    den: k,
                });
                self.ceil_ids.insert(key, id);
                id
            }
        };
        Some(Poly::atom(id))
    }

    /// Values of every atom from the dimension values (`dims[name]`); dimension atoms must divide
    /// exactly (checked by the caller against the where-clause).
    pub fn evaluate(&self, dim_value: &dyn Fn(&str) -> Option<i64>) -> Option<AtomValues> {
        let mut vals: AtomValues = Vec::with_capacity(self.kinds.len());
        for k in &self.kinds {
            let v = match k {
                AtomKind::Dim { name, unit, .. } => dim_value(name)? as i128 / *unit as i128,
                AtomKind::CeilDiv { num, den } => {
                    let n = num.eval(&vals)?;
                    (n + *den as i128 - 1).div_euclid(*den as i128)
                }
            };
            vals.push(v);
        }
        Some(vals)
    }

    /// Upper bounds of every atom where the where-clause bounds all dimensions it depends on.
    pub fn upper_bounds(&self) -> Vec<Option<i128>> {
        let mut out: Vec<Option<i128>> = Vec::with_capacity(self.kinds.len());
        for k in &self.kinds {
            let v = match k {
                AtomKind::Dim { unit, max, .. } => max.map(|m| m as i128 / *unit as i128),
                AtomKind::CeilDiv { num, den } => num
                    .upper_bound(&out)
                    .map(|n| (n + *den as i128 - 1).div_euclid(*den as i128)),
            };
            out.push(v);
        }
        out
    }

    fn write_atom(&self, f: &mut fmt::Formatter<'_>, a: AtomId) -> fmt::Result {
        match self.kind(a) {
            Some(AtomKind::Dim { name, unit, .. }) if *unit == 1 => write!(f, "{name}"),
            Some(AtomKind::Dim { name, unit, .. }) => write!(f, "({name}/{unit})"),
            Some(AtomKind::CeilDiv { num, den }) => {
                write!(f, "ceil_div({}, {den})", num.display(self))
            }
            None => write!(f, "?{}", a.0),
        }
    }
}

/// A monomial: atoms with positive exponents, sorted by atom.
pub type Monomial = Vec<(AtomId, u32)>;

/// A polynomial with `i128` coefficients over atoms, in canonical form (no zero terms).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Poly {
    terms: BTreeMap<Monomial, i128>,
    /// Set when a coefficient left `i128` in the arithmetic that made this polynomial (it is then
    /// meaningless; [`Poly::overflowed`] lets callers refuse it instead of using a wrapped value).
    overflow: bool,
}

/// The product of two monomials; `None` above [`MAX_DEGREE`].
fn mono_mul(a: &Monomial, b: &Monomial) -> Option<Monomial> {
    let mut m: BTreeMap<AtomId, u32> = BTreeMap::new();
    let mut degree: u32 = 0;
    for &(x, e) in a.iter().chain(b) {
        let slot = m.entry(x).or_insert(0);
        *slot = slot.checked_add(e)?;
        degree = degree.checked_add(e)?;
    }
    (degree <= MAX_DEGREE).then(|| m.into_iter().collect())
}

fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.abs(), b.abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Poly {
    /// The zero polynomial.
    pub fn zero() -> Poly {
        Poly::default()
    }

    /// A constant.
    pub fn constant(c: i128) -> Poly {
        let mut p = Poly::zero();
        if c != 0 {
            p.terms.insert(Vec::new(), c);
        }
        p
    }

    /// A single atom.
    pub fn atom(a: AtomId) -> Poly {
        let mut p = Poly::zero();
        p.terms.insert(vec![(a, 1)], 1);
        p
    }

    /// The terms.
    pub fn terms(&self) -> impl Iterator<Item = (&Monomial, &i128)> {
        self.terms.iter()
    }

    /// The constant value, if the polynomial is constant (never for an overflowed one).
    pub fn as_const(&self) -> Option<i128> {
        if self.overflow {
            return None;
        }
        match self.terms.len() {
            0 => Some(0),
            1 => self.terms.get(&Vec::new()).copied(),
            _ => None,
        }
    }

    /// Whether this is the constant `c`.
    pub fn is_const(&self, c: i128) -> bool {
        self.as_const() == Some(c)
    }

    /// Sum.
    pub fn add(&self, o: &Poly) -> Poly {
        let mut p = self.clone();
        p.overflow |= o.overflow;
        for (m, c) in &o.terms {
            let e = p.terms.entry(m.clone()).or_insert(0);
            match e.checked_add(*c) {
                Some(v) => *e = v,
                None => p.overflow = true,
            }
            if *e == 0 {
                p.terms.remove(m);
            }
        }
        if p.terms.len() > MAX_TERMS {
            p.overflow = true;
        }
        p
    }

    /// Whether a coefficient overflowed `i128` while this polynomial was computed.
    pub fn overflowed(&self) -> bool {
        self.overflow
    }

    /// Negation.
    pub fn neg(&self) -> Poly {
        let mut overflow = self.overflow;
        let terms = self
            .terms
            .iter()
            .map(|(m, c)| {
                (
                    m.clone(),
                    c.checked_neg().unwrap_or_else(|| {
                        overflow = true;
                        i128::MAX
                    }),
                )
            })
            .collect();
        Poly { terms, overflow }
    }

    /// Difference.
    pub fn sub(&self, o: &Poly) -> Poly {
        self.add(&o.neg())
    }

    /// Product.
    pub fn mul(&self, o: &Poly) -> Poly {
        let mut overflow = self.overflow || o.overflow;
        let mut terms: BTreeMap<Monomial, i128> = BTreeMap::new();
        for (ma, ca) in &self.terms {
            for (mb, cb) in &o.terms {
                let Some(m) = mono_mul(ma, mb) else {
                    overflow = true;
                    continue;
                };
                let c = ca.checked_mul(*cb).unwrap_or_else(|| {
                    overflow = true;
                    1
                });
                let e = terms.entry(m).or_insert(0);
                match e.checked_add(c) {
                    Some(v) => *e = v,
                    None => overflow = true,
                }
            }
        }
        terms.retain(|_, c| *c != 0);
        if terms.len() > MAX_TERMS {
            overflow = true;
        }
        Poly { terms, overflow }
    }

    /// Product with a constant.
    pub fn scale(&self, k: i128) -> Poly {
        self.mul(&Poly::constant(k))
    }

    /// `self / k` when every coefficient is a multiple of `k`.
    pub fn div_exact(&self, k: i64) -> Option<Poly> {
        let k = k as i128;
        if k == 0 || self.terms.values().any(|c| c % k != 0) {
            return None;
        }
        Some(Poly {
            terms: self.terms.iter().map(|(m, c)| (m.clone(), c / k)).collect(),
            overflow: self.overflow,
        })
    }

    /// `self / d` when `d` is a monomial (constant times atoms) dividing every term.
    pub fn div_monomial(&self, d: &Poly) -> Option<Poly> {
        if d.terms.len() != 1 {
            return None;
        }
        let (dm, dc) = d.terms.iter().next()?;
        let mut out = Poly::zero();
        for (m, c) in &self.terms {
            if c % dc != 0 {
                return None;
            }
            let mut rest: BTreeMap<AtomId, u32> = m.iter().copied().collect();
            for &(a, e) in dm {
                let have = rest.get(&a).copied().unwrap_or(0);
                if have < e {
                    return None;
                }
                if have == e {
                    rest.remove(&a);
                } else {
                    rest.insert(a, have - e);
                }
            }
            out = out.add(&Poly {
                terms: [(rest.into_iter().collect(), c / dc)].into_iter().collect(),
                overflow: self.overflow,
            });
        }
        Some(out)
    }

    /// The gcd of the coefficients (0 for the zero polynomial).
    pub fn content(&self) -> i128 {
        self.terms.values().fold(0, |g, &c| gcd(g, c))
    }

    /// Value for a binding of the atoms (none for an overflowed polynomial).
    pub fn eval(&self, vals: &[i128]) -> Option<i128> {
        if self.overflow {
            return None;
        }
        let mut s: i128 = 0;
        for (m, c) in &self.terms {
            let mut t = *c;
            for &(a, e) in m {
                let v = *vals.get(a.0 as usize)?;
                for _ in 0..e {
                    t = t.checked_mul(v)?;
                }
            }
            s = s.checked_add(t)?;
        }
        Some(s)
    }

    /// An upper bound for every binding with atoms in `[1, bound]`, when all atoms with a positive
    /// coefficient are bounded.
    pub fn upper_bound(&self, bounds: &[Option<i128>]) -> Option<i128> {
        if self.overflow {
            return None;
        }
        let mut s: i128 = 0;
        for (m, c) in &self.terms {
            if *c < 0 {
                // Every monomial is >= 1, so a negative term is at most `c`.
                s = s.checked_add(*c)?;
                continue;
            }
            let mut t = *c;
            for &(a, e) in m {
                let v = (*bounds.get(a.0 as usize)?)?;
                for _ in 0..e {
                    t = t.checked_mul(v)?;
                }
            }
            s = s.checked_add(t)?;
        }
        Some(s)
    }

    /// Proves `self >= 0` for every binding with all atoms `>= 1` (sound, not complete): substitutes
    /// `a = 1 + a'` for each atom and checks that no coefficient is negative.
    pub fn provably_nonneg(&self) -> bool {
        self.provably_nonneg_with(&[])
    }

    /// The shifted polynomial: `a = min_a + a'` for each atom (`min_a` from `mins`, else 1).
    fn shifted(&self, mins: &[i128]) -> Poly {
        let one_plus = |a: AtomId| {
            let m = mins.get(a.0 as usize).copied().unwrap_or(1).max(1);
            Poly::constant(m).add(&Poly::atom(a))
        };
        let mut shifted = Poly::zero();
        for (m, c) in &self.terms {
            let mut t = Poly::constant(*c);
            for &(a, e) in m {
                for _ in 0..e {
                    t = t.mul(&one_plus(a));
                    if t.overflow {
                        return t;
                    }
                }
            }
            shifted = shifted.add(&t);
            if shifted.overflow {
                return shifted;
            }
        }
        shifted
    }

    /// [`Poly::provably_nonneg`] with atom `a` at least `mins[a]`.
    pub fn provably_nonneg_with(&self, mins: &[i128]) -> bool {
        let s = self.shifted(mins);
        !s.overflow && !self.overflow && s.terms.values().all(|&c| c >= 0)
    }

    /// A lower bound over the bindings with atom `a` at least `mins[a]`, where the shifted polynomial
    /// has no negative coefficient (its constant term).
    pub fn lower_bound(&self, mins: &[i128]) -> Option<i128> {
        let s = self.shifted(mins);
        (!s.overflow && !self.overflow && s.terms.iter().all(|(m, c)| m.is_empty() || *c >= 0))
            .then(|| s.as_const_term())
    }

    fn as_const_term(&self) -> i128 {
        self.terms.get(&Vec::new()).copied().unwrap_or(0)
    }

    /// A printable form using the atom table.
    pub fn display<'a>(&'a self, atoms: &'a Atoms) -> PolyDisplay<'a> {
        PolyDisplay { p: self, atoms }
    }
}

/// Display adapter for [`Poly`] (needs the atom table for names).
pub struct PolyDisplay<'a> {
    p: &'a Poly,
    atoms: &'a Atoms,
}

impl fmt::Display for PolyDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.p.terms.is_empty() {
            return write!(f, "0");
        }
        // Highest degree first, constant last: `2*I + 1`.
        let mut terms: Vec<(&Monomial, &i128)> = self.p.terms.iter().collect();
        terms.sort_by_key(|(m, _)| std::cmp::Reverse(m.iter().map(|x| x.1).sum::<u32>()));
        for (k, (m, c)) in terms.into_iter().enumerate() {
            let mut c = *c;
            if k > 0 {
                if c < 0 {
                    write!(f, " - ")?;
                    c = -c;
                } else {
                    write!(f, " + ")?;
                }
            } else if c < 0 {
                write!(f, "-")?;
                c = -c;
            }
            if m.is_empty() {
                write!(f, "{c}")?;
                continue;
            }
            // Fold dimension units back into the coefficient: 128*(I/64) prints as 2*I.
            let mut den: i128 = 1;
            let mut names: Vec<String> = Vec::new();
            for &(a, e) in m {
                for _ in 0..e {
                    match self.atoms.kind(a) {
                        Some(AtomKind::Dim { name, unit, .. }) => {
                            den *= *unit as i128;
                            names.push(name.clone());
                        }
                        _ => names.push(format!("{}", AtomName(self.atoms, a))),
                    }
                }
            }
            let g = gcd(c, den);
            let (num, den) = (c / g, den / g);
            if num != 1 {
                write!(f, "{num}*")?;
            }
            write!(f, "{}", names.join("*"))?;
            if den != 1 {
                write!(f, "/{den}")?;
            }
        }
        Ok(())
    }
}

struct AtomName<'a>(&'a Atoms, AtomId);

impl fmt::Display for AtomName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write_atom(f, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceil_div_needs_a_numerator_of_at_least_one() {
        let mut atoms = Atoms::default();
        let i = Poly::atom(atoms.dim("I", 1, None));
        // I - 3 can be <= 0 at I = 1: no ceiling atom (it would promise >= 1).
        assert!(atoms.ceil_div(&i.sub(&Poly::constant(3)), 2).is_none());
        let mut bounded = Atoms::default();
        let j = Poly::atom(bounded.dim_bounded("I", 1, 4, None));
        let q = bounded.ceil_div(&j.sub(&Poly::constant(3)), 2);
        assert!(q.is_some());
        // The where-clause's lower bounds feed the proofs: I >= 4 proves I - 4 >= 0.
        assert!(bounded.nonneg(&j.sub(&Poly::constant(4))));
        assert!(!bounded.nonneg(&j.sub(&Poly::constant(5))));
    }

    #[test]
    fn overflow_is_flagged_not_wrapped() {
        let big = Poly::constant(1 << 62);
        let p = big
            .mul(&big)
            .mul(&Poly::constant(16))
            .add(&Poly::constant(5));
        assert!(p.overflowed());
        assert!(!Poly::constant(1 << 62).mul(&Poly::constant(4)).overflowed());
    }

    #[test]
    fn arithmetic_and_display() {
        let mut atoms = Atoms::default();
        let i = Poly::atom(atoms.dim("I", 64, None));
        let h = Poly::atom(atoms.dim("H", 1, None));
        let two_i = i.scale(128);
        assert_eq!(two_i.display(&atoms).to_string(), "2*I");
        let cd = atoms.ceil_div(&two_i, 128).unwrap_or_default();
        assert_eq!(cd.display(&atoms).to_string(), "I/64");
        let kt = atoms.ceil_div(&h, 64).unwrap_or_default();
        assert_eq!(kt.display(&atoms).to_string(), "ceil_div(H, 64)");
        let e = two_i.mul(&h).sub(&Poly::constant(1));
        assert_eq!(e.display(&atoms).to_string(), "2*I*H - 1");
        let vals = atoms
            .evaluate(&|n| match n {
                "I" => Some(768),
                "H" => Some(100),
                _ => None,
            })
            .unwrap_or_default();
        assert_eq!(kt.eval(&vals), Some(2));
        assert_eq!(e.eval(&vals), Some(2 * 768 * 100 - 1));
    }

    #[test]
    fn nonneg_proofs() {
        let mut atoms = Atoms::default();
        let a = Poly::atom(atoms.dim("A", 1, None));
        let b = Poly::atom(atoms.dim("B", 1, None));
        // a*b - a >= 0 for a, b >= 1
        assert!(a.mul(&b).sub(&a).provably_nonneg());
        // a - b is not provable
        assert!(!a.sub(&b).provably_nonneg());
        // a - 2 is not nonneg at a = 1
        assert!(!a.sub(&Poly::constant(2)).provably_nonneg());
    }
}
