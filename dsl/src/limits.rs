//! The front end's resource limits: how large, how long and how deep a recipe may be.
//!
//! Hostile or generated input must get a diagnostic, never a stack overflow or an unbounded
//! amount of work. The parser refuses a source larger than [`MAX_SOURCE_BYTES`] (E0004), nesting
//! deeper than [`MAX_DEPTH`] (E0002) and a chain longer than [`MAX_CHAIN`] (E0003); it parses
//! chains (`a + b + c`, `x[..][..]`) in loops into flat syntax nodes, so the depth of the syntax
//! tree is bounded by the nesting depth and every later recursion over it is bounded too. Lowering
//! applies the same depth limit where definitions nest *through names* (a `let` reading a `let`,
//! `interleave` of an `interleave`, `ceil_div` of a `ceil_div`), which the parser cannot see, and
//! bounds what a value stands for once its `let`s are substituted ([`MAX_EXPANDED`]).

/// Largest recipe source, in bytes (1 MiB): E0004 beyond.
pub const MAX_SOURCE_BYTES: usize = 1 << 20;

/// Deepest nesting, in levels (E0002): parentheses, calls and `quant`, unary `-`, `[...]`,
/// layout tuples; in the IR, operations on operations counting through the `let`s they read,
/// `interleave`s of `interleave`s and `ceil_div`s of `ceil_div`s.
pub const MAX_DEPTH: usize = 128;

/// Longest chain (E0003): operands of one `+ -` or `* / %` chain, suffixes (`.f`, `[...]`,
/// `@ L`) after one operand.
pub const MAX_CHAIN: usize = 4096;

/// Most operations one value may stand for once the `let`s it reads are substituted (E0003): the
/// code generator inlines `let`s, so `let a = x * x`, `let b = a * a`, ... would double each time.
pub const MAX_EXPANDED: u64 = 1 << 16;

/// Most atom occurrences a `ceil_div` size may be written with (E0003): a `ceil_div` atom is printed
/// with its numerator, which may hold earlier `ceil_div`s.
pub const MAX_WRITTEN: u64 = 4096;

/// Lowering stops after this many errors (later statements are not checked), so that a large
/// source full of mistakes is answered quickly.
pub const MAX_ERRORS: usize = 100;
