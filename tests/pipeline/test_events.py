"""pipeline/core/events.py alone: every message type written by the EventLog and read back
(`scheduled` structures back into the very Step schedule sent), the per-stage rows, the
header, rotation, redaction, a writer that survives a bad event, and logs written by older
versions (fields they did not have yet, no header, a cut last line).

Replay over these files is tests/engine/test_engine_events.py; whole-server logs,
tests/e2e/test_e2e_events.py."""
from __future__ import annotations

from pathlib import Path

import attrs
import orjson
import pytest

from gpu.worker.grammar import Constraint
from gpu.interface import SeqChunk, SeqStart, StepPlan, TokenLogprobs
from gpu.worker.sampler import SamplingOptions
from pipeline.core.config import EngineConfig
from pipeline.core.events import (SCHEMA_VERSION, EventLog, event_files, make_header, plain,
                             read_events, redact, redact_headers, stage_deltas, structure_step,
                             tokenizer_hash)
from pipeline.tools.replay import Log, replay_log
from stages.api.common import ToolPlan
from stages.delta import (Delta, FinishReason, PromptLogprob, RequestMetrics, TokenLogprob,
                          ToolCallDelta, Usage)
from stages.emit import ReplyEnd
from stages.messages import ReplySpec, ResponseEcho, Step

from tests.support.rendered import rendered

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
DATA = Path(__file__).parent / "data"


def requests():
    """One request of each API, with the optional parts a log must carry back."""
    chat = attrs.evolve(rendered("c", (1, 2, 3), "chat", stream=True, body={
        "tools": TOOLS, "n": 2, "stream_options": {"include_usage": True},
        "include_reasoning": False, "return_tokens_as_token_ids": True}),
        tools=ToolPlan("auto", parser="hermes"), continuous_usage=True, cache_salt="tenant")
    chat = attrs.evolve(chat, sampling=attrs.evolve(
        chat.sampling, constraint=Constraint("json_schema", '{"type": "object"}'), prompt_logprobs=2,
        stop=("\n\n",)))
    completions = attrs.evolve(
        rendered("p", (4, 5), "completions", max_tokens=3, seed=7, top_k=5, logprobs=2,
                 stop_token_ids=(9,), logit_bias=((4, 1.5),), body={"prompt": ["a", "b"]}),
        prompts=((4, 5), (6,)), prompt_max_tokens=(3, 2), echo=("a", "b"), arrival=12.5,
        per_request_metrics=True)
    responses = rendered("r", (7,), "responses", body={
        "instructions": "be brief", "tools": TOOLS, "tool_choice": {"type": "function",
        "name": "get_weather"}, "metadata": {"k": "v"}, "reasoning": {"effort": "low"}})
    return chat, completions, responses


def every_delta() -> tuple[Delta, ...]:
    """Deltas that between them set every Delta field, with each value type a field holds."""
    lp = TokenLogprobs(-0.5, (5, 6), (-0.5, -1.5), rank=1)
    return (
        Delta("c", (5,), None, num_cached_tokens=16, token_logprobs=(lp,), scheduled_at=3.25,
              prompt_token_logprobs=(None, lp), text="x", content="", reasoning="x",
              logprobs=(TokenLogprob("x", -0.5, (("y", -1.5),)),),
              prompt_logprobs=(PromptLogprob(1, "a", None), PromptLogprob(2, "b", -0.1, 3,
                                                                         ((7, "c", -0.2),)))),
        Delta("c", (6,), FinishReason.TOOL_CALLS, index=1, text="}", content="",
              tool_calls=(ToolCallDelta(0, "call_1", "get_weather", '{"city": "Paris"}'),),
              reasoning_tokens=4, usage=Usage(3, 2, 1, 4)),
        Delta("p", (9,), FinishReason.STOP, stop_reason=9, index=1,
              usage=Usage(3, 4), metrics=RequestMetrics(1.0, 2.0, 3.0, 1.5, 100.0)),
        Delta("p", (), FinishReason.STOP, stop_reason="\n\n", text="a", content="a"),
        Delta("r", (), FinishReason.ERROR, error="the GPU step failed"),
        Delta("r", (), FinishReason.ABORT),
    )


