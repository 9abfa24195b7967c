"""The decode step's decoder stack in one C call (gpu/kernels/cpu/layer.c, issue 39) against the
per-layer packed path it replaces, on the bundled SmolLM2 GGUF through ModelRunner: the same
greedy tokens, logits within 1e-3 (measured ~1e-4 on logits of magnitude ~20-30: the attention's
and silu's sums round in another order), the same KV cache to 1e-4; and the steps it must leave
to the per-layer path (a prefill in the step, a hooked linear, a slot out of range)."""

import contextlib
import ctypes
import shutil
import subprocess

import pytest
import torch

from gpu.kernels.cpu import layer as cpu_layer

from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.attention import KVCache
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.loader.decoder import load_model
from gpu.worker.runner import ModelRunner
from tests.support.cpu_layer_runs import BLOCKS, BS, _Counting, _prefilled, _run

pytestmark = pytest.mark.skipif(cpu_layer.library() is None, reason="gpu/kernels/cpu/layer.c is not built (no C compiler)")


@pytest.fixture(scope="module")
def lm():
    model = load_model(None, progress=False).model    # the default for a GGUF file on a CPU: packed
    assert model.fused_decode is not None
    return model

@pytest.fixture(autouse=True)
def one_thread(request):
    """One OpenMP thread except where a test asks for two (the C stack's barriers): on a shared
    machine each barrier between two threads can wait out a time slice, and a test step then
    takes a second instead of tens of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(getattr(request, "param", 1))
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n, one_thread", [(1, 1), (3, 2)], indirect=["one_thread"], ids=["1-seq", "3-seqs-2-threads"])
def test_fused_stack_matches_per_layer_path(lm, n, one_thread, monkeypatch):
    """The fp32 tiles: logits within 1e-3. With the int16 GEMV tiles (AVX2 builds without
    AVX-512, their default at 1-2 rows), the two paths' inputs to each linear differ by fp32
    rounding and so round to int16 apart: the same tokens, logits within 5e-2."""
    counting = _Counting(lm.fused_decode._fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    try:
        if _set_int16_gemv(-1):
            i16_tokens, i16_logits, _ = _run(lm, True, n, steps=3)
            i16_want_tokens, i16_want_logits, _ = _run(lm, False, n, steps=3)
            assert i16_tokens == i16_want_tokens
            assert max((a - b).abs().max().item() for a, b in zip(i16_logits, i16_want_logits)) < 5e-2
            counting.rcs.clear()
        _set_int16_gemv(0)
        got_tokens, got_logits, got_cache = _run(lm, True, n, steps=3)
        assert counting.rcs == [0] * 3        # every decode step in the C stack, none of the prefill
        want_tokens, want_logits, want_cache = _run(lm, False, n, steps=3)
    finally:
        _set_int16_gemv(-1)
    assert len(counting.rcs) == 3         # off: not called
    assert got_tokens == want_tokens
    err = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits))
    print(f"max |logits - per-layer path's| {err:.2e}")
    assert err < 1e-3, err
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        assert (a - b).abs().max().item() < 1e-4


def _run_verify(lm, fused: bool, n: int):
    """Prefill n sequences, then one verify step: each sequence's last token and three
    drafts (a verify's short chunk). (its tokens, its logits [4 n, V], the cache)."""
    with _prefilled(lm, fused, n) as (runner, prompts, tables, res, logits, cache):
        res = runner.execute(StepPlan(1, tuple(
            SeqChunk(str(i), (res.token_ids[i], 11, 12 + i, 13), len(p), tables[i], True, num_drafts=3)
            for i, p in enumerate(prompts))))
    return res.token_ids, logits[-1], cache


@pytest.mark.parametrize("one_thread", [2], indirect=True, ids=["2-threads"])
def test_a_verify_step_runs_in_the_fused_stack(lm, one_thread, monkeypatch):
    """A verify step (each sequence's last token and three drafts: four rows of one sequence,
    each seeing the keys up to its own position) in the C stack, against the per-layer path:
    the same tokens, logits within 1e-3, the same KV. Its 12 rows take the GEMM tiles: the fp32
    ones here (with the int16 tiles, where the build has them, the two paths' inputs to each
    linear differ by fp32 rounding and so round to int16 apart: same tokens, logits within 5e-2)."""
    counting = _Counting(lm.fused_decode._fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    try:
        has16 = _set_int16(1)
        if has16:
            i16_tokens, i16_logits, _ = _run_verify(lm, True, 3)
            i16_want_tokens, i16_want_logits, _ = _run_verify(lm, False, 3)
            assert counting.rcs == [0]
            counting.rcs.clear()
        _set_int16(0)
        got_tokens, got_logits, got_cache = _run_verify(lm, True, 3)
        assert counting.rcs == [0]            # the verify step in the C stack (the prefill not)
        want_tokens, want_logits, want_cache = _run_verify(lm, False, 3)
    finally:
        _set_int16(-1)
    assert got_logits.shape[0] == 12
    assert got_tokens == want_tokens
    assert (got_logits - want_logits).abs().max().item() < 1e-3
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        assert (a - b).abs().max().item() < 1e-4
    if has16:
        assert i16_tokens == i16_want_tokens == want_tokens
        assert (i16_logits - i16_want_logits).abs().max().item() < 5e-2


def _set_gemm(min_m: int, max_m: int) -> None:
    """The GEMM tiles' rows in both libraries (the C stack's, and the per-layer path's for the
    LM head): -1, -1 for the defaults, max_m 0 for none."""
    cpu_layer.library().cpu_quant_set_gemm(min_m, max_m)
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_gemm(max_m, min_m)


def _set_int16_gemv(max_m: int) -> bool:
    """The int16 GEMV tiles' most rows in both libraries (-1 the default, 0 none); whether the C
    stack's build has them (AVX2 without AVX-512)."""
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_int16_gemv(max_m)
    return bool(cpu_layer.library().cpu_quant_set_int16_gemv(max_m))


def _set_int16(on: int) -> bool:
    """The int16 GEMM tiles in both libraries (1 on, 0 off, -1 the default); whether the C
    stack's build has them (AVX512_VNNI, or AVX2 without AVX-512)."""
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_int16(on)
    return bool(cpu_layer.library().cpu_quant_set_int16(on))


def test_gemm_tiles_in_the_stack(lm):
    """17 sequences (groups of 9 and 8 rows): the C stack's linears and gate_up by the fp32 GEMM
    tiles (gpu/kernels/cpu/quant_gemm.c, AVX-512 and AVX2 builds) against the same stack with them off and
    against the per-layer path with them off (the fused and buffered fp32 tiles: the dequantized
    fp32 model up to the order of the sums): the same greedy tokens, logits within 1e-3. Then,
    where the build has AVX512_VNNI, the int16 tiles (x quantized per 32-element block, ~2^-16
    of its largest) in the stack: the same greedy tokens as the fp32 model, logits within 5e-2
    of it (measured 2e-2 on logits of magnitude ~20-30: each of the 120 linears adds ~2^-16 of
    its inputs' block maxima; not equal: they ran); elsewhere that part skips."""
    if not cpu_layer.library().cpu_quant_set_gemm(1, 48):
        _set_gemm(-1, -1)
        pytest.skip("no GEMM tiles in this build")
    try:
        has16 = _set_int16(1)
        if has16:
            i16_tokens, i16_logits, _ = _run(lm, True, 17, steps=3)
        _set_int16(0)
        got_tokens, got_logits, _ = _run(lm, True, 17, steps=3)
        _set_gemm(-1, 0)
        off_tokens, off_logits, _ = _run(lm, True, 17, steps=3)
        want_tokens = _run(lm, False, 17, steps=3)[0]
    finally:
        _set_gemm(-1, -1)
        _set_int16(-1)
    assert got_tokens == off_tokens == want_tokens
    err = max((a - b).abs().max().item() for a, b in zip(got_logits, off_logits))
    print(f"max |logits - GEMM tiles off| {err:.2e}")
    assert err < 1e-3, err
    if not has16:
        pytest.skip("the int16 GEMM tiles: no AVX512_VNNI in this build (the fp32 tiles passed)")
    assert i16_tokens == want_tokens
    err16 = max((a - b).abs().max().item() for a, b in zip(i16_logits, off_logits))
    print(f"max |logits (int16 GEMM tiles) - GEMM tiles off| {err16:.2e}")
    assert 0 < err16 < 5e-2, err16


def test_declines_what_it_does_not_compute(lm, monkeypatch):
    counting = _Counting(lm.fused_decode._fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    hook = lm.layers[3].mlp.down_proj.register_forward_hook(lambda mod, args, out: None)   # as LoRA's
    try:
        hooked_tokens = _run(lm, True, 1, steps=2)[0]
    finally:
        hook.remove()
    assert counting.rcs == []             # a hooked linear: the per-layer path runs every step
    assert hooked_tokens == _run(lm, False, 1, steps=2)[0]
    # a slot outside the cache: the C stack writes nothing and returns -1, the torch path serves
    # (which then raises on the same slot, as it always has)
    c = lm.config
    cache = KVCache(c.num_hidden_layers, 2, BS, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, device=torch.device("cpu"))
    g = SamplingOptions(temperature=0.0)
    runner.execute(StepPlan(0, (SeqChunk("a", (1, 2, 3), 0, (0,), True),), (SeqStart("a", (1, 2, 3), g),)))
    before = [t.clone() for t in cache.k]
    with pytest.raises(Exception):
        runner.execute(StepPlan(1, (SeqChunk("a", (4,), 3 + 2 * BS, (0, 1, 5), True),)))   # block 5 of 2
    assert counting.rcs[-1] == -1
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k))


@pytest.mark.parametrize("march", ["haswell", "x86-64"], ids=["avx2", "scalar"])
def test_other_isa_builds_agree(lm, tmp_path, march, monkeypatch):
    """The same source built for an AVX2-only CPU and for no vector ISA: the same tokens (the
    AVX2 build also with its GEMM tiles taking every row: NP = 16 panels, gate/up tiles; with its
    fp32 tiles, then its int16 ones)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / f"layer-{march}.so"
    subprocess.run([cc, "-O2", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
                    "-std=gnu11", str(cpu_layer._SOURCE), "-o", str(so), "-lm"], check=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    lib.cpu_layer_vector_width.restype = ctypes.c_int
    assert lib.cpu_layer_vector_width() == (8 if march == "haswell" else 1)
    fn = lib.cpu_layers_decode
    fn.restype, fn.argtypes = ctypes.c_int, cpu_layer.library().cpu_layers_decode.argtypes
    counting = _Counting(fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    # the int16 GEMV tiles (AVX2 builds) off in both: fp32 tiles, logits within 1e-3
    lib.cpu_quant_set_int16_gemv.restype, lib.cpu_quant_set_int16_gemv.argtypes = ctypes.c_int, [ctypes.c_int]
    assert bool(lib.cpu_quant_set_int16_gemv(-1)) == (march == "haswell")
    if march == "haswell":   # with them on, in both: the same tokens, logits within 5e-2 (test above)
        _set_int16_gemv(-1)   # the native build's too, where it has them (else its fp32 tiles)
        tokens, logits, _ = _run(lm, True, 2, steps=2)
        want_tokens, want_logits, _ = _run(lm, False, 2, steps=2)
        assert tokens == want_tokens
        assert max((a - b).abs().max().item() for a, b in zip(logits, want_logits)) < 5e-2
        counting.rcs.clear()
    lib.cpu_quant_set_int16_gemv(0)
    _set_int16_gemv(0)
    # and the int16 GEMM tiles (AVX2 builds too, issue 60) off in both: the fp32 GEMM tiles below
    lib.cpu_quant_set_int16.restype, lib.cpu_quant_set_int16.argtypes = ctypes.c_int, [ctypes.c_int]
    assert bool(lib.cpu_quant_set_int16(0)) == (march == "haswell")
    _set_int16(0)
    try:
        tokens, logits, _ = _run(lm, True, 2, steps=2)
        assert counting.rcs == [0] * 2
        want_tokens, want_logits, _ = _run(lm, False, 2, steps=2)
        assert tokens == want_tokens
        assert max((a - b).abs().max().item() for a, b in zip(logits, want_logits)) < 1e-3
        lib.cpu_quant_set_gemm.restype, lib.cpu_quant_set_gemm.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
        if lib.cpu_quant_set_gemm(1, 48):
            assert march == "haswell"
            gemm_tokens, gemm_logits, _ = _run(lm, True, 2, steps=2)
            assert counting.rcs == [0] * 4
            assert gemm_tokens == want_tokens
            assert max((a - b).abs().max().item() for a, b in zip(gemm_logits, want_logits)) < 1e-3
            lib.cpu_quant_set_int16(1)   # the AVX2 build's int16 GEMM tiles at every row: as the GEMV ones
            gemm_tokens, gemm_logits, _ = _run(lm, True, 2, steps=2)
            assert counting.rcs == [0] * 6
            assert gemm_tokens == want_tokens
            assert max((a - b).abs().max().item() for a, b in zip(gemm_logits, want_logits)) < 5e-2
    finally:
        _set_int16_gemv(-1)
        _set_int16(-1)


def test_after_sleep_and_wake(lm):
    """Sleep mode remakes the KV cache's tensors: the C stack rebuilds its pointers on wake-up
    (a stale one would write into freed memory) and decodes as the per-layer path does."""
    from gpu.worker.sleep import Sleeper
    want = _run(lm, False, 1, steps=2)[0]
    c = lm.config
    cache = KVCache(c.num_hidden_layers, BLOCKS, BS, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(lm, cache, device=torch.device("cpu"))
    g = SamplingOptions(temperature=0.0)
    runner.execute(StepPlan(0, (SeqChunk("a", (1, 2, 3), 0, tuple(range(BLOCKS)), True),),
                            (SeqStart("a", (1, 2, 3), g),)))
    runner.execute(StepPlan(1, (SeqChunk("a", (9,), 3, tuple(range(BLOCKS)), True),)))   # builds the structs
    sleeper = Sleeper(runner, None)
    sleeper.sleep(1)
    sleeper.wake_up()
    assert lm.fused_decode._model is None
    prompt = tuple(range(300, 303))
    res = runner.execute(StepPlan(2, (SeqChunk("b", prompt, 0, tuple(range(BLOCKS)), True),), (SeqStart("b", prompt, g),)))
    tokens = [res.token_ids]
    for step in (3, 4):
        res = runner.execute(StepPlan(step, (SeqChunk("b", (tokens[-1][0],), len(prompt) + step - 3,
                                                      tuple(range(BLOCKS)), True),)))
        tokens.append(res.token_ids)
    assert lm.fused_decode._model is not None and tokens == want
