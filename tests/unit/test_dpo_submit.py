"""DPO / IPO at submit (issue 51): `submit dpo-tiny --data FILES` reads every row and refuses a bad one, naming
the file and row in one line, with nothing written (missing chosen or rejected, an empty answer, chosen equal
to rejected, a plain conversation among the pairs, a file without rows); the recipe checks of flows (pipeline
and context parallelism 1, chat data for DPO), DPO on mock data and an online reference refused at submit, the
reference's choice printed by a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.unit.helpers import cli

from megalaunch.config.loader import load_recipe
from megalaunch.config.training.reference_plan import reference_choice
from megalaunch.errors import ConfigError, PreflightError
from megalaunch.finetune.layers import submit_layers
from megalaunch.launcher.prepare.prepare import prepare_run, prepare_submission

GOOD = {"prompt": "red cat", "chosen": "cat red", "rejected": "dog blue"}


def _files(root: Path, bad_row: dict | str | None, at: int = 3) -> Path:
    rows = [json.dumps({**GOOD, "prompt": f"p{i}"}) for i in range(5)]
    if bad_row is not None:
        rows[at - 1] = bad_row if isinstance(bad_row, str) else json.dumps(bad_row)
    (root / "pairs").mkdir(parents=True)
    (root / "pairs" / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    (root / "pairs" / "b.jsonl").write_text("\n".join(rows) + "\n")
    return root / "pairs"


@pytest.mark.parametrize(("row", "words"), [
    ({"prompt": "x", "chosen": "y"}, "'rejected' must be non-empty"),
    ({"prompt": "x", "rejected": "y"}, "'chosen' must be non-empty"),
    ({"prompt": "x", "chosen": "", "rejected": "y"}, "'chosen' must be non-empty"),
    ({"prompt": "x", "chosen": "same", "rejected": "same"}, "the same answer"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "not a preference pair"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' must be non-empty"),
    ("{not json", "not JSON"),
])
def test_a_bad_row_is_named_by_file_and_row_and_nothing_is_submitted(tmp_path: Path, row: dict | str, words: str) -> None:
    data = _files(tmp_path, row)
    with pytest.raises(ConfigError, match=r"b\.jsonl row 3: .*" + words.replace("(", r"\(")) as e:
        submit_layers("dpo-tiny", [], from_hf=None, data=str(data))
    assert "\n" not in str(e.value)
    runs = tmp_path / "runs"
    r = cli("submit", "dpo-tiny", "--data", str(data), "--set", f"run.root={runs}", "--set", "post_training.method=ipo")
    assert r.returncode != 0 and "b.jsonl row 3" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not runs.exists()


def test_good_pairs_pass_and_sft_rows_stay_allowed_for_sft(tmp_path: Path) -> None:
    data = _files(tmp_path, None)
    [(_, layer)] = submit_layers("dpo-tiny", [], from_hf=None, data=str(data))
    assert layer["data"]["chat_files"] == str(data)
    conversations = tmp_path / "chats"
    conversations.mkdir()
    (conversations / "c.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + "{broken\n")
    submit_layers("sft-tiny", [], from_hf=None, data=str(conversations))  # SFT: the first row only, as before


def test_flow_layout_and_data_checks(tmp_path: Path) -> None:
    for sets, words in ((["parallel.pipeline_model_parallel_size=2"], "pipeline_model_parallel_size 1"),
                        (["parallel.context_parallel_size=2"], "context_parallel_size 1"),
                        (["data.format=tokens"], "data.format chat")):
        with pytest.raises(ConfigError, match=words):
            load_recipe("dpo-tiny", sets)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size 1"):
        load_recipe("sft-tiny", ["training.flow=a.b:C", "parallel.pipeline_model_parallel_size=2"])
    with pytest.raises(PreflightError, match="not on mock data"):
        prepare_submission("dpo-tiny", [f"run.root={tmp_path}"], check_disk=False)
    with pytest.raises(PreflightError, match=r"online loads the starting model again .* random initialisation"):
        prepare_run(load_recipe("dpo-tiny", ["post_training.reference=online"]), root=tmp_path)


def test_the_reference_choice_is_said(tmp_path: Path) -> None:
    assert reference_choice(load_recipe("sft-tiny").recipe) is None
    assert reference_choice(load_recipe("dpo-tiny", ["post_training.reference=stage"]).recipe)[0] == "stage"
    choice, why = reference_choice(load_recipe("dpo-llama3-1b", ["cluster.gpu=h100"]).recipe, 8, 4, 128256)
    assert (choice, why) == ("stage", "auto: no starting checkpoint to load a frozen copy from")
    start = [f"checkpoint.load={tmp_path}"]
    choice, why = reference_choice(load_recipe("dpo-llama3-1b", ["cluster.gpu=h100", *start]).recipe, 8, 4, 128256)
    assert choice == "online" and "frozen bf16 copy (2.3 GiB)" in why and "GiB of 79 GiB: fits" in why, why
    small = ["parallel.layout=pinned", "cluster.gpu_memory_gb=23", *start]  # the policy fits, its copy does not
    choice, why = reference_choice(load_recipe("dpo-llama3-1b", small).recipe, 8, 4, 128256)
    assert choice == "stage" and "does not fit" in why, why
    assert reference_choice(load_recipe("dpo-tiny", start).recipe)[0] == "stage"  # a CPU job: no GPU memory
    pytest.importorskip("transformers")
    from tests.support.chat import make_chat_tokenizer
    from tests.unit.test_finetune_submit import TINY

    make_chat_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(TINY))
    data = _files(tmp_path, None)
    r = cli("submit", "dpo-tiny", "--from-hf", str(tmp_path / "hf"), "--data", str(data), "--dry-run",
            "--set", f"run.root={tmp_path / 'runs'}")
    assert r.returncode == 0, r.stderr
    assert "reference: stage (auto:" in r.stdout, r.stdout


def test_stored_scores_count_in_the_disk_peak(tmp_path: Path) -> None:
    import dataclasses

    from tests.unit.test_score_store import write_dataset

    from megalaunch.config.planner.checkpoint_size import recipe_peak
    from megalaunch.config.training.score_budget import score_bytes_per_token, scores_bytes

    write_dataset(tmp_path / "d" / "train", [100, 60, 40])
    recipe = load_recipe("dpo-tiny").recipe
    assert score_bytes_per_token(recipe) == 4.0 and score_bytes_per_token(load_recipe("sft-tiny").recipe) == 0
    assert scores_bytes(recipe, f"1 {tmp_path / 'd' / 'train'}\n") == 4.0 * 200
    peak = recipe_peak(recipe, 512)
    withs = dataclasses.replace(peak, scores_bytes=800.0)
    assert withs.total == peak.total + 800 and "stored scores" in withs.describe()
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text("x" * 3000)
    chats = load_recipe("dpo-tiny", [f"data.chat_files={tmp_path / 'chats'}", "data.mock=false",
                                     "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={tmp_path}"])
    assert scores_bytes(chats.recipe, None) == 4.0 * 1000  # estimated from the files' size


def test_batch_sizes_count_sequences_and_megatron_gets_pairs(tmp_path: Path) -> None:
    from megalaunch.config.megatron_args import megatron_args
    from megalaunch.rundir.paths import RunPaths

    args = megatron_args(load_recipe("dpo-tiny", ["training.micro_batch_size=4"]).recipe, RunPaths(tmp_path))
    assert args[args.index("--micro-batch-size") + 1] == "2" and args[args.index("--global-batch-size") + 1] == "8"
    sft = megatron_args(load_recipe("sft-tiny", ["training.micro_batch_size=4"]).recipe, RunPaths(tmp_path))
    assert sft[sft.index("--micro-batch-size") + 1] == "4" and sft[sft.index("--global-batch-size") + 1] == "8"
    with pytest.raises(ConfigError, match=r"training.micro_batch_size counts sequences .* got 3; fix: --set "
                                          r"training.micro_batch_size=4"):
        load_recipe("dpo-tiny", ["training.micro_batch_size=3", "training.global_batch_size=12"])
