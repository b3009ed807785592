"""The chain's first and last stages of `submit --from-hf --data` (launcher/chain/first_stage.py,
last_stage.py): chat files tokenized in the job with the run's tokenizer and frozen as the blend (a bad row
past the first, which submit does not read, stops the chain naming it; fixed, the stage runs again; done,
it never reruns), the export's record and what status says of it; and `submit` refusing bad inputs with
its one line only, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalaunch.cli.main import main
from megalaunch.launcher.chain import last_stage
from megalaunch.launcher.chain.first_stage import tokenize_chats
from megalaunch.launcher.status_format import format_run_status
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths

ROW = {"messages": [{"role": "user", "content": "red cat"}, {"role": "assistant", "content": "cat red"}]}


def test_chat_files_become_the_runs_frozen_blend_once(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.support.chat import make_chat_tokenizer

    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    make_chat_tokenizer(paths.tokenizer)
    paths.manifest.write_text(json.dumps({"trusted_sha256": {"run.yaml": "x"}, "data_blend_sha256": None}))
    chats = tmp_path / "chats" / "c.jsonl"
    chats.parent.mkdir()
    chats.write_text(json.dumps(ROW) + "\n" + json.dumps({"text": "no conversation"}) + "\n")
    failed = tokenize_chats(paths, str(chats.parent), "1", print)
    assert failed is not None and "row 2: neither 'messages' nor 'prompt'/'response'" in failed.reason
    assert "\n" not in failed.reason and f"megalaunch resume {paths.root}" in failed.fix
    assert not paths.data_blend.exists()

    chats.write_text("".join(json.dumps(ROW) + "\n" for _ in range(3)))
    assert tokenize_chats(paths, str(chats.parent), "2", print) is None
    records = [r for r in read_jsonl(paths.ledger) if r["event"] == "data_prepared"]
    assert [r["ok"] for r in records] == [False, True] and records[1]["output"] == str(paths.root / "sft_data")
    manifest = read_json(paths.manifest)
    blend = paths.data_blend.read_text()
    assert str(paths.root / "sft_data" / "c") in blend and (paths.root / "sft_data" / "c.mask").is_file()
    assert manifest["data_blend_sha256"] == manifest["trusted_sha256"]["data_blend.txt"] == records[1]["blend_sha256"]
    assert manifest["trusted_sha256"]["run.yaml"] == "x"
    assert tokenize_chats(paths, "/nowhere", "3", print) is None  # done: never again


def test_a_failed_export_is_recorded_with_its_retry_and_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    monkeypatch.setattr(last_stage, "run_stage", lambda command: (False, "no complete checkpoint in RUN", 0.4))
    assert last_stage.export_hf(paths, "7", print) is False
    record = next(r for r in read_jsonl(paths.ledger) if r["event"] == "exported")
    assert (record["ok"], record["error"]) == (False, "no complete checkpoint in RUN")
    assert record["fix"] == f"megalaunch convert mcore-to-hf {paths.root} --out {paths.root / 'hf'} --no-progress --overwrite"
    base = {"chain_name": "r", "backend": "local", "run_dir": str(paths.root), "chain_state": "stopped",
            "stop_reason": None, "iteration": 4, "target": 4, "last_checkpoint": 4, "tokens_per_s": None,
            "loss": None, "pending_triggers": [], "consumed_triggers": 0, "last_guard": None, "slurm_error": None,
            "segments": []}
    assert f"Hugging Face export failed: no complete checkpoint in RUN; retry: {record['fix']}" in \
        format_run_status({**base, "exported": record})
    ok = {"ok": True, "output": str(paths.root / "hf"), "iteration": 4}
    assert f"Hugging Face model: {paths.root / 'hf'} (iteration 4)" in format_run_status({**base, "exported": ok})


@pytest.mark.parametrize(("flags", "expected"), [
    (["--from-hf", "MISSING"], "megalaunch: error: --from-hf: MISSING is not a directory"),
    (["--data", "MISSING"], "megalaunch: error: --data: MISSING does not exist"),
    (["--data", "EMPTY"], "megalaunch: error: --data: EMPTY holds no chat files"),
])
def test_submit_refuses_bad_inputs_with_one_line_and_writes_nothing(tmp_path: Path, flags: list[str], expected: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    names = {"MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty")}
    flags = [names.get(f, f) for f in flags]
    with pytest.raises(SystemExit) as exited:
        main(["submit", "sft-llama3-1b", *flags, "--set", f"run.root={tmp_path / 'runs'}"])
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert exited.value.code != 0 and len(lines) == 1, out
    assert lines[0].startswith(expected.replace("MISSING", names["MISSING"]).replace("EMPTY", names["EMPTY"]))
    assert "fix:" in lines[0] and not (tmp_path / "runs").exists()
