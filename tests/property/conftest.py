"""Hypothesis profiles for the property tests. `megalaunch` (the default) keeps the directory well under
two minutes on two cores; HYPOTHESIS_PROFILE=thorough runs many more examples (e.g. before a release)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                       HealthCheck.filter_too_much, HealthCheck.data_too_large]}
settings.register_profile("megalaunch", max_examples=40, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "megalaunch"))
