//! The EPLB rebalancing policy: DeepSeek's hierarchical and global expert placement (SPEC §6, restated
//! in docs/FORMATS.md §6), exactly: loads as f32, stable weight-descending sorts, f32 pack sums, ties to
//! the lowest pack or expert. Pure host code; the executor that moves experts along a placement is
//! [`crate::moves`] (the plan), [`crate::store`] (the move) and [`crate::eplb_state`] (the layer's
//! state and its rebalance).

use thiserror::Error as ThisError;

/// Why a placement cannot be computed.
#[derive(Debug, ThisError, PartialEq, Eq)]
pub enum PolicyError {
    /// The sizes do not divide as the policy needs.
    #[error("{0}")]
    Shape(String),
}

/// A placement of logical experts on physical slots, per layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// `[L][R]`: the logical expert each physical slot holds (slot `p` is on GPU `p / (R/P)`).
    pub phy2log: Vec<Vec<usize>>,
    /// `[L][E][maxcnt]`: the slot of each replica of each logical expert, `-1` padded.
    pub log2phy: Vec<Vec<Vec<i64>>>,
    /// `[L][E]`: how many replicas each logical expert has (at least 1; a row sums to R).
    pub logcnt: Vec<Vec<usize>>,
}

/// Items in weight-descending order, ties by index (a stable sort).
fn descending(w: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..w.len()).collect();
    idx.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
    idx
}

/// `balanced_packing`: `n` weighted items onto `m` packs of `n/m` items each; each item, heaviest
/// first, goes to the non-full pack of least accumulated (f32) weight, ties to the lowest pack.
/// Returns each item's pack and rank in it.
pub fn balanced_packing(w: &[f32], m: usize) -> (Vec<usize>, Vec<usize>) {
    let n = w.len();
    let cap = n / m.max(1);
    if cap == 1 {
        return ((0..n).collect(), vec![0; n]);
    }
    let (mut pack, mut rank) = (vec![0; n], vec![0; n]);
    let (mut weight, mut items) = (vec![0f32; m], vec![0usize; m]);
    for i in descending(w) {
        let mut best: Option<usize> = None;
        for p in 0..m {
            if items[p] < cap && best.is_none_or(|b| weight[p] < weight[b]) {
                best = Some(p);
            }
        }
        let p = best.unwrap_or(0);
        pack[i] = p;
        rank[i] = items[p];
        weight[p] += w[i];
        items[p] += 1;
    }
    (pack, rank)
}

/// `replicate_experts`: `r` slots for `w.len()` experts; slot `p < E` holds `p`, each further slot
/// the expert of largest `w / count` (f32, ties to the lowest). Returns slot -> expert, each slot's
/// replica rank, and each expert's count.
pub fn replicate_experts(w: &[f32], r: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let e = w.len();
    let mut phy2log: Vec<usize> = (0..e).collect();
    let mut rank = vec![0; e];
    let mut cnt = vec![1usize; e];
    for _ in e..r {
        let mut best = 0;
        let mut best_v = f32::NEG_INFINITY;
        for (k, &x) in w.iter().enumerate() {
            let v = x / cnt[k] as f32;
            if v > best_v {
                best_v = v;
                best = k;
            }
        }
        phy2log.push(best);
        rank.push(cnt[best]);
        cnt[best] += 1;
    }
    (phy2log, rank, cnt)
}

/// `rebalance_experts(weight[L][E], R, G, N, P)`: hierarchical when `G % N == 0`, else global
/// (hierarchical with one group and one node).
pub fn rebalance_experts(
    weight: &[Vec<f32>],
    replicas: usize,
    groups: usize,
    nodes: usize,
    gpus: usize,
) -> Result<Placement, PolicyError> {
    let bad = |m: String| Err(PolicyError::Shape(m));
    let Some(e) = weight.first().map(Vec::len) else {
        return bad("no layers".into());
    };
    if weight.iter().any(|w| w.len() != e) || e == 0 {
        return bad("every layer needs the same, positive number of experts".into());
    }
    if gpus == 0 || nodes == 0 || groups == 0 || replicas < e {
        return bad(format!(
            "need replicas >= experts ({replicas} < {e}?) and positive groups, nodes and GPUs"
        ));
    }
    if !replicas.is_multiple_of(gpus) || !gpus.is_multiple_of(nodes) {
        return bad(format!(
            "replicas ({replicas}) must divide by GPUs ({gpus}), GPUs by nodes ({nodes})"
        ));
    }
    let (g, n) = if groups.is_multiple_of(nodes) {
        (groups, nodes)
    } else {
        (1, 1)
    };
    if e % g != 0 || (replicas / n) < e / n || e % n != 0 {
        return bad(format!(
            "experts ({e}) must divide into {g} groups and {n} nodes"
        ));
    }
    let mut out = Placement {
        phy2log: Vec::new(),
        log2phy: Vec::new(),
        logcnt: Vec::new(),
    };
    let mut ranks: Vec<Vec<usize>> = Vec::new();
    for w in weight {
        let (p2l, rank, cnt) = hierarchical(w, replicas, g, n, gpus);
        out.phy2log.push(p2l);
        ranks.push(rank);
        out.logcnt.push(cnt);
    }
    let maxcnt = out.logcnt.iter().flatten().copied().max().unwrap_or(1);
    for (l, p2l) in out.phy2log.iter().enumerate() {
        let mut m = vec![vec![-1i64; maxcnt]; e];
        for (slot, &x) in p2l.iter().enumerate() {
            m[x][ranks[l][slot]] = slot as i64;
        }
        out.log2phy.push(m);
    }
    Ok(out)
}

