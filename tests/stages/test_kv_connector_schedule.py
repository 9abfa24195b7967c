"""The KV connector in the scheduler (issue 36), without processes: the prefill side's
hold (its finishing delta names the blocks, which stay used until a KVRelease or the
timeout), the decode side's remote prefill (a sequence whose blocks the runner's read
fills: no chunk until it lands, then only its last prompt token, fed as a decode), and
`--kv-transfer-config` / kv_transfer_params refused clearly."""
from __future__ import annotations

import attrs
import pytest

from gpu.interface import StepResult
from tests.support.rendered import rendered
from stages.delta import FinishReason
from stages.kv_transfer import (KVParamsError, KVTransfer, KVTransferConfig, RemotePrefill,
                                    request_params)
from stages.schedule import Scheduler
from stages.schedule.blocks import BlockManager

BS = 4
CONFIG = KVTransferConfig("NixlConnector", "kv_both", engine_id="E", side_channel_port=5601,
                          abort_timeout_s=60.0)


def make(config=CONFIG) -> Scheduler:
    return Scheduler(BlockManager(32, BS), max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256, eos_token_ids=(0,), kv_transfer=config)


def run(s: Scheduler, plan, token: int = 9, **kv):
    sampled = tuple(c.seq_id for c in plan.chunks if c.sample)
    return s.update(plan, StepResult(plan.step, sampled, (token,) * len(sampled), 0.0, **kv))


def test_the_prefill_side_holds_the_prompt_blocks_and_names_them():
    s = make()
    prompt = tuple(range(1, 11))                     # 10 tokens: 3 blocks of 4
    s.add(attrs.evolve(rendered("p1", prompt, max_tokens=1),
                       kv_transfer=KVTransfer(remote_decode=True)))
    plan = s.schedule()
    out = run(s, plan)
    (d,) = out.deltas
    assert d.finish_reason is FinishReason.LENGTH
    params = d.kv_transfer_params
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "E", "remote_request_id": "p1",
                      "remote_block_ids": list(plan.chunks[0].block_table[:3]),
                      "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1}
    assert s.blocks.num_used == 3 and list(s.kv.held) == ["p1"]
    s.kv.release(("p1",))
    assert s.blocks.num_used == 0 and not s.kv.held


def test_held_blocks_are_freed_at_the_abort_timeout():
    s = make(attrs.evolve(CONFIG, abort_timeout_s=0.0))
    s.add(attrs.evolve(rendered("p1", (1, 2, 3, 4, 5), max_tokens=1),
                       kv_transfer=KVTransfer(remote_decode=True)))
    run(s, s.schedule())
    assert s.blocks.num_used == 2
    s.kv.release((), expire=True)
    assert s.blocks.num_used == 0 and s.kv.expired == 1


def _remote(prompt, blocks=(7, 8, 9)):
    return attrs.evolve(rendered("d1", prompt, max_tokens=3), kv_transfer=KVTransfer(
        remote_prefill=RemotePrefill("E", "p1", blocks, "127.0.0.1", 5601)))


def test_a_remote_prefill_reads_then_decodes_from_the_last_prompt_token():
    s = make()
    prompt = tuple(range(1, 11))
    s.add(_remote(prompt))
    plan = s.schedule()
    assert plan.chunks == () and len(plan.new_seqs) == 1 and plan.kv_waiting
    (read,) = plan.kv_reads
    assert (read.seq_id, read.engine_id, read.request_id, read.block_ids) == ("d1", "E", "p1",
                                                                              (7, 8, 9))
    assert len(read.local_block_ids) == 3 and s.blocks.num_used == 3
    out = run(s, plan)                                  # the read still in flight
    plan = s.schedule()
    assert plan.chunks == () and plan.kv_reads == () and plan.kv_waiting
    run(s, plan, kv_loaded=("d1",))
    plan = s.schedule()
    (chunk,) = plan.chunks
    assert chunk.token_ids == (10,) and chunk.start_pos == 9 and chunk.sample
    assert chunk.block_table == read.local_block_ids
    out = run(s, plan)
    assert out.deltas[0].token_ids == (9,) and out.deltas[0].num_cached_tokens == 9


