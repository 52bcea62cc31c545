//! Lowering a verified CuTe layout to kernel-IR index arithmetic: the one function every address
//! of a param or a view in a generated kernel comes from.
//!
//! A [`StorageMap`] is a param's (or view's) symbolic layout from the verified module, evaluated at
//! the binding: one top-level mode per logical dimension, each a list of `(shape, stride)` sub-modes
//! in CuTe's colexicographic order (the first sub-mode is the fastest), a base offset and an optional
//! swizzle applied to the final offset. [`StorageMap::index`] lowers it to div/mod by static shapes,
//! multiplies by strides, the base offset and the swizzle's XOR. The planner asks the map what the
//! algebra proves ([`StorageMap::is_row_major`], [`StorageMap::run`], [`StorageMap::shift`]) to
//! pick strength-reduced forms; nothing about a layout is inferred from a recipe's or a param's name.

use moeforge_dsl::ir::SymLayout;
use moeforge_dsl::layout::Swizzle;
use moeforge_dsl::verify::Binding;

use crate::kir::{e, BinOp, Expr};
use crate::{Error, Result};

/// A layout at a binding: logical coordinates to element offsets of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageMap {
    /// Per logical dimension, its `(shape, stride)` sub-modes, fastest first.
    pub modes: Vec<Vec<(i64, i64)>>,
    /// Base offset (elements).
    pub offset: i64,
    /// Swizzle applied to the final offset.
    pub swizzle: Option<Swizzle>,
}

/// One logical dimension's share of an offset: coordinate `c` split over the dimension's sub-modes
/// (div/mod by their extents; the last sub-mode takes the rest unreduced) times their strides.
fn dim_offset(subs: &[(i64, i64)], c: i64) -> i64 {
    let mut total = 0;
    let mut rest = c;
    for (j, &(s, d)) in subs.iter().enumerate() {
        let part = if j + 1 == subs.len() { rest } else { rest % s };
        total += part * d;
        rest /= s.max(1);
    }
    total
}

/// A [`StorageMap`] with each dimension's offsets tabulated over its extent
/// ([`StorageMap::tables`]). The offset of a coordinate is the base offset plus one share per
/// dimension, then the swizzle, so a lookup per dimension gives exactly
/// [`StorageMap::offset_of`]'s value (coordinates outside the table are computed as it does).
#[derive(Debug, Clone)]
pub struct OffsetTables {
    map: StorageMap,
    per_dim: Vec<Vec<i64>>,
}

impl OffsetTables {
    /// The share of the leading coordinates `lead` (all dimensions but the last; any coordinate
    /// of the last dimension given is ignored) and the base offset, before the swizzle: what
    /// [`OffsetTables::last`] completes.
    pub fn partial(&self, lead: &[i64]) -> i64 {
        let mut total = self.map.offset;
        let leading = self.map.modes.len().saturating_sub(1);
        for (d, &c) in lead.iter().enumerate().take(leading) {
            total += self.share(d, c);
        }
        total
    }

    /// [`StorageMap::offset_of`] of the coordinate whose leading dimensions gave `partial`
    /// ([`OffsetTables::partial`]) and whose last is `c`.
    pub fn last(&self, partial: i64, c: i64) -> i64 {
        let total = partial + self.share(self.map.modes.len().saturating_sub(1), c);
        match self.map.swizzle {
            None => total,
            Some(sw) => sw.apply(total),
        }
    }

    /// Dimension `d`'s share of the offset of coordinate `c` along it.
    fn share(&self, d: usize, c: i64) -> i64 {
        let table = self.per_dim.get(d).map(Vec::as_slice).unwrap_or_default();
        match usize::try_from(c).ok().and_then(|i| table.get(i)) {
            Some(&v) => v,
            None => self.map.modes.get(d).map_or(0, |subs| dim_offset(subs, c)),
        }
    }

    /// [`StorageMap::offset_of`] of `coord`.
    pub fn offset_of(&self, coord: &[i64]) -> i64 {
        let mut total = self.map.offset;
        for ((&c, subs), table) in coord.iter().zip(&self.map.modes).zip(&self.per_dim) {
            total += match usize::try_from(c).ok().and_then(|i| table.get(i)) {
                Some(&v) => v,
                None => dim_offset(subs, c),
            };
        }
        match self.map.swizzle {
            None => total,
            Some(sw) => sw.apply(total),
        }
    }
}

