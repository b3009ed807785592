"""Example-based regressions for the bugs the property tests (tests/property) found: each was a
traceback, a value that arrived changed, or a value that could become something else."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe, load_run_recipe
from megalaunch.errors import ConfigError, MegalaunchError, PreflightError
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import args_file_text, read_args_file
from megalaunch.rundir.paths import RunPaths

SLURM = ["cluster.backend=slurm"]


def test_args_file_keeps_empty_values_and_unicode_line_separators(tmp_path: Path) -> None:
    args = ["--split", "", "--note", "a\u2028b", "c\x0cd\x85e", "--last", ""]
    (tmp_path / "a").write_text(args_file_text(args))
    assert read_args_file(tmp_path / "a") == args


def test_empty_megatron_value_does_not_swallow_the_next_flag(tmp_path: Path) -> None:
    prepared = prepare_run(load_recipe("tiny", ["data.split="]), root=tmp_path)
    (tmp_path / "a").write_text(prepared.files["megatron.args"])
    args = read_args_file(tmp_path / "a")
    assert args[args.index("--split") + 1] == ""


def test_megatron_args_key_with_a_line_break_is_refused() -> None:
    with pytest.raises(PreflightError, match=r"megatron_args\.x"):
        prepare_run(load_recipe("tiny", ['megatron_args={"x\\n--load": 1}']))


@pytest.mark.parametrize("sets", [['cluster.env.V="a\\0b"', *SLURM], ['workload=["/bin/echo", "a\\0"]', *SLURM],
                                  ['cluster.container.image="\\0"', "cluster.container.kind=pyxis", *SLURM]])
def test_nul_in_a_value_is_refused_naming_the_field(sets: list[str]) -> None:
    with pytest.raises(PreflightError, match="NUL") as e:
        prepare_run(load_recipe("tiny", sets))
    assert e.value.field and e.value.field.startswith(("cluster.", "workload"))


def test_nul_never_reaches_a_conversion_script(tmp_path: Path) -> None:
    from megalaunch.conversion.submit import render_script

    recipe = load_recipe("tiny", ['cluster.megalaunch="\\0"', *SLURM]).recipe
    with pytest.raises(ConfigError, match="NUL"):
        render_script(recipe, ["hf-to-mcore", "x"], tmp_path / "out")


def test_unknown_user_in_a_path_is_a_megalaunch_error() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.load.*~nosuchuser0 names no user"):
        load_recipe("tiny", ["checkpoint.load=~nosuchuser0/ckpt"])
    with pytest.raises(ConfigError, match="not found"):
        load_recipe("~nosuchuser0/recipe")


@pytest.mark.parametrize("sets", [['description="a\\x85b"'], ['megatron_args={">x": 1, "a: b": "c", "t\\nu": 2}'],
                                  ['cluster.sbatch_extra={"#x": "y"}']])
def test_run_yaml_gives_back_what_it_was_given(tmp_path: Path, sets: list[str]) -> None:
    loaded = load_recipe("tiny", sets)
    try:
        paths = write_run(prepare_run(loaded, root=tmp_path))
    except PreflightError:  # a line break in a flag is refused (above); the local backend renders no #SBATCH
        return
    assert load_run_recipe(paths) == loaded.recipe


@pytest.mark.parametrize("content", [b"\x80", b"{", b"%", b"", b"- a\n", b"name: [unclosed"])
def test_damaged_run_yaml_is_a_config_error(tmp_path: Path, content: bytes) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.run_yaml.write_bytes(content)
    with pytest.raises(ConfigError, match=r"run\.yaml"):
        load_run_recipe(paths)


def test_yaml_values_python_cannot_build(tmp_path: Path) -> None:
    # on the command line they are plain strings, as any text that is not YAML
    assert load_recipe("tiny", ["description=2024-13-45"]).recipe.description == "2024-13-45"
    assert load_recipe("tiny", ["description=!!timestamp x"]).recipe.description == "!!timestamp x"
    for text in ("description: 2024-13-45", f"description: {'1' * 5000}", "megatron_args: &a {x: *a}",
                 "description: " + "[" * 3000):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"include: [tiny]\nname: r\n{text}\n")
        with pytest.raises(ConfigError, match=r"r\.yaml"):
            load_recipe(str(recipe))
    with pytest.raises(ConfigError):
        load_recipe("tiny", ["megatron_args.x=&a [*a]"])


@pytest.mark.parametrize("value", ["1e400", ".nan", "-.inf", "1" * 400])
def test_numbers_must_be_finite(value: str) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.save_time_estimate_s.*finite"):
        load_recipe("tiny", [f"checkpoint.save_time_estimate_s={value}"])


def test_zero_parallel_size_is_refused_before_dividing_by_it() -> None:
    with pytest.raises(PreflightError, match=r"parallel\.tensor_model_parallel_size"):
        prepare_run(load_recipe("tiny", ["parallel.tensor_model_parallel_size=0"]))


@pytest.mark.parametrize(("sets", "error", "field"), [
    (['name="ab\\n"'], ConfigError, "name"),
    (['cluster.env={"X\\n": a}'], ConfigError, "cluster.env"),
    (['cluster.partition="gpu\\n"', *SLURM], PreflightError, "cluster.partition"),
    (['cluster.time="12:00:00\\n"', *SLURM], PreflightError, "cluster.time"),
])
def test_a_final_newline_is_not_a_valid_name(sets: list[str], error: type[MegalaunchError], field: str) -> None:
    with pytest.raises(error, match=field.replace(".", r"\.")):
        prepare_run(load_recipe("tiny", sets))


def test_values_starting_with_a_dash_are_not_options_of_exec_or_source(tmp_path: Path) -> None:
    from megalaunch.rundir.tokenize import TokenizeRun
    from megalaunch.tokenization.recipe import load_tokenize_recipe
    from megalaunch.tokenization.submit import render_job_script

    recipe = load_tokenize_recipe("tokenize/jsonl", ["slurm.python=-a"])[0]
    assert "exec -- -a -m megalaunch.tokenization.job" in render_job_script(TokenizeRun(tmp_path), recipe)
    script = prepare_run(load_recipe("tiny", ["cluster.venv=-x", *SLURM]), root=tmp_path).files["job.sbatch"]
    assert "source -- -x/bin/activate\n" in script


def test_nul_in_a_tokenization_path_is_a_config_error() -> None:
    from megalaunch.tokenization.recipe import load_tokenize_recipe

    with pytest.raises(ConfigError, match="output_dir"):
        load_tokenize_recipe("tokenize/jsonl", ['output_dir="a\\0"'])


def test_a_number_with_a_control_character_is_a_megalaunch_error() -> None:
    """str.strip() removes U+001F but float() does not: '0\\x1f' matched the number pattern, then crashed."""
    with pytest.raises(ConfigError, match=r"training\.lr"):
        load_recipe("tiny", ['training.lr="0\x1f"'])
    assert load_recipe("tiny", ['training.train_iters=" 12 "']).recipe.training.train_iters == 12


def test_a_line_break_in_run_root_never_reaches_megatron_args(tmp_path: Path) -> None:
    """The run directory is in --save/--load: a line break in run.root would split those arguments."""
    with pytest.raises(PreflightError) as e:
        prepare_run(load_recipe("tiny", [f'run.root="{tmp_path}/a\\nb"']))
    assert e.value.field == "run.root"


@pytest.mark.parametrize("tag", ["!!float", "!!int", "!!bool", "!!timestamp"])
def test_an_empty_tagged_scalar_is_a_megalaunch_error(tag: str) -> None:
    """PyYAML's float constructor indexes value[0] of an empty scalar (IndexError)."""
    with pytest.raises(ConfigError, match="chain"):
        load_recipe("tiny", [f"chain={tag}"])
    with pytest.raises(ConfigError):
        load_recipe("tiny", [f"training.lr={tag}"])
