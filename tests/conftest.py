"""Shared fixtures: hypothesis profiles, a real S3-protocol server (moto) and store URLs."""

from __future__ import annotations

import os
import uuid
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None,
                          max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(var, value)


@pytest.fixture(autouse=True)
def _torch_determinism_restored() -> Iterator[None]:
    """``Trainer(deterministic=True)`` switches torch's deterministic algorithms on for the whole
    process; a later test must not run under it (some kernels refuse sub-byte dtypes then)."""
    import torch

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """moto's S3 server on 127.0.0.1 with one bucket; yields fsspec storage options."""
    pytest.importorskip("s3fs")
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
