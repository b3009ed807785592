"""chain.notify (launcher/chain/notify.py) through the real `Chain` of a real run directory: a real HTTP
server on the loopback interface receives the webhooks, a real process the commands. A notification
that fails or hangs costs the run nothing (same decision, bounded time, a `notify_failed` event)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tests.unit.test_chain import RecordingScheduler, _ckpt, _outcome

from megalaunch.config.loader import load_recipe
from megalaunch.errors import PreflightError
from megalaunch.launcher.chain import successor as successor_module
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.chain.notify import GRACE_S
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import Decision, TriggerBox


class Hook:
    """A webhook receiver on 127.0.0.1 (port 0): every POST's JSON body, after an optional delay."""

    def __init__(self, delay_s: float = 0.0) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append({"json": json.loads(body), "type": self.headers["Content-Type"]})
                time.sleep(delay_s)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def messages(self) -> list[dict[str, Any]]:
        return [r["json"] for r in self.received]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.close()


def closed_port_url() -> str:
    """A loopback port nobody listens on (bound, then closed): connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


def make_chain(tmp_path: Path, *sets: str) -> tuple[RunPaths, RecordingScheduler, Chain]:
    loaded = load_recipe("tiny", [f"run.root={tmp_path}/runs", "chain.max_segments_without_progress=2",
                                  "training.train_iters=100", *sets])
    paths = write_run(prepare_run(loaded))
    sched = RecordingScheduler()
    return paths, sched, Chain(paths, sched)


def events(chain: Chain, name: str) -> list[dict[str, Any]]:
    return [e for e in chain.ledger.events() if e["event"] == name]


# --- the stops that need a person, and the finish -----------------------------------------------------

def test_a_storage_full_stop_posts_one_message_with_the_fix(tmp_path: Path, hook: Hook, monkeypatch) -> None:
    paths, sched, chain = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']")
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "storage_full", reason="OSError: [Errno 28] No space left on device")
    v = chain.end("1", 1)
    assert not v.proceed and v.reason.startswith("storage full, no retry can fix it")
    (msg,) = hook.messages()
    assert hook.received[0]["type"] == "application/json"
    assert msg["run"] == paths.root.name and msg["run_dir"] == str(paths.root) and msg["job_id"] == "1"
    assert msg["outcome"] == "stopped" and msg["needs_person"] is True and msg["reason"] == v.reason
    assert msg["fix"] and msg["fix"] == chain.ledger.stopped()["fix"]
    assert msg["status_command"] == f"megalaunch status {paths.root}"
    assert msg["status_command"] in msg["text"] and v.reason in msg["text"]  # Slack/Teams show `text`
    (told,) = events(chain, "notified")
    assert told["target"] == f"webhook {hook.url.rsplit('/', 1)[0]}" and told["outcome"] == "stopped"
    assert events(chain, "notify_failed") == []


def test_a_config_error_stop_posts_one_message(tmp_path: Path, hook: Hook, monkeypatch) -> None:
    paths, sched, chain = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']")
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "config_error", reason="ValueError: bad shape", fix="--set model.x=2")
    assert not chain.end("1", 1).proceed
    (msg,) = hook.messages()
    assert msg["outcome"] == "stopped" and "configuration error" in msg["reason"] and msg["fix"] == "--set model.x=2"


def test_the_crash_loop_guard_posts_once_when_it_stops_the_chain(tmp_path: Path, hook: Hook) -> None:
    paths, sched, chain = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']")
    chain.begin("1")
    assert chain.end("1", 1).proceed  # 1 of 2: the chain goes on, nobody is told
    assert hook.messages() == []
    chain.begin("100")
    v = chain.end("100", 1)
    assert not v.proceed
    (msg,) = hook.messages()
    assert msg["outcome"] == "stopped" and "2 consecutive segments without a new checkpoint" in msg["reason"]
    assert msg["job_id"] == "100"


def test_a_finished_chain_posts_finished(tmp_path: Path, hook: Hook, monkeypatch) -> None:
    paths, sched, chain = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']")
    chain.begin("1")
    _ckpt(paths, 100)
    _outcome(monkeypatch, paths, "1", "finished", iteration=100)
    assert not chain.end("1", 0).proceed
    (msg,) = hook.messages()
    assert msg["outcome"] == "finished" and msg["needs_person"] is False and "target" in msg["reason"]


def test_a_pause_the_successor_could_not_be_queued_needs_a_person(tmp_path: Path, hook: Hook,
                                                                    monkeypatch) -> None:
    class Refusing(RecordingScheduler):
        def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None) -> str | None:
            raise RuntimeError("slurmctld did not answer")

    monkeypatch.setattr(successor_module, "SUCCESSOR_RETRY_S", ())  # no retries' waits in a unit test
    paths, _, _ = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']")
    chain = Chain(paths, Refusing())
    chain.begin("1")
    _ckpt(paths, 40)
    _outcome(monkeypatch, paths, "1", "saved", iteration=40)
    v = chain.end("1", 0)
    assert not v.proceed and "pauses" in v.reason
    (msg,) = hook.messages()
    assert msg["outcome"] == "paused" and msg["needs_person"] and msg["fix"].startswith("megalaunch resume ")


# --- a person's own stop, and every segment -------------------------------------------------------------

def test_a_users_exit_trigger_and_cancel_tell_nobody(tmp_path: Path, hook: Hook, monkeypatch) -> None:
    paths, sched, chain = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']")
    chain.begin("1")
    TriggerBox(paths).write("exit", "done for today")
    TriggerBox(paths).consume_for(Decision.EXIT, 40, "1")
    _ckpt(paths, 40)
    _outcome(monkeypatch, paths, "1", "exited", iteration=40)
    assert not chain.end("1", 0).proceed
    paths2, _, chain2 = make_chain(tmp_path / "b", f"chain.notify.webhooks=['{hook.url}']")
    chain2.begin("1")
    paths2.cancel_requested.touch()
    _outcome(monkeypatch, paths2, "1", "failed", reason="killed")
    assert not chain2.end("1", 1).proceed and chain2.ledger.stopped() is not None
    paths3, _, chain3 = make_chain(tmp_path / "c", f"chain.notify.webhooks=['{hook.url}']")
    TriggerBox(paths3).write("abort", "wrong data")  # pending at segment start: also the user's own
    assert not chain3.begin("1").proceed and chain3.ledger.stopped() is not None
    assert hook.messages() == []
    assert events(chain, "notified") == events(chain2, "notified") == events(chain3, "notified") == []


def test_on_every_segment_tells_each_end_once_also_a_users_stop(tmp_path: Path, hook: Hook, monkeypatch) -> None:
    paths, sched, chain = make_chain(tmp_path, f"chain.notify.webhooks=['{hook.url}']",
                                     "chain.notify.on_every_segment=true")
    chain.begin("1")
    _ckpt(paths, 40)
    _outcome(monkeypatch, paths, "1", "saved", iteration=40)
    assert chain.end("1", 0).proceed
    chain.begin("100")
    _ckpt(paths, 60)
    _outcome(monkeypatch, paths, "100", "exited", iteration=60)
    assert not chain.end("100", 0).proceed
    first, second = hook.messages()
    assert (first["outcome"], first["segment"], first["needs_person"]) == ("continues", "saved", False)
    assert (second["outcome"], second["job_id"]) == ("stopped_by_user", "100")  # once, not also "ended"


# --- failures to tell cost the run nothing ----------------------------------------------------------------

def _storage_full_end(tmp_path: Path, monkeypatch, *sets: str) -> tuple[Chain, RecordingScheduler, Any, float]:
    paths, sched, chain = make_chain(tmp_path, *sets)
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "storage_full", reason="OSError: [Errno 28] No space left on device")
    t0 = time.monotonic()
    v = chain.end("1", 1)
    return chain, sched, v, time.monotonic() - t0


def test_a_webhook_that_is_down_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    chain, sched, v, took = _storage_full_end(tmp_path, monkeypatch, f"chain.notify.webhooks=['{closed_port_url()}']",
                                              "chain.notify.timeout_s=2")
    _, sched0, v0, _ = _storage_full_end(tmp_path / "plain", monkeypatch)  # the same run without notify
    assert (v.proceed, v.reason.split(":")[0]) == (v0.proceed, v0.reason.split(":")[0])
    assert sched.cancelled == sched0.cancelled == ["100"] and chain.ledger.stopped() is not None
    (failed,) = events(chain, "notify_failed")
    assert "refused" in failed["error"].lower() and failed["outcome"] == "stopped"
    assert took < 2 + GRACE_S


def test_a_slow_webhook_is_given_up_at_its_timeout(tmp_path: Path, monkeypatch) -> None:
    slow = Hook(delay_s=6)
    try:
        chain, sched, v, took = _storage_full_end(tmp_path, monkeypatch, f"chain.notify.webhooks=['{slow.url}']",
                                                  "chain.notify.timeout_s=1")
    finally:
        slow.close()
    assert not v.proceed and sched.cancelled == ["100"]
    assert len(slow.received) == 1  # it was asked, once
    (failed,) = events(chain, "notify_failed")
    assert "timed out" in failed["error"] and failed["seconds"] < 1 + GRACE_S
    assert took < 1 + GRACE_S + 1  # the segment's end waited about the timeout, not the server's 6 s


def test_a_command_gets_the_json_on_stdin_and_in_the_environment(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "told.json"
    script = tmp_path / "tell.py"
    script.write_text("import json, os, sys\n"
                      "data = sys.stdin.read()\n"
                      "json.dump({'stdin': json.loads(data), 'env': json.loads(os.environ['MEGALAUNCH_NOTIFY_JSON'])},"
                      " open(sys.argv[1], 'w'))\n")
    chain, _, v, _ = _storage_full_end(tmp_path, monkeypatch,
                                       f"chain.notify.commands=[['{sys.executable}', '{script}', '{out}']]")
    told = json.loads(out.read_text())
    assert told["stdin"] == told["env"] and told["stdin"]["outcome"] == "stopped"
    assert told["stdin"]["reason"] == v.reason
    (ok,) = events(chain, "notified")
    assert ok["target"] == f"command {sys.executable}"


def test_a_hanging_or_failing_command_is_killed_and_recorded(tmp_path: Path, monkeypatch) -> None:
    chain, sched, v, took = _storage_full_end(
        tmp_path, monkeypatch, f"chain.notify.commands=[['{sys.executable}', '-c', 'import time; time.sleep(60)'], "
                               f"['{sys.executable}', '-c', 'raise SystemExit(3)'], [/no/such/notifier]]",
        "chain.notify.command_timeout_s=1")
    assert not v.proceed and sched.cancelled == ["100"]
    errors = sorted(e["error"] for e in events(chain, "notify_failed"))
    assert len(errors) == 3 and any("exited with status 3" in e for e in errors)
    assert any("killed" in e for e in errors) and any("FileNotFoundError" in e for e in errors)
    assert took < 1 + GRACE_S + 1


# --- webhook URLs by variable name: never written -------------------------------------------------------

def test_a_webhook_named_by_variable_is_read_in_the_job_and_never_written(tmp_path: Path, hook: Hook,
                                                                          monkeypatch) -> None:
    secret_url = hook.url + "/T0SECRET/B0SECRET/abcdefghijklmnopqrstuvwx"
    monkeypatch.setenv("ML_TEST_TEAM_HOOK", secret_url)
    paths, sched, chain = make_chain(tmp_path, "chain.notify.webhook_env=[ML_TEST_TEAM_HOOK]")
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "config_error", reason="ValueError: x")
    chain.end("1", 1)
    (msg,) = hook.messages()
    assert msg["outcome"] == "stopped"
    assert events(chain, "notified")[0]["target"] == "webhook $ML_TEST_TEAM_HOOK"
    for f in paths.root.rglob("*"):
        if f.is_file():
            assert "SECRET" not in f.read_text(errors="replace"), f
    monkeypatch.delenv("ML_TEST_TEAM_HOOK")  # a later segment submitted from a shell without it
    chain2 = Chain(paths, sched)
    chain2.stop("2", "guard")
    (failed,) = events(chain2, "notify_failed")
    assert "ML_TEST_TEAM_HOOK is not set in the job's environment" in failed["error"]


def test_the_slurm_script_names_the_webhook_variable_and_mails_when_asked(tmp_path: Path) -> None:
    base = [f"run.root={tmp_path}", "cluster.backend=slurm"]
    plain = prepare_run(load_recipe("tiny", base)).files["job.sbatch"]
    assert "mail" not in plain
    script = prepare_run(load_recipe("tiny", [*base, "cluster.mail_user=ada.l+runs@example.org",
                                              "chain.notify.webhook_env=[TEAM_HOOK]"])).files["job.sbatch"]
    header = script.splitlines()
    i = header.index("#SBATCH --no-requeue")
    assert header[i + 1:i + 3] == ["#SBATCH --mail-user=ada.l+runs@example.org", "#SBATCH --mail-type=END,FAIL"]
    assert "# TEAM_HOOK" in script  # passed on by sbatch from the submitting shell, by name only
    mail_fail = prepare_run(load_recipe("tiny", [*base, "cluster.mail_user=a@b.org", "cluster.mail_type=FAIL"]))
    assert "#SBATCH --mail-type=FAIL\n" in mail_fail.files["job.sbatch"]


# --- config errors: one line, the field, what is valid, the fix --------------------------------------------

@pytest.mark.parametrize(("sets", "field", "must"), [
    (["cluster.mail_user=not-an-email"], "cluster.mail_user", "email address"),
    (["cluster.mail_user='a@b.org;rm -rf /'"], "cluster.mail_user", "email address"),
    (["cluster.mail_user=a@b.org", "cluster.mail_type=END,BOGUS"], "cluster.mail_type", "'BOGUS'"),
    (["chain.notify.webhooks=['https://hooks.slack.com/services/T0/B0/x']"], "chain.notify.webhooks[0]",
     "webhook_env"),
    (["chain.notify.webhooks=['https://me:pw@relay.example.org/hook']"], "chain.notify.webhooks[0]", "user:password@"),
    (["chain.notify.webhooks=['https://relay.example.org/hook?token=abc']"], "chain.notify.webhooks[0]", "?query"),
    (["chain.notify.webhooks=['https://relay.example.org/h/Xk29aLq0Zr8mWp4Tn7Ys']"], "chain.notify.webhooks[0]",
     "token-like"),
    (["chain.notify.webhooks=['file:///etc/passwd']"], "chain.notify.webhooks[0]", "http(s)"),
    (["chain.notify.webhook_env=['']"], "chain.notify.webhook_env[0]", "not an environment variable name"),
    (["chain.notify.webhook_env=['https://x.org/h']"], "chain.notify.webhook_env[0]", "not an environment"),
    (["chain.notify.commands=[[]]"], "chain.notify.commands[0]", "empty command"),
    (["chain.notify.timeout_s=0"], "chain.notify.timeout_s", "> 0"),
])
def test_bad_notify_and_mail_settings_are_one_line_errors(tmp_path: Path, sets: list[str], field: str,
                                                          must: str) -> None:
    with pytest.raises(PreflightError) as e:
        prepare_run(load_recipe("tiny", [f"run.root={tmp_path}", "cluster.backend=slurm", *sets]))
    line = str(e.value)
    assert "\n" not in line and e.value.field == field and must in line, line
    assert e.value.valid and e.value.fix
    if field.startswith("chain.notify.webhooks") and must != "http(s)":
        assert "webhook_env" in line  # the way out for a URL with a token


def test_a_secret_free_relay_url_is_allowed(tmp_path: Path) -> None:
    prepared = prepare_run(load_recipe("tiny", [f"run.root={tmp_path}",
                                                "chain.notify.webhooks=['http://alerts.internal:8080/megalaunch']"]))
    assert json.loads(prepared.files["runtime.json"])["notify"]["webhooks"] == ["http://alerts.internal:8080/megalaunch"]
    assert json.loads(prepare_run(load_recipe("tiny", [f"run.root={tmp_path}"])).files["runtime.json"])["notify"] is None
