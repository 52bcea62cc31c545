//! The host reference of the MoE layer forward (SPEC §9), what `moeforge moe run --device host`
//! computes (issue \[9\] item 3).
//!
//! Per token `t` and choice `j < k`, logical expert `e = topk_ids[t, j]` runs on a physical slot
//! ([`Replicas`]: the slot itself without a placement, `log2phy[e, t mod logcnt[e]]` with one).
//! That slot's weights are dequantized by [`crate::dequant::logical_experts`] (the verified
//! module's codes, scales, decode scales and row gather, read back in the input's coordinates),
//! so `w13`'s rows come back in the order the recipe's `input w13` declares, `[gate; up]`, whatever
//! physical order the recipe stores (nvfp4_cutedsl's `[up; gate]` interleave is undone by the
//! gather the verifier records). The GEMM inputs are fed as the recipe's declared activation
//! scheme says ([`Feed`]).
//!
//! Arithmetic (moeforge's choice for the host): every dequantized weight and fed activation is
//! exact in f64 (a code times its scales has few significant bits), the dot products accumulate in
//! f64 in ascending `k` and are rounded once to f32; so `w13_out` is the f64 evaluation rounded to
//! f32 (the GPU accumulates in f32 and stays within SPEC §9's bound of it). `a = silu(g) * u` is
//! evaluated in f64 from the f32 `g`, `u` and rounded to f32, then fed to the second GEMM (rounded
//! to bf16, or quantized to E4M3). `y` is rounded to f32 and the combine is f32,
//! `acc = acc + w_j * y_j` in `j` order from 0, rounded to bf16 once. Every token's result depends
//! only on its own inputs and its experts' weights, so the output is the same bits for any thread
//! count and any placement with the same replica counts.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use crate::codegen::gemm::reference as gr;
use crate::codegen::reference as r;
use crate::dsl::ir::{ActDynamic, ActScale};
use crate::dsl::ModuleInfo;

/// Why the MoE layer cannot run (`moeforge moe run`).
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// An input tensor is absent.
    #[error("moe run: missing input: {file} has no tensor `{name}` (it needs `hidden_states` [T, H] bf16, `topk_ids` [T, k] i32, `topk_weights` [T, k] f32)")]
    MissingInput {
        /// The inputs file.
        file: String,
        /// The tensor.
        name: String,
    },
    /// An input tensor has the wrong dtype.
    #[error("moe run: wrong dtype: input `{name}` is {got}, expected {want}")]
    InputDtype {
        /// The tensor.
        name: String,
        /// The dtype needed.
        want: String,
        /// The dtype found.
        got: String,
    },
    /// An input tensor has the wrong shape.
    #[error("moe run: wrong shape: input `{name}` is {got:?}, expected {want}")]
    InputShape {
        /// The tensor.
        name: String,
        /// The shape needed.
        want: String,
        /// The shape found.
        got: Vec<usize>,
    },
    /// A `topk_ids` entry outside `[0, E)`.
    #[error("moe run: expert id out of range: topk_ids[{token}, {j}] = {id}, outside [0, {experts}) (the layer's logical experts)")]
    ExpertOutOfRange {
        /// The token.
        token: usize,
        /// The choice.
        j: usize,
        /// The id found.
        id: i64,
        /// The logical expert count.
        experts: usize,
    },
    /// The MoE layer to run is not in the packed file, or not named where it must be.
    #[error("moe run: layer: {0}")]
    Layer(String),
    /// The placement's logical-to-physical map is not usable.
    #[error("moe run: placement: {0}")]
    Placement(String),
    /// A static activation scale that is not a positive finite number.
    #[error("moe run: bad activation scale: `{param}` of slot {slot} is {value}; a static scale must be positive and finite")]
    ActivationScale {
        /// The param.
        param: String,
        /// The slot.
        slot: usize,
        /// Its value.
        value: f32,
    },
    /// The recipe has a form the host forward does not read.
    #[error("moe run: unsupported recipe `{recipe}`: {why}")]
    Unsupported {
        /// The recipe.
        recipe: String,
        /// What is not read.
        why: String,
    },
}

type Result<T, E = MoeError> = std::result::Result<T, E>;

