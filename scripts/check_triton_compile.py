"""AOT compile check of the Triton kernels in gpu/kernels for a CUDA target, without a GPU.

    python scripts/check_triton_compile.py [--arch 90] [--only NAME] [-v]
    python scripts/check_triton_compile.py --variants    # one variant per kernel at any batch size

Uses whatever `triton` (and `torch`) the interpreter imports, so it can check
another Triton release from a separate venv, e.g. for triton 3.6:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy
    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages:.venv/lib/python3.11/site-packages \\
        /tmp/t36/bin/python scripts/check_triton_compile.py --expect-triton 3.6.0

(the t36 site-packages first so its triton wins over the project's; the
project's CPU torch is only needed to run the launchers).

How: every public launcher (paged_attention, write_kv, rms_norm, ...) is called
with CPU tensors of the dtypes and SmolLM2-135M / Qwen3-0.6B-like shapes a GPU
run would use, while the module's @triton.jit kernel is swapped for a recorder.
The recorded launch (args, constexprs, num_warps, num_stages) is specialized
with the installed triton's own JIT binder, exactly as a launch on the device
would be, and compiled through ttir/ttgir/llir/ptx to a cubin with the ptxas
shipped in the triton wheel, for GPUTarget("cuda", arch, 32).  Nothing is
launched.  TRITON_INTERPRET is cleared, so the launchers take their GPU paths.

Prints one line per compiled variant, OK or FAIL, and exits 1 on any failure.

KERNELS below is the one list of the kernels scripts/gpu_check.sh checks on the device:

    python scripts/check_triton_compile.py --list            # each kernel: in this tree or not yet
    python scripts/check_triton_compile.py --tests --gpus 1  # their test files (gpu_check step 3)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # before triton / the kernels are imported
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}  # bytes per block

# Model-like shapes: (name, Hq, Hkv, Dh, hidden, intermediate, vocab).
MODELS = [
    ("smollm2-135m", 9, 3, 64, 576, 1536, 49152),
    ("qwen3-0.6b", 16, 8, 128, 1024, 3072, 151936),
]
PAGE = 16

# The kernels gpu_check checks, in one place: (name, kernel module, the test file comparing
# it on the device against its torch reference, GPUs it needs). gpu_check's step 3 runs
# tests/kernels and every test file listed here; this script compiles the launches in
# _cases and, for a listed module that defines aot_cases() (yielding (label, kernel
# names, launch)), those too. Adding a kernel is one line here (and its module's
# aot_cases). Module None: planned this turn, not in this tree yet (--list says so). Tests
# in tests/kernels also get each case's error and tolerance into kernels_tests.json (its
# conftest measures every torch.testing.assert_close); tests elsewhere run, unmeasured.
KERNELS = [
    ("paged_attention", "gpu.kernels.triton.paged_attention", "tests/kernels/test_paged_attention.py", 1),
    ("paged_attention softcap (Gemma 2)", "gpu.kernels.triton.paged_attention", "tests/kernels/test_paged_attention.py", 1),
    ("write_kv", "gpu.kernels.triton.kv_cache", "tests/kernels/test_kv_cache.py", 1),
    ("prepare_qkv", "gpu.kernels.triton.qkv_prep", "tests/kernels/test_qkv_prep.py", 1),
    ("rms_norm", "gpu.kernels.triton.rmsnorm", "tests/kernels/test_rmsnorm.py", 1),
    ("apply_rope", "gpu.kernels.triton.rope", "tests/kernels/test_rope.py", 1),
    ("silu_and_mul", "gpu.kernels.triton.activation", "tests/kernels/test_activation.py", 1),
    ("gelu_tanh_and_mul (GeGLU: Gemma)", "gpu.kernels.triton.activation", "tests/kernels/test_activation.py", 1),
    ("sample / apply_penalties", "gpu.kernels.triton.sampling", "tests/kernels/test_sampling.py", 1),
    ("mxfp4_moe", "gpu.kernels.triton.mxfp4_moe", "tests/kernels/test_mxfp4_moe.py", 1),
    ("moe_gemm (bf16 experts)", "gpu.kernels.triton.moe_gemm", "tests/kernels/test_moe_gemm.py", 1),
    ("wna16_gemm (AWQ / GPTQ / W4A16 weights)", "gpu.kernels.triton.wna16_gemm", "tests/kernels/test_quant_gemm.py", 1),
    ("fp8_gemm (FP8 block-scaled weights)", "gpu.kernels.triton.fp8_gemm", "tests/kernels/test_quant_gemm.py", 1),
    ("int8_gemm (INT8 W8A8)", "gpu.kernels.triton.int8_gemm", "tests/kernels/test_quant_gemm.py", 1),
    ("fp8 KV cache (write_kv, prepare_qkv, paged_attention over e4m3)", "gpu.kernels.triton.fp8_kv", "tests/kernels/test_kv_fp8.py", 1),
    ("mla_decode (DeepSeek-V3 latent cache)", "gpu.kernels.triton.mla_decode", "tests/kernels/test_mla_decode.py", 1),
    ("lora shrink/expand", "gpu.kernels.triton.lora", "tests/kernels/test_lora_kernels.py", 1),
    ("encoder attention (non-causal)", "gpu.kernels.triton.paged_attention", "tests/kernels/test_varlen_attention.py", 1),
    ("gated delta rule chunked / step, causal conv1d step (Qwen3-Next, Qwen3.5)",
     "gpu.kernels.triton.delta_rule", "tests/kernels/test_delta_rule_kernels.py", 1),
    ("vision tower attention", None, None, 1),
    ("EAGLE heads forward", None, None, 1),
    ("NIXL with CUDA buffers", None, None, 2),
]


def kernel_status(gpus: int = 1) -> list[tuple[str, str, str | None]]:
    """(name, status, test file to run or None) for each of KERNELS; status: "ok", "not in
    this tree yet", "module missing: M", "no test file: T", "needs N GPUs"."""
    import importlib.util

    out = []
    for name, module, test, need in KERNELS:
        try:
            found = module is not None and importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if module is None:
            out.append((name, "not in this tree yet", None))
        elif not found:
            out.append((name, f"module missing: {module}", None))
        elif test is None or not os.path.exists(os.path.join(REPO, test)):
            out.append((name, f"no test file: {test}", None))
        elif need > gpus:
            out.append((name, f"needs {need} GPUs", None))
        else:
            out.append((name, "ok", test))
    return out


