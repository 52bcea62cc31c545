#!/usr/bin/env python3
"""torch's whole MoE layer on the cases of `moeforge bench --gpu --moe`.

Usage: python3 scripts/moe_anchor.py CASES.json

CASES.json is what the benchmark writes: {"cases": [{model, tokens, experts, top_k, hidden,
intermediate, ids}, ...]}, with the benchmark's routing (`ids`, [tokens * top_k] logical expert
ids), so that torch runs the same rows. For each case it times torch's bf16 layer, what a user
writes with torch alone:

    order = argsort(ids, stable); xs = x[order // k]; offs = cumsum(bincount(ids))
    h = torch._grouped_mm(xs, w13^T, offs); a = silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, w2^T, offs); out = zeros(T, H, f32).index_add_(0, order // k, y * w)

Prints one JSON object per line: {"what": "device", ...}, then per case {model, tokens, us} or
{model, tokens, error}. It fails soft: without torch, CUDA or a readable cases file it prints one
{"error": ...} record and exits 0. Timing: triton's do_bench (median, clearing a 256 MB buffer
before each rep), or CUDA events with the same flush where triton is absent.
"""
import json
import sys


def emit(**kw):
    print(json.dumps(kw), flush=True)


def main(argv):
    if len(argv) != 2:
        emit(error="usage: moe_anchor.py CASES.json")
        return 0
    try:
        with open(argv[1]) as f:
            cases = json.load(f)["cases"]
    except Exception as e:  # noqa: BLE001 - any unreadable input is reported, not raised
        emit(error=f"cannot read cases {argv[1]}: {e}"[:300])
        return 0
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        emit(error=f"torch not importable: {e}"[:300])
        return 0
    if not torch.cuda.is_available():
        emit(error=f"torch {torch.__version__}: no CUDA device")
        return 0
    dev = "cuda"
    torch.manual_seed(0)
    try:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=5, rep=30, return_mode="median")  # ms

        timer = "triton do_bench"
    except Exception:  # noqa: BLE001
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

        def bench(fn):
            fn()
            ts = []
            for _ in range(20):
                flush.zero_()
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            ts.sort()
            return ts[len(ts) // 2]

        timer = "CUDA events"
    emit(what="device", name=torch.cuda.get_device_name(0), torch=torch.__version__, timer=timer)
    weights = {}
    for c in cases:
        model, t, e, k = c["model"], c["tokens"], c["experts"], c["top_k"]
        h, i = c["hidden"], c["intermediate"]
        try:
            if model not in weights:
                weights.clear()
                torch.cuda.empty_cache()
                w13 = (torch.randn(e, 2 * i, h, device=dev) * 0.02).to(torch.bfloat16)
                w2 = (torch.randn(e, h, i, device=dev) * 0.02).to(torch.bfloat16)
                weights[model] = (w13.transpose(-2, -1), w2.transpose(-2, -1))
            w13t, w2t = weights[model]
            ids = torch.tensor(c["ids"], dtype=torch.int64, device=dev)
            x = torch.randn(t, h, device=dev).to(torch.bfloat16)
            tw = torch.full((t * k,), 1.0 / k, device=dev)

            def layer():
                order = torch.argsort(ids, stable=True)
                tok = order // k
                xs = x.index_select(0, tok)
                offs = torch.cumsum(torch.bincount(ids, minlength=e), 0).to(torch.int32)
                hh = torch._grouped_mm(xs, w13t, offs=offs)
                a = F.silu(hh[:, :i]) * hh[:, i:]
                y = torch._grouped_mm(a, w2t, offs=offs)
                out = torch.zeros(t, h, device=dev, dtype=torch.float32)
                out.index_add_(0, tok, y.float() * tw[order, None])
                return out.to(torch.bfloat16)

            layer()
            ms = bench(layer)
            emit(model=model, tokens=t, us=ms * 1e3)
        except Exception as ex:  # noqa: BLE001
            emit(model=model, tokens=t, error=str(ex)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
