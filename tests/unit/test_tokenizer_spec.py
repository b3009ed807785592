"""One tokenizer reference for every stage (config/tokenizer.py): a bare tokenizer.json and a
directory holding only tokenizer.json resolve to the same special tokens, a run freezes a tokenizer
directory that Megatron's own HuggingFaceTokenizer builds from, and a tokenizer without an eos token
is refused before anything is written. Tokenizers are trained here with `tokenizers` (no downloads)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from tests.support.corpus import documents, train_bpe_tokenizer
from tests.unit.helpers import cli

from megalaunch.config.loader import load_recipe
from megalaunch.config.tokenizer import resolve_tokenizer
from megalaunch.errors import PreflightError
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import read_args_file

pytest.importorskip("tokenizers")

HF = "data.tokenizer_type=HuggingFaceTokenizer"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json",
                               list(documents(60, mean_words=40)), vocab_size=400)


@pytest.fixture()
def only_json_dir(tmp_path: Path, tokenizer_file: Path) -> Path:
    d = tmp_path / "tok-dir"
    d.mkdir()
    shutil.copy(tokenizer_file, d / "tokenizer.json")
    return d


def _ids(path: Path) -> dict[str, int]:
    tok = json.loads(path.read_text())
    return {t["content"]: t["id"] for t in tok["added_tokens"]}


def test_a_file_and_a_directory_with_only_tokenizer_json_resolve_alike(tokenizer_file: Path,
                                                                       only_json_dir: Path) -> None:
    ids = _ids(tokenizer_file)
    for ref in (tokenizer_file, only_json_dir):
        spec = resolve_tokenizer(ref)
        assert spec.tokens == {"bos": "<|begin_of_text|>", "eos": "<|endoftext|>", "pad": None}
        assert spec.ids == {"bos": ids["<|begin_of_text|>"], "eos": ids["<|endoftext|>"], "pad": None}
        assert spec.vocab_size == 400
        cfg = json.loads(spec.files()["tokenizer_config.json"])
        assert cfg["eos_token"] == "<|endoftext|>" and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tokenizer_config_names_the_special_tokens(only_json_dir: Path) -> None:
    """A tokenizer_config.json wins over the guess from the special tokens (here: eos = the bos text)."""
    (only_json_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|begin_of_text|>"}, "pad_token": "<|endoftext|>", "custom": 1}))
    spec = resolve_tokenizer(only_json_dir)
    assert spec.tokens["eos"] == "<|begin_of_text|>" and spec.tokens["pad"] == "<|endoftext|>"
    assert spec.origin["eos"] == "tokenizer_config.json"
    assert json.loads(spec.files()["tokenizer_config.json"])["custom"] == 1  # the rest is kept


def test_no_eos_and_unknown_eos_are_refused(tmp_path: Path) -> None:
    no_eos = train_bpe_tokenizer(tmp_path / "no-eos" / "tokenizer.json", list(documents(30, mean_words=30)),
                                 vocab_size=300, eos="<sep>", bos="<go>")
    with pytest.raises(PreflightError, match="no end-of-text token") as e:
        resolve_tokenizer(no_eos)
    assert e.value.field == "data.tokenizer_model" and "\n" not in str(e.value)
    (no_eos.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
    with pytest.raises(PreflightError, match=r"'<end>'.*not in the vocabulary"):
        resolve_tokenizer(no_eos.parent)
    (no_eos.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<sep>"}))
    assert resolve_tokenizer(no_eos.parent).tokens["eos"] == "<sep>"  # the fix the message names works


def test_a_broken_or_absent_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(PreflightError, match=r"not a valid tokenizer\.json"):
        resolve_tokenizer(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=r"holds no tokenizer\.json"):
        resolve_tokenizer(tmp_path / "empty")
    with pytest.raises(PreflightError, match="hub name"):
        resolve_tokenizer("meta-llama/Llama-3.1-8B")


def test_preflight_loads_the_tokenizer_with_tokenizers(tmp_path: Path, tokenizer_file: Path) -> None:
    """JSON that names an eos but that the tokenizers library cannot load is refused by submit."""
    tok = json.loads(tokenizer_file.read_text())
    tok["model"]["type"] = "NoSuchModel"
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps(tok))
    assert resolve_tokenizer(bad).tokens["eos"] == "<|endoftext|>"  # the JSON alone looks fine
    proc = cli("submit", "tiny", "--set", HF, "--set", f"data.tokenizer_model={bad}", "--dry-run")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "data.tokenizer_model" in proc.stderr and "does not load with tokenizers" in proc.stderr


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_the_run_freezes_a_tokenizer_directory_and_records_it(kind: str, tmp_path: Path, tokenizer_file: Path,
                                                              only_json_dir: Path) -> None:
    ref = tokenizer_file if kind == "file" else only_json_dir
    paths = write_run(prepare_run(load_recipe("tiny", [HF, f"data.tokenizer_model={ref}"]), root=tmp_path / "runs"))
    args = read_args_file(paths.megatron_args)
    assert args[args.index("--tokenizer-model") + 1] == str(paths.tokenizer)
    assert "--vocab-size" not in args  # tiny's vocab_size: 512 is the NullTokenizer's, not this tokenizer's
    assert (paths.tokenizer / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["tokenizer"]["source"] == str(ref)
    assert manifest["tokenizer"]["eos_token"] == "<|endoftext|>"
    assert manifest["tokenizer"]["eos_token_id"] == _ids(tokenizer_file)["<|endoftext|>"]
    assert manifest["tokenizer"]["vocab_size"] == 400


def test_the_null_tokenizer_keeps_its_vocab_size(tmp_path: Path) -> None:
    paths = write_run(prepare_run(load_recipe("tiny"), root=tmp_path / "runs"))
    args = read_args_file(paths.megatron_args)
    assert args[args.index("--vocab-size") + 1] == "512" and "--tokenizer-model" not in args
    assert not paths.tokenizer.exists() and json.loads(paths.manifest.read_text())["tokenizer"] is None


@pytest.mark.megatron
def test_megatrons_tokenizer_builds_from_the_rendered_arguments(tmp_path: Path, tokenizer_file: Path,
                                                                only_json_dir: Path) -> None:
    """Megatron's own argument parser and build_tokenizer, on exactly what the run's megatron.args says."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args

    eos = _ids(tokenizer_file)["<|endoftext|>"]
    for i, ref in enumerate((tokenizer_file, only_json_dir)):
        paths = write_run(prepare_run(load_recipe("tiny", [HF, f"data.tokenizer_model={ref}"]),
                                      root=tmp_path / f"runs{i}"))
        argv, sys.argv = sys.argv, ["train", *read_args_file(paths.megatron_args)]
        try:
            args = parse_args()
        finally:
            sys.argv = argv
        args.rank = 0
        tokenizer = build_tokenizer(args)
        assert tokenizer.vocab_size == 400 and tokenizer.eod == eos
        assert args.padded_vocab_size == 448  # 400 padded to tiny's make_vocab_size_divisible_by 64


def test_submit_refuses_a_tokenizer_without_eos_in_one_line(tmp_path: Path) -> None:
    no_eos = train_bpe_tokenizer(tmp_path / "no-eos" / "tokenizer.json", list(documents(30, mean_words=30)),
                                 vocab_size=300, eos="<sep>", bos="<go>")
    root = tmp_path / "runs"
    proc = cli("submit", "tiny", "--set", HF, "--set", f"data.tokenizer_model={no_eos}", "--set", f"run.root={root}")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.tokenizer_model" in lines[0] and "eos_token" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not root.exists()


def test_dry_run_names_the_resolved_tokenizer(tokenizer_file: Path) -> None:
    proc = cli("submit", "tiny", "--set", HF, "--set", f"data.tokenizer_model={tokenizer_file}", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("tokenizer "))
    assert "400 entries" in line and "eos '<|endoftext|>'" in line and line.endswith(f"tokenizer{os.sep}")
