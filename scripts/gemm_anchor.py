#!/usr/bin/env python3
"""torch's grouped GEMMs on the cases of `moeforge bench --gpu --gemm`.

Usage: python3 scripts/gemm_anchor.py CASES.json

CASES.json is what the benchmark writes: {"cases": [{model, recipe, tokens, experts, top_k, n, k,
rows}, ...]}, the row counts per expert of each case (the benchmark's seeded uniform top-k routing),
so that torch runs exactly the shapes moeforge ran. For each case it times, with the same row counts:

* recipe bf16 and the weights-only recipes (nvfp4_cutedsl, mxfp4, int8_per_row, int4_g128, whose
  peers are bf16): torch._grouped_mm, bf16 x bf16 -> bf16, weights [E, N, K] transposed as in
  ../shared/anchors/torch_anchors.py;
* recipes fp8_per_tensor and fp8_block128: torch._scaled_grouped_mm fp8 rowwise (e4m3, f32 scales
  per row and per weight column). torch has no blockwise (128x128) grouped GEMM, so fp8_block128 is
  compared with rowwise; the record says so. The fp8 measurement is made once per (model, tokens)
  and reported for both fp8 recipes.

Prints one JSON object per line: first {"what": "device", ...}, then per case {model, recipe,
tokens, us, anchor, ...} or {model, recipe, tokens, error}. It fails soft: without torch, CUDA or a
readable cases file it prints one {"error": ...} record and exits 0. Timing: triton's do_bench
(median; it clears a 256 MB buffer before each rep, as moeforge flushes L2), or CUDA events with the
same flush where triton is absent.
"""
import sys

from anchor_common import emit, setup, timer


def main(argv):
    got = setup(argv, "gemm_anchor.py")
    if got is None:
        return 0
    cases, torch = got
    dev = "cuda"

    bench, timer_name = timer(torch, dev)

    props = torch.cuda.get_device_properties(0)
    emit(what="device", name=props.name, torch=torch.__version__, timer=timer_name)

    weights = {}  # (E, N, K) -> {"bf16": tensor, "fp8": tensor}
    done = {}  # (model, tokens, kind) -> (us or None, error or None)
    for c in cases:
        key = (c["model"], c["recipe"], c["tokens"])
        try:
            E, N, K, rows = c["experts"], c["n"], c["k"], c["rows"]
            kind = "fp8" if c["recipe"] in ("fp8_per_tensor", "fp8_block128") else "bf16"
            shape = (E, N, K)
            if shape not in weights:
                weights.clear()
                torch.cuda.empty_cache()
                weights[shape] = {
                    "bf16": torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * 0.02
                }
            w = weights[shape]
            T = sum(rows)
            done_key = (c["model"], c["tokens"], kind, tuple(rows))
            if done_key not in done:
                offs = torch.cumsum(torch.tensor(rows, device=dev), 0).to(torch.int32)
                xs = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
                try:
                    if kind == "bf16":
                        wt = w["bf16"].transpose(-2, -1)
                        f = lambda: torch._grouped_mm(xs, wt, offs=offs, out_dtype=torch.bfloat16)
                    else:
                        if "fp8" not in w:
                            w["fp8"] = w["bf16"].to(torch.float8_e4m3fn)
                        w8 = w["fp8"].transpose(-2, -1)
                        xs8 = xs.to(torch.float8_e4m3fn)
                        sa = torch.ones(T, device=dev, dtype=torch.float32)
                        sb = torch.ones(E, N, device=dev, dtype=torch.float32)
                        f = lambda: torch._scaled_grouped_mm(
                            xs8, w8, sa, sb, offs=offs, out_dtype=torch.bfloat16)
                    f()
                    torch.cuda.synchronize()
                    done[done_key] = (bench(f) * 1e3, None)
                except Exception as e:  # noqa: BLE001
                    done[done_key] = (None, str(e)[:300])
                del xs
            us, err = done[done_key]
            if err is not None:
                emit(model=key[0], recipe=key[1], tokens=key[2], error=err)
                continue
            rec = dict(model=key[0], recipe=key[1], tokens=key[2], us=us,
                       rows_total=T, touched=sum(1 for r in rows if r > 0),
                       TFLOPs=2 * T * N * K / (us * 1e-6) / 1e12)
            if kind == "bf16":
                rec["anchor"] = "torch._grouped_mm bf16"
            else:
                rec["anchor"] = "torch._scaled_grouped_mm fp8 rowwise"
                if c["recipe"] == "fp8_block128":
                    rec["note"] = ("torch has no blockwise grouped GEMM: "
                                   "fp8 rowwise measured instead")
            emit(**rec)
        except Exception as e:  # noqa: BLE001
            emit(model=key[0], recipe=key[1], tokens=key[2], error=str(e)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
