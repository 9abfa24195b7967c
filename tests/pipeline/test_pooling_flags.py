"""--runner, --convert, --pooler-config (issue 32): EngineConfig decides a pooling server
and refuses what it does not combine with."""
from __future__ import annotations

import pytest

from gpu.config.pooling import PoolerConfig, PoolingConfigError
from pipeline.core.config import EngineConfig


def test_auto_detects_a_pooling_model(minilm_dir):
    assert EngineConfig(model=str(minilm_dir)).pooling
    assert not EngineConfig().pooling                       # the bundled SmolLM2
    assert EngineConfig(convert="embed").pooling
    assert not EngineConfig(model=str(minilm_dir), runner="generate").pooling


def test_pooler_config_from_json_or_dict():
    assert EngineConfig(pooler_config='{"pooling_type": "cls"}').pooler_config == PoolerConfig(pooling_type="CLS")
    assert EngineConfig(pooler_config={"normalize": False}).pooler_config == PoolerConfig(normalize=False)
    with pytest.raises(PoolingConfigError, match="pooling"):
        EngineConfig(pooler_config='{"pooling": 1}')


@pytest.mark.parametrize("kw, match", [
    (dict(runner="generate", convert="embed"), "--runner pooling"),
    (dict(convert="embed", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                               "prompt_lookup_max": 3}), "--speculative-config"),
    (dict(convert="embed", tensor_parallel_size=2), "--tensor-parallel-size"),
    (dict(convert="embed", simulate_gpu="h200"), "--simulate-gpu"),
])
def test_refused_combinations(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)
