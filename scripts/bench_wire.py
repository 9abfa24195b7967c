"""The wire's cost per engine step (pipeline/layouts/wire.py): a decode step of N sequences (one
token each), packed by the engine, written to a socketpair, read and unpacked by a
frontend into a Step. CPU time (process_time), so a loaded machine moves it little.

    .venv/bin/python scripts/bench_wire.py [--seqs 256] [--steps 2000]

Prints µs per step for: pack, unpack, the whole trip through trio sockets (both ends in
one process: the sum of the two processes' CPU), and, for comparison, one pickle of the
whole Step each way (what a plain object channel would cost).
"""
from __future__ import annotations

import argparse
import pickle
import socket
import time

import trio

from pipeline.layouts.wire import Link, pack_step, unpack_step
from stages.delta import Delta
from stages.messages import Step


def decode_step(seqs: int, number: int = 1) -> Step:
    deltas = tuple(Delta(f"req-{i:04d}-{'x' * 24}", (1000 + i,), scheduled_at=12.5 + i,
                         index=0, num_cached_tokens=32 if i % 3 == 0 else 0)
                   for i in range(seqs))
    return Step(number, (), deltas, seqs, 0, seqs * 40, 99.0)


def per_step(fn, steps: int) -> float:
    t0 = time.process_time()
    for _ in range(steps):
        fn()
    return (time.process_time() - t0) / steps * 1e6


async def trip(step: Step, steps: int) -> float:
    a, b = socket.socketpair()
    tx, rx = Link(trio.socket.from_stdlib_socket(a)), Link(trio.socket.from_stdlib_socket(b))
    items = [(d.request_id, d) for d in step.deltas]
    t0 = time.process_time()

    async def send() -> None:
        for _ in range(steps):
            await tx.send_frame(pack_step(step, [], items))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        for _ in range(steps):
            _, payload = await rx.receive_frame()
            unpack_step(payload, {})
    return (time.process_time() - t0) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    step = decode_step(args.seqs)
    items = [(d.request_id, d) for d in step.deltas]
    frame = pack_step(step, [], items)
    payload = frame[5:]
    pickled = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    rows = [
        ("pack (engine)", per_step(lambda: pack_step(step, [], items), args.steps)),
        ("unpack (frontend)", per_step(lambda: unpack_step(payload, {}), args.steps)),
        ("pack + socketpair + unpack, trio", trio.run(trip, step, args.steps)),
        ("pickle.dumps(Step), for comparison",
         per_step(lambda: pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL), args.steps)),
        ("pickle.loads(Step), for comparison", per_step(lambda: pickle.loads(pickled), args.steps)),
    ]
    print(f"{args.seqs} sequences a step, frame {len(frame)} bytes "
          f"(pickled Step {len(pickled)} bytes)")
    for name, us in rows:
        print(f"  {name:40s} {us:8.1f} µs/step  {us / args.seqs:6.2f} µs/token")


if __name__ == "__main__":
    main()
