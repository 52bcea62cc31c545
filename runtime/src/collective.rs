//! Collectives over typed process groups: where this process sits in `moe_tp`, `ep` and `tp`, MAX
//! all-reduces (scales that do not depend on how a checkpoint is sharded) and point-to-point byte
//! exchange (experts that move between ranks).
//!
//! Implementations: [`SingleRank`] (one process is the whole world), [`InProcess`] (ranks are
//! threads of one process, for tests and for `pack --moe-tp`), and NCCL on the GPU
//! ([`crate::nccl`]). A program step over a group whose implementation is missing is an error
//! ([`Error::MissingCollective`]), never a skipped step.
//!
//! [`Collective`] works on host memory; [`DeviceCollective`] is its GPU twin, on device buffers and
//! queued on a [`Device`]'s stream between the kernels: [`SingleDevice`] (a world of one GPU) and
//! [`crate::nccl::NcclWorld`] implement it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
pub use moeforge_dsl::ir::Group;

use crate::{drv, Device, Error, Result};

/// How a world of `ep * moe_tp` ranks splits into groups: rank `r` is EP rank `r / moe_tp` and
/// MoE-TP rank `r % moe_tp`; `tp` spans the whole world; `none` is the rank alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    /// Ranks holding different experts.
    pub ep: usize,
    /// Ranks splitting one expert.
    pub moe_tp: usize,
}

impl Topology {
    /// One rank.
    pub const SINGLE: Topology = Topology { ep: 1, moe_tp: 1 };

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.ep * self.moe_tp
    }

    /// `rank`'s position in its group `g`.
    pub fn rank_in(&self, g: Group, rank: usize) -> usize {
        self.members(g, rank)
            .iter()
            .position(|&m| m == rank)
            .unwrap_or(0)
    }

    /// The world ranks of `rank`'s group `g`, ascending; `rank`'s position in it is its group rank.
    pub fn members(&self, g: Group, rank: usize) -> Vec<usize> {
        match g {
            Group::None => vec![rank],
            Group::Tp => (0..self.world()).collect(),
            Group::MoeTp => {
                let base = rank / self.moe_tp * self.moe_tp;
                (base..base + self.moe_tp).collect()
            }
            Group::Ep => (0..self.ep)
                .map(|e| e * self.moe_tp + rank % self.moe_tp)
                .collect(),
        }
    }
}

/// A process's collectives, by typed group. Ranks passed to [`Collective::exchange`] are group
/// ranks (positions in [`Topology::members`]).
pub trait Collective: Send + Sync {
    /// The world's shape.
    fn topology(&self) -> Topology;
    /// This process's world rank.
    fn world_rank(&self) -> usize;
    /// This process's rank within group `g`.
    fn rank(&self, g: Group) -> usize {
        self.topology().rank_in(g, self.world_rank())
    }
    /// The size of group `g`.
    fn size(&self, g: Group) -> usize {
        self.topology().members(g, self.world_rank()).len()
    }
    /// Replace each value by its maximum over `g`'s ranks (every rank passes the same length).
    fn all_reduce_max(&self, g: Group, data: &mut [f32]) -> Result<()>;
    /// One grouped exchange within `g`: each `(peer, bytes)` of `sends` goes to group rank `peer`,
    /// each `(peer, buffer)` of `recvs` is filled from `peer`. Messages between one pair arrive in
    /// the order they were given (both sides list them in the same order).
    fn exchange(
        &self,
        g: Group,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()>;
}

/// Adapts a [`Collective`] to the pack programs' hook.
pub struct Hook<'a>(pub &'a dyn Collective);

impl moeforge_codegen::Collective for Hook<'_> {
    fn all_reduce_max(&self, group: Group, data: &mut [f32]) -> moeforge_codegen::Result<()> {
        self.0
            .all_reduce_max(group, data)
            .map_err(|e| moeforge_codegen::Error::Collective {
                group: group.name().to_string(),
                why: e.to_string(),
            })
    }
}

