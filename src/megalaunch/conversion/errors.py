"""Conversion errors: each says what was wrong, naming the tensor, file or field, in one line."""

from __future__ import annotations

from megalaunch.errors import MegalaunchError


class ConversionError(MegalaunchError):
    """A checkpoint cannot be converted as asked."""


class UnsupportedModelError(ConversionError):
    """The architecture or one of its features has no mapping."""


class ShapeMismatchError(ConversionError):
    """A tensor's shape differs from what the model configuration implies."""

    def __init__(self, tensor: str, found: tuple[int, ...], expected: tuple[int, ...], *,
                 source: str = "checkpoint", fix: str | None = None) -> None:
        super().__init__(f"tensor '{tensor}' has shape {list(found)} in the {source}, "
                         f"the model configuration implies {list(expected)}", fix=fix)
        self.tensor, self.found, self.expected = tensor, found, expected


class IncompleteCheckpointError(ConversionError):
    """A Megatron checkpoint is missing its tracker, metadata or data files."""


class MissingFileError(ConversionError):
    """An input file or directory does not exist."""
