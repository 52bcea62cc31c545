# A synthetic bf16 MoE layer checkpoint (E, H, I from argv; model.layers.0.mlp.experts.w13_weight / w2_weight)
# and 16 tokens of top-8 inputs, written as safetensors with the standard library only: the start-up
# timing of the twenty-fourth session (BENCHMARKS.md).
import json, struct, random, sys
E, H, I = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
random.seed(1)
def bf16_block(n):
    out = bytearray()
    for _ in range(n):
        # exponent 0x78..0x7d (about 2^-7..2^-2), random mantissa and sign
        e = random.randint(0x78, 0x7c); m = random.randint(0, 127); s = random.randint(0, 1)
        v = (s << 15) | (e << 7) | m
        out += struct.pack('<H', v)
    return bytes(out)
blk = bf16_block(65521)  # odd length so rows differ
def fill(nbytes):
    reps = nbytes // len(blk) + 1
    return (blk * reps)[:nbytes]
p = "model.layers.0.mlp.experts"
tensors = [(f"{p}.w13_weight", [E, 2*I, H]), (f"{p}.w2_weight", [E, H, I])]
hdr = {}; off = 0; datas = []
for name, shape in tensors:
    n = 2 * shape[0] * shape[1] * shape[2]
    hdr[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
    datas.append(fill(n)); off += n
h = json.dumps(hdr).encode(); h += b' ' * ((8 - len(h) % 8) % 8)
with open("ckpt.safetensors", "wb") as f:
    f.write(struct.pack('<Q', len(h))); f.write(h)
    for d in datas: f.write(d)
T, K = 16, 8
inp = {}; off = 0; d2 = []
x = fill(2 * T * H); ids = b''.join(struct.pack('<i', (t * 5 + k * 3) % E) for t in range(T) for k in range(K)); w = b''.join(struct.pack('<f', 0.125) for _ in range(T * K))
for name, dt, shape, d in (("hidden_states", "BF16", [T, H], x), ("topk_ids", "I32", [T, K], ids), ("topk_weights", "F32", [T, K], w)):
    inp[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(d)]}; d2.append(d); off += len(d)
h = json.dumps(inp).encode(); h += b' ' * ((8 - len(h) % 8) % 8)
with open("inputs.safetensors", "wb") as f:
    f.write(struct.pack('<Q', len(h))); f.write(h)
    for d in d2: f.write(d)