/// One process that is the whole world: every group has one rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn topology(&self) -> Topology {
        Topology::SINGLE
    }
    fn world_rank(&self) -> usize {
        0
    }
    fn all_reduce_max(&self, _g: Group, _data: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn exchange(
        &self,
        g: Group,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        // A message to oneself is a copy, in order.
        let mut queue: VecDeque<&[u8]> = VecDeque::new();
        for (peer, b) in sends {
            check_peer(g, *peer, 1)?;
            queue.push_back(b);
        }
        for (peer, buf) in recvs.iter_mut() {
            check_peer(g, *peer, 1)?;
            let m = queue.pop_front().ok_or_else(|| Error::Collective {
                group: g.name(),
                why: "a receive has no matching send".into(),
            })?;
            copy_message(g, m, buf)?;
        }
        Ok(())
    }
}

fn check_peer(g: Group, peer: usize, size: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::Collective {
            group: g.name(),
            why: format!("peer {peer} is not a rank of a group of {size}"),
        });
    }
    Ok(())
}

fn copy_message(g: Group, m: &[u8], buf: &mut [u8]) -> Result<()> {
    if m.len() != buf.len() {
        return Err(Error::Collective {
            group: g.name(),
            why: format!(
                "a message of {} bytes arrived for a {}-byte buffer",
                m.len(),
                buf.len()
            ),
        });
    }
    buf.copy_from_slice(m);
    Ok(())
}

/// Reductions waiting for their group: `(group, first member, sequence)` -> values so far.
type Pending = HashMap<(Group, usize, u64), Reduction>;

/// Messages in flight: `(from, to)` world ranks -> messages, oldest first.
type Mail = HashMap<(usize, usize), VecDeque<Vec<u8>>>;

struct Reduction {
    acc: Vec<f32>,
    arrived: usize,
    left: usize,
}

#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    reduced: Condvar,
    mail: Mutex<Mail>,
    delivered: Condvar,
}

/// Ranks that are threads of one process: [`InProcess::world`] makes one handle per rank, each
/// handed to its own thread.
pub struct InProcess {
    topo: Topology,
    rank: usize,
    shared: Arc<Shared>,
    /// Per group: the number of reductions this rank has entered.
    seq: Mutex<HashMap<Group, u64>>,
    timeout: Duration,
}

impl InProcess {
    /// One handle per rank of `topo` (index = world rank).
    pub fn world(topo: Topology) -> Vec<InProcess> {
        let shared = Arc::new(Shared::default());
        (0..topo.world())
            .map(|rank| InProcess {
                topo,
                rank,
                shared: shared.clone(),
                seq: Mutex::new(HashMap::new()),
                timeout: Duration::from_secs(120),
            })
            .collect()
    }

    fn poisoned(g: Group) -> Error {
        Error::Collective {
            group: g.name(),
            why: "another rank panicked".into(),
        }
    }

    fn timed_out(g: Group, what: &str) -> Error {
        Error::Collective {
            group: g.name(),
            why: format!("{what} timed out: a rank did not take part"),
        }
    }
}

impl Collective for InProcess {
    fn topology(&self) -> Topology {
        self.topo
    }

