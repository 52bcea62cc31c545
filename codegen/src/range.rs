//! Value ranges of a kernel's index arithmetic: whether every `i64` value it computes provably lies in
//! `i32`'s range, so that a backend may compute indices in 32 bits (the GPU's integer units work on 32
//! bits; 64-bit index arithmetic costs instruction pairs).
//!
//! An interval analysis over the kernel IR: the item variable ranges over `0..items`, loop variables
//! over their bounds, every other `i64` variable over the union of what is assigned to it (iterated to
//! a fixed point, or given up on). Each `i64` operation's result interval is computed exactly over
//! `i128` and must lie in `i32`; division and remainder need a constant positive divisor and a
//! non-negative dividend (as the IR requires); bit operations other than shifts and masks of
//! non-negative values, and anything unknown, fail the proof. A failed proof only keeps 64 bits.

use crate::kir::{BinOp, Expr, Kernel, Stmt, Ty, UnOp, Var};

type Iv = (i128, i128);

/// The proven range, with headroom below i32's limits: backends add small constants to proven
/// values (a packed access's element offsets, up to 16).
const LO: i128 = i32::MIN as i128 + 1024;
const HI: i128 = i32::MAX as i128 - 1024;

/// Headroom above a group loop's count: its variable steps past the count by up to a group (1024).
const GROUP_STEP: i128 = 1024;

/// Whether every `i64` value of `k` (indices, coordinates, loop variables, the item and the item
/// loop's step past the last item) fits in `i32`, with headroom. The item loop's bound assumes what
/// the runtime's launch configuration guarantees: at most `items` plus one CTA of threads.
pub fn indices_fit_i32(k: &Kernel) -> bool {
    // The item loop steps by the launched threads, at most `items` plus a CTA past the last item.
    if k.items < 1 || i128::from(k.items) * 2 + 2 * GROUP_STEP > HI {
        return false;
    }
    let mut a = Analysis {
        types: &k.var_types,
        iv: vec![None; k.var_types.len()],
        changed: false,
    };
    if a.set(k.item, (0, i128::from(k.items) - 1)).is_err() {
        return false;
    }
    for _ in 0..4 {
        a.changed = false;
        if a.block(&k.body).is_err() {
            return false;
        }
        if !a.changed {
            return true;
        }
    }
    false
}

struct Analysis<'a> {
    types: &'a [Ty],
    iv: Vec<Option<Iv>>,
    changed: bool,
}

/// The proof failed (a value may leave `i32`, or is not known).
struct Unbounded;

type R<T> = Result<T, Unbounded>;

fn fit(iv: Iv) -> R<Iv> {
    if iv.0 >= LO && iv.1 <= HI && iv.0 <= iv.1 {
        Ok(iv)
    } else {
        Err(Unbounded)
    }
}

