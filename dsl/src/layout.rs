//! CuTe's layout algebra over concrete integers.
//!
//! A [`Layout`] is a pair of congruent hierarchical tuples, a [`Shape`] and a [`Stride`], that maps a
//! coordinate to an offset: `crd2idx(c) = sum_i c_i * d_i`. A plain integer coordinate is read
//! colexicographically (first mode fastest), exactly as in CuTe. The operations keep CuTe's names and
//! semantics: [`Layout::size`], [`Layout::cosize`], [`coalesce`], [`composition`], [`complement`],
//! [`logical_divide`], [`logical_product`], plus [`Swizzle`] and [`ComposedLayout`], and row-major /
//! padded constructors for tensors stored with padding. `Display` prints CuTe's notation, `(4,8):(1,4)`
//! and `S<3,4,3>`.

use std::fmt;

/// Errors of the layout algebra: operations whose preconditions do not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The shape and stride tuples do not have the same profile.
    #[error("shape `{shape}` and stride `{stride}` are not congruent")]
    NotCongruent {
        /// The shape, in CuTe notation.
        shape: String,
        /// The stride, in CuTe notation.
        stride: String,
    },
    /// `composition` needs each stride of B to divide (or be divided by) A's mode shapes.
    #[error(
        "composition is not defined: stride {stride} and shape {shape} do not divide each other"
    )]
    NotDivisible {
        /// The offending stride of the right operand.
        stride: i64,
        /// The offending shape of the left operand.
        shape: i64,
    },
    /// `complement` needs an injective layout whose strides divide each other in sorted order.
    #[error("complement is not defined for `{0}`")]
    NoComplement(String),
    /// A coordinate does not fit the shape.
    #[error("coordinate `{coord}` is out of the shape `{shape}`")]
    CoordOutOfShape {
        /// The coordinate.
        coord: String,
        /// The shape.
        shape: String,
    },
    /// A shape extent is not positive.
    #[error("shape extent {0} is not positive")]
    NonPositiveExtent(i64),
    /// Integer overflow while evaluating a layout.
    #[error("integer overflow in layout arithmetic")]
    Overflow,
    /// Composing mode by mode would not be the composed function: the right operand's modes carry
    /// into each other's digits of the left operand.
    #[error("composition `{a} o {b}` does not distribute over the modes of `{b}`")]
    NotDistributive {
        /// The left operand.
        a: String,
        /// The right operand.
        b: String,
    },
}

/// Result type of the layout algebra.
pub type Result<T, E = LayoutError> = std::result::Result<T, E>;

/// A hierarchical tuple of integers: CuTe's `IntTuple`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IntTuple {
    /// A leaf.
    Int(i64),
    /// A (possibly nested) tuple.
    Tuple(Vec<IntTuple>),
}

/// A layout's shape.
pub type Shape = IntTuple;
/// A layout's stride.
pub type Stride = IntTuple;

impl IntTuple {
    /// A flat tuple from a slice of integers (one leaf is returned as a plain integer).
    pub fn flat(v: &[i64]) -> IntTuple {
        if v.len() == 1 {
            IntTuple::Int(v[0])
        } else {
            IntTuple::Tuple(v.iter().map(|&x| IntTuple::Int(x)).collect())
        }
    }

    /// The leaves in order (depth-first), CuTe's `flatten`.
    pub fn leaves(&self) -> Vec<i64> {
        let mut out = Vec::new();
        self.collect_leaves(&mut out);
        out
    }

    fn collect_leaves(&self, out: &mut Vec<i64>) {
        match self {
            IntTuple::Int(i) => out.push(*i),
            IntTuple::Tuple(t) => t.iter().for_each(|x| x.collect_leaves(out)),
        }
    }

    /// The product of the leaves: CuTe's `size` of a shape (an empty tuple has size 1).
    pub fn product(&self) -> i64 {
        self.leaves().iter().product()
    }

    /// Number of top-level modes (`rank`); an integer has rank 1.
    pub fn rank(&self) -> usize {
        match self {
            IntTuple::Int(_) => 1,
            IntTuple::Tuple(t) => t.len(),
        }
    }