    fn world_rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_max(&self, g: Group, data: &mut [f32]) -> Result<()> {
        let members = self.topo.members(g, self.rank);
        if members.len() == 1 {
            return Ok(());
        }
        let seq = {
            let mut s = self.seq.lock().map_err(|_| Self::poisoned(g))?;
            let n = s.entry(g).or_insert(0);
            *n += 1;
            *n
        };
        let key = (g, members[0], seq);
        let mut p = self.shared.pending.lock().map_err(|_| Self::poisoned(g))?;
        let r = p.entry(key).or_insert_with(|| Reduction {
            acc: vec![f32::NEG_INFINITY; data.len()],
            arrived: 0,
            left: members.len(),
        });
        if r.acc.len() != data.len() {
            return Err(Error::Collective {
                group: g.name(),
                why: format!(
                    "ranks reduce different lengths ({} and {})",
                    r.acc.len(),
                    data.len()
                ),
            });
        }
        for (a, &x) in r.acc.iter_mut().zip(data.iter()) {
            // NaN wins, as in a MAX reduction that propagates NaN.
            *a = if x.is_nan() || a.is_nan() {
                f32::NAN
            } else {
                a.max(x)
            };
        }
        r.arrived += 1;
        self.shared.reduced.notify_all();
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            let Some(r) = p.get_mut(&key) else {
                return Err(Error::Collective {
                    group: g.name(),
                    why: "a reduction vanished".into(),
                });
            };
            if r.arrived == members.len() {
                data.copy_from_slice(&r.acc);
                r.left -= 1;
                if r.left == 0 {
                    p.remove(&key);
                }
                return Ok(());
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(Self::timed_out(g, "all-reduce"));
            }
            p = self
                .shared
                .reduced
                .wait_timeout(p, deadline - now)
                .map_err(|_| Self::poisoned(g))?
                .0;
        }
    }

    fn exchange(
        &self,
        g: Group,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        let members = self.topo.members(g, self.rank);
        {
            let mut mail = self.shared.mail.lock().map_err(|_| Self::poisoned(g))?;
            for (peer, b) in sends {
                check_peer(g, *peer, members.len())?;
                mail.entry((self.rank, members[*peer]))
                    .or_default()
                    .push_back(b.to_vec());
            }
        }
        self.shared.delivered.notify_all();
        let deadline = std::time::Instant::now() + self.timeout;
        for (peer, buf) in recvs.iter_mut() {
            check_peer(g, *peer, members.len())?;
            let from = members[*peer];
            let mut mail = self.shared.mail.lock().map_err(|_| Self::poisoned(g))?;
            loop {
                if let Some(m) = mail.get_mut(&(from, self.rank)).and_then(|q| q.pop_front()) {
                    copy_message(g, &m, buf)?;
                    break;
                }
                let now = std::time::Instant::now();
                if now >= deadline {
                    return Err(Self::timed_out(g, "receive"));
                }
                mail = self
                    .shared
                    .delivered
                    .wait_timeout(mail, deadline - now)
                    .map_err(|_| Self::poisoned(g))?
                    .0;
            }
        }
        Ok(())
    }
}

