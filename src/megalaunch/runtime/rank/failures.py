"""Which failures of a segment no retry can fix, and what to tell the user.

A segment that fails *before its first iteration* with a deterministic error (Megatron's argument
validation, model construction, a feature whose kernel or library is not installed on the node,
a requested checkpoint that cannot be used) will fail the same way in every retry: it is a
configuration error. Its outcome is `config_error`, and the chain stops after that one segment
(launcher/chain/chain.py). Transient failures (NCCL and other communication errors, CUDA out-of-memory,
a lost node, a timeout) and anything after the first iteration stay plain failures that count
against the crash-loop budget. A full filesystem or exhausted quota (runtime/rank/storage.py) is neither:
no retry fixes it and no node is to blame (outcome `storage_full`, the chain stops at once).

The reason is readable: the exception's text and the source line that raised it (an `assert`
without a message shows the asserted expression), plus a fix where one is known.

Standard library only at module level: the launcher's tests import it without torch."""

from __future__ import annotations

import importlib.util
import re
import traceback
from dataclasses import dataclass

from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.storage import STORAGE_FIX, SaveDoesNotFit, storage_error

STORAGE_PREFIX = "storage full: "

# Exception classes whose cause is the configuration (when raised before the first iteration).
DETERMINISTIC = ("AssertionError", "ValueError", "TypeError", "KeyError", "NotImplementedError",
                 "ImportError", "ModuleNotFoundError", "AttributeError", "IndexError")
# A file the recipe names that is not there, or not readable: deterministic, though an OSError.
MISSING_FILE = ("FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "PermissionError")

# Words that mark a failure as transient whatever its class: communication, memory, hardware, I/O.
TRANSIENT_WORDS = re.compile(
    r"NCCL|nccl|CUDA error|CUDA out of memory|OutOfMemory|out of memory|cudaError|ECC|Xid|"
    r"Connection (refused|reset)|Broken pipe|timed out|Timeout|socket|gloo|DistBackendError|"
    r"DistNetworkError|Input/output error|Stale file handle", re.I)
TRANSIENT_CLASSES = ("OutOfMemoryError", "DistBackendError", "DistNetworkError", "DistStoreError",
                     "OSError", "IOError", "ConnectionError", "TimeoutError", "BrokenPipeError",
                     "MemoryError", "ChildProcessError", "KeyboardInterrupt")


class ConfigFailure(Exception):
    """A failure no retry can fix, with the fix where one is known."""

    def __init__(self, reason: str, fix: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


@dataclass(frozen=True)
class Failure:
    config: bool          # True: no retry can fix it (outcome config_error)
    reason: str           # one line: "AssertionError: text (megatron/x.py:12)"
    fix: str | None = None
    storage: bool = False  # a full filesystem or quota (outcome storage_full): the reason starts with STORAGE_PREFIX


# Known messages -> the fix, in recipe terms. First match wins; matched against "Class: text | source".
KNOWN_FIXES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p, re.I), fix) for p, fix in (
    (r"transformer.?engine|transformer_engine|\bTE\b.*(not|un)available",
     "transformer-engine is not installed on this node: --set training.attention=sdpa "
     "--set training.transformer_impl=local, or install it (pip install megalaunch[te])"),
    (r"flash.?attn|flash_attn|FlashAttention",
     "flash-attn is not installed on this node: drop --use-flash-attn from megatron_args "
     "(training.attention=sdpa uses torch's fused attention), or install flash-attn"),
    (r"liger", "liger-kernel failed on this node (the reason says how): --set training.kernels=megatron, or install "
               "the liger-kernel and triton that match the job's torch"),
    (r"apex", "apex is not installed on this node: use training.transformer_impl=local and drop the apex-only "
              "flags from megatron_args"),
    (r"nvidia_resiliency_ext|nvrx",
     "megatron-core 0.19 needs nvidia-resiliency-ext >= 0.6 when it is installed (older ones break its import): "
     "pip install -U nvidia-resiliency-ext in the job's environment, or uninstall it"),
    (r"module '[\w.]+' has no attribute|cannot import name",
     "a package in the job's Python environment is not the version megatron-core expects (the reason names "
     "it): install the version megatron-core supports in cluster.venv / the container, or uninstall it"),
    (r"sequence.?parallel", "--set parallel.sequence_parallel=false"),
    (r"lr_warmup|warmup", "training.lr_warmup_iters must be smaller than the decay iterations "
                          "(training.lr_decay_iters, default train_iters)"),
    (r"micro.?batch|global.?batch|num_micro", "training.global_batch_size must be a multiple of "
                                              "micro_batch_size x data-parallel size"),
    (r"num_attention_heads|num_query_groups|hidden_size", "check the model's head and hidden sizes "
                                                          "against parallel.tensor_model_parallel_size"),
    (r"pipeline|num_layers", "check model.num_layers against parallel.pipeline_model_parallel_size "
                             "(and the virtual pipeline size)"),
    (r"vocab|tokenizer", "check data.tokenizer_type / data.tokenizer_model / data.vocab_size"),
    (r"checkpoint|\bload\b|state_dict|size mismatch|Missing key|Unexpected key",
     "the checkpoint does not match the recipe's model or parallel layout: start a new run, "
     "or megalaunch resume RUN --from an iteration saved with this layout"),
))


