"""What moeforge's torch anchor scripts share (scripts/gemm_anchor.py, scripts/moe_anchor.py): JSON-line
output, the cases file, torch with CUDA, and the timer.

Every function fails soft: a problem is one {"error": ...} record and None, never an exception, so that
the benchmark calling the script always gets JSON lines and exit status 0.
"""
import json


def emit(**kw):
    print(json.dumps(kw), flush=True)


def setup(argv, script):
    """The cases of `script CASES.json` and torch with a CUDA device seeded 0, or None after an
    error record."""
    if len(argv) != 2:
        emit(error=f"usage: {script} CASES.json")
        return None
    try:
        with open(argv[1]) as f:
            cases = json.load(f)["cases"]
    except Exception as e:  # noqa: BLE001 - any unreadable input is reported, not raised
        emit(error=f"cannot read cases {argv[1]}: {e}"[:300])
        return None
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        emit(error=f"torch not importable: {e}"[:300])
        return None
    if not torch.cuda.is_available():
        emit(error=f"torch {torch.__version__}: no CUDA device")
        return None
    torch.manual_seed(0)
    return cases, torch


def timer(torch, dev):
    """`(bench, name)`: bench(fn) is fn's median time in ms with a 256 MB buffer cleared before each
    rep (as moeforge flushes L2): triton's do_bench, or CUDA events where triton is absent."""
    try:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=5, rep=30, return_mode="median")  # ms

        return bench, "triton do_bench"
    except Exception:  # noqa: BLE001
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

        def bench(fn):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(20):
                flush.zero_()
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            ts.sort()
            return ts[len(ts) // 2]

        return bench, "CUDA events (triton absent)"
