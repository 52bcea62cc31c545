//! A declared layout is the layout written. Property test: every standard recipe, with random legal
//! storage layouts declared on its params (permutations of the non-expert modes, tilings that split a
//! mode, `S<B,M,S>` swizzles, over padded scales too), packed by the interpreter and the Cranelift
//! host backend; reading each param back through its declared layout (evaluated by the layout
//! algebra, not by the code generator) must give, element for element, what the standard recipe's
//! pack holds at the same logical coordinate. A fresh seed each run, printed for replay
//! (`MOEFORGE_SEED=...`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::seed;

use std::collections::HashMap;

use moeforge::codegen::{self, kir::BufRole, SingleProcess};
use moeforge::dsl::ir::DType;
use moeforge::dsl::layout::IntTuple;
use moeforge::dsl::ModuleInfo;

use moeforge::layout_gen::{with_layouts, without_layouts, Rng};

fn bf16(rng: &mut Rng) -> f32 {
    let k = rng.next_u64();
    let mant = ((k >> 8) & 0x7F) as u32;
    let exp = 118 + ((k >> 16) % 16) as u32;
    let sign = ((k >> 24) & 1) as u32;
    f32::from_bits((sign << 31) | (exp << 23) | (mant << 16))
}

type Params = HashMap<String, Vec<u8>>;

/// Pack with a backend: `interp` and `host` take the GPU form of the program, `host_x4` the
/// host form (4-lane vectors) that `moeforge pack` runs.
fn pack(info: &ModuleInfo, inputs: &Params, backend: &str) -> Params {
    let x4 = backend == "host_x4";
    let prog =
        codegen::plan::plan_with(info, &|n: &str| inputs.contains_key(n), &|_| false, x4).unwrap();
    let mut bufs = codegen::alloc_buffers(&prog, &mut |n| inputs.get(n).cloned()).unwrap();
    match backend {
        "interp" => codegen::interp::run(&prog, &mut bufs, &SingleProcess).unwrap(),
        _ => {
            let compiled = codegen::host::compile(&prog).unwrap();
            compiled.run(&mut bufs, &SingleProcess, 2).unwrap();
        }
    }
    prog.bufs
        .iter()
        .zip(bufs)
        .filter_map(|(b, d)| match &b.role {
            BufRole::Param(n) => Some((n.clone(), d)),
            _ => None,
        })
        .collect()
}

/// Every logical element of every param, read through the param's verified storage layout (the
/// layout algebra's `crd2idx` and `Swizzle::apply`): name -> element bytes in row-major order.
fn logical(info: &ModuleInfo, params: &Params) -> HashMap<String, Vec<Vec<u8>>> {
    let b = info.binding().unwrap();
    let m = info.module();
    let mut out = HashMap::new();
    for p in &info.params {
        let t = m.tensor(p.id).unwrap();
        let Some(bytes) = params.get(&t.name) else {
            continue;
        };
        let shape: Vec<i64> = t.shape.iter().map(|s| b.eval(s).unwrap() as i64).collect();
        let (lay, off) = moeforge::dsl::verify::numeric(&p.layout, b).unwrap();
        let n: i64 = shape.iter().product();
        let mut elems = Vec::with_capacity(n as usize);
        for i in 0..n {
            let mut c = vec![0i64; shape.len()];
            let mut r = i;
            for k in (0..shape.len()).rev() {
                c[k] = r % shape[k];
                r /= shape[k];
            }
            let crd = if c.len() == 1 {
                IntTuple::Int(c[0])
            } else {
                IntTuple::Tuple(c.iter().map(|&x| IntTuple::Int(x)).collect())
            };
            let mut o = lay.crd2idx(&crd).unwrap() + off;
            if let Some(sw) = p.layout.swizzle {
                o = sw.apply(o);
            }
            let o = o as usize;
            elems.push(match t.dtype {
                DType::E2m1 => vec![(bytes[o / 2] >> (4 * (o % 2))) & 0xF],
                d => {
                    let w = (d.bits() / 8) as usize;
                    bytes[o * w..(o + 1) * w].to_vec()
                }
            });
        }
        out.insert(t.name.clone(), elems);
    }
    out
}