def test_a_failed_read_ends_the_request_and_frees_its_blocks():
    s = make()
    s.add(_remote(tuple(range(1, 11))))
    plan = s.schedule()
    out = run(s, plan, kv_failed=(("d1", "the side channel did not answer"),))
    (d,) = out.deltas
    assert d.finish_reason is FinishReason.ERROR and "did not answer" in d.error
    assert s.blocks.num_used == 0
    assert s.schedule().released == ("d1",) and not s.has_work()


def test_an_abort_during_the_read_keeps_the_blocks_until_the_read_is_over():
    s = make()
    s.add(_remote(tuple(range(1, 11))))
    run(s, s.schedule())
    s.finish("d1", FinishReason.ABORT)
    assert s.blocks.num_used == 3            # the read may still write into them
    plan = s.schedule()
    assert plan.kv_waiting and plan.released == ("d1",)
    run(s, plan, kv_loaded=("d1",))
    assert s.blocks.num_used == 0 and not s.has_work()
    assert not s.schedule().kv_waiting


def test_remote_blocks_that_are_not_the_prompts_fail_the_request():
    s = make()
    s.add(_remote(tuple(range(1, 11)), blocks=(1, 2)))
    out = run(s, s.schedule())
    assert "remote_block_ids has 2 blocks" in out.deltas[0].error


@pytest.mark.parametrize("text, message", [
    ('{"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}', "kv_connector 'LMCache"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_server"}', "kv_role 'kv_server'"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "tpu"}',
     "kv_buffer_device 'tpu'"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_rank": 1}', "unknown key"),
    ("nope", "not JSON")])
def test_bad_kv_transfer_configs_are_clear_start_up_errors(text, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(text)


def test_the_connector_combines_with_tensor_parallel_not_with_the_stand_in():
    from pipeline.core.config import EngineConfig

    kv = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    assert EngineConfig(tensor_parallel_size=2, kv_transfer_config=kv).kv_transfer_config
    with pytest.raises(ValueError, match="does not combine with --simulate-gpu"):
        EngineConfig(simulate_gpu="h200", kv_transfer_config=kv)


def test_kv_transfer_params_as_vllm_sends_them():
    assert request_params(None) is None
    assert request_params({"do_remote_decode": False, "do_remote_prefill": False}) is None
    assert request_params({"do_remote_decode": True, "do_remote_prefill": False,
                           "remote_engine_id": None, "remote_block_ids": None,
                           "remote_host": None, "remote_port": None}) == KVTransfer(True)
    got = request_params({"do_remote_prefill": True, "do_remote_decode": False,
                          "remote_engine_id": "E", "remote_request_id": "r",
                          "remote_block_ids": [3, 4], "remote_host": "h", "remote_port": 5600,
                          "tp_size": 1})
    assert got.remote_prefill == RemotePrefill("E", "r", (3, 4), "h", 5600)
    with pytest.raises(KVParamsError, match="remote_block_ids"):
        request_params({"do_remote_prefill": True, "remote_block_ids": [-1]})
    with pytest.raises(KVParamsError, match="remote_port"):
        request_params({"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id":
                        "E", "remote_request_id": "r", "remote_host": "h", "remote_port": 0})


def test_render_refuses_what_this_server_cannot_transfer():
    from stages.api.common import RequestError
    from stages.api.kv_params import kv_transfer

    decode = {"do_remote_decode": True}
    prefill = {"do_remote_prefill": True, "remote_engine_id": "E", "remote_request_id": "r",
               "remote_block_ids": [1], "remote_host": "h", "remote_port": 5600}
    assert kv_transfer({"prompt_token_ids": [1]}, None, 1, 1, None) is None
    for params, cfg, n, stream, message in [
            (decode, attrs.evolve(CONFIG, kv_role="kv_consumer"), 1, False, "kv_consumer"),
            (prefill, attrs.evolve(CONFIG, kv_role="kv_producer"), 1, False, "kv_producer"),
            (decode, CONFIG, 2, False, "one prompt and n 1"),
            (decode, CONFIG, 1, True, "stream false")]:
        with pytest.raises(RequestError, match=message):
            kv_transfer(params, cfg, n, 1, None, stream)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        kv_transfer(prefill, CONFIG, 1, 1, 0)
    assert kv_transfer(prefill, CONFIG, 1, 1, None).remote_prefill.block_ids == (1,)
    with pytest.raises(RequestError, match="boolean"):     # the flags keep their types
        kv_transfer({"do_remote_prefill": "yes"}, CONFIG, 1, 1, None)


def test_a_server_without_a_connector_ignores_kv_transfer_params(caplog):
    """As vLLM: the seed's body (prompt ids and do_remote_prefill, no remote fields) and a
    decode request are served as plain requests by a server without a KV connector."""
    from stages.api.kv_params import kv_transfer

    seed = {"prompt_token_ids": [1, 2], "do_remote_prefill": True}
    with caplog.at_level("WARNING", logger="tailrace.api"):
        assert kv_transfer(seed, None, 1, 1, None, api="/v1/chat/test-kv") is None
        assert kv_transfer({"do_remote_decode": True}, None, 2, 1, 0, True,
                           api="/v1/chat/test-kv") is None
    [line] = [r.getMessage() for r in caplog.records if "test-kv" in r.getMessage()]
    assert line.startswith("/v1/chat/test-kv: 'kv_transfer_params' asks for a KV transfer")


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True},
    {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "E"},
    {"do_remote_prefill": True, "remote_engine_id": "E", "remote_request_id": "r",
     "remote_block_ids": [-1], "remote_host": "h", "remote_port": 5600}])