/// How one GEMM takes its input (SPEC §9), from the recipe's declared activation scheme.
#[derive(Debug, Clone, PartialEq)]
pub enum Feed {
    /// bf16 (the activation rounded to bf16; `x` is bf16 already).
    Bf16,
    /// E4M3, one dynamic scale per token (`s_t = max(amax_t / 448, 1/(448*512))`).
    PerToken,
    /// E4M3, one dynamic scale per token per 128 columns (`s = max(amax, 1e-4) / 448`).
    PerTokenGroup128,
    /// E4M3 divided by a registered static scale: the param's name and its value per slot.
    Static {
        /// The param holding the scale.
        param: String,
        /// Its values, one per slot.
        values: Vec<f32>,
    },
}

impl Feed {
    /// The feed of GEMM `gemm` (`w13` or `w2`): the declared scheme, a static scale where the
    /// packed params hold it, else the declared fallback.
    pub fn of(info: &ModuleInfo, gemm: &str, params: &HashMap<String, Vec<u8>>) -> Result<Feed> {
        let recipe = info.module().name.clone();
        let dynamic = |d: ActDynamic| {
            match d {
            ActDynamic::PerToken => Ok(Feed::PerToken),
            ActDynamic::PerTokenGroup { group: 128 } => Ok(Feed::PerTokenGroup128),
            other => Err(MoeError::Unsupported {
                recipe: recipe.clone(),
                why: format!("activation scaling `{other}` (the host reads per_token and per_token_group = 128)"),
            }),
        }
        };
        let scales = info.activation_scales(gemm);
        if scales.is_empty() {
            return Ok(Feed::Bf16);
        }
        // A static scale the file holds wins; else the (first) dynamic one.
        for s in &scales {
            if let ActScale::Static(id) = s {
                let name = info
                    .module()
                    .tensor(*id)
                    .map(|t| t.name.clone())
                    .unwrap_or_default();
                if let Some(b) = params.get(&name) {
                    let values = b
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    return Ok(Feed::Static {
                        param: name,
                        values,
                    });
                }
            }
        }
        for s in &scales {
            if let ActScale::Dynamic(d) = s {
                return dynamic(*d);
            }
        }
        Err(MoeError::Unsupported {
            recipe,
            why: format!(
                "the `{gemm}` GEMM's static activation scale is not in the packed file and no fallback is declared"
            ),
        })
    }

    /// The declaration as text (`bf16`, `fp8 per_token`, ...).
    pub fn describe(&self) -> String {
        match self {
            Feed::Bf16 => "bf16".into(),
            Feed::PerToken => "fp8 per_token".into(),
            Feed::PerTokenGroup128 => "fp8 per_token_group = 128".into(),
            Feed::Static { param, .. } => format!("fp8 static `{param}`"),
        }
    }

    /// `x` as the GEMM takes it, dequantized: exact f64 values (an E4M3 code times its f32 scale
    /// is exact in f64).
    fn feed(&self, x: &[f32], slot: usize) -> Result<Vec<f64>> {
        let k = x.len();
        let dq = |q: &[u8], s: &dyn Fn(usize) -> f32| -> Vec<f64> {
            q.iter()
                .enumerate()
                .map(|(c, &b)| r::e4m3_to_f32(b) as f64 * s(c) as f64)
                .collect()
        };
        let internal = |e: crate::codegen::Error| MoeError::Unsupported {
            recipe: String::new(),
            why: format!("activation quantization: {e}"),
        };
        Ok(match self {
            Feed::Bf16 => x
                .iter()
                .map(|&v| gr::bf16_to_f32(gr::bf16_from_f32(v)) as f64)
                .collect(),
            Feed::PerToken if k == 0 => Vec::new(),
            Feed::PerToken => {
                let (q, s) = gr::quantize_per_token(x, k).map_err(internal)?;
                let s0 = s.first().copied().unwrap_or(1.0);
                dq(&q, &|_| s0)
            }
            Feed::PerTokenGroup128 if k == 0 => Vec::new(),
            Feed::PerTokenGroup128 => {
                let (q, s) = gr::quantize_per_group128(x, k).map_err(internal)?;
                dq(&q, &|c| s.get(c / 128).copied().unwrap_or(0.0))
            }
            Feed::Static { param, values } => {
                let v = values.get(slot).copied().unwrap_or(f32::NAN);
                if !(v.is_finite() && v > 0.0) {
                    return Err(MoeError::ActivationScale {
                        param: param.clone(),
                        slot,
                        value: v,
                    });
                }
                let q = gr::quantize_per_tensor(x, v);
                dq(&q, &|_| v)
            }
        })
    }
}

