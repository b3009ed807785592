"""The stand-in trainer's process group (runtime/standin.py; docs/training.md, "Tests"): what torch.distributed
is to the trainer, over plain TCP (standard library only); `install` puts the runtime's collectives
(runtime/rank/collectives.py) and the health check's measurement (a constant figure, the same test hooks)
over it.

- **Rendezvous.** Rank 0 listens on MASTER_ADDR:MASTER_PORT (every address of its host); every other rank
  connects, retrying until the start-up limit, and says who it is (rank, node, job id and step: a
  connection of another job or step on a reused port, or a stray one, is closed). Once all have joined,
  rank 0 sends everybody every rank's node. A rank that never joins keeps the others waiting, as in
  torch's rendezvous.
- **A collective** is one round trip: every rank sends rank 0 its value (one JSON line, with the
  collective's number and kind: a rank out of step is an error), rank 0 answers every rank with the
  reduction: MAX (the stop decision, `any_rank`), its own value (a broadcast) or the list of all values
  (a gather: the health check's figures, the shards of a save).
- **A peer that died** (SIGKILL, a lost node: the kernel closes its socket) is noticed at the next
  collective by the ranks connected to it: they raise `PeerLost` ("connection closed by peer: rank R on
  NODE", words the chain's evidence reads as a consequence, launcher/accounting/evidence.py PEER_LOST),
  and rank 0 closes every connection on any error, so every rank fails within a collective, as the
  trainer's collectives fail when a rank is gone. A silent peer (a hang) raises TimeoutError ("Socket
  Timeout") only after `timeout_s`, which the stand-in sets beyond its hang watchdog's limit.

Rank 0 reads the ranks in order and answers once all have written: the cost of a collective is a few
small writes and reads per rank, one process per rank, no thread."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from megalaunch.runtime.health import health
from megalaunch.runtime.rank import collectives

DEVICE = "stand-in"  # the health check's device (its baselines never mix with a real one's)
DEVICE_TFLOPS = 1.0


class PeerLost(ConnectionError):
    """A peer's connection broke: its process ended (a rank killed, a node lost)."""