def test_an_incomplete_remote_prefill_is_logged_and_prefilled_here(params, caplog):
    """As vLLM's NixlConnector: a warning, and the prompt is computed locally."""
    from stages.api.kv_params import kv_transfer

    with caplog.at_level("WARNING", logger="tailrace.kv"):
        assert kv_transfer(params, CONFIG, 1, 1, None) is None
    assert any("prefilling the prompt here" in r.getMessage() for r in caplog.records)


def test_the_seeds_kv_transfer_body_renders_its_prompt_ids():
    from stages.render import RenderContext, Submission, render

    ctx = RenderContext(tokenizer=None, served_model_names=("m",), max_model_len=64,
                        vocab_size=100)
    body = {"messages": [{"role": "user", "content": "ignored"}], "max_tokens": 4,
            "kv_transfer_params": {"prompt_token_ids": [5, 6, 7], "do_remote_prefill": True}}
    out = render(Submission("r", "chat", body, 0.0), ctx)
    assert out.prompt_token_ids == (5, 6, 7) and out.kv_transfer is None


def test_a_read_that_timed_out_ends_the_request_but_keeps_its_blocks_until_it_is_over():
    """kv_late: NIXL may still land the read into the blocks, so they wait for it."""
    s = make()
    s.add(_remote(tuple(range(1, 11))))
    plan = s.schedule()
    out = run(s, plan, kv_failed=(("d1", "took over 30 s"),), kv_late=("d1",))
    (d,) = out.deltas
    assert d.finish_reason is FinishReason.ERROR and "30 s" in d.error
    assert s.blocks.num_used == 3                  # held for the late read
    plan = s.schedule()
    assert plan.kv_waiting                          # the runner keeps polling it
    run(s, plan)
    assert s.blocks.num_used == 3
    run(s, s.schedule(), kv_loaded=("d1",))         # it landed: now they are free
    assert s.blocks.num_used == 0 and not s.has_work()
    assert not s.schedule().kv_waiting