/// The physical slot each logical expert's tokens run on: `log2phy[e][t mod logcnt[e]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    log2phy: Vec<Vec<usize>>,
}

impl Replicas {
    /// No placement: logical expert `e` is slot `e` (`experts` of them).
    pub fn identity(experts: usize) -> Replicas {
        Replicas {
            log2phy: (0..experts).map(|e| vec![e]).collect(),
        }
    }

    /// From a placement row: `log2phy[e]` lists the slots holding replicas of `e` in replica
    /// order (`logcnt[e]` = its length). Each must hold `e` in `phy2log` and be in range; every
    /// expert needs at least one replica.
    pub fn new(log2phy: Vec<Vec<usize>>, phy2log: &[usize]) -> Result<Replicas> {
        for (e, row) in log2phy.iter().enumerate() {
            if row.is_empty() {
                return Err(MoeError::Placement(format!(
                    "logical expert {e} has no replica"
                )));
            }
            for (rk, &p) in row.iter().enumerate() {
                if phy2log.get(p) != Some(&e) {
                    return Err(MoeError::Placement(format!(
                        "log2phy[{e}][{rk}] = {p}, but slot {p} holds {}",
                        phy2log
                            .get(p)
                            .map(|x| format!("logical expert {x}"))
                            .unwrap_or_else(|| format!(
                                "nothing (there are {} slots)",
                                phy2log.len()
                            ))
                    )));
                }
            }
        }
        Ok(Replicas { log2phy })
    }

    /// From `phy2log` alone: each expert's replicas in ascending slot order.
    pub fn from_phy2log(phy2log: &[usize], experts: usize) -> Result<Replicas> {
        let mut log2phy = vec![Vec::new(); experts];
        for (p, &e) in phy2log.iter().enumerate() {
            let row = log2phy.get_mut(e).ok_or_else(|| {
                MoeError::Placement(format!(
                    "slot {p} holds logical expert {e}, outside [0, {experts})"
                ))
            })?;
            row.push(p);
        }
        Replicas::new(log2phy, phy2log)
    }

    /// Logical experts.
    pub fn experts(&self) -> usize {
        self.log2phy.len()
    }

    /// The slots holding replicas of logical expert `e`, in replica order (empty when `e` is out
    /// of range).
    pub fn replicas_of(&self, e: usize) -> &[usize] {
        self.log2phy.get(e).map_or(&[], Vec::as_slice)
    }

    /// The slot token `t` runs logical expert `e` on (`None` when `e` is out of range).
    pub fn slot(&self, e: usize, t: usize) -> Option<usize> {
        let row = self.log2phy.get(e)?;
        row.get(t % row.len().max(1)).copied()
    }
}

/// One MoE layer's packed params at a verified binding.
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    /// The recipe, verified at the params' binding (its experts dimension = the slot count).
    pub info: &'a ModuleInfo,
    /// Param name -> stored bytes.
    pub params: &'a HashMap<String, Vec<u8>>,
}

/// The router's output for `T` tokens.
#[derive(Debug, Clone, Copy)]
pub struct Tokens<'a> {
    /// `hidden_states [T, H]`, bf16 bits.
    pub x: &'a [u16],
    /// `topk_ids [T, k]`, logical expert ids.
    pub ids: &'a [i32],
    /// `topk_weights [T, k]`.
    pub weights: &'a [f32],
    /// Tokens T.
    pub t: usize,
    /// Choices per token k.
    pub k: usize,
}

impl Tokens<'_> {
    /// Each input holds `T x H` (`hidden_states`) or `T x k` elements, else `InputShape` naming
    /// it.
    pub fn check_lengths(&self, h: usize) -> Result<()> {
        let (t, k) = (self.t, self.k);
        for (name, len, want) in [
            ("hidden_states", self.x.len(), t * h),
            ("topk_ids", self.ids.len(), t * k),
            ("topk_weights", self.weights.len(), t * k),
        ] {
            if len != want {
                return Err(MoeError::InputShape {
                    name: name.into(),
                    want: format!("{want} elements (T = {t}, k = {k}, H = {h})"),
                    got: vec![len],
                });
            }
        }
        Ok(())
    }
}

