//! How the GPU layer's grouped GEMMs read a recipe's weight param (issue \[8\] item 2): in place,
//! through a TMA map of the param's own storage ([`codegen::gemm::wmap`](crate::codegen::gemm::wmap)),
//! or from a copy re-laid on the host, with the reason.
//!
//! The row offsets come from the verified module alone: the param's storage map at the binding
//! (`ModuleInfo::params[..].layout`, the map the pack kernels write through) and the row gather
//! between the input and the param (`ModuleInfo::role`), inverted so that the GEMM's row `q` (the
//! input's `[gate; up]` row, or the fused epilogue's paired order) names the param row holding
//! it. Nothing here reads a recipe's name.

use crate::codegen::addr::StorageMap;
use crate::codegen::gemm::desc::strides_nest;
use crate::codegen::gemm::wmap::{self, WLayout};
use crate::codegen::gemm::ws::paired_row;
use crate::codegen::gemm::ws::{WRows, WsConfig};
use crate::dsl::ModuleInfo;

/// Where a GEMM's weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Access {
    /// The param's bytes, through `layout`.
    InPlace {
        /// The param.
        param: String,
        /// Its map.
        layout: WLayout,
    },
    /// A copy re-laid on the host, and why the param's own storage is not read.
    Relaid {
        /// Why.
        why: String,
    },
}

impl Access {
    /// One line for `check` and the layer's report.
    pub fn describe(&self) -> String {
        match self {
            Access::InPlace { param, layout } => {
                let inner = usize::from(layout.rows.modes.clamp(1, 4)) - 1;
                let modes: Vec<String> = layout.rows.inner[..inner]
                    .iter()
                    .map(u32::to_string)
                    .collect();
                format!(
                    "`{param}` in place, a rank-{} TMA map{}{}",
                    layout.rows.rank(),
                    if modes.is_empty() {
                        String::new()
                    } else {
                        format!(" (row modes {} then the rest)", modes.join(" x "))
                    },
                    if layout.rows.up_first {
                        ", up rows first"
                    } else {
                        ""
                    }
                )
            }
            Access::Relaid { why } => format!("a copy re-laid on the host: {why}"),
        }
    }
}

/// `cands` compiled for weight row modes `rows`: those whose weight tile is a box of the modes
/// (all of them for [`WRows::PLAIN`]); `None` where none is, and the GEMM must then read a
/// re-laid copy through the plain map instead (a tile of 64, 128 or 256 rows that is no box of
/// modes such as 24 x 4 x 2). The layer and `compile --kernels gemm` both decide with it.
pub fn for_rows(cands: Vec<WsConfig>, rows: WRows) -> Option<Vec<WsConfig>> {
    let v: Vec<WsConfig> = cands
        .into_iter()
        .map(|c| WsConfig { w_rows: rows, ..c })
        .filter(|c| rows == WRows::PLAIN || rows.check(c.n, c.tile_weights()).is_ok())
        .collect();
    (!v.is_empty()).then_some(v)
}

/// The row modes a GEMM reading `access` in place compiles for: its paired-order map (`paired`,
/// the fused epilogue) or its input-order one; [`WRows::PLAIN`] where it reads a re-laid copy.
pub fn rows_read(access: &WeightAccess, paired: bool) -> WRows {
    let a = if paired {
        access.paired.as_ref()
    } else {
        Some(&access.plain)
    };
    match a {
        Some(Access::InPlace { layout, .. }) => layout.rows,
        _ => WRows::PLAIN,
    }
}

/// The variants a GPU layer loads for a GEMM whose candidates are `cands` (its form's:
/// `moe_gpu_layer::layer_candidates`) and whose weights it reads through `access`
/// (`paired` for the fused epilogue): compiled for the in-place row modes where some tile is a box
/// of them, else the plain candidates (the layer then reads the re-laid copy). What the layer,
/// `cache warmup` and `compile --kernels gemm` agree on.
pub fn layer_variants(
    cands: Vec<WsConfig>,
    access: Option<&WeightAccess>,
    paired: bool,
) -> Vec<WsConfig> {
    let rows = access.map_or(WRows::PLAIN, |a| rows_read(a, paired));
    match for_rows(cands.clone(), rows) {
        Some(v) => v,
        None => cands,
    }
}