impl StorageMap {
    /// Evaluate a verified symbolic layout at a binding.
    pub fn of(l: &SymLayout, b: &Binding) -> Result<StorageMap> {
        let ev = |p: &moeforge_dsl::poly::Poly| {
            b.eval(p)
                .and_then(|x| i64::try_from(x).ok())
                .ok_or(Error::Internal("layout does not evaluate at the binding"))
        };
        let modes = l
            .dims
            .iter()
            .map(|d| d.iter().map(|(s, t)| Ok((ev(s)?, ev(t)?))).collect())
            .collect::<Result<Vec<Vec<(i64, i64)>>>>()?;
        Ok(StorageMap {
            modes,
            offset: ev(&l.offset)?,
            swizzle: l.swizzle,
        })
    }

    /// The compact row-major map of a shape.
    pub fn row_major(shape: &[i64]) -> StorageMap {
        let mut modes = vec![Vec::new(); shape.len()];
        let mut acc = 1;
        for i in (0..shape.len()).rev() {
            modes[i] = vec![(shape[i], acc)];
            acc *= shape[i];
        }
        StorageMap {
            modes,
            offset: 0,
            swizzle: None,
        }
    }

    /// The extent of each logical dimension.
    pub fn shape(&self) -> Vec<i64> {
        self.modes
            .iter()
            .map(|d| d.iter().map(|x| x.0).product())
            .collect()
    }

    /// Whether the map is the compact row-major one of its shape (sub-modes of extent 1 ignored),
    /// so that `index` reduces to the linear offset.
    pub fn is_row_major(&self) -> bool {
        if self.offset != 0 || self.swizzle.is_some() {
            return false;
        }
        let mut want = 1i64;
        for d in self.modes.iter().rev() {
            for &(s, t) in d {
                if s == 1 {
                    continue;
                }
                if t != want {
                    return false;
                }
                want = want.saturating_mul(s);
            }
        }
        true
    }

    /// The offset of a natural coordinate (one integer per logical dimension): each dimension's
    /// integer split over its sub-modes (div/mod by their static extents), times the strides, plus the
    /// base offset, then the swizzle.
    pub fn index(&self, coord: &[Expr]) -> Expr {
        let mut total = e::i(0);
        for (c, subs) in coord.iter().zip(&self.modes) {
            let mut rest = c.clone();
            for (j, &(s, d)) in subs.iter().enumerate() {
                let part = if j + 1 == subs.len() {
                    rest.clone()
                } else {
                    e::rem(rest.clone(), s)
                };
                total = e::add(total, e::mul(part, e::i(d)));
                rest = e::div(rest, s);
            }
        }
        let total = e::add(total, e::i(self.offset));
        match self.swizzle {
            None => total,
            Some(sw) => swizzle_expr(sw, total),
        }
    }

    /// Numeric offset of a coordinate (the host-side twin of [`StorageMap::index`]).
    pub fn offset_of(&self, coord: &[i64]) -> i64 {
        let mut total = self.offset;
        for (&c, subs) in coord.iter().zip(&self.modes) {
            total += dim_offset(subs, c);
        }
        match self.swizzle {
            None => total,
            Some(sw) => sw.apply(total),
        }
    }

    /// The map's per-dimension offsets tabulated over its shape ([`OffsetTables`]): the same
    /// offsets as [`StorageMap::offset_of`] by one lookup per dimension, for host loops over every
    /// element of a param. A dimension longer than `max_len` is not tabulated (computed per call).
    pub fn tables(&self, max_len: i64) -> OffsetTables {
        let per_dim = self
            .modes
            .iter()
            .map(|subs| {
                let n = subs
                    .iter()
                    .try_fold(1i64, |acc, x| acc.checked_mul(x.0.max(0)))
                    .unwrap_or(i64::MAX);
                if n > max_len {
                    return Vec::new();
                }
                (0..n).map(|c| dim_offset(subs, c)).collect()
            })
            .collect();
        OffsetTables {
            map: self.clone(),
            per_dim,
        }
    }

    /// How much [`StorageMap::index`] moves when coordinate `k` grows by `delta`, where that is one
    /// constant for every coordinate: no swizzle, and `delta` a multiple of the mode's inner extents,
    /// so that only its last part (which `index` leaves unreduced) grows.
    pub fn shift(&self, k: usize, delta: i64) -> Option<i64> {
        if self.swizzle.is_some() {
            return None;
        }
        let (last, inner) = self.modes.get(k)?.split_last()?;
        let p: i64 = inner.iter().map(|&(s, _)| s).product();
        (p > 0 && delta % p == 0).then(|| delta / p * last.1)
    }

    /// The longest run `n` (a power of two, at most `max`) such that, for every coordinate whose last
    /// index is a multiple of `n`, the `n` elements along the last dimension lie at consecutive
    /// offsets starting at a multiple of `n`: what a packed (vector) access needs.
    pub fn run(&self, max: i64) -> i64 {
        match self.modes.len() {
            0 => 1,
            n => self.run_along(n - 1, max),
        }
    }

