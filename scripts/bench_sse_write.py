"""Server CPU per SSE event, 256 concurrent streams, through tailrace's HTTP path.

The server process runs ``web.app.create_app`` behind ``LoadingGate`` with Hypercorn, as
``tailrace serve`` does (``web.server.open_http``), over a stand-in engine: ``submit``
returns a real ``pipeline.core.engine.Reply``, and a step task puts one completions chunk
(the bytes tailrace's completions API writes) on every open reply each ``--step-ms``,
then the finishing chunk, the usage chunk, ``[DONE]`` and ``ReplyEnd``, as the emit
stage does. A reader in another process (stdlib sockets and ``select``, cheap enough to
keep up) opens the streams and reads them to the end. The server's CPU time comes from
/proc/<pid>/stat over the streaming window only.

    PYTHONPATH=. python scripts/bench_sse_write.py [--variants today null ...] [--rounds 3]

Variants (the server's path for the same bytes):
- today: the path before issue 21: Quart's response generator, as web/app.py streams a
  Reply, and Hypercorn's TCPServer writing each chunk with trio's send_all.
- fastwrite: the same with web/sse.py's FastWriteTCPServer (what `tailrace serve` runs).
- fastwrite-asgi: fastwrite, and a raw ASGI app instead of Quart (a bound only: no
  disconnect watcher, no error handling).
- null: no HTTP write at all (a task drains each Reply); the floor: the stand-in
  engine's own work and the Reply's.
"""

from __future__ import annotations

import argparse
import os
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
FINISH = EVENT.replace(b'" hello"', b'""').replace(b'"finish_reason":null', b'"finish_reason":"length"')
USAGE = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
         b'"created":1764554000,"model":"SmolLM2-135M-Instruct","choices":[],'
         b'"usage":{"prompt_tokens":16,"completion_tokens":%d,"total_tokens":%d}}\n\n')
DONE = b"data: [DONE]\n\n"


# -- the server -------------------------------------------------------------------------

