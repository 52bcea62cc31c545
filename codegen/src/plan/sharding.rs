//! How a rank's inputs are cut from the whole checkpoint's: the planning input that places the
//! all-reduce steps which make scales independent of the TP/EP layout (one checkpoint, the same
//! bytes under any layout).
//!
//! A rank of `moe_tp` holds a slice of each expert's tensors (w13's rows, w2's columns); a rank of
//! `ep` holds whole experts, a slice of the expert dimension. Where a slice cuts the region an amax
//! is taken over (an expert's whole tensor, a row that the columns' cut splits), the planner
//! MAX-reduces that amax over the cutting group before any scale is derived; where it would cut a
//! quantization block, planning is refused ([`crate::Error::CutBlock`]). The default, [`Sharding`]
//! with no input split, plans exactly what it planned before sharding existed.

use std::collections::BTreeMap;

use moeforge_dsl::ir::Group;

/// One input's cut over `moe_tp`: the dimension, and how many contiguous runs of the whole tensor
/// the rank's extent along it is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Split {
    /// The dimension cut: 1 for the rows, 2 for the columns of an `[E, M, K]` input.
    pub dim: usize,
    /// Runs of equal length making up the rank's extent: 2 for w13's rows (its gate rows, then the
    /// same up rows), 1 for w2's columns. Every run starts at a multiple of its length in the whole
    /// tensor's run, so a block lies within one rank when the run length is a multiple of it.
    pub runs: i64,
}

/// How one input is sharded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Shard {
    /// The cut over `moe_tp`, if the input is split over more than one rank of it.
    pub moe_tp: Option<Split>,
    /// Whether its experts (dim 0) are divided over more than one rank of `ep`.
    pub ep: bool,
}

impl Shard {
    /// Whether the input is whole on this rank.
    pub fn is_whole(&self) -> bool {
        self.moe_tp.is_none() && !self.ep
    }

    /// The groups a MAX over the whole of this input (every expert, every element) must reduce
    /// over, so that it equals the unsharded one.
    pub fn whole_max_groups(&self) -> Vec<Group> {
        let mut g = Vec::new();
        if self.moe_tp.is_some() {
            g.push(Group::MoeTp);
        }
        if self.ep {
            g.push(Group::Ep);
        }
        g
    }
}

/// Per input (by its recipe name), how this rank's slice is cut; inputs not named are whole. A cut
/// over a group of one rank is no cut: leave it out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sharding {
    inputs: BTreeMap<String, Shard>,
}

impl Sharding {
    /// Every input whole: the plan of one process packing the whole checkpoint.
    pub fn unsplit() -> Sharding {
        Sharding::default()
    }

    /// `input` cut along `dim` over `moe_tp`, its rank's extent made of `runs` runs.
    pub fn with_moe_tp(mut self, input: &str, dim: usize, runs: i64) -> Sharding {
        self.inputs.entry(input.to_string()).or_default().moe_tp = Some(Split { dim, runs });
        self
    }

    /// `input`'s experts divided over `ep`.
    pub fn with_ep(mut self, input: &str) -> Sharding {
        self.inputs.entry(input.to_string()).or_default().ep = true;
        self
    }

    /// How `input` is cut (whole when not named).
    pub fn of(&self, input: &str) -> Shard {
        self.inputs.get(input).copied().unwrap_or_default()
    }

    /// Whether every input is whole.
    pub fn is_unsplit(&self) -> bool {
        self.inputs.values().all(Shard::is_whole)
    }

    /// The inputs that are cut, with their cuts.
    pub fn cut(&self) -> impl Iterator<Item = (&str, Shard)> + '_ {
        self.inputs
            .iter()
            .filter(|(_, s)| !s.is_whole())
            .map(|(n, s)| (n.as_str(), *s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_unsplit_and_cuts_are_recorded() {
        assert!(Sharding::default().is_unsplit());
        let s = Sharding::unsplit()
            .with_moe_tp("w13", 1, 2)
            .with_ep("w13")
            .with_ep("w2");
        assert!(!s.is_unsplit());
        assert_eq!(
            s.of("w13"),
            Shard {
                moe_tp: Some(Split { dim: 1, runs: 2 }),
                ep: true
            }
        );
        assert_eq!(s.of("w2").whole_max_groups(), vec![Group::Ep]);
        assert!(s.of("w13_input_scale").is_whole());
        assert_eq!(s.cut().count(), 2);
    }
}
