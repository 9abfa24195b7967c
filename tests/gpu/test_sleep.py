"""gpu/worker/sleep.py: what each sleep level lets go of, and that waking gives back the same
weights (reloaded at level 2) and a KV cache of the same shape."""
import pytest
import torch

from gpu.layers.attention import KVCache
from gpu.worker.sleep import Sleeper


class Runner:
    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        self.model.register_buffer("table", torch.arange(5.0))
        self.cache = KVCache(2, 4, 4, 2, 8, torch.float32, "cpu")
        self.graphs = None


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_drops_then_wake_restores(level):
    r = Runner()
    original = weights(r.model)
    shapes = [t.shape for t in (*r.cache.k, *r.cache.v)]
    reloads = []

    def reload():
        reloads.append(1)
        return Runner().model              # the checkpoint: the same weights
    s = Sleeper(r, reload)
    s.sleep(level)
    assert all(t.numel() == 0 for t in (*r.cache.k, *r.cache.v))
    kept = all(v.numel() for v in r.model.state_dict().values())
    assert kept == (level == 1)
    s.sleep(level)                         # asleep already: nothing more
    s.wake_up()
    assert [t.shape for t in (*r.cache.k, *r.cache.v)] == shapes
    assert all(not t.any() for t in r.cache.k)
    now = weights(r.model)
    assert now.keys() == original.keys()
    assert all(torch.equal(now[k], original[k]) for k in original)
    assert reloads == ([1] if level == 2 else [])
    assert s.level == 0
    s.wake_up()                            # awake already: nothing
    assert r.model(torch.ones(1, 8)).shape == (1, 8)


def test_bad_level_is_refused():
    with pytest.raises(ValueError):
        Sleeper(Runner(), None).sleep(3)


def test_wake_keeps_a_shared_kv_layer_on_its_source():
    """A cache whose layer 2 reads layer 0's KV (Gemma 4's shared layers) and whose layers have
    two shapes wakes with the same shapes, layer 2 naming layer 0's new tensors again."""
    r = Runner()
    r.cache = KVCache(3, 4, 4, 0, 0, torch.float32, "cpu", layer_shapes=((2, 8), (1, 16), None),
                      kv_sources=(0, 1, 0))
    shapes = [t.shape for t in (*r.cache.k, *r.cache.v)]
    s = Sleeper(r, None)
    s.sleep(1)
    s.wake_up()
    assert [t.shape for t in (*r.cache.k, *r.cache.v)] == shapes
    assert r.cache.k[2] is r.cache.k[0] and r.cache.v[2] is r.cache.v[0] and r.cache.k[1] is not r.cache.k[0]
