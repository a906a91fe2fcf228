"""The suite's gate on Triton's interpreter: interpreter cases are skipped, with the fix named, on the
one known-broken pairing (Triton 3.6 or older with NumPy 2.4 or newer), and run on every other."""
import pytest

from tests import conftest

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("triton, numpy, broken", [
    ((3, 6), (2, 4), True), ((3, 5), (2, 5), True), ((3, 7), (2, 4), False), ((3, 6), (2, 3), False),
    (None, (2, 4), False), ((3, 6), None, False),
])
def test_the_broken_pairing_alone_is_named(monkeypatch, triton, numpy, broken):
    monkeypatch.setattr(conftest, "_release", lambda name: {"triton": triton, "numpy": numpy}[name])
    reason = conftest.interpreter_broken()
    assert (reason is not None) == broken
    if broken:
        assert "triton>=3.7" in reason and "numpy<2.4" in reason
