"""Issue 15's acceptance: one journey from raw text to a Hugging Face model on the real Slurm cluster,
driven through the CLI as a new user would. Wherever a stage prints `next: megalaunch ...`, exactly
that command runs next:

raw jsonl + parquet in four folders, a local byte-level BPE `tokenizer.json`
-> `tokenize plan` -> `tokenize submit` (ONE job array) -> `tokenize status` until every dump is done
-> `data check OUTPUT --tokenizer TOK` -> `data blend OUTPUT --output blend.txt`
-> `submit RECIPE --set data.blend_file=.../blend.txt` (the recipe: `tiny` with
   `data.tokenizer_model` = the same tokenizer.json, 2-minute segments, periodic saves)
-> the chain stops on Slurm's time-limit warning at least once and finishes in a later segment
-> `status RUN` prints `convert mcore-to-hf RUN --out RUN/hf` -> that command
-> transformers loads model and tokenizer from (a copy of) that directory alone, generates, and its
   loss on held-out documents (never tokenized for training) is within 10 % of the last training loss.

Timing (2-core machine): lead = save 5 + step 1 + Slurm's check period 30 + margin 14 = 50 s, so
in a 120 s segment USR2 arrives 40..70 s after the segment starts. Iterations are paced by the
trainer's test hook (STEP_SLEEP_S after each step), so a segment trains at most ~65 s / 0.5 s = 130
iterations: TRAIN_ITERS = 140 cannot finish in one segment, whatever the machine's load.
A segment's start-up (job begin, Python, Megatron, the checkpoint load) takes 20-30 s here, so a
segment typically trains 40-60 iterations and the chain has 3 segments (2 on a quiet machine). The
pacing sets the segments' count; the slower it is, the fewer iterations a segment burns waiting for
its warning (each ~0.2 CPU-s: 0.2 s and 350 iterations cost ~45 CPU-s more a CI run).
Measured wall time ~175 s: tokenization ~5 s, the chain ~155 s, status + conversion ~8 s,
transformers ~5 s."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import TERMINAL_STATES, job_state, queue_ids, run_as, wait_for
from launch import MEGALAUNCH, REPO, job_megalaunch, ledger, run_dir_of, trainer_python
from tests.support.corpus import documents, train_bpe_tokenizer

from megalaunch.runtime.rank.dist_env import free_port

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in
                           ("torch", "megatron", "datatrove", "tokenizers", "transformers", "pyarrow")),
                       reason="needs the [train], [tokenize] and [convert] extras"),
]

SOURCES = {"web": "jsonl", "forum": "jsonl", "books": "parquet", "wiki": "parquet"}
FILES_PER_SOURCE = 2
DOCS_PER_FILE = 125  # 1,000 documents, ~1 MB, ~320k tokens: TRAIN_ITERS x 512 tokens is less than a quarter epoch
HELD_OUT_DOCS = 40   # generated from the same stream, never written to the corpus
VOCAB = 512
EOS = "<|endoftext|>"

STEP_SLEEP_S = 0.5
TRAIN_ITERS = 140
SAVE_INTERVAL = 50
LOG_INTERVAL = 5
SEQ = 64  # the tiny model's seq_length
CHAIN_TIMEOUT_S = 480

SAVED_LINE = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) ")


def cli(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`megalaunch ARGS` as a user on the login node; PYTHONPATH makes it (and the jobs it submits, which
    inherit the environment) run this checkout's code, not the one the venv's editable install names."""
    env = {"XDG_STATE_HOME": str(cwd / ".state-root"), "PYTHONPATH": str(REPO / "src")}
    proc = run_as(None, [MEGALAUNCH, *args], env, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, f"megalaunch {shlex.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def next_command(output: str, command: str) -> list[str]:
    """The arguments of the `next: megalaunch COMMAND ...` line a stage printed (possibly after other text
    on the same line, as `tokenize submit` prints `every dump is done; next: ...`)."""
    for line in output.splitlines():
        _, sep, rest = line.partition("next: megalaunch ")
        if sep and rest.startswith(command):
            return shlex.split(rest)
    raise AssertionError(f"no `next: megalaunch {command} ...` line in:\n{output}")


def write_corpus(root: Path, docs: list[str]) -> None:
    """Four source folders, two jsonl and two parquet, two files each, {"id", "text"} records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    it = iter(docs)
    for source, fmt in SOURCES.items():
        folder = root / source
        folder.mkdir(parents=True)
        for f in range(FILES_PER_SOURCE):
            rows = [{"id": f"{source}-{f}-{d}", "text": next(it)} for d in range(DOCS_PER_FILE)]
            if fmt == "jsonl":
                (folder / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            else:
                pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{f}.parquet")
    assert next(it, None) is None


def write_recipes(tmp: Path, tokenizer: Path) -> tuple[Path, Path]:
    tokenize = {
        "name": "journey",
        "inputs": {"roots": [str(tmp / "raw")], "filter_in": ["*.jsonl", "*.parquet"], "text_key": "text"},
        "tokenizer": {"path": str(tokenizer), "eos": EOS, "batch_size": 100},
        "n_dumps": 2, "tasks": 2, "workers": 1, "backend": "slurm",
        "slurm": {"time": "00:05:00", "max_concurrent": 2, "python": trainer_python()},
    }
    train = {
        "include": ["tiny"], "name": "journey",
        "run": {"root": str(tmp / "runs")},
        "data": {"mock": False, "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tokenizer)},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:02:00", "python": trainer_python(), "megalaunch": job_megalaunch(), "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": str(STEP_SLEEP_S), "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": TRAIN_ITERS, "log_interval": LOG_INTERVAL, "lr_warmup_iters": 10},
        "checkpoint": {"save_interval": SAVE_INTERVAL, "save_time_estimate_s": 5, "keep_last": 10},
        # lead = save 5 + step 1 + check period 30 + margin 14 = 50 s; 120 - 50 - 30 = 40 s >= 30 s of training
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 14, "min_train_time_s": 30},
    }
    paths = []
    for name, recipe in (("tokenize.yaml", tokenize), ("train.yaml", train)):
        path = tmp / name
        path.write_text(yaml.safe_dump(recipe))
        path.chmod(0o644)
        paths.append(path)
    return paths[0], paths[1]


def _events(run: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in ledger(run) if e["event"] == event]


def _segment_log(run: Path, job_id: str) -> str:
    path = run / "logs" / f"{run.name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def held_out_loss(model: Any, tokenizer: Any, texts: list[str]) -> tuple[float, int]:
    """Mean next-token loss over the held-out documents, tokenized as training saw its data: each
    document's tokens then EOS, all concatenated, cut into SEQ-token sequences."""
    import torch

    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(stream) // SEQ
    batch = torch.tensor(stream[:n * SEQ]).view(n, SEQ)
    with torch.no_grad():
        logits = model(input_ids=batch).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return float(loss), n * (SEQ - 1)


@pytest.mark.slow
@pytest.mark.timeout(CHAIN_TIMEOUT_S + 300)
def test_raw_text_to_hugging_face_model_through_the_cli(slurm_tmp: Path) -> None:
    tmp = slurm_tmp
    clock = [("start", time.monotonic())]  # stage timings, printed at the end
    # --- 1. raw text and a local byte-level BPE tokenizer ------------------------------------------
    n_train = len(SOURCES) * FILES_PER_SOURCE * DOCS_PER_FILE
    docs = list(documents(n_train + HELD_OUT_DOCS, seed=15, mean_words=120))
    train_docs, held_out = docs[:n_train], docs[n_train:]
    write_corpus(tmp / "raw", train_docs)
    tokenizer_json = train_bpe_tokenizer(tmp / "tok" / "tokenizer.json", train_docs[:300], vocab_size=VOCAB, eos=EOS)
    tokenize_recipe, train_recipe = write_recipes(tmp, tokenizer_json)

    # --- 2. tokenization: plan -> submit (one job array) -> status until done -> check -> blend ------
    planned = cli("tokenize", "plan", str(tokenize_recipe), "--run-dir", str(tmp / "tokrun"), cwd=tmp)
    assert f"planned {len(SOURCES) * FILES_PER_SOURCE} input files" in planned.stdout, planned.stdout
    submitted = cli(*next_command(planned.stdout, "tokenize submit"), cwd=tmp)
    match = re.search(r"submitted job array (\d+) \(2 dumps\)", submitted.stdout)
    assert match, submitted.stdout
    array = match.group(1)
    status_cmd = next_command(submitted.stdout, "tokenize status")
    assert status_cmd[-1] == "--follow"  # following blocks until done; poll the one-shot status instead
    statuses: list[str] = []

    def tokenized() -> bool:
        out = cli(*status_cmd[:-1], cwd=tmp).stdout
        statuses.append(out)
        assert "failed" not in out and "cancelled" not in out, out
        return "next: megalaunch data check" in out

    wait_for(tokenized, 180, interval=2, what="every dump of the tokenization array to be done")
    assert "2/2 dumps" in statuses[-1] and f"{n_train:,} documents" in statuses[-1], statuses[-1]
    for task in ("0", "1"):  # both dumps ran as tasks of that one array and end well (a task whose dump is
        # written may still be in its epilogue for a moment: RUNNING/COMPLETING, then COMPLETED)
        wait_for(lambda t=task: job_state(f"{array}_{t}") in TERMINAL_STATES | {"GONE"}, 60, interval=1,
                 what=f"array task {array}_{task} to leave the queue")
        assert job_state(f"{array}_{task}") in ("COMPLETED", "GONE")
    assert {p.name for p in (tmp / "tokrun" / "logs").iterdir()} == {f"tok-journey-{array}_0.out",
                                                                    f"tok-journey-{array}_1.out"}

    clock.append(("tokenization", time.monotonic()))
    check_cmd = next_command(statuses[-1], "data check")
    assert check_cmd == ["data", "check", str(tmp / "tokrun" / "output"), "--tokenizer", str(tokenizer_json)]
    checked = cli(*check_cmd, cwd=tmp)
    assert "4/4 pairs ok" in checked.stdout and f"(vocabulary {VOCAB})" in checked.stdout, checked.stdout
    tokens = int(re.search(r"pairs ok, ([\d,]+) tokens", checked.stdout).group(1).replace(",", ""))
    assert tokens > 1.5 * TRAIN_ITERS * 8 * SEQ  # less than one epoch: the held-out comparison is fair

    blend_cmd = next_command(checked.stdout, "data blend")
    assert blend_cmd[-2:] == ["--output", "blend.txt"]
    blended = cli(*blend_cmd, cwd=tmp)
    blend_file = tmp / "blend.txt"
    blend_sha = re.search(r"sha256 ([0-9a-f]{64})", blended.stdout).group(1)
    assert len(blend_file.read_text().split()) == 2 * 4  # weight prefix, four pairs

    # --- 3. train on that blend file with the same tokenizer.json, as a chain of 2+ segments --------
    clock.append(("check+blend", time.monotonic()))
    submit_cmd = next_command(blended.stdout, "submit")
    assert submit_cmd == ["submit", "RECIPE", "--set", f"data.blend_file={blend_file}"], submit_cmd
    submit_cmd[1] = str(train_recipe)
    cli(*submit_cmd, cwd=tmp)
    run = run_dir_of(tmp)
    manifest = json.loads((run / "manifest.json").read_text())
    assert (run / "data_blend.txt").read_bytes() == blend_file.read_bytes()  # frozen byte for byte
    assert manifest["tokenizer"]["source"] == str(tokenizer_json), manifest["tokenizer"]
    assert manifest["tokenizer"]["vocab_size"] == VOCAB, manifest["tokenizer"]
    assert blend_sha in json.dumps(manifest)

    slurm_states: dict[str, str] = {}  # recorded while running: slurmctld forgets after MinJobAge

    def chain_done() -> bool:
        for job in [e["job_id"] for e in _events(run, "submitted")]:
            if job not in slurm_states and (st := job_state(job)) in TERMINAL_STATES:
                slurm_states[job] = st
        return bool(_events(run, "chain_stopped")) and not queue_ids(name=run.name)

    try:
        wait_for(chain_done, CHAIN_TIMEOUT_S, interval=2, what="the training chain to finish")
    finally:
        if not chain_done():
            run_as(None, [MEGALAUNCH, "cancel", str(run)], {"PYTHONPATH": str(REPO / "src")}, cwd=tmp)
    clock.append(("training chain", time.monotonic()))
    ended = _events(run, "ended")
    jobs = [e["job_id"] for e in ended]
    report = "\n".join(f"segment {e['job_id']}: {e['outcome']} at {e['checkpoint_iteration']}" for e in ended)
    tail = f"\n--- last segment log ---\n{_segment_log(run, jobs[-1])[-4000:]}" if jobs else ""
    assert len(ended) >= 2, report + tail
    assert [e["outcome"] for e in ended] == ["saved"] * (len(ended) - 1) + ["finished"], report + tail
    # Slurm's warning stopped every segment but the last; the last may get it too, at its final iteration
    # only (the warning came as it finished: the final save is the stop save), never before
    decisions = [d for d in _events(run, "decision") if d["decision"] != "save"
                 and not (d["job_id"] == jobs[-1] and d.get("iteration") == TRAIN_ITERS)]
    assert [(d["job_id"], d["signal"]) for d in decisions] == [(j, True) for j in jobs[:-1]]
    for job in jobs:
        assert slurm_states.get(job) == "COMPLETED", (job, slurm_states)  # saved and left before the limit
    saved = [int(m.group(1)) for j in jobs for m in SAVED_LINE.finditer(_segment_log(run, j))]
    # every periodic save the chain reached was written, or skipped inside the signal window (logged and in the
    # ledger: the stop save a few iterations later takes its place); on a loaded machine a segment reaches
    # its first multiple of SAVE_INTERVAL only after the window opened, so either may happen
    skipped = {e["iteration"] for e in _events(run, "save_skipped") if e.get("kind") == "periodic"}
    reached = set(range(SAVE_INTERVAL, TRAIN_ITERS, SAVE_INTERVAL))
    assert reached <= set(saved) | skipped, (saved, sorted(skipped), report)
    for it in skipped:  # a skip is said where the user reads it
        assert any(f"periodic save at iteration {it} skipped" in _segment_log(run, j) for j in jobs), it
    assert saved[-1] == TRAIN_ITERS and set(saved) >= {e["checkpoint_iteration"] for e in ended}, saved

    status = cli("status", str(run), cwd=tmp).stdout
    assert "chain: stopped" in status and f"last checkpoint: {TRAIN_ITERS}" in status, status
    progress = json.loads((run / "state" / "progress.json").read_text())
    metrics = [json.loads(line) for line in (run / "state" / "metrics.jsonl").read_text().splitlines() if line]
    assert progress["iteration"] == metrics[-1]["iteration"] == TRAIN_ITERS, (progress, metrics[-1])
    last_loss = float(progress["loss"])
    assert last_loss == metrics[-1]["loss"]
    assert last_loss < math.log(VOCAB) - 0.5, (last_loss, metrics[:2])  # it learned something

    # --- 4. convert: the command status printed ----------------------------------------------------
    convert_cmd = next_command(status, "convert mcore-to-hf")
    assert convert_cmd == ["convert", "mcore-to-hf", str(run), "--out", str(run / "hf")], convert_cmd
    converted = cli(*convert_cmd, cwd=tmp, timeout=300)
    assert "next: AutoModelForCausalLM.from_pretrained" in converted.stdout, converted.stdout
    clock.append(("status+convert", time.monotonic()))

    # --- 5. transformers, from the output directory alone ------------------------------------------
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    alone = tmp / "hf-alone"
    shutil.copytree(run / "hf", alone)
    shutil.move(tmp / "tok", tmp / "tok-moved-away")  # nothing may still point at the source tokenizer
    tokenizer = AutoTokenizer.from_pretrained(alone)
    model = AutoModelForCausalLM.from_pretrained(alone, dtype=torch.float32).eval()
    config = json.loads((alone / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == VOCAB
    assert tokenizer.eos_token == EOS and config["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id == manifest["tokenizer"]["eos_token_id"]
    assert config["bos_token_id"] == tokenizer.bos_token_id == manifest["tokenizer"]["bos_token_id"]

    prompt = tokenizer(held_out[0][:40], return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8 or generated[0, -1] == tokenizer.eos_token_id
    text = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:])
    assert isinstance(text, str) and text

    loss, n_tokens = held_out_loss(model, tokenizer, held_out)
    clock.append(("transformers", time.monotonic()))
    print("journey stages: " + ", ".join(f"{name} {t - clock[i][1]:.0f} s" for i, (name, t) in enumerate(clock[1:])))
    print(f"journey: {len(ended)} segments {report!r}; last training loss {last_loss:.4f}, held-out loss "
          f"{loss:.4f} over {n_tokens} tokens; generated {text!r}")
    assert abs(loss - last_loss) <= 0.10 * last_loss, (loss, last_loss)
