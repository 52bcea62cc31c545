//! Kernels built only from the typed PTX layer's asynchronous and tensor-core instructions
//! (`ptx::asyncops`), assembled by ptxas 13.0 for sm_90a with `-v`: ptxas must accept them, spill
//! nothing, and not serialize the wgmma pipeline (its "wgmma.mma_async instructions are serialized"
//! warning, C75xx, is an error here).
//!
//! ptxas comes from `MOEFORGE_PTXAS`, else the cache `scripts/ptxas` fills. Without one the tests say
//! that they skipped, unless `MOEFORGE_REQUIRE_PTXAS` is set, in which case they fail.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr
)]

use std::path::PathBuf;
use std::process::Command;

use moeforge_codegen::ptx::{
    AsyncOp, BarrierId, BinOpcode, Builder, Cluster, CmpOp, Entry, Guard, Inst, MaxNReg, Operand,
    Param, PtxTy, Reg, RegClass, RegDelta, ScaleD, SharedDecl, SharedTy, SpecialReg, TmaDim,
    TmaLoad, UnOpcode, Wgmma, WgmmaN, WgmmaTy, PTX_VERSION,
};

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOEFORGE_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("MOEFORGE_TOOLS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("moeforge/tools"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/moeforge/tools"))
        })?;
    let p = cache.join("cuda-nvcc-13.0.88/ptxas");
    p.exists().then_some(p)
}

/// The module: version, target, the entry's header, declarations, instructions.
fn module(entry: &Entry, b: &Builder) -> String {
    let mut s = format!(".version {PTX_VERSION}\n.target sm_90a\n.address_size 64\n\n");
    s.push_str(&entry.header().unwrap());
    s.push_str(&b.decls());
    s.push('\n');
    for i in &b.insts {
        s.push_str(&i.to_string());
        s.push('\n');
    }
    s.push_str("}\n");
    s
}

/// Assembles `ptx` for sm_90a with `-v` and returns ptxas's report (stdout and stderr), after
/// checking that it succeeded, spilled nothing and serialized no wgmma; `None` where no ptxas was
/// found (and none is required).
fn assemble(name: &str, ptx: &str) -> Option<String> {
    let Some(ptxas) = ptxas() else {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but no ptxas was found (run scripts/ptxas)"
        );
        eprintln!("SKIPPED: ptxas not found; `{name}` was built but not assembled");
        return None;
    };
    let dir =
        std::env::temp_dir().join(format!("moeforge-ptx-async-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("{name}.ptx"));
    let cubin = dir.join(format!("{name}.cubin"));
    std::fs::write(&src, ptx).unwrap();
    let out = Command::new(&ptxas)
        .args(["-arch=sm_90a", "-v"])
        .arg(&src)
        .arg("-o")
        .arg(&cubin)
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "ptxas rejected {name}:\n{report}\n--- PTX ---\n{ptx}"
    );
    assert!(std::fs::metadata(&cubin).unwrap().len() > 0);
    let _ = std::fs::remove_dir_all(&dir);
    let problems = problems(&report);
    assert!(
        problems.is_empty(),
        "ptxas -v on {name}: {problems:?}\n{report}"
    );
    Some(report)
}

/// What in a `ptxas -v` report this backend treats as an error: the serialized-wgmma warning,
/// any C75xx performance diagnostic (injected `warpgroup.wait`/`arrive` C7517/C7519, ignored
/// `setmaxnreg` C7508, ...), spills, a stack frame, or no register report at all.
fn problems(report: &str) -> Vec<&'static str> {
    let mut p = Vec::new();
    if report.contains("wgmma.mma_async instructions are serialized") {
        p.push("wgmma.mma_async instructions are serialized");
    }
    if report.contains("(C75") || report.contains("Potential Performance Loss") {
        p.push("a C75xx diagnostic");
    }
    if !report.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") {
        p.push("spills or a stack frame");
    }
    if !report.contains("Used ") {
        p.push("no register report");
    }
    p
}