    /// The `i`-th top-level mode (an integer is its own only mode).
    pub fn mode(&self, i: usize) -> Option<&IntTuple> {
        match self {
            IntTuple::Int(_) if i == 0 => Some(self),
            IntTuple::Int(_) => None,
            IntTuple::Tuple(t) => t.get(i),
        }
    }

    /// Whether two tuples have the same hierarchical profile.
    pub fn congruent(&self, other: &IntTuple) -> bool {
        match (self, other) {
            (IntTuple::Int(_), IntTuple::Int(_)) => true,
            (IntTuple::Tuple(a), IntTuple::Tuple(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.congruent(y))
            }
            _ => false,
        }
    }
}

impl fmt::Display for IntTuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IntTuple::Int(i) => write!(f, "{i}"),
            IntTuple::Tuple(t) => {
                write!(f, "(")?;
                for (k, x) in t.iter().enumerate() {
                    if k > 0 {
                        write!(f, ",")?;
                    }
                    write!(f, "{x}")?;
                }
                write!(f, ")")
            }
        }
    }
}

/// A CuTe layout: a shape and a congruent stride.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Shape,
    stride: Stride,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.shape, self.stride)
    }
}

impl Layout {
    /// A layout from a shape and a congruent stride.
    pub fn new(shape: Shape, stride: Stride) -> Result<Layout> {
        if !shape.congruent(&stride) {
            return Err(LayoutError::NotCongruent {
                shape: shape.to_string(),
                stride: stride.to_string(),
            });
        }
        if let Some(&bad) = shape.leaves().iter().find(|&&s| s <= 0) {
            return Err(LayoutError::NonPositiveExtent(bad));
        }
        Ok(Layout { shape, stride })
    }

    /// A flat layout from parallel shape and stride lists.
    pub fn from_flat(shape: &[i64], stride: &[i64]) -> Result<Layout> {
        Layout::new(IntTuple::flat(shape), IntTuple::flat(stride))
    }

    /// CuTe's default (column-major, "LayoutLeft") compact layout of a flat shape.
    pub fn column_major(shape: &[i64]) -> Result<Layout> {
        let mut stride = Vec::with_capacity(shape.len());
        let mut acc = 1i64;
        for &s in shape {
            stride.push(acc);
            acc = acc.checked_mul(s).ok_or(LayoutError::Overflow)?;
        }
        Layout::from_flat(shape, &stride)
    }

    /// The row-major ("LayoutRight") compact layout of a flat shape: last mode fastest.
    pub fn row_major(shape: &[i64]) -> Result<Layout> {
        Layout::padded(shape, shape)
    }

    /// The layout of a `shape` tensor stored row-major inside a zero-padded `storage` shape
    /// (`storage[i] >= shape[i]`): padding as a layout, offsets are those of the padded buffer.
    pub fn padded(shape: &[i64], storage: &[i64]) -> Result<Layout> {
        let mut stride = vec![0i64; storage.len()];
        let mut acc = 1i64;
        for i in (0..storage.len()).rev() {
            stride[i] = acc;
            acc = acc.checked_mul(storage[i]).ok_or(LayoutError::Overflow)?;
        }
        Layout::from_flat(shape, &stride)
    }

