"""`megalaunch data check|blend|mix|sft|rollouts`: validate .bin/.idx pairs, freeze data blends, build mixtures.

`blend` and `mix` take lists after one flag (`--weights 0.8 0.2`), which click options cannot, so
they parse their own arguments with argparse."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Callable
from typing import Annotated

import typer

from megalaunch.cli.data_rollouts import rollouts
from megalaunch.cli.data_sft import sft
from megalaunch.cli.output import emit_json, say

app = typer.Typer(no_args_is_help=True)
app.command("sft")(sft)
app.command("rollouts")(rollouts)
_RAW = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command()
def check(
    paths: Annotated[list[str], typer.Argument(help="Prefixes (with or without .bin/.idx) or directories.")],
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="tokenizer.json: check dtype and ids "
                                                  "against its vocabulary.")] = None,
    vocab_size: Annotated[int | None, typer.Option("--vocab-size", help="Vocabulary size (instead of "
                                                   "--tokenizer).")] = None,
    no_scan: Annotated[bool, typer.Option("--no-scan", help="Skip reading every token id.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Verify every .bin/.idx pair (header, dtype vs vocabulary, sizes, document counts, truncation)
    and count tokens from the index. Exits non-zero when a pair is bad."""
    from dataclasses import asdict

    from megalaunch.data.check import check_paths, raise_for_problems

    if tokenizer:
        vocab_size = _vocab_size(tokenizer)
    reports = check_paths(paths, vocab_size=vocab_size, scan_ids=not no_scan)
    if as_json:
        emit_json([asdict(r) for r in reports])
    else:
        say(f"{'status':8}{'dtype':>7}{'documents':>13}{'tokens':>16}  prefix")
        for r in reports:
            say(f"{'ok' if r.ok else 'BAD':8}{r.dtype:>7}{r.sequences:>13,}{r.tokens:>16,}  {r.prefix}")
            for problem in r.problems:
                say(f"        - {problem}")
        good = [r for r in reports if r.ok]
        say(f"{len(good)}/{len(reports)} pairs ok, {sum(r.tokens for r in good):,} tokens"
            + (f" (vocabulary {vocab_size})" if vocab_size else ""))
    raise_for_problems(reports)
    if not as_json:
        say(f"next: megalaunch data blend {' '.join(map(shlex.quote, paths))} --output blend.txt")


def _vocab_size(path: str) -> int:
    from megalaunch.errors import require

    require("tokenizers", "tokenize")
    from tokenizers import Tokenizer

    from megalaunch.tokenization.encoder import check_tokenizer_file

    return int(Tokenizer.from_file(check_tokenizer_file(path)).get_vocab_size(with_added_tokens=True))