/// The forward's results.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// `output [T, H]`, bf16 bits.
    pub output: Vec<u16>,
    /// `w13_out [T, k, 2I]`: the first GEMM's f32 accumulator, `[gate; up]` columns.
    pub w13_out: Vec<f32>,
    /// `act [T, k, I]`: what the second GEMM took, dequantized to f32.
    pub act: Vec<f32>,
    /// H.
    pub h: usize,
    /// I.
    pub i: usize,
}

/// The shape `[E, M, K]` of the recipe's input `name` at the binding.
pub(crate) fn input_shape(info: &ModuleInfo, name: &str) -> Option<(usize, usize, usize)> {
    let t =
        info.module().tensors.iter().find(|t| {
            t.name == name && matches!(t.kind, crate::dsl::ir::TensorKind::Input { .. })
        })?;
    let d: Vec<usize> = t
        .shape
        .iter()
        .map(|p| info.eval(p).and_then(|x| usize::try_from(x).ok()))
        .collect::<Option<_>>()?;
    match d[..] {
        [e, m, k] => Some((e, m, k)),
        _ => None,
    }
}

/// `(slots, H, I)` of a layer: from the recipe's inputs `w13 [E, 2I, H]` and `w2 [E, H, I]`.
pub fn dims(info: &ModuleInfo) -> Result<(usize, usize, usize)> {
    let unsupported = |why: &str| MoeError::Unsupported {
        recipe: info.module().name.clone(),
        why: why.into(),
    };
    let (e, m13, k13) = input_shape(info, "w13")
        .ok_or_else(|| unsupported("it has no input `w13` [E, 2*I, H] at the binding"))?;
    let (e2, h, i) = input_shape(info, "w2")
        .ok_or_else(|| unsupported("it has no input `w2` [E, H, I] at the binding"))?;
    if e != e2 || m13 != 2 * i || k13 != h {
        return Err(unsupported(&format!(
            "`w13` is [{e}, {m13}, {k13}] and `w2` [{e2}, {h}, {i}]; the layer needs [E, 2*I, H] and [E, H, I]"
        )));
    }
    Ok((e, h, i))
}

/// Expert `slot`'s dequantized weights of input `name`, `[M, K]` row-major in the input's order.
fn weights(layer: &Layer<'_>, name: &str, slot: usize) -> Result<Vec<f64>> {
    let unsupported = |why: String| MoeError::Unsupported {
        recipe: layer.info.module().name.clone(),
        why,
    };
    let l = crate::dequant::logical_experts(layer.info, name, layer.params, Some(slot..slot + 1))
        .ok_or_else(|| {
            unsupported(format!(
                "its params of `{name}` cannot be read back (a param missing, or a form the dequantizer does not read)"
            ))
        })?;
    (0..l.codes.len())
        .map(|at| l.value(at))
        .collect::<Option<Vec<f64>>>()
        .ok_or_else(|| unsupported(format!("`{name}`: an element has no value")))
}

fn dot(w: &[f64], x: &[f64]) -> f64 {
    w.iter().zip(x).fold(0.0, |acc, (a, b)| acc + a * b)
}

/// One `(t, j)`'s intermediates: `[g; u]`, `a` as fed, `y`.
type PairOut = (usize, Vec<f32>, Vec<f32>, Vec<f32>);

/// The slots `range` of `by_slot`: each slot's weights dequantized once, then its tokens.
fn run_slots(
    layer: &Layer<'_>,
    tokens: &Tokens<'_>,
    feeds: (&Feed, &Feed),
    (h, i): (usize, usize),
    work: &[(usize, Vec<usize>)],
    range: Range<usize>,
) -> Result<Vec<PairOut>> {
    let mut out = Vec::new();
    for (slot, pairs) in work.get(range).unwrap_or_default() {
        let w13 = weights(layer, "w13", *slot)?;
        let w2 = weights(layer, "w2", *slot)?;
        for &p in pairs {
            let t = p / tokens.k.max(1);
            let x: Vec<f32> = tokens.x[t * h..(t + 1) * h]
                .iter()
                .map(|&b| gr::bf16_to_f32(b))
                .collect();
            let xf = feeds.0.feed(&x, *slot)?;
            let gu: Vec<f32> = w13
                .chunks_exact(h.max(1))
                .take(2 * i)
                .map(|row| dot(row, &xf) as f32)
                .collect();
            let a: Vec<f32> = (0..i)
                .map(|c| {
                    let (g, u) = (gu[c] as f64, gu[i + c] as f64);
                    (g / (1.0 + (-g).exp()) * u) as f32
                })
                .collect();
            let af = feeds.1.feed(&a, *slot)?;
            let y: Vec<f32> = w2
                .chunks_exact(i.max(1))
                .take(h)
                .map(|row| dot(row, &af) as f32)
                .collect();
            out.push((p, gu, af.iter().map(|&v| v as f32).collect(), y));
        }
    }
    Ok(out)
}

