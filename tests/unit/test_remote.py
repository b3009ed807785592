"""Remote use over SSH without a network: the ssh command lines (quoting, BatchMode, the control
socket), what travels, the protocol's checks, the one-line errors, the routing, and the laptop's half
against a stand-in `ssh` that records its argv (the secret must never be in it). The real sshd and
Slurm: tests/slurm/test_remote_slurm.py."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from megalaunch.errors import MegalaunchError, RemoteError
from megalaunch.remote.client import explain_start, run_remote
from megalaunch.remote.route import route, take_host
from megalaunch.remote.server import materialize, secret_names
from megalaunch.remote.ship import Request, build_request, parse_words
from megalaunch.remote.ssh import (
    SshTarget,
    command_argv,
    control_dir,
    explain_ssh,
    master_argv,
    remote_command,
)
from megalaunch.remote.wire import (
    WireError,
    decode_env,
    decode_hello,
    decode_request,
    encode_hello,
    encode_request,
)

SUBMIT_OPTS = {"--set", "-s", "--name", "--backend", "--cluster", "--from-hf"}


def _opts(_command: str) -> set[str]:
    return SUBMIT_OPTS


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: a control socket's path has at most 104 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mlssh-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_remote_command_quotes_every_word_so_nothing_is_shell_syntax() -> None:
    target = SshTarget("me@login", "env PYTHONPATH='/a b' /venv/bin/megalaunch")
    cmd = remote_command(target, ["remote-side", "$(rm -rf ~); `x`"])
    assert cmd.startswith("exec ")
    assert shlex.split(cmd) == ["exec", "env", "PYTHONPATH=/a b", "/venv/bin/megalaunch", "remote-side",
                                "$(rm -rf ~); `x`"]
    assert "'$(rm -rf ~); `x`'" in cmd


def test_every_ssh_line_is_batch_mode_over_the_private_control_socket(tmp_path: Path) -> None:
    target = SshTarget("me@login", config="/cfg")
    sock = tmp_path / "s"
    for argv in (master_argv(target, sock), command_argv(target, sock, ["remote-side"])):
        assert argv[1:3] == ["-F", "/cfg"]
        pairs = {argv[i + 1] for i, w in enumerate(argv) if w == "-o"}
        assert {"BatchMode=yes", f"ControlPath={sock}/%C"} <= pairs
        assert argv[argv.index("--") + 1] == "me@login"  # after `--`: never read as an option
    assert {"ControlMaster=yes", "ControlPersist=600"} <= set(master_argv(target, sock))
    assert "-N" in master_argv(target, sock) and "-f" in master_argv(target, sock)
    cmd = command_argv(target, sock, ["remote-side"])
    assert "ControlMaster=no" in cmd and "-T" in cmd and cmd[-1] == "exec megalaunch remote-side"


@pytest.mark.parametrize("host", ["-oProxyCommand=x", "", "a b", "me@lo\ngin"])
def test_a_host_that_ssh_would_read_as_an_option_is_refused(host: str) -> None:
    with pytest.raises(RemoteError, match="not an SSH destination"):
        SshTarget(host)


def test_the_control_directory_is_private_and_a_shared_one_is_refused(short_tmp: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = short_tmp
    monkeypatch.setenv("MEGALAUNCH_SSH_CONTROL_DIR", str(tmp_path / "ctl"))
    made = control_dir()
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)
    with pytest.raises(RemoteError, match="not a private directory"):
        control_dir()
    (tmp_path / "link").symlink_to(made)
    made.chmod(0o700)
    monkeypatch.setenv("MEGALAUNCH_SSH_CONTROL_DIR", str(tmp_path / "link"))
    with pytest.raises(RemoteError, match="not a private directory"):
        control_dir()
    monkeypatch.setenv("MEGALAUNCH_SSH_CONTROL_DIR", str(tmp_path / ("x" * 60)))
    with pytest.raises(RemoteError, match="too long a path for a socket"):
        control_dir()


@pytest.mark.parametrize(("stderr", "words"), [
    ("ssh: Could not resolve hostname nope: Name or service not known", "does not resolve"),
    ("me@login: Permission denied (publickey).", "refused your SSH key"),
    ("Host key verification failed.", "host key is unknown"),
    ("ssh: connect to host login port 22: Connection refused", "refused the connection"),
    ("ssh: connect to host login port 22: Connection timed out", "no answer"),
    ("kex_exchange_identification: read: Connection reset by peer", "failed (exit 255): kex_exchange"),
])
def test_ssh_failures_become_one_line_with_a_fix(stderr: str, words: str) -> None:
    text = str(explain_ssh("login", 255, "Warning: something\n" + stderr + "\n"))
    assert words in text and "fix:" in text and "\n" not in text


def test_a_missing_or_old_megalaunch_there_is_named() -> None:
    target = SshTarget("login", "/opt/ml/bin/megalaunch")
    missing = str(explain_start(target, 127, "bash: line 1: /opt/ml/bin/megalaunch: No such file or directory\n"))
    assert "megalaunch is not found on login" in missing and "cluster.ssh.megalaunch" in missing
    old = str(explain_start(target, 2, "megalaunch: error: No such command 'remote-side'.\n"))
    assert "too old" in old
    assert "refused your SSH key" in str(explain_start(target, 255, "Permission denied (publickey)."))


def test_parse_words_finds_the_recipe_and_value_options() -> None:
    argv = ["--debug", "submit", "--set", "a=1", "r.yaml", "--cluster=c.yaml", "-s", "b=2", "--dry-run"]
    words = parse_words(argv, SUBMIT_OPTS)
    assert words is not None and argv[words.command] == "submit"
    assert [argv[i] for i in words.positionals] == ["r.yaml"]
    assert words.options["--cluster"] == [(5, "--cluster=")]
    assert [argv[i] for i, _ in words.options["-s"]] == ["b=2"]


def test_local_recipe_files_travel_with_their_includes_and_shipped_names_do_not(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "exp").mkdir()
    base = tmp_path / "common" / "base.yaml"
    base.write_text("include: [tiny]\ntraining: {lr: 0.001}\n")
    absolute = tmp_path / "common" / "abs.yaml"
    absolute.write_text("training: {train_iters: 5}\n")
    recipe = tmp_path / "exp" / "r.yaml"
    recipe.write_text(f"# mine\ninclude: [../common/base.yaml, {absolute}]\nname: r\n")
    profile = tmp_path / "prof.yaml"
    profile.write_text("cluster: {partition: gpu}\n")
    req = build_request(["submit", str(recipe), "--cluster", str(profile), "--from-hf", "/cluster/hf"], SUBMIT_OPTS)
    key = "files/" + str(recipe).lstrip("/")
    assert set(req.files) == {key, "files/" + str(base).lstrip("/"), "files/" + str(absolute).lstrip("/"),
                              "files/" + str(profile).lstrip("/")}
    assert yaml.safe_load(req.files[key])["include"] == ["../common/base.yaml", "../common/abs.yaml"]
    assert req.files["files/" + str(base).lstrip("/")].startswith("include: [tiny]")  # untouched: tiny is shipped
    assert req.argv[1] == key and req.argv[-1] == "/cluster/hf"  # --from-hf: a cluster path, as written
    assert req.file_args == [(1, ""), (3, "")]
    # on the login node: the same layout under a private directory; includes resolve
    argv = materialize(decode_request(encode_request(req)), tmp_path / "there")
    from megalaunch.config.loader import load_tree
    tree, _ = load_tree(argv[1], cluster=argv[3])
    assert tree["training"]["train_iters"] == 5 and tree["cluster"]["partition"] == "gpu"


def test_a_shipped_name_or_a_cluster_path_travels_as_written() -> None:
    req = build_request(["submit", "tiny", "--cluster", "slurm"], SUBMIT_OPTS)
    assert req == Request(["submit", "tiny", "--cluster", "slurm"])
    req = build_request(["submit", "/cluster/only/r.yaml"], SUBMIT_OPTS)
    assert req.files == {} and req.argv == ["submit", "/cluster/only/r.yaml"]
    assert build_request(["status", "run"], SUBMIT_OPTS) == Request(["status", "run"])


@pytest.mark.parametrize("key", ["/etc/passwd", "../x", "a/../../x", ""])
def test_the_login_node_refuses_a_file_outside_its_directory(key: str) -> None:
    with pytest.raises(WireError):
        decode_request(encode_request(Request(["submit", key], {key: "x"}, [(1, "")])))


def test_the_login_node_names_the_host_the_laptop_used_in_its_hints() -> None:
    from megalaunch.cli import output

    assert decode_request(encode_request(Request(["status"], via="me@login"))).via == "me@login"
    assert decode_request(encode_request(Request(["status"], via="-oProxyCommand=x"))).via is None
    try:
        output.VIA_HOST = "me@login"
        assert output.ml() == "megalaunch --host me@login"
    finally:
        output.VIA_HOST = None
    assert output.ml() == "megalaunch"


def test_the_environment_line_carries_only_what_was_asked() -> None:
    assert decode_hello(encode_hello(["WANDB_API_KEY"])) == ["WANDB_API_KEY"]
    assert decode_hello(b"Welcome to the cluster!\n") is None
    line = b'{"env": {"WANDB_API_KEY": "k", "LD_PRELOAD": "/evil.so", "X": 3}}\n'
    assert decode_env(line, ["WANDB_API_KEY", "X"]) == {"WANDB_API_KEY": "k"}


def test_the_login_node_asks_for_the_recipes_secret_names(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("include: [tiny]\ncluster: {secret_env: [WANDB_API_KEY]}\n"
                      "chain: {notify: {webhook_env: [HOOK_URL]}}\n")

    def params(argv: list[str]) -> tuple[str, dict[str, object]]:
        return argv[0], {"recipe": argv[1], "dry_run": "--dry-run" in argv, "set_": [], "cluster": None}

    assert secret_names(["submit", str(recipe)], params) == ["HOOK_URL", "WANDB_API_KEY"]
    assert secret_names(["submit", str(recipe), "--dry-run"], params) == []
    assert secret_names(["submit", str(tmp_path / "missing.yaml")], params) == []  # the command says why


def test_host_from_the_flag_the_environment_or_the_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MEGALAUNCH_HOST", "MEGALAUNCH_REMOTE_COMMAND", "MEGALAUNCH_SSH_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    assert take_host(["status", "--host", "a@b", "run", "--", "--host"]) == ("a@b", ["status", "run", "--", "--host"])
    target, rest = route(["logs", "run", "-f", "--host=a@login"], _opts)
    assert target == SshTarget("a@login") and rest == ["logs", "run", "-f"]
    assert route(["status"], _opts) == (None, ["status"])
    monkeypatch.setenv("MEGALAUNCH_HOST", "env@login")
    assert route(["cancel", "r"], _opts)[0] == SshTarget("env@login")
    assert route(["cancel", "r", "--host", "local"], _opts)[0] is None
    monkeypatch.delenv("MEGALAUNCH_HOST")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("include: [tiny]\ncluster: {ssh: {host: prof@login, megalaunch: /v/bin/megalaunch}}\n")
    assert route(["submit", str(recipe)], _opts)[0] == SshTarget("prof@login", "/v/bin/megalaunch")
    monkeypatch.setenv("MEGALAUNCH_REMOTE_COMMAND", "ml")
    assert route(["submit", str(recipe), "-s", "cluster.ssh.host=x@y"], _opts)[0] == SshTarget("x@y", "ml")
    with pytest.raises(MegalaunchError, match="--host works with submit"):
        route(["recipes", "list", "--host", "a@b"], _opts)


def test_no_shipped_recipe_names_a_login_node() -> None:
    """route.py loads a recipe a second time only when a local file or a --set may name cluster.ssh."""
    from megalaunch.config.recipe_files import shipped_recipes

    assert [name for name, path in shipped_recipes().items() if "ssh" in path.read_text()] == []


def _stand_in_ssh(tmp_path: Path) -> Path:
    """`ssh` that records its argv, answers `-O check`, and runs the remote command here with sh."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {tmp_path}/argv.log\n"
                    "for last; do :; done\ncase \" $* \" in *' -O '*) exit 0;; esac\nexec sh -c \"$last\"\n")
    fake.chmod(0o755)
    return bin_dir


