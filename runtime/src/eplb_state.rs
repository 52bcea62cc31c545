//! A MoE layer's EPLB state and the executor that rebalances it.
//!
//! [`EplbLayerState`] holds the placement (`phy2log`, and `log2phy`/`logcnt` derived from it), the
//! per-slot load counters of the last `window` steps and the balancedness before and after the last
//! plan. A layer owns an `Option<EplbLayerState>`: `None` is EPLB off; there is no other switch.
//! [`EplbLayer::rebalance`] plans from the counters (SPEC §6's policy), rearranges every param of
//! the store in place, and switches the map only when every move succeeded.

use std::collections::VecDeque;

use crate::eplb::{balancedness, rebalance_experts};
use crate::moves::{MovePlan, SlotMap};
use crate::store::{ExpertStorage, MoveReport, ParamStore};
use crate::{Error, Result};

/// The policy's shape: SPEC §6's `num_groups`, `num_nodes`, `num_gpus` (the EP ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Expert groups (1: global policy).
    pub groups: usize,
    /// Nodes.
    pub nodes: usize,
    /// GPUs (EP ranks); slot `p` is on GPU `p / (R/gpus)`.
    pub gpus: usize,
}

/// One layer's EPLB state.
#[derive(Debug, Clone, PartialEq)]
pub struct EplbLayerState {
    map: SlotMap,
    /// `map.log2phy()`, kept because [`EplbLayerState::route`] runs per token.
    log2phy: Vec<Vec<usize>>,
    gpus: usize,
    window: usize,
    steps: VecDeque<Vec<u64>>,
    balance: Option<(f32, f32)>,
}

impl EplbLayerState {
    /// The default sliding window, in steps.
    pub const DEFAULT_WINDOW: usize = 1000;

    /// State over `map` on `gpus` ranks, counting the last `window` steps.
    pub fn new(map: SlotMap, gpus: usize, window: usize) -> Result<EplbLayerState> {
        if gpus == 0 || !map.slots().is_multiple_of(gpus) {
            return Err(Error::Placement(format!(
                "{} slots do not divide over {gpus} GPUs",
                map.slots()
            )));
        }
        if window == 0 {
            return Err(Error::Placement(
                "the load window must be at least 1 step".into(),
            ));
        }
        Ok(EplbLayerState {
            log2phy: map.log2phy(),
            map,
            gpus,
            window,
            steps: VecDeque::new(),
            balance: None,
        })
    }

    /// The placement.
    pub fn map(&self) -> &SlotMap {
        &self.map
    }

    /// Slot -> logical expert.
    pub fn phy2log(&self) -> &[usize] {
        self.map.phy2log()
    }

    /// Logical expert -> its slots (replica `r` is entry `r`).
    pub fn log2phy(&self) -> &[Vec<usize>] {
        &self.log2phy
    }

    /// Replicas per logical expert.
    pub fn logcnt(&self) -> Vec<usize> {
        self.map.logcnt()
    }

    /// The physical slot token `t`'s choice of logical expert `e` goes to (SPEC §9: replica
    /// `t mod logcnt[e]`).
    pub fn route(&self, token: usize, expert: usize) -> Option<usize> {
        let s = self.log2phy.get(expert)?;
        s.get(token % s.len().max(1)).copied()
    }

    /// Record one step's tokens per physical slot; the oldest step leaves the window.
    pub fn record(&mut self, per_slot: &[u64]) -> Result<()> {
        if per_slot.len() != self.map.slots() {
            return Err(Error::Placement(format!(
                "a step counted {} slots, the layer has {}",
                per_slot.len(),
                self.map.slots()
            )));
        }
        if self.steps.len() == self.window {
            self.steps.pop_front();
        }
        self.steps.push_back(per_slot.to_vec());
        Ok(())
    }

    /// Steps in the window.
    pub fn steps(&self) -> usize {
        self.steps.len()
    }

    /// The window's load per logical expert (its slots' counts summed, through the current map).
    pub fn logical_loads(&self) -> Vec<f32> {
        let mut w = vec![0f64; self.map.experts()];
        for step in &self.steps {
            for (p, &c) in step.iter().enumerate() {
                w[self.map.phy2log()[p]] += c as f64;
            }
        }
        w.into_iter().map(|x| x as f32).collect()
    }

    /// Balancedness (mean / max load per GPU) of the window's loads under the current map.
    pub fn balancedness(&self) -> f32 {
        balancedness(
            &self.logical_loads(),
            self.map.phy2log(),
            &self.map.logcnt(),
            self.gpus,
        )
    }

    /// The balancedness before and after the last plan.
    pub fn last_balance(&self) -> Option<(f32, f32)> {
        self.balance
    }

    /// Plan a new placement from the window's loads (same slot count).
    pub fn plan(&self, policy: Policy) -> Result<SlotMap> {
        if policy.gpus != self.gpus {
            return Err(Error::Placement(format!(
                "the policy spreads over {} GPUs, the layer over {}",
                policy.gpus, self.gpus
            )));
        }
        let w = self.logical_loads();
        let p = rebalance_experts(
            std::slice::from_ref(&w),
            self.map.slots(),
            policy.groups,
            policy.nodes,
            policy.gpus,
        )
        .map_err(|e| Error::Placement(e.to_string()))?;
        let row = p
            .phy2log
            .into_iter()
            .next()
            .ok_or_else(|| Error::Placement("the policy returned no layer".into()))?;
        SlotMap::new(row, self.map.experts())
    }