impl Analysis<'_> {
    fn is_i64(&self, v: Var) -> bool {
        self.types.get(v.0 as usize) == Some(&Ty::I64)
    }

    /// Join `iv` into `v`'s interval.
    fn set(&mut self, v: Var, iv: Iv) -> R<()> {
        let iv = fit(iv)?;
        let slot = self.iv.get_mut(v.0 as usize).ok_or(Unbounded)?;
        let joined = match *slot {
            Some((lo, hi)) => (lo.min(iv.0), hi.max(iv.1)),
            None => iv,
        };
        if *slot != Some(joined) {
            *slot = Some(joined);
            self.changed = true;
        }
        Ok(())
    }

    /// A group construct's variable: `0..count`, stepping past it by up to a group.
    fn group_var(&mut self, sub: Var, count: &Expr) -> R<()> {
        let (_, hi) = self.int(count)?;
        fit((0, hi + GROUP_STEP))?;
        self.set(sub, (0, (hi - 1).max(0)))
    }

    fn block(&mut self, body: &[Stmt]) -> R<()> {
        for st in body {
            match st {
                Stmt::Set(v, x) => {
                    if self.is_i64(*v) {
                        let iv = self.int(x)?;
                        self.set(*v, iv)?;
                    } else {
                        self.expr(x)?;
                    }
                }
                Stmt::For {
                    var,
                    start,
                    end,
                    body,
                } => {
                    let (lo, start_hi) = self.int(start)?;
                    let (_, hi) = self.int(end)?;
                    // The variable ends at `end`, or stays at `start` for an empty loop.
                    self.set(*var, (lo, hi.max(start_hi)))?;
                    self.block(body)?;
                }
                Stmt::If { cond, then } => {
                    self.expr(cond)?;
                    self.block(then)?;
                }
                Stmt::Store { index, value, .. } | Stmt::AtomicMaxF32 { index, value, .. } => {
                    self.int(index)?;
                    self.expr(value)?;
                }
                Stmt::LoadPacked { index, dst, .. } => {
                    self.int(index)?;
                    if dst.iter().any(|v| self.is_i64(*v)) {
                        return Err(Unbounded);
                    }
                }
                Stmt::StorePacked { index, values, .. } => {
                    self.int(index)?;
                    for x in values {
                        self.expr(x)?;
                    }
                }
                Stmt::GroupMax {
                    sub,
                    count,
                    body,
                    value,
                    ..
                } => {
                    self.group_var(*sub, count)?;
                    self.block(body)?;
                    self.expr(value)?;
                }
                Stmt::GroupRow(g) => {
                    self.group_var(g.sub, &g.count)?;
                    self.block(&g.load)?;
                    self.expr(&g.value)?;
                    self.block(&g.mid)?;
                    self.block(&g.body)?;
                }
                Stmt::GroupFor { var, count, body } => {
                    self.group_var(*var, count)?;
                    self.block(body)?;
                }
            }
        }
        Ok(())
    }

    /// The interval of an `i64` expression.
    fn int(&mut self, x: &Expr) -> R<Iv> {
        self.expr(x)?.ok_or(Unbounded)
    }

    /// Check an expression: `Some(interval)` for an `i64` one, `None` for others (whose `i64`
    /// sub-expressions are checked).
    fn expr(&mut self, x: &Expr) -> R<Option<Iv>> {
        Ok(match x {
            Expr::Var(v) => {
                if self.is_i64(*v) {
                    // Read before any assignment: not known.
                    Some(
                        self.iv
                            .get(v.0 as usize)
                            .copied()
                            .flatten()
                            .ok_or(Unbounded)?,
                    )
                } else {
                    None
                }
            }
            Expr::I64(c) => Some(fit((i128::from(*c), i128::from(*c)))?),
            Expr::I32(_) | Expr::F32(_) => None,
            Expr::Load { index, .. } | Expr::LoadX4 { index, .. } => {
                self.int(index)?;
                None
            }
            Expr::Un(op, a) => {
                let ia = self.expr(a)?;
                match op {
                    // An i32 widened: anything in i32.
                    UnOp::Widen => Some((LO, HI)),
                    _ => {
                        if ia.is_some() && *op != UnOp::Narrow {
                            return Err(Unbounded);
                        }
                        None
                    }
                }
            }
            Expr::Bin(op, a, b) => {
                let (ia, ib) = (self.expr(a)?, self.expr(b)?);
                match (ia, ib) {
                    (Some(ia), Some(ib)) => {
                        let r = bin(*op, ia, ib, b)?;
                        match op {
                            BinOp::ILt | BinOp::IEq => None,
                            _ => Some(fit(r)?),
                        }
                    }
                    (None, None) => None,
                    _ => return Err(Unbounded),
                }
            }
            Expr::Select(c, a, b) => {
                self.expr(c)?;
                match (self.expr(a)?, self.expr(b)?) {
                    (Some(ia), Some(ib)) => Some((ia.0.min(ib.0), ia.1.max(ib.1))),
                    (None, None) => None,
                    _ => return Err(Unbounded),
                }
            }
            Expr::Fma(a, b, c) => {
                for y in [a, b, c] {
                    self.expr(y)?;
                }
                None
            }
            Expr::PackE2m1 { vals, .. } | Expr::AbsMax(vals) => {
                for y in vals {
                    self.expr(y)?;
                }
                None
            }
            Expr::Splat(a) | Expr::Lane(a, _) => {
                self.expr(a)?;
                None
            }
        })
    }
}