def _registered_cases(only):
    """The launches each listed module's aot_cases() yields (new kernels bring their own)."""
    import importlib

    for name, module, _, _ in KERNELS:
        if module is None:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for label, kernel_names, launch in getattr(mod, "aot_cases", lambda: ())():
            if only is None or only in label:
                yield label, mod, kernel_names, launch


class _Recorder:
    """Stands in for a JITFunction: kernel[grid](*args, **kwargs) only records the call."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _jit_fn(fn):
    # Under some configurations triton.jit may wrap; unwrap to the JITFunction.
    while not hasattr(fn, "params") and hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _record(module, kernel_names, launch):
    """Run launch() with module.<kernel> replaced by recorders; return [(kernel_name, jit_fn, args, kwargs)]."""
    saved = {n: getattr(module, n) for n in kernel_names}
    recs = {n: _Recorder(_jit_fn(saved[n])) for n in kernel_names}
    try:
        for n, r in recs.items():
            setattr(module, n, r)
        launch()
    finally:
        for n, f in saved.items():
            setattr(module, n, f)
    return [(n, r.fn, a, k) for n, r in recs.items() for a, k in r.calls]


def _compile(fn, args, kwargs, target):
    """Specialize like JITFunction.run does for `target`, then triton.compile (no driver needed)."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs)
    kwargs.setdefault("debug", False)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _cases(only):
    """Yield (label, module, kernel_names, launch) for every variant to compile."""
    import torch

    from gpu.kernels.triton import activation, kv_cache, paged_attention, qkv_prep, rmsnorm, rope, sampling

    dev = "cpu"
    all_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    def want(name):
        return only is None or only in name

    # ---- gpt-oss-20b attention: sinks and a 128-position sliding window (bf16)
    for mode in ("decode", "prefill", "split4"):
        label = f"paged_attention[gpt-oss-20b,bf16,{mode},sinks+window]"
        if not want(label):
            continue

        def launch_gpt_oss(mode=mode, hq=64, hkv=8, dh=64):
            B, ctx = 4, 300
            q_len = 1 if mode != "prefill" else 37
            pages = -(-ctx // PAGE)
            k_cache = torch.zeros(B * pages, PAGE, hkv, dh, dtype=torch.bfloat16, device=dev)
            tables = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
            cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * q_len
            qkv = torch.zeros(B * q_len, (hq + 2 * hkv) * dh, dtype=torch.bfloat16, device=dev)
            q = qkv[:, : hq * dh].view(B * q_len, hq, dh)
            paged_attention.paged_attention(
                q, k_cache, torch.zeros_like(k_cache), tables, cu,
                torch.full((B,), ctx, dtype=torch.int32, device=dev), dh ** -0.5,
                max_seqlen_q=q_len if mode != "prefill" else None,
                num_kv_splits=4 if mode == "split4" else 1,
                sinks=torch.zeros(hq, dtype=torch.bfloat16, device=dev), window=128)

        yield label, paged_attention, ["_paged_attention_kernel", "_decode_attention_kernel", "_combine_splits_kernel"], launch_gpt_oss

    # ---- Gemma 2 (2B): head_dim 256, soft-capped scores, a 4096 window on alternate layers
    for mode, window in [(m, w) for m in ("decode", "prefill", "split4") for w in (None, 4096)]:
        label = f"paged_attention[gemma2-2b,bf16,{mode},softcap{'+window' if window else ''}]"
        if not want(label):
            continue

        def launch_gemma2(mode=mode, window=window, hq=8, hkv=4, dh=256):
            B, ctx = 4, 300
            q_len = 1 if mode != "prefill" else 37
            pages = -(-ctx // PAGE)
            k_cache = torch.zeros(B * pages, PAGE, hkv, dh, dtype=torch.bfloat16, device=dev)
            tables = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
            cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * q_len
            q = torch.zeros(B * q_len, hq, dh, dtype=torch.bfloat16, device=dev)
            paged_attention.paged_attention(
                q, k_cache, torch.zeros_like(k_cache), tables, cu,
                torch.full((B,), ctx, dtype=torch.int32, device=dev), 256 ** -0.5,
                max_seqlen_q=q_len if mode != "prefill" else None,
                num_kv_splits=4 if mode == "split4" else 1, window=window, softcap=50.0)

        yield label, paged_attention, ["_paged_attention_kernel", "_decode_attention_kernel", "_combine_splits_kernel"], launch_gemma2

    # ---- --kv-cache-dtype fp8 (Qwen3-0.6B's heads, bf16 model): e4m3 codes written by write_kv and
    # the fused prepare_qkv, read by paged attention (prefill, decode, split decode); scales 0.5 / 2
    hq, hkv, dh = 16, 8, 128
    for mode in ("decode", "prefill", "split4"):
        label = f"paged_attention[qwen3-0.6b,bf16,fp8 kv,{mode}]"
        if want(label):
            def launch_fp8(mode=mode):
                B, ctx = 4, 300
                q_len = 1 if mode != "prefill" else 37
                pages = -(-ctx // PAGE)
                k_cache = torch.zeros(B * pages, PAGE, hkv, dh, dtype=torch.float8_e4m3fn, device=dev)
                tables = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
                cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * q_len
                q = torch.zeros(B * q_len, hq, dh, dtype=torch.bfloat16, device=dev)
                paged_attention.paged_attention(
                    q, k_cache, torch.zeros_like(k_cache), tables, cu,
                    torch.full((B,), ctx, dtype=torch.int32, device=dev), dh ** -0.5,
                    max_seqlen_q=q_len if mode != "prefill" else None,
                    num_kv_splits=4 if mode == "split4" else 1, k_scale=0.5, v_scale=2.0)

            yield label, paged_attention, ["_paged_attention_kernel", "_decode_attention_kernel", "_combine_splits_kernel"], launch_fp8
    if want("write_kv[qwen3-0.6b,bf16,fp8 kv]"):
        def launch_write_fp8():
            T = 37
            qkv = torch.zeros(T, (hq + 2 * hkv) * dh, dtype=torch.bfloat16, device=dev)
            cache = torch.zeros(8, PAGE, hkv, dh, dtype=torch.float8_e4m3fn, device=dev)
            kv_cache.write_kv(qkv[:, hq * dh:(hq + hkv) * dh].view(T, hkv, dh), qkv[:, (hq + hkv) * dh:].view(T, hkv, dh),
                              cache, cache.clone(), torch.arange(T, dtype=torch.int64, device=dev), 0.5, 2.0)

        yield "write_kv[qwen3-0.6b,bf16,fp8 kv]", kv_cache, ["_write_kv_kernel"], launch_write_fp8
    if want("prepare_qkv[qwen3-0.6b,bf16,fp8 kv]"):
        def launch_prep_fp8():
            T = 37
            w = torch.ones(dh, dtype=torch.bfloat16, device=dev)
            cache = torch.zeros(8, PAGE, hkv, dh, dtype=torch.float8_e4m3fn, device=dev)
            qkv_prep.prepare_qkv(torch.zeros(T, (hq + 2 * hkv) * dh, dtype=torch.bfloat16, device=dev), hq, hkv, dh,
                                 w, w, 1e-6, torch.arange(T, device=dev), torch.zeros(4096, dh, device=dev), cache,
                                 cache.clone(), torch.arange(T, dtype=torch.int64, device=dev), 0.5, 2.0)

        yield "prepare_qkv[qwen3-0.6b,bf16,fp8 kv]", qkv_prep, ["_qkv_prep_kernel"], launch_prep_fp8

    # ---- gpt-oss-20b MXFP4 experts (32 experts, top 4): gate/up (+SwiGLU) and down, decode and prefill
    for tokens, proj, scaled in [(t, p, d) for t in (4, 2048) for p in ("gate_up", "down") for d in (False, True)]:
        if True:
            label = f"mxfp4_moe[gpt-oss-20b,bf16,{proj},{tokens} tokens{',dot_scaled' if scaled else ''}]"
            if not want(label):
                continue

            def launch_moe(tokens=tokens, proj=proj, scaled=scaled, E=32, k=4, D=2880, inter=2880):
                from gpu.kernels.triton import mxfp4_moe
                n, kk = (2 * inter, D) if proj == "gate_up" else (D, inter)
                rows = tokens * k
                a = torch.zeros(tokens if proj == "gate_up" else rows, kk, dtype=torch.bfloat16)
                blocks = torch.zeros(E, n, kk // 2, dtype=torch.uint8)
                scales = torch.zeros(E, n, kk // 32, dtype=torch.uint8)
                offs = torch.linspace(rows / E, rows, E).to(torch.int32)
                order = torch.arange(rows)
                kw = dict(a_rows=order // k, swiglu=(1.702, 7.0)) if proj == "gate_up" else \
                    dict(row_scale=torch.zeros(rows, dtype=torch.bfloat16), out_rows=order)
                mxfp4_moe.mxfp4_moe_matmul(a, blocks, scales, offs, bias=torch.zeros(E, n, dtype=torch.bfloat16),
                                           n_rows=rows, dot_scaled=scaled, **kw)

            from gpu.kernels.triton import mxfp4_moe
            yield label, mxfp4_moe, ["_mxfp4_moe_kernel"], launch_moe

    for model, hq, hkv, dh, hidden, inter, vocab in MODELS:
        # ---- paged attention: decode, prefill/mixed, flash-decoding splits
        for dtype in all_dtypes:
            for mode in ("decode", "prefill", "split4"):
                label = f"paged_attention[{model},{short[dtype]},{mode}]"
                if not want(label):
                    continue

                def launch(dtype=dtype, mode=mode, hq=hq, hkv=hkv, dh=dh):
                    B = 4
                    q_len = 1 if mode != "prefill" else 37
                    ctx = 300
                    pages = -(-ctx // PAGE)
                    k_cache = torch.zeros(B * pages, PAGE, hkv, dh, dtype=dtype, device=dev)
                    v_cache = torch.zeros_like(k_cache)
                    tables = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
                    cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * q_len
                    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
                    # q as a view of a fused qkv projection, like the model passes it.
                    qkv = torch.zeros(B * q_len, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
                    q = qkv[:, : hq * dh].view(B * q_len, hq, dh)
                    paged_attention.paged_attention(
                        q, k_cache, v_cache, tables, cu, seq_lens, dh ** -0.5,
                        max_seqlen_q=q_len if mode != "prefill" else None,
                        num_kv_splits=4 if mode == "split4" else 1,
                        out=torch.empty(q.shape, dtype=dtype, device=dev))

                yield label, paged_attention, ["_paged_attention_kernel", "_decode_attention_kernel", "_combine_splits_kernel"], launch

        for dtype in all_dtypes:
            s = short[dtype]
            # ---- KV cache write (k, v views of fused qkv; slot_mapping int64)
            label = f"write_kv[{model},{s}]"
            if want(label):
                def launch(dtype=dtype, hq=hq, hkv=hkv, dh=dh):
                    T = 37
                    qkv = torch.zeros(T, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
                    k = qkv[:, hq * dh:(hq + hkv) * dh].view(T, hkv, dh)
                    v = qkv[:, (hq + hkv) * dh:].view(T, hkv, dh)
                    cache = torch.zeros(8, PAGE, hkv, dh, dtype=dtype, device=dev)
                    slots = torch.arange(T, dtype=torch.int64, device=dev)
                    kv_cache.write_kv(k, v, cache, cache.clone(), slots)

                yield label, kv_cache, ["_write_kv_kernel"], launch

            # ---- RMSNorm (hidden, and per-head qk-norm over head_dim), plain and fused-add
            for d in (hidden, dh):
                for fused in (False, True):
                    label = f"rms_norm[{model},{s},d={d}{',fused_add' if fused else ''}]"
                    if not want(label):
                        continue

                    def launch(dtype=dtype, d=d, fused=fused):
                        x = torch.zeros(37, d, dtype=dtype, device=dev)
                        w = torch.ones(d, dtype=dtype, device=dev)
                        if fused:
                            rmsnorm.fused_add_rms_norm(x, x.clone(), w, 1e-6)
                        else:
                            rmsnorm.rms_norm(x, w, 1e-6)

                    yield label, rmsnorm, ["_rms_norm_kernel"], launch

            # ---- fused q/k norm + RoPE + KV write (Qwen3 has the norms, SmolLM2 not)
            label = f"prepare_qkv[{model},{s}]"
            if want(label):
                def launch(dtype=dtype, hq=hq, hkv=hkv, dh=dh, norm=model.startswith("qwen3")):
                    T = 37
                    qkv = torch.zeros(T, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
                    w = torch.ones(dh, dtype=dtype, device=dev) if norm else None
                    cache = torch.zeros(8, PAGE, hkv, dh, dtype=dtype, device=dev)
                    qkv_prep.prepare_qkv(qkv, hq, hkv, dh, w, w, 1e-6, torch.arange(T, device=dev),
                                         torch.zeros(4096, dh, device=dev), cache, cache.clone(),
                                         torch.arange(T, dtype=torch.int64, device=dev))

                yield label, qkv_prep, ["_qkv_prep_kernel"], launch

            # ---- RoPE (cos_sin table fp32, positions int64)
            label = f"apply_rope[{model},{s}]"
            if want(label):
                def launch(dtype=dtype, hq=hq, hkv=hkv, dh=dh):
                    T = 37
                    qkv = torch.zeros(T, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
                    q = qkv[:, : hq * dh].view(T, hq, dh)
                    k = qkv[:, hq * dh:(hq + hkv) * dh].view(T, hkv, dh)
                    cos_sin = torch.zeros(4096, dh, dtype=torch.float32, device=dev)
                    pos = torch.arange(T, dtype=torch.int64, device=dev)
                    rope.apply_rope(q, k, pos, cos_sin)

                yield label, rope, ["_rope_kernel"], launch

            # ---- SwiGLU gate: decode-sized and prefill-sized batches pick different tiles
            for n in (1, 512):
                label = f"silu_and_mul[{model},{s},n={n}]"
                if want(label):
                    def launch(dtype=dtype, n=n, inter=inter):
                        activation.silu_and_mul(torch.zeros(n, 2 * inter, dtype=dtype, device=dev))

                    yield label, activation, ["_silu_and_mul_kernel"], launch
                label = f"gelu_tanh_and_mul[{model},{s},n={n}]"
                if want(label):
                    def launch(dtype=dtype, n=n, inter=inter):
                        activation.gelu_tanh_and_mul(torch.zeros(n, 2 * inter, dtype=dtype, device=dev))

                    yield label, activation, ["_silu_and_mul_kernel"], launch

        # ---- sampling / penalties: fp32 logits over the model's vocab
        for B in (1, 64):
            # fp32 logits (a grammar's or penalties' rows) and bf16 (the runner's on CUDA)
            label = f"sample[{model},B={B},{'bf16' if B > 1 else 'fp32'}]"
            if want(label):
                def launch(B=B, vocab=vocab):
                    logits = torch.zeros(B, vocab, dtype=torch.bfloat16 if B > 1 else torch.float32, device=dev)
                    f32 = lambda v: torch.full((B,), v, dtype=torch.float32, device=dev)  # noqa: E731
                    sampling.sample(logits, f32(0.8), torch.full((B,), 50, dtype=torch.int32, device=dev),
                                    f32(0.9), f32(0.05), torch.arange(B, dtype=torch.int64, device=dev),
                                    torch.zeros(B, dtype=torch.int64, device=dev), use_top_k_top_p=False)

                yield label, sampling, ["_sample_kernel"], launch

            label = f"apply_penalties[{model},B={B}]"
            if want(label):
                def launch(B=B, vocab=vocab):
                    logits = torch.zeros(B, vocab, dtype=torch.float32, device=dev)
                    f32 = lambda v: torch.full((B,), v, dtype=torch.float32, device=dev)  # noqa: E731
                    sampling.apply_penalties(logits, torch.zeros(B, vocab, dtype=torch.bool, device=dev),
                                             torch.zeros(B, vocab, dtype=torch.int32, device=dev),
                                             f32(1.1), f32(0.1), f32(0.1))

                yield label, sampling, ["_penalties_kernel"], launch

    yield from _registered_cases(only)


def _variant_key(fn, args, kwargs, target) -> str:
    """What Triton compiles a launch under: the specialization of every argument (an int
    equal to 1 or a multiple of 16, a pointer's alignment) and the constexprs. Two
    launches with one key share one compiled kernel."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, specialization, _ = binder(*args, **{**kwargs, "debug": False})
    consts = sorted((k, repr(v)) for k, v in kwargs.items() if k.isupper() or k.startswith("num_"))
    return repr((specialization, consts))


# Batch sizes a run meets step after step: one variant must serve them all.
VARIANT_SIZES = (1, 2, 15, 16, 17, 48, 256, 300)


def _staged(chunks):
    """A step's metadata as the runner stages it: gpu/runner.stage_inputs, then the real
    Staging packing (one int64 and one int32 buffer, arrays back to back, each padded to
    16 bytes), on CPU tensors. Odd batch sizes put the arrays after the first one at odd
    element offsets: without the padding their alignment, and so their variant, would
    change with the batch."""
    import torch

    from gpu.worker.staging import Staging, upload_inputs, stage_inputs

    host = stage_inputs(tuple(chunks), PAGE)
    return upload_inputs(host, torch.device("cpu"), Staging(torch.device("cpu")))


def _chunks(B, q_len, blocks, ctx=40):
    from gpu.interface import SeqChunk

    blocks = max(blocks, -(-ctx // PAGE))   # at least the context's; more widens the table
    return [SeqChunk(f"s{i}", (1,) * q_len, ctx - q_len, tuple(range(i * blocks, (i + 1) * blocks)), True)
            for i in range(B)]


def _variant_cases():
    """Yield (label, module, kernel_names, [launch per step size]) at Qwen3-0.6B's shapes."""
    import torch

    from gpu.kernels.triton import activation, kv_cache, mla_decode, paged_attention, qkv_prep, rmsnorm, rope, sampling

    _, hq, hkv, dh, hidden, inter, vocab = MODELS[1]
    dtype, dev = torch.bfloat16, "cpu"

    def attention(B, q_len, blocks):
        _, _, meta, _ = _staged(_chunks(B, q_len, blocks, ctx=max(40, q_len)))
        k_cache = torch.zeros(B * meta.block_tables.shape[1], PAGE, hkv, dh, dtype=dtype, device=dev)
        qkv = torch.zeros(B * q_len, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
        q = qkv[:, : hq * dh].view(B * q_len, hq, dh)
        paged_attention.paged_attention(q, k_cache, k_cache.clone(), meta.block_tables, meta.cu_seqlens_q,
                                        meta.seq_lens, dh ** -0.5, max_seqlen_q=q_len)

    names = ["_paged_attention_kernel", "_decode_attention_kernel", "_combine_splits_kernel"]
    yield ("paged_attention decode (B, block-table width)", paged_attention, names,
           [lambda b=b: attention(b, 1, 3 + b % 5) for b in VARIANT_SIZES])
    yield ("paged_attention prefill/mixed (B, q_len)", paged_attention, names,
           [lambda b=b: attention(1 + b % 7, 2 + b, 3 + (2 + b) // PAGE) for b in VARIANT_SIZES])

    def latent(B, blocks):
        _, _, meta, _ = _staged(_chunks(B, 1, blocks, ctx=40))
        cache = torch.zeros(B * meta.block_tables.shape[1], PAGE, 1, 576, dtype=dtype, device=dev)
        mla_decode.mla_decode(torch.zeros(B, 16, 576, dtype=dtype), cache, meta.block_tables, meta.seq_lens,
                              0.1, 512)

    yield ("mla_decode (B, block-table width; DeepSeek-V3 at TP 8)", mla_decode, ["_mla_decode_kernel"],
           [lambda b=b: latent(b, 3 + b % 5) for b in VARIANT_SIZES])

    def roped(B):
        _, positions, _, _ = _staged(_chunks(B, 1 + B % 3, 4))
        T = positions.shape[0]
        qkv = torch.zeros(T, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
        rope.apply_rope(qkv[:, : hq * dh].view(T, hq, dh), qkv[:, hq * dh:(hq + hkv) * dh].view(T, hkv, dh),
                        positions, torch.zeros(64, dh, dtype=torch.float32))

    yield "apply_rope (T, staged positions)", rope, ["_rope_kernel"], [lambda b=b: roped(b) for b in VARIANT_SIZES]

    def prepped(B):
        _, positions, meta, _ = _staged(_chunks(B, 1 + B % 3, 4))
        T = positions.shape[0]
        cache = torch.zeros(4 * B, PAGE, hkv, dh, dtype=dtype)
        w = torch.ones(dh, dtype=dtype)
        qkv_prep.prepare_qkv(torch.zeros(T, (hq + 2 * hkv) * dh, dtype=dtype), hq, hkv, dh, w, w, 1e-6,
                             positions, torch.zeros(64, dh), cache, cache.clone(), meta.slot_mapping)

    yield ("prepare_qkv (T, staged positions and slots)", qkv_prep, ["_qkv_prep_kernel"],
           [lambda b=b: prepped(b) for b in VARIANT_SIZES])

    def write(T):
        _, _, meta, _ = _staged(_chunks(T, 1, 2))     # the slot mapping as staged
        qkv = torch.zeros(T, (hq + 2 * hkv) * dh, dtype=dtype, device=dev)
        cache = torch.zeros(3 * T, PAGE, hkv, dh, dtype=dtype, device=dev)
        kv_cache.write_kv(qkv[:, hq * dh:(hq + hkv) * dh].view(T, hkv, dh),
                          qkv[:, (hq + hkv) * dh:].view(T, hkv, dh), cache, cache.clone(),
                          meta.slot_mapping)

    yield "write_kv (T, staged slots)", kv_cache, ["_write_kv_kernel"], [lambda t=t: write(t) for t in VARIANT_SIZES]
    yield ("fused_add_rms_norm (T)", rmsnorm, ["_rms_norm_kernel"],
           [lambda t=t: rmsnorm.fused_add_rms_norm(torch.zeros(t, hidden, dtype=dtype), torch.zeros(t, hidden, dtype=dtype),
                                                   torch.ones(hidden, dtype=dtype), 1e-6) for t in VARIANT_SIZES])
    yield ("silu_and_mul (T)", activation, ["_silu_and_mul_kernel"],
           [lambda t=t: activation.silu_and_mul(torch.zeros(t, 2 * inter, dtype=dtype)) for t in VARIANT_SIZES])

    def draw(B):
        f32 = lambda v: torch.full((B,), v, dtype=torch.float32)  # noqa: E731
        sampling.sample(torch.zeros(B, vocab), f32(0.8), torch.zeros(B, dtype=torch.int32), f32(1.0), f32(0.0),
                        torch.arange(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                        use_top_k_top_p=False, use_min_p=False)

    yield "sample (B)", sampling, ["_sample_kernel"], [lambda b=b: draw(b) for b in VARIANT_SIZES]

    def penalise(B):
        f32 = lambda v: torch.full((B,), v, dtype=torch.float32)  # noqa: E731
        sampling.apply_penalties(torch.zeros(B, vocab), torch.zeros(B, vocab, dtype=torch.bool),
                                 torch.zeros(B, vocab, dtype=torch.int32), f32(1.1), f32(0.1), f32(0.1))

    yield "apply_penalties (B)", sampling, ["_penalties_kernel"], [lambda b=b: penalise(b) for b in VARIANT_SIZES]
    yield from _delta_rule_variants()


def _delta_rule_variants():
    """Gated DeltaNet's kernels at Qwen3-Next-80B's shapes (16 key and 32 value heads of 128),
    the projections' rows strided as GatedDeltaNet slices them: any batch, any chunk length."""
    import torch

    from gpu.kernels.triton import delta_rule

    Hk, Hv, D, S = 16, 32, 128, 64
    C = 2 * Hk * D + Hv * D

    def prefill(B, L):
        y = torch.zeros(B, L, C, dtype=torch.bfloat16)
        q, k, v = y.split([Hk * D, Hk * D, Hv * D], dim=-1)
        g = torch.zeros(B, L, Hv)
        delta_rule.chunked(q.view(B, L, Hk, D), k.view(B, L, Hk, D), v.view(B, L, Hv, D), g, g.clone(),
                           torch.full((B,), L), torch.zeros(S, Hv, D, D), torch.arange(B) % S,
                           torch.ones(B, dtype=torch.bool))

    def decode(B):
        y = torch.zeros(B, C, dtype=torch.bfloat16)
        conv = delta_rule.conv1d_step(y, torch.zeros(C, 4, dtype=torch.bfloat16),
                                      torch.zeros(S, C, 3, dtype=torch.bfloat16), torch.arange(B) % S)
        q, k, v = conv.split([Hk * D, Hk * D, Hv * D], dim=-1)
        g = torch.zeros(B, Hv)
        delta_rule.recurrent_step(q.view(B, Hk, D), k.view(B, Hk, D), v.view(B, Hv, D), g, g.clone(),
                                  torch.zeros(S, Hv, D, D), torch.arange(B) % S)

    yield ("gated_delta_rule chunked (B, L)", delta_rule, ["_chunked_kernel"],
           [lambda b=b: prefill(1 + b % 4, b) for b in VARIANT_SIZES])
    yield ("gated_delta_rule step, causal_conv1d step (B)", delta_rule, ["_step_kernel", "_conv_step_kernel"],
           [lambda b=b: decode(b) for b in VARIANT_SIZES])


def check_variants(target) -> int:
    """--variants: each kernel at every step size of VARIANT_SIZES must bind to one
    compiled variant (no compile in the middle of a run). Nothing is compiled."""
    n_fail = 0
    for label, module, names, launches in _variant_cases():
        keys: dict[str, set[str]] = {}
        for launch in launches:
            for kname, fn, a, kw in _record(module, names, launch):
                keys.setdefault(kname, set()).add(_variant_key(fn, a, kw, target))
        for kname, found in keys.items():
            ok = len(found) == 1
            n_fail += not ok
            print(f"{'OK  ' if ok else 'FAIL'} {kname} {label}: {len(found)} variant(s) over sizes {VARIANT_SIZES}",
                  flush=True)
    return 1 if n_fail else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--only", default=None, help="only variants whose label contains this string")
    parser.add_argument("--cache-dir", default=None, help="TRITON_CACHE_DIR (default: a fresh temp dir, "
                                                          "so every kernel is really compiled)")
    parser.add_argument("--expect-triton", default=None, metavar="VERSION",
                        help="fail unless the imported triton is this version, e.g. 3.6.0")
    parser.add_argument("-v", "--verbose", action="store_true", help="full tracebacks on failure")
    parser.add_argument("--variants", action="store_true",
                        help="compile nothing: check that each kernel binds to one variant whatever "
                             "the batch size (do_not_specialize; block sizes from the model's shapes)")
    parser.add_argument("--list", action="store_true",
                        help="print KERNELS: each kernel gpu_check checks, in this tree or not yet")
    parser.add_argument("--tests", action="store_true",
                        help="print the test files of KERNELS that exist here, one a line")
    parser.add_argument("--gpus", type=int, default=1, help="with --list/--tests: GPUs there are")
    args = parser.parse_args()
    if args.list or args.tests:
        for name, status, test in kernel_status(args.gpus):
            if args.list:
                print(f"{name}: {status}" + (f" ({test})" if test else ""))
            elif test:
                print(test)
        return 0

    tmp = None
    if args.cache_dir:
        os.environ["TRITON_CACHE_DIR"] = args.cache_dir
    else:
        tmp = tempfile.TemporaryDirectory(prefix="triton_aot_check_")
        os.environ["TRITON_CACHE_DIR"] = tmp.name

    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)}), target sm_{args.arch}", flush=True)
    if args.expect_triton and triton.__version__ != args.expect_triton:
        print(f"FAIL triton {triton.__version__} imported, expected {args.expect_triton}", flush=True)
        return 1
    max_shared = MAX_SHARED.get(args.arch)
    if args.variants:
        return check_variants(target)

    n_ok = n_fail = 0
    for label, module, names, launch in _cases(args.only):
        try:
            calls = _record(module, names, launch)
            assert calls, "the launcher launched no kernel"
        except Exception as exc:  # noqa: BLE001
            n_fail += 1
            print(f"FAIL {label}: launcher: {type(exc).__name__}: {exc}", flush=True)
            if args.verbose:
                traceback.print_exc()
            continue
        for kname, fn, a, kw in calls:
            consts = {k: v for k, v in kw.items() if k.isupper()}
            opts = {k: v for k, v in kw.items() if not k.isupper()}
            line = f"{kname} {label} {consts} {opts}"
            t0 = time.perf_counter()
            try:
                kernel = _compile(fn, a, kw, target)
                cubin = kernel.asm.get("cubin", b"")
                assert cubin, "no cubin produced"
                shared = int(getattr(kernel.metadata, "shared", 0) or 0)
                if max_shared is not None and shared > max_shared:
                    raise RuntimeError(f"needs {shared} B shared memory > {max_shared} B on sm_{args.arch}")
            except Exception as exc:  # noqa: BLE001
                n_fail += 1
                msg = str(exc).strip().splitlines()
                print(f"FAIL {line}: {type(exc).__name__}: {msg[0] if msg else ''}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                continue
            n_ok += 1
            print(f"OK   {line} shared={shared}B cubin={len(cubin)}B {time.perf_counter() - t0:.1f}s", flush=True)

    print(f"{n_ok} OK, {n_fail} FAIL (triton {triton.__version__}, sm_{args.arch})", flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 1 if n_fail or not n_ok else 0


if __name__ == "__main__":
    sys.exit(main())