/// Check that every `topk_ids` entry names a logical expert with a replica (what the forward
/// checks before computing anything).
pub fn check_ids(tokens: &Tokens<'_>, replicas: &Replicas) -> Result<()> {
    for (p, &id) in tokens.ids.iter().enumerate() {
        let ok = usize::try_from(id)
            .ok()
            .and_then(|e| replicas.slot(e, p / tokens.k.max(1)))
            .is_some();
        if !ok {
            return Err(MoeError::ExpertOutOfRange {
                token: p / tokens.k.max(1),
                j: p % tokens.k.max(1),
                id: id as i64,
                experts: replicas.experts(),
            });
        }
    }
    Ok(())
}

/// Run the layer (see the module docs) on `threads` host threads (0: one per core). Expert ids are
/// checked against `replicas` before anything is computed.
pub fn forward(
    layer: &Layer<'_>,
    tokens: &Tokens<'_>,
    replicas: &Replicas,
    threads: usize,
) -> Result<Forward> {
    let (slots, h, i) = dims(layer.info)?;
    let (t, k) = (tokens.t, tokens.k);
    tokens.check_lengths(h)?;
    let feeds = (
        Feed::of(layer.info, "w13", layer.params)?,
        Feed::of(layer.info, "w2", layer.params)?,
    );
    // Each (t, j) on its slot; pairs grouped by slot, in ascending order.
    let mut by_slot: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for tt in 0..t {
        for j in 0..k {
            let id = tokens.ids[tt * k + j];
            let out_of_range = || MoeError::ExpertOutOfRange {
                token: tt,
                j,
                id: id as i64,
                experts: replicas.experts(),
            };
            let e = usize::try_from(id).map_err(|_| out_of_range())?;
            let slot = replicas.slot(e, tt).ok_or_else(out_of_range)?;
            if slot >= slots {
                return Err(MoeError::Placement(format!(
                    "logical expert {e} maps to slot {slot}, but the packed params hold {slots} slots"
                )));
            }
            by_slot.entry(slot).or_default().push(tt * k + j);
        }
    }
    let work: Vec<(usize, Vec<usize>)> = by_slot.into_iter().collect();
    let n = work.len();
    let nt = if threads == 0 {
        std::thread::available_parallelism()
            .map(|x| x.get())
            .unwrap_or(1)
    } else {
        threads
    }
    .clamp(1, n.max(1));
    let feeds_ref = (&feeds.0, &feeds.1);
    let parts: Vec<Result<Vec<PairOut>>> = if nt == 1 {
        vec![run_slots(layer, tokens, feeds_ref, (h, i), &work, 0..n)]
    } else {
        let work = &work;
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..nt)
                .map(|w| {
                    s.spawn(move || {
                        run_slots(
                            layer,
                            tokens,
                            feeds_ref,
                            (h, i),
                            work,
                            w * n / nt..(w + 1) * n / nt,
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|hd| {
                    hd.join().unwrap_or_else(|_| {
                        Err(MoeError::Unsupported {
                            recipe: layer.info.module().name.clone(),
                            why: "a worker thread failed".into(),
                        })
                    })
                })
                .collect()
        })
    };
    let mut w13_out = vec![0f32; t * k * 2 * i];
    let mut act = vec![0f32; t * k * i];
    let mut ys = vec![0f32; t * k * h];
    for part in parts {
        for (p, gu, a, y) in part? {
            w13_out[p * 2 * i..(p + 1) * 2 * i].copy_from_slice(&gu);
            act[p * i..(p + 1) * i].copy_from_slice(&a);
            ys[p * h..(p + 1) * h].copy_from_slice(&y);
        }
    }
    let mut output = vec![0u16; t * h];
    for tt in 0..t {
        for c in 0..h {
            let mut acc = 0f32;
            for j in 0..k {
                let p = tt * k + j;
                acc += tokens.weights[p] * ys[p * h + c];
            }
            output[tt * h + c] = gr::bf16_from_f32(acc);
        }
    }
    Ok(Forward {
        output,
        w13_out,
        act,
        h,
        i,
    })
}