/// The interval of `a op b` for `i64` operands (`bx` is `b`'s expression, for constant divisors).
fn bin(op: BinOp, a: Iv, b: Iv, bx: &Expr) -> R<Iv> {
    let corners = |f: fn(i128, i128) -> i128| {
        let c = [f(a.0, b.0), f(a.0, b.1), f(a.1, b.0), f(a.1, b.1)];
        (
            c.iter().copied().min().unwrap_or(0),
            c.iter().copied().max().unwrap_or(0),
        )
    };
    let divisor = || match bx {
        Expr::I64(c) if *c > 0 => Ok(i128::from(*c)),
        _ => Err(Unbounded),
    };
    Ok(match op {
        BinOp::IAdd => (a.0 + b.0, a.1 + b.1),
        BinOp::ISub => (a.0 - b.1, a.1 - b.0),
        BinOp::IMul => corners(|x, y| x * y),
        BinOp::IDiv if a.0 >= 0 => {
            let c = divisor()?;
            (a.0 / c, a.1 / c)
        }
        BinOp::IRem if a.0 >= 0 => {
            let c = divisor()?;
            (0, a.1.min(c - 1))
        }
        BinOp::And if a.0 >= 0 && b.0 >= 0 => (0, a.1.min(b.1)),
        BinOp::Or | BinOp::Xor if a.0 >= 0 && b.0 >= 0 => {
            // Below the next power of two of the larger operand.
            let hi = a.1.max(b.1);
            let bits = 128 - hi.leading_zeros();
            (0, (1i128 << bits.min(126)) - 1)
        }
        BinOp::Shr if a.0 >= 0 && b.0 >= 0 && b.1 < 64 => (a.0 >> b.1, a.1 >> b.0),
        BinOp::Shl if a.0 >= 0 && b.0 >= 0 && b.1 < 32 => (a.0 << b.0, a.1 << b.1),
        // Comparisons: both operands checked; the result is a boolean.
        BinOp::ILt | BinOp::IEq => a,
        _ => return Err(Unbounded),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{e, BufId, VarAlloc};

    fn kernel(items: i64, body: impl FnOnce(&mut VarAlloc, Var) -> Vec<Stmt>) -> Kernel {
        let mut va = VarAlloc::default();
        let item = va.new_var(Ty::I64);
        let body = body(&mut va, item);
        va.kernel("k".into(), item, items, body)
    }

    fn store(index: Expr) -> Stmt {
        Stmt::Store {
            buf: BufId(0),
            index,
            value: e::f(0.0),
        }
    }

    #[test]
    fn item_arithmetic_within_i32_fits() {
        // row = item / 7168, col = item % 7168, index = row * 7168 * 2 + col * 2 + 1.
        let k = kernel(1 << 28, |va, it| {
            let row = va.new_var(Ty::I64);
            vec![
                Stmt::Set(row, e::div(e::v(it), 7168)),
                store(e::add(
                    e::add(
                        e::mul(e::v(row), e::i(14336)),
                        e::mul(e::rem(e::v(it), 7168), e::i(2)),
                    ),
                    e::i(1),
                )),
            ]
        });
        assert!(indices_fit_i32(&k));
    }

    #[test]
    fn a_product_past_i32_or_an_unknown_value_does_not() {
        // item * 16 reaches 2^32.
        let k = kernel(1 << 28, |_, it| vec![store(e::mul(e::v(it), e::i(16)))]);
        assert!(!indices_fit_i32(&k));
        // Too many items for the item loop's step.
        let k = kernel(1 << 30, |_, it| vec![store(e::v(it))]);
        assert!(!indices_fit_i32(&k));
        // A division by a variable, and a dividend that may be negative.
        let k = kernel(100, |_, it| {
            vec![store(e::bin(BinOp::IDiv, e::i(1000), e::v(it)))]
        });
        assert!(!indices_fit_i32(&k));
        let k = kernel(100, |_, it| {
            vec![store(e::div(e::bin(BinOp::ISub, e::v(it), e::i(50)), 4))]
        });
        assert!(!indices_fit_i32(&k));
    }

    #[test]
    fn loops_and_group_loops_are_bounded_by_their_ends() {
        let k = kernel(1000, |va, it| {
            let c = va.new_var(Ty::I64);
            let sub = va.new_var(Ty::I64);
            vec![
                Stmt::For {
                    var: c,
                    start: e::i(0),
                    end: e::i(64),
                    body: vec![store(e::add(e::mul(e::v(it), e::i(64)), e::v(c)))],
                },
                Stmt::GroupFor {
                    var: sub,
                    count: e::i(4096),
                    body: vec![store(e::add(e::mul(e::v(it), e::i(4096)), e::v(sub)))],
                },
            ]
        });
        assert!(indices_fit_i32(&k));
        // The same with a loop end past i32.
        let k = kernel(1000, |va, it| {
            let c = va.new_var(Ty::I64);
            vec![Stmt::For {
                var: c,
                start: e::i(0),
                end: e::i(1 << 32),
                body: vec![store(e::add(e::v(it), e::v(c)))],
            }]
        });
        assert!(!indices_fit_i32(&k));
    }
}
