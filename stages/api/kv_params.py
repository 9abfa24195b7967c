"""A request's kv_transfer_params against this server's KV connector (issue 36): what
render puts on RenderedRequest.kv_transfer, or the 400 for what it cannot serve."""
from __future__ import annotations

import logging

from stages.api.common import RequestError, ignored_field
from stages.kv_transfer import (IncompleteRemotePrefill, KVParamsError, KVTransfer,
                                    KVTransferConfig, notify_refused, refused_remote_prefill,
                                    request_params)

__all__ = ["KVTransferConfig", "kv_transfer", "notify_refused", "refused_remote_prefill"]


_log = logging.getLogger("tailrace.kv")


def kv_transfer(params, cfg: KVTransferConfig | None, n: int, num_prompts: int,
                prompt_logprobs: int | None, stream: bool = False, api: str = "request"
                ) -> KVTransfer | None:
    """kv_transfer_params as the KV connector reads them (stages/kv_transfer.py),
    checked against this server's role: a 400 for what it cannot do. As vLLM: a server
    without a connector ignores them (chat took their prompt_token_ids at render), and a
    remote prefill whose fields are incomplete is logged and prefilled here."""
    if cfg is None:
        if params:
            ignored_field(api, "kv_transfer_params", "asks for a KV transfer of a server "
                          "without a KV connector (--kv-transfer-config): served as a plain "
                          "request")
        return None
    try:
        kv = request_params(params)
    except IncompleteRemotePrefill as err:
        _log.warning("%s; prefilling the prompt here instead.", err.message)
        return None
    except KVParamsError as err:
        raise RequestError(err.message, param=err.param) from None
    if kv is None:
        return None
    field = "do_remote_decode" if kv.remote_decode else "do_remote_prefill"
    param = f"kv_transfer_params.{field}"
    if kv.remote_decode and not cfg.producer or kv.remote_prefill and not cfg.consumer:
        raise RequestError(f"'{param}': this server's kv_role is {cfg.kv_role}.", param=param)
    if n != 1 or num_prompts != 1:
        raise RequestError(f"'{param}' takes one prompt and n 1.", param=param)
    if kv.remote_prefill is not None and prompt_logprobs is not None:
        raise RequestError(f"'{param}' does not combine with prompt_logprobs (the prompt is "
                           "not computed here).", param="prompt_logprobs")
    if kv.remote_decode and stream:     # the params come on the body; a stream has none
        raise RequestError(f"'{param}' needs stream false (the reply's body carries the "
                           "kv_transfer_params for the decode instance).", param="stream")
    return kv