/// The two ways a first GEMM can read its weights, and the one way of a second.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightAccess {
    /// Rows in the input's order (the plain GEMM).
    pub plain: Access,
    /// Rows in the fused SiLU epilogue's paired order (`None` where the rows cannot pair: an odd
    /// half or N not a multiple of 16).
    pub paired: Option<Access>,
}

/// The params holding input `name`'s values (or its copy): its id and row gather.
fn values_of(
    info: &ModuleInfo,
    name: &str,
) -> Option<(crate::dsl::ir::TensorId, Option<crate::dsl::ir::IndexVec>)> {
    match info.quantization_of(name) {
        Some(q) => {
            // (The gather after the quantization, or the one before it: the dequantizer's rule.)
            let v = q.values?;
            Some((v.param, v.rows.or(q.rows_in)))
        }
        None => {
            let c = info.copy_of(name)?;
            Some((c.param, c.rows))
        }
    }
}

/// A weight param's `[slots, N, K]` at the module's binding.
fn dims_of(info: &ModuleInfo, t: &crate::dsl::ir::Tensor) -> Option<(usize, usize, usize)> {
    let dims: Vec<usize> = t
        .shape
        .iter()
        .map(|d| info.eval(d).and_then(|x| usize::try_from(x).ok()))
        .collect::<Option<_>>()?;
    match dims[..] {
        [slots, n, k] => Some((slots, n, k)),
        _ => None,
    }
}

/// How the grouped GEMMs of the GPU layer read the weights of input `gemm` (`w13` or `w2`) at the
/// module's binding, and the param holding them, through [`weight_access`]: bf16 and E4M3 codes
/// contiguous along K, int8 codes in the W8A16 GEMM's own order ([`KOrder`]); 4-bit codes always
/// from a copy in the kernel's order. `None` without a binding or a param holding the input's
/// values.
pub fn of_gemm(info: &ModuleInfo, gemm: &str) -> Option<(String, WeightAccess)> {
    use crate::dsl::ir::DType;
    let (id, _) = values_of(info, gemm)?;
    let t = info.module().tensor(id)?;
    let (slots, n, k) = dims_of(info, t)?;
    let (elem, order) = match t.dtype {
        DType::Bf16 => (2, KOrder::Contiguous),
        DType::E4m3 => (1, KOrder::Contiguous),
        DType::I8 => (1, KOrder::Int8Kernel),
        d => {
            let why = format!(
                "{d} codes are read in the kernel's own order (dequantized into register fragments)"
            );
            return Some((
                t.name.clone(),
                WeightAccess {
                    plain: Access::Relaid { why: why.clone() },
                    paired: Some(Access::Relaid { why }),
                },
            ));
        }
    };
    Some((
        t.name.clone(),
        weight_access(info, gemm, (slots, n, k), (elem, order)),
    ))
}

/// How a GPU GEMM gets its weight scales.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScaleRead {
    /// The scale param's bytes as stored: they are the GEMM's scale vector element for element.
    AsStored {
        /// The param.
        param: String,
    },
    /// A vector made on the host in the GEMM's order, and why the param's own bytes are not it.
    Copied {
        /// Why.
        why: String,
    },
}

impl ScaleRead {
    /// One line for `check`.
    pub fn describe(&self) -> String {
        match self {
            ScaleRead::AsStored { param } => format!("`{param}` as stored"),
            ScaleRead::Copied { why } => format!("a vector made on the host: {why}"),
        }
    }
}