class _ArgParser(argparse.ArgumentParser):
    """argparse whose usage errors become one-line ConfigErrors (the CLI's error boundary)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from megalaunch.errors import ConfigError

        raise ConfigError(f"{message}", field=f"megalaunch {self.prog}",
                          fix=" ".join(self.format_usage().split()))


def _parse(parser: argparse.ArgumentParser, args: list[str], ctx: typer.Context,
           help_twin: Callable[..., None]) -> argparse.Namespace:
    if "-h" in args or "--help" in args:
        _styled_help(ctx, help_twin)
    return parser.parse_args(args)


def _styled_help(ctx: typer.Context, twin: Callable[..., None]) -> None:
    """Print the help as every other command prints it (Typer's), from `twin`: a signature that
    declares the same arguments for the help only (argparse parses them: lists after one flag)."""
    import typer.main

    paragraphs = (ctx.command.help or "").split("\n\n")
    text = "\n\n".join(" ".join(p.split()) for p in paragraphs)
    helper = typer.Typer(add_completion=False)
    helper.command(help=text, context_settings={"help_option_names": ["-h", "--help"]})(twin)
    command = typer.main.get_command(helper)
    command.main(["--help"], prog_name=ctx.command_path, standalone_mode=False)
    raise typer.Exit(0)


@app.command(context_settings=_RAW, add_help_option=False)
def blend(ctx: typer.Context) -> None:
    """Resolve prefixes/directories into a frozen blend: DIR... [--weights W...] [--output FILE].

    Sorted, validated, weighted by token counts (or the given weights, shared inside a directory by
    tokens), hashed; written in Megatron's --data-args-path format."""
    parser = _ArgParser(prog="data blend", description=blend.__doc__, add_help=False)
    parser.add_argument("paths", nargs="+", help="prefixes or directories")
    parser.add_argument("--weights", nargs="+", type=float, help="one weight per path (default: token counts)")
    parser.add_argument("--output", help="write the blend file here (then: data.blend_file in a recipe)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = _parse(parser, list(ctx.args), ctx, _blend_help)
    from megalaunch.data.blend import resolve_blend
    from megalaunch.errors import ConfigError
    from megalaunch.rundir.paths import refuse_frozen_write

    if args.weights is not None and len(args.weights) != len(args.paths):
        raise ConfigError(f"{len(args.paths)} paths but {len(args.weights)} weights", field="--weights",
                          fix="give one weight per path, or none")
    if args.output:
        refuse_frozen_write(args.output, "--output")
    weights = args.weights or [None] * len(args.paths)
    result = resolve_blend(list(zip(args.paths, weights, strict=True)))
    result.check_files()
    if args.output:
        result.write(args.output)
    if args.json:
        emit_json({"prefixes": [{"prefix": p, "weight": w} for p, w in result.prefixes], "sha256": result.sha256,
                   "skipped_empty": list(result.skipped_empty), "output": args.output})
        return
    total = sum(w for _, w in result.prefixes)
    for prefix, weight in result.prefixes:
        say(f"{weight:>16,.6g} {weight / total:>8.2%}  {prefix}")
    for prefix in result.skipped_empty:
        say(f"{'(empty, left out)':>25}  {prefix}")
    say(f"{len(result.prefixes)} prefixes, sha256 {result.sha256}"
        + (f", written to {args.output}" if args.output else ""))
    setting = (f"data.blend_file={os.path.abspath(args.output)}" if args.output
               else blend_setting(args.paths, args.weights))
    say(f"next: megalaunch submit RECIPE --set {shlex.quote(setting)}")


def blend_setting(paths: list[str], weights: list[float | None] | None) -> str:
    """`data.blend=[...]` for `submit --set` when no blend file was written: the same entries, so the
    run freezes this very blend."""
    entries = [f"{{path: {json.dumps(os.path.abspath(p))}" + (f", weight: {w!r}}}" if w is not None else "}")
               for p, w in zip(paths, weights if weights is not None else [None] * len(paths), strict=True)]
    return f"data.blend=[{', '.join(entries)}]"


def _blend_help(
    paths: Annotated[list[str], typer.Argument(metavar="DIR|PREFIX|TOKENIZE_RUN...", help="Prefixes (with or "
                                               "without .bin/.idx), folders of them, or tokenization run directories.")],
    weights: Annotated[list[float] | None, typer.Option("--weights", metavar="W...", help="One weight per path, "
                                                        "all after one flag: --weights 0.7 0.3 (default: token counts).")] = None,
    output: Annotated[str | None, typer.Option("--output", metavar="FILE", help="Write the blend file here; a "
                                               "recipe takes it as data.blend_file. Not inside a run directory "
                                               "(change a run's blend with `megalaunch resume RUN --set ...`).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Help-only twin of `blend`."""


def _mix_help(
    folders: Annotated[list[str], typer.Option("--folders", metavar="DIR...", help="Source folders, all after "
                                               "one flag: --folders A B.")],
    weights: Annotated[list[float], typer.Option("--weights", metavar="W...", help="One weight per folder: "
                                                 "--weights 0.8 0.2.")],
    output: Annotated[str, typer.Option("--output", metavar="DIR", help="The mixture folder to write.")],
    mode: Annotated[str, typer.Option("--mode", metavar="<links|blend>", help="links: whole pairs without "
                                      "repetition; blend: a data_blend.txt over every pair.")] = "links",
    seed: Annotated[int, typer.Option("--seed", help="Shuffle seed of each source's pairs.")] = 1234,
    train_tokens: Annotated[float | None, typer.Option("--train-tokens", metavar="T", help="Tokens you will "
                                                       "train on: adds how many epochs of each source that is.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Help-only twin of `mix`."""


@app.command(context_settings=_RAW, add_help_option=False)
def mix(ctx: typer.Context) -> None:
    """Build a data mixture: --folders A B --weights 0.8 0.2 --output M [--mode links|blend].

    links (default): a folder of links to whole .bin/.idx pairs chosen without repetition until the
    limiting source is exhausted, shares in tokens (swiss-ai semantics). blend: every pair with the
    weights spread over them; Megatron repeats small sources to reach their share."""
    parser = _ArgParser(prog="data mix", description=mix.__doc__, add_help=False)
    parser.add_argument("--folders", nargs="+", required=True)
    parser.add_argument("--weights", nargs="+", type=float, required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--mode", choices=("links", "blend"), default="links")
    parser.add_argument("--seed", type=int, default=1234, help="shuffle seed of each source's pairs")
    parser.add_argument("--train-tokens", type=float, default=None,
                        help="tokens you will train on: adds how many epochs of each source that is")
    parser.add_argument("--json", action="store_true")
    args = _parse(parser, list(ctx.args), ctx, _mix_help)
    from megalaunch.data.mix import format_report, plan_mixture, write_mixture
    from megalaunch.rundir.paths import refuse_frozen_write

    refuse_frozen_write(args.output, "--output")

    mixture = plan_mixture(args.folders, args.weights, mode=args.mode, seed=args.seed)
    out = write_mixture(mixture, args.output)
    if args.json:
        emit_json({"output": str(out), "mode": mixture.mode, "tokens": mixture.tokens,
                   "sources": mixture.report_rows()})
        return
    say(format_report(mixture, int(args.train_tokens) if args.train_tokens else None))
    use = f"{out}" if mixture.mode == "links" else f"{out}/data_blend.txt"
    say(f"mixture written to {out}; train on it with data: [{use}]" if mixture.mode == "links"
        else f"blend written to {use}")
