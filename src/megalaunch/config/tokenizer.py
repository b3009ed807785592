"""One tokenizer reference for every stage: a `tokenizer.json` file or a Hugging Face tokenizer
directory (possibly holding only `tokenizer.json`). Tokenization (`tokenizer.path`), training
(`data.tokenizer_model`) and conversion take the same reference.

`resolve_tokenizer` reads the files as plain JSON (standard library only, so the login node needs no
extra) and resolves bos/eos/pad once. `TokenizerSpec.files()` is the tokenizer directory that a run
freezes (RUN/tokenizer/: the tokenizer files plus a `tokenizer_config.json` naming the class and
the special tokens), which is what Megatron's HuggingFaceTokenizer (`AutoTokenizer.from_pretrained`)
and a converted Hugging Face model are given: a bare `tokenizer.json` is not a directory, and a
directory without `tokenizer_config.json` has no eos, both of which fail inside the job."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.errors import PreflightError

# Files of a Hugging Face tokenizer directory that travel with it (not the model's config or weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
# Where no tokenizer_config.json / special_tokens_map.json names them: special tokens of the
# tokenizer whose text says what they are, most common spelling first.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "[BOS]")
ROLES = ("bos", "eos", "pad")


@dataclass(frozen=True)
class TokenizerSpec:
    """A resolved tokenizer: where it came from, its special tokens and their ids."""

    source: Path
    """The file or directory the recipe named."""
    files_from: dict[str, Path]
    """Tokenizer file name -> the file it is copied from."""
    config: dict[str, Any]
    """The source's tokenizer_config.json (empty when it has none)."""
    tokens: dict[str, str | None]
    """bos/eos/pad -> token text (eos always set)."""
    ids: dict[str, int | None]
    """bos/eos/pad -> token id (None when the id is unknown: no tokenizer.json)."""
    vocab_size: int | None
    """Highest id + 1, counting added tokens (None without tokenizer.json)."""
    origin: dict[str, str] = field(default_factory=dict)
    """bos/eos/pad -> which file or rule named it."""

    def tokenizer_config(self) -> dict[str, Any]:
        """The source's tokenizer_config.json with the class and the resolved special tokens filled in."""
        cfg = dict(self.config)
        if "tokenizer.json" in self.files_from:
            cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for role in ROLES:
            token = self.tokens.get(role)
            if token is not None and not cfg.get(f"{role}_token"):
                cfg[f"{role}_token"] = token
        cfg.setdefault("model_max_length", 1_000_000_000_000_000_019_884_624_838_656)  # transformers' "no limit"
        return cfg

    def files(self) -> dict[str, bytes]:
        """The frozen tokenizer directory: file name -> content (tokenizer.model is binary)."""
        out = {name: path.read_bytes() for name, path in self.files_from.items() if name != "tokenizer_config.json"}
        out["tokenizer_config.json"] = (json.dumps(self.tokenizer_config(), indent=2, sort_keys=True) + "\n").encode()
        return out

    def record(self) -> dict[str, Any]:
        """What the run records about its tokenizer (manifest.json's `tokenizer`)."""
        return {"source": str(self.source), "vocab_size": self.vocab_size,
                **{f"{r}_token": self.tokens.get(r) for r in ROLES},
                **{f"{r}_token_id": self.ids.get(r) for r in ROLES}}

    def describe(self) -> str:
        """One line: source, vocabulary and the resolved special tokens."""
        parts = [f"{r} {self.tokens[r]!r}" + (f" = {self.ids[r]}" if self.ids.get(r) is not None else "")
                 for r in ROLES if self.tokens.get(r) is not None]
        vocab = f", {self.vocab_size} entries" if self.vocab_size else ""
        return f"tokenizer {self.source}{vocab}: {', '.join(parts)}"

    def hf_config_ids(self) -> dict[str, int]:
        """bos/eos/pad ids for a Hugging Face model's config.json."""
        return {f"{r}_token_id": i for r, i in self.ids.items() if i is not None}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: text or {content: ...}."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _read(path: Path, what: str, field_name: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise PreflightError(f"cannot read {path}: {e.strerror}", field=field_name,
                             fix="make the tokenizer files readable") from None
    except ValueError as e:
        raise PreflightError(f"{path} is not a valid {what} ({e})", field=field_name,
                             fix="re-save the tokenizer (tokenizer.save('tokenizer.json'))") from None


