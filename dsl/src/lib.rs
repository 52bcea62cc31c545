//! moeforge's recipe language: a nom parser with spans, a typed IR in arenas, CuTe's layout algebra
//! over integers and over symbolic polynomials, and the verifier that proves a recipe's promises
//! before any code is generated.
//!
//! The pipeline is `parse -> lower -> verify`; [`check`] runs all three.

pub mod ast;
pub mod diag;
pub mod ir;
pub mod layout;
pub mod limits;
pub mod lower;
pub mod parse;
pub mod poly;
pub mod roles;
pub mod spec;
pub mod verify;

pub use diag::Diagnostic;
pub use ir::Module;
pub use verify::{Binding, ModuleInfo, Proof};

/// Parse and lower a recipe (names, dtypes, shapes, divisibility, promise 3).
pub fn compile(src: &str) -> Result<Module, Vec<Diagnostic>> {
    let ast = parse::parse(src).map_err(|d| vec![d])?;
    lower::lower(&ast, src)
}

/// Parse, lower, bind (when `bind` is given) and verify a recipe.
pub fn check(src: &str, bind: Option<&[(String, i64)]>) -> Result<ModuleInfo, Vec<Diagnostic>> {
    let m = compile(src)?;
    let b = match bind {
        Some(v) => Some(m.bind(v)?),
        None => None,
    };
    verify::verify(m, b)
}
