//! EPLB on the GPU MoE layer (issue \[9\] items 2 and 5), on the graph check's synthetic layer (8
//! experts on 8 slots, split over 2 virtual EP ranks for the policy): a skewed routing's load counted by the
//! layer's device counters, `GpuLayer::rebalance` planning from them (SPEC §6) and moving every
//! per-slot buffer in place, then the same tokens' forward: bit-identical to the forward before,
//! since the rebalance only moved experts (SPEC §9), and a graph captured before the rebalance
//! replays the new placement with the same bits. Part of `moeforge selftest --gpu --moe`; GPU only.

use std::fmt::Write as _;

use crate::moe_graph_check::{layer, random_tokens, MODEL, RECIPES};
use crate::runtime::eplb_state::{EplbLayerState, Policy};
use crate::runtime::moves::SlotMap;
use crate::runtime::Device;
use crate::selftest_util::Rng;
use crate::Result;

/// The check's lines and verdict.
pub(crate) fn eplb_check(
    dev: &Device,
    rng: &mut Rng,
    settings: &crate::runtime::Settings,
) -> Result<(String, bool)> {
    let mut out = String::new();
    let mut all = true;
    let t = 96;
    let policy = Policy {
        groups: 1,
        nodes: 1,
        gpus: 2,
    };
    for recipe in RECIPES {
        let e = MODEL.experts;
        let mut layer = layer(dev, recipe, settings)?;
        layer.set_eplb(dev, Some(EplbLayerState::new(SlotMap::identity(e), 2, 10)?))?;
        let owned = random_tokens(rng, t, true);
        let tok = owned.tokens();
        let before = layer.forward(dev, &tok, false)?.output;
        // A graph captured before the rebalance replays the new placement after it.
        let graph = layer.capture(dev)?;
        layer.record_load(dev)?;
        let r = layer.rebalance(dev, policy)?;
        let after = layer.forward(dev, &tok, false)?.output;
        layer.clear_output(dev)?;
        layer.replay(&graph)?;
        let replayed = layer.finish(dev, false)?.output;
        let moved = layer.placement() != &SlotMap::identity(e);
        let ok = after == before
            && replayed == after
            && moved
            && r.changed_slots > 0
            && r.balance.1 > r.balance.0;
        all &= ok;
        let _ = writeln!(
            out,
            "moe layer eplb {:<14} T={t} k={}: balancedness {:.3} -> {:.3}, {} slots changed ({} bytes copied), placement {:?}; forward after == before ({}), a graph captured before replays it ({}): {}",
            recipe.name(),
            MODEL.top_k,
            r.balance.0,
            r.balance.1,
            r.changed_slots,
            r.bytes,
            layer.placement().phy2log(),
            if after == before { "same bits" } else { "DIFFERENT" },
            if replayed == after { "same bits" } else { "DIFFERENT" },
            if ok { "ok" } else { "FAIL" }
        );
    }
    Ok((out, all))
}
