//! NCCL on the GPU: the library loaded by moeforge itself, communicators, and a world of them that
//! implements [`DeviceCollective`].
//!
//! cudarc's own NCCL loader is not used: it never tries `libnccl.so.2` (NCCL's real soname, often the
//! only name installed, e.g. by PyTorch's wheels or `libnccl2`), panics when nothing loads, and its
//! `Comm` aborts instead of finalizing on drop. Here the library is loaded with `libloading` from, in
//! order, an explicit path ([`crate::Settings::nccl_path`]; the `moeforge` command reads it from
//! `MOEFORGE_NCCL_SO_PATH`), `libnccl.so.2`, then `libnccl.so` ([`Nccl::candidates`]); when none loads
//! (or one lacks a symbol) the answer is [`Error::NoNccl`] naming every candidate and why it failed.
//! Only the symbols used are resolved, with cudarc's NCCL type definitions (`cudarc::nccl::sys`).
//!
//! Results are read as the raw C `int`, never as cudarc's `ncclResult_t` enum: a newer NCCL may return
//! a code the bindings lack (2.30 added `ncclTimeout`), and an unknown discriminant in a Rust enum is
//! undefined behaviour. Known codes are named with `ncclResult_t`'s values.
//!
//! Two ranks in one process are two threads, one per GPU, each opening its [`Device`] and its
//! [`NcclComm`] itself ([`UniqueId`] is `Copy` and is made once); NCCL refuses two ranks on one GPU.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

use crate::collective::{self, DeviceCollective, Group, Topology};
use crate::{Device, Error, Result};

/// NCCL's sonames, tried in this order after an explicit path.
pub const SONAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// An NCCL result as the C function returns it.
type Code = c_uint;

const SUCCESS: Code = ncclResult_t::ncclSuccess as Code;

/// The name of an NCCL result code (`ncclInvalidUsage`), or `ncclResult 9` for a code this build's
/// bindings do not know.
pub fn result_name(code: u32) -> String {
    use ncclResult_t::*;
    [
        ncclSuccess,
        ncclUnhandledCudaError,
        ncclSystemError,
        ncclInternalError,
        ncclInvalidArgument,
        ncclInvalidUsage,
        ncclRemoteError,
        ncclInProgress,
    ]
    .into_iter()
    .find(|r| *r as u32 == code)
    .map_or_else(|| format!("ncclResult {code}"), |r| format!("{r:?}"))
}

/// A loaded NCCL library: the entry points moeforge calls.
pub struct Nccl {
    path: PathBuf,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Code,
    comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> Code,
    comm_finalize: unsafe extern "C" fn(ncclComm_t) -> Code,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Code,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut Code) -> Code,
    group_start: unsafe extern "C" fn() -> Code,
    group_end: unsafe extern "C" fn() -> Code,
    send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> Code,
    recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> Code,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> Code,
    get_error_string: unsafe extern "C" fn(Code) -> *const c_char,
    /// Keeps the entry points above valid; never unloaded while `self` lives.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl").field("path", &self.path).finish()
    }
}

static LOADED: OnceLock<Nccl> = OnceLock::new();

impl Nccl {
    /// The libraries tried, in order: `explicit` (when given), then [`SONAMES`] (found by the dynamic
    /// loader's search: `LD_LIBRARY_PATH`, the ld.so cache, the system folders).
    pub fn candidates(explicit: Option<&Path>) -> Vec<PathBuf> {
        explicit
            .map(Path::to_path_buf)
            .into_iter()
            .chain(SONAMES.iter().map(PathBuf::from))
            .collect()
    }

