"""pipeline/core/config.py: EngineConfig's validation at construction, the flags that build it,
and the byte sizes the flags read. A bad value is refused with a message that names the
setting and the value, before anything loads."""
from __future__ import annotations

import argparse

import attrs
import orjson
import pytest

from pipeline.core.config import (FAULT_STEPS_ENV, EngineConfig, add_engine_arguments, byte_size,
                             engine_config)
from stages.api.tool_parsers import TOOL_PARSERS


def flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tailrace serve")
    add_engine_arguments(p)
    return p.parse_args(argv)


def test_no_flags_give_the_default_config(monkeypatch):
    """Every field has its flag, with the same default (engine_config reads them by name)."""
    monkeypatch.delenv(FAULT_STEPS_ENV, raising=False)
    assert engine_config(flags()) == EngineConfig()


def test_flags_reach_their_fields():
    cfg = engine_config(flags(
        "m.gguf", "--served-model-name", "a", "b", "--max-num-seqs", "3", "--dtype", "half",
        "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "2GiB", "--max-waiting", "7",
        "--override-generation-config", '{"temperature": 0.5}', "--reasoning-parser", "qwen3"))
    assert (cfg.model, cfg.served_model_name, cfg.max_num_seqs) == ("m.gguf", ("a", "b"), 3)
    assert cfg.dtype == "float16"                        # the alias, resolved
    assert cfg.enable_prefix_caching is False and cfg.kv_cache_memory_bytes == 2 << 30
    assert cfg.max_queued_requests == 7                  # --max-waiting is vLLM's old name
    assert cfg.override_generation_config == {"temperature": 0.5}
    assert cfg.reasoning_parser == "qwen3"


def test_model_as_vllm_s_option_too():
    assert engine_config(flags("--model", "m.gguf")).model == "m.gguf"
    assert engine_config(flags("m.gguf", "--model", "m.gguf")).model == "m.gguf"
    with pytest.raises(ValueError, match="two models: 'a.gguf' and --model 'b.gguf'"):
        engine_config(flags("a.gguf", "--model", "b.gguf"))


def test_the_config_is_frozen():
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        EngineConfig().max_num_seqs = 1


@pytest.mark.parametrize("field", ["max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                   "block_size", "num_gpu_blocks_override",
                                   "kv_cache_memory_bytes", "stream_interval",
                                   "max_queued_requests"])
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_must_be_positive(field, value):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})
    assert str(info.value) == f"{field} must be positive, got {value}"


@pytest.mark.parametrize("flag, field", [("--max-num-seqs", "max_num_seqs"),
                                         ("--block-size", "block_size"),
                                         ("--stream-interval", "stream_interval")])
def test_a_bad_size_flag_is_refused_by_name(flag, field):
    with pytest.raises(ValueError, match=f"^{field} must be positive, got 0$"):
        engine_config(flags(flag, "0"))


def test_optional_sizes_may_be_absent():
    cfg = EngineConfig(max_model_len=None, max_num_batched_tokens=None,
                       num_gpu_blocks_override=None, kv_cache_memory_bytes=None)
    assert cfg.max_model_len is None


@pytest.mark.parametrize("field, value", [("dtype", "int3"), ("load_format", "zip"),
                                          ("reasoning_parser", "r2d2"),
                                          ("simulate_gpu", "tpu")])
def test_a_value_outside_its_choices_names_the_field_and_the_choices(field, value):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})
    message = info.value.args[0]
    assert message.startswith(f"'{field}' must be in (") and f"(got '{value}')" in message


@pytest.mark.parametrize("flag, value", [("--dtype", "int3"), ("--load-format", "zip"),
                                         ("--reasoning-parser", "r2d2"),
                                         ("--simulate-gpu", "tpu")])
def test_the_cli_refuses_a_choice_before_the_config(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        flags(flag, value)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and f"invalid choice: '{value}'" in err


@pytest.mark.parametrize("field", ["event_log_max_bytes", "event_log_backup_count"])
def test_event_log_rotation_sizes_may_be_zero_not_negative(field):
    assert getattr(EngineConfig(**{field: 0}), field) == 0
    with pytest.raises(ValueError, match=f"'{field}' must be >= 0: -1"):
        EngineConfig(**{field: -1})


def test_served_model_names_become_a_tuple():
    assert EngineConfig(served_model_name=["a", "b"]).served_model_name == ("a", "b")
    assert EngineConfig(served_model_name=None).served_model_name == ()


def test_tool_flags_must_go_together():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        EngineConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError) as info:
        EngineConfig(tool_call_parser="nope")
    assert str(info.value).startswith("--tool-call-parser 'nope' is not one of ")
    assert all(name in str(info.value) for name in TOOL_PARSERS)
    cfg = EngineConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert cfg.tool_call_parser == "hermes"