    /// Record that the layer now holds `map` (same slots and experts), after every per-slot buffer
    /// it serves from moved to it: a layer whose buffers are not a [`ParamStore`] (a GPU layer's
    /// GEMM operands) calls this once its own rearrangement succeeded. Returns the balancedness of
    /// the window's loads before and after; the counters restart.
    pub fn moved_to(&mut self, map: SlotMap) -> Result<(f32, f32)> {
        if map.slots() != self.map.slots() || map.experts() != self.map.experts() {
            return Err(Error::Placement(format!(
                "a map of {} slots over {} experts for a layer of {} over {}",
                map.slots(),
                map.experts(),
                self.map.slots(),
                self.map.experts()
            )));
        }
        let before = self.balancedness();
        self.switch(map, before);
        Ok(self.balance.unwrap_or((before, before)))
    }

    /// Switch to `map` (after every param moved): the counters restart, since they counted the
    /// old slots.
    fn switch(&mut self, map: SlotMap, before: f32) {
        let w = self.logical_loads();
        let after = balancedness(&w, map.phy2log(), &map.logcnt(), self.gpus);
        self.balance = Some((before, after));
        self.log2phy = map.log2phy();
        self.map = map;
        self.steps.clear();
    }
}

/// What a rebalance did.
#[derive(Debug, Clone, PartialEq)]
pub struct Rebalance {
    /// Balancedness of the window's loads before and after.
    pub balance: (f32, f32),
    /// Slots whose expert changed (over all ranks).
    pub changed_slots: usize,
    /// This rank's bytes.
    pub moved: MoveReport,
}

/// A layer's params on one rank with its EPLB state (`None`: EPLB off).
pub struct EplbLayer<S: ExpertStorage> {
    /// The params.
    pub store: ParamStore<S>,
    /// The EPLB state; `None` means EPLB is off.
    pub eplb: Option<EplbLayerState>,
}

impl<S: ExpertStorage> EplbLayer<S> {
    /// Plan from the counters and rearrange in place; the map switches only after every param
    /// moved. With EPLB off this is an error, not a no-op.
    pub fn rebalance(&mut self, policy: Policy, transport: &S::Transport) -> Result<Rebalance> {
        let state = self
            .eplb
            .as_ref()
            .ok_or_else(|| Error::Placement("EPLB is off for this layer".into()))?;
        let new = state.plan(policy)?;
        self.move_to(new, transport)
    }

    /// Rearrange in place to `new` (every rank calls this with the same map).
    pub fn move_to(&mut self, new: SlotMap, transport: &S::Transport) -> Result<Rebalance> {
        let state = self
            .eplb
            .as_mut()
            .ok_or_else(|| Error::Placement("EPLB is off for this layer".into()))?;
        if state.map() != self.store.placement() {
            return Err(Error::Placement(
                "the EPLB map and the store's placement differ".into(),
            ));
        }
        let before = state.balancedness();
        let plan = MovePlan::new(state.map(), &new, state.gpus)?;
        let moved = self.store.rearrange(&plan, transport)?;
        let changed_slots = plan.changed_slots();
        state.switch(new, before);
        Ok(Rebalance {
            balance: state.last_balance().unwrap_or((before, before)),
            changed_slots,
            moved,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_window_slides_and_counts_through_the_map() {
        let map = SlotMap::new(vec![0, 1, 2, 0], 3).unwrap();
        let mut s = EplbLayerState::new(map, 2, 2).unwrap();
        s.record(&[1, 2, 3, 4]).unwrap();
        s.record(&[1, 0, 0, 0]).unwrap();
        assert_eq!(s.logical_loads(), vec![6.0, 2.0, 3.0]);
        s.record(&[0, 0, 0, 10]).unwrap();
        assert_eq!(s.steps(), 2);
        assert_eq!(s.logical_loads(), vec![11.0, 0.0, 0.0]);
        assert!(s.record(&[1, 2]).is_err());
        assert_eq!(
            s.route(5, 0),
            Some(3),
            "token 5 takes replica 5 mod 2 = 1 of expert 0"
        );
        assert_eq!(s.logcnt(), vec![2, 1, 1]);
    }

    #[test]
    fn a_skewed_load_is_rebalanced() {
        let mut s = EplbLayerState::new(SlotMap::identity(8), 4, 10).unwrap();
        s.record(&[100, 90, 1, 1, 1, 1, 1, 1]).unwrap();
        let before = s.balancedness();
        let new = s
            .plan(Policy {
                groups: 1,
                nodes: 1,
                gpus: 4,
            })
            .unwrap();
        let after = balancedness(&s.logical_loads(), new.phy2log(), &new.logcnt(), 4);
        assert!(after > before, "{before} -> {after}");
        assert!(EplbLayerState::new(SlotMap::identity(6), 4, 10).is_err());
    }
}