/// How the GPU GEMM of input `gemm` reads its weight scales at the module's binding, with its
/// rows in the input's order or in the fused epilogue's paired order (`paired`: gate rows first,
/// or up rows first where the GEMM reads the weights in place that way, as the layer does): as the scale param stores them where every scale the GEMM reads sits at its own index
/// of the GEMM's layout (per tensor `[slots]`, per channel and per row `[slots, N]` in the GEMM's
/// row order, 128x128 blocks `[slots, N / 128, K / 128]`), checked scale by scale through the
/// param's storage map and the row gather; else a vector made on the host, and why. `None`
/// without a binding or weight scales.
pub fn scales_read(info: &ModuleInfo, gemm: &str, paired: bool) -> Option<ScaleRead> {
    use crate::codegen::gemm::ws::Scaling;
    use crate::dsl::ir::{Fp8Granularity as G, QuantScheme as Q};
    let sm = crate::dequant::scale_map(info, gemm)?;
    let (id, rows) = values_of(info, gemm)?;
    let (slots, n, k) = dims_of(info, info.module().tensor(id)?)?;
    let copied = |why: &str| Some(ScaleRead::Copied { why: why.into() });
    // The param row holding GEMM row `q` (the inverse of the gather).
    let atoms = info.binding()?.atoms().to_vec();
    let holder = match holders(rows.as_ref(), &atoms, n) {
        Ok(h) => h,
        Err(why) => return copied(&why),
    };
    // The paired order as the layer takes it: up rows first where the GEMM reads the param in
    // place that way (`moe_gpu_layer` uploads the scales in the same order).
    let up_first = paired
        && of_gemm(info, gemm).is_some_and(|(_, a)| {
            matches!(a.paired, Some(Access::InPlace { ref layout, .. }) if layout.rows.up_first)
        });
    let order = |q: usize| {
        if paired {
            paired_row(q, n / 2, up_first)
        } else {
            q
        }
    };
    // Whether the rows pair for the fused epilogue under `scaling` (the layer's own rule).
    let pairs = |scaling| crate::moe_gpu::pairable(scaling, n);
    // (GEMM index, the element whose scale it is) of every scale the GEMM reads.
    let slots_of: Vec<(usize, (usize, usize, usize))> = match sm.scheme {
        Q::Fp8 {
            granularity: G::Tensor,
            ..
        } => (0..slots).map(|e| (e, (e, 0, 0))).collect(),
        Q::Fp8 {
            granularity: G::Channel,
            ..
        }
        | Q::Int8Row => {
            if paired && !pairs(Scaling::PerRow) {
                return None;
            }
            (0..slots)
                .flat_map(|e| (0..n).map(move |q| (e * n + q, (e, q, 0))))
                .map(|(at, (e, q, c))| (at, (e, holder[order(q)], c)))
                .collect()
        }
        Q::Fp8 {
            granularity: G::Block128,
            ..
        } => {
            if paired && !pairs(Scaling::Block128) {
                return None;
            }
            // (The paired order reads each half's block by its `[gate; up]` row: the same layout.)
            let (nb, kb) = (n.div_ceil(128), k.div_ceil(128));
            (0..slots * nb * kb)
                .map(|at| {
                    let (e, b, c) = (at / (nb * kb), at / kb % nb, at % kb);
                    (at, (e, holder[128 * b], 128 * c))
                })
                .collect()
        }
        _ => {
            return copied(
                "group scales go to the GEMM in its own order (`[slots, groups, N]`, or the 4-bit kernels' tiles)",
            )
        }
    };
    let first = slots_of.iter().find_map(|&(at, (e, r, c))| {
        let off = sm.offset((e as i64, r as i64, c as i64));
        (off != at as i64).then_some((at, off))
    });
    Some(match first {
        None => ScaleRead::AsStored { param: sm.param },
        Some((at, off)) => ScaleRead::Copied {
            why: format!(
                "`{}` holds the GEMM's scale {at}{} at element {off}",
                sm.param,
                if paired {
                    " (rows in the paired order)"
                } else {
                    ""
                }
            ),
        },
    })
}

/// How a weight param's rows hold K.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KOrder {
    /// Contiguous (bf16 and E4M3 codes, TMA boxes of 128 bytes through a descriptor).
    Contiguous,
    /// The W8A16 GEMM's own order of int8 codes (`reference::i8_kernel_place`, rows of a multiple
    /// of 64 bytes): its register-A kernels read a row's k-tile as 64 bytes and take no row modes,
    /// so only storage that is exactly their compact operand (`[slots, N, K]` in the GEMM's row
    /// order) is read in place.
    Int8Kernel,
}