# the login node's half, stood in: asks for SECRET_X, tells what it got and exits 7
STAND_IN = r"""
import json, sys
req = json.loads(sys.stdin.buffer.readline())
sys.stdout.write('Welcome!\nmegalaunch-remote 1 {"needs": ["SECRET_X", "UNSET_Y"]}\n'); sys.stdout.flush()
env = json.loads(sys.stdin.buffer.readline())["env"]
print("argv", req["argv"], "via", req["via"], "files", sorted(req["files"]), "env", sorted(env),
      env.get("SECRET_X") == "s3cret-42")
print("to stderr", file=sys.stderr)
sys.exit(7)
"""


def test_the_secret_goes_on_stdin_and_the_exit_status_comes_back(tmp_path: Path, short_tmp: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    monkeypatch.setenv("PATH", f"{_stand_in_ssh(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("MEGALAUNCH_SSH_CONTROL_DIR", str(short_tmp))
    monkeypatch.setenv("SECRET_X", "s3cret-42")
    (tmp_path / "side.py").write_text(STAND_IN)
    target = SshTarget("me@login", f"{sys.executable} {tmp_path / 'side.py'}")
    rc = run_remote(target, Request(["status", "run"]))
    out, err = capfdbinary.readouterr()
    assert rc == 7
    assert b"argv ['status', 'run'] via me@login files [] env ['SECRET_X'] True" in out  # UNSET_Y: unset, not sent
    assert b"Welcome!" in err and b"to stderr" in err and b"Welcome" not in out
    logged = (tmp_path / "argv.log").read_text()
    assert "-O check" in logged and "remote-side" in logged and "BatchMode=yes" in logged
    assert "s3cret-42" not in logged


def test_a_remote_side_that_never_says_hello_is_one_line(tmp_path: Path, short_tmp: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{_stand_in_ssh(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("MEGALAUNCH_SSH_CONTROL_DIR", str(short_tmp))
    with pytest.raises(RemoteError, match="megalaunch is not found on me@login"):
        run_remote(SshTarget("me@login", "/nowhere/megalaunch"), Request(["status"]))


def test_a_closed_reader_stops_the_remote_command(tmp_path: Path, short_tmp: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`megalaunch --host H logs RUN | head`: when head is done, the command there ends too."""
    monkeypatch.setenv("PATH", f"{_stand_in_ssh(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("MEGALAUNCH_SSH_CONTROL_DIR", str(short_tmp))
    (tmp_path / "side.py").write_text(
        "import sys\nsys.stdin.buffer.readline()\nprint('megalaunch-remote 1 {\"needs\": []}', flush=True)\n"
        "sys.stdin.buffer.readline()\nwhile True:\n    print('x' * 100, flush=True)\n")
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "wb") as out:
        rc = run_remote(SshTarget("me@login", f"{sys.executable} {tmp_path / 'side.py'}"), Request(["logs", "r"]),
                        out=out)
    assert rc == 141
