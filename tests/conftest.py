"""Shared fixtures: hypothesis profiles, a real S3-protocol server (moto) and store URLs."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any, Iterator

# The checkout's top-level folders ``kernels/`` and ``plugins/`` are ``tpde.kernels`` and
# ``tpde.plugins`` (the editable install maps them): on ``sys.path`` (``python -m pytest`` and
# pytest-xdist's workers put the working directory there) they would shadow packages of those
# names, such as Hugging Face's ``kernels`` that transformers imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import pytest
from hypothesis import HealthCheck, settings

# Reproducible everywhere, with or without CI=true: the same examples on every run and machine.
# HYPOTHESIS_PROFILE=explore draws fresh examples each run (and keeps a database of failures).
settings.register_profile("default", derandomize=True, deadline=None, database=None,
                          max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, max_examples=200,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(var, value)


#: Process-wide settings that Lightning, seeding or a test may change; put back after each test.
_ENVIRONMENT = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG", "HF_HUB_OFFLINE",
                "TRITON_INTERPRET", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK",
                "NODE_RANK")


@pytest.fixture(autouse=True)
def _global_state_restored() -> Iterator[None]:
    """No test runs under state an earlier one left behind: ``Trainer(deterministic=True)``
    switches torch's deterministic algorithms on for the whole process (some kernels then
    refuse sub-byte dtypes), ``seed_everything`` sets environment variables and every RNG.
    Every test starts with the global generators at one fixed seed, so a tensor drawn from
    them is the same whichever tests ran before (NumPy's and Python's are seeded from the
    operating system at import)."""
    import random

    import numpy as np
    import torch

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    environment = {k: os.environ.get(k) for k in _ENVIRONMENT}
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    for key, value in environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture()
def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on."""
    from campaigns.s3 import free_port as pick

    return pick()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """moto's S3 server on 127.0.0.1 with one bucket; yields fsspec storage options."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs and moto: pip install 'tpde[dev]'")
    from campaigns.s3 import moto_server

    with moto_server() as options:
        yield {"options": options}


@pytest.fixture(params=["local", "memory", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict[str, Any] | None]:
    """A fresh run location in each kind of store, with its storage options."""
    run = uuid.uuid4().hex[:10]
    if request.param == "local":
        return str(tmp_path / run), None
    if request.param == "memory":
        return f"memory://tpde-tests/{run}", None
    server = request.getfixturevalue("s3_server")
    return f"s3://tpde/{run}", server["options"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (real training, many processes) first, in their order: with
    several workers (``make test``) the longest start at once instead of one of them running
    alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