#[test]
fn declared_layouts_are_the_layouts_written() {
    let s0 = seed();
    let mut rng = Rng::new(s0);
    let (e, h, i) = (2i64, 128i64, 128i64);
    let bind = vec![("E".into(), e), ("H".into(), h), ("I".into(), i)];
    let mut inputs: Params = HashMap::new();
    let mut gen = |n: i64| -> Vec<u8> {
        (0..n)
            .flat_map(|_| ((bf16(&mut rng).to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    inputs.insert("w13".into(), gen(e * 2 * i * h));
    inputs.insert("w2".into(), gen(e * h * i));
    let mut accepted = 0;
    let mut relaid = 0;
    // Besides the standard recipes: copies through a row gather, relaid straight from the input.
    let gathered = moeforge::kernels::StandardRecipe {
        name: "bf16_gathered",
        path: "tests/layouts.rs",
        source: "recipe bf16_gathered(E: experts, H, I) where H % 16 == 0, I % 64 == 0 {
  input w13 : bf16[E, 2*I, H]
  input w2  : bf16[E, H, I]
  let rows = interleave(swap_halves(2*I), group = 64)
  param w13_weight : bf16[E, 2*I, H] = w13[:, rows, :]
  param w2_weight  : bf16[E, H, I] = w2
}
",
    };
    for r in moeforge::kernels::STANDARD.iter().chain([&gathered]) {
        let std_info = moeforge::dsl::check(r.source, Some(&bind)).unwrap();
        let want = logical(&std_info, &pack(&std_info, &inputs, "host"));
        for _case in 0..4 {
            let src = with_layouts(&mut rng, r.source);
            let info = match moeforge::dsl::check(&src, Some(&bind)) {
                Ok(info) => info,
                Err(d) => {
                    // Only a swizzle whose period does not divide an expert (E0401/E0402), a split
                    // of an extent not provably divisible (E0204) or a view slicing a split mode
                    // off its inner extent (E0306) may be refused.
                    let msg = format!("{d:?}");
                    assert!(
                        ["E0401", "E0402", "E0204", "slices a hierarchical mode"]
                            .iter()
                            .any(|c| msg.contains(c)),
                        "seed {s0}: {}: a legal layout was refused: {msg}\n{src}",
                        r.name
                    );
                    continue;
                }
            };
            accepted += 1;
            relaid += info
                .params
                .iter()
                .zip(&std_info.params)
                .filter(|(p, q)| p.layout != q.layout)
                .count();
            for backend in ["interp", "host", "host_x4"] {
                let got = logical(&info, &pack(&info, &inputs, backend));
                for (name, w) in &want {
                    let g = &got[name];
                    if let Some(k) = (0..w.len()).find(|&k| g[k] != w[k]) {
                        panic!(
                            "seed {s0}: {} on {backend}: `{name}` element {k} is {:?}, the standard pack has {:?}\n{src}",
                            r.name, g[k], w[k]
                        );
                    }
                }
            }
        }
    }
    assert!(
        accepted >= 12,
        "seed {s0}: only {accepted} layouts accepted"
    );
    assert!(relaid > 0);
}

#[test]
fn example_layout_recipes_pack_through_their_layouts() {
    // kernels/layouts: column-major FP8, 16x16-tiled bf16, S<3,4,3>-swizzled bf16, MXFP4 with
    // swizzled E8M0 scales and column-tiled values; at shapes with partial 128-row scale tiles.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/layouts");
    let mut rng = Rng::new(seed());
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        for (e, h, i) in [(2i64, 256i64, 128i64), (3, 128, 64)] {
            let bind = vec![("E".into(), e), ("H".into(), h), ("I".into(), i)];
            let Ok(info) = moeforge::dsl::check(&src, Some(&bind)) else {
                continue;
            };
            let plain = moeforge::dsl::check(&without_layouts(&src), Some(&bind)).unwrap();
            let mut inputs: Params = HashMap::new();
            for (name, len) in [("w13", e * 2 * i * h), ("w2", e * h * i)] {
                let b: Vec<u8> = (0..len)
                    .flat_map(|_| ((bf16(&mut rng).to_bits() >> 16) as u16).to_le_bytes())
                    .collect();
                inputs.insert(name.into(), b);
            }
            let want = logical(&plain, &pack(&plain, &inputs, "host"));
            for backend in ["interp", "host", "host_x4"] {
                let got = logical(&info, &pack(&info, &inputs, backend));
                assert_eq!(got.len(), want.len());
                for (name, w) in &want {
                    assert!(
                        got[name] == *w,
                        "{}: `{name}` on {backend} differs from the row-major pack",
                        path.display()
                    );
                }
                n += 1;
            }
        }
    }
    assert!(n >= 8, "only {n} example packs compared");
}

/// What a view stands for: its logical shape and, per view element (row-major), the row-major index
/// of the param's logical element it is, by evaluating the view's definition on the param's logical
/// tensor (slices, indexing, permutes, reshapes, SPEC §2's MMA split). `None` for a view that
/// reinterprets raw storage through an explicit layout.
fn meaning(info: &ModuleInfo, v: moeforge::dsl::ir::ValueId) -> Option<(Vec<i64>, Vec<i64>)> {
    use moeforge::dsl::ir::Op;
    let m = info.module();
    let ev = |p: &moeforge::dsl::poly::Poly| info.eval(p).unwrap() as i64;
    let strides = |s: &[i64]| {
        let mut st = vec![1i64; s.len()];
        for k in (0..s.len().saturating_sub(1)).rev() {
            st[k] = st[k + 1] * s[k + 1];
        }
        st
    };
    let coords = |i: i64, s: &[i64]| {
        let mut c = vec![0i64; s.len()];
        let mut r = i;
        for k in (0..s.len()).rev() {
            c[k] = r % s[k];
            r /= s[k];
        }
        c
    };
    match &m.value(v)?.op {
        Op::Tensor(t) => {
            let s: Vec<i64> = m.tensor(*t)?.shape.iter().map(ev).collect();
            let n = s.iter().product();
            Some((s, (0..n).collect()))
        }
        Op::Slice {
            base,
            dim,
            start,
            end,
        } => {
            let (s, idx) = meaning(info, *base)?;
            let (a, b) = (ev(start), ev(end));
            let mut ns = s.clone();
            ns[*dim] = b - a;
            let st = strides(&s);
            let n: i64 = ns.iter().product();
            let out = (0..n)
                .map(|i| {
                    let mut c = coords(i, &ns);
                    c[*dim] += a;
                    idx[c.iter().zip(&st).map(|(x, y)| x * y).sum::<i64>() as usize]
                })
                .collect();
            Some((ns, out))
        }
        Op::Select { base, dim, index } => {
            let (s, idx) = meaning(info, *base)?;
            let mut ns = s.clone();
            ns.remove(*dim);
            let st = strides(&s);
            let n: i64 = ns.iter().product();
            let out = (0..n)
                .map(|i| {
                    let mut c = coords(i, &ns);
                    c.insert(*dim, ev(index));
                    idx[c.iter().zip(&st).map(|(x, y)| x * y).sum::<i64>() as usize]
                })
                .collect();
            Some((ns, out))
        }
        Op::Permute { base, perm } => {
            let (s, idx) = meaning(info, *base)?;
            let ns: Vec<i64> = perm.iter().map(|&p| s[p]).collect();
            let st = strides(&s);
            let n: i64 = ns.iter().product();
            let out = (0..n)
                .map(|i| {
                    let c = coords(i, &ns);
                    let mut src = vec![0i64; s.len()];
                    for (k, &p) in perm.iter().enumerate() {
                        src[p] = c[k];
                    }
                    idx[src.iter().zip(&st).map(|(x, y)| x * y).sum::<i64>() as usize]
                })
                .collect();
            Some((ns, out))
        }
        Op::Reshape { base, shape } => {
            let (_, idx) = meaning(info, *base)?;
            Some((shape.iter().map(ev).collect(), idx))
        }
        Op::MmaSfView { base } => {
            // (a, b, mt, c, kt, g) stands for S_g[mt*128 + b*32 + a, kt*4 + c].
            let (s, idx) = meaning(info, *base)?;
            let (mt_n, kt_n) = (s[1] / 128, s[2] / 4);
            let ns = vec![32, 4, mt_n, 4, kt_n, s[0]];
            let st = strides(&s);
            let n: i64 = ns.iter().product();
            let out = (0..n)
                .map(|i| {
                    let [a, b, mt, c, kt, g] = coords(i, &ns)[..] else {
                        unreachable!()
                    };
                    let l = [g, mt * 128 + b * 32 + a, kt * 4 + c];
                    idx[l.iter().zip(&st).map(|(x, y)| x * y).sum::<i64>() as usize]
                })
                .collect();
            Some((ns, out))
        }
        _ => None,
    }
}

/// Every view of a module stands for what its definition says: for each view element, the offset
/// its verified layout gives equals the storage offset (through the param's layout) of the logical
/// element it stands for. Returns the number of views checked.
fn check_views(info: &ModuleInfo, what: &str) -> usize {
    let b = info.binding().unwrap();
    let m = info.module();
    let offset = |l: &moeforge::dsl::ir::SymLayout, c: &[i64]| {
        let (lay, off) = moeforge::dsl::verify::numeric(l, b).unwrap();
        let crd = if c.len() == 1 {
            IntTuple::Int(c[0])
        } else {
            IntTuple::Tuple(c.iter().map(|&x| IntTuple::Int(x)).collect())
        };
        let o = lay.crd2idx(&crd).unwrap() + off;
        l.swizzle.map_or(o, |s| s.apply(o))
    };
    let coords = |i: i64, s: &[i64]| {
        let mut c = vec![0i64; s.len()];
        let mut r = i;
        for k in (0..s.len()).rev() {
            c[k] = r % s[k];
            r /= s[k];
        }
        c
    };
    let mut n = 0;
    for v in &info.views {
        let t = m.tensor(v.id).unwrap();
        let Some((shape, idx)) = meaning(info, t.value.unwrap()) else {
            continue;
        };
        let p = info.params.iter().find(|p| p.id == v.source).unwrap();
        let pshape: Vec<i64> = m
            .tensor(v.source)
            .unwrap()
            .shape
            .iter()
            .map(|s| info.eval(s).unwrap() as i64)
            .collect();
        for (i, &li) in idx.iter().enumerate() {
            let vc = coords(i as i64, &shape);
            let got = offset(&v.layout, &vc);
            let want = offset(&p.layout, &coords(li, &pshape));
            assert_eq!(got, want, "{what}: view `{}` at {vc:?}", t.name);
        }
        n += 1;
    }
    n
}

#[test]
fn views_stand_for_what_they_say() {
    let mut n = 0;
    for r in moeforge::kernels::STANDARD {
        for (e, h, i) in [(2i64, 128i64, 128i64), (3, 256, 192)] {
            let bind = vec![("E".into(), e), ("H".into(), h), ("I".into(), i)];
            if let Ok(info) = moeforge::dsl::check(r.source, Some(&bind)) {
                n += check_views(&info, r.name);
            }
        }
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/layouts");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        let bind = vec![("E".into(), 2), ("H".into(), 256), ("I".into(), 128)];
        let info = moeforge::dsl::check(&src, Some(&bind)).unwrap();
        n += check_views(&info, &path.display().to_string());
    }
    // Random layouts: the gate/up slices of tiled, permuted and swizzled params.
    let s0 = seed();
    let mut rng = Rng::new(s0);
    let bind = vec![("E".into(), 2), ("H".into(), 128), ("I".into(), 128)];
    for _ in 0..5 {
        for r in moeforge::kernels::STANDARD {
            if let Ok(info) = moeforge::dsl::check(&with_layouts(&mut rng, r.source), Some(&bind)) {
                n += check_views(&info, &format!("seed {s0}: {}", r.name));
            }
        }
    }
    assert!(n >= 30, "only {n} views checked");
}

#[test]
fn every_standard_recipe_gets_accepted_random_layouts() {
    // What `selftest --gpu` runs: an accepted random-layout variant of each standard recipe, whose
    // params really differ from row-major somewhere.
    let s0 = seed();
    let mut rng = Rng::new(s0);
    for r in moeforge::kernels::STANDARD {
        let src = moeforge::layout_gen::random_accepted(
            &mut rng,
            r.source,
            r.path,
            "E=2,H=128,I=128",
            64,
        )
        .unwrap_or_else(|| panic!("seed {s0}: no accepted layout for {}", r.name));
        let bind = vec![("E".into(), 2), ("H".into(), 128), ("I".into(), 128)];
        assert!(src.contains(" @ "), "{src}");
        assert!(moeforge::dsl::check(&src, Some(&bind)).is_ok());
    }
}

#[test]
fn what_check_accepts_compiles_at_every_admissible_binding() {
    // `check` plans at one binding (the bound or the smallest admissible one); the planner must then
    // serve the recipe at every binding that verifies: standard, layout-example and pre-quantized
    // recipes and random declared-layout variants, at shapes with partial tiles and at real sizes.
    let s0 = seed();
    let mut rng = Rng::new(s0);
    let binds = [
        "E=2,H=128,I=128",
        "E=3,H=192,I=64",
        "E=1,H=4160,I=2112",
        "E=8,H=2048,I=768",
    ];
    let mut sources: Vec<(String, String)> = moeforge::kernels::STANDARD
        .iter()
        .chain(moeforge::kernels::LAYOUTS)
        .chain(moeforge::kernels::PREQUANT)
        .map(|r| (r.name.to_string(), r.source.to_string()))
        .collect();
    for r in moeforge::kernels::STANDARD {
        if let Some(s) =
            moeforge::layout_gen::random_accepted(&mut rng, r.source, r.path, binds[0], 64)
        {
            sources.push((format!("{}~random", r.name), s));
        }
    }
    let mut planned = 0;
    for (name, src) in &sources {
        if moeforge::check_source(src, name, None).is_err() {
            continue;
        }
        for b in binds {
            if moeforge::verify_source(src, name, Some(b)).is_err() {
                continue; // the where-clause or a layout's divisibility rejects this shape
            }
            if let Err(e) = moeforge::pack_program(src, name, b, &|_| true) {
                panic!("seed {s0}: {name} verifies at {b} but does not compile: {e}\n{src}");
            }
            planned += 1;
        }
    }
    assert!(planned >= 40, "only {planned} programs planned");
}
