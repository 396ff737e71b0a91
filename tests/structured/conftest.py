import pytest

from moeserve.structured import params as so_params


@pytest.fixture
def builtin(monkeypatch):
    """The hand-written engine (MOESERVE_STRUCTURED_BACKEND=builtin) for one test: the default is llguidance."""
    monkeypatch.setattr(so_params, "BACKEND", "builtin")
    yield "builtin"
