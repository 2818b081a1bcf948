"""Hypothesis profiles: 'ci' (selected when CI=true) keeps example counts bounded and
derandomised so the whole suite stays under 10 minutes on 2 cores; 'dev' explores more."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev"))


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test starts from the same framework seed, so failures reproduce."""
    import minidl
    minidl.set_seed(0)
    yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)
