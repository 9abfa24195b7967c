"""What `tailrace bench serve` costs per streamed token, the client timed alone.

A canned SSE server runs in a process of its own: every step (``--step-ms``) it writes
one completions chunk, as tailrace's completions API writes it, to every open stream,
each as its own HTTP/1.1 chunk, then the finishing chunk, the usage chunk and
``[DONE]``. The client is `web.bench.serve.run_benchmark` itself, in this process, at
``--streams`` concurrent streams; its CPU time comes from ``getrusage(RUSAGE_SELF)``
around the run only, and the server's from /proc, so other load on the machine does
not enter either figure.

    PYTHONPATH=. python scripts/bench_client_cost.py [--streams 256] [--tokens 128] [--rounds 3]
        [--step-ms 20] [--clients raw httpx]

Prints, per round: streamed tokens, wall time, tok/s, client CPU µs per token, server
CPU µs per token, and the mean number of tokens per client read (1.0 means the client
kept up with the server, the dearest case per token: reads are not batched).
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson

EVENT = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
         b'"created":1764554000,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
         b'"text":" hello","logprobs":null,"finish_reason":null}]}\n\n')
FINISH = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
          b'"created":1764554000,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
          b'"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n')
HEAD = (b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"date: Tue, 01 Dec 2026 12:00:00 GMT\r\nserver: hypercorn-h11\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _usage(prompt: int, completion: int) -> bytes:
    body = {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1764554000,
            "model": "SmolLM2-135M-Instruct", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = b""
        self.left = 0
        self.sent = 0


def serve(step_s: float) -> None:
    """The canned server: one thread, a step clock, blocking writes (the client's pace is back-pressure)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    listener.setblocking(False)
    print(listener.getsockname()[1], flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    active: list[_Conn] = []
    token = _chunk(EVENT)
    tail = _chunk(FINISH)
    next_step = time.monotonic()
    while True:
        timeout = max(0.0, next_step - time.monotonic()) if active else None
        for key, _ in selector.select(timeout):
            if key.data is None:
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:
                    continue
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                selector.register(sock, selectors.EVENT_READ, _Conn(sock))
                continue
            conn = key.data
            try:
                data = conn.sock.recv(65536)
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(conn.sock)
                conn.sock.close()
                continue
            conn.inbox += data
            head, sep, body = conn.inbox.partition(b"\r\n\r\n")
            if not sep:
                continue
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(body) < length:
                continue
            selector.unregister(conn.sock)
            conn.sock.setblocking(True)
            if head.startswith(b"GET /v1/models"):
                models = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
                conn.sock.sendall(b"HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                  % len(models) + models)
                conn.sock.close()
                continue
            conn.left = orjson.loads(body)["max_tokens"]
            conn.sock.sendall(HEAD)
            active.append(conn)
        if active and time.monotonic() >= next_step:
            next_step += step_s
            still: list[_Conn] = []
            for conn in active:
                try:
                    if conn.left > 0:
                        conn.sock.sendall(token)
                        conn.left -= 1
                        conn.sent += 1
                        still.append(conn)
                    else:
                        conn.sock.sendall(tail + _chunk(_usage(16, conn.sent)) + _chunk(b"data: [DONE]\n\n")
                                          + b"0\r\n\r\n")
                        conn.sock.close()
                except OSError:
                    conn.sock.close()
            active = still
            if time.monotonic() > next_step + step_s:
                next_step = time.monotonic()  # behind by more than a step: do not burst to catch up


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_round(port: int, server_pid: int, streams: int, tokens: int, prompts: int, client: str) -> dict[str, float]:
    import httpx
    import trio

    from web.bench import serve as bench
    from web.bench.datasets import SampleRequest

    def httpx_client(config):  # the client before issue 21, for comparison
        return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0),
                                 limits=httpx.Limits(max_connections=None), trust_env=False)

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--port", str(port), "--model", "m", "--disable-tqdm",
                              "--max-concurrency", str(streams), "--num-prompts", str(prompts)])
    config = bench.build_config(args)
    samples = [SampleRequest(prompt=f"prompt {i}", prompt_len=2, expected_output_len=tokens) for i in range(prompts)]
    own_client = getattr(bench, "open_client", None)
    if client == "httpx":
        bench.open_client = httpx_client
    try:
        client0, server0, wall0 = _self_cpu_s(), _proc_cpu_s(server_pid), time.perf_counter()
        outcome = trio.run(bench.run_benchmark, config, samples)
        client1, server1, wall1 = _self_cpu_s(), _proc_cpu_s(server_pid), time.perf_counter()
    finally:
        bench.open_client = own_client
    failed = [r.error for r in outcome.results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
    streamed = sum(r.output_tokens for r in outcome.results)
    # Events that arrived in the same read as the one before them have an ITL of exactly 0.
    same_read = sum(1 for r in outcome.results for itl in r.itls if itl == 0.0)
    return {"tokens": streamed, "wall_s": wall1 - wall0, "tok_s": streamed / (wall1 - wall0),
            "client_us": (client1 - client0) / streamed * 1e6, "server_us": (server1 - server0) / streamed * 1e6,
            "per_read": streamed / (streamed - same_read)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--prompts", type=int, default=None, help="requests per round (default: --streams)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the server writes one token to every stream each step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", nargs="+", choices=("own", "httpx"), default=["own", "httpx"],
                        help="own: bench serve as this tree has it (since issue 21, web/bench/transport.py); "
                             "httpx: the same with httpx as the transport, as before issue 21; alternating "
                             "within each round. With PYTHONPATH at an older tree, 'own' times that tree's client")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.step_ms / 1000)
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--step-ms", str(args.step_ms)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        prompts = args.prompts or args.streams
        print(f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms} ms "
              f"(at most {args.streams * 1000 / args.step_ms:,.0f} tok/s)")
        for k in range(args.rounds):
            for client in args.clients:
                r = one_round(port, server.pid, args.streams, args.tokens, prompts, client)
                print(f"round {k + 1} {client:>5}: {r['tokens']:,} tokens in {r['wall_s']:.2f} s = {r['tok_s']:,.0f} tok/s; "
                      f"client {r['client_us']:.1f} us/token, server {r['server_us']:.1f} us/token, "
                      f"{r['per_read']:.2f} tokens per client read", flush=True)
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
