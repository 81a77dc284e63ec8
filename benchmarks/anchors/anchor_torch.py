# ruff: noqa  (verbatim copy of the reference anchor; see README.md)
"""Peer benchmark: the same GPT block stack in PyTorch with torch.autocast + GradScaler.

  python anchor_torch.py --policy bf16|fp16|fp32|tf32 [--compile]   -> one JSON line
"""
import argparse, json, time
import torch, torch.nn as nn, torch.nn.functional as F

CFG = dict(batch=16, seq=1024, d=1024, heads=16, layers=8, ff=4096, vocab=32768)


class Block(nn.Module):
    def __init__(s, d, h, ff):
        super().__init__()
        s.h = h
        s.ln1, s.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.qkv, s.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        s.f1, s.f2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(s, x):
        b, t, d = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, s.h, d // s.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + s.o(a)
        return x + s.f2(F.gelu(s.f1(s.ln2(x))))


class GPT(nn.Module):
    def __init__(s, c):
        super().__init__()
        s.emb = nn.Embedding(c["vocab"], c["d"])
        s.blocks = nn.Sequential(*[Block(c["d"], c["heads"], c["ff"]) for _ in range(c["layers"])])
        s.ln, s.head = nn.LayerNorm(c["d"]), nn.Linear(c["d"], c["vocab"])

    def forward(s, x):
        return s.head(s.ln(s.blocks(s.emb(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="bf16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    c = CFG
    torch.backends.cuda.matmul.allow_tf32 = a.policy == "tf32"
    torch.backends.cudnn.allow_tf32 = a.policy == "tf32"
    dev = "cuda"
    model = GPT(c).to(dev)
    opt = torch.optim.AdamW(model.parameters(), 1e-4, fused=True)
    scaler = torch.amp.GradScaler(enabled=a.policy == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.policy)
    x = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device=dev)

    def step():
        with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(x).float().view(-1, c["vocab"]), x.view(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    fn = torch.compile(step) if a.compile else step
    t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); compile_s = time.perf_counter() - t0
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter(); loss = fn(); loss.item(); times.append(time.perf_counter() - t)
    times.sort(); med = times[len(times) // 2]
    n = c["layers"] * 12 * c["d"] ** 2 + c["vocab"] * c["d"]
    tokens = c["batch"] * c["seq"]
    flops = 6 * n * tokens + c["layers"] * 12 * c["seq"] * c["d"] * tokens
    print("RESULT " + json.dumps(dict(model="gpt", policy="torch_" + a.policy + ("_compile" if a.compile else ""),
          compile_s=round(compile_s, 2), step_ms_median=round(med * 1e3, 3), units_per_s=round(tokens / med, 1),
          tflops=round(flops / med / 1e12, 1), peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
          loss=loss.item(), torch=torch.__version__)), flush=True)


if __name__ == "__main__":
    main()
