"""Pre-quantized checkpoints (issue 58) on tiny random Llama and Qwen3 models, each format written
by its documented layout (tests/support/quantized_checkpoints.py): the loader's method (gpu/quantization/)
dequantizes every linear to exactly the format's reference (numpy unpacking of the bit layout,
or compressed-tensors' own decompress), the logits are those of transformers' model holding the
reference weights (fp32: the same weights, so the bound is fp32 rounding, 1e-4), and greedy
decoding at --tensor-parallel-size 2 is token-identical to one process. Mismatches between
--quantization, the quantization_config and the tensors are start-up errors naming them."""

import json

import orjson

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu.kernels.cpu import quant as cpu_quant
from gpu.kernels.cpu.quant import PackedLinear
from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, our_logits
from tests.support.quantized_checkpoints import QUANT_CONFIGS, fp32_tiles, make_quantized  # noqa: F401 (fp32_tiles: a fixture)
from tests.support.tp_ranks import greedy, logits, paged_greedy, run_ranks

pytestmark = pytest.mark.usefixtures("fp32_tiles")  # fp32 GEMM tiles: the tests check products exactly

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101]
# hidden 256 and intermediate 320: two 128x128 blocks a side, the last ones partial
BIG = dict(hidden_size=256, intermediate_size=320)
G128 = dict(hidden_size=256, intermediate_size=384)     # group 128 divides both
CASES = {  # name: (format, arch, overrides)
    "fp8-block-qwen3": ("fp8-block", "qwen3", BIG),
    "fp8-tensor-llama": ("fp8-tensor", "llama", {}),
    "ct-fp8-channel-qwen3": ("ct-fp8-channel", "qwen3", {}),
    "ct-w8a8-llama": ("ct-w8a8", "llama", {}),
    "ct-w4a16-qwen3": ("ct-w4a16", "qwen3", {}),
    "ct-w4a16-asym-llama": ("ct-w4a16-asym", "llama", {}),
    "ct-w4a16-g128-llama": ("ct-w4a16-g128", "llama", G128),
    "awq-qwen3": ("awq", "qwen3", {}),
    "awq-g128-llama": ("awq-g128", "llama", G128),
    "gptq4-llama": ("gptq4", "llama", {}),
    "gptq4-act-qwen3": ("gptq4-act", "qwen3", {}),
    "gptq8-llama": ("gptq8", "llama", {}),
    "gptq4-v2-qwen3": ("gptq4-v2", "qwen3", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, the transformers model with the reference dequantized weights)."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for seed, (name, (fmt, arch, overrides)) in enumerate(CASES.items()):
        out[name] = (root / name, make_quantized(fmt, arch, root / name, seed=seed, **overrides))
    return out


# how each runs on this CPU: the GGUF block format its linears are repacked into (exact:
# gpu/quantization/repack.py), or None: dequantized at load (FP8; act-order groups)
PACKED = {"fp8-block-qwen3": None, "fp8-tensor-llama": None, "ct-fp8-channel-qwen3": None,
          "ct-w8a8-llama": "Q8_0", "ct-w4a16-qwen3": "Q4_0", "ct-w4a16-asym-llama": "Q8_0", "awq-qwen3": "Q8_0",
          "ct-w4a16-g128-llama": "Q4_0", "awq-g128-llama": "Q8_0",
          "gptq4-llama": "Q4_0", "gptq4-act-qwen3": None, "gptq8-llama": "Q8_0", "gptq4-v2-qwen3": "Q4_0"}


def weight(linear) -> torch.Tensor:
    """A linear's weight [out, in] fp32, dense or packed (the kernels' own dequantization)."""
    return linear.dequantized() if isinstance(linear, PackedLinear) else linear.weight


@pytest.mark.parametrize("quantization", ["auto", "none"])
@pytest.mark.parametrize("case", CASES)
def test_dequantized_weights_and_logits_match_the_reference(case, quantization, checkpoints):
    path, hf = checkpoints[case]
    loaded = load_model(path, dtype="float32", progress=False, quantization=quantization)
    packed = PACKED[case] if quantization == "auto" and cpu_quant.kernels() is not None else None
    ours, ref = loaded.model.layers[1], hf.model.layers[1]
    if packed is None:
        assert ("14 " in loaded.weights and "linears dequantized once at load to float32" in loaded.weights
                or "0 of 8 decoder linears repacked" in loaded.weights and "8 dequantized at load" in loaded.weights)
        assert not isinstance(ours.self_attn.qkv_proj, PackedLinear)
    else:
        assert f"8 of 8 decoder linears repacked exactly into GGUF blocks (14 {packed} tensors)" in loaded.weights
        assert ours.mlp.down_proj.formats == ({v: k for k, v in cpu_quant.FORMATS.items()}[packed],)
    want_qkv = torch.cat([ref.self_attn.q_proj.weight, ref.self_attn.k_proj.weight, ref.self_attn.v_proj.weight])
    assert torch.equal(weight(ours.self_attn.qkv_proj), want_qkv)
    assert torch.equal(weight(ours.mlp.gate_up_proj), torch.cat([ref.mlp.gate_proj.weight, ref.mlp.up_proj.weight]))
    assert torch.equal(weight(ours.mlp.down_proj), ref.mlp.down_proj.weight)
    dense = load_file(str(path.parent / (path.name + "-dense") / "model.safetensors"))
    assert torch.equal(loaded.model.lm_head.weight, dense["lm_head.weight"])     # kept dense
    expected, got = hf_logits(hf, IDS), our_logits(loaded.model, IDS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_reference_is_quantized(checkpoints):
    """The formats' grids show in the weights: 4-bit groups hold at most 16 values."""
    path, hf = checkpoints["gptq4-llama"]
    w = hf.model.layers[0].mlp.down_proj.weight      # [64, 96], groups of 32 along the input
    assert max(len(w[r, :32].unique()) for r in range(w.shape[0])) <= 16


def test_bf16_serving_rounds_the_dequantized_weights_once(checkpoints):
    path, hf = checkpoints["ct-w4a16-qwen3"]
    model = load_model(path, dtype="bfloat16", progress=False).model
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert torch.equal(model.layers[0].mlp.down_proj.weight, hf.model.layers[0].mlp.down_proj.weight.bfloat16())


def test_quantization_flag_must_match_the_checkpoint(checkpoints):
    path, _ = checkpoints["awq-qwen3"]
    assert "AWQ" in load_model(path, quantization="awq", dtype="float32", progress=False).weights
    with pytest.raises(ValueError, match="--quantization gptq, but config.json's quantization_config says 'awq'"):
        load_model(path, quantization="gptq", progress=False)
    dense = path.parent / (path.name + "-dense")
    with pytest.raises(ValueError, match="--quantization fp8, but the checkpoint is not quantized"):
        load_model(dense, quantization="fp8", progress=False)
    with pytest.raises(ValueError, match="--quantization gguf: the model is not a GGUF file"):
        load_model(path, quantization="gguf", progress=False)


def _rewrite(src, dst, *, drop=(), add=None, config=None):
    dst.mkdir()
    tensors = {**load_file(str(src / "model.safetensors")), **(add or {})}
    for name in drop:
        tensors.pop(name)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        cfg = config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))


