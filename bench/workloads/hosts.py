"""Across hosts: what meshbook's network path costs next to its local one (issue 16).

* Remote vs local: 4 real ranks behind the ssh launcher, 2 agents of 2 ranks each on "other
  hosts" (this machine, reached through an ``ssh`` that runs the command here: see
  :func:`bench.remote.local_ssh`), so every request and answer travels over TCP with CurveZMQ
  and through the agents' relays, against the same 4 ranks started by the local launcher
  (the controller talks to each rank over ipc directly). A no-op round trip, and a push of
  16 and 256 MiB in GB/s (counted as in the data movement table: the tensor once per rank).
* Curve vs plain TCP: one connection's throughput with 64 MiB messages, encrypted or not, for
  the design note on why a push to another host crosses the network once per host. Not a
  choice users get: meshbook's ``tcp://`` sockets are always Curve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import zmq

from ..harness import Context, Outcome
from ..procs import reaped
from ..remote import local_ssh
from ..report import Table, duration, latency, mib, ratio, throughput
from ..timing import Budget, Samples, clock, measure

TITLE = "Across hosts"
ORDER = 45

RANKS = 4
HOSTS = ["host-a", "host-b"]
PUSH_SIZES = (16 << 20, 256 << 20)
DISPATCH = Budget(samples=1000, seconds=10)
DISPATCH_QUICK = Budget(samples=100, seconds=1)
PUSH = Budget(samples=20, seconds=8, warmup=1, min_samples=3)
PUSH_QUICK = Budget(samples=3, seconds=1, warmup=1, min_samples=3)
#: Curve vs plain: messages of this size, this many in flight per sample.
WIRE_MESSAGE = 64 << 20
WIRE_BATCH = 4
WIRE = Budget(samples=10, seconds=8, warmup=1, min_samples=3)
WIRE_QUICK = Budget(samples=3, seconds=1, warmup=1, min_samples=3)


def run(ctx: Context) -> Outcome:
    return Outcome([_remote_vs_local(ctx), _curve_vs_plain(ctx)])


# -- remote vs local ---------------------------------------------------------------------------

Found = dict[str, "dict[str, Samples] | None"]


def _start_local() -> Any:
    import meshbook

    return meshbook.start(RANKS)


def _start_over_ssh(stack: ExitStack) -> Any:
    import meshbook

    return meshbook.start(RANKS, launcher=stack.enter_context(local_ssh(HOSTS)))


def _measure(start: Callable[[], Any], what: str, ctx: Context) -> dict[str, Samples]:
    import torch

    out = {}
    with reaped(what, start, lambda mesh: mesh.stop()) as mesh:
        out["round trip"] = measure(clock(lambda: mesh.run("pass").result()),
                                  ctx.budget(DISPATCH, DISPATCH_QUICK))
        for size in PUSH_SIZES:
            tensor = torch.randn(size // 4)
            out[f"push {mib(size)}"] = measure(clock(partial(mesh.push, t=tensor)), ctx.budget(PUSH, PUSH_QUICK))
    return out


def _remote_vs_local(ctx: Context) -> Table:
    with ExitStack() as stack:
        found: Found = {
            "local launcher: 1 agent, ipc": ctx.attempt(
                f"across hosts: {RANKS} local ranks", partial(_measure, _start_local, "local ranks", ctx)),
            f"ssh launcher: {len(HOSTS)} agents, TCP + Curve": ctx.attempt(
                f"across hosts: {RANKS} ranks on {len(HOSTS)} ssh hosts",
                partial(_measure, partial(_start_over_ssh, stack), "ranks over ssh", ctx)),
        }
    table = Table(f"Remote vs local: {RANKS} real ranks, no-op round trip and push",
                  ["ranks behind", "`Mesh.run(\"pass\")`",
                   *(f"push {mib(s)} `Mesh.push`" for s in PUSH_SIZES)])
    for label, got in found.items():
        if got is None:
            table.add(label, *["failed"] * (1 + len(PUSH_SIZES)))
            continue
        table.add(label, latency(got["round trip"]),
                  *(_push_cell(size, got[f"push {mib(size)}"]) for size in PUSH_SIZES))
    local, remote = found.values()
    if local and remote:
        table.notes.append("over the network / local, in time: " + ", ".join(
            f"{key} {ratio(remote[key].median, local[key].median)}" for key in local))
    table.notes += [
        ("median (p99) of the round trip; push: GB/s counting the tensor once per rank, and "
         "in brackets the median time of one push (it returns once every rank stored it)"),
        (f"\"other hosts\": {len(HOSTS)} agents started through the ssh launcher with an ssh "
         f"that runs the command on this machine, each serving {RANKS // len(HOSTS)} real ranks; "
         f"requests go once per agent over its Curve TCP connection on loopback and the agent "
         f"relays them to its ranks over ipc. A push crosses the network once per agent, which "
         f"hands it to its ranks; a local push reaches the ranks through shared memory"),
    ]
    return table


def _push_cell(size: int, samples: Samples) -> str:
    return f"{throughput(size * RANKS, samples.median)} ({duration(samples.median)})"


# -- Curve vs plain TCP ------------------------------------------------------------------------


def _wire_sample(send: zmq.Socket, recv: zmq.Socket, payload: bytes) -> float:
    started = time.perf_counter()
    for _ in range(WIRE_BATCH):
        send.send(payload, copy=False)
    for _ in range(WIRE_BATCH):
        recv.recv(copy=False)
    return time.perf_counter() - started


def _connection(curve: bool, budget: Budget) -> Samples:
    """One PUSH -> PULL TCP connection between two contexts (each with its own I/O thread,
    which is where CurveZMQ encrypts and decrypts)."""
    from meshbook.mesh.protocol import net

    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    zap = None
    try:
        pull, push = server_ctx.socket(zmq.PULL), client_ctx.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.setsockopt(zmq.LINGER, 0)
        if curve:
            server, client = net.Keys.new(), net.Keys.new()
            zap = net.Allowlist({client.public: None}).serve(server_ctx)
            net.curve_server(pull, server)
            net.curve_client(push, client, server.public)
        port = net.bind_in_range(pull, "127.0.0.1")
        push.connect(net.tcp_address("127.0.0.1", port))
        payload = bytes(WIRE_MESSAGE)
        return measure(partial(_wire_sample, push, pull, payload), budget)
    finally:
        if zap is not None:
            zap.close()
        server_ctx.destroy(linger=0)
        client_ctx.destroy(linger=0)


def _curve_vs_plain(ctx: Context) -> Table:
    budget = ctx.budget(WIRE, WIRE_QUICK)
    found = {curve: ctx.attempt(f"across hosts: one TCP connection, {'Curve' if curve else 'plain'}",
                                partial(_connection, curve, budget)) for curve in (True, False)}
    table = Table(f"One TCP connection, {mib(WIRE_MESSAGE)} messages: CurveZMQ vs plain",
                  ["connection", "throughput", "time per message"])
    per = WIRE_MESSAGE * WIRE_BATCH
    for curve, got in found.items():
        label = "TCP + CurveZMQ (meshbook's tcp://)" if curve else "plain TCP (for comparison only)"
        table.add(label, throughput(per, got.median) if got else "failed",
                  duration(got.median / WIRE_BATCH) if got else "-")
    if all(found.values()):
        table.notes.append(f"Curve takes {ratio(found[True].median, found[False].median)} the time "
                           f"of plain TCP")
    table.notes.append(f"loopback, PUSH to PULL across two ZeroMQ contexts in one process, "
                       f"{WIRE_BATCH} messages in flight per sample; GB/s is 10^9 bytes per second")
    return table