    /// [`StorageMap::run`] along dimension `dim`: its first sub-mode has stride 1, and `n` divides
    /// that sub-mode's extent, every other stride and the base offset, and the swizzle leaves the
    /// low `log2 n` bits alone.
    pub fn run_along(&self, dim: usize, max: i64) -> i64 {
        let Some(&(s0, d0)) = self.modes.get(dim).and_then(|d| d.first()) else {
            return 1;
        };
        if d0 != 1 {
            return 1;
        }
        let mut n = 1;
        while n * 2 <= max && s0 % (n * 2) == 0 && self.aligned(dim, n * 2) {
            n *= 2;
        }
        n
    }

    /// The dimension whose first sub-mode has stride 1 (where storage is contiguous), if any.
    pub fn unit_dim(&self) -> Option<usize> {
        self.modes
            .iter()
            .position(|d| d.first().is_some_and(|&(s, t)| t == 1 && s > 1))
    }

    /// Every stride but `dim`'s unit one, and the base offset, are multiples of `n`, and the
    /// swizzle leaves the low `log2 n` bits alone.
    fn aligned(&self, dim: usize, n: i64) -> bool {
        let strides_ok = self.modes.iter().enumerate().all(|(k, d)| {
            d.iter()
                .enumerate()
                .all(|(j, &(s, t))| (k == dim && j == 0) || s == 1 || t % n == 0)
        });
        let swz_ok = self
            .swizzle
            .is_none_or(|sw| (1i64 << sw.base.min(62)) % n == 0);
        strides_ok && self.offset % n == 0 && swz_ok
    }

    /// The map of byte pairs of a 4-bit type: elements `2j` and `2j+1` of the last dimension share
    /// byte `index / 2`. `None` where the layout splits a pair across bytes.
    pub fn halved(&self) -> Option<StorageMap> {
        if self.run(2) < 2 {
            return None;
        }
        let n = self.modes.len();
        let modes = self
            .modes
            .iter()
            .enumerate()
            .map(|(k, d)| {
                d.iter()
                    .enumerate()
                    .map(|(j, &(s, t))| {
                        if k + 1 == n && j == 0 {
                            (s / 2, 1)
                        } else {
                            (s, t / 2)
                        }
                    })
                    .collect()
            })
            .collect();
        let swizzle = match self.swizzle {
            Some(sw) if sw.base >= 1 => Some(Swizzle::new(sw.bits, sw.base - 1, sw.shift)),
            Some(_) => return None,
            None => None,
        };
        Some(StorageMap {
            modes,
            offset: self.offset / 2,
            swizzle,
        })
    }
}

impl std::fmt::Display for StorageMap {
    /// CuTe notation: `S<B,M,S> o off + (s0,(s1a,s1b)):(d0,(d1a,d1b))`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let part = |sel: fn(&(i64, i64)) -> i64| -> String {
            let m: Vec<String> = self
                .modes
                .iter()
                .map(|d| {
                    let v: Vec<String> = d.iter().map(|x| sel(x).to_string()).collect();
                    if v.len() == 1 {
                        v[0].clone()
                    } else {
                        format!("({})", v.join(","))
                    }
                })
                .collect();
            format!("({})", m.join(","))
        };
        if let Some(sw) = self.swizzle {
            write!(f, "{sw} o ")?;
        }
        if self.offset != 0 {
            write!(f, "{} + ", self.offset)?;
        }
        write!(f, "{}:{}", part(|x| x.0), part(|x| x.1))
    }
}