class Group:
    """The stand-in's process group (module docstring): rank 0 holds a connection to every other rank,
    every other rank one to rank 0; `ops` numbers the collectives."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s, self.ops = rank, world, timeout_s, 0
        self.peers: dict[int, tuple[socket.socket, Any]] = {}  # rank -> (socket, its reader)
        self.hosts = [""] * world

    def join(self, addr: str, port: int, *, host: str, job: str, within_s: float) -> Group:
        self.hosts[self.rank] = host
        deadline = time.monotonic() + within_s
        if self.world > 1 and self.rank == 0:
            self._serve(port, job, deadline)
        elif self.world > 1:
            self._connect(addr, port, job, deadline)
        return self

    def _serve(self, port: int, job: str, deadline: float) -> None:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        server = socket.create_server(("", port), family=family, backlog=self.world,
                                      dualstack_ipv6=family == socket.AF_INET6)
        with server:
            while len(self.peers) < self.world - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self.world)) - set(self.peers))
                    raise TimeoutError(f"rendezvous timed out: rank(s) {missing[:20]} never joined") from None
                self._admit(conn, job)
        for r in self.peers:
            self._send(r, {"hosts": self.hosts})

    def _admit(self, conn: socket.socket, job: str) -> None:
        conn.settimeout(10.0)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        try:
            hello = json.loads(reader.readline())
            rank = int(hello["rank"])
            welcome = hello.get("job") == job and 0 < rank < self.world and rank not in self.peers
        except (OSError, ValueError, KeyError, TypeError):
            welcome = False
        if not welcome:  # a stray connection, or another job's rank on a reused port
            conn.close()
            return
        conn.settimeout(self.timeout_s)
        self.peers[rank] = (conn, reader)
        self.hosts[rank] = str(hello.get("host"))

    def _connect(self, addr: str, port: int, job: str, deadline: float) -> None:
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=5.0)
                break
            except OSError as e:  # rank 0 not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rendezvous timed out: no rank 0 on {addr}:{port} ({e})") from None
                time.sleep(0.1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(max(0.01, deadline - time.monotonic()))  # until every rank has joined
        self.peers[0], self.hosts[0] = (conn, conn.makefile("rb")), addr
        self._send(0, {"rank": self.rank, "host": self.hosts[self.rank], "job": job})
        self.hosts = [str(h) for h in self._recv(0)["hosts"]]
        conn.settimeout(self.timeout_s)

    def exchange(self, op: str, value: Any) -> Any:
        """The one collective: every rank's `value` to rank 0, its answer (`op`: max, bcast, gather) to all."""
        self.ops += 1
        if self.world == 1:
            return _answer(op, [value])
        try:
            if self.rank != 0:
                self._send(0, {"op": op, "seq": self.ops, "v": value})
                return self._recv(0)["v"]
            values = [value]
            for r in range(1, self.world):
                msg = self._recv(r)
                if (msg.get("op"), msg.get("seq")) != (op, self.ops):
                    raise RuntimeError(f"collective mismatch: {self._who(r)} is in {msg.get('op')} "
                                       f"#{msg.get('seq')}, rank 0 in {op} #{self.ops}")
                values.append(msg["v"])
            answer = _answer(op, values)
            for r in range(1, self.world):
                self._send(r, {"v": answer})
            return answer
        except BaseException:
            self.close()  # every peer notices at once, as a dead rank's peers do
            raise

    def all_reduce_max(self, value: int) -> int:
        return int(self.exchange("max", int(value)))

    def broadcast_from_zero(self, value: int) -> int:
        return int(self.exchange("bcast", int(value)))

    def any_rank(self, flag: bool) -> bool:
        return bool(self.exchange("max", int(flag)))

    def _who(self, r: int) -> str:
        return f"rank {r} on {self.hosts[r] or '?'}"

    def _send(self, r: int, msg: dict[str, Any]) -> None:
        try:
            self.peers[r][0].sendall(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            raise PeerLost(f"connection reset by peer: {self._who(r)} ({e})") from e

    def _recv(self, r: int) -> dict[str, Any]:
        try:
            line = self.peers[r][1].readline()
        except TimeoutError:
            raise TimeoutError(f"Socket Timeout: nothing from {self._who(r)} in {self.timeout_s:.0f} s") from None
        except OSError as e:
            raise PeerLost(f"connection reset by peer: {self._who(r)} ({e})") from e
        if not line:
            raise PeerLost(f"connection closed by peer: {self._who(r)} (its process ended)")
        msg = json.loads(line)
        assert isinstance(msg, dict)
        return msg

    def close(self) -> None:
        for conn, reader in self.peers.values():
            reader.close()
            conn.close()
        self.peers.clear()


def _answer(op: str, values: list[Any]) -> Any:
    return max(values) if op == "max" else values[0] if op == "bcast" else values


def install(group: Group) -> None:
    """The runtime's collectives and the health check's measurement, over the stand-in's group."""
    collectives.all_reduce_max = group.all_reduce_max
    collectives.broadcast_from_zero = group.broadcast_from_zero
    collectives.any_rank = group.any_rank

    def run_check(*, rank: int, margin: float, baselines: health.Baselines | None = None,
                  while_busy: Callable[[], Any] = lambda: None) -> health.HealthVerdict:
        while_busy()  # the start-up imports (warm_imports.py), as the real check on the CPU
        node, started, tflops, error = health.node_name(), time.perf_counter(), None, None
        try:  # the same test hooks as the real check
            if health._hooked(os.environ.get(health.FAIL_NODE_ENV) or "", node, rank):
                raise RuntimeError(f"test hook {health.FAIL_NODE_ENV}={os.environ[health.FAIL_NODE_ENV]}")
            tflops = DEVICE_TFLOPS / health._slow_factor(node, rank)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:300]
        baseline = baselines.reference(DEVICE) if baselines is not None and rank == 0 else None
        mine = health.RankFigures(rank=rank, node=node, device=DEVICE, tflops=tflops,
                                  seconds=time.perf_counter() - started, error=error)
        gathered = group.exchange("gather", [asdict(mine), baseline])
        return health.judge([health.RankFigures(**f) for f, _ in gathered], margin=margin, baseline=gathered[0][1])

    health.run_check = run_check
