"""Putting a value into a recipe the way users do (a YAML recipe file, or `--set`), and what the
rendered job scripts must contain for a recipe (the arrival checks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from tests.property.fields import DICT_KEY, StringField, override


def flow_yaml(value: Any) -> str:
    """`value` as one YAML flow expression whose strings are double-quoted (every byte escaped)."""
    text = yaml.safe_dump(value, default_style='"', default_flow_style=True, width=10**9, allow_unicode=False)
    text = text.rstrip("\n")
    return text[: -len("\n...")] if text.endswith("\n...") else text


def set_expr(field: StringField, text: str, raw: bool = False) -> str | None:
    """The `--set` argument that puts `text` into `field` (quoted unless `raw`), or None when the
    command line cannot name it (a mapping key)."""
    if field.kind == "dict-key":
        return None
    parts = field.path.split(".")
    if any(p.endswith("[0]") for p in parts):  # a dataclass inside a list: set the whole list
        i = next(i for i, p in enumerate(parts) if p.endswith("[0]"))
        dotted = ".".join([*parts[:i], parts[i][:-3]])
        sub: Any = override(StringField(".".join(parts[i + 1:]), field.kind), text)
        return f"{dotted}={flow_yaml([sub])}"
    dotted = field.path + (f".{DICT_KEY}" if field.kind in ("dict-value", "any-value") else "")
    if field.kind == "list":
        return f"{dotted}=[{text}]" if raw else f"{dotted}={flow_yaml([text])}"
    return f"{dotted}={text}" if raw else f"{dotted}={flow_yaml(text)}"


def write_recipe(path: Path, tree: dict[str, Any]) -> Path:
    # Escaped: PyYAML writes U+0085 (NEL) raw with allow_unicode, and reads it back as a line break.
    path.write_text(yaml.safe_dump(tree, sort_keys=False, allow_unicode=False, width=10**9))
    return path


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.split("\n") if line.startswith("#SBATCH")]


def expected_header(job: Any) -> list[str]:
    """The #SBATCH lines a JobHeader must produce, values byte for byte (templates/_header.sbatch.j2)."""
    lines = [f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={job.nodes}",
             f"#SBATCH --ntasks-per-node={job.ntasks_per_node}" if job.ntasks_per_node is not None
             else "#SBATCH --ntasks=1", f"#SBATCH --cpus-per-task={job.cpus_per_task}"]
    if job.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.mem is not None:
        lines.append(f"#SBATCH --mem={job.mem}")
    lines.append(f"#SBATCH --time={job.time}")
    lines += [f"#SBATCH --{o['name']}={o['value']}" for o in job.options]
    if job.exclusive:
        lines.append("#SBATCH --exclusive")
    if job.signal:
        lines.append(f"#SBATCH --signal={job.signal}")
    lines.append("#SBATCH --no-requeue")
    if job.append:
        lines.append("#SBATCH --open-mode=append")
    lines += [f"#SBATCH --output={job.log}", f"#SBATCH --error={job.log}"]
    return lines


def home(path: str) -> str:
    return os.path.expanduser(path) if path else ""