    /// The process's NCCL: on the first successful call, the first of
    /// [`Nccl::candidates`]`(explicit)` that loads and has every entry point, kept for the life of the
    /// process; later calls return that library whatever `explicit` says (one process, one NCCL:
    /// [`Nccl::path`] says which). A failure is not remembered, so a later call may try again.
    pub fn load(explicit: Option<&Path>) -> Result<&'static Nccl> {
        if let Some(n) = LOADED.get() {
            return Ok(n);
        }
        let n = Nccl::open_first(&Nccl::candidates(explicit))?;
        // Another thread may have won the race: its library is kept and this one dropped (a
        // reference count in the dynamic loader; the same file stays loaded).
        let _ = LOADED.set(n);
        LOADED.get().ok_or_else(|| Error::NoNccl {
            tried: vec!["(the loaded library vanished)".into()],
        })
    }

    /// The first of `candidates` that loads and has every entry point, not kept anywhere (tests and
    /// tools; [`Nccl::load`] is the process's library). [`Error::NoNccl`] names every candidate with
    /// the reason it failed.
    pub fn open_first(candidates: &[PathBuf]) -> Result<Nccl> {
        let mut tried = Vec::new();
        for c in candidates {
            match Nccl::open(c) {
                Ok(n) => return Ok(n),
                Err(why) => tried.push(format!("{} ({why})", c.display())),
            }
        }
        Err(Error::NoNccl { tried })
    }

    fn open(path: &Path) -> std::result::Result<Nccl, String> {
        // SAFETY: loading runs the library's initialisers; NCCL's (and any library a caller names as
        // NCCL) are the usual C++ static constructors, which moeforge does not depend on or race with.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is looked up by its C name and given the signature nccl.h
                // declares for it in every NCCL 2.x that has it (send/recv since 2.7, finalize since
                // 2.14), the result read as a 32-bit integer (the C enum's size); the pointer is copied
                // out and stays valid while `_lib` holds the library.
                *unsafe { lib.get($name) }.map_err(|e| format!("no `{}`: {e}", $name))?
            };
        }
        Ok(Nccl {
            path: path.to_path_buf(),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_finalize: sym!("ncclCommFinalize"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            all_reduce: sym!("ncclAllReduce"),
            get_error_string: sym!("ncclGetErrorString"),
            _lib: lib,
        })
    }

    /// Where this library was loaded from (as tried: a soname is resolved by the dynamic loader).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `Ok` for `ncclSuccess`, else [`Error::Nccl`] with the code's name and NCCL's message.
    fn check(&self, call: &'static str, code: Code) -> Result<()> {
        if code == SUCCESS {
            return Ok(());
        }
        // SAFETY: `ncclGetErrorString` takes any result code and returns a pointer to a static,
        // NUL-terminated string (or null, handled below).
        let msg = unsafe { (self.get_error_string)(code) };
        let text = if msg.is_null() {
            String::new()
        } else {
            // SAFETY: non-null and NUL-terminated, owned by the library (static storage).
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        Err(Error::Nccl {
            call,
            detail: format!("{}: {text}", result_name(code)),
        })
    }
}

/// An NCCL unique id (the 128 bytes every rank of one communicator must be given), with the library
/// that made it. Made once ([`UniqueId::new`]) and copied to every rank: by value to threads, as
/// [`UniqueId::to_bytes`] to other processes.
#[derive(Clone, Copy)]
pub struct UniqueId {
    id: ncclUniqueId,
    nccl: &'static Nccl,
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// A new id (`ncclGetUniqueId`: it also starts the bootstrap root that the ranks contact, in this
    /// process).
    pub fn new(nccl: &'static Nccl) -> Result<UniqueId> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: the out-pointer is a valid, writable ncclUniqueId.
        nccl.check("ncclGetUniqueId", unsafe { (nccl.get_unique_id)(&mut id) })?;
        Ok(UniqueId { id, nccl })
    }

    /// An id received from the process that made it.
    pub fn from_bytes(nccl: &'static Nccl, bytes: [u8; 128]) -> UniqueId {
        UniqueId {
            id: ncclUniqueId {
                internal: bytes.map(|b| b as c_char),
            },
            nccl,
        }
    }

    /// The id's bytes, to send to the other processes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.id.internal.map(|c| c as u8)
    }
}

/// One message of a grouped exchange, in the order it is enqueued: send `sends[index]` or fill
/// `recvs[index]`, with `peer` a communicator rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2p {
    /// `ncclSend` of `bytes` bytes.
    Send {
        /// Position in `sends`.
        index: usize,
        /// Receiving rank.
        peer: c_int,
        /// Length.
        bytes: usize,
    },
    /// `ncclRecv` of `bytes` bytes.
    Recv {
        /// Position in `recvs`.
        index: usize,
        /// Sending rank.
        peer: c_int,
        /// Length.
        bytes: usize,
    },
}