/// `ptxas -v` output for `ptx` with no checks but success; `None` without ptxas.
fn report_of(name: &str, ptx: &str) -> Option<String> {
    let ptxas = ptxas()?;
    let dir =
        std::env::temp_dir().join(format!("moeforge-ptx-async-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("{name}.ptx"));
    std::fs::write(&src, ptx).unwrap();
    let out = Command::new(&ptxas)
        .args(["-arch=sm_90a", "-v"])
        .arg(&src)
        .arg("-o")
        .arg(dir.join(format!("{name}.cubin")))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "ptxas rejected {name}");
    Some(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn mov_u32(b: &mut Builder, v: i64) -> Reg {
    let d = b.reg(RegClass::B32);
    b.push(Inst::Un {
        op: UnOpcode::Mov(PtxTy::U32),
        d,
        a: Operand::Int(v),
    });
    d
}

fn bin(b: &mut Builder, op: BinOpcode, ty: PtxTy, a: Reg, v: Operand) -> Reg {
    let class = match ty {
        PtxTy::U64 | PtxTy::B64 | PtxTy::S64 => RegClass::B64,
        _ => RegClass::B32,
    };
    let d = b.reg(class);
    b.push(Inst::Bin {
        op,
        ty,
        d,
        a: Operand::Reg(a),
        b: v,
    });
    d
}

fn setp(b: &mut Builder, cmp: CmpOp, a: Reg, v: Operand) -> Reg {
    let p = b.reg(RegClass::Pred);
    b.push(Inst::Setp {
        cmp,
        ty: PtxTy::U32,
        p,
        a: Operand::Reg(a),
        b: v,
    });
    p
}

/// A K-major SW128 descriptor of the tile at `smem` advanced by `k16` 32-byte K steps (GEMM.md
/// §1.5): `lo = (smem >> 4 | 1 << 16) + 2 * k16`, `hi = 0x40000040`.
fn descriptor(b: &mut Builder, smem: Reg, k16: i64) -> Reg {
    let lo = bin(b, BinOpcode::Shr, PtxTy::U32, smem, Operand::Int(4));
    let lo = bin(b, BinOpcode::Or, PtxTy::B32, lo, Operand::Int(0x10000));
    let lo = bin(b, BinOpcode::Add, PtxTy::U32, lo, Operand::Int(2 * k16));
    let hi = mov_u32(b, 0x4000_0040);
    let d = b.reg(RegClass::B64);
    b.emit(AsyncOp::PackB64 { d, lo, hi }).unwrap();
    d
}

/// `out[tid * 4 * regs.len() ..]` = the thread's accumulator, one `st.global.f32` each.
fn store_accumulator(b: &mut Builder, out_param: &str, tid: Reg, acc: &[Reg]) {
    let p = b.reg(RegClass::B64);
    b.push(Inst::LdParam {
        ty: PtxTy::U64,
        d: p,
        name: out_param.into(),
    });
    let g = b.reg(RegClass::B64);
    b.push(Inst::Cvta { d: g, a: p });
    let bytes = b.reg(RegClass::B64);
    b.push(Inst::Bin {
        op: BinOpcode::MulWide,
        ty: PtxTy::U32,
        d: bytes,
        a: Operand::Reg(tid),
        b: Operand::Int(4 * acc.len() as i64),
    });
    let base = b.reg(RegClass::B64);
    b.push(Inst::Bin {
        op: BinOpcode::Add,
        ty: PtxTy::U64,
        d: base,
        a: Operand::Reg(g),
        b: Operand::Reg(bytes),
    });
    for (i, &v) in acc.iter().enumerate() {
        let addr = bin(
            b,
            BinOpcode::Add,
            PtxTy::U64,
            base,
            Operand::Int(4 * i as i64),
        );
        b.push(Inst::St {
            ty: PtxTy::F32,
            addr,
            v,
        });
    }
}

/// One CTA of one warpgroup: thread 0 initializes an mbarrier, expects 8192 bytes and loads one
/// 64x64 bf16 tile (128-byte rows) with a 2D TMA through a `.param .align 64 .b8 [128]` tensor map;
/// every thread waits on the mbarrier; then `wgmma.fence`, four `m64n64k16` bf16 MMAs from two
/// shared-memory descriptors (the first with scale-d = 0), commit, wait, and each thread stores
/// its 32 accumulators with `st.global.f32`.
fn tma_wgmma_kernel() -> (Entry, Builder) {
    let mut e = Entry::new("tma_wgmma");
    e.params = vec![
        Param::tensor_map("tma_wgmma_tmap"),
        Param::global_ptr("tma_wgmma_out", 16),
    ];
    let mut b = Builder::default();
    b.declare_shared(SharedDecl::array("sA", SharedTy::B8, 8192, 1024).unwrap())
        .unwrap();
    b.declare_shared(SharedDecl::scalar("bar", SharedTy::B64, 8).unwrap())
        .unwrap();
    let tid = b.reg(RegClass::B32);
    b.push(Inst::Special {
        d: tid,
        name: SpecialReg::TidX,
    });
    let leader = setp(&mut b, CmpOp::Eq, tid, Operand::Int(0));
    let one = Guard::when(leader);
    let tmap = b.tensor_map_addr("tma_wgmma_tmap").unwrap();
    b.emit_guarded(one, AsyncOp::PrefetchTensorMap { tmap })
        .unwrap();
    let bar = b.shared_addr("bar");
    let sa = b.shared_addr("sA");
    b.emit_guarded(
        one,
        AsyncOp::MbarrierInit {
            bar,
            count: Operand::Int(1),
        },
    )
    .unwrap();
    b.emit_guarded(one, AsyncOp::FenceMbarrierInit).unwrap();
    b.push(Inst::BarSync);
    b.emit_guarded(
        one,
        AsyncOp::MbarrierArriveExpectTx {
            bar,
            tx_bytes: Operand::Int(64 * 64 * 2),
        },
    )
    .unwrap();
    let (k0, m0) = (mov_u32(&mut b, 0), mov_u32(&mut b, 0));
    b.emit_guarded(
        one,
        AsyncOp::TmaLoad(TmaLoad {
            dim: TmaDim::D2,
            dst: sa,
            tmap,
            coords: vec![k0, m0],
            bar,
            cache_hint: None,
        }),
    )
    .unwrap();
    b.mbarrier_wait(bar, Operand::Int(0)).unwrap();
    let acc_on = setp(&mut b, CmpOp::Eq, tid, Operand::Reg(tid));
    let descs: Vec<Reg> = (0..4).map(|k| descriptor(&mut b, sa, k)).collect();
    let n = WgmmaN::new(64).unwrap();
    let acc = b.accumulator(n);
    b.emit(AsyncOp::WgmmaFence).unwrap();
    for (k, &desc) in descs.iter().enumerate() {
        let scale_d = if k == 0 {
            ScaleD::Imm(false)
        } else {
            ScaleD::Pred(acc_on)
        };
        b.emit(AsyncOp::Wgmma(Wgmma::ss(
            n,
            WgmmaTy::Bf16,
            acc.clone(),
            desc,
            desc,
            scale_d,
        )))
        .unwrap();
    }
    b.emit(AsyncOp::WgmmaCommitGroup).unwrap();
    b.emit(AsyncOp::WgmmaWaitGroup(0)).unwrap();
    store_accumulator(&mut b, "tma_wgmma_out", tid, &acc);
    b.push(Inst::Ret);
    (e, b)
}

#[test]
fn ptxas_assembles_a_tma_wgmma_kernel_without_spills_or_serialization() {
    let (e, b) = tma_wgmma_kernel();
    let ptx = module(&e, &b);
    // The lines the H200 examples used, in this backend's spacing.
    for line in [
        "\t.param .align 64 .b8 tma_wgmma_tmap[128],",
        "\t.shared .align 1024 .b8 \tsA[8192];",
        "\t.shared .align 8 .b64 \tbar;",
        "\tmov.u32 \t%r2, bar;",
        "\t@%p1 mbarrier.init.shared::cta.b64 \t[%r2], 1;",
        "\t@%p1 fence.mbarrier_init.release.cluster;",
        "\t@%p1 mbarrier.arrive.expect_tx.shared::cta.b64 \t_, [%r2], 8192;",
        "\t@%p1 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes \t[%r3], [%rd2, {%r4, %r5}], [%r2];",
        "\tmbarrier.try_wait.parity.shared::cta.b64 \t%p2, [%r2], 0;",
        "\t@!%p2 bra \t$L_mbar_wait_1;",
        "\twgmma.fence.sync.aligned;",
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned \t0;",
    ] {
        assert!(ptx.contains(line), "missing {line:?} in\n{ptx}");
    }
    assert_eq!(
        ptx.matches("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16")
            .count(),
        4
    );
    assert_eq!(ptx.matches("st.global.f32").count(), 32);
    if let Some(report) = assemble("tma_wgmma", &ptx) {
        eprintln!("{report}");
    }
}

/// Every other new instruction in one warp-specialized kernel of a 2-CTA cluster: producer
/// warpgroup 0 (`setmaxnreg.dec 40`, `elect.sync`, a 3D TMA load with a cache hint, an L2
/// prefetch), consumer warpgroup 1 (`setmaxnreg.inc 232`, an e4m3 wgmma from descriptors and a bf16
/// wgmma with A from registers, the empty-barrier release, on the other CTA too, the proxy fence, a
/// named barrier and the TMA store with its bulk group).
fn warp_specialized_kernel() -> (Entry, Builder) {
    let mut e = Entry::new("ws");
    e.params = vec![
        Param::tensor_map("ws_tmap"),
        Param::global_ptr("ws_out", 16),
    ];
    e.cluster = Some(Cluster::Fixed([2, 1, 1]));
    // The register count at entry: without it ptxas ignores `setmaxnreg` (C7508). `.maxntid 384`
    // alone does not give it where the kernel needs fewer registers than 65536/384 (ptxas 13.0).
    e.maxnreg = Some(168);
    let mut b = Builder::default();
    b.declare_shared(SharedDecl::array("sA", SharedTy::B8, 16384, 1024).unwrap())
        .unwrap();
    b.declare_shared(SharedDecl::scalar("full", SharedTy::B64, 8).unwrap())
        .unwrap();
    b.declare_shared(SharedDecl::scalar("empty", SharedTy::B64, 8).unwrap())
        .unwrap();
    let tid = b.reg(RegClass::B32);
    b.push(Inst::Special {
        d: tid,
        name: SpecialReg::TidX,
    });
    let wg = bin(&mut b, BinOpcode::Shr, PtxTy::U32, tid, Operand::Int(7));
    let tmap = b.tensor_map_addr("ws_tmap").unwrap();
    let full = b.shared_addr("full");
    let empty = b.shared_addr("empty");
    let sa = b.shared_addr("sA");
    let leader = setp(&mut b, CmpOp::Eq, tid, Operand::Int(0));
    b.emit_guarded(
        Guard::when(leader),
        AsyncOp::MbarrierInit {
            bar: full,
            count: Operand::Int(1),
        },
    )
    .unwrap();
    b.emit_guarded(
        Guard::when(leader),
        AsyncOp::MbarrierInit {
            bar: empty,
            count: Operand::Int(2),
        },
    )
    .unwrap();
    b.emit_guarded(Guard::when(leader), AsyncOp::FenceMbarrierInit)
        .unwrap();
    b.emit(AsyncOp::BarrierClusterArrive).unwrap();
    b.emit(AsyncOp::BarrierClusterWait).unwrap();
    let consumer = setp(&mut b, CmpOp::Ne, wg, Operand::Int(0));
    let (consumer_l, done_l) = (b.label("consumer"), b.label("done"));
    b.push(Inst::Bra {
        label: consumer_l.clone(),
        pred: Some((consumer, false)),
    });
    // Producer.
    b.emit(AsyncOp::SetMaxNReg {
        delta: RegDelta::Dec,
        count: MaxNReg::new(40).unwrap(),
    })
    .unwrap();
    let elected = b.reg(RegClass::Pred);
    b.emit(AsyncOp::ElectSync {
        d: None,
        p: elected,
        mask: 0xffff_ffff,
    })
    .unwrap();
    let warp0 = setp(&mut b, CmpOp::Lt, tid, Operand::Int(32));
    b.push(Inst::Bra {
        label: done_l.clone(),
        pred: Some((warp0, true)),
    });
    b.push(Inst::Bra {
        label: done_l.clone(),
        pred: Some((elected, true)),
    });
    let coords: Vec<Reg> = (0..3).map(|_| mov_u32(&mut b, 0)).collect();
    let policy = b.reg(RegClass::B64);
    b.push(Inst::Un {
        op: UnOpcode::Mov(PtxTy::B64),
        d: policy,
        a: Operand::Int(0x12F0_0000_0000_0000),
    });
    b.emit(AsyncOp::TmaPrefetch {
        dim: TmaDim::D3,
        tmap,
        coords: coords.clone(),
    })
    .unwrap();
    b.emit(AsyncOp::MbarrierArriveExpectTx {
        bar: full,
        tx_bytes: Operand::Int(16384),
    })
    .unwrap();
    b.emit(AsyncOp::TmaLoad(TmaLoad {
        dim: TmaDim::D3,
        dst: sa,
        tmap,
        coords: coords.clone(),
        bar: full,
        cache_hint: Some(policy),
    }))
    .unwrap();
    b.push(Inst::Bra {
        label: done_l.clone(),
        pred: None,
    });
    // Consumer.
    b.push(Inst::Label(consumer_l));
    b.emit(AsyncOp::SetMaxNReg {
        delta: RegDelta::Inc,
        count: MaxNReg::new(232).unwrap(),
    })
    .unwrap();
    b.mbarrier_wait(full, Operand::Int(0)).unwrap();
    // A fragment of the register-A MMA: four words per thread, from global memory.
    let p = b.reg(RegClass::B64);
    b.push(Inst::LdParam {
        ty: PtxTy::U64,
        d: p,
        name: "ws_out".into(),
    });
    let g = b.reg(RegClass::B64);
    b.push(Inst::Cvta { d: g, a: p });
    let frag: Vec<Reg> = (0..4).map(|_| b.reg(RegClass::B32)).collect();
    b.push(Inst::LdV {
        nc: true,
        words: frag.clone(),
        addr: g,
    });
    let desc_a = descriptor(&mut b, sa, 0);
    let desc_b = descriptor(&mut b, sa, 1);
    let n = WgmmaN::new(64).unwrap();
    let acc8 = b.accumulator(n);
    let acc16 = b.accumulator(n);
    b.emit(AsyncOp::WgmmaFence).unwrap();
    b.emit(AsyncOp::Wgmma(Wgmma::ss(
        n,
        WgmmaTy::E4m3,
        acc8.clone(),
        desc_a,
        desc_b,
        ScaleD::Imm(false),
    )))
    .unwrap();
    b.emit(AsyncOp::Wgmma(Wgmma::rs(
        n,
        WgmmaTy::Bf16,
        acc16.clone(),
        [frag[0], frag[1], frag[2], frag[3]],
        desc_b,
        ScaleD::Imm(false),
    )))
    .unwrap();
    b.emit(AsyncOp::WgmmaCommitGroup).unwrap();
    b.emit(AsyncOp::WgmmaWaitGroup(0)).unwrap();
    let lane0 = bin(&mut b, BinOpcode::And, PtxTy::B32, tid, Operand::Int(127));
    let wg_leader = setp(&mut b, CmpOp::Eq, lane0, Operand::Int(0));
    b.emit_guarded(
        Guard::when(wg_leader),
        AsyncOp::MbarrierArrive { bar: empty },
    )
    .unwrap();
    let remote = b.reg(RegClass::B32);
    b.emit(AsyncOp::Mapa {
        d: remote,
        a: empty,
        cta: Operand::Int(1),
    })
    .unwrap();
    b.emit_guarded(
        Guard::when(wg_leader),
        AsyncOp::MbarrierArriveCluster { bar: remote },
    )
    .unwrap();
    b.emit(AsyncOp::FenceProxyAsyncShared).unwrap();
    b.emit(AsyncOp::Bar {
        id: BarrierId::new(1).unwrap(),
        count: Some(128),
    })
    .unwrap();
    b.emit_guarded(
        Guard::when(wg_leader),
        AsyncOp::TmaStore {
            dim: TmaDim::D3,
            tmap,
            coords,
            src: sa,
        },
    )
    .unwrap();
    b.emit_guarded(Guard::when(wg_leader), AsyncOp::BulkCommitGroup)
        .unwrap();
    b.emit_guarded(Guard::when(wg_leader), AsyncOp::BulkWaitGroupRead(0))
        .unwrap();
    let acc: Vec<Reg> = acc8.iter().chain(&acc16).copied().collect();
    store_accumulator(&mut b, "ws_out", tid, &acc);
    b.push(Inst::Label(done_l));
    b.push(Inst::Ret);
    (e, b)
}

#[test]
fn ptxas_assembles_every_new_instruction_in_a_warp_specialized_kernel() {
    let (e, b) = warp_specialized_kernel();
    let ptx = module(&e, &b);
    for opcode in [
        "setmaxnreg.dec.sync.aligned.u32 \t40;",
        "setmaxnreg.inc.sync.aligned.u32 \t232;",
        "elect.sync \t_|%p",
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint",
        "cp.async.bulk.prefetch.tensor.3d.L2.global",
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
        "mapa.shared::cluster.u32",
        "mbarrier.arrive.release.cluster.shared::cluster.b64",
        "bar.sync \t1, 128;",
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group",
        "cp.async.bulk.commit_group;",
        "cp.async.bulk.wait_group.read \t0;",
    ] {
        assert!(ptx.contains(opcode), "missing {opcode:?} in\n{ptx}");
    }
    if let Some(report) = assemble("ws", &ptx) {
        eprintln!("{report}");
    }
}

/// The checks can fail: the same single-tile kernel with one `add.f32` on an accumulator between two
/// in flight MMAs (gemm-examples/sm90_C7517_repro.ptx's mistake) makes ptxas inject waits (C75xx),
/// which [`problems`] reports; and a warp-specialized kernel without `.maxnreg` has its
/// `setmaxnreg` ignored (C7508).
#[test]
fn the_ptxas_checks_catch_serialized_wgmma_and_ignored_setmaxnreg() {
    let (e, mut b) = tma_wgmma_kernel();
    let first = b
        .insts
        .iter()
        .position(|i| {
            matches!(
                i,
                Inst::Async {
                    op: AsyncOp::Wgmma(_),
                    ..
                }
            )
        })
        .unwrap();
    let Inst::Async {
        op: AsyncOp::Wgmma(w),
        ..
    } = b.insts[first].clone()
    else {
        unreachable!()
    };
    b.insts.insert(
        first + 1,
        Inst::Bin {
            op: BinOpcode::AddRn,
            ty: PtxTy::F32,
            d: w.d[0],
            a: Operand::Reg(w.d[0]),
            b: Operand::F32(1.0),
        },
    );
    let bad = module(&e, &b);
    let (e2, b2) = warp_specialized_kernel();
    let no_maxnreg = module(
        &Entry {
            maxnreg: None,
            ..e2
        },
        &b2,
    );
    let Some(report) = report_of("serialized", &bad) else {
        assert!(
            std::env::var_os("MOEFORGE_REQUIRE_PTXAS").is_none(),
            "MOEFORGE_REQUIRE_PTXAS is set but no ptxas was found (run scripts/ptxas)"
        );
        eprintln!("SKIPPED: ptxas not found");
        return;
    };
    assert!(
        problems(&report).contains(&"a C75xx diagnostic"),
        "ptxas did not flag an accumulator written between wgmmas:\n{report}"
    );
    let report = report_of("no_maxnreg", &no_maxnreg).unwrap();
    assert!(report.contains("C7508"), "{report}");
    assert!(!problems(&report).is_empty());
}

/// The generated grouped GEMM v0 (`gemm::kernel::grouped_bf16_v0`) assembles for sm_90a with no
/// spills and no serialized wgmma, for a small shape and the DeepSeek-V3 w13 shape.
#[test]
fn ptxas_assembles_the_grouped_bf16_gemm_v0() {
    for (n, k, stages) in [(256u32, 512u32, 2u32), (2048, 7168, 3)] {
        let (ptx, launch) = moeforge_codegen::gemm::kernel::grouped_bf16_v0(n, k, stages).unwrap();
        assert_eq!(launch.k_tiles, k / 64);
        assert_eq!(
            ptx.matches("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16")
                .count(),
            4
        );
        if let Some(report) = assemble(&format!("gemm_bf16_v0_{n}_{k}_{stages}"), &ptx) {
            eprintln!("{report}");
        }
    }
}
