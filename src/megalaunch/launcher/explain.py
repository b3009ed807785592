"""YAML with provenance comments: `run.yaml` and `megalaunch recipes show --explain`."""

from __future__ import annotations

from typing import Any

import yaml


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    elif text.endswith("..."):
        text = text[:-3].strip()
    return text


def yaml_with_origins(data: dict[str, Any], origin: Any, prefix: str = "", indent: int = 0) -> str:
    """Block YAML of `data` where each leaf carries `# <origin(dotted)>` unless it is a default."""
    lines: list[str] = []
    pad = "  " * indent
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:")
            lines.append(yaml_with_origins(value, origin, dotted + ".", indent + 1).rstrip("\n"))
            continue
        src = origin(dotted)
        note = f"  # {src}" if src != "default" else ""
        lines.append(f"{pad}{key}: {_scalar(value)}{note}")
    return "\n".join(lines) + "\n"