/// Whether `map` holds every row's K in `order` (an element offset along K per index, counted
/// from K index 0; `Err` says how it does not).
fn k_order_of(map: &StorageMap, k: usize, order: KOrder) -> Result<(), String> {
    match order {
        KOrder::Contiguous => {
            let k_ok = map.modes[2]
                .iter()
                .enumerate()
                .all(|(j, &(s, t))| if j == 0 { t == 1 } else { s == 1 });
            if k_ok {
                Ok(())
            } else {
                Err(format!(
                    "is not contiguous along K (its K modes {:?}; a TMA box row is 128 contiguous bytes)",
                    map.modes[2]
                ))
            }
        }
        KOrder::Int8Kernel => {
            let align = crate::codegen::gemm::reference::I8_ROW_ALIGN;
            if !k.is_multiple_of(align) {
                return Err(format!(
                    "holds rows of K = {k} codes, which the int8 GEMM pads to a multiple of {align} bytes"
                ));
            }
            let at0 = map.offset_of(&[0, 0, 0]);
            let first = (0..k).find(|&x| {
                map.offset_of(&[0, 0, x as i64]) - at0
                    != crate::codegen::gemm::reference::i8_kernel_place(x) as i64
            });
            match first {
                None => Ok(()),
                Some(x) => Err(format!(
                    "is not in the int8 GEMM's order along K (K index {x} at element {} of its row, the kernel's order has it at {}; its K modes {:?})",
                    map.offset_of(&[0, 0, x as i64]) - at0,
                    crate::codegen::gemm::reference::i8_kernel_place(x),
                    map.modes[2]
                )),
            }
        }
    }
}

/// How the grouped GEMMs can read the weight param of input `name` (`[slots, n, k]`, `elem`
/// bytes an element, K held in `order`) at the module's binding: from the verified module alone
/// (the layer checks that the param's bytes reach as far as the map).
pub fn weight_access(
    info: &ModuleInfo,
    name: &str,
    (slots, n, k): (usize, usize, usize),
    (elem, k_order): (usize, KOrder),
) -> WeightAccess {
    let relaid = |why: String| WeightAccess {
        plain: Access::Relaid { why: why.clone() },
        paired: Some(Access::Relaid { why }),
    };
    let Some((id, rows)) = values_of(info, name) else {
        return relaid(format!("no param holds `{name}`'s values"));
    };
    let Some(p) = info.params.iter().find(|p| p.id == id) else {
        return relaid(format!("`{name}`'s param is not registered"));
    };
    let pname = info
        .module()
        .tensor(id)
        .map(|t| t.name.clone())
        .unwrap_or_default();
    let Some(b) = info.binding() else {
        return relaid(format!("`{pname}` is not bound"));
    };
    let Ok(map) = StorageMap::of(&p.layout, b) else {
        return relaid(format!("`{pname}`'s layout does not evaluate"));
    };
    let row = (k * elem) as i64;
    match rows_of(
        &map,
        rows.as_ref(),
        b.atoms(),
        (slots, n, k),
        (elem, k_order),
    )
    .and_then(|r| slot_contained(r, (slots, n, row)))
    {
        Err(why) => relaid(format!("`{pname}` {why}")),
        Ok((row_bytes, expert)) => {
            let fit = |order: &dyn Fn(usize) -> usize, up_first: bool| -> Access {
                let base = row_bytes[order(0)];
                let off: Vec<i64> = (0..n).map(|q| row_bytes[order(q)] - base).collect();
                match wmap::fit(&off, expert, slots as u64, up_first) {
                    // Register-A int8: only the compact operand itself (no row modes): row q
                    // at q rows of K bytes (checked here, though the verifier's dense param
                    // layouts imply it; experts one slot apart: `slot_contained`).
                    Ok(layout)
                        if k_order == KOrder::Int8Kernel
                            && (base != 0
                                || layout.rows != WRows::PLAIN
                                || off.iter().enumerate().any(|(q, &o)| o != q as i64 * row)) =>
                    {
                        Access::Relaid {
                            why: format!(
                                "`{pname}` holds its rows in another order than the GEMM's (row modes {:?}, byte strides {:?}), and the register-A int8 GEMM reads no row modes",
                                layout.extents, layout.strides
                            ),
                        }
                    }
                    Ok(_) if k_order == KOrder::Int8Kernel => Access::InPlace {
                        param: pname.clone(),
                        layout: WLayout::compact(slots as u64, n as u64, row as u64),
                    },
                    Ok(layout)
                        if strides_nest(row as u64, &layout.extents, &layout.strides).is_err() =>
                    {
                        Access::Relaid {
                            why: format!(
                                "`{pname}`'s row modes {:?} (byte strides {:?}) overlap as a TMA map sees them (a stride below the span of the modes inside it)",
                                layout.extents, layout.strides
                            ),
                        }
                    }
                    Ok(mut layout) if base >= 0 && base % 16 == 0 => {
                        layout.base = base as u64;
                        Access::InPlace {
                            param: pname.clone(),
                            layout,
                        }
                    }
                    Ok(_) => Access::Relaid {
                        why: format!(
                            "`{pname}`'s first row starts at byte {base}, not on 16 bytes"
                        ),
                    },
                    Err(why) => Access::Relaid {
                        why: format!("`{pname}`: {why}"),
                    },
                }
            };
            let plain = fit(&|q| q, false);
            let paired = (n.is_multiple_of(16)).then(|| {
                let half = n / 2;
                let gate_first = fit(&|q| paired_row(q, half, false), false);
                match gate_first {
                    Access::InPlace { .. } => gate_first,
                    Access::Relaid { .. } => {
                        // Up rows first: row q of each 16 swaps halves.
                        let up = fit(&|q| paired_row(q, half, true), true);
                        match up {
                            Access::InPlace { .. } => up,
                            Access::Relaid { .. } => gate_first,
                        }
                    }
                }
            });
            WeightAccess { plain, paired }
        }
    }
}

