"""``tailrace bench serve``: load an OpenAI-compatible server and report latency.

Each request gets ``x-request-id: <--request-id-prefix><index>``, with index
the request's position (0-based) in the sampled prompt list.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import attrs
import httpx
import numpy as np
import orjson
import trio
from tqdm import tqdm

from web.bench import datasets, metrics
from web.bench.account import RequestResult
from web.bench.backends import BACKENDS, Backend, BenchConfigError, SamplingParams
from web.bench.request import request_headers, send_request
from web.bench.transport import StreamClient

DEFAULT_REQUEST_ID_PREFIX = "bench-serve-"


@attrs.frozen
class BenchConfig:
    """Every flag, validated; ``build_config`` is the only way in from argparse."""

    backend: Backend
    base_url: str
    endpoint: str
    model: str | None
    served_model_name: str | None
    tokenizer: str | None
    dataset_name: str
    dataset_path: str | None
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    random_prefix_len: int
    sharegpt_output_len: int | None
    custom_output_len: int
    seed: int
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    ignore_eos: bool
    sampling: SamplingParams
    extra_body: dict[str, Any]
    headers: dict[str, str]
    request_id_prefix: str
    goodput: dict[str, float]
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    save_result: bool
    save_detailed: bool
    result_dir: str | None
    result_filename: str | None
    disable_tqdm: bool
    request_timeout: float | None
    inputs_per_request: int = 1

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=sorted(BACKENDS), default="openai-completions",
                        help="API to load (openai and vllm: vLLM's names for openai-completions)")
    target.add_argument("--base-url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default=None, help="API path; default per backend (/v1/completions, /v1/chat/completions, /v1/responses)")
    target.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    target.add_argument("--served-model-name", default=None, help="model name sent in requests; wins over --model")
    target.add_argument("--tokenizer", default=None, help="tokenizer for prompts and prompt lengths (default: the server's default model)")
    target.add_argument("--header", action="append", default=[], metavar="KEY=VALUE", help="extra HTTP header; repeatable")
    target.add_argument("--request-id-prefix", default=DEFAULT_REQUEST_ID_PREFIX, help="x-request-id is this prefix + the request index")
    target.add_argument("--request-timeout", type=float, default=None, help="per-request read timeout in seconds (default: none)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "sharegpt", "custom"), default="random")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON or custom JSONL file")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths are uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length instead of the answer's")
    data.add_argument("--custom-output-len", type=int, default=256, help="output length for lines without output_tokens")
    data.add_argument("--seed", type=int, default=0, help="seed for sampling prompts and arrival times")

    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=1000)
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--ignore-eos", action="store_true")
    load.add_argument("--inputs-per-request", type=int, default=1,
                      help="openai-embeddings: each request embeds this many of the prompts (an input list)")

    sampling = parser.add_argument_group("sampling (sent only when given)")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--frequency-penalty", type=float, default=None)
    sampling.add_argument("--presence-penalty", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--sampling-seed", type=int, default=None, help="sent as the request's seed")
    sampling.add_argument("--extra-body", default=None, help="JSON object merged into every payload")

    report = parser.add_argument_group("metrics and output")
    report.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="printed metrics from ttft,tpot,itl,e2el")
    report.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    report.add_argument("--save-result", action="store_true")
    report.add_argument("--save-detailed", action="store_true", help="also save per-request arrays (implies --save-result)")
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", default=None)
    report.add_argument("--disable-tqdm", action="store_true")


def _parse_headers(items: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise BenchConfigError(f"--header {item!r}: expected KEY=VALUE")
        headers[name.strip()] = value
    return headers


def _parse_extra_body(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise BenchConfigError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BenchConfigError("--extra-body must be a JSON object")
    return body


def build_config(args: argparse.Namespace) -> BenchConfig:
    backend = BACKENDS[args.backend]
    endpoint = args.endpoint or backend.default_endpoint
    backend.check_endpoint(endpoint)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
    )
    backend.check_sampling(sampling)
    if args.num_prompts < 1:
        raise BenchConfigError("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise BenchConfigError("--request-rate must be > 0 (inf sends all at once)")
    if not args.burstiness > 0:
        raise BenchConfigError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchConfigError("--max-concurrency must be >= 1")
    if args.dataset_name in ("sharegpt", "custom") and not args.dataset_path:
        raise BenchConfigError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.inputs_per_request < 1 or (args.inputs_per_request > 1 and backend.stream):
        raise BenchConfigError("--inputs-per-request is at least 1, and more only with --backend openai-embeddings")
    return BenchConfig(
        backend=backend,
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        endpoint=endpoint,
        model=args.model,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len,
        custom_output_len=args.custom_output_len,
        seed=args.seed,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        sampling=sampling,
        extra_body=_parse_extra_body(args.extra_body),
        headers=_parse_headers(args.header),
        request_id_prefix=args.request_id_prefix,
        goodput=metrics.parse_goodput(args.goodput),
        percentile_metrics=metrics.parse_metric_list(args.percentile_metrics),
        metric_percentiles=metrics.parse_percentiles(args.metric_percentiles),
        save_result=args.save_result or args.save_detailed,
        save_detailed=args.save_detailed,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
        disable_tqdm=args.disable_tqdm,
        request_timeout=args.request_timeout,
        inputs_per_request=args.inputs_per_request,
    )


def sample_requests(config: BenchConfig, tokenizer: datasets.Tokenizer) -> list[datasets.SampleRequest]:
    if config.dataset_name == "random":
        return datasets.random_requests(
            tokenizer, num_prompts=config.num_prompts, input_len=config.random_input_len,
            output_len=config.random_output_len, range_ratio=config.random_range_ratio,
            prefix_len=config.random_prefix_len, seed=config.seed)
    assert config.dataset_path is not None
    if config.dataset_name == "sharegpt":
        return datasets.sharegpt_requests(tokenizer, config.dataset_path, num_prompts=config.num_prompts,
                                          output_len=config.sharegpt_output_len, seed=config.seed)
    return datasets.custom_requests(tokenizer, config.dataset_path, num_prompts=config.num_prompts,
                                    output_len=config.custom_output_len, seed=config.seed)


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds after the start: gamma gaps, shape=burstiness, scale=1/(rate*burstiness)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


@attrs.frozen
class BenchOutcome:
    results: tuple[RequestResult, ...]
    duration: float
    model: str


def open_client(config: BenchConfig) -> StreamClient | httpx.AsyncClient:
    """The raw HTTP/1.1 client for plain http (a fraction of httpx's CPU per chunk); httpx for https."""
    connect_timeout = config.request_timeout or 60.0
    if config.base_url.startswith("http://"):
        return StreamClient(read_timeout=config.request_timeout, connect_timeout=connect_timeout)
    timeout = httpx.Timeout(config.request_timeout, connect=connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.max_concurrency)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def _discover_model(client: StreamClient | httpx.AsyncClient, config: BenchConfig) -> str:
    url = config.base_url.rstrip("/") + "/v1/models"
    async with client.stream("GET", url, headers=config.headers) as response:
        body = await response.aread()
    if response.status_code != 200:
        raise BenchConfigError(f"GET {url}: HTTP {response.status_code}; pass --model")
    try:
        listing = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BenchConfigError(f"GET {url} did not answer JSON; pass --model") from None
    models = (listing.get("data") if isinstance(listing, dict) else None) or []
    if not models:
        raise BenchConfigError("the server lists no models; pass --model")
    return models[0]["id"]


async def run_benchmark(config: BenchConfig, requests: Sequence[datasets.SampleRequest]) -> BenchOutcome:
    """Send every request on its arrival schedule; the nursery waits for all of them."""
    results: list[RequestResult | None] = [None] * len(requests)
    limiter = trio.CapacityLimiter(config.max_concurrency or math.inf)
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    print(f"Traffic request rate: {config.request_rate}, burstiness: {config.burstiness}, "
          f"maximum request concurrency: {config.max_concurrency}", file=sys.stderr)

    with tqdm(total=len(requests), disable=config.disable_tqdm, file=sys.stderr) as progress:
        async with open_client(config) as client:
            model = config.served_model_name or config.model or await _discover_model(client, config)

            async def one(index: int, sample: datasets.SampleRequest) -> None:
                prompt = sample.prompt
                if config.inputs_per_request > 1:   # this request's share of the prompts
                    k = config.inputs_per_request
                    prompt = [s.prompt for s in requests[index * k:(index + 1) * k]]
                payload = config.backend.build_payload(
                    model=model, prompt=prompt, max_tokens=sample.expected_output_len,
                    sampling=config.sampling, ignore_eos=config.ignore_eos, extra_body=config.extra_body)
                headers = request_headers(f"{config.request_id_prefix}{index}", config.headers)
                async with limiter:
                    results[index] = await send_request(client, config.backend, config.url, payload, headers,
                                                        sample.prompt_len)
                progress.update(1)

            start = time.perf_counter()
            start_trio = trio.current_time()
            async with trio.open_nursery() as nursery:
                k = config.inputs_per_request
                for index, (sample, offset) in enumerate(zip(requests[:-(-len(requests) // k)], offsets)):
                    await trio.sleep_until(start_trio + offset)
                    nursery.start_soon(one, index, sample)
            duration = time.perf_counter() - start
    done = tuple(r for r in results if r is not None)
    assert len(done) == -(-len(requests) // config.inputs_per_request)
    return BenchOutcome(results=done, duration=duration, model=model)


def result_record(config: BenchConfig, outcome: BenchOutcome) -> dict[str, Any]:
    summary = metrics.summarize(outcome.results, outcome.duration, percentiles=config.metric_percentiles,
                                goodput=config.goodput or None)
    record: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": config.backend.name,
        "endpoint": config.endpoint,
        "model_id": outcome.model,
        "tokenizer_id": config.tokenizer,
        "dataset_name": config.dataset_name,
        "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        **summary,
    }
    if config.goodput:
        record["goodput_slos_ms"] = dict(config.goodput)
    if config.save_detailed:
        record.update(metrics.detailed_fields(outcome.results))
    return record


def default_result_filename(config: BenchConfig, model: str) -> str:
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{config.backend.name}-{rate}qps{concurrency}-{Path(model).name}-{stamp}.json"


def save_record(config: BenchConfig, record: dict[str, Any], model: str) -> Path:
    path = Path(config.result_filename or default_result_filename(config, model))
    if config.result_dir:
        path = Path(config.result_dir) / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def _load_tokenizer(path: str | None) -> datasets.Tokenizer:
    from gpu.tokenizers.files import load_tokenizer  # no torch; only the CLI path needs it

    return load_tokenizer(path)


def _report_errors(results: Sequence[RequestResult], limit: int = 5) -> None:
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    for message, count in list(errors.items())[:limit]:
        print(f"failed x{count}: {message}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; 2 for a refused configuration, 1 if no request succeeded, else 0."""
    try:
        config = build_config(args)
        tokenizer = _load_tokenizer(config.tokenizer)
        requests = sample_requests(config, tokenizer)
    except (BenchConfigError, OSError, orjson.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        outcome = trio.run(run_benchmark, config, requests)
    except (BenchConfigError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    record = result_record(config, outcome)
    if not config.backend.stream:   # embeddings: the inputs embedded per second too
        done = sum(1 for r in outcome.results if r.success) * config.inputs_per_request
        record["inputs_per_request"] = config.inputs_per_request
        record["input_throughput"] = min(done, len(requests)) / outcome.duration if outcome.duration else 0.0
    print(metrics.format_table(record, metrics.TableOptions(config.percentile_metrics, config.metric_percentiles)))
    if not config.backend.stream:
        print(f"Embedding inputs per second:             {record['input_throughput']:.2f}")
    _report_errors(outcome.results)
    if config.save_result:
        path = save_record(config, record, outcome.model)
        print(f"saved results to {path}", file=sys.stderr)
    return 0 if record["completed"] else 1


def _standalone() -> int:
    parser = argparse.ArgumentParser(prog="python -m web.bench.serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(_standalone())