/// The calls of one grouped exchange on a communicator of `nranks`, between `ncclGroupStart` and
/// `ncclGroupEnd`: every send in order, then every receive in order (NCCL matches the messages of
/// one pair in the order they were issued). `sends` and `recvs` are `(peer, bytes)`. An empty exchange
/// is no calls (and no group).
pub fn exchange_calls(
    nranks: usize,
    sends: &[(usize, usize)],
    recvs: &[(usize, usize)],
) -> Result<Vec<P2p>> {
    let peer = |p: usize| -> Result<c_int> {
        if p >= nranks {
            return Err(Error::Nccl {
                call: "ncclSend/ncclRecv",
                detail: format!("peer {p} is not a rank of a communicator of {nranks}"),
            });
        }
        c_int::try_from(p).map_err(|_| Error::Nccl {
            call: "ncclSend/ncclRecv",
            detail: format!("peer {p} does not fit a C int"),
        })
    };
    let mut out = Vec::with_capacity(sends.len() + recvs.len());
    for (index, &(p, bytes)) in sends.iter().enumerate() {
        out.push(P2p::Send {
            index,
            peer: peer(p)?,
            bytes,
        });
    }
    for (index, &(p, bytes)) in recvs.iter().enumerate() {
        out.push(P2p::Recv {
            index,
            peer: peer(p)?,
            bytes,
        });
    }
    Ok(out)
}

/// One NCCL communicator: rank `rank` of `nranks`, on one GPU. Operations are queued on the
/// [`Device`]'s stream they are given (which must be on the communicator's GPU).
///
/// Not `Send`: it holds NCCL's raw communicator, which belongs to the thread that made it. Create it
/// on the thread that uses it (one thread per GPU), after opening that thread's [`Device`]. Dropping
/// it finalizes (waits for its queued operations) and destroys it, never aborts; [`NcclComm::close`]
/// does the same and reports failures.
pub struct NcclComm {
    nccl: &'static Nccl,
    comm: ncclComm_t,
    ordinal: usize,
    rank: usize,
    nranks: usize,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("gpu", &self.ordinal)
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .finish()
    }
}

