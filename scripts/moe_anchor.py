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
import sys

from anchor_common import emit, setup, timer


def main(argv):
    got = setup(argv, "moe_anchor.py")
    if got is None:
        return 0
    cases, torch = got
    F = torch.nn.functional
    dev = "cuda"
    bench, timer_name = timer(torch, dev)
    emit(what="device", name=torch.cuda.get_device_name(0), torch=torch.__version__, timer=timer_name)
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
