"""The batched LoRA term (gpu/lora/adapters.py) against peft's merged model, on a tiny random Llama:
one flat batch mixes base rows and three adapters of different ranks and targets."""
from __future__ import annotations

import json

import pytest
import torch

from tests.support.hf_models import hf_logits, make_hf_model, our_logits
from tests.support.lora_adapters import make_adapter

from gpu.interface import LoRARef, SeqChunk
from gpu.loader.decoder import load_model
from gpu.lora.adapters import LoRAError, LoRAManager, LoRANotFound, read_adapter_config

ADAPTERS = {   # name -> (rank, targets, rslora)
    "qkv8": (8, ["q_proj", "k_proj", "v_proj"], False),
    "mlp4": (4, ["gate_proj", "up_proj", "down_proj"], True),
    "all16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
SEQS = [[3, 17, 42, 99, 5], [150, 7, 63], [21, 88, 130, 1, 64, 9], [33, 120], [77, 2, 45, 101]]
WHO = ["qkv8", None, "all16", "mlp4", "qkv8"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tiny")
    hf = make_hf_model("llama", root / "base", tie_word_embeddings=False)
    merged = {}
    for i, (name, (r, targets, rs)) in enumerate(ADAPTERS.items()):
        merged[name] = make_adapter(hf, root / name, r=r, targets=targets, use_rslora=rs, seed=i)
    loaded = load_model(root / "base", dtype="float32", progress=False)
    return root, hf, merged, loaded


def test_mixed_batch_equals_each_merged_model(tiny):
    root, hf, merged, loaded = tiny
    model = loaded.model
    mgr = LoRAManager(model, max_loras=3, max_cpu_loras=3, max_rank=16, dtype=torch.float32,
                      device=torch.device("cpu"))
    try:
        refs = {n: LoRARef(n, i + 1, str(root / n)) for i, n in enumerate(ADAPTERS)}
        chunks = []
        for i, (ids, who) in enumerate(zip(SEQS, WHO)):
            if who is not None:
                mgr.start(f"s{i}", refs[who])
            chunks.append(SeqChunk(f"s{i}", tuple(ids), 0, (), True))
        assert mgr.prepare(chunks)
        got = our_logits(model, [t for s in SEQS for t in s], seq_lens=[len(s) for s in SEQS])
        mgr.done()
        row = 0
        for ids, who in zip(SEQS, WHO):
            ref = hf_logits(merged[who] if who else hf, ids)
            torch.testing.assert_close(got[row:row + len(ids)], ref, atol=1e-4, rtol=1e-4)
            if who:   # the adapter really changes the output
                assert (ref - hf_logits(hf, ids)).abs().max() > 1e-2
            row += len(ids)
        # released: the step after runs the base model alone, and nothing stays pinned
        for i in range(len(SEQS)):
            mgr.release(f"s{i}")
        assert not mgr.users and not mgr.prepare(chunks)
        torch.testing.assert_close(our_logits(model, SEQS[0]), hf_logits(hf, SEQS[0]), atol=1e-4, rtol=1e-4)
    finally:
        mgr.close()


def test_lru_keeps_running_adapters_and_forget_drops_after_release(tiny):
    root, _, _, loaded = tiny
    mgr = LoRAManager(loaded.model, max_loras=1, max_cpu_loras=1, max_rank=16,
                      dtype=torch.float32, device=torch.device("cpu"))
    try:
        a, b = LoRARef("qkv8", 1, str(root / "qkv8")), LoRARef("mlp4", 2, str(root / "mlp4"))
        mgr.start("x", a)
        mgr.prepare([SeqChunk("x", (1, 2), 0, (), True)])
        mgr.start("y", b)
        mgr.prepare([SeqChunk("y", (1, 2), 0, (), True)])
        assert set(mgr.loaded) == {1, 2}        # a is pinned by x: not evicted
        mgr.release("x")
        mgr.prepare([SeqChunk("y", (3,), 2, (), True)])
        mgr.forget(2)
        mgr.prepare([SeqChunk("y", (4,), 3, (), True)])
        assert 2 in mgr.loaded                  # y still runs on it
        mgr.release("y")
        mgr.prepare([])
        assert 2 not in mgr.loaded and not mgr.users and not mgr.seq_lora
    finally:
        mgr.close()


def _adapter_dir(tmp_path, **config):
    d = tmp_path / "bad"
    d.mkdir(exist_ok=True)
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (d / "adapter_config.json").write_text(json.dumps({**base, **config}))
    (d / "adapter_model.safetensors").write_bytes(b"")
    return d


@pytest.mark.parametrize("config,words", [
    (dict(r=32), "greater than --max-lora-rank 16"),
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(bias="all"), "biases"),
])
def test_unsupported_adapters_are_refused_naming_why(tiny, tmp_path, config, words):
    with pytest.raises(LoRAError, match=words) as err:
        read_adapter_config(str(_adapter_dir(tmp_path, **config)), tiny[3].config, 16)
    assert err.value.status == 400


def test_missing_adapter_is_not_found(tiny, tmp_path):
    with pytest.raises(LoRANotFound) as err:
        read_adapter_config(str(tmp_path / "nowhere"), tiny[3].config, 16)
    assert err.value.status == 404


def test_scale_alpha_over_r_and_rslora(tiny, tmp_path):
    mc = tiny[3].config
    assert read_adapter_config(str(_adapter_dir(tmp_path, r=4, lora_alpha=8)), mc, 16).scale == 2.0
    assert read_adapter_config(str(_adapter_dir(tmp_path, r=4, lora_alpha=8, use_rslora=True)),
                               mc, 16).scale == 4.0


def _mixed_logits(root, model, who, dtype=torch.float32):
    """One flat forward of SEQS with adapters `who` through a fresh LoRAManager."""
    mgr = LoRAManager(model, max_loras=3, max_cpu_loras=3, max_rank=16, dtype=dtype,
                      device=torch.device("cpu"))
    try:
        refs = {n: LoRARef(n, i + 1, str(root / n)) for i, n in enumerate(ADAPTERS)}
        chunks = []
        for i, (ids, w) in enumerate(zip(SEQS, who)):
            if w is not None:
                mgr.start(f"s{i}", refs[w])
            chunks.append(SeqChunk(f"s{i}", tuple(ids), 0, (), True))
        assert mgr.prepare(chunks)
        got = our_logits(model, [t for s in SEQS for t in s], seq_lens=[len(s) for s in SEQS])
        mgr.done()
        return mgr.backend, got
    finally:
        mgr.close()


def test_triton_backend_equals_torch_backend_and_merged_models(tiny, monkeypatch):
    """TAILRACE_LORA_BACKEND=triton (the CUDA path, here under TRITON_INTERPRET): the shrink/
    expand kernels over the row -> slot index give the grouped-matmul path's logits and the
    merged models', with ranks 4/8/16 and base rows between and after the adapters' rows
    (one forward: 2 layers x 4 linears x 2 launches)."""
    root, hf, merged, loaded = tiny
    who = ["qkv8", None, "all16", "mlp4", None]
    monkeypatch.setenv("TAILRACE_LORA_BACKEND", "torch")
    backend, want = _mixed_logits(root, loaded.model, who)
    assert backend == "torch"
    monkeypatch.setenv("TAILRACE_LORA_BACKEND", "triton")
    backend, got = _mixed_logits(root, loaded.model, who)
    assert backend == "triton"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    row = 0
    for ids, w in zip(SEQS, who):
        ref = hf_logits(merged[w] if w else hf, ids)
        torch.testing.assert_close(got[row:row + len(ids)], ref, atol=1e-4, rtol=1e-4)
        row += len(ids)


def test_cpu_kernel_backend_equals_torch_backend_and_merged_models(tiny, monkeypatch):
    """The CPU default, gpu/kernels/cpu/lora.c (one call per hooked linear for every adapter of
    the step), gives the torch grouped path's logits and the merged models', base rows between
    and after the adapters' rows; with bf16 adapter weights it stays as close to the merged
    models as torch's bf16 path (which also rounds x A^T to bf16)."""
    from gpu.kernels.cpu import lora as cpu_lora

    if cpu_lora.kernels() is None:
        pytest.skip("no C compiler")
    root, hf, merged, loaded = tiny
    who = ["all16", None, "qkv8", "mlp4", None]
    monkeypatch.delenv("TAILRACE_LORA_BACKEND", raising=False)
    backend, got = _mixed_logits(root, loaded.model, who)
    assert backend == "cpu"
    monkeypatch.setenv("TAILRACE_LORA_BACKEND", "torch")
    _, want = _mixed_logits(root, loaded.model, who)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, want16 = _mixed_logits(root, loaded.model, who, torch.bfloat16)
    monkeypatch.setenv("TAILRACE_LORA_BACKEND", "cpu")
    _, got16 = _mixed_logits(root, loaded.model, who, torch.bfloat16)
    row = 0
    for ids, w in zip(SEQS, who):
        ref = hf_logits(merged[w] if w else hf, ids)
        sl = slice(row, row + len(ids))
        torch.testing.assert_close(got[sl], ref, atol=1e-4, rtol=1e-4)
        err16, err_torch16 = (got16[sl] - ref).abs().max(), (want16[sl] - ref).abs().max()
        assert err16 <= 1.5 * err_torch16 + 1e-5, (w, err16, err_torch16)
        row += len(ids)


def test_triton_slots_reuse_and_index(tiny, monkeypatch):
    """The Triton path's slots (no kernel launched): an adapter stays in its slot across
    steps, a new one takes the least recently used slot of an adapter the step does not use,
    and the row index is -1 for base rows, up to the last LoRA row."""
    root, _, _, loaded = tiny
    monkeypatch.setenv("TAILRACE_LORA_BACKEND", "triton")
    mgr = LoRAManager(loaded.model, max_loras=2, max_cpu_loras=3, max_rank=16,
                      dtype=torch.float32, device=torch.device("cpu"))
    try:
        refs = [LoRARef(n, i + 1, str(root / n)) for i, n in enumerate(ADAPTERS)]
        for i, ref in enumerate(refs):
            mgr.start(f"s{i}", ref)
        mgr.prepare([SeqChunk("s0", (1, 2), 0, (), True), SeqChunk("b", (3,), 0, (), True),
                     SeqChunk("s1", (4,), 0, (), True), SeqChunk("b2", (5,), 0, (), True)])
        assert mgr._index[0].tolist() == [0, 0, -1, 1]
        assert mgr._slots.owner == [1, 2]
        mgr.done()
        mgr.prepare([SeqChunk("s1", (1,), 0, (), True), SeqChunk("s2", (2, 3), 0, (), True)])
        assert mgr._index[0].tolist() == [1, 0, 0] and mgr._slots.owner == [3, 2]
        mgr.done()
        qkv, down = (0, "self_attn.qkv_proj"), (0, "mlp.down_proj")   # all16's q/k/v: rank 48
        at, bt = mgr.loaded[3].weights[qkv]
        assert torch.equal(mgr._slots.a[qkv][0, :48], at.T) and torch.equal(mgr._slots.b[qkv][0, :, :48], bt.T)
        assert mgr._slots.ranks[qkv].tolist() == [48, 0]    # mlp4 (slot 1) has no q/k/v
        assert mgr._slots.ranks[down].tolist() == [16, 4]
        monkeypatch.setenv("TAILRACE_LORA_BACKEND", "cuda")
        with pytest.raises(ValueError, match="TAILRACE_LORA_BACKEND"):
            LoRAManager(loaded.model, max_loras=1, max_cpu_loras=1, max_rank=16,
                        dtype=torch.float32, device=torch.device("cpu"))
    finally:
        mgr.close()