    /// Concatenation of layouts as modes: CuTe's `make_layout(a, b, ...)`.
    pub fn make(modes: &[Layout]) -> Layout {
        Layout {
            shape: IntTuple::Tuple(modes.iter().map(|m| m.shape.clone()).collect()),
            stride: IntTuple::Tuple(modes.iter().map(|m| m.stride.clone()).collect()),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The stride.
    pub fn stride(&self) -> &Stride {
        &self.stride
    }

    /// Number of top-level modes.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// The `i`-th top-level mode as a layout.
    pub fn mode(&self, i: usize) -> Option<Layout> {
        Some(Layout {
            shape: self.shape.mode(i)?.clone(),
            stride: self.stride.mode(i)?.clone(),
        })
    }

    /// The flattened (shape, stride) pairs.
    pub fn flat_modes(&self) -> Vec<(i64, i64)> {
        self.shape
            .leaves()
            .into_iter()
            .zip(self.stride.leaves())
            .collect()
    }

    /// The flattened layout (CuTe's `flatten`).
    pub fn flatten(&self) -> Layout {
        let (s, d): (Vec<i64>, Vec<i64>) = self.flat_modes().into_iter().unzip();
        Layout {
            shape: IntTuple::Tuple(s.into_iter().map(IntTuple::Int).collect()),
            stride: IntTuple::Tuple(d.into_iter().map(IntTuple::Int).collect()),
        }
    }

    /// Number of coordinates: CuTe's `size`.
    pub fn size(&self) -> i64 {
        self.shape.product()
    }

    /// One past the largest offset the layout produces: CuTe's `cosize` (for any sign of strides,
    /// `max offset + 1`).
    pub fn cosize(&self) -> i64 {
        1 + self
            .flat_modes()
            .iter()
            .map(|&(s, d)| if d > 0 { (s - 1) * d } else { 0 })
            .sum::<i64>()
    }

    /// The smallest offset the layout produces (0 unless a stride is negative).
    pub fn min_offset(&self) -> i64 {
        self.flat_modes()
            .iter()
            .map(|&(s, d)| if d < 0 { (s - 1) * d } else { 0 })
            .sum()
    }

    /// Offset of a 1-D index (colexicographic over the shape, as CuTe's `layout(i)`).
    pub fn call(&self, idx: i64) -> i64 {
        let mut rest = idx;
        let modes = self.flat_modes();
        let mut off = 0i64;
        for (k, &(s, d)) in modes.iter().enumerate() {
            let c = if k + 1 == modes.len() { rest } else { rest % s };
            rest /= s;
            off += c * d;
        }
        off
    }

    /// Offset of a natural (hierarchical) coordinate: CuTe's `crd2idx`.
    pub fn crd2idx(&self, coord: &IntTuple) -> Result<i64> {
        crd2idx(coord, &self.shape, &self.stride)
    }

    /// Offset of a flat coordinate, one entry per leaf mode.
    pub fn crd2idx_flat(&self, coord: &[i64]) -> Result<i64> {
        let modes = self.flat_modes();
        if coord.len() != modes.len() {
            return Err(LayoutError::CoordOutOfShape {
                coord: format!("{coord:?}"),
                shape: self.shape.to_string(),
            });
        }
        let mut off = 0i64;
        for (&c, &(s, d)) in coord.iter().zip(&modes) {
            if c < 0 || c >= s {
                return Err(LayoutError::CoordOutOfShape {
                    coord: format!("{coord:?}"),
                    shape: self.shape.to_string(),
                });
            }
            off = c
                .checked_mul(d)
                .and_then(|x| off.checked_add(x))
                .ok_or(LayoutError::Overflow)?;
        }
        Ok(off)
    }

    /// Whether the layout is injective: no two coordinates share an offset. Decided by sorting the
    /// non-trivial modes by stride and checking that each stride is at least the span of the smaller
    /// ones (exact for non-negative strides; exhaustive for small layouts otherwise).
    pub fn is_injective(&self) -> bool {
        let mut modes: Vec<(i64, i64)> = self
            .flat_modes()
            .into_iter()
            .filter(|&(s, _)| s > 1)
            .collect();
        if modes.iter().any(|&(_, d)| d <= 0) {
            return self.is_injective_exhaustive();
        }
        modes.sort_by_key(|&(s, d)| (d, s));
        let mut span = 1i64;
        for (s, d) in modes {
            if d < span {
                return self.is_injective_exhaustive();
            }
            span += d * (s - 1);
        }
        true
    }

    fn is_injective_exhaustive(&self) -> bool {
        let n = self.size();
        if n > 1 << 24 {
            return false;
        }
        let lo = self.min_offset();
        let range = self.cosize().saturating_sub(lo);
        // A dense codomain gets a bitmap; a sparse one (large strides: the range can be far
        // past any allocation) sorts the offsets instead, so memory follows the size, not the span.
        if range <= 4 * n.max(1) {
            let mut seen = vec![false; range.max(0) as usize];
            for i in 0..n {
                let o = (self.call(i) - lo) as usize;
                match seen.get_mut(o) {
                    Some(slot) if !*slot => *slot = true,
                    _ => return false,
                }
            }
            return true;
        }
        let mut offsets: Vec<i64> = (0..n).map(|i| self.call(i)).collect();
        offsets.sort_unstable();
        offsets.windows(2).all(|w| w[0] != w[1])
    }

    /// Whether the layout is a bijection from `[0, size)` onto `[0, size)`.
    pub fn is_bijective(&self) -> bool {
        self.min_offset() == 0 && self.cosize() == self.size() && self.is_injective()
    }
}

/// CuTe's `crd2idx(coord, shape, stride)`: an integer coordinate against a tuple shape is split
/// colexicographically; a tuple coordinate must be congruent at that level.
pub fn crd2idx(coord: &IntTuple, shape: &Shape, stride: &Stride) -> Result<i64> {
    match (coord, shape, stride) {
        (IntTuple::Int(c), IntTuple::Int(s), IntTuple::Int(d)) => {
            if *c < 0 || c >= s {
                return Err(LayoutError::CoordOutOfShape {
                    coord: c.to_string(),
                    shape: s.to_string(),
                });
            }
            c.checked_mul(*d).ok_or(LayoutError::Overflow)
        }
        (IntTuple::Int(c), IntTuple::Tuple(ss), IntTuple::Tuple(ds)) => {
            let mut rest = *c;
            let mut off = 0i64;
            for (k, (s, d)) in ss.iter().zip(ds).enumerate() {
                let n = s.product();
                let ci = if k + 1 == ss.len() { rest } else { rest % n };
                rest /= n;
                off += crd2idx(&IntTuple::Int(ci), s, d)?;
            }
            Ok(off)
        }
        (IntTuple::Tuple(cs), IntTuple::Tuple(ss), IntTuple::Tuple(ds)) if cs.len() == ss.len() => {
            let mut off = 0i64;
            for ((c, s), d) in cs.iter().zip(ss).zip(ds) {
                off += crd2idx(c, s, d)?;
            }
            Ok(off)
        }
        _ => Err(LayoutError::CoordOutOfShape {
            coord: coord.to_string(),
            shape: shape.to_string(),
        }),
    }
}

/// CuTe's `idx2crd(idx, shape)`: the natural (colexicographic) coordinate of a 1-D index.
pub fn idx2crd(idx: i64, shape: &Shape) -> IntTuple {
    match shape {
        IntTuple::Int(_) => IntTuple::Int(idx),
        IntTuple::Tuple(ss) => {
            let mut rest = idx;
            let mut out = Vec::with_capacity(ss.len());
            for (k, s) in ss.iter().enumerate() {
                let n = s.product();
                let ci = if k + 1 == ss.len() { rest } else { rest % n };
                rest /= n;
                out.push(idx2crd(ci, s));
            }
            IntTuple::Tuple(out)
        }
    }
}

fn from_modes(modes: Vec<(i64, i64)>) -> Layout {
    match modes.len() {
        0 => Layout {
            shape: IntTuple::Int(1),
            stride: IntTuple::Int(0),
        },
        1 => Layout {
            shape: IntTuple::Int(modes[0].0),
            stride: IntTuple::Int(modes[0].1),
        },
        _ => Layout {
            shape: IntTuple::Tuple(modes.iter().map(|m| IntTuple::Int(m.0)).collect()),
            stride: IntTuple::Tuple(modes.iter().map(|m| IntTuple::Int(m.1)).collect()),
        },
    }
}

/// CuTe's `coalesce`: the flattest layout with the same function over `[0, size)`. Drops size-1
/// modes and merges neighbours where `d[i+1] == s[i] * d[i]`.
pub fn coalesce(layout: &Layout) -> Layout {
    let mut out: Vec<(i64, i64)> = Vec::new();
    for (s, d) in layout.flat_modes() {
        if s == 1 {
            continue;
        }
        if let Some(last) = out.last_mut() {
            if last.0 * last.1 == d {
                last.0 *= s;
                continue;
            }
        }
        out.push((s, d));
    }
    from_modes(out)
}

/// CuTe's `composition(a, b)`: the layout `r` with `r(i) == a(b(i))` for every `i < size(b)`, with
/// `b`'s shape profile. Defined when `b`'s strides and `a`'s shapes divide each other.
pub fn composition(a: &Layout, b: &Layout) -> Result<Layout> {
    if let (IntTuple::Tuple(bs), IntTuple::Tuple(bd)) = (&b.shape, &b.stride) {
        let mut modes = Vec::with_capacity(bs.len());
        for (s, d) in bs.iter().zip(bd) {
            modes.push(composition(
                a,
                &Layout {
                    shape: s.clone(),
                    stride: d.clone(),
                },
            )?);
        }
        let r = Layout::make(&modes);
        if !distributes(a, b, &r)? {
            return Err(LayoutError::NotDistributive {
                a: a.to_string(),
                b: b.to_string(),
            });
        }
        return Ok(r);
    }
    let (IntTuple::Int(b_shape), IntTuple::Int(b_stride)) = (&b.shape, &b.stride) else {
        return Err(LayoutError::NotCongruent {
            shape: b.shape.to_string(),
            stride: b.stride.to_string(),
        });
    };
    if *b_stride == 0 {
        return Ok(Layout {
            shape: IntTuple::Int(*b_shape),
            stride: IntTuple::Int(0),
        });
    }
    let flat_a = coalesce(a).flat_modes();
    let mut result: Vec<(i64, i64)> = Vec::new();
    let mut rest_shape = *b_shape;
    let mut rest_stride = *b_stride;
    let (last, init) = match flat_a.split_last() {
        Some(x) => x,
        None => return Err(LayoutError::NonPositiveExtent(0)),
    };
    for &(cur_shape, cur_stride) in init {
        if cur_shape % rest_stride != 0 && rest_stride % cur_shape != 0 {
            return Err(LayoutError::NotDivisible {
                stride: rest_stride,
                shape: cur_shape,
            });
        }
        let new_shape = (cur_shape / rest_stride).max(1).min(rest_shape);
        if new_shape != 1 {
            result.push((new_shape, rest_stride * cur_stride));
        }
        if rest_shape % new_shape != 0 {
            return Err(LayoutError::NotDivisible {
                stride: rest_shape,
                shape: new_shape,
            });
        }
        rest_shape /= new_shape;
        rest_stride = (rest_stride + cur_shape - 1) / cur_shape;
    }
    if rest_shape != 1 || result.is_empty() {
        result.push((rest_shape, rest_stride * last.1));
    }
    Ok(from_modes(result))
}

/// Whether the mode-by-mode composition `r` of `a o b` is the composed function on `b`'s domain
/// (CuTe composes mode by mode; that is `a(b(c))` only where `b`'s modes do not carry into each other
/// through `a`). Decided without enumeration where `a` is linear on `b`'s image (one mode after
/// coalescing, `b` within it), else by enumerating `b`'s domain, up to 2^20 points; larger cases that
/// are not linear are refused.
fn distributes(a: &Layout, b: &Layout, r: &Layout) -> Result<bool> {
    let n = b.size();
    let flat = coalesce(a).flat_modes();
    if flat.len() <= 1 && b.flat_modes().iter().all(|&(_, d)| d >= 0) && b.cosize() <= a.size() {
        return Ok(true);
    }
    if n > 1 << 20 {
        return Ok(false);
    }
    for i in 0..n {
        if r.call(i) != a.call(b.call(i)) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// CuTe's `complement(a, cosize_hi)`: the layout of the offsets in `[0, cosize_hi)` that `a` does
/// not reach, ordered so that `(a, complement(a))` is injective.
pub fn complement(a: &Layout, cosize_hi: i64) -> Result<Layout> {
    let mut modes: Vec<(i64, i64)> = a
        .flat_modes()
        .into_iter()
        .filter(|&(s, d)| s != 1 && d != 0)
        .map(|(s, d)| (d, s))
        .collect();
    if modes.iter().any(|&(d, _)| d < 0) {
        return Err(LayoutError::NoComplement(a.to_string()));
    }
    modes.sort();
    let mut result = Vec::new();
    let mut current = 1i64;
    for (d, s) in modes {
        if d % current != 0 || current > d * s {
            return Err(LayoutError::NoComplement(a.to_string()));
        }
        result.push((d / current, current));
        current = d * s;
    }
    result.push(((cosize_hi + current - 1) / current, current));
    Ok(coalesce(&from_modes(result)))
}

/// CuTe's `logical_divide(a, tiler)`: `composition(a, (tiler, complement(tiler, size(a))))`, the
/// first mode iterating inside a tile, the second over the tiles.
pub fn logical_divide(a: &Layout, tiler: &Layout) -> Result<Layout> {
    let comp = complement(tiler, a.size())?;
    composition(a, &Layout::make(&[tiler.clone(), comp]))
}

/// CuTe's `logical_product(a, b)`: `(a, composition(complement(a, size(a)*cosize(b)), b))`, `b`
/// repeating `a`'s footprint.
pub fn logical_product(a: &Layout, b: &Layout) -> Result<Layout> {
    let comp = complement(a, a.size() * b.cosize())?;
    Ok(Layout::make(&[a.clone(), composition(&comp, b)?]))
}

/// CuTe's `Swizzle<B, M, S>`: XORs the `B` bits at `[M+S, M+S+B)` of an offset into the bits at
/// `[M, M+B)` (for `S >= 0`; a negative `S` shifts the other way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Swizzle {
    /// Number of bits in the mask.
    pub bits: u32,
    /// Number of least-significant bits kept constant.
    pub base: u32,
    /// Distance to shift the mask (signed).
    pub shift: i32,
}

impl Swizzle {
    /// `S<B,M,S>`.
    pub fn new(bits: u32, base: u32, shift: i32) -> Swizzle {
        Swizzle { bits, base, shift }
    }

    /// Apply the swizzle to an offset.
    pub fn apply(&self, offset: i64) -> i64 {
        let bit_msk = (1i64 << self.bits) - 1;
        let yyy = bit_msk << (self.base as i64 + self.shift.max(0) as i64);
        if self.shift >= 0 {
            offset ^ ((offset & yyy) >> self.shift)
        } else {
            offset ^ ((offset & yyy) << (-self.shift))
        }
    }

    /// The swizzle permutes offsets inside aligned blocks of this many elements.
    pub fn period(&self) -> i64 {
        1i64 << (self.bits as i64 + self.base as i64 + self.shift.unsigned_abs() as i64)
    }

    /// A swizzle is an involution (and so a bijection) when `|S| >= B`.
    pub fn is_involution(&self) -> bool {
        self.shift.unsigned_abs() >= self.bits
    }
}

impl fmt::Display for Swizzle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S<{},{},{}>", self.bits, self.base, self.shift)
    }
}

/// CuTe's `ComposedLayout`: `outer o offset o inner`; here the outer function is a [`Swizzle`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ComposedLayout {
    /// Applied last.
    pub outer: Swizzle,
    /// Added between inner and outer.
    pub offset: i64,
    /// Applied first.
    pub inner: Layout,
}

