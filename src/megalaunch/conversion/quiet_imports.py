"""Megatron's import-time notices, kept out of `megalaunch convert`'s output.

Importing megatron.core warns that Transformer Engine and Apex are missing (one UserWarning per
module that falls back), that absl is not installed, and torch logs "No CUDA runtime is found":
fallbacks that do not matter to a conversion, which runs no fused kernel and needs no GPU. They are
silenced while those modules are first imported, and only then: an import that fails still fails, and
any warning after the import still shows. `megalaunch --debug convert ...` skips this and shows them."""

from __future__ import annotations

import logging
import warnings

# torch logs its missing CUDA runtime through the standard logger of the module that looks for it
NOISY_LOGGERS = ("torch.utils.cpp_extension",)


def import_megatron_quietly() -> None:
    """Import megatron.core (and torch under it) with warnings and the noisy loggers muted; later
    imports of the same modules come from sys.modules and print nothing."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.dist_checkpointing  # noqa: F401
    except ImportError:
        pass  # not installed: the conversion's own import says so, with its traceback under --debug
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
