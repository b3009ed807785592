"""runtime/model/megatron_import: Megatron's import-time `torch.compile` decorations compile on first call
instead of importing TorchDynamo/Inductor at import, and wandb stays out of that import unless Megatron's
own W&B writer is set up (docs/goodput.md, start-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
# Megatron's import in fresh interpreters (~10-15 CPU-s a probe): CI runs these, the inner loop (--fast) does not
pytestmark = pytest.mark.megatron

from megalaunch.runtime.model.megatron_import import DEFERRED_COMPILE_ENV, deferred_compile  # noqa: E402

PROBE = r"""
import json, os, sys, tempfile, types, torch
from megalaunch.runtime.model import megatron_import
megatron_import.import_megatron()
import megatron.core.jit as jit
from megatron.core import timers
from megatron.core.fusions import fused_bias_gelu
from megatron.training import global_vars
out = {"dynamo_after_import": "torch._dynamo" in sys.modules,
       "jit_fuser_deferred": bool(getattr(jit.jit_fuser, "_megalaunch_deferred", False)),
       "kernel_wrapped": hasattr(fused_bias_gelu.bias_gelu, "__wrapped__"),
       "compile_restored": not getattr(torch.compile, "_megalaunch_deferred", False),
       "wandb_after_import": "wandb" in sys.modules, "timers_wandb": timers.wandb is not None}
if os.environ.get("PROBE_NULL_TOKENIZER"):  # the same interpreter goes on (one Megatron import, ~10 CPU-s)
    import argparse
    from megalaunch.runtime.loop import megatron_patches
    megatron_patches.null_tokenizer_without_transformers()
    class Args(argparse.Namespace):  # Megatron's other tokenizer arguments at their defaults (None)
        def __getattr__(self, name):
            return None
    tok = global_vars.build_tokenizer(Args(tokenizer_type="NullTokenizer", vocab_size=512, rank=0,
                                           make_vocab_size_divisible_by=128, tensor_model_parallel_size=1))
    out["null_tokenizer"] = {"transformers": "transformers" in sys.modules, "vocab": tok.vocab_size, "eod": tok.eod}
    import transformers  # afterwards it imports normally (nothing left blocked)
    out["transformers_imports_after"] = "transformers" in sys.modules
# Megatron's own W&B writer (megatron_args: wandb-project) gives the timers the real module back
os.environ["WANDB_MODE"] = "disabled"
args = types.SimpleNamespace(wandb_project="p", wandb_exp_name="e", wandb_save_dir=tempfile.mkdtemp(),
                             wandb_entity=None, rank=0, world_size=1)
global_vars._set_wandb_writer(args)
out["timers_wandb_with_writer"] = timers.wandb is not None and timers.wandb is sys.modules["wandb"]
print(json.dumps(out))
"""


def probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_probe() -> dict[str, object]:
    """One fresh interpreter with the defaults: Megatron's import, then the null tokenizer, then W&B."""
    return probe({"PROBE_NULL_TOKENIZER": "1"})


def test_megatron_imports_without_the_compiler_and_torch_compile_is_restored(default_probe: dict[str, object]) -> None:
    got = {k: v for k, v in default_probe.items() if k not in ("null_tokenizer", "transformers_imports_after")}
    assert got == {"dynamo_after_import": False, "jit_fuser_deferred": True, "kernel_wrapped": True,
                   "compile_restored": True, "wandb_after_import": False, "timers_wandb": False,
                   "timers_wandb_with_writer": True}


def test_switched_off_megatron_imports_the_compiler_as_before() -> None:
    got = probe({DEFERRED_COMPILE_ENV: "0"})
    assert got["dynamo_after_import"] is True
    assert got["jit_fuser_deferred"] is False
    assert got["wandb_after_import"] is True and got["timers_wandb"] is True


def test_a_deferred_function_compiles_on_first_call_and_computes_the_same() -> None:
    compiled: list[int] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        compiled.append(1)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + x

    with deferred_compile():
        g = torch.compile(f, backend=counting)
        decorated = torch.compile(backend=counting)(f)
    assert g.__wrapped__ is f and decorated.__wrapped__ is f
    assert compiled == []  # nothing compiled before the first call
    x = torch.linspace(-1, 1, 7)
    assert torch.equal(g(x), f(x))
    assert len(compiled) == 1
    assert torch.equal(g(x), f(x))
    assert len(compiled) == 1  # compiled once, then reused
    assert torch.equal(decorated(x * 3), f(x * 3))


def test_modules_are_compiled_at_once() -> None:
    with deferred_compile():
        m = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert isinstance(m, torch._dynamo.eval_frame.OptimizedModule)


def test_the_null_tokenizer_is_built_without_importing_transformers(default_probe: dict[str, object]) -> None:
    assert default_probe["null_tokenizer"] == {"transformers": False, "vocab": 512, "eod": 511}
    assert default_probe["transformers_imports_after"] is True