def test_a_tool_parser_plugin_adds_its_name(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from stages.api.tool_parsers import ToolParser, register_tool_parser, TOOL_PARSERS\n"
        "@register_tool_parser('utests_plugin')\n"
        "class Mine(TOOL_PARSERS['hermes']):\n"
        "    pass\n")
    try:
        # the flags load the plugin before the config is made (EngineConfig runs no code)
        cfg = engine_config(flags("--tool-parser-plugin", str(plugin), "--tool-call-parser",
                                  "utests_plugin", "--enable-auto-tool-choice"))
        assert cfg.tool_call_parser == "utests_plugin" and "utests_plugin" in TOOL_PARSERS
    finally:
        TOOL_PARSERS.pop("utests_plugin", None)     # the registry is process-wide
    with pytest.raises(ValueError, match="--tool-parser-plugin .*missing.py: no such file"):
        engine_config(flags("--tool-parser-plugin", str(tmp_path / "missing.py")))


def test_fault_steps_name_the_bad_item():
    assert EngineConfig(fault_steps="2, 5:fatal").fault_step_kinds == {2: "error", 5: "fatal"}
    with pytest.raises(ValueError, match=r"fault_steps: '3:boom' is not STEP or STEP:error\|fatal"):
        EngineConfig(fault_steps="2,3:boom")


def test_fault_steps_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(FAULT_STEPS_ENV, "4:fatal")
    assert engine_config(flags()).fault_step_kinds == {4: "fatal"}


# -- byte sizes (--kv-cache-memory-bytes, --event-log-max-bytes) ------------------------------

@pytest.mark.parametrize("text, size", [
    ("4000000000", 4_000_000_000), ("4G", 4 * 10**9), ("4GB", 4 * 10**9), ("4GiB", 4 << 30),
    ("4gib", 4 << 30), (" 2 MiB ", 2 << 20), ("1.5k", 1500), ("100MiB", 100 << 20),
    ("1T", 10**12), ("0", 0)])
def test_byte_sizes_take_decimal_and_binary_suffixes(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "four", "4X"])
def test_a_bad_byte_size_says_what_it_got(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"not a byte size: {text!r}"):
        byte_size(text)


@pytest.mark.parametrize("value, words", [("[1]", "must be a JSON object"),
                                          ("{temperature: 1}", "not JSON")])
def test_override_generation_config_must_be_a_json_object(value, words, capsys):
    with pytest.raises(SystemExit):
        flags("--override-generation-config", value)
    err = capsys.readouterr().err
    assert "--override-generation-config" in err and words in err


def test_async_scheduling_with_every_speculative_method_unless_turned_off(tmp_path):
    """The combination rule, decided once here: n-gram drafts, a draft model and an EAGLE
    head combine with async scheduling by default (floating chunks, which the runner
    fills); --no-async-scheduling turns it off."""
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert EngineConfig().async_scheduling is True
    assert EngineConfig(async_scheduling=False).async_scheduling is False
    assert EngineConfig(speculative_config=spec).async_scheduling is True
    assert EngineConfig(speculative_config=spec, async_scheduling=False).async_scheduling is False
    from gpu.tokenizers.files import default_model_path
    draft = orjson.dumps({"method": "draft_model", "model": str(default_model_path()),
                          "num_speculative_tokens": 2}).decode()
    assert EngineConfig(speculative_config=draft).async_scheduling is True
    assert EngineConfig(speculative_config=draft, async_scheduling=False).async_scheduling is False
    head = orjson.dumps({"method": "eagle3", "model": "gpu/configs/gpt-oss-20b-eagle3",
                         "num_speculative_tokens": 3}).decode()
    assert EngineConfig(speculative_config=head).async_scheduling is True
    assert EngineConfig(speculative_config=head, async_scheduling=False).async_scheduling is False
