"""Stage outputs are stage inputs (issue 15, item 2): `submit` takes the blend file that `megalaunch
data blend` wrote (`data.blend_file`) or tokenization run directories as data paths; exactly one way of
naming the data; `submit --dry-run` announces the run directory that the real submit creates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.unit.helpers import cli, counter_recipe

from megalaunch.data.writer import write_dataset

SMALL_RUN = "{train_iters: 12, lr_warmup_iters: 1, log_interval: 1}"


def _source(root: Path, name: str, docs_per_file: list[list[list[int]]]) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for i, docs in enumerate(docs_per_file):
        write_dataset(folder / f"part_{i:02d}", docs)
    return folder


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path]:
    return (_source(tmp_path / "data", "web", [[[1, 2, 3], [4]], [[5] * 10]]),
            _source(tmp_path / "data", "code", [[[7, 8]], [[9] * 6, [1]]]))


def _runs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _fails_in_one_line(proc, *needles: str) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_data_blend_output_submits_and_freezes_byte_for_byte(tmp_path: Path, sources: tuple[Path, Path]) -> None:
    web, code = sources
    blend_file = tmp_path / "mix.txt"
    made = cli("data", "blend", str(code), str(web), "--weights", "0.3", "0.7", "--output", str(blend_file))
    assert made.returncode == 0, made.stderr
    recipe = counter_recipe(tmp_path, training=SMALL_RUN,
                            data=f"{{mock: false, blend_file: {blend_file}, tokenizer_type: NullTokenizer, "
                                 "vocab_size: 512}")
    proc = cli("submit", str(recipe))
    assert proc.returncode == 0, proc.stderr
    (run,) = _runs(tmp_path / "runs")
    assert (run / "data_blend.txt").read_bytes() == blend_file.read_bytes()
    manifest = json.loads((run / "manifest.json").read_text())
    sha = next(x for x in made.stdout.splitlines() if "sha256 " in x).split("sha256 ")[1].split(",")[0]
    assert f"next: megalaunch submit RECIPE --set data.blend_file={blend_file}" in made.stdout
    assert manifest["data_blend_sha256"] == sha
    assert {p for _, p in zip(*[iter((run / "data_blend.txt").read_text().split())] * 2, strict=True)} == {
        str(web / "part_00"), str(web / "part_01"), str(code / "part_00"), str(code / "part_01")}


def test_a_hand_written_blend_file_is_sorted_and_its_relative_prefixes_anchored(tmp_path: Path,
                                                                                sources: tuple[Path, Path]) -> None:
    from megalaunch.data.blend import load_blend_file, resolve_blend

    web, code = sources
    f = tmp_path / "data" / "hand.txt"
    f.write_text("2 web/part_01\n1 code/part_00\n")
    blend = load_blend_file(f)
    assert blend.prefixes == ((str(code / "part_00"), 1.0), (str(web / "part_01"), 2.0))
    assert blend.text == resolve_blend([(str(code / "part_00"), 1.0), (str(web / "part_01"), 2.0)]).text


@pytest.mark.parametrize(("data", "needles"), [
    ("{mock: false, blend: [{path: DATA/web}], blend_file: DATA/b.txt}", ["data.blend and data.blend_file"]),
    ("{mock: false}", ["data.blend", "data.blend_file", "data.mock"]),
    ("{mock: false, blend_file: DATA/nope.txt}", ["data.blend_file", "nope.txt does not exist",
                                                   "megalaunch data blend"]),
    ("{mock: false, blend_file: DATA/odd.txt}", ["data.blend_file", "odd number of words"]),
    ("{mock: false, blend_file: DATA/neg.txt}", ["data.blend_file", "must be positive"]),
    ("{mock: false, blend_file: DATA/gone.txt}", ["data", "gone.idx is missing"]),
])
def test_one_way_of_naming_the_data_and_a_sound_blend_file(tmp_path: Path, sources: tuple[Path, Path],
                                                           data: str, needles: list[str]) -> None:
    d = tmp_path / "data"
    (d / "b.txt").write_text(f"1 {d}/web/part_00\n")
    (d / "odd.txt").write_text(f"1 {d}/web/part_00 2\n")
    (d / "neg.txt").write_text(f"-1 {d}/web/part_00\n")
    (d / "gone.txt").write_text(f"1 {d}/gone\n")
    recipe = counter_recipe(tmp_path, data=data.replace("DATA", str(d)))
    for args in (["--dry-run"], []):
        _fails_in_one_line(cli("submit", str(recipe), *args), *needles)
    assert _runs(tmp_path / "runs") == []  # nothing written


def _tokenization_run(root: Path, dumps: int, done: int, output: Path) -> Path:
    """What `tokenize plan` + finished dumps leave: plan.json, recipe.yaml, one summary per done dump."""
    run = root / "tok"
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"dumps": [{"index": i, "bytes": 1, "tasks": []}
                                                         for i in range(dumps)]}))
    (run / "recipe.yaml").write_text(f"output_dir: {output}\n")
    for i in range(done):
        (run / "dumps" / f"dump_{i:04d}").mkdir(parents=True)
        (run / "dumps" / f"dump_{i:04d}" / "summary.json").write_text("{}")
    return run


def test_a_tokenization_run_directory_is_a_data_path(tmp_path: Path, sources: tuple[Path, Path]) -> None:
    from megalaunch.data.blend import resolve_blend
    from megalaunch.errors import PreflightError

    web, _ = sources
    run = _tokenization_run(tmp_path, dumps=2, done=2, output=web)
    assert resolve_blend([(str(run), None)]).text == resolve_blend([(str(web), None)]).text
    (run / "dumps" / "dump_0001" / "summary.json").unlink()
    with pytest.raises(PreflightError, match=r"is not finished: 1 of 2 dumps done.*tokenize submit"):
        resolve_blend([(str(run), None)])


def test_dry_run_announces_the_directory_the_submit_creates(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, training=SMALL_RUN)
    names = []
    for _ in range(2):  # the second run under the same root gets a name of its own, announced alike
        dry = cli("submit", str(recipe), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        announced = next(line.split("would create ", 1)[1] for line in dry.stdout.splitlines()
                         if line.startswith("would create "))
        real = cli("submit", str(recipe))
        assert real.returncode == 0, real.stderr
        created = next(line.split("run directory: ", 1)[1] for line in real.stdout.splitlines()
                       if line.startswith("run directory: "))
        assert announced == created
        assert Path(created).is_dir()
        names.append(created)
    assert names[0] != names[1]
    assert [str(p) for p in _runs(tmp_path / "runs")] == sorted(names)


# --- a frozen blend stays frozen (issue 15, item 3) -----------------------------------------------------

@pytest.fixture
def frozen_run(tmp_path: Path, sources: tuple[Path, Path]) -> Path:
    from megalaunch.config.loader import load_recipe
    from megalaunch.data.blend import resolve_blend
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    blend_file = tmp_path / "blend.txt"
    resolve_blend([(str(p), None) for p in sources]).write(blend_file)
    loaded = load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "data.mock=false",
                                  f"data.blend_file={blend_file}"])
    return write_run(prepare_run(loaded)).root


@pytest.mark.parametrize("where", ["data_blend.txt", "blend2.txt", "checkpoints/x.txt", "new/dir/x.txt"])
def test_data_blend_refuses_to_write_into_a_run_directory(frozen_run: Path, sources: tuple[Path, Path],
                                                          where: str) -> None:
    import os

    frozen = frozen_run / "data_blend.txt"
    before = (frozen.read_bytes(), os.stat(frozen).st_mode, sorted(p.name for p in frozen_run.iterdir()))
    target = frozen_run / where
    proc = cli("data", "blend", str(sources[0]), "--output", str(target))
    _fails_in_one_line(proc, "--output", str(frozen_run), "frozen", f"megalaunch resume {frozen_run} --set")
    assert (frozen.read_bytes(), os.stat(frozen).st_mode, sorted(p.name for p in frozen_run.iterdir())) == before
    assert target == frozen or not target.exists()
    mixed = cli("data", "mix", "--folders", *map(str, sources), "--weights", "1", "1", "--output",
                str(frozen_run / "mix"))
    _fails_in_one_line(mixed, "--output", "frozen")
    assert not (frozen_run / "mix").exists()


def test_data_blend_writes_outside_run_directories(tmp_path: Path, frozen_run: Path,
                                                   sources: tuple[Path, Path]) -> None:
    out = frozen_run.parent / "next-blend.txt"  # next to a run, not in it
    proc = cli("data", "blend", str(sources[0]), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("4 ")


@pytest.mark.parametrize("command", ["blend", "mix"])
def test_data_blend_and_mix_help_look_like_every_other_command(command: str) -> None:
    ours, reference = cli("data", command, "--help"), cli("submit", "--help")
    assert ours.returncode == 0 == reference.returncode
    import re

    for marker in (r"Usage: ", r"╭─ Options ", r"--help +-h +Show this message and exit\."):
        assert re.search(marker, reference.stdout)
        assert re.search(marker, ours.stdout), ours.stdout
    assert "--weights" in ours.stdout and "usage: data" not in ours.stdout  # not argparse's
    assert cli("data", command, "-h").stdout == ours.stdout