/// `rows` (from [`rows_of`]) where every expert's rows stay inside its own slot of the storage
/// (`n` rows of `row` bytes: slot `e` is bytes `[e n row, (e + 1) n row)`), else why not. EPLB
/// moves a GEMM operand's slots as whole equal chunks (`runtime::slot_moves`), so a storage that
/// interleaves experts (expert stride below a slot) or spreads one past its slot is read from a
/// copy, which moves correctly.
fn slot_contained(
    (row_bytes, stride): (Vec<i64>, i64),
    (slots, n, row): (usize, usize, i64),
) -> Result<(Vec<i64>, i64), String> {
    let slot = n as i64 * row;
    if slots > 1 && stride != slot {
        return Err(format!(
            "places its experts {stride} bytes apart, not one slot of {slot} bytes (EPLB moves whole slots)"
        ));
    }
    let lo = row_bytes.iter().copied().min().unwrap_or(0);
    let hi = row_bytes.iter().copied().max().unwrap_or(0) + row;
    if lo < 0 || hi > slot {
        return Err(format!(
            "spreads an expert's rows over bytes [{lo}, {hi}), past its slot of {slot} bytes (EPLB moves whole slots)"
        ));
    }
    Ok((row_bytes, stride))
}

/// Per input row of expert 0, the byte offset of the param row holding it (K index 0), and the
/// bytes between experts; or why the storage is not a K-major row map.
/// The param row holding each of the `n` input rows (the inverse of the gather `rows`; every row
/// its own where there is none); an error where the gather is no permutation.
fn holders(
    rows: Option<&crate::dsl::ir::IndexVec>,
    atoms: &[i128],
    n: usize,
) -> Result<Vec<usize>, String> {
    let mut holder = vec![usize::MAX; n];
    for r in 0..n {
        let src = match rows {
            Some(iv) => iv
                .map(r as i128, atoms)
                .and_then(|x| usize::try_from(x).ok()),
            None => Some(r),
        };
        match src {
            Some(s) if s < n && holder[s] == usize::MAX => holder[s] = r,
            _ => return Err("holds its rows through a gather that is no permutation".into()),
        }
    }
    Ok(holder)
}