impl NcclComm {
    /// Join the communicator `id` names as rank `rank` of `nranks`, on `dev`'s GPU
    /// (`ncclCommInitRank`: blocks until every rank has joined).
    pub fn init(dev: &Device, id: UniqueId, rank: usize, nranks: usize) -> Result<NcclComm> {
        let nccl = id.nccl;
        let int = |what: &str, v: usize| {
            c_int::try_from(v).map_err(|_| Error::Nccl {
                call: "ncclCommInitRank",
                detail: format!("{what} {v} does not fit a C int"),
            })
        };
        if rank >= nranks {
            return Err(Error::Nccl {
                call: "ncclCommInitRank",
                detail: format!("rank {rank} of a communicator of {nranks}"),
            });
        }
        let (r, n) = (int("rank", rank)?, int("size", nranks)?);
        // NCCL takes the device from the calling thread's current context.
        dev.ctx
            .bind_to_thread()
            .map_err(crate::drv("cuCtxSetCurrent"))?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: the out-pointer is a valid local; the id is a value every rank was given; the
        // device's context is current on this thread.
        let code = unsafe { (nccl.comm_init_rank)(&mut comm, n, id.id, r) };
        nccl.check("ncclCommInitRank", code)?;
        Ok(NcclComm {
            nccl,
            comm,
            ordinal: dev.ctx.ordinal(),
            rank,
            nranks,
        })
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Its number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    fn same_gpu(&self, dev: &Device, call: &'static str) -> Result<cudaStream_t> {
        if dev.ctx.ordinal() != self.ordinal {
            return Err(Error::Nccl {
                call,
                detail: format!(
                    "the communicator is on GPU {}, the stream on GPU {}",
                    self.ordinal,
                    dev.ctx.ordinal()
                ),
            });
        }
        dev.ctx
            .bind_to_thread()
            .map_err(crate::drv("cuCtxSetCurrent"))?;
        Ok(dev.stream.cu_stream() as cudaStream_t)
    }

    /// An error NCCL met asynchronously (a peer failed, a network error), if any.
    pub fn check_async(&self) -> Result<()> {
        let mut code: Code = SUCCESS;
        // SAFETY: `comm` is a live communicator; the out-pointer is a valid local.
        let r = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut code) };
        self.nccl.check("ncclCommGetAsyncError", r)?;
        self.nccl.check("(asynchronous)", code)
    }

    /// In-place MAX all-reduce of the f32 values `buf` holds (little-endian bytes, a whole number of
    /// values), queued on `dev`'s stream.
    pub fn all_reduce_max_f32<B: DevicePtrMut<u8>>(&self, dev: &Device, buf: &mut B) -> Result<()> {
        let bytes = buf.len();
        if !bytes.is_multiple_of(4) {
            return Err(Error::Nccl {
                call: "ncclAllReduce",
                detail: format!("{bytes} bytes are not a whole number of f32"),
            });
        }
        let stream = self.same_gpu(dev, "ncclAllReduce")?;
        if bytes == 0 {
            return Ok(());
        }
        // The guard records the buffer's write on the stream when dropped, after the enqueue.
        let (ptr, _written) = buf.device_ptr_mut(&dev.stream);
        // SAFETY: `ptr` addresses `bytes` bytes of device memory on the communicator's GPU, alive for
        // this borrow; in place (send == recv buffer) is allowed; the stream is `dev`'s, current.
        let code = unsafe {
            (self.nccl.all_reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                bytes / 4,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclMax,
                self.comm,
                stream,
            )
        };
        self.nccl.check("ncclAllReduce", code)?;
        self.check_async()
    }

    /// One grouped exchange of bytes (`u8`: NCCL has no fp8 or fp4 type, and bytes are what moves):
    /// each `(peer, view)` of `sends` to communicator rank `peer`, each `(peer, view)` of `recvs`
    /// filled from `peer`, all between one `ncclGroupStart` and `ncclGroupEnd` on `dev`'s stream
    /// ([`exchange_calls`] is the order). A message to oneself is allowed.
    pub fn send_recv(
        &self,
        dev: &Device,
        sends: &[(usize, CudaView<'_, u8>)],
        recvs: &mut [(usize, CudaViewMut<'_, u8>)],
    ) -> Result<()> {
        let s: Vec<(usize, usize)> = sends.iter().map(|(p, v)| (*p, v.len())).collect();
        let r: Vec<(usize, usize)> = recvs.iter().map(|(p, v)| (*p, v.len())).collect();
        let calls = exchange_calls(self.nranks, &s, &r)?;
        if calls.is_empty() {
            return Ok(());
        }
        let stream = self.same_gpu(dev, "ncclGroupStart")?;
        // SAFETY: no arguments; opens a group on this thread, closed below on every path.
        self.nccl
            .check("ncclGroupStart", unsafe { (self.nccl.group_start)() })?;
        // The guards record each buffer's use on the stream when dropped, after ncclGroupEnd has
        // enqueued the transfers.
        let mut guards = Vec::with_capacity(calls.len());
        let mut failed = None;
        let (mut send_ptrs, mut recv_ptrs) = (Vec::new(), Vec::new());
        for (_, v) in sends {
            let (p, g) = v.device_ptr(&dev.stream);
            send_ptrs.push(p);
            guards.push(g);
        }
        for (_, v) in recvs.iter_mut() {
            let (p, g) = v.device_ptr_mut(&dev.stream);
            recv_ptrs.push(p);
            guards.push(g);
        }
        for c in &calls {
            let (call, code) = match *c {
                P2p::Send { index, peer, bytes } => {
                    let p = send_ptrs.get(index).copied().unwrap_or(0);
                    // SAFETY: `p` addresses `bytes` bytes of device memory on this GPU, borrowed
                    // until after ncclGroupEnd; the stream is `dev`'s, current.
                    let code = unsafe {
                        (self.nccl.send)(
                            p as *const c_void,
                            bytes,
                            ncclDataType_t::ncclUint8,
                            peer,
                            self.comm,
                            stream,
                        )
                    };
                    ("ncclSend", code)
                }
                P2p::Recv { index, peer, bytes } => {
                    let p = recv_ptrs.get(index).copied().unwrap_or(0);
                    // SAFETY: as for the send; the buffer is borrowed mutably, so nothing else
                    // writes it.
                    let code = unsafe {
                        (self.nccl.recv)(
                            p as *mut c_void,
                            bytes,
                            ncclDataType_t::ncclUint8,
                            peer,
                            self.comm,
                            stream,
                        )
                    };
                    ("ncclRecv", code)
                }
            };
            if let Err(e) = self.nccl.check(call, code) {
                failed = Some(e);
                break;
            }
        }
        // SAFETY: closes the group opened above (also after a failed call, as NCCL requires).
        let end = self
            .nccl
            .check("ncclGroupEnd", unsafe { (self.nccl.group_end)() });
        drop(guards);
        if let Some(e) = failed {
            return Err(e);
        }
        end?;
        self.check_async()
    }

    /// Finalize (wait for the queued operations) and destroy the communicator, reporting failures
    /// (dropping it does the same silently).
    pub fn close(self) -> Result<()> {
        let r = self.finalize_and_destroy();
        std::mem::forget(self);
        r
    }

    fn finalize_and_destroy(&self) -> Result<()> {
        // SAFETY: `comm` is live and is destroyed exactly once (`close` forgets `self`; `drop` runs
        // only otherwise); destroy follows finalize even when finalize failed, to free it.
        let fin = unsafe { (self.nccl.comm_finalize)(self.comm) };
        // SAFETY: as above.
        let des = unsafe { (self.nccl.comm_destroy)(self.comm) };
        self.nccl.check("ncclCommFinalize", fin)?;
        self.nccl.check("ncclCommDestroy", des)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Finalize then destroy, never abort; a failure cannot be reported from a drop (use
        // `close` to see it).
        let _ = self.finalize_and_destroy();
    }
}

/// The ids of every communicator a world needs: one per distinct member set of size > 1 of the
/// groups asked for ([`WorldIds::member_sets`]). Made once and given to every rank.
#[derive(Debug, Clone)]
pub struct WorldIds {
    topo: Topology,
    sets: Vec<(Vec<usize>, UniqueId)>,
}

impl WorldIds {
    /// The communicators `groups` need in a world of shape `topo`: each distinct member set of more
    /// than one rank (two groups with the same members share one), in a fixed order: `tp`, `moe_tp`,
    /// `ep`, then by first member. Every rank joins its sets in this order, which cannot deadlock.
    pub fn member_sets(topo: Topology, groups: &[Group]) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for g in [Group::Tp, Group::MoeTp, Group::Ep] {
            if !groups.contains(&g) {
                continue;
            }
            for r in 0..topo.world() {
                let m = topo.members(g, r);
                if m.len() > 1 && !out.contains(&m) {
                    out.push(m);
                }
            }
        }
        out
    }

    /// New ids for [`WorldIds::member_sets`]`(topo, groups)`.
    pub fn new(nccl: &'static Nccl, topo: Topology, groups: &[Group]) -> Result<WorldIds> {
        let sets = WorldIds::member_sets(topo, groups)
            .into_iter()
            .map(|m| Ok((m, UniqueId::new(nccl)?)))
            .collect::<Result<_>>()?;
        Ok(WorldIds { topo, sets })
    }

    /// Ids received from the process that made them ([`WorldIds::ids`], in order).
    pub fn from_ids(topo: Topology, groups: &[Group], ids: &[UniqueId]) -> Result<WorldIds> {
        let sets = WorldIds::member_sets(topo, groups);
        if sets.len() != ids.len() {
            return Err(Error::Collective {
                group: "world",
                why: format!(
                    "the world needs {} communicator ids, {} were given",
                    sets.len(),
                    ids.len()
                ),
            });
        }
        Ok(WorldIds {
            topo,
            sets: sets.into_iter().zip(ids.iter().copied()).collect(),
        })
    }

    /// The ids, in [`WorldIds::member_sets`] order.
    pub fn ids(&self) -> Vec<UniqueId> {
        self.sets.iter().map(|(_, id)| *id).collect()
    }

    /// The world's shape.
    pub fn topology(&self) -> Topology {
        self.topo
    }
}

/// One rank's communicators: for each group (of those the [`WorldIds`] were made for) whose
/// members include this rank and number more than one, the communicator of exactly those members,
/// in which this rank's position is its group rank. Groups of one need none.
///
/// Not `Send`, as [`NcclComm`]: create it on the thread that uses it.
#[derive(Debug)]
pub struct NcclWorld {
    topo: Topology,
    rank: usize,
    comms: Vec<(Vec<usize>, NcclComm)>,
}

impl NcclWorld {
    /// Join this rank's communicators on `dev` (blocks until the other members join each).
    pub fn init(dev: &Device, ids: &WorldIds, rank: usize) -> Result<NcclWorld> {
        if rank >= ids.topo.world() {
            return Err(Error::Collective {
                group: "world",
                why: format!("rank {rank} of a world of {}", ids.topo.world()),
            });
        }
        let mut comms = Vec::new();
        for (members, id) in &ids.sets {
            if let Some(pos) = members.iter().position(|&m| m == rank) {
                let c = NcclComm::init(dev, *id, pos, members.len())?;
                comms.push((members.clone(), c));
            }
        }
        Ok(NcclWorld {
            topo: ids.topo,
            rank,
            comms,
        })
    }

    /// The communicator of this rank's group `g`, if the world has one.
    pub fn comm(&self, g: Group) -> Option<&NcclComm> {
        let m = self.topo.members(g, self.rank);
        self.comms.iter().find(|(s, _)| *s == m).map(|(_, c)| c)
    }

    /// Finalize and destroy every communicator, reporting the first failure (dropping the world does
    /// the same silently).
    pub fn close(self) -> Result<()> {
        let mut first = Ok(());
        for (_, c) in self.comms {
            let r = c.close();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    fn missing(&self, g: Group) -> Error {
        Error::MissingCollective {
            group: g.name(),
            size: self.size(g),
        }
    }
}

impl DeviceCollective for NcclWorld {
    fn topology(&self) -> Topology {
        self.topo
    }

    fn world_rank(&self) -> usize {
        self.rank
    }

    fn supports(&self, g: Group) -> bool {
        self.size(g) == 1 || self.comm(g).is_some()
    }

    fn all_reduce_max(&self, g: Group, data: &mut CudaSlice<u8>, dev: &Device) -> Result<()> {
        collective::f32_count(g, data.len())?;
        if self.size(g) == 1 {
            return Ok(());
        }
        let c = self.comm(g).ok_or_else(|| self.missing(g))?;
        c.all_reduce_max_f32(dev, data).map_err(|e| in_group(g, e))
    }

    fn exchange(
        &self,
        g: Group,
        sends: &[(usize, CudaView<'_, u8>)],
        recvs: &mut [(usize, CudaViewMut<'_, u8>)],
        dev: &Device,
    ) -> Result<()> {
        if self.size(g) == 1 {
            return collective::self_exchange(g, sends, recvs, dev);
        }
        let c = self.comm(g).ok_or_else(|| self.missing(g))?;
        c.send_recv(dev, sends, recvs).map_err(|e| in_group(g, e))
    }
}

/// An NCCL failure as a failure of the collective over `g`.
fn in_group(g: Group, e: Error) -> Error {
    match e {
        Error::Nccl { call, detail } => Error::Collective {
            group: g.name(),
            why: format!("{call}: {detail}"),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_explicit_path_is_tried_first_then_the_sonames() {
        assert_eq!(
            Nccl::candidates(Some(Path::new("/opt/nccl/lib/libnccl.so.2.27.3"))),
            [
                "/opt/nccl/lib/libnccl.so.2.27.3",
                "libnccl.so.2",
                "libnccl.so"
            ]
            .map(PathBuf::from)
        );
        assert_eq!(
            Nccl::candidates(None),
            ["libnccl.so.2", "libnccl.so"].map(PathBuf::from)
        );
    }

    #[test]
    fn no_library_is_an_error_naming_every_candidate() {
        let c = [
            PathBuf::from("/nonexistent/libnccl.so.2"),
            PathBuf::from("libnccl-moeforge-test-absent.so"),
        ];
        let e = Nccl::open_first(&c).err();
        let text = e.as_ref().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.starts_with("no usable NCCL library: "), "{text}");
        match e {
            Some(Error::NoNccl { tried }) => {
                assert_eq!(tried.len(), 2);
                assert!(
                    tried[0].starts_with("/nonexistent/libnccl.so.2 ("),
                    "{text}"
                );
                assert!(
                    tried[1].starts_with("libnccl-moeforge-test-absent.so ("),
                    "{text}"
                );
            }
            other => panic!("expected NoNccl, got {other:?}"),
        }
        assert!(matches!(Nccl::open_first(&[]), Err(Error::NoNccl { tried }) if tried.is_empty()));
    }

    #[test]
    fn a_library_without_ncclsymbols_is_refused_by_name() {
        // The C library loads everywhere this runs and has none of NCCL's entry points.
        match Nccl::open_first(&[PathBuf::from("libc.so.6")]) {
            Err(Error::NoNccl { tried }) => {
                assert!(tried[0].contains("no `ncclGetUniqueId`"), "{tried:?}")
            }
            other => panic!("expected NoNccl, got {other:?}"),
        }
    }

    #[test]
    fn the_process_library_is_absent_here_or_loaded_once() {
        match Nccl::load(Some(Path::new("/nonexistent/libnccl.so"))) {
            // A machine without NCCL (CI): the error names all three candidates in order.
            Err(Error::NoNccl { tried }) => {
                assert_eq!(tried.len(), 3, "{tried:?}");
                assert!(tried[0].starts_with("/nonexistent/libnccl.so ("));
                assert!(tried[1].starts_with("libnccl.so.2 ("));
                assert!(tried[2].starts_with("libnccl.so ("));
            }
            // A machine with NCCL: the soname loaded, and a second call returns the same library.
            Ok(n) => {
                assert!(SONAMES.iter().any(|s| n.path() == Path::new(s)));
                let again = Nccl::load(None).ok();
                assert!(again.is_some_and(|m| std::ptr::eq(n, m)));
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn result_codes_are_named_without_trusting_the_enum() {
        assert_eq!(result_name(0), "ncclSuccess");
        assert_eq!(result_name(5), "ncclInvalidUsage");
        assert_eq!(result_name(8), "ncclResult 8");
        assert_eq!(result_name(u32::MAX), format!("ncclResult {}", u32::MAX));
    }

    #[test]
    fn an_exchange_is_every_send_then_every_receive_in_order() {
        let calls = exchange_calls(2, &[(1, 10), (0, 3), (1, 0)], &[(1, 7), (0, 3)]);
        assert_eq!(
            calls.ok(),
            Some(vec![
                P2p::Send {
                    index: 0,
                    peer: 1,
                    bytes: 10
                },
                P2p::Send {
                    index: 1,
                    peer: 0,
                    bytes: 3
                },
                P2p::Send {
                    index: 2,
                    peer: 1,
                    bytes: 0
                },
                P2p::Recv {
                    index: 0,
                    peer: 1,
                    bytes: 7
                },
                P2p::Recv {
                    index: 1,
                    peer: 0,
                    bytes: 3
                },
            ])
        );
        assert_eq!(exchange_calls(2, &[], &[]).ok(), Some(vec![]));
        match exchange_calls(2, &[(0, 1)], &[(2, 1)]) {
            Err(Error::Nccl { detail, .. }) => {
                assert!(detail.contains("peer 2 is not a rank of a communicator of 2"))
            }
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn a_world_needs_one_communicator_per_distinct_group_of_several() {
        let two = |ep, moe_tp| Topology { ep, moe_tp };
        // Two GPUs: one communicator, whichever way they are split and whichever groups are asked.
        let all = [Group::Tp, Group::MoeTp, Group::Ep];
        assert_eq!(WorldIds::member_sets(two(1, 2), &all), vec![vec![0, 1]]);
        assert_eq!(WorldIds::member_sets(two(2, 1), &all), vec![vec![0, 1]]);
        assert_eq!(
            WorldIds::member_sets(two(1, 2), &[Group::MoeTp]),
            vec![vec![0, 1]]
        );
        // Groups of one need none.
        assert!(WorldIds::member_sets(two(2, 1), &[Group::MoeTp]).is_empty());
        assert!(WorldIds::member_sets(Topology::SINGLE, &all).is_empty());
        assert!(WorldIds::member_sets(two(2, 2), &[Group::None]).is_empty());
        // 2 x 2: the world, two moe_tp pairs, two ep pairs; the order ignores the caller's.
        let want = vec![
            vec![0, 1, 2, 3],
            vec![0, 1],
            vec![2, 3],
            vec![0, 2],
            vec![1, 3],
        ];
        assert_eq!(WorldIds::member_sets(two(2, 2), &all), want);
        assert_eq!(
            WorldIds::member_sets(two(2, 2), &[Group::Ep, Group::MoeTp, Group::Tp]),
            want
        );
    }
}
