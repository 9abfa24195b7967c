"""Decode attention over a paged KV cache on the CPU, three formulations side by side at
SmolLM2's shapes (32 sequences, 9 query / 3 KV heads of 64, contexts of 150-200 tokens in
16-token blocks scattered through the cache), alternating, --rounds times:

- sdpa+gather: what TorchPagedAttention does (index_select of the blocks, one SDPA call);
- bmm+gather: the same gather, then matmul / fp32 masked softmax / matmul;
- compiled: one torch.compile'd (inductor, dynamic shapes) function that reads the blocks
  through the block table inside its loops: no gathered copy; its compile time is printed;
- c: gpu/kernels/cpu/ops.c's paged_decode_attention (what TorchPagedAttention now runs where it
  builds): reads the blocks in place, one call.

--layers N gives each call its own layer's cache, N layers in turn (N=30: SmolLM2's, whose
caches do not fit in L2 as one layer's does), and times a pass over all of them.

    .venv/bin/python scripts/bench_cpu_decode_attention.py --dtype bfloat16 --rounds 3
    .venv/bin/python scripts/bench_cpu_decode_attention.py --skip-compile --layers 30
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gpu.kernels.cpu import ops as cpu_kernels

B, HKV, G, D, BS = 32, 3, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--layers", type=int, default=1)
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    torch.manual_seed(0)
    nb_total = B * 17
    caches = [(torch.randn(nb_total, BS, HKV, D, dtype=dt), torch.randn(nb_total, BS, HKV, D, dtype=dt))
              for _ in range(a.layers)]
    lens = torch.randint(150, 200, (B,))
    nblk = int(-(-lens.max() // BS))
    table = torch.randperm(nb_total)[:B * nblk].view(B, nblk)
    blocks = table.flatten()
    mask = (torch.arange(nblk * BS)[None] < lens[:, None])[:, None, None, :]
    q = torch.randn(B, HKV * G, D, dtype=dt)
    scale = D ** -0.5

    def sdpa_gather(kc, vc):
        kd = kc.index_select(0, blocks).view(B, -1, HKV, D).transpose(1, 2)
        vd = vc.index_select(0, blocks).view(B, -1, HKV, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q.reshape(B, HKV, G, D), kd, vd, attn_mask=mask,
                                              scale=scale).reshape(B, -1, D)

    def bmm_gather(kc, vc):
        kd = kc.index_select(0, blocks).view(B, -1, HKV, D).permute(0, 2, 3, 1)   # [B, Hkv, D, K]
        vd = vc.index_select(0, blocks).view(B, -1, HKV, D).transpose(1, 2)       # [B, Hkv, K, D]
        s = torch.matmul(q.reshape(B, HKV, G, D), kd).float() * scale
        s = s.masked_fill_(~mask, float("-inf")).softmax(-1)
        return torch.matmul(s.to(vd.dtype), vd).reshape(B, -1, D)

    def paged(q, kc, vc, table, lens):
        k, v = kc[table].float(), vc[table].float()                                # fused into the loops
        s = torch.einsum("bhgd,bnshd->bhgns", q.reshape(q.shape[0], HKV, G, D).float(), k).flatten(-2) * scale
        pos = torch.arange(s.shape[-1])
        s = s.masked_fill((pos[None] >= lens[:, None])[:, None, None, :], float("-inf")).softmax(-1)
        return torch.einsum("bhgk,bkhd->bhgd", s, v.flatten(1, 2)).reshape(q.shape[0], -1, D).to(q.dtype)

    contenders = {"sdpa+gather": sdpa_gather, "bmm+gather": bmm_gather}
    kernels = cpu_kernels.kernels()
    if kernels is not None:
        tables32, lens64, rows = table.to(torch.int32), lens.to(torch.int64), torch.arange(B)

        def c_kernel(kc, vc):
            out = torch.empty_like(q)
            assert kernels.paged_decode_attention(q, rows, out, kc, vc, tables32, lens64, scale)
            return out
        contenders["c"] = c_kernel
    if not a.skip_compile:
        t0 = time.perf_counter()
        compiled = torch.compile(paged, dynamic=True)
        compiled(q, *caches[0], table, lens)
        print(f"compile: {time.perf_counter() - t0:.1f} s")
        contenders["compiled"] = lambda kc, vc: compiled(q, kc, vc, table, lens)
    ref = sdpa_gather(*caches[0]).float()
    for name, f in contenders.items():
        print(f"{name}: max abs difference from sdpa+gather {(f(*caches[0]).float() - ref).abs().max().item():.2e}")

    def timed(f, n=30):
        def every_layer():
            for kc, vc in caches:
                f(kc, vc)
        every_layer()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            every_layer()
            ts.append((time.perf_counter() - t) / len(caches))
        ts.sort()
        return ts[n // 2] * 1e6, ts[0] * 1e6

    for r in range(a.rounds):
        for name, f in contenders.items():
            med, best = timed(f)
            print(f"round {r} {name:12s} median {med:8.0f} us, best {best:6.0f} us (a layer)", flush=True)


if __name__ == "__main__":
    main()
