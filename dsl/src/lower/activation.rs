//! Lowering of the `activation` statement: the activation scheme the MoE layer's GEMMs use
//! (SPEC §9), checked against the recipe's params (E0701-E0704).
//!
//! Grammar: `activation bf16`, `activation fp8(MODE [else MODE])` where `MODE` is `per_token`,
//! `per_token_group = 128` or `static(w13 = PARAM, w2 = PARAM)`; a fallback (`else`) must be a
//! dynamic mode and is required exactly when a static scale is optional.

use super::{Binding, Lower};
use crate::ast::{ActMode, ActModeKind, Ident, Span};
use crate::diag::Diagnostic;
use crate::ir::{
    activation_dtype_for_weight, ActDynamic, Activation, DType, Op, TensorId, TensorKind,
    GEMM_WEIGHTS,
};

/// The only activation group size the FP8 block GEMM takes.
const GROUP: i64 = 128;

const MODES_HELP: &str = "help: declare `activation fp8(per_token)`, `activation fp8(per_token_group = 128)` (128x128 block weight scales) or `activation fp8(static(w13 = w13_input_scale, w2 = w2_input_scale) [else per_token])`";

impl Lower<'_> {
    /// `activation SCHEME [(MODE [else MODE])]`: record the declared scheme on the module.
    pub(super) fn activation_stmt(
        &mut self,
        scheme: &Ident,
        mode: Option<&ActMode>,
        fallback: Option<&ActMode>,
        span: Span,
    ) -> Option<()> {
        if let Some((_, first)) = self.m.activation {
            self.err(
                Diagnostic::error("E0102", "the activation scheme is declared twice")
                    .with_label(scheme.span, "declared again here")
                    .with_label(first, "first declared here"),
            );
            return None;
        }
        let act = match scheme.name.as_str() {
            "bf16" => {
                if let Some(m) = mode {
                    self.err(
                        Diagnostic::error("E0105", "`activation bf16` takes no arguments")
                            .with_label(m.span, "bf16 activations are not scaled"),
                    );
                    return None;
                }
                Activation::Bf16
            }
            "fp8" => {
                let Some(mode) = mode else {
                    self.err(
                        Diagnostic::error("E0105", "`activation fp8` needs a scaling mode")
                            .with_label(scheme.span, "say how activations are scaled")
                            .with_note(MODES_HELP),
                    );
                    return None;
                };
                match &mode.kind {
                    ActModeKind::Dynamic { .. } => {
                        let d = self.act_dynamic(mode)?;
                        if let Some(fb) = fallback {
                            self.err(
                                Diagnostic::error(
                                    "E0704",
                                    "`else` has no effect after a dynamic mode",
                                )
                                .with_label(fb.span, "never used")
                                .with_note(
                                    "a fallback replaces static scales that the checkpoint lacks",
                                ),
                            );
                            return None;
                        }
                        Activation::Fp8Dynamic(d)
                    }
                    ActModeKind::Static { scales } => {
                        let (w13, w2) = self.act_static_scales(scales, mode.span)?;
                        let optional: Vec<TensorId> = [w13, w2]
                            .into_iter()
                            .filter(|t| self.m.tensor(*t).is_some_and(|t| t.optional))
                            .collect();
                        let fallback = match (fallback, optional.first()) {
                            (None, None) => None,
                            (None, Some(t)) => {
                                let (name, at) = self
                                    .m
                                    .tensor(*t)
                                    .map(|t| (t.name.clone(), t.name_span))
                                    .unwrap_or_default();
                                self.err(
                                    Diagnostic::error("E0704", format!("static activation scale `{name}` is optional but no fallback is declared"))
                                        .with_label(mode.span, "the GEMM has no scale when the checkpoint lacks it")
                                        .with_label(at, "computed from an optional input")
                                        .with_note("help: add `else per_token` (SPEC §9: activations are then quantized dynamically per token)"),
                                );
                                return None;
                            }
                            (Some(fb), None) => {
                                self.err(
                                    Diagnostic::error("E0704", "`else` has no effect: the static activation scales are always present")
                                        .with_label(fb.span, "never used")
                                        .with_note("a fallback replaces static scales computed from `optional` inputs"),
                                );
                                return None;
                            }
                            (Some(fb), Some(_)) => {
                                if matches!(fb.kind, ActModeKind::Static { .. }) {
                                    self.err(
                                        Diagnostic::error("E0704", "a fallback must be a dynamic mode")
                                            .with_label(fb.span, "static scales cannot replace absent static scales")
                                            .with_note("help: `else per_token` or `else per_token_group = 128`"),
                                    );
                                    return None;
                                }
                                Some(self.act_dynamic(fb)?)
                            }
                        };
                        Activation::Fp8Static { w13, w2, fallback }
                    }
                }
            }
            other => {
                self.err(
                    Diagnostic::error("E0104", format!("unknown activation scheme `{other}`"))
                        .with_label(scheme.span, "expected `bf16` or `fp8`")
                        .with_note("activations are bf16 or E4M3 on Hopper (SPEC §9); weights-only schemes keep them bf16"),
                );
                return None;
            }
        };
        self.m.activation = Some((act, span));
        Some(())
    }

    /// `per_token` or `per_token_group = 128`.
    fn act_dynamic(&mut self, mode: &ActMode) -> Option<ActDynamic> {
        let ActModeKind::Dynamic { name, size } = &mode.kind else {
            return None;
        };
        match (name.name.as_str(), size) {
            ("per_token", None) => Some(ActDynamic::PerToken),
            ("per_token", Some((_, at))) => {
                self.err(
                    Diagnostic::error("E0105", "`per_token` takes no size")
                        .with_label(*at, "one scale per token covers the whole row"),
                );
                None
            }
            ("per_token_group", None) => {
                self.err(
                    Diagnostic::error("E0105", "`per_token_group` needs a group size")
                        .with_label(name.span, "write `per_token_group = 128`"),
                );
                None
            }
            ("per_token_group", Some((g, at))) => {
                if *g == GROUP {
                    return Some(ActDynamic::PerTokenGroup {
                        group: GROUP as u32,
                    });
                }
                let head = if *g <= 0 {
                    format!("activation group size {g} is not positive")
                } else {
                    format!("activation group size {g} is not supported")
                };
                self.err(
                    Diagnostic::error("E0703", head)
                        .with_label(*at, "the only group size is 128")
                        .with_note("the FP8 block GEMM rescales each 128-deep slice of K by `s_x * s_w` (DeepGEMM's promotion, SPEC §9), so one activation group is exactly one 128-column block of the weight scales"),
                );
                None
            }
            ("static", _) => {
                self.err(
                    Diagnostic::error("E0105", "`static` names the scale of each GEMM").with_label(
                        mode.span,
                        "write `static(w13 = w13_input_scale, w2 = w2_input_scale)`",
                    ),
                );
                None
            }
            (other, _) => {
                self.err(
                    Diagnostic::error("E0104", format!("unknown activation mode `{other}`"))
                        .with_label(
                            name.span,
                            "expected `per_token`, `per_token_group` or `static`",
                        )
                        .with_note(MODES_HELP),
                );
                None
            }
        }
    }

    /// `static(w13 = PARAM, w2 = PARAM)`: each GEMM's scale, a registered f32 `[E]` param that
    /// is one value for all experts.
    fn act_static_scales(
        &mut self,
        scales: &[(Ident, Ident)],
        span: Span,
    ) -> Option<(TensorId, TensorId)> {
        let mut found: [Option<(TensorId, Span)>; 2] = [None, None];
        for (gemm, param) in scales {
            let Some(slot) = GEMM_WEIGHTS.iter().position(|(g, _)| *g == gemm.name) else {
                self.err(
                    Diagnostic::error(
                        "E0105",
                        format!("unknown GEMM `{}` in `static(..)`", gemm.name),
                    )
                    .with_label(gemm.span, "expected `w13` or `w2`")
                    .with_note(
                        "the MoE layer has two GEMMs: `w13` reads `x`, `w2` reads `silu(g) * u`",
                    ),
                );
                return None;
            };
            if let Some((_, first)) = found[slot] {
                self.err(
                    Diagnostic::error(
                        "E0102",
                        format!("the static scale of `{}` is given twice", gemm.name),
                    )
                    .with_label(gemm.span, "given again here")
                    .with_label(first, "first given here"),
                );
                return None;
            }
            let t = self.act_scale_param(param)?;
            found[slot] = Some((t, gemm.span));
        }
        match found {
            [Some((w13, _)), Some((w2, _))] => Some((w13, w2)),
            [a, _] => {
                let missing = if a.is_none() { "w13" } else { "w2" };
                self.err(
                    Diagnostic::error(
                        "E0105",
                        format!("`static(..)` names no scale for the `{missing}` GEMM"),
                    )
                    .with_label(span, format!("add `{missing} = ...`"))
                    .with_note("both GEMMs take E4M3 inputs, each divided by its own scale"),
                );
                None
            }
        }
    }

    /// One static scale: a registered f32 `[E]` param defined as one value for all experts.
    fn act_scale_param(&mut self, param: &Ident) -> Option<TensorId> {
        let help = format!(
            "help: register it as `param {0} : f32[{1}] = broadcast(reduce_max({0}, group = ep), {1})`",
            param.name,
            self.m.experts_dim().map(|d| d.name.clone()).unwrap_or_default()
        );
        let t = match self.lookup(&param.name, param.span)? {
            Binding::Tensor(t) => t,
            _ => {
                self.err(
                    Diagnostic::error(
                        "E0702",
                        format!("static activation scale `{}` is not a tensor", param.name),
                    )
                    .with_label(param.span, "expected a registered f32 param")
                    .with_note(help),
                );
                return None;
            }
        };
        let tensor = self.m.tensor(t)?.clone();
        let what = match tensor.kind {
            TensorKind::Param => None,
            TensorKind::Input { .. } => Some("an input"),
            TensorKind::View { .. } => Some("a view"),
            TensorKind::Let => Some("a `let` value"),
        };
        if let Some(what) = what {
            self.err(
                Diagnostic::error("E0702", format!("static activation scale `{}` is {what}, not a registered param", param.name))
                    .with_label(param.span, "the GEMM reads its scale from a param")
                    .with_label(tensor.name_span, "defined here")
                    .with_note("a value the GEMMs read must be a `param` so that EPLB moves it with its expert")
                    .with_note(help),
            );
            return None;
        }
        let experts = self.m.experts_dim().map(|d| d.poly.clone());
        let shape_ok = tensor.shape.len() == 1 && tensor.shape.first() == experts.as_ref();
        if tensor.dtype != DType::F32 || !shape_ok {
            self.err(
                Diagnostic::error(
                    "E0702",
                    format!(
                        "static activation scale `{}` must be f32[{}], it is {}{}",
                        param.name,
                        self.m
                            .experts_dim()
                            .map(|d| d.name.clone())
                            .unwrap_or_default(),
                        tensor.dtype,
                        self.m.show_shape(&tensor.shape)
                    ),
                )
                .with_label(param.span, "one f32 scale, registered per expert")
                .with_label(tensor.name_span, "defined here"),
            );
            return None;
        }
        let uniform = tensor
            .value
            .and_then(|v| self.m.value(v))
            .is_some_and(|v| matches!(v.op, Op::Broadcast { .. }));
        if !uniform {
            self.err(
                Diagnostic::error(
                    "E0702",
                    format!(
                        "static activation scale `{}` is not one value for all experts",
                        param.name
                    ),
                )
                .with_label(
                    param.span,
                    "the GEMM divides every token's row by one scale",
                )
                .with_label(tensor.name_span, "defined here, not as a `broadcast`")
                .with_note(help),
            );
            return None;
        }
        Some(t)
    }

    /// Each GEMM's weight (`w13_weight`, `w2_weight`, where registered) against the declared
    /// activations (bf16 when none is declared): e4m3 x e4m3 or bf16 x bf16 (E0701).
    pub(super) fn check_activation_operands(&mut self) {
        let act = self.m.activation();
        let declared = self.m.activation_span();
        for (gemm, name) in GEMM_WEIGHTS {
            let Some(w) = self
                .m
                .find(name)
                .and_then(|t| self.m.tensor(t))
                .filter(|t| t.kind == TensorKind::Param)
            else {
                continue;
            };
            let need = activation_dtype_for_weight(w.dtype);
            if need == act.dtype() {
                continue;
            }
            let (wdt, wspan) = (w.dtype, w.name_span);
            let operands = "Hopper's tensor cores multiply e4m3 x e4m3 or bf16 x bf16: e4m3 weights take e4m3 activations, every other weight dtype bf16 (weights-only schemes are dequantized to bf16, SPEC §9)";
            let d = match declared {
                Some(at) => Diagnostic::error(
                    "E0701",
                    format!(
                        "the `{gemm}` GEMM would multiply {} activations by {wdt} weights",
                        act.dtype()
                    ),
                )
                .with_label(at, format!("declares {} activations", act.dtype()))
                .with_label(wspan, format!("`{name}` is {wdt}"))
                .with_note(operands)
                .with_note(if need == DType::E4m3 {
                    MODES_HELP.to_string()
                } else {
                    "help: declare `activation bf16`".to_string()
                }),
                None => Diagnostic::error(
                    "E0701",
                    format!("`{name}` is {wdt} but the recipe declares no activation scheme (bf16 by default)"),
                )
                .with_label(wspan, format!("{wdt} weights need {need} activations"))
                .with_note(operands)
                .with_note(MODES_HELP),
            };
            self.err(d);
        }
    }
}