/// One layer of the hierarchical policy: slot -> logical, slot rank, logical counts.
fn hierarchical(
    w: &[f32],
    r: usize,
    g: usize,
    n: usize,
    p: usize,
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let e = w.len();
    let gs = e / g;
    // (1) groups onto nodes.
    let group_w: Vec<f32> = (0..g)
        .map(|k| w[k * gs..(k + 1) * gs].iter().fold(0f32, |a, &x| a + x))
        .collect();
    let (gpack, grank) = balanced_packing(&group_w, n);
    let log2mlog: Vec<usize> = (0..e)
        .map(|lg| {
            let (k, i) = (lg / gs, lg % gs);
            (gpack[k] * (g / n) + grank[k]) * gs + i
        })
        .collect();
    let mut mlog2log = vec![0; e];
    for (lg, &mlog) in log2mlog.iter().enumerate() {
        mlog2log[mlog] = lg;
    }
    // (2) replicas within each node; (3) replicas onto the node's GPUs.
    let (en, rn, per_gpu) = (e / n, r / n, r / p);
    let mut pphy2log = vec![0; r];
    let mut pphyrank = vec![0; r];
    let mut mlogcnt = vec![0; e];
    for node in 0..n {
        let local: Vec<f32> = (0..en).map(|j| w[mlog2log[node * en + j]]).collect();
        let (phy2mlog, phyrank, cnt) = replicate_experts(&local, rn);
        for j in 0..en {
            mlogcnt[node * en + j] = cnt[j];
        }
        let per_phy: Vec<f32> = phy2mlog.iter().map(|&j| local[j] / cnt[j] as f32).collect();
        let (gpu, rank_in_gpu) = balanced_packing(&per_phy, p / n);
        for (phy, (&gp, &rk)) in gpu.iter().zip(&rank_in_gpu).enumerate() {
            let slot = node * rn + gp * per_gpu + rk;
            pphy2log[slot] = mlog2log[node * en + phy2mlog[phy]];
            pphyrank[slot] = phyrank[phy];
        }
    }
    let logcnt = (0..e).map(|lg| mlogcnt[log2mlog[lg]]).collect();
    (pphy2log, pphyrank, logcnt)
}

/// Balancedness of a layer: mean over max of the per-GPU loads, where slot `s` carries
/// `w[phy2log[s]] / logcnt[phy2log[s]]` and GPU `k` holds slots `[k*R/P, (k+1)*R/P)`.
pub fn balancedness(w: &[f32], phy2log: &[usize], logcnt: &[usize], gpus: usize) -> f32 {
    let per = phy2log.len() / gpus.max(1);
    let loads: Vec<f32> = (0..gpus)
        .map(|k| {
            phy2log[k * per..(k + 1) * per]
                .iter()
                .map(|&x| w[x] / logcnt[x].max(1) as f32)
                .sum()
        })
        .collect();
    let max = loads.iter().copied().fold(0f32, f32::max);
    if max == 0.0 {
        return 1.0;
    }
    loads.iter().sum::<f32>() / gpus as f32 / max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_worked_example() {
        let w = vec![
            vec![
                90., 132., 40., 61., 104., 165., 39., 4., 73., 56., 183., 86.,
            ],
            vec![
                20., 107., 104., 64., 19., 197., 187., 157., 172., 86., 16., 27.,
            ],
        ];
        let Ok(p) = rebalance_experts(&w, 16, 4, 2, 8) else {
            panic!("the example is admissible")
        };
        assert_eq!(
            p.phy2log,
            vec![
                vec![5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                vec![7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
            ]
        );
        assert_eq!(p.logcnt[0], vec![1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]);
        for l in 0..2 {
            assert_eq!(p.logcnt[l].iter().sum::<usize>(), 16);
            // log2phy inverts phy2log, replica by replica.
            for (e, slots) in p.log2phy[l].iter().enumerate() {
                let live: Vec<i64> = slots.iter().copied().filter(|&s| s >= 0).collect();
                assert_eq!(live.len(), p.logcnt[l][e]);
                for s in live {
                    assert_eq!(p.phy2log[l][s as usize], e);
                }
            }
        }
    }

    #[test]
    fn global_policy_and_refusals() {
        // G % N != 0: global policy (one group, one node).
        let w = vec![vec![10., 1., 1., 1., 1., 1.]];
        let Ok(p) = rebalance_experts(&w, 8, 3, 2, 2) else {
            panic!("admissible")
        };
        assert_eq!(p.logcnt[0][0], 3, "the hot expert gets the extra replicas");
        assert!(balancedness(&w[0], &p.phy2log[0], &p.logcnt[0], 2) > 0.8);
        assert!(rebalance_experts(&w, 7, 1, 1, 2).is_err());
        assert!(rebalance_experts(&w, 4, 1, 1, 2).is_err());
    }
}