def test_a_missing_or_unexpected_tensor_is_named_at_start_up(checkpoints, tmp_path):
    path, _ = checkpoints["fp8-block-qwen3"]
    _rewrite(path, tmp_path / "no-scale", drop=["model.layers.1.mlp.up_proj.weight_scale_inv"])
    with pytest.raises(ValueError, match=r"fp8: the checkpoint's 'model.layers.1.mlp.up_proj.weight' is "
                                         r"float8_e4m3fn, a quantized value with no scale tensor"):
        load_model(tmp_path / "no-scale", progress=False)
    _rewrite(path, tmp_path / "no-config", config=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight_scale_inv' is a quantized "
                                         r"format's tensor, but config.json has no quantization_config"):
        load_model(tmp_path / "no-config", progress=False)
    path, _ = checkpoints["ct-w8a8-llama"]
    _rewrite(path, tmp_path / "ignored", config=lambda c: {**c, "quantization_config": {
        **c["quantization_config"], "ignore": ["lm_head", "re:.*o_proj$"]}})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight_scale' is a quantized tensor, "
                                         r"but the quantization_config's ignore list keeps"):
        load_model(tmp_path / "ignored", progress=False)
    _rewrite(path, tmp_path / "no-zero", config=lambda c: {**c, "quantization_config": {**c["quantization_config"], "config_groups": {
                 "group_0": {**c["quantization_config"]["config_groups"]["group_0"], "weights": {
                     **c["quantization_config"]["config_groups"]["group_0"]["weights"], "symmetric": False}}}}})
    with pytest.raises(ValueError, match=r"compressed-tensors: the checkpoint has 'model.layers.\d.\w+.\w+."
                                         r"weight_scale' but not 'model.layers.\d.\w+.\w+.weight_zero_point'"):
        load_model(tmp_path / "no-zero", progress=False)
    path, hf = checkpoints["gptq4-llama"]     # GPTQ writers save zero biases for bias-free linears
    _rewrite(path, tmp_path / "zero-bias", add={"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    got = our_logits(load_model(tmp_path / "zero-bias", dtype="float32", progress=False).model, IDS)
    torch.testing.assert_close(got, hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    _rewrite(path, tmp_path / "bias", add={"model.layers.0.self_attn.q_proj.bias": torch.ones(64)})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.q_proj.bias'"):
        load_model(tmp_path / "bias", progress=False)
    _rewrite(path, tmp_path / "unknown", config=lambda c: {**c, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes', which is not served"):
        load_model(tmp_path / "unknown", progress=False)


PROMPTS = [[3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1], [64, 9, 33, 120, 77, 2, 45, 101, 7, 7]]
TP_CASES = ("fp8-block-qwen3", "ct-w4a16-asym-llama", "gptq4-act-qwen3")


def _tp_run(tp, paths):
    out = {}
    for name, path in paths:
        m = load_model(path, dtype="float32", progress=False, tp=tp).model
        out[name] = (logits(m, PROMPTS), [greedy(m, tp, p, 6) for p in PROMPTS], paged_greedy(m, tp, PROMPTS, 6))
    return out


def test_tensor_parallel_2_agrees_with_one_process(checkpoints):
    """Each rank reads a quantized linear's tensors whole, dequantizes and keeps its shard."""
    from gpu.parallel import SINGLE

    paths = [(name, checkpoints[name][0]) for name in TP_CASES]
    one = _tp_run(SINGLE, paths)
    two = run_ranks(2, _tp_run, paths, timeout_s=240)
    for name in TP_CASES:
        torch.testing.assert_close(two[name][0], one[name][0], atol=1e-4, rtol=1e-4)
        assert two[name][1] == one[name][1] and two[name][2] == one[name][2], name


async def test_engine_greedy_tokens_match_the_dequantized_twin_under_preemption(checkpoints):
    """Through the engine (scheduler, paged KV cache, chunked prefill): greedy completions of the
    quantized checkpoint equal its dense twin's token for token, both with a cache so small
    that requests are preempted and recomputed."""
    import trio

    from pipeline.core.config import EngineConfig
    from pipeline.core.engine import open_engine

    prompts = [[(7 * i + 3 * j) % 150 + 3 for j in range(11 + 3 * i)] for i in range(4)]

    async def run(path) -> tuple[list[list[int]], int]:
        cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=96, max_num_seqs=4, block_size=8,
                           num_gpu_blocks_override=9, max_num_batched_tokens=16, enable_prefix_caching=False)
        out: list = [None] * len(prompts)
        async with open_engine(cfg) as engine:
            async def one(i):
                body = {"model": engine.model_names[0], "prompt": prompts[i], "max_tokens": 12,
                        "temperature": 0, "ignore_eos": True, "logprobs": 0}
                reply = orjson.loads(await (await engine.submit("completions", body)).read())
                out[i] = reply["choices"][0]["logprobs"]["tokens"]

            async with trio.open_nursery() as n:
                for i in range(len(prompts)):
                    n.start_soon(one, i)
            return out, engine.stats().num_preemptions

    for name in ("fp8-block-qwen3", "gptq4-llama"):   # dequantized; Q4_0 blocks in the fused C decode
        path, _ = checkpoints[name]
        got, preempted = await run(path)
        want, _ = await run(path.parent / (path.name + "-dense"))
        assert preempted > 0, name
        assert got == want and all(len(t) == 12 for t in got), name


# the Triton GEMM each case's linears run by on CUDA (gpu/quantization/cuda_linear.py), and
# how many of the 8 decoder linears stay dequantized (act-order GPTQ: permuted groups)
KERNELS = {"ct-w4a16-asym-llama": ("w4", 0), "awq-g128-llama": ("w4", 0), "gptq8-llama": ("w8", 0),
           "gptq4-act-qwen3": (None, 8), "fp8-block-qwen3": ("fp8", 0), "ct-fp8-channel-qwen3": ("fp8", 0),
           "ct-w8a8-llama": ("int8", 0)}
# logits against the dequantized model: exact weights; FP8 / INT8 activations quantized per
# token in the kernel (e4m3: 2^-4 an element at worst; int8: 1/254 of the row's largest)
LOGIT_BOUND = {"w4": 1e-4, "w8": 1e-4, "fp8": 0.1, "int8": 0.05, None: 1e-4}


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Load as on CUDA (quantized linears kept for the Triton GEMMs), here under the interpreter."""
    from gpu.quantization import cuda_linear
    monkeypatch.setattr(cuda_linear, "wanted", lambda device: True)


@pytest.mark.parametrize("case", KERNELS)
def test_cuda_linears_keep_the_format_and_run_the_triton_gemms(case, checkpoints, kernels_on_cpu):
    from gpu.quantization.cuda_linear import QuantLinear

    path, hf = checkpoints[case]
    kind, dense = KERNELS[case]
    loaded = load_model(path, dtype="float32", progress=False)
    ours, ref = loaded.model.layers[1], hf.model.layers[1]
    if kind is None:
        assert f"0 of {dense} decoder linears kept quantized" in loaded.weights
        assert not isinstance(ours.mlp.down_proj, QuantLinear)
    else:
        assert f"8 of 8 decoder linears kept quantized and run by the Triton GEMMs (8 {kind})" in loaded.weights
        for lin, want in ((ours.self_attn.qkv_proj, [ref.self_attn.q_proj, ref.self_attn.k_proj, ref.self_attn.v_proj]),
                          (ours.mlp.gate_up_proj, [ref.mlp.gate_proj, ref.mlp.up_proj]), (ours.mlp.down_proj, [ref.mlp.down_proj])):
            assert isinstance(lin, QuantLinear) and lin.kind == kind
            assert torch.equal(lin.dequantized(), torch.cat([m.weight for m in want]))      # the format's exact weights
    got, expected = our_logits(loaded.model, IDS[:6]), hf_logits(hf, IDS[:6])
    assert float((got - expected).abs().max()) < LOGIT_BOUND[kind] * max(1.0, float(expected.abs().max()))


def _static(config):
    """compressed-tensors W8A8 with static per-tensor activation scales (`dynamic: false`)."""
    group = config["quantization_config"]["config_groups"]["group_0"]
    acts = {**group["input_activations"], "strategy": "tensor", "dynamic": False}
    return {**config, "quantization_config": {**config["quantization_config"], "config_groups": {
        "group_0": {**group, "input_activations": acts}}}}


STATIC_ROUNDING = {   # x -> what the kernel multiplies, given the static scale s
    "fp8-tensor-llama": lambda x, s: (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,
    "ct-w8a8-llama": lambda x, s: torch.round(x / s).clamp(-128, 127) * s,
}


@pytest.mark.parametrize("case", STATIC_ROUNDING)
def test_cuda_linears_quantize_activations_by_the_static_input_scale(case, checkpoints, kernels_on_cpu, tmp_path):
    """fp8 `activation_scheme: static`, compressed-tensors `dynamic: false`: each linear's
    input_scale (rewritten here to differ from part to part) quantizes its activations in the
    FP8 or INT8 GEMM, a merged module's parts (q, k, v; gate, up) sharing their largest (vLLM's
    choice). The torch reference: transformers' dequantized model with every linear's input
    rounded as the static scale says (e4m3 of clamp(x / s, -448, 448), or int8 of round(x / s),
    times s)."""
    path, hf = checkpoints[case]
    kind = "fp8" if case.startswith("fp8") else "int8"
    parts = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    own = {f"model.layers.{i}.{o}.{p}": 0.008 + 0.002 * j + 0.001 * i
           for i in range(2) for o, ps in parts.items() for j, p in enumerate(ps)}
    _rewrite(path, tmp_path / "static", add={f"{n}.input_scale": torch.tensor(s) for n, s in own.items()},
             config=_static if kind == "int8" else None)
    loaded = load_model(tmp_path / "static", dtype="float32", progress=False)
    assert f"(8 {kind}) (activations quantized per token in the kernel; in 8 by the checkpoint's static" in loaded.weights
    shared = {}
    for n in own:
        group = ("q_proj", "k_proj", "v_proj") if n.endswith(("q_proj", "k_proj", "v_proj")) else (
            ("gate_proj", "up_proj") if n.endswith(("gate_proj", "up_proj")) else (n.rsplit(".", 1)[1],))
        shared[n] = max(own[n.rsplit(".", 1)[0] + "." + g] for g in group)
    assert float(loaded.model.layers[1].self_attn.qkv_proj.xs) == pytest.approx(shared["model.layers.1.self_attn.v_proj"])

    def rounded(s):
        return lambda module, args: (STATIC_ROUNDING[case](args[0].float(), s),)
    hooks = [hf.get_submodule(n).register_forward_pre_hook(rounded(s)) for n, s in shared.items()]
    try:
        expected = hf_logits(hf, IDS[:6])
    finally:
        for h in hooks:
            h.remove()
    got = our_logits(loaded.model, IDS[:6])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert float((hf_logits(hf, IDS[:6]) - got).abs().max()) > 1e-3            # the rounding shows


def test_cuda_linears_are_cut_per_rank_as_the_dense_weights(checkpoints, kernels_on_cpu):
    """--tensor-parallel-size 2: each rank's quantized linears hold exactly the rows (qkv,
    gate_up) or columns (o, down) its dequantized twin holds; a column cut through AWQ's
    128-column groups (intermediate 384 over 2 ranks: 192) leaves groups of 64."""
    from gpu.parallel import TP
    from gpu.quantization import cuda_linear

    path, _ = checkpoints["awq-g128-llama"]
    for rank in (0, 1):
        tp = TP(rank=rank, size=2)
        quant = load_model(path, dtype="float32", progress=False, tp=tp).model.layers[0]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cuda_linear, "wanted", lambda device: False)
            dense = load_model(path, dtype="float32", progress=False, tp=tp).model.layers[0]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            lin = quant.get_submodule(name)
            assert torch.equal(lin.dequantized(), dense.get_submodule(name).weight), (rank, name)
        assert quant.mlp.down_proj.params["group"] == 64 and quant.mlp.gate_up_proj.params["group"] == 128


def test_checkpoint_kv_scales_are_read_for_the_fp8_cache(checkpoints, tmp_path):
    """vLLM's and compressed-tensors' self_attn.k_scale / v_scale, and the older kv_scale (one
    for both): LoadedModel.kv_scales, which start-up sets on an fp8 KV cache (none: 1.0)."""
    path, hf = checkpoints["fp8-tensor-llama"]
    add = {"model.layers.0.self_attn.k_scale": torch.tensor(0.25), "model.layers.0.self_attn.v_scale": torch.tensor([2.0]),
           "model.layers.1.self_attn.kv_scale": torch.tensor(0.5)}

    _rewrite(path, tmp_path / "scaled", add=add)
    loaded = load_model(tmp_path / "scaled", dtype="float32", progress=False)
    assert loaded.kv_scales == {0: (0.25, 2.0), 1: (0.5, 0.5)}
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    from pipeline.core.config import EngineConfig
    from pipeline.core.startup import build_runner
    for kv, want in (("fp8", ([0.25, 0.5], [2.0, 0.5])), ("auto", ([1.0, 1.0], [1.0, 1.0]))):
        cfg = EngineConfig(model=str(tmp_path / "scaled"), kv_cache_dtype=kv, num_gpu_blocks_override=4, block_size=8)
        cache = build_runner(cfg, loaded, torch.device("cpu"), 64).cache    # start-up's cache
        assert (cache.k_scale, cache.v_scale) == want, kv
    assert load_model(path, dtype="float32", progress=False).kv_scales == {}
    _rewrite(path, tmp_path / "per-head", add={"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_scale' has 2 values; a KV cache scale is one per layer"):
        load_model(tmp_path / "per-head", progress=False)
