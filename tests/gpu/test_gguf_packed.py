"""GGUF weights kept packed on the CPU (gpu/kernels/cpu/quant.c, gpu/quantization/gguf.py, issue 39), against
gguf-py's own dequantization: tensors quantized here with gguf-py, K-quant blocks drawn at random
(gguf-py cannot quantize them), and the bundled SmolLM2's tensors; then the whole packed model's
logits and greedy tokens against the dequantized fp32 model.

Tolerances: the kernels' dequantized values equal gguf-py's bit for bit (max error 0, every
format); a linear's outputs are fp32 dot products of those values, so they match an fp64
product of gguf-py's dequantized weight to fp32 summation error: |err| <= 2e-5 * sqrt(K) *
max|x| * max|w| (measured ~10x below); the model's logits within 2e-3 of the dequantized fp32
model's (measured 6e-5 on logits of magnitude ~28)."""

import subprocess
import ctypes
import shutil

import gguf
import numpy as np
import pytest
import torch

from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.attention_dense import DenseCausalAttention, greedy_generate
from gpu.loader.decoder import load_model
from gpu.parallel import SINGLE
from gpu.tokenizers.files import default_model_path

Q = gguf.GGMLQuantizationType
K = cpu_quant.kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the CPU quant kernels are not built (no C compiler)")

BLOCK_BYTES = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
# where a K-quant block keeps its fp16 d (and dmin after it)
SCALE_AT = {Q.Q2_K: 80, Q.Q3_K: 108, Q.Q4_K: 0, Q.Q5_K: 0, Q.Q6_K: 208}