def write(path: Path, *events: tuple[str, str, dict], header: dict | None = None) -> list[dict]:
    """Log each (stage, event, fields) through a real EventLog; every line read back."""
    log = EventLog(path)
    if header is not None:
        log.write_header(header)
    for stage, event, fields in events:
        log.stage(stage)(event, **fields)
    log.close()
    return list(read_events(path))


def test_a_scheduled_step_reads_back_as_the_step_schedule_sent(tmp_path):
    reqs = requests()
    step = Step(4, reqs, every_delta(), num_running=2, num_waiting=1, kv_blocks_used=5,
                done_at=17.125)
    plan = StepPlan(4, (SeqChunk("c#0", (1, 2, 3), 0, (0,), True),
                        SeqChunk("p#1", (6,), 0, (3, 4), False)),
                    (SeqStart("c#0", (1, 2, 3), SamplingOptions()),))
    [ev] = write(tmp_path / "ev.jsonl", ("schedule", "scheduled",
                                         {"plan": plan, "preempted": ("x#1",), "message": step}))
    assert (ev["event"], ev["stage"], ev["preempted"]) == ("scheduled", "schedule", ["x#1"])
    assert isinstance(ev["t"], float)
    # the plan, small: [sequence id, start position, tokens, samples]; no tables or prompts
    assert ev["plan"] == {"step": 4, "chunks": [["c#0", 0, 3, True], ["p#1", 0, 1, False]],
                          "new_seqs": ["c#0"]}
    back = structure_step(ev["message"])
    assert back == step
    # each reply spec comes back whole (equality covers it), nested echo included
    chat, _, responses = back.new_requests
    assert (chat.reply.include_reasoning, chat.reply.return_tokens_as_token_ids) == (False, True)
    assert responses.reply.response.tools == tuple(TOOLS)
    assert responses.reply.response.metadata == {"k": "v"}
    assert type(back.deltas[1].finish_reason) is FinishReason
    assert [d.stop_reason for d in back.deltas[2:4]] == [9, "\n\n"]   # an id, a string


def test_deltas_are_written_without_their_defaults():
    """Most deltas are one running token: the log carries only what is set."""
    rows = plain(Step(1, (), (Delta("a", (5,)), Delta("b"))))
    assert rows["deltas"] == [{"request_id": "a", "token_ids": [5]}, {"request_id": "b"}]


def test_each_stage_logs_what_it_added(tmp_path):
    deltas = every_delta()
    events = write(tmp_path / "ev.jsonl",
                   *((stage, event, {"step": 4, "deltas": deltas})
                     for stage, event in (("detokenize", "detokenized"), ("parse", "parsed"),
                                          ("account", "accounted"))))
    rows = {ev["event"]: ev["deltas"] for ev in events}
    assert rows == {event: plain(stage_deltas(event, deltas)) for event in rows}
    assert rows["detokenized"][0] == {
        "request_id": "c", "text": "x", "logprobs": [{"token": "x", "logprob": -0.5,
                                                       "top": [["y", -1.5]]}]}
    assert rows["parsed"][:2] == [
        {"request_id": "c", "content": "", "reasoning": "x"},
        {"request_id": "c", "index": 1, "content": "", "finish_reason": "tool_calls",
         "tool_calls": [{"index": 0, "id": "call_1", "name": "get_weather",
                         "arguments": '{"city": "Paris"}'}]}]
    assert [r["request_id"] for r in rows["accounted"]] == ["c", "p", "p", "r", "r"]
    assert rows["accounted"][1]["metrics"]["mean_itl_ms"] == 1.5
    # a plain reply (content is its text) logs no parse rows
    assert stage_deltas("parsed", [Delta("a", (1,), text="hi", content="hi")]) == []


