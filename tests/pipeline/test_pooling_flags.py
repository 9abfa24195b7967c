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


def test_hf_overrides_lay_a_json_object_over_config_json(minilm_dir):
    """--hf-overrides (vLLM's): nested objects key by key, anything else replaced; a
    Matryoshka declaration reaches the pooling spec; a value that is no JSON object is a
    clear error at start-up."""
    from gpu.config.overrides import apply_hf_overrides
    from gpu.loader.pooling import load_pooling_model

    base = {"rope_scaling": {"type": "yarn", "factor": 2.0}, "hidden_size": 8, "a": [1]}
    got = apply_hf_overrides(base, {"rope_scaling": {"factor": 4.0}, "a": None, "b": 1})
    assert got == {"rope_scaling": {"type": "yarn", "factor": 4.0}, "hidden_size": 8,
                   "a": None, "b": 1}
    assert base["rope_scaling"]["factor"] == 2.0                # not changed in place
    assert EngineConfig(hf_overrides='{"is_matryoshka": true}').hf_overrides == {"is_matryoshka": True}
    for bad, match in (("[1]", "JSON object"), ("{x", "not JSON")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(hf_overrides=bad)
    plain = load_pooling_model(minilm_dir, load_format="dummy")
    declared = load_pooling_model(minilm_dir, load_format="dummy",
                                  hf_overrides={"matryoshka_dimensions": [128, 256]})
    assert plain.spec.matryoshka is None and declared.spec.matryoshka == (128, 256)
