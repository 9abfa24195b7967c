"""Every tensor of the torch and device paths stays on the metadata's device.

The model, the KV cache and the step's inputs live on the "meta" device; DeviceCheck
(tests/support/device_check.py) fails any op that meets a tensor created on the CPU by
default. On CUDA that mistake is a device-mismatch error at the first step; here it
shows without a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.support.device_check import DeviceCheck, DeviceMismatch
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.loader.decoder import load_model
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.worker.runner import ModelRunner
from gpu.worker.staging import prepare_step

META = torch.device("meta")


@pytest.fixture
def meta_model(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, load_format="dummy", dtype="float32", device="meta", progress=False).model


def _cache(lm, device=META):
    c = lm.config
    return KVCache(c.num_hidden_layers, 12, 4, c.num_key_value_heads, c.head_dim, torch.float32, device)


# decode-only, prefill-only, a mixed step, a prefill over a cached prefix
STEPS = [
    (SeqChunk("a", (5,), 6, (0, 1), True), SeqChunk("b", (7,), 3, (2,), True)),
    (SeqChunk("a", (3, 9, 4), 0, (0,), True),),
    (SeqChunk("a", (5,), 6, (0, 1), True), SeqChunk("b", (3, 9, 4, 1), 0, (3,), True)),
    (SeqChunk("c", (8, 2), 5, (4, 5), True), SeqChunk("a", (5,), 6, (0, 1), True)),
]


@pytest.mark.parametrize("chunks", STEPS, ids=["decode", "prefill", "mixed", "cached-prefix"])
def test_torch_attention_path_keeps_tensors_on_the_device(meta_model, chunks):
    cache = _cache(meta_model)
    attn = TorchPagedAttention(cache, 0.25)
    with torch.inference_mode(), DeviceCheck():
        input_ids, positions, meta, rows = prepare_step(chunks, cache.block_size, META)
        for t in (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q,
                  meta.seq_lens):
            assert t.device == META
        attn.prepare(meta)
        hidden = meta_model(input_ids, positions, attn)
    assert hidden.device == META and hidden.shape == (sum(len(c.token_ids) for c in chunks), 32)


@pytest.mark.parametrize("chunks", STEPS, ids=["decode", "prefill", "mixed", "cached-prefix"])
def test_torch_attention_with_sinks_and_window_keeps_tensors_on_the_device(chunks):
    """gpt-oss's layers: the sink column and the sliding-window masks are made on the device too."""
    cache = KVCache(1, 12, 4, 2, 16, torch.float32, META)
    attn = TorchPagedAttention(cache, 0.25)
    with torch.inference_mode(), DeviceCheck():
        _, _, meta, _ = prepare_step(chunks, cache.block_size, META)
        attn.prepare(meta)
        T = sum(len(c.token_ids) for c in chunks)
        q, kv = torch.zeros(T, 4, 16, device=META), torch.zeros(T, 2, 16, device=META)
        sinks = torch.zeros(4, device=META)
        for window in (None, 3):
            out = attn.forward(0, q, kv, kv, sinks=sinks, window=window)
            assert out.device == META and out.shape == q.shape


def test_runner_step_reads_back_once(meta_model):
    runner = ModelRunner(meta_model, _cache(meta_model), device=META)
    greedy = SamplingOptions(temperature=0.0)
    plan = StepPlan(1, STEPS[2], (SeqStart("a", (1,) * 6, greedy), SeqStart("b", (3, 9, 4, 1), greedy)))
    check = DeviceCheck(host_reads=True)
    with check:
        result = runner.execute(plan)
    assert result.seq_ids == ("a", "b") and len(result.token_ids) == 2
    assert check.reads == ["cpu"]   # the logits, once, for host sampling: nothing else syncs


def test_the_shim_catches_a_host_tensor(meta_model):
    """Negative control: the mistake this file guards against does fail under the shim."""
    q = torch.zeros(4, 2, 16, device=META)
    with DeviceCheck(), pytest.raises(DeviceMismatch, match="index_select"):
        q.index_select(0, torch.tensor([0, 2]))   # a CPU index for a device tensor
