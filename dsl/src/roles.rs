//! What each param holds, asked once: which quantization's values, scales, global or decode scale
//! (through which row gather, padded or not), or which input it copies. The pack planner, the
//! dequantization check and the GEMM generator all read a recipe's roles through this module, so
//! that none of them repeats the search.

use crate::ir::{IndexVec, Module, Op, QuantField, QuantScheme, TensorId, TensorKind, ValueId};
use crate::verify::ModuleInfo;

/// One param holding an output of a quantization (or a copy of an input).
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The param.
    pub param: TensorId,
    /// The row gather between the output and the param (`x[:, rows, :]`), if any.
    pub rows: Option<IndexVec>,
    /// Whether the param pads the output (`swizzle_128x4`, `pad`): its shape is larger, the rest
    /// zero.
    pub padded: bool,
}

/// One quantization and the params holding its outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantization {
    /// The quantization node.
    pub node: ValueId,
    /// Its scheme.
    pub scheme: QuantScheme,
    /// The value quantized, after any row gather (`quant ...(x[:, rows, :])`).
    pub input: ValueId,
    /// The checkpoint input that value is, when it is one.
    pub input_tensor: Option<TensorId>,
    /// The row gather before the quantization, if any.
    pub rows_in: Option<IndexVec>,
    /// The param holding the codes.
    pub values: Option<Output>,
    /// The param holding the block / row / tensor scales.
    pub scales: Option<Output>,
    /// The param holding NVFP4's encode scale.
    pub global_scale: Option<Output>,
    /// The param holding NVFP4's decode scale.
    pub decode_scale: Option<Output>,
    /// The param holding group-wise INT4's u4 zero points (asymmetric).
    pub zeros: Option<Output>,
}

impl Quantization {
    /// The output slot of a field.
    fn slot(&mut self, f: QuantField) -> &mut Option<Output> {
        match f {
            QuantField::Values => &mut self.values,
            QuantField::Scales => &mut self.scales,
            QuantField::GlobalScale => &mut self.global_scale,
            QuantField::DecodeScale => &mut self.decode_scale,
            QuantField::Zeros => &mut self.zeros,
        }
    }

    /// Every param holding one of its outputs.
    pub fn params(&self) -> impl Iterator<Item = TensorId> + '_ {
        [
            &self.values,
            &self.scales,
            &self.global_scale,
            &self.decode_scale,
            &self.zeros,
        ]
        .into_iter()
        .flatten()
        .map(|o| o.param)
    }
}

/// What a param's definition is, seen through padding and a row gather.
#[derive(Debug, Clone, PartialEq)]
pub enum Role {
    /// An output of a quantization node.
    Quantized {
        /// The quantization node.
        node: ValueId,
        /// Which output.
        field: QuantField,
        /// How the param holds it.
        output: Output,
    },
    /// A copy of a checkpoint input.
    Copy {
        /// The input.
        input: TensorId,
        /// How the param holds it.
        output: Output,
    },
    /// Anything else (per-expert arithmetic, broadcasts).
    Computed,
}

/// A value without its padding (`swizzle_128x4`, `pad`), and whether it had any: what a param's
/// passes write before its storage map places and pads it.
pub fn unpadded(m: &Module, v: ValueId) -> (ValueId, bool) {
    match m.value(v).map(|x| &x.op) {
        Some(Op::Swizzle128x4 { base } | Op::Pad { base, .. }) => (*base, true),
        _ => (v, false),
    }
}

/// Strip padding and then one row gather off a value: the value, whether it was padded, the gather.
pub fn peel(m: &Module, v: ValueId) -> (ValueId, bool, Option<IndexVec>) {
    let (v, padded) = unpadded(m, v);
    match m.value(v).map(|x| &x.op) {
        Some(Op::Gather {
            base,
            index,
            dim: 1,
        }) => (*base, padded, Some(index.clone())),
        _ => (v, padded, None),
    }
}

impl ModuleInfo {
    /// The role of a param's definition.
    pub fn role(&self, param: TensorId) -> Role {
        let m = self.module();
        let Some(v) = m.tensor(param).and_then(|t| t.value) else {
            return Role::Computed;
        };
        let (v, padded, rows) = peel(m, v);
        let output = Output {
            param,
            rows,
            padded,
        };
        match m.value(v).map(|x| &x.op) {
            Some(Op::Field { quant, field }) => Role::Quantized {
                node: *quant,
                field: *field,
                output,
            },
            Some(Op::Tensor(t))
                if m.tensor(*t)
                    .is_some_and(|x| matches!(x.kind, TensorKind::Input { .. })) =>
            {
                Role::Copy { input: *t, output }
            }
            _ => Role::Computed,
        }
    }

    /// Every quantization some param holds an output of, in the order of the first such param.
    pub fn quantizations(&self) -> Vec<Quantization> {
        let m = self.module();
        let mut out: Vec<Quantization> = Vec::new();
        for (id, t) in m.tensors_with_ids() {
            if t.kind != TensorKind::Param {
                continue;
            }
            let Role::Quantized {
                node,
                field,
                output,
            } = self.role(id)
            else {
                continue;
            };
            let k = match out.iter().position(|q| q.node == node) {
                Some(k) => k,
                None => {
                    let Some(Op::Quant { scheme, input }) = m.value(node).map(|x| &x.op) else {
                        continue;
                    };
                    let (input, _, rows_in) = peel(m, *input);
                    let input_tensor = match m.value(input).map(|x| &x.op) {
                        Some(Op::Tensor(t)) => Some(*t),
                        _ => None,
                    };
                    out.push(Quantization {
                        node,
                        scheme: *scheme,
                        input,
                        input_tensor,
                        rows_in,
                        values: None,
                        scales: None,
                        global_scale: None,
                        decode_scale: None,
                        zeros: None,
                    });
                    out.len() - 1
                }
            };
            let slot = out[k].slot(field);
            if slot.is_none() {
                *slot = Some(output);
            }
        }
        out
    }

    /// The quantization of a checkpoint input, by the input's name.
    pub fn quantization_of(&self, input: &str) -> Option<Quantization> {
        let m = self.module();
        self.quantizations().into_iter().find(|q| {
            q.input_tensor
                .and_then(|t| m.tensor(t))
                .is_some_and(|t| t.name == input)
        })
    }

    /// The param copying a checkpoint input, by the input's name.
    pub fn copy_of(&self, input: &str) -> Option<Output> {
        let m = self.module();
        self.params.iter().find_map(|p| match self.role(p.id) {
            Role::Copy { input: t, output } if m.tensor(t).is_some_and(|t| t.name == input) => {
                Some(output)
            }
            _ => None,
        })
    }
}