def test_emitted_bytes_and_reply_ends(tmp_path):
    items = [("a", b"data: {}\n\n"), ("b", b'{"id": "b"}'), ("b", ReplyEnd(200)),
             ("a", "ignored: not bytes".encode()), ("c", ReplyEnd(503))]
    events = write(tmp_path / "ev.jsonl", ("emit", "emitted", {"items": items}))
    assert [e["event"] for e in events] == ["emitted", "reply_end", "reply_end"]
    assert events[0]["replies"] == [["a", "data: {}\n\n"], ["b", '{"id": "b"}'],
                                    ["a", "ignored: not bytes"]]
    assert [(e["request_id"], e["status"]) for e in events[1:]] == [("b", 200), ("c", 503)]


def test_the_header_comes_first_and_records_what_replay_needs(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    cfg = EngineConfig(chat_template=str(template), reasoning_parser="qwen3", seed=3)
    fields = make_header(cfg, model_path="m.gguf", model_name="m", tokenizer=None,
                         served_model_names=("a", "b"), max_model_len=512,
                         kv_blocks_total=64, block_size=16)
    events = write(tmp_path / "ev.jsonl", ("render", "received", {"request_id": "x"}),
                   header=fields)
    header = events[0]
    assert header["event"] == "header" and header["stage"] == "engine"
    assert header["schema_version"] == SCHEMA_VERSION and isinstance(header["wall_time"], float)
    assert header["flags"]["chat_template"] == "{{ messages }}"     # the source, not the path
    assert header["flags"]["served_model_name"] == ["a", "b"]
    assert (header["flags"]["reasoning_parser"], header["flags"]["max_model_len"]) == ("qwen3", 512)
    assert (header["tokenizer_path"], header["tokenizer_hash"], header["parsers"]) == (
        "m.gguf", None, None)
    assert (header["kv_blocks_total"], header["block_size"]) == (64, 16)
    assert events[1]["event"] == "received"


def test_bodies_and_headers_are_redacted_on_writing(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl")
    log.secrets = frozenset({"sk-server"})
    log.stage("render")("received", request_id="a", headers=[("Authorization", "Bearer sk-1")],
                        body={"messages": [{"role": "user", "content": "key sk-server"}],
                              "api_key": "k"})
    log.close()
    [ev] = read_events(tmp_path / "ev.jsonl")
    assert ev["headers"] == {"authorization": "[redacted]"}
    assert ev["body"] == {"messages": [{"role": "user", "content": "[redacted]"}],
                          "api_key": "[redacted]"}


def test_an_event_that_cannot_be_written_becomes_a_log_error_line(tmp_path):
    events = write(tmp_path / "ev.jsonl", ("admit", "admitted", {"request_id": "a", "x": object()}),
                   ("admit", "admitted", {"request_id": "b"}))
    assert events[0]["event"] == "log_error" and events[0]["failed_event"] == "admitted"
    assert events[0]["error"].startswith("TypeError(") and "object" in events[0]["error"]
    assert (events[1]["event"], events[1]["request_id"]) == ("admitted", "b")   # it goes on


# -- rotation and redaction ------------------------------------------------------------------

def test_rotation_keeps_n_files_and_reads_them_oldest_first(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=400, backup_count=3)
    log.write_header({"schema_version": 1})
    emit = log.stage("emit")
    for i in range(60):
        emit("reply_end_test", n=i)
    log.close()
    files = event_files(path)
    assert [p.name for p in files] == ["ev.jsonl.3", "ev.jsonl.2", "ev.jsonl.1", "ev.jsonl"]
    assert all(p.stat().st_size <= 400 for p in files)
    for p in files:
        assert orjson.loads(p.read_bytes().split(b"\n")[0])["event"] == "header"
    numbers = [e["n"] for e in read_events(path) if e["event"] == "reply_end_test"]
    assert numbers == list(range(numbers[0], 60))   # in order, the oldest ones deleted
    assert sum(1 for e in read_events(path) if e["event"] == "header") == 1


def test_credentials_are_redacted():
    headers = redact_headers([("Authorization", "Bearer sk-1"), ("X-API-Key", "k"),
                              ("Cookie", "s=1"), ("X-Auth-Token", "t"), ("Proxy-Authorization", "p"),
                              ("X-Custom", "Basic dXNlcjpwYXNz"), ("User-Agent", "openai"),
                              ("Content-Type", "application/json")])
    assert headers == {"authorization": "[redacted]", "x-api-key": "[redacted]",
                       "cookie": "[redacted]", "x-auth-token": "[redacted]",
                       "proxy-authorization": "[redacted]", "x-custom": "[redacted]",
                       "user-agent": "openai", "content-type": "application/json"}
    body = {"model": "m", "max_tokens": 5, "max_completion_tokens": 3, "api_key": "sk-1",
            "messages": [{"role": "user", "content": "my key is sk-server-key, ok?"},
                         {"role": "user", "content": "Bearer abc"}],
            "metadata": {"password": "x", "prompt_tokens": 1}}
    out = redact(body, frozenset({"sk-server-key"}))
    assert out == {"model": "m", "max_tokens": 5, "max_completion_tokens": 3,
                   "api_key": "[redacted]",
                   "messages": [{"role": "user", "content": "[redacted]"},
                                {"role": "user", "content": "[redacted]"}],
                   "metadata": {"password": "[redacted]", "prompt_tokens": 1}}
    assert body["api_key"] == "sk-1"     # a copy: the request itself is untouched


# -- logs written by older versions ----------------------------------------------------------

def test_a_scheduled_message_from_before_later_fields_still_reads():
    """The first event logs had no choices, several prompts, tools, salts, timings or
    logprobs: what is missing takes its default."""
    old = {"step": 2, "new_requests": [{
        "request_id": "a", "api": "completions", "model": "m", "prompt_token_ids": [1, 2],
        "sampling": {"max_tokens": 4, "options": {"temperature": 0.0}}, "stream": False,
        "include_usage": True, "created": 1700000000, "arrival": 5.0,
        "request": {"prompt": "hi", "max_tokens": 4}}],
        "deltas": [{"request_id": "a", "token_ids": [7]},
                   {"request_id": "a", "token_ids": [8], "finish_reason": "length"}]}
    step = structure_step(old)
    [req] = step.new_requests
    assert (req.n, req.prompts, req.tools, req.cache_salt, req.continuous_usage) == (
        1, (), None, None, False)
    assert req.sampling.options == SamplingOptions(temperature=0.0) and req.sampling.stop == ()
    # from the logged typed request, by completions' rule; before the flag: with the details
    assert req.reply == ReplySpec(prompt_tokens_details=True)
    assert step.deltas[1] == Delta("a", (8,), FinishReason.LENGTH)
    assert (step.done_at, step.num_running, step.kv_blocks_used) == (0.0, 0, 0)


def test_a_request_logged_with_its_typed_request_gets_its_apis_reply_spec():
    """Before ReplySpec the log carried the typed request whole (null in an engine
    process's file): replay makes each API's spec of it, as render makes it now."""
    def new_request(rid, api, typed):
        return {"request_id": rid, "api": api, "model": "m", "prompt_token_ids": [1],
                "sampling": {"max_tokens": 4}, "stream": True, "include_usage": False,
                "created": 0, "arrival": 0.0, "request": typed}
    step = structure_step({"step": 1, "new_requests": [
        new_request("c", "chat", {"messages": [{"role": "user", "content": "hi"}],
                                  "include_reasoning": False, "return_token_ids": True}),
        new_request("r", "responses", {"input": "hi", "instructions": "be brief",
                                       "metadata": {"k": "v"}}),
        new_request("e", "completions", None)]})
    chat, responses, engine_side = step.new_requests
    # such a log predates --enable-prompt-tokens-details: its replies always had the details
    assert chat.reply == ReplySpec(return_token_ids=True, include_reasoning=False,
                                   prompt_tokens_details=True)
    assert responses.reply == ReplySpec(response=ResponseEcho(instructions="be brief",
                                                              metadata={"k": "v"}),
                                        prompt_tokens_details=True)
    assert engine_side.reply == ReplySpec(prompt_tokens_details=True)


def _log_file(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_log_without_a_header_or_from_a_newer_version_is_read_with_warnings(tmp_path):
    bare = Log.read(_log_file(tmp_path / "old.jsonl", b'{"event": "admitted", "t": 1.0}'))
    assert bare.header == {} and len(bare.events) == 1
    assert any("no header line" in w for w in bare.warnings)
    newer = Log.read(_log_file(
        tmp_path / "new.jsonl", b'{"event": "header", "schema_version": 99, "t": 0.0}',
        b'{"event": "teleported", "t": 1.0}', b'{"event": "teleported", "t": 2.0}'))
    assert any("schema version 99, newer" in w for w in newer.warnings)
    assert any("unknown event type 'teleported' (2 lines): ignored" in w
               for w in newer.warnings)
    assert len(newer.events) == 3


def test_bad_lines_are_skipped_with_a_warning_that_says_where(tmp_path):
    path = _log_file(tmp_path / "ev.jsonl", b'{"event": "header", "t": 0.0}', b"not json",
                     b"[1, 2]", b"", b'{"event": "admitted", "t": 1.0}', b'{"event": "adm')
    warned: list[str] = []
    events = list(read_events(path, warn=warned.append))
    assert [e["event"] for e in events] == ["header", "admitted"]
    assert warned == [f"{path}: line 2 is not JSON; skipped",
                      f"{path}: line 3 is not an event object; skipped",
                      f"{path}: its last line is truncated; skipped"]


def test_no_log_at_all_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no event log at"):
        list(read_events(tmp_path / "missing.jsonl"))


def test_a_log_recorded_by_an_earlier_tailrace_replays_byte_for_byte(smollm_tokenizer):
    """data/events_v1.jsonl was written by tailrace 0.1.0 (schema 1) serving the bundled
    SmolLM2 with --enable-per-request-metrics, five requests at once: a chat stream with
    logprobs and continuous usage, completions of two prompts with n=2 and a stop string,
    responses, chat with response_format json_object, chat with prompt_logprobs. Whatever
    the message types become, this log keeps reading and every reply reproduces. (Where the
    reply format itself changed on purpose (issue 22: vLLM's null keys in non-streaming
    bodies, the sampled token in completions' top_logprobs; issue 40: a Response says
    `store: true`, OpenAI's default, now that responses are stored; issue 37: no
    completion_tokens_details without a reasoning parser, as vLLM), those logged bodies
    were rewritten to the new bytes; nothing else was.)"""
    log = Log.read(DATA / "events_v1.jsonl")
    assert log.warnings == []
    assert log.header["tokenizer_hash"] == tokenizer_hash(smollm_tokenizer)
    result = replay_log(log, smollm_tokenizer, log.header["parsers"]["reasoning_parser"])
    assert sorted(result.checked) == ["chat-json", "chat-prompt-logprobs", "chat-stream",
                                      "completions-n2", "responses"]
    assert not result.differences and not result.unfinished and not result.not_checked
    assert result.reproduced == result.logged
    assert b'"metrics"' in result.logged["chat-json"]     # timings from the logged times
    steps = [structure_step(ev["message"]) for ev in log.events if ev["event"] == "scheduled"]
    assert {r.request_id for s in steps for r in s.new_requests} == set(result.checked)
    [json_request] = [r for s in steps for r in s.new_requests if r.request_id == "chat-json"]
    assert json_request.sampling.constraint.kind == "json_object"