def known_fix(text: str) -> str | None:
    for pattern, fix in KNOWN_FIXES:
        if pattern.search(text):
            return fix
    return None


def recipe_field_fix(reason: str, recipe: dict[str, object]) -> str | None:
    """'megatron_args.num_dataset_builder_threads is 0 in the recipe: correct it' when the reason
    names Megatron arguments (`args.NAME`) that the recipe sets, section by section."""
    names = list(dict.fromkeys(re.findall(r"\bargs\.([a-z_][a-z0-9_]*)", reason)))
    found = []
    for name in names:
        for section, values in recipe.items():
            if isinstance(values, dict) and name in values:
                found.append(f"{section}.{name} (now {values[name]!r})")
    if not found:
        return None
    return f"check {', '.join(found)} in the recipe: Megatron refused it; correct it and submit again"


def _origin(error: BaseException) -> tuple[str, str]:
    """('megatron/training/arguments.py:412', 'assert args.x < args.y') of the frame that raised."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "", ""
    last = frames[-1]
    name = last.filename
    for marker in ("site-packages/", "dist-packages/", "/src/"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{last.lineno}", (last.line or "").strip()


def describe(error: BaseException) -> str:
    """One line: class, message (or the asserted source line when there is none), and where."""
    cls = type(error).__name__
    if isinstance(error, ConfigFailure):
        return error.reason
    text = " ".join(str(error).split())
    where, line = _origin(error)
    if not text and line:
        text = line
    out = f"{cls}: {text}" if text else cls
    if where:
        out += f" ({where})" if not line or line in text else f" ({where}: {line})"
    return out[:600]


def classify(error: BaseException, *, started: bool) -> Failure:
    """How the chain should take `error`; `started` is True once an iteration has run."""
    reason = describe(error)
    if isinstance(error, ConfigFailure):
        return Failure(True, reason, error.fix or known_fix(reason))
    if isinstance(error, SaveDoesNotFit):  # the check before a save: its own sentence says it all
        return Failure(False, f"{STORAGE_PREFIX}{error.reason}"[:600], STORAGE_FIX, storage=True)
    evidence = storage_error(error)
    if evidence is not None:  # the evidence first: the launcher finds it in the outcome's reason
        return Failure(False, f"{STORAGE_PREFIX}{evidence} ({reason})"[:600], STORAGE_FIX, storage=True)
    mro = {c.__name__ for c in type(error).__mro__}
    if mro & set(MISSING_FILE) and not TRANSIENT_WORDS.search(f"{error}"):
        return Failure(not started, reason, known_fix(reason) if not started else None)
    transient = bool(mro & set(TRANSIENT_CLASSES)) or bool(TRANSIENT_WORDS.search(f"{error}"))
    deterministic = bool(mro & set(DETERMINISTIC)) and not transient
    if deterministic and not started:
        return Failure(True, reason, known_fix(reason))
    return Failure(False, reason, None)


def exit_failure(code: object, *, started: bool) -> Failure:
    """Megatron leaves with sys.exit(non-zero) (argparse, its own checks) before training: config."""
    reason = f"Megatron exited with status {code}"
    return Failure(not started, reason + ("" if started else " before the first iteration (see its message above)"),
                   None)


# --- kernels and libraries a recipe may ask for -------------------------------------------------------

def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_kernels(argv: list[str], attention: str) -> list[str]:
    """Refuse, before Megatron starts, a feature whose library is not importable here; return the
    notes to log for what is used instead. Raises ConfigFailure naming the field and the fix."""
    te_wanted = attention == "te" or flag_value(argv, "--transformer-impl") == "transformer_engine"
    if te_wanted and not installed("transformer_engine"):
        field = "training.attention: te" if attention == "te" else "training.transformer_impl: transformer_engine"
        raise ConfigFailure(f"{field} needs transformer-engine, which is not installed on this node",
                            "--set training.attention=sdpa --set training.transformer_impl=local "
                            "(torch's fused attention, no extra library), or install transformer-engine")
    if "--use-flash-attn" in argv and not installed("flash_attn"):
        raise ConfigFailure("megatron_args use_flash_attn needs flash-attn, which is not installed on this node",
                            "drop use_flash_attn from megatron_args (training.attention=sdpa uses torch's "
                            "fused attention), or install flash-attn")
    notes = []
    if "--sequence-parallel" in argv and not te_wanted and not installed("apex"):
        notes.append("sequence parallel with megalaunch's torch norm (no transformer-engine or apex here)")
    return notes


def resolve_attention(requested: str, argv: list[str], *, cpu: bool) -> tuple[str, str]:
    """`training.attention: auto` decided here, in the job, where importability is known: transformer-engine
    if importable, else flash-attn, else torch SDPA. Returns (the choice, why). With context parallelism
    (which torch SDPA and flash-attn here do not support) the fallback is Megatron's local attention."""
    if requested != "auto":
        return requested, "set in the recipe"
    cp = int(flag_value(argv, "--context-parallel-size") or 1)
    if not cpu and installed("transformer_engine"):
        return "te", "auto: transformer-engine is importable"
    if cp > 1:
        return "local", f"auto: context parallelism (CP {cp}) without transformer-engine needs Megatron's local attention"
    if not cpu and installed("flash_attn"):
        return "flash", "auto: flash-attn is importable (no transformer-engine)"
    return "sdpa", "auto: torch SDPA (neither transformer-engine nor flash-attn is importable)" if not cpu \
        else "auto: torch SDPA on the CPU"


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def record_rank_error(ctx: RankContext, failure: Failure, *, iteration: int, steps: int) -> None:
    """Every failing rank leaves its error next to its task record (RUN/state/tasks/<job>/error-rank-N.json):
    when another rank's exit gets this one killed (srun --kill-on-bad-exit), rank 0's outcome may never be
    written. The trainer's and the stand-in's (runtime/standin.py)."""
    import time

    from megalaunch.rundir.files import atomic_write_json

    if ctx.job_id is None:
        return
    try:
        path = ctx.paths.task_error(ctx.job_id, ctx.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"rank": ctx.rank, "config": failure.config, "reason": failure.reason,
                                 "fix": failure.fix, "iteration": iteration, "steps": steps, "time": time.time()})
    except OSError as e:
        ctx.log(f"could not record this rank's error: {e}")
