"""Fixtures around the stub Kubernetes API (`pytest_plugins = ["tests.conftest_kube"]`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube_stub import KubeStub


@pytest.fixture
def kube_stub() -> Iterator[KubeStub]:
    """A running, empty stub API server requiring `Bearer stub-token`; add objects with `.add()`."""
    with KubeStub() as stub:
        yield stub


@pytest.fixture
def kubeconfig(kube_stub: KubeStub, tmp_path: Path) -> Path:
    """A kubeconfig file (context `stub`, namespace `default`) pointing at `kube_stub`."""
    return kube_stub.write_kubeconfig(tmp_path / "kubeconfig")