def serve(variant: str, tokens: int, step_s: float, interval: int) -> None:
    import logging

    import trio

    from pipeline.core.reply import Reply
    from stages.emit import ReplyEnd
    from web import app as web_app
    from web.server import open_http

    class StandInEngine:
        """What create_app needs of an Engine; one step writes a token to every reply."""

        failure = None
        healthy = True
        model_names = ("m",)

        def __init__(self) -> None:
            self.open: dict[str, list] = {}

        async def submit(self, api, body, request_id, headers=()):
            send, receive = trio.open_memory_channel(tokens + 8)
            self.open[request_id] = [send, tokens]
            return Reply(self, request_id, True, receive)

        def abort(self, request_id: str) -> None:
            self.open.pop(request_id, None)

        async def run(self) -> None:
            next_step = trio.current_time()
            step = 0
            while True:
                next_step = max(next_step + step_s, trio.current_time())
                await trio.sleep_until(next_step)
                step += 1
                for request_id, state in list(self.open.items()):
                    send, left = state
                    if left:
                        if step % interval == 0 or left < interval:  # as --stream-interval holds events
                            for _ in range(min(interval, left)):
                                send.send_nowait(EVENT)
                            state[1] = left - min(interval, left)
                    else:
                        for item in (FINISH, USAGE % (tokens, tokens + 16), DONE, ReplyEnd(200)):
                            send.send_nowait(item)
                        send.close()
                        del self.open[request_id]

    tcp_server_base = server_class(variant)

    async def main() -> None:
        engine = StandInEngine()
        gate = web_app.LoadingGate()
        gate.open(web_app.create_app(engine) if variant != "fastwrite-asgi" else _raw_asgi(engine))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            if variant == "null":
                nursery.start_soon(_null_http, engine, sock)
                print(port, flush=True)
                return
            async with open_http(gate, sock, log_level="warning",
                                 tcp_server_base=tcp_server_base):
                print(port, flush=True)
                await trio.sleep_forever()

    def _raw_asgi(engine):
        """The SSE route without Quart (no disconnect watcher, no errors): a bound on what
        bypassing Quart's response generator could save."""

        async def app(scope, receive, send) -> None:
            while (await receive()).get("more_body"):
                pass
            reply = await engine.submit("completions", None, f"r{id(scope)}")
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            async for chunk in reply:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return app

    async def _null_http(engine, sock) -> None:
        """Reads each request, drains its Reply without writing it, and closes."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

        async def handle(stream) -> None:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            async with stream:
                async for _ in await engine.submit("completions", None, f"r{id(stream)}"):
                    pass

        await trio.serve_listeners(handle, [listener])

    logging.basicConfig(level=logging.WARNING)
    trio.run(main)


def server_class(variant: str) -> type:
    """The class the variant's connections' TCPServer builds on (web.server.open_http)."""
    from hypercorn.trio.tcp_server import TCPServer

    from web import sse

    return sse.FastWriteTCPServer if variant.startswith("fastwrite") else TCPServer


# -- the reader (another process) -----------------------------------------------------

def read(port: int, streams: int, tokens: int, null: bool) -> None:
    """Opens the streams, reads them to their end; prints events read and seconds taken."""
    body = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": tokens, "stream": True})
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    selector = selectors.DefaultSelector()
    start = time.perf_counter()
    for _ in range(streams):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, [b"", 0])
    events = 0
    open_streams = streams
    expected = tokens + 3  # the tokens, the finishing chunk, the usage chunk, [DONE]
    while open_streams:
        for key, _ in selector.select():
            data = key.fileobj.recv(1 << 18)
            state = key.data
            if not data:
                selector.unregister(key.fileobj)
                key.fileobj.close()
                open_streams -= 1
                continue
            n = data.count(b"\n\n")
            state[1] += n
            events += n
            if state[1] >= expected and data.endswith(b"0\r\n\r\n"):
                selector.unregister(key.fileobj)
                key.fileobj.close()
                open_streams -= 1
    print(events, time.perf_counter() - start, flush=True)


# -- the driver -----------------------------------------------------------------------

def _proc_cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def one_round(variant: str, args: argparse.Namespace) -> dict[str, float]:
    server = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--tokens", str(args.tokens),
                               "--step-ms", str(args.step_ms), "--stream-interval", str(args.stream_interval)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        time.sleep(0.5)  # let start-up settle before the window opens
        cpu0 = _proc_cpu_s(server.pid)
        reader = subprocess.run([sys.executable, __file__, "--read", str(port), "--streams", str(args.streams),
                                 "--tokens", str(args.tokens)] + (["--null"] if variant == "null" else []),
                                capture_output=True, text=True, check=True)
        cpu1 = _proc_cpu_s(server.pid)
    finally:
        server.terminate()
        server.wait()
    events_read, seconds = reader.stdout.split()
    events = args.streams * (args.tokens + 3) if variant == "null" else int(events_read)
    return {"events": events, "seconds": float(seconds), "events_s": events / float(seconds),
            "user_us": (cpu1[0] - cpu0[0]) / events * 1e6, "sys_us": (cpu1[1] - cpu0[1]) / events * 1e6}


VARIANTS = ("today", "fastwrite", "fastwrite-asgi", "null")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="token events per stream")
    parser.add_argument("--step-ms", type=float, default=40.0, help="one token per stream each step")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="put a stream's token events on its Reply N at a time, every N steps (serve's flag)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, variants alternating")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--read", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--null", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.tokens, args.step_ms / 1000, args.stream_interval)
        return 0
    if args.read:
        read(args.read, args.streams, args.tokens, args.null)
        return 0
    print(f"{args.streams} streams x {args.tokens} tokens (+3 closing events), a step every {args.step_ms} ms, "
          f"--stream-interval {args.stream_interval}")
    for k in range(args.rounds):
        for variant in args.variants:
            r = one_round(variant, args)
            print(f"round {k + 1} {variant:>10}: {r['events']:,} events in {r['seconds']:.2f} s = "
                  f"{r['events_s']:,.0f} events/s; server {r['user_us'] + r['sys_us']:.1f} us/event "
                  f"({r['user_us']:.1f} user + {r['sys_us']:.1f} system)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