def _vocab(tok: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """token -> id of the model's vocabulary and of the special added tokens."""
    model = tok.get("model")
    vocab = model.get("vocab", {}) if isinstance(model, dict) else {}
    ids: dict[str, int] = {}
    if isinstance(vocab, dict):
        ids = {str(k): int(v) for k, v in vocab.items() if isinstance(v, int)}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = {str(p[0]): i for i, p in enumerate(vocab) if isinstance(p, list) and p}
    special: dict[str, int] = {}
    for t in tok.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
            ids[t["content"]] = t["id"]
            if t.get("special", False):
                special[t["content"]] = t["id"]
    return ids, special


def _files_of(source: Path, field_name: str) -> dict[str, Path]:
    if source.is_file():
        return {"tokenizer.json": source}
    if source.is_dir():
        found = {n: source / n for n in TOKENIZER_FILES if (source / n).is_file()}
        if "tokenizer.json" in found or "tokenizer_config.json" in found:
            return found
        raise PreflightError(f"{source} holds no tokenizer.json or tokenizer_config.json", field=field_name,
                             valid="a tokenizer.json, or a Hugging Face tokenizer directory",
                             fix="point it at the tokenizer's directory or its tokenizer.json")
    hub = "/" in str(source) and not str(source).startswith(("/", ".", "~"))
    raise PreflightError(f"{source} does not exist" + (" (a hub name? model hubs are not reachable from compute "
                                                       "nodes)" if hub else ""), field=field_name,
                         valid="a local tokenizer directory or tokenizer.json",
                         fix="download it and point at the local copy")


def resolve_tokenizer(ref: str | os.PathLike[str], *, field_name: str = "data.tokenizer_model") -> TokenizerSpec:
    """Read the tokenizer that `ref` names and resolve its special tokens; one-line PreflightError
    naming `field_name` for anything Megatron's HuggingFaceTokenizer would refuse inside the job."""
    source = Path(os.path.expanduser(str(ref)))
    files = _files_of(source, field_name)
    tok = _read(files["tokenizer.json"], "tokenizer.json", field_name) if "tokenizer.json" in files else None
    if tok is not None and not (isinstance(tok, dict) and isinstance(tok.get("model"), dict)):
        raise PreflightError(f"{files['tokenizer.json']} is not a tokenizers tokenizer.json (no 'model')",
                             field=field_name, fix="save it with the tokenizers library: tokenizer.save(path)")
    config = _read(files["tokenizer_config.json"], "tokenizer_config.json", field_name) \
        if "tokenizer_config.json" in files else {}
    smap = _read(files["special_tokens_map.json"], "special_tokens_map.json", field_name) \
        if "special_tokens_map.json" in files else {}
    vocab, special = _vocab(tok) if tok is not None else ({}, {})
    tokens: dict[str, str | None] = {}
    origin: dict[str, str] = {}
    for role, guesses in (("bos", BOS_NAMES), ("eos", EOS_NAMES), ("pad", ())):
        for name, table in (("tokenizer_config.json", config), ("special_tokens_map.json", smap)):
            text = _token_text(table.get(f"{role}_token")) if isinstance(table, dict) else None
            if text is not None:
                tokens[role], origin[role] = text, name
                break
        else:
            guess = next((g for g in guesses if g in special), None)
            tokens[role] = guess
            if guess is not None:
                origin[role] = "special token of tokenizer.json"
    if tokens["eos"] is None:
        raise PreflightError(f"the tokenizer {source} has no end-of-text token: no eos_token in a "
                             f"tokenizer_config.json and none of {', '.join(EOS_NAMES)} among its special tokens",
                             field=field_name, valid="a tokenizer with an eos token (Megatron's document separator)",
                             fix="add a tokenizer_config.json with \"eos_token\" next to tokenizer.json, or train "
                                 "the tokenizer with special_tokens=['<|endoftext|>']")
    ids: dict[str, int | None] = {}
    for role in ROLES:
        token = tokens[role]
        ids[role] = vocab.get(token) if token is not None else None
        if token is not None and tok is not None and ids[role] is None:
            raise PreflightError(f"{role}_token {token!r} ({origin[role]}) is not in the vocabulary of "
                                 f"{files['tokenizer.json']}: Megatron would add it and the ids would not match "
                                 "the tokenized data", field=field_name,
                             fix=f"name a token of the tokenizer as {role}_token in tokenizer_config.json")
    vocab_size = max(vocab.values()) + 1 if vocab else None
    return TokenizerSpec(source=source, files_from=files, config=config if isinstance(config, dict) else {},
                         tokens=tokens, ids=ids, vocab_size=vocab_size, origin=origin)


def check_loads(spec: TokenizerSpec, *, field_name: str = "data.tokenizer_model") -> None:
    """Load tokenizer.json with the `tokenizers` library when it is installed (what the job's
    transformers does); the JSON checks of resolve_tokenizer stand alone without it."""
    import importlib.util

    path = spec.files_from.get("tokenizer.json")
    if path is None or importlib.util.find_spec("tokenizers") is None:
        return
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for files it cannot parse
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PreflightError(f"{path} does not load with tokenizers: {first}", field=field_name,
                             fix="re-save the tokenizer with the tokenizers library") from None
