"""What `submit --from-hf MODEL_DIR --data SFT_DIR` hands the recipe loader: values merged over the recipe
and the cluster profile and under `--set` (config/loader.py's `layers`), each named by its flag in run.yaml;
`chain.export_hf` is the SFT recipes' own (training/sft.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megalaunch.config.loader import Layers, load_tree
from megalaunch.finetune.data_dir import data_layer
from megalaunch.finetune.model_dir import from_hf_layer


def submit_layers(ref: str, sets: list[str], *, from_hf: str | None, data: str | None,
                  cluster: str | None = None) -> Layers:
    """The layers of `--from-hf` and `--data` (none without them); raises a one-line ConfigError naming the flag."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if from_hf:
        tree, _ = load_tree(ref, sets, cluster=cluster)  # the sequence length asked for, --set included
        seq_length = (tree.get("model") or {}).get("seq_length", 2048)
        layers.append((f"--from-hf {from_hf}", from_hf_layer(from_hf, sets, int(seq_length))))
    if data:
        layer = data_layer(data)
        method = ((load_tree(ref, sets, cluster=cluster)[0].get("post_training") or {}).get("method") or "none")
        if method in ("dpo", "ipo") and layer["data"].get("chat_files"):  # every row a pair, read now
            from megalaunch.finetune.data_dir import chat_files
            from megalaunch.finetune.preference_check import check_preference_files

            check_preference_files(chat_files(Path(layer["data"]["chat_files"])), method)
        layers.append((f"--data {data}", layer))
    return layers
