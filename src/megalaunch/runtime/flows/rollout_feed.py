"""GRPO's hand-off with a generator outside the chain (docs/post_training.md, "GRPO"): rounds of rollouts
brought into the run in order, one at a time, as training reaches them.

Samples map to rounds deterministically: the rounds are consumed in order, round k holds n_k completions
(a multiple of the global batch size, checked), and iteration i (1-based) trains on samples
(i - 1) * gbs .. i * gbs - 1 of the concatenation, so Megatron's consumed-samples counter says which round
and row every iteration reads, in every segment (exact resume). Each round is tokenized once, by rank 0, in
a process of its own (`megalaunch data rollouts`, with the run's tokenizer), the first time an iteration
needs it: at the step boundary before that iteration, every rank asks `ready(i)`. Rank 0 waits up to
`post_training.rollout_wait_s` for the round's file, tokenizes it and appends its line to
RUN/rollouts/record.jsonl (file, sha256, samples, iterations: which round every iteration used); the
other ranks wait for the round's marker or for rank 0's verdict (RUN/rollouts/gates/<job>-<i>.json):
states, never a guess at how long rank 0 takes. A round that does not come in time, or is refused (its
bad rows named), stops the segment cleanly: rank 0 writes the `exit` trigger with the reason, the
boundary's decision saves and leaves (outcome `exited`, the chain stops), and `megalaunch resume` later
continues from that checkpoint and waits again."""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.runtime.flows.chat_format import MARKER_SUFFIX
from megalaunch.runtime.flows.rollout_format import RECORD, ROLLOUTS_DIR, round_source, round_stem
from megalaunch.runtime.flows.rollout_reference import reference_complete, reference_dir

POLL_S = 0.2  # how often a waiting rank looks at the state it waits for
INTERRUPTED = "interrupted by the stop signal"  # a wait cut short: the signal's save comes first (not cached)


@dataclass
class FeedConfig:
    source: Path  # post_training.rollouts: a file, or the directory of rounds
    run_dir: Path
    tokenizer: Path  # the run's tokenizer (RUN/tokenizer)
    global_batch: int
    train_iters: int
    wait_s: float  # post_training.rollout_wait_s
    seq_length: int | None = None
    job_id: str = "nojob"
    reference_model: Path | None = None  # kl_coeff > 0: each round is scored with it (rollout_reference.py)


