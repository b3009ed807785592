"""Shared fixtures: every test gets its own registry of runs, so nothing leaks into ~/.local."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state-home")))