/// CuTe's `Swizzle<B,M,S>` as IR: `o ^ ((o & yyy) >> S)` (or `<< -S`), `yyy` the `B` bits at
/// `M + max(S, 0)`.
fn swizzle_expr(sw: Swizzle, o: Expr) -> Expr {
    let yyy = ((1i64 << sw.bits) - 1) << (i64::from(sw.base) + i64::from(sw.shift.max(0)));
    let masked = e::bin(BinOp::And, o.clone(), e::i(yyy));
    let moved = if sw.shift >= 0 {
        e::bin(BinOp::Shr, masked, e::i(i64::from(sw.shift)))
    } else {
        e::bin(BinOp::Shl, masked, e::i(-i64::from(sw.shift)))
    };
    e::bin(BinOp::Xor, o, moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Buf, BufId, BufRole, Elem, Program, Step, Stmt, Ty, UnOp, VarAlloc};

    /// Run `index` in the interpreter: item `i` (row-major over the shape) stores `i & 255` at
    /// `index(coord(i))`; every coordinate must land at `offset_of`.
    fn check_index(m: &StorageMap) {
        let shape = m.shape();
        let n: i64 = shape.iter().product();
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let mut coord = Vec::new();
        let mut rest = e::v(item);
        for &s in shape.iter().rev() {
            coord.push(e::rem(rest.clone(), s));
            rest = e::div(rest, s);
        }
        coord.reverse();
        let body = vec![Stmt::Store {
            buf: BufId(0),
            index: m.index(&coord),
            value: e::un(UnOp::Narrow, e::v(item)),
        }];
        let k = va.kernel("t".into(), item, n, body);
        let mut offs = Vec::new();
        for i in 0..n {
            let mut c = vec![0; shape.len()];
            let mut r = i;
            for (k, &s) in shape.iter().enumerate().rev() {
                c[k] = r % s;
                r /= s;
            }
            offs.push(m.offset_of(&c));
        }
        let len = offs.iter().copied().max().unwrap_or(0) as usize + 1;
        let prog = Program {
            recipe: "t".into(),
            bufs: vec![Buf {
                role: BufRole::Temp("o".into()),
                elem: Elem::U8,
                len,
                zeroed: true,
            }],
            steps: vec![Step::Kernel(k)],
        };
        let mut bufs = vec![vec![0u8; len]];
        assert!(crate::interp::run(&prog, &mut bufs, &crate::SingleProcess).is_ok());
        for (i, o) in offs.iter().enumerate() {
            assert_eq!(bufs[0][*o as usize], (i & 255) as u8, "item {i}");
        }
    }

    #[test]
    fn index_matches_numeric_offsets() {
        let maps = [
            StorageMap::row_major(&[2, 3, 4]),
            StorageMap {
                modes: vec![vec![(2, 24)], vec![(3, 1)], vec![(4, 3)]],
                offset: 0,
                swizzle: None,
            },
            StorageMap {
                modes: vec![vec![(2, 64)], vec![(4, 4), (2, 32)], vec![(4, 1), (2, 16)]],
                offset: 0,
                swizzle: Some(Swizzle::new(1, 2, 3)),
            },
            StorageMap {
                modes: vec![vec![(2, 64)], vec![(8, 8)], vec![(8, 1)]],
                offset: 0,
                swizzle: Some(Swizzle::new(2, 1, -1)),
            },
        ];
        for m in &maps {
            check_index(m);
        }
        assert!(maps[0].is_row_major());
        assert!(!maps[1].is_row_major());
        assert_eq!(maps[0].run(16), 4);
        assert_eq!(maps[1].run(16), 1);
        assert_eq!(maps[2].run(16), 4);
    }

    proptest::proptest! {
        /// The tabulated offsets are `offset_of`'s for every coordinate: inside the shape (looked
        /// up), outside it (computed), with and without a swizzle and a base offset, and with a
        /// dimension too long to tabulate.
        #[test]
        fn tabulated_offsets_equal_offset_of(
            modes in proptest::collection::vec(
                proptest::collection::vec((1i64..6, 0i64..50), 1..4),
                1..4,
            ),
            offset in 0i64..100,
            swizzled in proptest::bool::ANY,
            max_len in 0i64..40,
            extra in 0i64..7,
        ) {
            let m = StorageMap {
                modes,
                offset,
                swizzle: swizzled.then(|| Swizzle::new(2, 2, 3)),
            };
            let t = m.tables(max_len);
            let shape = m.shape();
            let total: i64 = shape.iter().map(|s| s + extra).product();
            for i in 0..total.min(4096) {
                let mut c = vec![0; shape.len()];
                let mut r = i;
                for (k, &s) in shape.iter().enumerate().rev() {
                    c[k] = r % (s + extra);
                    r /= s + extra;
                }
                proptest::prop_assert_eq!(t.offset_of(&c), m.offset_of(&c), "coordinate {:?}", c);
                if let Some((&l, lead)) = c.split_last() {
                    proptest::prop_assert_eq!(t.last(t.partial(lead), l), m.offset_of(&c));
                }
            }
        }
    }

    #[test]
    fn halved_pairs_share_a_byte() {
        let m = StorageMap {
            modes: vec![vec![(2, 64)], vec![(4, 16)], vec![(4, 1), (4, 4)]],
            offset: 0,
            swizzle: Some(Swizzle::new(2, 2, 2)),
        };
        let Some(h) = m.halved() else {
            panic!("pairs are contiguous")
        };
        for a in 0..2 {
            for b in 0..4 {
                for c in 0..8 {
                    let lo = m.offset_of(&[a, b, 2 * c]);
                    let hi = m.offset_of(&[a, b, 2 * c + 1]);
                    assert_eq!(lo % 2, 0);
                    assert_eq!(hi, lo + 1);
                    assert_eq!(h.offset_of(&[a, b, c]), lo / 2);
                }
            }
        }
        let col = StorageMap {
            modes: vec![vec![(2, 16)], vec![(4, 1)], vec![(4, 4)]],
            offset: 0,
            swizzle: None,
        };
        assert!(col.halved().is_none());
    }
}