def _quantized(qtype, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(packed [rows, row_bytes] uint8, gguf-py's dequantization [rows, cols] fp32)."""
    rng = np.random.default_rng(seed)
    if qtype in BLOCK_BYTES:   # random blocks with sane fp16 scales (d, dmin / d at the block's end)
        bb = BLOCK_BYTES[qtype]
        packed = rng.integers(0, 256, (rows, cols // 256 * bb), dtype=np.uint8)
        blocks = packed.reshape(rows, -1, bb)
        scale = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)
        at = SCALE_AT[qtype]
        blocks[..., at:at + 2] = scale
        if qtype not in (Q.Q3_K, Q.Q6_K):   # dmin
            blocks[..., at + 2:at + 4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    else:
        packed = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return packed, gguf.quants.dequantize(packed, qtype).reshape(rows, cols)


FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_each_format_against_gguf_py(qtype):
    rows, cols = 37, 512   # rows: not a multiple of the kernel's tile
    packed, ref = _quantized(qtype, rows, cols)
    w = torch.from_numpy(packed)
    assert np.array_equal(K.dequantize(int(qtype), w, cols).numpy(), ref)   # max error 0
    bias = torch.randn(rows)
    lin = cpu_quant.PackedLinear(cols, [(int(qtype), w)], bias)
    ref64 = torch.from_numpy(ref).double()
    for m in (1, 3, 5, 8, 30, K.large_m + 3):   # the GEMV tiles, their tails, the GEMM tiles, the large-M path
        x = torch.randn(m, cols)
        y = lin(x)
        want = x.double() @ ref64.T + bias.double()
        bound = 2e-5 * cols ** 0.5 * x.abs().max().item() * max(ref64.abs().max().item(), 1.0)
        assert y.shape == (m, rows) and y.dtype == torch.float32
        assert (y.double() - want).abs().max().item() <= bound, (qtype.name, m)


def test_mixed_segments_and_strided_input():
    """A merged projection whose parts differ in format (a Q4_K_M file's attn_v is Q6_K),
    fed a non-contiguous view."""
    (a, ra), (b, rb) = _quantized(Q.Q4_K, 20, 256, 1), _quantized(Q.Q6_K, 9, 256, 2)
    lin = cpu_quant.PackedLinear(256, [(int(Q.Q4_K), torch.from_numpy(a)), (int(Q.Q6_K), torch.from_numpy(b))])
    x = torch.randn(4, 512)[:, ::2]
    want = x.double() @ torch.from_numpy(np.concatenate([ra, rb])).double().T
    try:   # the fp32 tiles; 4 rows of K-quants take the int16 GEMV tiles in an AVX2 build by default
        K.set_int16_gemv(0)
        assert torch.allclose(lin(x).double(), want, atol=1e-4, rtol=1e-5)
    finally:
        K.set_int16_gemv(-1)
    bound = torch.cat([_int16_gemv_bound(Q.Q4_K, a, ra, x), _int16_gemv_bound(Q.Q6_K, b, rb, x)], 1) + 1e-4
    assert ((lin(x).double() - want).abs() <= bound).all()
    assert torch.equal(lin.dequantized(), torch.from_numpy(np.concatenate([ra, rb])))


def test_bundled_model_tensors():
    """The SmolLM2 file's own Q4_1 and Q8_0 tensors (the embedding's first 1024 rows)
    dequantize exactly as gguf-py does."""
    reader = gguf.GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        data = np.array(t.data[:1024], copy=True)
        cols = int(t.shape[0])
        ref = gguf.quants.dequantize(data, t.tensor_type).reshape(-1, cols)
        assert np.array_equal(K.dequantize(int(t.tensor_type), torch.from_numpy(data), cols).numpy(), ref), name
    assert {tensors[n].tensor_type for n in ("blk.0.attn_q.weight", "token_embd.weight")} == {Q.Q4_1, Q.Q8_0}


@pytest.fixture(scope="module")
def packed_smollm():
    return load_model(None, progress=False)   # the default for a GGUF file on a CPU


def test_default_keeps_gguf_packed(packed_smollm, smollm):
    lm = packed_smollm.model
    assert "kept packed" in packed_smollm.weights and "Q4_1" in packed_smollm.weights
    assert isinstance(lm.layers[0].self_attn.qkv_proj, cpu_quant.PackedLinear)
    assert isinstance(lm.lm_head, cpu_quant.PackedLinear) and lm.lm_head.formats == (int(Q.Q8_0),)
    # the tied table: the head's blocks, looked up row by row; no fp32 copy of it
    assert isinstance(lm.embed_tokens, cpu_quant.PackedEmbedding) and lm.embed_tokens.packed is lm.lm_head.packed0
    assert "at load" not in packed_smollm.weights, packed_smollm.weights
    packed_bytes = sum(m.packed_bytes for m in lm.modules() if isinstance(m, cpu_quant.PackedLinear))
    assert packed_bytes < 0.3 * 4 * 134.5e6   # ~92 MB against the fp32 model's 538
    assert not isinstance(smollm.model.lm_head, cpu_quant.PackedLinear)   # --dtype float32: dequantized
    assert "GGUF: 210 Q4_1, 1 Q8_0 tensors dequantized to float32 at load" in smollm.weights, smollm.weights


@pytest.mark.parametrize("int16", [0, 1], ids=["fp32-tiles", "int16-tiles"])
def test_logits_and_greedy_match_dequantized_fp32(packed_smollm, smollm, int16):
    """The prompt's 37 rows take the GEMM tiles, the greedy steps' single rows the GEMV tiles.
    fp32 tiles: logits within 2e-3 of the dequantized fp32 model's. The int16 tiles (the default
    where the build has them: AVX512_VNNI's GEMM tiles, or an AVX2 build's GEMV tiles; x quantized
    per 32-element block to ~2^-16 of its largest, which the residual stream's outlier channels
    make large for the rest of their block): within 5e-2 (measured 2.5e-2 on logits of magnitude
    ~28, 1.6e-3 of it the LM head's; scripts/dtype_quality.py: mean KL 4.5e-7 from fp32). The
    same greedy tokens either way."""
    has = K.set_int16(1), K.set_int16_gemv(-1)
    if int16 and not any(has):
        pytest.skip("no int16 tiles in this build (AVX512_VNNI's GEMM tiles, AVX2's GEMV tiles)")
    K.set_int16(int16)
    K.set_int16_gemv(-1 if int16 else 0)
    tok = smollm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True))
    try:
        with torch.inference_mode():
            pos = torch.arange(len(ids))
            lm = packed_smollm.model
            got = lm.compute_logits(lm(torch.tensor(ids), pos, DenseCausalAttention()))
            want = smollm.model.compute_logits(smollm.model(torch.tensor(ids), pos, DenseCausalAttention()))
        err = (got - want).abs().max().item()
        print(f"max |logits - dequantized fp32's| {err:.2e}")
        assert err < (5e-2 if int16 else 2e-3), err
        assert greedy_generate(lm, ids, 8) == greedy_generate(smollm.model, ids, 8)
    finally:
        K.set_int16(-1)
        K.set_int16_gemv(-1)


def test_quantization_flag_errors():
    from gpu.loader.decoder import Source
    from gpu.quantization.gguf import GGUF
    with pytest.raises(ValueError, match="quantization"):
        load_model(None, quantization="int3", progress=False)
    not_gguf = Source(config=None, tokenizer=None, generation_config={}, name="x", num_tensors=0,
                      named_tensors=None)
    with pytest.raises(ValueError, match="--quantization gguf: the model is not a GGUF file"):
        GGUF.choose("gguf", not_gguf, "auto", "auto", "cpu", SINGLE)
    assert not GGUF.choose("auto", not_gguf, "auto", "auto", "cpu", SINGLE).packed


def _build(tmp_path, march: str) -> cpu_quant.QuantKernels:
    """gpu/kernels/cpu/quant.c built for -march=march (skips without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / f"q-{march}.so"
    subprocess.run([cc, "-O2", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
                    "-std=gnu11", str(cpu_quant._SOURCE), "-o", str(so)], check=True, timeout=120)
    return cpu_quant.QuantKernels(ctypes.CDLL(str(so)))


@pytest.mark.parametrize("march", ["haswell", "x86-64"], ids=["avx2", "scalar"])
def test_other_isa_builds_agree(tmp_path, march):
    """The same source built for an AVX2-only CPU and for no vector ISA gives the same results
    (what a machine without AVX-512 runs)."""
    other = _build(tmp_path, march)
    assert other.vector_width == (8 if march == "haswell" else 1)
    other.set_int16_gemv(0)   # the fp32 tiles (an AVX2 build's int16 GEMV tiles: test_int16_gemv_tiles_*,
    other.set_int16(0)        # its int16 GEMM tiles: test_gemm_tiles_against_gguf_py, test_int16_gemm_tiles_*)
    for qtype in FORMATS:
        packed, ref = _quantized(qtype, 13, 256, 3)
        w = torch.from_numpy(packed)
        assert np.array_equal(other.dequantize(int(qtype), w, 256).numpy(), ref), qtype.name
        x, y = torch.randn(5, 256), torch.empty(5, 13)
        other.matmul(int(qtype), w, x, y)
        assert torch.allclose(y.double(), x.double() @ torch.from_numpy(ref).double().T, atol=1e-4), qtype.name


@pytest.mark.parametrize("march", ["native", "haswell"], ids=["native", "avx2"])
def test_fused_small_m_tiles_bit_identical_to_buffered(tmp_path, march):
    """Few rows of Q4_0/Q4_1/Q8_0 are dequantized in registers (no fp32 row buffer): the
    same values, the same products summed in the same order, so bit for bit the buffered
    path's outputs (and so within the bounds above of gguf-py's)."""
    k = _build(tmp_path, march)
    if not k.set_fused(-1):
        pytest.skip(f"no AVX-512 or AVX2+FMA in -march={march}")
    k.set_gemm(0)   # the GEMM tiles would take some of these rows in both builds (test_gemm_tiles_*)
    k.set_int16_gemv(0)   # and the int16 GEMV tiles 1-2 rows in an AVX2 build (test_int16_gemv_tiles_*)
    mr = 6 if k.vector_width == 16 else 2   # gpu/kernels/cpu/quant.c FMR
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        packed, ref = _quantized(qtype, 23, 256, 4)   # 23 rows: a tile of fewer than NR rows at the end
        w = torch.from_numpy(packed)
        for m in range(1, 2 * mr + 2):                  # groups of mr rows, and a last short one
            x = torch.randn(m, 300)[:, 7:263]           # a row stride other than K
            fused, buffered = torch.empty(m, 23), torch.empty(m, 23)
            assert k.set_fused(64)
            k.matmul(int(qtype), w, x, fused)
            k.set_fused(0)
            k.matmul(int(qtype), w, x, buffered)
            assert torch.equal(fused, buffered), (qtype.name, m)
            want = x.double() @ torch.from_numpy(ref).double().T
            assert (fused.double() - want).abs().max().item() < 1e-4, (qtype.name, m)
    k.set_int16_gemv(-1)


INT16_FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q8_0)


def _int16_bound(qtype, packed: np.ndarray, ref: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on the int16 GEMM tiles' error from quantizing x (gpu/kernels/cpu/quant_gemm.c): x
    rounded per row and 32-element block b to dx_b = absmax_b / 32767 errs by <= absmax_b / 65534
    an element (x 1.002 for the fp32 rounding of x / dx_b), and multiplies only the integer part
    d q of each weight (w itself for Q4_0 and Q8_0, w - m for Q4_1, whose m multiplies the exact
    sum of x's block): sum_b sum_{k in b} |d q_k| absmax_b / 65534 * 1.002."""
    n, cols = ref.shape
    dq = np.abs(ref.astype(np.float64))
    if qtype == Q.Q4_1:   # the block's min m: its f16 at bytes 2..3 of each 20-byte block
        m = packed.reshape(n, cols // 32, 20)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        dq = np.abs(ref.astype(np.float64) - np.repeat(m, 32, axis=1))
    wsum = torch.from_numpy(dq.reshape(n, cols // 32, 32).sum(-1))               # [N, nb]
    xmax = x.double().abs().reshape(x.shape[0], cols // 32, 32).amax(-1)           # [M, nb]
    return xmax @ wsum.T / 65534 * 1.002


@pytest.mark.parametrize("march", ["native", "haswell"], ids=["native", "avx2"])
def test_gemm_tiles_against_gguf_py(tmp_path, march):
    """The outer-product GEMM tiles (gpu/kernels/cpu/quant_gemm.c, AVX-512 and AVX2+FMA builds; an
    AVX2 build must have them) against gguf-py's dequantized weight in fp64, at ragged shapes:
    N = 77 (AVX-512's panels of 32, 32 and 13, AVX2's of 16 x 4 and 13: a second vector half
    masked) and 9 (the second vector empty); K = 576 (K-chunks of 256, 256, 64) and 96 (one
    short chunk); rows from 1 to 200 (one group of up to GMR = 14 or 6, groups of unequal
    rows); x and y with row strides other than K and N; a bias. Each output sums up to 256
    products in k order, then the chunks' sums: the same bound as the other tiles (measured
    >100x below), and within it of the buffered tiles. y lies inside a NaN-filled larger
    tensor: nothing outside it is written (the masked tails). Both builds sum each output's
    products in the same order with one fp32 FMA each (the panel's width and the group's rows
    change which outputs a call computes, not how), so the AVX2 build's y equals the native
    AVX-512 build's bit for bit (checked where the native build is AVX-512, its int16 tiles off).

    Where the build has AVX512_VNNI, or is AVX2 without AVX-512 (issue 60), Q4_0/Q4_1/Q8_0 take
    the int16 tiles (x quantized per 32-element block): each output within _int16_bound (the
    quantization's error) plus the fp32 bound of gguf-py's product and of the fp32 tiles' result,
    and different from the fp32 tiles in some bits for each shape (the int16 tiles did run). The
    AVX2 build's int16 tiles (vpmaddwd + vpaddd) sum the same exact int32 block sums in the same
    order as AVX512_VNNI's (vpdpwssd): bit for bit the same y (checked where the native build
    has AVX512_VNNI)."""
    k = K if march == "native" else _build(tmp_path, march)
    has = k.set_gemm(10 ** 6, 1)
    native = K if march != "native" and K.vector_width == 16 and K.set_gemm(10 ** 6, 1) else None
    has16 = k.set_int16(1)
    native16 = native is not None and native.set_int16(1)
    assert march == "native" or has16   # an AVX2 build has them
    try:
        if march == "native" and not has:
            pytest.skip("no AVX-512 nor AVX2+FMA in this build")
        assert has and k.vector_width in (8, 16)
        assert march == "native" or k.vector_width == 8
        assert k.gemm_rows() == (1, 10 ** 6)
        cases = [(q, n, c) for q in (Q.Q4_0, Q.Q4_1, Q.Q8_0) for n, c in ((77, 576), (9, 96))]
        cases += [(Q.Q4_K, 45, 512), (Q.Q6_K, 45, 512)]   # the GEMM tiles take every format
        if has16:   # more ragged shapes for the int16 tiles: K-chunks of 512, 512, 32; one of 32
            cases += [(q, n, c) for q in INT16_FORMATS for n, c in ((33, 1056), (16, 32))]
        for qtype, n, cols in cases:
            packed, ref = _quantized(qtype, n, cols, 5)
            w, ref64, bias = torch.from_numpy(packed), torch.from_numpy(ref).double(), torch.randn(n)
            int16 = has16 and qtype in INT16_FORMATS
            differs = False
            for m in (1, 5, 6, 7, 8, 13, 14, 15, 29, 48, 64, 200):
                x = torch.randn(m, cols + 20)[:, 5:5 + cols]
                backing, buffered = torch.full((m + 2, n + 10), float("nan")), torch.empty(m, n)
                y = backing[1:1 + m, 3:3 + n]
                k.set_gemm(10 ** 6, 1)
                k.matmul(int(qtype), w, x, y, bias)
                outside = torch.ones_like(backing, dtype=torch.bool)
                outside[1:1 + m, 3:3 + n] = False
                assert backing[outside].isnan().all(), (qtype.name, n, cols, m)
                k.set_gemm(0)
                k.set_fused(0)
                k.matmul(int(qtype), w, x, buffered, bias)
                k.set_fused(-1)
                want = x.double() @ ref64.T + bias.double()
                bound = 2e-5 * cols ** 0.5 * x.abs().max().item() * max(ref64.abs().max().item(), 1.0)
                if int16:
                    k.set_int16(0)
                    k.set_gemm(10 ** 6, 1)
                    fp32_tiles = torch.empty(m, n)
                    k.matmul(int(qtype), w, x, fp32_tiles, bias)
                    k.set_int16(1)
                    differs |= not torch.equal(y, fp32_tiles)
                    bound16 = _int16_bound(qtype, packed, ref, x) + bound
                    err = (y.double() - want).abs()
                    assert (err <= bound16).all(), (qtype.name, n, cols, m, (err - bound16).max().item())
                    assert ((y.double() - fp32_tiles.double()).abs() <= bound16 + bound).all(), (qtype.name, n, cols, m)
                    print(f"{qtype.name} [{m} x {cols} x {n}]: int16 error {err.max().item():.2e}, "
                          f"{(err / bound16).max().item():.2f} of its bound")
                    if native16:
                        y512 = torch.empty(m, n)
                        native.set_int16(1)
                        native.matmul(int(qtype), w, x, y512, bias)
                        native.set_int16(-1)
                        assert torch.equal(y, y512), (qtype.name, n, cols, m, (y - y512).abs().max().item())
                    continue
                err = (y.double() - want).abs().max().item()
                assert err <= bound, (qtype.name, n, cols, m, err, bound)
                assert (y - buffered).abs().max().item() <= bound, (qtype.name, n, cols, m)
                if native is not None:
                    y512 = torch.empty(m, n)
                    native.set_int16(0)
                    native.matmul(int(qtype), w, x, y512, bias)
                    native.set_int16(-1)
                    assert torch.equal(y, y512), (qtype.name, n, cols, m, (y - y512).abs().max().item())
            assert differs or not int16, (qtype.name, n, cols, "the int16 tiles did not run")
    finally:
        k.set_gemm(-1)
        k.set_fused(-1)
        k.set_int16(-1)
        K.set_gemm(-1)
        K.set_int16(-1)


def test_int16_gemm_tiles_edge_blocks():
    """Blocks of x the int16 quantization must not mishandle: all zero, tiny (below 32767 x
    FLT_MIN, taken as zero), subnormal, huge (1e30: the scale, not the int16 range, carries it),
    within the bound; a NaN or an inf makes its row's outputs NaN and leaves the other rows'
    bits alone."""
    if not K.set_int16(1):
        K.set_int16(-1)
        pytest.skip("no int16 GEMM tiles in this build (AVX512_VNNI, or AVX2 without AVX-512)")
    packed, ref = _quantized(Q.Q4_1, 40, 256, 9)
    w, ref64 = torch.from_numpy(packed), torch.from_numpy(ref).double()
    x = torch.randn(12, 256)
    x[0, :32] = 0
    x[1, 32:64] = 1e-36
    x[2, 64:96] = torch.randn(32) * 1e-40     # subnormal
    x[3, 96:128] = torch.randn(32) * 1e30
    try:
        K.set_gemm(10 ** 6, 1)
        y = torch.empty(12, 40)
        K.matmul(int(Q.Q4_1), w, x, y)
        want = x.double() @ ref64.T
        bound = _int16_bound(Q.Q4_1, packed, ref, x) + 2e-5 * 16 * x.abs().amax(1, keepdim=True).double() * 2
        bound[1:3] += 32 * 1e-36 * ref64.abs().max()
        assert ((y.double() - want).abs() <= bound).all()
        bad = x.clone()
        bad[5, 7], bad[8, 200] = float("nan"), float("inf")
        yb = torch.empty(12, 40)
        K.matmul(int(Q.Q4_1), w, bad, yb)
        assert yb[[5, 8]].isnan().all()
        rest = [i for i in range(12) if i not in (5, 8)]
        assert torch.equal(yb[rest], y[rest])
    finally:
        K.set_gemm(-1)
        K.set_int16(-1)


@pytest.mark.parametrize("qtype", INT16_FORMATS, ids=lambda q: q.name)
def test_int16_gemm_tiles_deterministic(qtype):
    """The int16 GEMM tiles quantize each row of x alone and sum each output in one order, so a
    row's outputs are the same bits whatever rows share its call (its 24 rows, or 40: other
    groups of GMR16 = 6 rows), where it sits in the batch, and at 1 or 2 threads."""
    if not K.set_int16(1) or not K.int16(int(qtype)):
        K.set_int16(-1)
        pytest.skip("no int16 GEMM tiles in this build (AVX512_VNNI, or AVX2 without AVX-512)")
    threads = torch.get_num_threads()
    packed, _ = _quantized(qtype, 70, 1056, 8)   # 70: panels of 32, 32, 6; 1056: chunks of 512, 512, 32
    w, x = torch.from_numpy(packed), torch.randn(41, 1056)
    try:
        K.set_gemm(10 ** 6, 1)
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            # rows 0..22 of x first in a call of 24 or 40 rows, or from the second row of 24
            for rows, at in ((x[:24], 0), (x[:40], 0), (torch.cat([x[40:], x[:23]]), 1)):
                y = torch.empty(rows.shape[0], 70)
                K.matmul(int(qtype), w, rows, y)
                outs.append(y[at:at + 23].clone())
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        K.set_int16(0)
        y = torch.empty(24, 70)
        K.matmul(int(qtype), w, x[:24], y)
        assert not torch.equal(y[:23], outs[0])   # the int16 tiles did run
    finally:
        torch.set_num_threads(threads)
        K.set_gemm(-1)
        K.set_int16(-1)


def test_gemm_tiles_serve_packed_linear():
    """PackedLinear at the rows the GEMM tiles take by default (a merged qkv-like weight of two
    formats, so one call per segment into column slices of y; Q8_0's from more rows than
    Q4_1's), up to their most rows, which is then where torch's GEMM takes over: within the
    bound above of gguf-py's weight, and of the same call with them off."""
    (lo, hi), lo8 = K.gemm_rows(int(Q.Q4_1)), K.gemm_rows(int(Q.Q8_0))[0]
    if not hi:
        pytest.skip("no GEMM tiles in this build")
    assert K.large_m == hi >= cpu_quant.LARGE_M and lo <= lo8
    (a, ra), (b, rb) = _quantized(Q.Q4_1, 50, 576, 6), _quantized(Q.Q8_0, 19, 576, 7)
    lin = cpu_quant.PackedLinear(576, [(int(Q.Q4_1), torch.from_numpy(a)), (int(Q.Q8_0), torch.from_numpy(b))],
                                 torch.randn(69))
    ref64 = torch.from_numpy(np.concatenate([ra, rb])).double()
    try:
        for m in sorted({lo, lo8 - 1, lo8, 100, hi}):
            x = torch.randn(m, 576)
            got = lin(x)
            K.set_gemm(0)
            off = lin(x)
            K.set_gemm(-1)
            want = x.double() @ ref64.T + lin.bias.double()
            bound = 2e-5 * 576 ** 0.5 * x.abs().max().item() * max(ref64.abs().max().item(), 1.0)
            assert (got.double() - want).abs().max().item() <= bound, m
            assert (got - off).abs().max().item() <= bound, m
    finally:
        K.set_gemm(-1)


def _gemv_kernels(tmp_path) -> cpu_quant.QuantKernels:
    """A build with the int16 GEMV tiles: the native one where it has them (AVX2 without
    AVX-512), else the same source built for an AVX2-only CPU (so AVX-512 machines test them)."""
    if K.set_int16_gemv(-1):
        return K
    k = _build(tmp_path, "haswell")
    assert k.set_int16_gemv(-1) and k.int16_gemv_max_m() >= 1
    return k


def _int16_gemv_bound(qtype, packed: np.ndarray, ref: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on the int16 GEMV tiles' error from quantizing x: as _int16_bound, with the
    integer part of each weight w - min (Q4_1, Q5_1: its block's m; Q4_K/Q5_K: its sub-block's
    -dmin mn, found by dequantizing the blocks with their quants zeroed; the others: w)."""
    n, cols = ref.shape
    w = ref.astype(np.float64)
    if qtype in (Q.Q4_1, Q.Q5_1):
        bb = 20 if qtype == Q.Q4_1 else 24
        m = packed.reshape(n, cols // 32, bb)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        w = w - np.repeat(m, 32, axis=1)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        zeroed = packed.reshape(n, cols // 256, BLOCK_BYTES[qtype]).copy()
        zeroed[..., 16:] = 0   # qs (and Q5_K's qh): every q 0, so each weight is its sub-block's min
        w = w - gguf.quants.dequantize(zeroed.reshape(n, -1), qtype).reshape(n, cols).astype(np.float64)
    wsum = torch.from_numpy(np.abs(w).reshape(n, cols // 32, 32).sum(-1))
    xmax = x.double().abs().reshape(x.shape[0], cols // 32, 32).amax(-1)
    return xmax @ wsum.T / 65534 * 1.002


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_int16_gemv_tiles_against_gguf_py(tmp_path, qtype):
    """The int16 GEMV tiles (AVX2 builds without AVX-512: every format at 1-2 rows by default; here
    up to 5 rows, groups of IMR = 2 and a last one) against gguf-py's dequantized weight in fp64:
    N = 23 and 9 (tiles of 4 and a last short one; a tile alone), K = 256 and 768 (or 96 and 576
    for the 32-element formats), x with a row stride other than K, a bias, y inside a NaN-filled
    tensor (nothing outside it written). Each output within _int16_gemv_bound plus the fp32
    bound of the other tiles (2e-5 sqrt(K) max|x| max|w|; measured at most ~0.15 of the
    quantization bound), and different from the fp32 tiles' (the int16 ones did run)."""
    k = _gemv_kernels(tmp_path)
    k.set_gemm(0)
    try:
        for cols in ((256, 768) if qtype in BLOCK_BYTES else (96, 576)):
            for n in (23, 9):
                packed, ref = _quantized(qtype, n, cols, 11)
                w, ref64 = torch.from_numpy(packed), torch.from_numpy(ref).double()
                bias = torch.randn(n)
                for m in range(1, 6):
                    x = torch.randn(m, cols + 13)[:, 6:6 + cols] * 3
                    out = torch.full((m + 2, n + 5), float("nan"))
                    y = out[1:m + 1, 2:n + 2]
                    k.set_int16_gemv(8)
                    k.matmul(int(qtype), w, x, y, bias)
                    k.set_int16_gemv(0)
                    y32 = torch.empty(m, n)
                    k.matmul(int(qtype), w, x, y32, bias)
                    want = x.double() @ ref64.T + bias.double()
                    bound = 2e-5 * cols ** 0.5 * x.abs().max().item() * max(ref64.abs().max().item(), 1.0)
                    err = (y.double() - want).abs()
                    bound16 = _int16_gemv_bound(qtype, packed, ref, x) + bound
                    assert (err <= bound16).all(), (qtype.name, cols, n, m, (err / bound16).max().item())
                    assert not torch.equal(y, y32), (qtype.name, cols, n, m)
                    out[1:m + 1, 2:n + 2] = 0
                    assert out.isnan().sum().item() == out.numel() - m * n   # nothing else written
    finally:
        k.set_int16_gemv(-1)
        k.set_gemm(-1)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_int16_gemv_tiles_deterministic(tmp_path, qtype):
    """Each row of x is quantized alone and each output summed in one order: a row's outputs are
    the same bits whatever rows share its call (1 to 4), where it sits in the batch, which tile
    its weight row falls in (the weight from its fourth row on: other tiles of 4) and at 1 or 2
    threads."""
    k = _gemv_kernels(tmp_path)
    threads = torch.get_num_threads()
    cols = 512 if qtype in BLOCK_BYTES else 576
    packed, _ = _quantized(qtype, 30, cols, 12)
    w, x = torch.from_numpy(packed), torch.randn(4, cols)
    try:
        k.set_gemm(0)
        k.set_int16_gemv(8)
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows, at in ((x[:1], 0), (x[:2], 0), (x[:4], 0), (torch.cat([x[3:], x[:1]]), 1)):
                y = torch.empty(rows.shape[0], 30)
                k.matmul(int(qtype), w, rows, y)
                outs.append(y[at, 3:].clone())
            y = torch.empty(1, 27)
            k.matmul(int(qtype), w[3:], x[:1], y)
            outs.append(y[0])
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    finally:
        torch.set_num_threads(threads)
        k.set_gemm(-1)
        k.set_int16_gemv(-1)


def test_int16_gemv_tiles_edge_blocks(tmp_path):
    """Blocks of x their quantization must not mishandle (as the int16 GEMM tiles': all zero, tiny,
    subnormal, huge within the bound; a NaN or an inf makes its row's outputs NaN and leaves the
    other row's bits alone)."""
    k = _gemv_kernels(tmp_path)
    packed, ref = _quantized(Q.Q4_1, 40, 256, 9)
    w, ref64 = torch.from_numpy(packed), torch.from_numpy(ref).double()
    try:
        k.set_gemm(0)
        k.set_int16_gemv(8)
        for x in (torch.randn(2, 256), torch.randn(2, 256)):
            x[0, :32] = 0
            x[1, 32:64] = 1e-36
            x[0, 64:96] = torch.randn(32) * 1e-40     # subnormal
            x[1, 96:128] = torch.randn(32) * 1e30
            y = torch.empty(2, 40)
            k.matmul(int(Q.Q4_1), w, x, y)
            want = x.double() @ ref64.T
            bound = _int16_gemv_bound(Q.Q4_1, packed, ref, x) + 2e-5 * 16 * x.abs().amax(1, keepdim=True).double() * 2
            bound += 32 * 1e-36 * ref64.abs().max()
            assert ((y.double() - want).abs() <= bound).all()
            for r in (0, 1):
                bad = x.clone()
                bad[r, 7 + 100 * r] = float("nan") if r == 0 else float("inf")
                yb = torch.empty(2, 40)
                k.matmul(int(Q.Q4_1), w, bad, yb)
                assert yb[r].isnan().all() and torch.equal(yb[1 - r], y[1 - r])
    finally:
        k.set_gemm(-1)
        k.set_int16_gemv(-1)