fn rows_of(
    map: &StorageMap,
    rows: Option<&crate::dsl::ir::IndexVec>,
    atoms: &[i128],
    (slots, n, k): (usize, usize, usize),
    (elem, order): (usize, KOrder),
) -> Result<(Vec<i64>, i64), String> {
    if map.swizzle.is_some() {
        return Err("is stored swizzled (TMA reads rows of plain storage)".into());
    }
    if map.shape() != [slots as i64, n as i64, k as i64] {
        return Err(format!(
            "has shape {:?}, not the GEMM's [{slots}, {n}, {k}]",
            map.shape()
        ));
    }
    k_order_of(map, k, order)?;
    let holder = holders(rows, atoms, n)?;
    let e = elem as i64;
    let at = |ei: usize, r: usize| map.offset_of(&[ei as i64, r as i64, 0]) * e;
    let row_bytes: Vec<i64> = holder.iter().map(|&r| at(0, r)).collect();
    let stride = if slots > 1 { at(1, 0) - at(0, 0) } else { 0 };
    if (1..slots).any(|ei| at(ei, 0) - at(0, 0) != ei as i64 * stride) {
        return Err("does not place its experts at one stride".into());
    }
    Ok((row_bytes, stride))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::gemm::tune;
    use crate::codegen::gemm::ws::{Operands, Scaling};

    #[test]
    fn only_experts_inside_their_slots_are_read_in_place() {
        // 4 rows of 256 bytes, experts one slot (1024 bytes) apart: in place.
        let rows: Vec<i64> = (0..4).map(|r| r * 256).collect();
        assert!(slot_contained((rows.clone(), 1024), (3, 4, 256)).is_ok());
        // Experts interleaved (256 bytes apart): EPLB's whole-slot moves would move other rows.
        let e = slot_contained((rows.clone(), 256), (3, 4, 256)).unwrap_err();
        assert!(e.contains("256 bytes apart") && e.contains("EPLB"), "{e}");
        // A row past the slot (a base offset into the next one).
        let shifted: Vec<i64> = rows.iter().map(|r| r + 16).collect();
        let e = slot_contained((shifted, 1024), (3, 4, 256)).unwrap_err();
        assert!(e.contains("[16, 1040)"), "{e}");
        // One expert: its stride never steps.
        assert!(slot_contained((rows, 0), (1, 4, 256)).is_ok());
    }

    #[test]
    fn int8_rows_in_the_kernels_order_are_recognised_index_by_index() {
        let k = 192usize;
        let map = |kmodes: Vec<(i64, i64)>| StorageMap {
            modes: vec![vec![(2, 4 * k as i64)], vec![(4, k as i64)], kmodes],
            offset: 0,
            swizzle: None,
        };
        let kernel = vec![(2, 2), (4, 16), (2, 1), (4, 4), (3, 64)];
        assert_eq!(k_order_of(&map(kernel), k, KOrder::Int8Kernel), Ok(()));
        // Row-major K (the standard int8 recipe): K index 1 sits at element 1, not 2.
        let e = k_order_of(&map(vec![(k as i64, 1)]), k, KOrder::Int8Kernel).unwrap_err();
        assert!(
            e.contains("K index 1 at element 1") && e.contains("at 2"),
            "{e}"
        );
        // Two modes swapped (c and s): the first index that differs is named.
        let swapped = vec![(2, 2), (4, 4), (2, 1), (4, 16), (3, 64)];
        let e = k_order_of(&map(swapped), k, KOrder::Int8Kernel).unwrap_err();
        assert!(e.contains("K index 2 "), "{e}");
        // K not a multiple of 64: the kernel pads its rows, so no param is its operand.
        let e = k_order_of(&map(vec![(100, 1)]), 100, KOrder::Int8Kernel).unwrap_err();
        assert!(e.contains("K = 100") && e.contains("64"), "{e}");
        // Contiguous K for bf16 and E4M3 codes, as before.
        assert_eq!(
            k_order_of(&map(vec![(k as i64, 1)]), k, KOrder::Contiguous),
            Ok(())
        );
        assert!(k_order_of(&map(vec![(k as i64, 2)]), k, KOrder::Contiguous).is_err());
    }

    #[test]
    fn row_modes_no_tile_is_a_box_of_leave_the_plain_map() {
        let cands = tune::candidates(Operands::Bf16, Scaling::None, 192, 256);
        assert!(!cands.is_empty());
        // 24 x 4 x 2: no tile of 64, 128 or 256 rows is a box.
        let odd = WRows {
            modes: 3,
            inner: [24, 4, 0],
            folded: false,
            up_first: false,
        };
        assert_eq!(for_rows(cands.clone(), odd), None);
        // 8 x 2 x 12: tiles of 16 rows and multiples are.
        let by8 = WRows {
            modes: 3,
            inner: [8, 2, 0],
            folded: false,
            up_first: false,
        };
        let v = for_rows(cands.clone(), by8).expect("some tile is a box");
        assert!(v.iter().all(|c| c.w_rows == by8));
        assert_eq!(
            for_rows(cands.clone(), WRows::PLAIN).map(|v| v.len()),
            Some(cands.len())
        );
    }
}
