"""Which runner a checkpoint needs and what its pooler does (gpu/config/pooling.py): the
sentence-transformers files, --pooler-config, Matryoshka rules (issue 32)."""
from __future__ import annotations

import json

import pytest

from gpu.config.pooling import (PoolerConfig, PoolingConfigError, check_dimensions, checkpoint_pooler,
                                detect_runner, parse_pooler_config, pooling_spec)


def test_minilm_folder_is_a_pooling_model(minilm_dir):
    assert detect_runner(minilm_dir) == "pooling"
    assert detect_runner(minilm_dir / "config.json") == "pooling"
    assert checkpoint_pooler(minilm_dir) == PoolerConfig(pooling_type="MEAN", normalize=True)


def test_decoders_and_gguf_generate(tmp_path):
    from gpu.tokenizers.files import default_model_path
    assert detect_runner(default_model_path()) == "generate"
    assert detect_runner(None) == "generate"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    assert detect_runner(tmp_path) == "generate"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    assert detect_runner(tmp_path) == "pooling"


def _folder(tmp_path, modules, pooling=None, config=None):
    (tmp_path / "config.json").write_text(json.dumps(config or {"model_type": "bert", "hidden_size": 8}))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": "sentence_transformers.models." + kind}
         for i, (kind, path) in enumerate(modules)]))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_sentence_transformers_cls_without_normalize(tmp_path):
    folder = _folder(tmp_path, [("Transformer", ""), ("Pooling", "1_Pooling")],
                     {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    assert checkpoint_pooler(folder) == PoolerConfig(pooling_type="CLS", normalize=False)
    spec = pooling_spec({"model_type": "bert", "hidden_size": 8}, folder)
    assert (spec.pooling_type, spec.normalize) == ("CLS", False)
    # the flag wins over the checkpoint
    spec = pooling_spec({"model_type": "bert", "hidden_size": 8}, folder,
                        flag=parse_pooler_config('{"pooling_type": "mean", "normalize": true}'))
    assert (spec.pooling_type, spec.normalize) == ("MEAN", True)


@pytest.mark.parametrize("modules, pooling, match", [
    ([("Transformer", ""), ("Dense", "2_Dense")], None, "Dense"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode_max_tokens": True}, "max_tokens"),
])
def test_unsupported_sentence_transformers_modules_are_refused(tmp_path, modules, pooling, match):
    with pytest.raises(PoolingConfigError, match=match):
        checkpoint_pooler(_folder(tmp_path, modules, pooling))


def test_architecture_defaults():
    enc = pooling_spec({"model_type": "bert", "hidden_size": 8}, None)
    dec = pooling_spec({"model_type": "qwen3", "hidden_size": 8}, None, convert="embed")
    cls = pooling_spec({"architectures": ["BertForSequenceClassification"], "model_type": "bert",
                        "hidden_size": 8, "id2label": {"0": "neg", "1": "pos"}}, None)
    assert (enc.task, enc.pooling_type, enc.normalize) == ("embed", "CLS", True)
    assert (dec.task, dec.pooling_type, dec.normalize, dec.encoder) == ("embed", "LAST", True, False)
    assert (cls.task, cls.num_labels, cls.labels, cls.use_activation, cls.output_size) == (
        "classify", 2, ("neg", "pos"), True, 2)
    conv = pooling_spec({"model_type": "qwen3", "hidden_size": 8}, None, convert="classify")
    assert (conv.task, conv.num_labels) == ("classify", 2)


@pytest.mark.parametrize("text, match", [
    ("{not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"pooling": "MEAN"}', "unknown key 'pooling'"),
    ('{"pooling_type": "MAX"}', "MAX"),
    ('{"normalize": 1}', "normalize"),
    ('{"dimensions": 0}', "dimensions"),
])
def test_pooler_config_flag_errors_name_the_key(text, match):
    with pytest.raises(PoolingConfigError, match=match):
        parse_pooler_config(text)


def test_matryoshka_dimensions():
    with pytest.raises(PoolingConfigError, match="Matryoshka"):
        check_dimensions(32, 384, None, "dimensions")
    check_dimensions(32, 384, (), "dimensions")                 # is_matryoshka: any size
    check_dimensions(256, 1024, (256, 512, 1024), "dimensions")
    with pytest.raises(PoolingConfigError, match="one of"):
        check_dimensions(300, 1024, (256, 512, 1024), "dimensions")
    with pytest.raises(PoolingConfigError, match="between 1 and 384"):
        check_dimensions(500, 384, (), "dimensions")
    spec = pooling_spec({"model_type": "bert", "hidden_size": 8, "matryoshka_dimensions": [4, 8]}, None,
                        flag=PoolerConfig(dimensions=4))
    assert (spec.matryoshka, spec.output_size) == ((4, 8), 4)
