"""Hypothesis profiles for the property tests. `megalaunch` (the default, what CI runs) keeps the
directory well under two minutes on two cores and is derandomized: the same examples every run, so a
red CI always means a change broke something. HYPOTHESIS_PROFILE=explore draws new examples each
run and `thorough` many more: run them when touching the loader or the templates, and turn what they
find into a test in tests/unit/test_property_regressions.py. `inner` (scripts/test --fast: the inner loop,
not CI) is the default's first examples, fewer of them: the same derandomized examples, ~40 % of the time."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                       HealthCheck.filter_too_much, HealthCheck.data_too_large]}
settings.register_profile("megalaunch", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("inner", max_examples=16, derandomize=True, **_COMMON)
settings.register_profile("explore", max_examples=40, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "megalaunch"))
