//! The one traversal of the kernel IR's statements. Each statement kind states here, once, the
//! variables it defines, the expressions it evaluates itself, and its nested blocks (with the value
//! a group evaluates after its block, per sub-item); the passes that only traverse (collecting
//! definitions, substituting conversions, checks) go through [`Stmt::parts`] / [`Stmt::parts_mut`]
//! and [`walk`], so a new statement kind touches this file and the backends that lower it, not every
//! walker.

use crate::kir::{Expr, GroupRow, Stmt, Var};

/// What a statement is made of (shared borrows).
#[derive(Debug)]
pub struct Parts<'a> {
    /// Variables it defines itself (not those of nested blocks).
    pub defs: Vec<Var>,
    /// Expressions it evaluates itself, in evaluation order.
    pub exprs: Vec<&'a Expr>,
    /// Nested blocks in order, each with the value evaluated after it (per sub-item), if any.
    pub blocks: Vec<(&'a [Stmt], Option<&'a Expr>)>,
}

/// What a statement is made of (exclusive borrows, for rewriting passes).
#[derive(Debug)]
pub struct PartsMut<'a> {
    /// Expressions it evaluates itself, in evaluation order.
    pub exprs: Vec<&'a mut Expr>,
    /// Nested blocks in order, each with the value evaluated after it (per sub-item), if any.
    pub blocks: Vec<(&'a mut Vec<Stmt>, Option<&'a mut Expr>)>,
}

impl Stmt {
    /// The statement's definitions, expressions and nested blocks.
    pub fn parts(&self) -> Parts<'_> {
        match self {
            Stmt::Set(v, x) => Parts {
                defs: vec![*v],
                exprs: vec![x],
                blocks: vec![],
            },
            Stmt::For {
                var,
                start,
                end,
                body,
            } => Parts {
                defs: vec![*var],
                exprs: vec![start, end],
                blocks: vec![(body, None)],
            },
            Stmt::If { cond, then } => Parts {
                defs: vec![],
                exprs: vec![cond],
                blocks: vec![(then, None)],
            },
            Stmt::Store { index, value, .. } | Stmt::AtomicMaxF32 { index, value, .. } => Parts {
                defs: vec![],
                exprs: vec![index, value],
                blocks: vec![],
            },
            Stmt::LoadPacked { index, dst, .. } => Parts {
                defs: dst.clone(),
                exprs: vec![index],
                blocks: vec![],
            },
            Stmt::StorePacked { index, values, .. } => Parts {
                defs: vec![],
                exprs: std::iter::once(index).chain(values).collect(),
                blocks: vec![],
            },
            Stmt::GroupMax {
                var,
                sub,
                count,
                body,
                value,
            } => Parts {
                defs: vec![*var, *sub],
                exprs: vec![count],
                blocks: vec![(body, Some(value))],
            },
            Stmt::GroupRow(GroupRow {
                var,
                sub,
                count,
                load,
                value,
                mid,
                body,
            }) => Parts {
                defs: vec![*var, *sub],
                exprs: vec![count],
                blocks: vec![(load, Some(value)), (mid, None), (body, None)],
            },
            Stmt::GroupFor { var, count, body } => Parts {
                defs: vec![*var],
                exprs: vec![count],
                blocks: vec![(body, None)],
            },
        }
    }

    /// [`Stmt::parts`] for rewriting: the expressions and blocks, mutably.
    pub fn parts_mut(&mut self) -> PartsMut<'_> {
        match self {
            Stmt::Set(_, x) => PartsMut {
                exprs: vec![x],
                blocks: vec![],
            },
            Stmt::For {
                start, end, body, ..
            } => PartsMut {
                exprs: vec![start, end],
                blocks: vec![(body, None)],
            },
            Stmt::If { cond, then } => PartsMut {
                exprs: vec![cond],
                blocks: vec![(then, None)],
            },
            Stmt::Store { index, value, .. } | Stmt::AtomicMaxF32 { index, value, .. } => {
                PartsMut {
                    exprs: vec![index, value],
                    blocks: vec![],
                }
            }
            Stmt::LoadPacked { index, .. } => PartsMut {
                exprs: vec![index],
                blocks: vec![],
            },
            Stmt::StorePacked { index, values, .. } => PartsMut {
                exprs: std::iter::once(index).chain(values.iter_mut()).collect(),
                blocks: vec![],
            },
            Stmt::GroupMax {
                count, body, value, ..
            } => PartsMut {
                exprs: vec![count],
                blocks: vec![(body, Some(value))],
            },
            Stmt::GroupRow(GroupRow {
                count,
                load,
                value,
                mid,
                body,
                ..
            }) => PartsMut {
                exprs: vec![count],
                blocks: vec![(load, Some(value)), (mid, None), (body, None)],
            },
            Stmt::GroupFor { count, body, .. } => PartsMut {
                exprs: vec![count],
                blocks: vec![(body, None)],
            },
        }
    }
}

/// Visit every statement of a body, depth first, each before its nested blocks.
pub fn walk(body: &[Stmt], f: &mut dyn FnMut(&Stmt)) {
    for st in body {
        f(st);
        for (b, _) in st.parts().blocks {
            walk(b, f);
        }
    }
}

/// Every variable a body defines (assignments, loop and group variables, packed-load destinations),
/// each once, in order of first definition.
pub fn defined_vars(body: &[Stmt]) -> Vec<Var> {
    let mut out = Vec::new();
    walk(body, &mut |st| {
        for v in st.parts().defs {
            if !out.contains(&v) {
                out.push(v);
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{e, BufId};

    #[test]
    fn walk_and_definitions_reach_every_nested_block() {
        let (a, b, c, d) = (Var(0), Var(1), Var(2), Var(3));
        let body = vec![
            Stmt::Set(a, e::i(1)),
            Stmt::For {
                var: b,
                start: e::i(0),
                end: e::i(4),
                body: vec![Stmt::If {
                    cond: e::v(a),
                    then: vec![Stmt::LoadPacked {
                        buf: BufId(0),
                        index: e::v(b),
                        dst: vec![c, d],
                    }],
                }],
            },
            Stmt::Set(a, e::i(2)),
        ];
        assert_eq!(defined_vars(&body), vec![a, b, c, d]);
        let mut n = 0;
        walk(&body, &mut |_| n += 1);
        assert_eq!(n, 5);
        let mut body = body;
        let mut exprs = 0;
        for st in &mut body {
            exprs += st.parts_mut().exprs.len();
        }
        assert_eq!(exprs, 4);
    }
}