/// A process's collectives on device buffers, by typed group: the GPU twin of [`Collective`]. Work
/// is queued on the [`Device`]'s stream (stream-ordered after the kernels queued before it and before
/// those queued after); nothing here waits for the GPU. Ranks passed to
/// [`DeviceCollective::exchange`] are group ranks (positions in [`Topology::members`]).
///
/// Not `Send` or `Sync` by requirement: an NCCL communicator belongs to the thread that made it.
pub trait DeviceCollective {
    /// The world's shape.
    fn topology(&self) -> Topology;
    /// This process's world rank.
    fn world_rank(&self) -> usize;
    /// This process's rank within group `g`.
    fn rank(&self, g: Group) -> usize {
        self.topology().rank_in(g, self.world_rank())
    }
    /// The size of group `g`.
    fn size(&self, g: Group) -> usize {
        self.topology().members(g, self.world_rank()).len()
    }
    /// Whether this collective can reduce and exchange over `g` (a group of one always can; a larger
    /// one needs a communicator for it).
    fn supports(&self, g: Group) -> bool;
    /// Replace each f32 of `data` (little-endian bytes, a whole number of values; every rank passes
    /// the same length) by its maximum over `g`'s ranks, in place.
    fn all_reduce_max(&self, g: Group, data: &mut CudaSlice<u8>, dev: &Device) -> Result<()>;
    /// One grouped exchange within `g` (for NCCL: one `ncclGroupStart`/`ncclGroupEnd`): each
    /// `(peer, bytes)` of `sends` goes to group rank `peer`, each `(peer, buffer)` of `recvs` is
    /// filled from `peer`, whose message must have the buffer's length. Messages between one pair
    /// arrive in the order they were given (both sides list them in the same order).
    fn exchange(
        &self,
        g: Group,
        sends: &[(usize, CudaView<'_, u8>)],
        recvs: &mut [(usize, CudaViewMut<'_, u8>)],
        dev: &Device,
    ) -> Result<()>;
}

/// One GPU that is the whole world: every group has one rank, reductions are the identity (the right
/// answer, not a skipped step) and an exchange is a stream-ordered copy from each send to the receive
/// in the same position.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleDevice;

impl DeviceCollective for SingleDevice {
    fn topology(&self) -> Topology {
        Topology::SINGLE
    }
    fn world_rank(&self) -> usize {
        0
    }
    fn supports(&self, _g: Group) -> bool {
        true
    }
    fn all_reduce_max(&self, g: Group, data: &mut CudaSlice<u8>, _dev: &Device) -> Result<()> {
        f32_count(g, data.len()).map(|_| ())
    }
    fn exchange(
        &self,
        g: Group,
        sends: &[(usize, CudaView<'_, u8>)],
        recvs: &mut [(usize, CudaViewMut<'_, u8>)],
        dev: &Device,
    ) -> Result<()> {
        self_exchange(g, sends, recvs, dev)
    }
}

/// The number of f32 values in `bytes` bytes, or an error when it is not a whole number.
pub(crate) fn f32_count(g: Group, bytes: usize) -> Result<usize> {
    if !bytes.is_multiple_of(4) {
        return Err(Error::Collective {
            group: g.name(),
            why: format!(
                "a MAX all-reduce of f32 over {bytes} bytes (not a whole number of values)"
            ),
        });
    }
    Ok(bytes / 4)
}

/// Which receive each send of an exchange with oneself fills: `(send, recv)` index pairs, in order
/// (the n-th message goes to the n-th receive). `sends` and `recvs` are `(peer, bytes)`; every peer
/// must be 0, the counts and each pair's lengths equal.
pub fn self_exchange_pairs(
    g: Group,
    sends: &[(usize, usize)],
    recvs: &[(usize, usize)],
) -> Result<Vec<(usize, usize)>> {
    for (peer, _) in sends.iter().chain(recvs) {
        check_peer(g, *peer, 1)?;
    }
    if sends.len() != recvs.len() {
        return Err(Error::Collective {
            group: g.name(),
            why: format!(
                "{} messages sent to oneself but {} receives",
                sends.len(),
                recvs.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(sends.len());
    for (k, (s, r)) in sends.iter().zip(recvs).enumerate() {
        if s.1 != r.1 {
            return Err(Error::Collective {
                group: g.name(),
                why: format!(
                    "a message of {} bytes arrived for a {}-byte buffer",
                    s.1, r.1
                ),
            });
        }
        out.push((k, k));
    }
    Ok(out)
}

/// An exchange within a group of one: each message copied, stream-ordered, into its receive.
pub(crate) fn self_exchange(
    g: Group,
    sends: &[(usize, CudaView<'_, u8>)],
    recvs: &mut [(usize, CudaViewMut<'_, u8>)],
    dev: &Device,
) -> Result<()> {
    let s: Vec<(usize, usize)> = sends.iter().map(|(p, v)| (*p, v.len())).collect();
    let r: Vec<(usize, usize)> = recvs.iter().map(|(p, v)| (*p, v.len())).collect();
    for (si, ri) in self_exchange_pairs(g, &s, &r)? {
        let (Some((_, from)), Some((_, to))) = (sends.get(si), recvs.get_mut(ri)) else {
            continue;
        };
        if from.is_empty() {
            continue;
        }
        dev.stream
            .memcpy_dtod(from, to)
            .map_err(drv("cuMemcpyDtoDAsync"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_split_the_world() {
        let t = Topology { ep: 2, moe_tp: 3 };
        assert_eq!(t.members(Group::MoeTp, 4), vec![3, 4, 5]);
        assert_eq!(t.members(Group::Ep, 4), vec![1, 4]);
        assert_eq!(t.members(Group::Tp, 4), (0..6).collect::<Vec<_>>());
        assert_eq!(t.members(Group::None, 4), vec![4]);
    }

    #[test]
    fn threads_reduce_within_their_group_and_exchange() {
        let t = Topology { ep: 2, moe_tp: 2 };
        let world = InProcess::world(t);
        let out: Vec<(Vec<f32>, Vec<f32>, Vec<u8>)> = std::thread::scope(|s| {
            let hs: Vec<_> = world
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.world_rank();
                        let mut a = vec![r as f32, -(r as f32)];
                        c.all_reduce_max(Group::MoeTp, &mut a)
                            .map_err(|e| e.to_string())?;
                        let mut b = vec![r as f32 * 10.0];
                        c.all_reduce_max(Group::Ep, &mut b)
                            .map_err(|e| e.to_string())?;
                        // Ring within ep: send my rank byte to the other ep rank.
                        let me = c.rank(Group::Ep);
                        let other = 1 - me;
                        let msg = [r as u8, 7];
                        let mut got = [0u8; 2];
                        c.exchange(Group::Ep, &[(other, &msg)], &mut [(other, &mut got)])
                            .map_err(|e| e.to_string())?;
                        Ok::<_, String>((a, b, got.to_vec()))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().ok().and_then(|r| r.ok()).unwrap_or_default())
                .collect()
        });
        assert_eq!(out[0].0, vec![1.0, 0.0]);
        assert_eq!(out[3].0, vec![3.0, -2.0]);
        assert_eq!(out[0].1, vec![20.0]);
        assert_eq!(out[1].1, vec![30.0]);
        assert_eq!(out[0].2, vec![2, 7]);
        assert_eq!(out[3].2, vec![1, 7]);
    }

    #[test]
    fn a_missing_rank_times_out_with_an_error() {
        let mut world = InProcess::world(Topology { ep: 1, moe_tp: 2 });
        world[0].timeout = Duration::from_millis(50);
        let e = world[0].all_reduce_max(Group::MoeTp, &mut [1.0]);
        assert!(matches!(e, Err(Error::Collective { .. })), "{e:?}");
    }

    #[test]
    fn a_single_device_is_a_world_of_one() {
        let c = SingleDevice;
        for g in [Group::None, Group::Tp, Group::MoeTp, Group::Ep] {
            assert_eq!(c.size(g), 1);
            assert_eq!(c.rank(g), 0);
            assert!(c.supports(g));
        }
        assert_eq!(f32_count(Group::Tp, 12).ok(), Some(3));
        assert!(matches!(
            f32_count(Group::Tp, 6),
            Err(Error::Collective { group: "tp", .. })
        ));
    }

    #[test]
    fn an_exchange_with_oneself_pairs_messages_in_order() {
        let g = Group::Ep;
        assert_eq!(
            self_exchange_pairs(g, &[(0, 4), (0, 9)], &[(0, 4), (0, 9)]).ok(),
            Some(vec![(0, 0), (1, 1)])
        );
        assert_eq!(self_exchange_pairs(g, &[], &[]).ok(), Some(vec![]));
        for (sends, recvs, says) in [
            (
                vec![(1, 4)],
                vec![(0, 4)],
                "peer 1 is not a rank of a group of 1",
            ),
            (
                vec![(0, 4)],
                vec![(0, 4), (0, 4)],
                "1 messages sent to oneself but 2",
            ),
            (
                vec![(0, 4)],
                vec![(0, 5)],
                "a message of 4 bytes arrived for a 5-byte",
            ),
        ] {
            match self_exchange_pairs(g, &sends, &recvs) {
                Err(Error::Collective { group: "ep", why }) => assert!(why.contains(says), "{why}"),
                other => panic!("expected an error saying `{says}`, got {other:?}"),
            }
        }
    }
}
