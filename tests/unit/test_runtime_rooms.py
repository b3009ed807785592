"""The runtime's rooms (docs/architecture.md, "The runtime's rooms"): each is handed only what it
needs and knows nothing of the others; no import circle inside the runtime, not even one only a type
checker follows; small files. Plus what each room decides on its own: the step boundary, the save
hook, retention after a save."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.unit.test_architecture import SRC, _graph

from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import Decision
from megalaunch.runtime.checkpoint import resume
from megalaunch.runtime.checkpoint.checkpoints import CheckpointConfig, Checkpoints
from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.session import Session
from megalaunch.runtime.stop.decisions import at_boundary
from megalaunch.runtime.stop.signals import SignalFlag

RUNTIME = SRC / "megalaunch" / "runtime"
ROOMS = {"stop.decisions", "checkpoint.checkpoints", "observation.observe", "stop.stop_window"}
MAX_LINES = 350


def _runtime_graph() -> dict[str, set[str]]:
    """Imports between runtime modules, `if TYPE_CHECKING:` ones included."""
    prefix = "megalaunch.runtime."
    return {m[len(prefix):]: {t[len(prefix):] for t in targets if t.startswith(prefix)}
            for m, targets in _graph(type_only=True).items() if m.startswith(prefix)}


def test_no_import_circle_in_the_runtime_even_for_the_type_checker() -> None:
    graph = _runtime_graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_the_rooms_know_nothing_of_each_other_nor_of_the_session() -> None:
    graph = _runtime_graph()
    for room in ROOMS:
        assert graph[room] & ((ROOMS - {room}) | {"session", "train", "loop.megatron_seams"}) == set(), (room, graph[room])
    assert "session" not in graph["loop.step"] and "train" not in graph["loop.step"]


def test_runtime_files_are_small() -> None:
    sizes = {p.relative_to(RUNTIME).as_posix(): len(p.read_text().splitlines()) for p in RUNTIME.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


@pytest.mark.parametrize(("decision", "iteration", "save_now", "leave", "abort", "kind"), [
    (Decision.CONTINUE, 10, False, False, False, "periodic"),
    (Decision.SAVE, 7, True, False, False, "trigger"),
    (Decision.SAVE, 10, False, False, False, "trigger"),  # Megatron's own save at the interval serves it
    (Decision.SIGNAL, 7, False, True, False, "stop"),
    (Decision.EXIT, 10, False, True, False, "stop"),
    (Decision.ABORT, 7, False, True, True, "periodic"),
])
def test_what_a_decision_asks_at_the_step_boundary(decision: Decision, iteration: int, save_now: bool,
                                                   leave: bool, abort: bool, kind: str) -> None:
    b = at_boundary(decision, iteration, save_interval=10)
    assert (b.save_now, b.leave, b.abort, b.save_kind) == (save_now, leave, abort, kind)
    assert at_boundary(Decision.SAVE, 10, save_interval=0).save_now  # no interval: every save trigger saves


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "7")
    paths = RunPaths(tmp_path)
    for d in (paths.triggers, paths.state, paths.checkpoints):
        d.mkdir(parents=True, exist_ok=True)
    flag = SignalFlag()
    yield Session(paths, RuntimeSettings(train_iters=100, save_interval=10, keep_last=1), flag, rank=0, world=1)
    flag.restore()


def test_a_save_the_checkpoints_room_declines_is_not_reported(session: Session,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-save hook's answer is the session's: a declined save reaches no other room."""
    beats: list[str] = []
    monkeypatch.setattr(session.observe.timeline.heartbeat, "beat", lambda what, **kw: beats.append(what))
    monkeypatch.setattr(session.checkpoints, "before_save", lambda iteration, kind: kind != "periodic")
    assert not session.before_save(10, "periodic") and beats == []
    assert session.before_save(13, "stop") and beats == ["save_start"]


def _legacy(paths: RunPaths, iteration: int) -> None:
    d = resume.iter_dir(paths, iteration) / "mp_rank_00"
    d.mkdir(parents=True)
    (d / "model_optim_rng.pt").write_bytes(b"weights")
    paths.tracker.write_text(f"{iteration}\n")


def test_after_a_save_the_checkpoint_resumed_from_goes_once_a_newer_one_is_complete(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """keep_last 1: the segment resumed from 20; once 40 is complete, 20 is an old checkpoint like any other."""
    paths = RunPaths(tmp_path)
    paths.state.mkdir(parents=True)
    for i in (10, 20):
        _legacy(paths, i)
    room = Checkpoints(RankContext(paths, 0, 1, "9"), CheckpointConfig(keep_last=1))
    room.resumed_from = 20
    room.loaded(20, 160)  # segment start: retention, the loaded one kept
    assert resume.checkpoint_iterations(paths) == [20]
    _legacy(paths, 40)
    assert room.before_save(40, "periodic")
    room.after_save(40, room.save_finished())
    assert resume.checkpoint_iterations(paths) == [40] and len(room.save_times) == 1
    out = capsys.readouterr().out
    assert "retention: deleted checkpoints [10]" in out and "retention: deleted checkpoints [20]" in out
    assert [e["iteration"] for e in read_jsonl(paths.ledger) if e["event"] == "checkpoint_deleted"] == [10, 20]


def test_other_ranks_leave_retention_to_rank_0(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    for i in (10, 20):
        _legacy(paths, i)
    room = Checkpoints(RankContext(paths, 1, 2, "9"), CheckpointConfig(keep_last=1))
    room.before_save(20, "periodic")
    room.after_save(20, room.save_finished())
    assert resume.checkpoint_iterations(paths) == [10, 20] and not paths.ledger.exists()
