//! Kernel bindings (`kernel NAME(OPERANDS) on TARGETS index W`): what a generated kernel may read
//! and where it may run. The GEMM plan and the GPU layer ask here ([`reading`]) before they use a
//! weight on Hopper; the answer is fail-closed: a target the binding's `on` list does not name is refused, as is a name
//! no binding has. (The pack program is not a binding: it runs on every target a recipe is compiled
//! for.)

use moeforge_dsl::ir::{KernelBinding, Target};
use moeforge_dsl::ModuleInfo;

use crate::{Error, Result};

/// The first binding of a verified module that may be generated for `target` and reads every
/// param named in `reads` (what a generated kernel of that target needs in order to read them);
/// `None` when no binding does.
pub fn reading<'a>(
    info: &'a ModuleInfo,
    target: Target,
    reads: &[&str],
) -> Option<&'a KernelBinding> {
    let m = info.module();
    m.kernels.iter().find(|k| {
        for_target(info, &k.name, target).is_ok()
            && reads.iter().all(|name| {
                k.operands
                    .iter()
                    .any(|(id, _)| m.tensor(*id).is_some_and(|t| t.name == *name))
            })
    })
}

/// [`reading`], or the refusal naming what no binding of `target` reads: "no `on sm_90a` kernel
/// binding reads `a` and `b`" (what the GEMM plan and the GPU layer both say).
pub fn require<'a>(
    info: &'a ModuleInfo,
    target: Target,
    reads: &[&str],
) -> std::result::Result<&'a KernelBinding, String> {
    reading(info, target, reads).ok_or_else(|| {
        format!(
            "no `on {}` kernel binding reads {}",
            target.name(),
            reads
                .iter()
                .map(|r| format!("`{r}`"))
                .collect::<Vec<_>>()
                .join(" and ")
        )
    })
}

/// The binding `name` of a verified module, if it may be generated for `target`.
pub fn for_target<'a>(
    info: &'a ModuleInfo,
    name: &str,
    target: Target,
) -> Result<&'a KernelBinding> {
    let m = info.module();
    let Some(k) = m.kernels.iter().find(|k| k.name == name) else {
        return Err(Error::Target(format!(
            "recipe `{}` has no kernel binding `{name}`",
            m.name
        )));
    };
    if !k.targets.contains(&target) {
        let on: Vec<&str> = k.targets.iter().map(|t| t.name()).collect();
        return Err(Error::Target(format!(
            "kernel `{name}` is bound `on {}`, not `{}`: refusing to generate it there",
            on.join(", "),
            target.name()
        )));
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_outside_the_on_list_are_refused() {
        let src = "recipe r(E: experts, H) where H % 16 == 0 {\n  input w : bf16[E, H]\n  param p : bf16[E, H] = w\n  kernel k(p) on sm_100a index i32\n}\n";
        let Ok(info) = moeforge_dsl::check(src, None) else {
            panic!("recipe checks")
        };
        assert!(for_target(&info, "k", Target::Sm100a).is_ok());
        for t in [Target::Sm90a, Target::Host] {
            let Err(e) = for_target(&info, "k", t) else {
                panic!("{} accepted", t.name())
            };
            assert!(e.to_string().contains("bound `on sm_100a`"), "{e}");
        }
        assert!(for_target(&info, "nope", Target::Sm100a).is_err());
    }
}
