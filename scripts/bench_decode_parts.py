"""A decode step's parts on the CPU for one model: the decoder stack and the LM head, at 1
and at 32 rows, through the runner's paged attention (TorchPagedAttention) after a prompt.

    python scripts/bench_decode_parts.py MODEL [--prompt-len 64] [--steps 12]

Prints the median milliseconds of each part and the LM head's share of a step. Where the model
has a C decode stack (gpu/kernels/cpu/layer.py, layer_gemma.py), each step also runs it, right
after the per-layer torch path (the same inputs, alternating), and prints its time beside. Run it with
OMP_NUM_THREADS set as the server runs (docs/benchmarks.md, "Gemma 3 270M Q4_K_M")."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu.layers.attention import AttentionMetadata, KVCache, TorchPagedAttention
from gpu.loader.decoder import load_model


def _meta(seq_lens: list[int], q_lens: list[int], block_size: int, blocks_per_seq: int) -> AttentionMetadata:
    """Sequence b in blocks b * blocks_per_seq ..., its q_lens[b] new tokens at its end."""
    B = len(seq_lens)
    tables = torch.arange(B * blocks_per_seq, dtype=torch.int32).view(B, blocks_per_seq)
    starts, slots = [0], []
    for b, (n, q) in enumerate(zip(seq_lens, q_lens)):
        starts.append(starts[-1] + q)
        pos = torch.arange(n - q, n)
        slots.append(tables[b].long()[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=tables,
        cu_seqlens_q=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        q_starts=starts, q_lens=list(q_lens), ctx_lens=list(seq_lens),
        start_positions=[n - q for n, q in zip(seq_lens, q_lens)],
        decode_rows=[b for b, q in enumerate(q_lens) if q == 1],
        prefill_rows=[b for b, q in enumerate(q_lens) if q > 1], max_seqlen_q=max(q_lens))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    loaded = load_model(args.model, progress=False)
    m, c = loaded.model, loaded.config
    print(f"{loaded.name}: {c.architecture}, vocab {c.vocab_size}, {torch.get_num_threads()} threads")
    print(f"weights: {loaded.weights}")
    bs, P = 16, args.prompt_len
    for B in (1, 32):
        per_seq = -(-(P + args.steps + 1) // bs)
        cache = KVCache(c.num_hidden_layers, B * per_seq, bs, m.local_kv_heads, c.head_dim, torch.float32, "cpu")
        attn = TorchPagedAttention(cache, c.head_dim ** -0.5)
        stack, head, fused = [], [], []
        with torch.inference_mode():
            ids = torch.randint(10, 1000, (B * P,))
            attn.prepare(_meta([P] * B, [P] * B, bs, per_seq))
            m(ids, torch.arange(P).repeat(B), attn)
            for step in range(args.steps):
                n = P + step + 1
                attn.prepare(_meta([n] * B, [1] * B, bs, per_seq))
                t0 = time.perf_counter()
                h = m(torch.randint(10, 1000, (B,)), torch.full((B,), n - 1), attn)
                t1 = time.perf_counter()
                m.compute_logits(h)
                t2 = time.perf_counter()
                stack.append(t1 - t0)
                head.append(t2 - t1)
                if m.fused_decode is not None and B <= 16:
                    t3 = time.perf_counter()
                    got = m.fused_decode(torch.randint(10, 1000, (B,)), torch.full((B,), n - 1), attn)
                    if got is not None:
                        fused.append(time.perf_counter() - t3)
        s, h = statistics.median(stack) * 1e3, statistics.median(head) * 1e3
        c_stack = f", the C stack {statistics.median(fused) * 1e3:7.1f} ms" if fused else ""
        print(f"{B:>2} rows: decoder stack {s:7.1f} ms{c_stack}, LM head {h:7.1f} ms ({100 * h / (s + h):.0f}% of the step)")


if __name__ == "__main__":
    main()
