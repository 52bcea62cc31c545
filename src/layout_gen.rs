//! Random legal storage layouts for a recipe's params, and the row-major twin of a recipe: what the
//! layout property tests, `selftest --gpu` and `bench --layouts` run. A layout is drawn as a random
//! storage order of the param's modes, some split in two (a tiling), optionally under a swizzle
//! `S<B,M,S>`; 4-bit params keep their byte pairs (the last dimension's first sub-mode fastest), and
//! params an `mma_sf_view` reads keep the 128x4 tile layout that view needs.

use std::collections::HashMap;

/// A xorshift generator: a seed gives one sequence, for replay.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform below `n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Split a comma list at the top level of brackets.
pub fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for ch in s.chars() {
        match ch {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

/// A random dense, expert-major layout literal over the dims `[E, d1, d2, ...]`.
pub fn random_layout(rng: &mut Rng, dims: &[String], fp4: bool) -> String {
    // Leaves per dim, fastest first: (dim, extent).
    let mut leaves: Vec<Vec<String>> = Vec::new();
    for d in &dims[1..] {
        if rng.below(2) == 0 {
            let t = [2, 4, 8][rng.below(3) as usize];
            leaves.push(vec![t.to_string(), format!("{d}/{t}")]);
        } else {
            leaves.push(vec![d.clone()]);
        }
    }
    // Storage order of the leaves, fastest first; a 4-bit type keeps the last dim's first leaf
    // fastest (byte pairs).
    let mut order: Vec<(usize, usize)> = leaves
        .iter()
        .enumerate()
        .flat_map(|(k, l)| (0..l.len()).map(move |j| (k, j)))
        .collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    if fp4 {
        let last = (leaves.len() - 1, 0);
        order.retain(|x| *x != last);
        order.insert(0, last);
    }
    let mut strides: HashMap<(usize, usize), String> = HashMap::new();
    let mut acc = "1".to_string();
    for &(k, j) in &order {
        strides.insert((k, j), acc.clone());
        acc = format!("{acc}*{}", leaves[k][j]);
    }
    let shape_of = |k: usize| -> String {
        if leaves[k].len() == 1 {
            leaves[k][0].clone()
        } else {
            format!("({})", leaves[k].join(", "))
        }
    };
    let stride_of = |k: usize| -> String {
        let s: Vec<String> = (0..leaves[k].len())
            .map(|j| strides.get(&(k, j)).cloned().unwrap_or_default())
            .collect();
        if s.len() == 1 {
            s[0].clone()
        } else {
            format!("({})", s.join(", "))
        }
    };
    let shape: Vec<String> = std::iter::once(dims[0].clone())
        .chain((0..leaves.len()).map(shape_of))
        .collect();
    let stride: Vec<String> = std::iter::once(acc.clone())
        .chain((0..leaves.len()).map(stride_of))
        .collect();
    let swz = if rng.below(3) == 0 {
        let b = 1 + rng.below(2) as i64;
        let m = if fp4 { 1 + rng.below(2) } else { rng.below(3) } as i64;
        let s = b + rng.below(2) as i64;
        format!("S<{b},{m},{s}> o ")
    } else {
        String::new()
    };
    format!("{swz}({}):({})", shape.join(", "), stride.join(", "))
}

/// The recipe with random layouts declared on (some of) its params of rank >= 2.
pub fn with_layouts(rng: &mut Rng, src: &str) -> String {
    let mut out = String::new();
    for line in src.lines() {
        let t = line.trim_start();
        let mut done = false;
        if let Some(rest) = t.strip_prefix("param ") {
            if let (Some(colon), Some(eq)) = (rest.find(':'), rest.find(" = ")) {
                let ty = rest[colon + 1..eq].trim();
                if let (Some(lb), true) = (ty.find('['), ty.ends_with(']')) {
                    let dims = split_top(&ty[lb + 1..ty.len() - 1]);
                    let pname = rest[..colon].trim();
                    // The MMA view pins its scales to the 128x4 tile layout (refused otherwise).
                    let pinned = src.contains(&format!("mma_sf_view({pname})"));
                    if dims.len() >= 2 && !ty.contains('@') && !pinned && rng.below(4) != 0 {
                        let lay = random_layout(
                            rng,
                            &dims,
                            ty.starts_with("e2m1") || ty.starts_with("u4"),
                        );
                        let indent = &line[..line.len() - t.len()];
                        out.push_str(&format!(
                            "{indent}param {} : {ty} @ {lay} = {}\n",
                            rest[..colon].trim(),
                            rest[eq + 3..].trim()
                        ));
                        done = true;
                    }
                }
            }
        }
        if !done {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The recipe with every declared layout removed (`@ ...` up to ` = `).
pub fn without_layouts(src: &str) -> String {
    src.lines()
        .map(|l| match (l.find(" @ "), l.find(" = ")) {
            (Some(a), Some(b)) if a < b && l.trim_start().starts_with("param ") => {
                format!("{}{}\n", &l[..a], &l[b..])
            }
            _ => format!("{l}\n"),
        })
        .collect()
}

/// A random-layout variant of a recipe (at least one layout declared) that `check` accepts at a
/// binding (`E=..,H=..,I=..`): draws until one is accepted (a split of an extent the where-clause does not make divisible, or a swizzle
/// whose period does not divide an expert, is refused), at most `tries` times.
pub fn random_accepted(
    rng: &mut Rng,
    src: &str,
    path: &str,
    bind: &str,
    tries: usize,
) -> Option<String> {
    (0..tries).find_map(|_| {
        let s = with_layouts(rng, src);
        (s.contains(" @ ") && crate::check_source(&s, path, Some(bind)).is_ok()).then_some(s)
    })
}