class RolloutFeed:
    """Which round holds which samples, and bringing the next round in (see the module docstring)."""

    def __init__(self, config: FeedConfig, *, is_zero: bool, log: Callable[[str], None] = print,
                 ledger: Callable[..., None] | None = None, beat: Callable[[str], None] | None = None) -> None:
        self.c = config
        self.dir = config.run_dir / ROLLOUTS_DIR
        self.is_zero, self.log, self.ledger, self.beat = is_zero, log, ledger, beat
        self.sizes: list[int] = []  # conversations of rounds 1, 2, ... known so far (markers read)
        self.starts: list[int] = []  # the first sample of each of them
        self.total = 0  # samples in them
        self.answers: dict[int, str | None] = {}  # iteration -> None (ready) or why it cannot run
        self.recorded: set[int] | None = None  # rounds in record.jsonl (rank 0, read once)
        self.seconds: dict[int, float] = {}  # round -> seconds its tokenization took here
        self.interrupted: Callable[[], bool] = lambda: False  # this rank's stop-signal flag, while it waits

    def prefix(self, k: int) -> Path:
        return self.dir / round_stem(self.c.source, k)

    def locate(self, sample: int) -> tuple[int, int] | None:
        """(round, row), both from 0 (round 0 is round-000001); None: that round is not brought in yet."""
        while sample >= self.total:
            k = len(self.sizes) + 1
            marker = read_marker(self.prefix(k))
            if marker is None or not self._referenced(k):
                return None
            self.starts.append(self.total)
            self.sizes.append(int(marker["conversations"]))
            self.total += self.sizes[-1]
            if self.is_zero and self.c.train_iters:  # a feed that brings rounds in (not a reader's)
                self._record(k, marker)
        i = bisect.bisect_right(self.starts, sample) - 1
        return i, sample - self.starts[i]

    def ready(self, iteration: int, interrupted: Callable[[], bool] = lambda: False) -> str | None:
        """Every rank, at the boundary before `iteration`: None when its round is in, else why the segment
        stops (rank 0 has written that down for the others), or INTERRUPTED when the stop signal came during
        the wait (asked again later, the wait goes on)."""
        if iteration > self.c.train_iters:
            return None
        if iteration in self.answers:
            return self.answers[iteration]
        self.interrupted = interrupted
        if self.locate((iteration - 1) * self.c.global_batch) is not None:
            answer = None
        else:
            answer = self._bring(iteration) if self.is_zero else self._await(iteration)
        if answer != INTERRUPTED:
            self.answers[iteration] = answer
        return answer

    def _gate_file(self, iteration: int) -> Path:
        return self.dir / "gates" / f"{self.c.job_id}-{iteration}.json"

    def _await(self, iteration: int) -> str | None:
        """Not rank 0: wait for the round's marker or rank 0's verdict on this iteration."""
        k = len(self.sizes) + 1
        while True:
            if self.locate((iteration - 1) * self.c.global_batch) is not None:
                return None
            verdict = _read_json(self._gate_file(iteration))
            if verdict is not None:
                return str(verdict["reason"])
            if self.interrupted():
                return INTERRUPTED
            self._pulse(f"waiting for rank 0 to bring in rollout round {k}")
            time.sleep(POLL_S)

    def _bring(self, iteration: int) -> str | None:
        """Rank 0: wait for the next round's file, tokenize it, record it; or say why not (gate file)."""
        reason, k = None, len(self.sizes) + 1
        while reason is None and self.locate((iteration - 1) * self.c.global_batch) is None:
            k = len(self.sizes) + 1  # the rounds before the one this iteration reads come first, in order
            if read_marker(self.prefix(k)) is None:
                reason = self._wait_for(k) or self._tokenize(k)
            if reason is None and not self._referenced(k):
                reason = self._score_reference(k)
        if reason is not None:
            self.dir.joinpath("gates").mkdir(parents=True, exist_ok=True)
            _write_json(self._gate_file(iteration), {"iteration": iteration, "round": k, "reason": reason})
            if reason == INTERRUPTED:  # the gate file only frees the others' wait; a later segment waits again
                self.log(f"rollouts: the wait for round {k} gives way to the stop signal")
                return reason
            self.log(f"rollouts: stopping before iteration {iteration}: {reason}")
            if self.ledger is not None:
                self.ledger("rollouts_stop", iteration=iteration, round=k, reason=reason)
        return reason

    def _wait_for(self, k: int) -> str | None:
        if self.c.source.is_file() and k > 1:
            used = self.total
            return (f"the rollouts in {self.c.source} ({used} completions, {used // self.c.global_batch} iterations "
                    f"of global batch {self.c.global_batch}) are used up before train_iters {self.c.train_iters}; "
                    "give a directory of rounds, or lower training.train_iters")
        deadline = time.monotonic() + self.c.wait_s
        if round_source(self.c.source, k) is None:
            self.log(f"rollouts: waiting up to {self.c.wait_s:g} s for round {k} in {self.c.source}")
        while round_source(self.c.source, k) is None:
            if self.interrupted():
                return INTERRUPTED
            if time.monotonic() >= deadline:
                return (f"rollout round {k} ({self.c.source}/{round_stem(self.c.source, k)}.jsonl) did not come "
                        f"within post_training.rollout_wait_s={self.c.wait_s:g} s; megalaunch resume continues "
                        "once the generator wrote it")
            self._pulse(f"waiting for rollout round {k}")
            time.sleep(POLL_S)
        return None

    def _tokenize(self, k: int) -> str | None:
        path = round_source(self.c.source, k)
        assert path is not None
        begin = time.monotonic()
        self._pulse(f"tokenizing rollout round {k}")
        command = [sys.executable, "-m", "megalaunch.cli.main", "data", "rollouts", str(path), "--tokenizer",
                   str(self.c.tokenizer), "--output", str(self.dir), "--name", round_stem(self.c.source, k)]
        command += ["--multiple-of", str(self.c.global_batch)]  # refused before its marker: a marker is a usable round
        if self.c.seq_length:
            command += ["--seq-length", str(self.c.seq_length)]
        code, lines = self._run(command, f"tokenizing rollout round {k}")
        if code is None:
            return INTERRUPTED
        if code != 0:
            why = lines[-1].removeprefix("megalaunch: error: ") if lines else f"exit status {code}"
            return f"rollout round {k} refused: {why}"
        self.seconds[k] = round(time.monotonic() - begin, 2)
        return None

    def _referenced(self, k: int) -> bool:
        """Round k's reference scores are complete, or none are needed."""
        return self.c.reference_model is None or reference_complete(self._reference_dir(k))

    def _reference_dir(self, k: int) -> Path:
        return reference_dir(self.c.run_dir, round_stem(self.c.source, k))

    def _score_reference(self, k: int) -> str | None:
        self._pulse(f"scoring rollout round {k} with the reference")
        command = [sys.executable, "-m", "megalaunch.runtime.flows.rollout_reference", "--prefix", str(self.prefix(k)),
                   "--model", str(self.c.reference_model), "--out", str(self._reference_dir(k)),
                   "--max-tokens", str((self.c.seq_length or 1 << 20) + 1)]
        code, lines = self._run(command, f"scoring rollout round {k} with the reference")
        if code is None:
            return INTERRUPTED
        if code != 0 or not self._referenced(k):
            why = lines[-1] if lines else f"exit status {code}"
            return f"scoring rollout round {k} with the reference {self.c.reference_model} failed: {why}"
        self.log(f"rollouts: round {k}: {lines[-1] if lines else 'reference scored'}")
        return None

    def _record(self, k: int, marker: dict[str, Any]) -> None:
        """Rank 0: round k's line in record.jsonl, once (a round tokenized by a segment that ended before it
        recorded it is recorded by the next one that reads its marker)."""
        if self.recorded is None:
            path = self.dir / RECORD
            lines = path.read_text().splitlines() if path.is_file() else []
            self.recorded = {int(json.loads(x)["round"]) for x in lines if x.strip()}
        if k in self.recorded:
            return
        self.recorded.add(k)
        seconds = self.seconds.get(k)
        first = self.starts[k - 1]  # samples of the rounds before this one
        n, gbs = int(marker["conversations"]), self.c.global_batch
        line = {"round": k, "source": marker["source"], "sha256": marker["source_sha256"], "completions": n,
                "groups": marker["groups"], "first_sample": first, "first_iteration": first // gbs + 1,
                "last_iteration": (first + n) // gbs, "reward_mean": marker["reward_mean"],
                "old_logprobs": marker["old_logprobs"], "tokenized_s": seconds, "job_id": self.c.job_id,
                "time": time.time()}
        with open(self.dir / RECORD, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.log(f"rollouts: round {k} in ({n} completions, iterations {line['first_iteration']}-"
                 f"{line['last_iteration']}, sha256 {str(line['sha256'])[:12]}, tokenized in {seconds} s)")
        if self.ledger is not None:
            self.ledger("rollout_round", **{key: line[key] for key in ("round", "source", "sha256", "completions",
                                                                       "first_iteration", "last_iteration")})

    def _run(self, command: list[str], what: str) -> tuple[int | None, list[str]]:
        """A stage's process, beating the hang watcher while it runs: (exit status or None when the stop
        signal ended it, its output's lines, errors last)."""
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
            while proc.poll() is None:
                if self.interrupted():
                    proc.terminate()
                    proc.wait()
                    return None, []
                self._pulse(what)
                time.sleep(POLL_S)
            out.seek(0)
            return proc.returncode, [x for x in out.read().splitlines() if x.strip()]

    def _pulse(self, what: str) -> None:
        if self.beat is not None:
            self.beat(what)


def read_marker(prefix: Path) -> dict[str, Any] | None:
    return _read_json(Path(str(prefix) + MARKER_SUFFIX))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(path)
