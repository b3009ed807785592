"""Bad input: one line naming the field and the fix, non-zero exit, no traceback, no run directory,
no job. `sbatch` and `sinfo` are stand-ins here that only record being called (a unit test of
the CLI's validation; the real Slurm is exercised in tests/slurm)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tests.unit.helpers import cli

BASE = """include: [tiny]
name: bad
run: {{root: {root}}}
"""

# (id, recipe body appended to BASE, extra CLI args, text that must appear in the error line)
CASES: list[tuple[str, str, list[str], str]] = [
    ("top-level typo", "modle: {num_layers: 2}\n", [], "did you mean 'model'"),
    ("model typo", "model: {num_layer: 2}\n", [], "model.num_layer"),
    ("training typo via --set", "", ["--set", "training.lrr=1e-3"], "did you mean 'lr'"),
    ("cluster typo", "cluster: {partiton: gpu}\n", [], "did you mean 'partition'"),
    ("startup timeout not positive", "", ["--set", "chain.startup_timeout_s=0"],
     "chain.startup_timeout_s must be > 0 seconds"),
    ("hang timeout negative", "chain: {hang_timeout_s: -5}\n", [], "fix: --set chain.hang_timeout_s=1800"),
    ("nested container typo", "cluster: {container: {imag: x}}\n", [], "cluster.container.imag"),
    ("int wrong type", "model: {num_layers: two}\n", [], "model.num_layers"),
    ("float wrong type", "", ["--set", "training.lr=fast"], "training.lr"),
    ("bool wrong type", "model: {swiglu: maybe}\n", [], "model.swiglu"),
    ("literal wrong value", "training: {precision: bf32}\n", [], "training.precision"),
    ("list wrong type", "cluster: {modules: cuda}\n", [], "cluster.modules"),
    ("world not divisible", "cluster: {tasks_per_node: 3}\nparallel: {tensor_model_parallel_size: 2}\n", [],
     "parallel"),
    ("global batch not divisible", "cluster: {tasks_per_node: 2}\ntraining: {global_batch_size: 3}\n", [],
     "training.global_batch_size"),
    ("heads not divisible by TP", "cluster: {tasks_per_node: 8}\nparallel: {tensor_model_parallel_size: 8}\n",
     [], "tensor_model_parallel_size"),
    ("layers not divisible by PP", "cluster: {tasks_per_node: 3}\nparallel: {pipeline_model_parallel_size: 3}\n"
     "training: {global_batch_size: 9}\n", [], "pipeline_model_parallel_size"),
    ("VPP without PP", "parallel: {virtual_pipeline_model_parallel_size: 2}\n", [],
     "virtual_pipeline_model_parallel_size"),
    ("sequence parallel without TP", "parallel: {sequence_parallel: true}\n", [], "sequence_parallel"),
    ("EP without experts", "parallel: {expert_model_parallel_size: 2}\n", [], "expert_model_parallel_size"),
    ("seq longer than positions", "model: {seq_length: 128}\n", [], "model.seq_length"),
    ("time limit too short", 'cluster: {time: "00:00:20"}\ncheckpoint: {save_time_estimate_s: 60}\n', [],
     "cluster.time"),
    ("missing data prefix", "data: {mock: false, blend: [{path: /nonexistent/corpus_text_document}]}\n", [],
     "data"),
    ("secret W&B key in env", "cluster: {env: {WANDB_API_KEY: 0123456789abcdef0123456789abcdef01234567}}\n", [],
     "cluster.env.WANDB_API_KEY"),
    ("secret token in megatron_args", "megatron_args: {hf_token: hf_abcdefghijklmnopqrstuvwxyz0123}\n", [],
     "megatron_args.hf_token"),
    ("unknown recipe", None, ["llama9-900b"], "not found"),  # type: ignore[list-item]
    ("bad --set syntax", "", ["--set", "training.lr"], "KEY=VALUE"),
    ("invalid YAML", "model: {num_layers: [1, 2\n", [], "not valid YAML"),
    ("name with spaces", "", ["--name", "my run"], "name"),
    ("zero nodes", "cluster: {nodes: 0}\n", [], "cluster.nodes"),
    ("local backend on two nodes", "cluster: {nodes: 2}\n", [], "cluster.nodes"),
    ("unknown group", "", ["--set", "run.group=no-such-group-xyz"], "run.group"),
    ("sdpa with context parallel", "cluster: {tasks_per_node: 2}\nparallel: {context_parallel_size: 2}\n"
     "training: {attention: sdpa}\n", [], "training.attention"),
    ("no data at all", "data: {mock: false}\n", [], "data.blend"),
    ("null tokenizer without vocab", "data: {vocab_size: null}\n", [], "data.vocab_size"),
    ("unsafe #SBATCH value", "cluster: {backend: slurm, gpus_per_node: 0, partition: 'gpu\nrm -rf /'}\n", [],
     "cluster.partition"),
    ("managed sbatch option", "cluster: {backend: slurm, gpus_per_node: 0, sbatch_extra: {time: '1:00'}}\n", [],
     "cluster.sbatch_extra.time"),
    ("missing local tokenizer", "data: {tokenizer_type: HuggingFaceTokenizer, tokenizer_model: /nope/tok.json}\n",
     [], "data.tokenizer_model"),
    ("repeated top-level key", "include: [models/nope]\n", [], "'include' appears twice"),
    ("bad env var name", "cluster: {env: {'A-B': x}}\n", [], "cluster"),
    ("bad time format", 'cluster: {time: "ten hours"}\n', [], "time"),
    ("precision on CPU", "training: {precision: bf16}\n", [], "training.precision"),
    ("async save on CPU", "checkpoint: {async_save: true}\n", [], "checkpoint.async_save"),
    ("secret_env not exported", "cluster: {backend: slurm, gpus_per_node: 0, secret_env: [ML_TEST_UNSET_KEY]}\n",
     [], "cluster.secret_env"),
    ("webhook_env not exported", "cluster: {backend: slurm, gpus_per_node: 0}\n"
     "chain: {notify: {webhook_env: [ML_TEST_UNSET_HOOK]}}\n", [], "chain.notify.webhook_env"),
    ("webhook URL with its token", "chain: {notify: {webhooks: ['https://hooks.slack.com/services/T0/B0/x']}}\n",
     [], "chain.notify.webhooks[0]"),
    ("mail_user not an address", "cluster: {backend: slurm, gpus_per_node: 0, mail_user: 'me at home'}\n", [],
     "cluster.mail_user"),
]


@pytest.fixture()
def fake_slurm(tmp_path: Path) -> tuple[Path, Path]:
    """sbatch/sinfo stand-ins that record any call."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "sbatch-called"
    for name, body in (("sbatch", f"touch {marker}\necho 4242"), ("sinfo", "echo slurm 22.05.8")):
        f = bindir / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bindir, marker


