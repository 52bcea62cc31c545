"""EPLB anchors for `moeforge bench --gpu --eplb`, measured in the same device call:
the device copy ceiling (1 GiB y.copy_(x), bytes read + written), torch's in-place rearrangement
of a DeepSeek-V3 EP8 bf16 layer (`param.copy_(param[perm])`, as ../shared/anchors/torch_anchors.py
does it), and, with two GPUs, the NVLink copy one way and both ways (as p2p_anchor.py does it)."""
import json, time
import torch
from triton.testing import do_bench

def rec(**kw):
    print(json.dumps(kw), flush=True)

x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
y = torch.empty_like(x)
t = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median")
rec(what="d2d_copy", ms=t, TBps=2 * x.numel() / t / 1e9)
del x, y

E, H, I = 32, 7168, 2048
w13 = torch.randn(E, 2 * I, H, device="cuda:0", dtype=torch.bfloat16)
w2 = torch.randn(E, H, I, device="cuda:0", dtype=torch.bfloat16)
perm = torch.randperm(E, device="cuda:0")
def rearrange():
    with torch.no_grad():
        w13.copy_(w13[perm]); w2.copy_(w2[perm])
t = do_bench(rearrange, warmup=3, rep=20, return_mode="median")
nbytes = (w13.numel() + w2.numel()) * 2
rec(what="eplb_rearrange_torch", ms=t, layer_GB=nbytes / 1e9, effective_TBps=2 * nbytes / t / 1e9)
del w13, w2
torch.cuda.empty_cache()

if torch.cuda.device_count() >= 2:
    x0 = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda:0")
    y1 = torch.empty_like(x0, device="cuda:1")
    t = do_bench(lambda: y1.copy_(x0, non_blocking=True), warmup=5, rep=50, return_mode="median")
    rec(what="p2p_copy_0to1", ms=t, GBps=x0.numel() / t / 1e6)
    x1 = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda:1")
    y0 = torch.empty_like(x1, device="cuda:0")
    s0 = torch.cuda.Stream(device=0); s1 = torch.cuda.Stream(device=1)
    def bi():
        with torch.cuda.stream(s0): y1.copy_(x0, non_blocking=True)
        with torch.cuda.stream(s1): y0.copy_(x1, non_blocking=True)
        s0.synchronize(); s1.synchronize()
    bi(); t0 = time.perf_counter()
    for _ in range(10): bi()
    t = (time.perf_counter() - t0) / 10 * 1e3
    rec(what="p2p_copy_bidir", ms=t, GBps_total=2 * x0.numel() / t / 1e6)