impl ComposedLayout {
    /// `outer o offset o inner`.
    pub fn new(outer: Swizzle, offset: i64, inner: Layout) -> ComposedLayout {
        ComposedLayout {
            outer,
            offset,
            inner,
        }
    }

    /// Offset of a 1-D index.
    pub fn call(&self, idx: i64) -> i64 {
        self.outer.apply(self.offset + self.inner.call(idx))
    }

    /// Number of coordinates.
    pub fn size(&self) -> i64 {
        self.inner.size()
    }
}

impl fmt::Display for ComposedLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.offset == 0 {
            write!(f, "{} o {}", self.outer, self.inner)
        } else {
            write!(f, "{} o {} o {}", self.outer, self.offset, self.inner)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(s: &[i64], d: &[i64]) -> Layout {
        Layout::from_flat(s, d).unwrap_or_else(|_| Layout::make(&[]))
    }

    #[test]
    fn composition_that_would_carry_between_modes_is_refused() {
        // (3,4,3):(3,9,1) o (2,3):(6,4): mode by mode (2,3):(18,12), but b(1,2) = 14 and a(14) = 7,
        // while the modes' images 18 + 24 = 42 (the sum carries into a's second mode).
        let a = l(&[3, 4, 3], &[3, 9, 1]);
        let b = l(&[2, 3], &[6, 4]);
        assert!(matches!(
            composition(&a, &b),
            Err(LayoutError::NotDistributive { .. })
        ));
        // A tiler that stays within one of a's modes composes.
        let r = composition(&l(&[12, 3], &[3, 1]), &l(&[2, 3], &[1, 2])).unwrap();
        for i in 0..6 {
            assert_eq!(
                r.call(i),
                l(&[12, 3], &[3, 1]).call(l(&[2, 3], &[1, 2]).call(i))
            );
        }
    }

    #[test]
    fn display_is_cute_notation() {
        assert_eq!(l(&[4, 8], &[1, 4]).to_string(), "(4,8):(1,4)");
        assert_eq!(Swizzle::new(3, 4, 3).to_string(), "S<3,4,3>");
        assert_eq!(l(&[8], &[2]).to_string(), "8:2");
    }

    #[test]
    fn coalesce_examples() {
        assert_eq!(coalesce(&l(&[2, 4], &[1, 2])).to_string(), "8:1");
        assert_eq!(coalesce(&l(&[2, 1, 6], &[1, 6, 2])).to_string(), "12:1");
        assert_eq!(coalesce(&l(&[4, 8], &[8, 1])).to_string(), "(4,8):(8,1)");
    }

    #[test]
    fn composition_examples() {
        // CuTe docs: (6,2):(8,2) o (4,3):(3,1) = ((2,2),3):((24,2),8)
        let a = l(&[6, 2], &[8, 2]);
        let b = l(&[4, 3], &[3, 1]);
        let r = composition(&a, &b).unwrap_or_else(|_| l(&[1], &[0]));
        assert_eq!(r.to_string(), "((2,2),3):((24,2),8)");
        for i in 0..b.size() {
            assert_eq!(r.call(i), a.call(b.call(i)));
        }
    }

    #[test]
    fn complement_examples() {
        // complement(4:1, 24) = 6:4 ; complement((2,2):(1,6), 24) = (3,2):(2,12)
        let c = complement(&l(&[4], &[1]), 24).unwrap_or_else(|_| l(&[1], &[0]));
        assert_eq!(c.to_string(), "6:4");
        let c = complement(&l(&[2, 2], &[1, 6]), 24).unwrap_or_else(|_| l(&[1], &[0]));
        assert_eq!(c.to_string(), "(3,2):(2,12)");
    }

    #[test]
    fn logical_divide_example() {
        // CuTe docs: (4,2,3):(2,1,8) / 4:2 = ((2,2),(2,3)):((4,1),(2,8))
        let a = l(&[4, 2, 3], &[2, 1, 8]);
        let r = logical_divide(&a, &l(&[4], &[2])).unwrap_or_else(|_| l(&[1], &[0]));
        assert_eq!(r.to_string(), "((2,2),(2,3)):((4,1),(2,8))");
    }

    #[test]
    fn crd2idx_hierarchical() {
        let lay = Layout::new(
            IntTuple::Tuple(vec![IntTuple::flat(&[2, 2]), IntTuple::Int(3)]),
            IntTuple::Tuple(vec![IntTuple::flat(&[1, 6]), IntTuple::Int(2)]),
        )
        .unwrap_or_else(|_| l(&[1], &[0]));
        // integer coordinate 3 inside mode 0 is (1,1)
        let c = IntTuple::Tuple(vec![IntTuple::Int(3), IntTuple::Int(2)]);
        assert_eq!(lay.crd2idx(&c), Ok(1 + 6 + 4));
        assert_eq!(idx2crd(5, lay.shape()).to_string(), "((1,0),1)");
    }

    /// Regression: a small layout whose strides span far past memory (the soundness test drew one)
    /// is decided by sorting its offsets, not by a bitmap over its whole span.
    #[test]
    fn injectivity_of_a_small_layout_with_huge_strides() {
        // A negative stride sends the check to the exhaustive path; the span is about 2^52.
        let spread = l(&[4, 4], &[1 << 50, -1]);
        assert!(spread.is_injective());
        let collide = l(&[4, 2], &[1 << 50, 0]);
        assert!(!collide.is_injective());
        let overlap = l(&[4, 4], &[1 << 50, -(1 << 50)]);
        assert!(!overlap.is_injective());
        // Dense layouts still take the bitmap.
        assert!(l(&[3, 5], &[5, -1]).is_injective());
        assert!(!l(&[3, 5], &[1, -1]).is_injective());
    }

    #[test]
    fn padded_layout() {
        let p = Layout::padded(&[3, 5], &[4, 8]).unwrap_or_else(|_| l(&[1], &[0]));
        assert_eq!(p.to_string(), "(3,5):(8,1)");
        assert_eq!(p.cosize(), 2 * 8 + 4 + 1);
    }
}