def _assert_clean_failure(proc, must: str, root: Path, marker: Path) -> None:
    assert proc.returncode != 0, proc.stdout
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err_lines) == 1, proc.stderr
    line = err_lines[0]
    assert line.startswith("megalaunch: error:"), line
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout.strip() == "", proc.stdout  # the refusal is the only thing printed (issue 37)
    assert must in line, line
    assert not root.exists() or not any(root.iterdir()), list(root.iterdir())
    assert not marker.exists(), "a job was submitted"


@pytest.mark.parametrize(("case_id", "body", "args", "must"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_cleanly(case_id: str, body: str | None, args: list[str], must: str, tmp_path: Path,
                                 fake_slurm: tuple[Path, Path]) -> None:
    bindir, marker = fake_slurm
    root = tmp_path / "runs"
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    if body is None:
        proc = cli("submit", *args, env=env)
    else:
        recipe = tmp_path / "bad.yaml"
        text = BASE.format(root=root) + body
        recipe.write_text(text)
        proc = cli("submit", str(recipe), *args, env=env)
    _assert_clean_failure(proc, must, root, marker)


def test_at_least_thirty_cases() -> None:
    assert len(CASES) + 2 >= 30


def test_missing_include(tmp_path: Path, fake_slurm: tuple[Path, Path]) -> None:
    bindir, marker = fake_slurm
    root = tmp_path / "runs"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: [tiny, models/nope]\nname: x\nrun: {{root: {root}}}\n")
    proc = cli("submit", str(recipe), env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    _assert_clean_failure(proc, "not found", root, marker)


def test_unwritable_run_root(tmp_path: Path, fake_slurm: tuple[Path, Path]) -> None:
    bindir, marker = fake_slurm
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: [tiny]\nname: x\nrun: {{root: {blocker}/runs}}\n")
    proc = cli("submit", str(recipe), env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    _assert_clean_failure(proc, "run.root", tmp_path / "nothing", marker)
    assert blocker.read_text() == "not a directory"


def test_slurm_not_installed(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: [tiny]\nname: x\nrun: {{root: {root}}}\ncluster: {{backend: slurm, gpus_per_node: 0}}\n")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = cli("submit", str(recipe), env={"PATH": str(empty)})
    _assert_clean_failure(proc, "Slurm is not installed", root, tmp_path / "never")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = cli("--debug", "submit", "llama9-900b")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


def _dataset(prefix: Path) -> None:
    from megalaunch.data.writer import IndexedWriter

    w = IndexedWriter(prefix, dtype="uint16")
    w.add_batch([[1, 2, 3], [4, 5]])
    w.close()


def test_blend_dtype_too_small_for_the_tokenizer(tmp_path: Path, fake_slurm: tuple[Path, Path]) -> None:
    bindir, marker = fake_slurm
    _dataset(tmp_path / "corpus_text_document")
    root = tmp_path / "runs"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: [tiny]\nname: x\nrun: {{root: {root}}}\n"
                      f"data: {{mock: false, vocab_size: 70000, blend: [{{path: {tmp_path}}}]}}\n")
    proc = cli("submit", str(recipe), env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    _assert_clean_failure(proc, "data.blend", root, marker)
    assert "uint16" in proc.stderr
    ok = cli("submit", str(recipe), "--set", "data.vocab_size=1000", "--dry-run")
    assert ok.returncode == 0, ok.stderr  # the same blend with a fitting vocabulary passes
