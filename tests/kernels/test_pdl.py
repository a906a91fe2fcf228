"""`kernels.pdl`: on by default, off by the environment, and never where it cannot run (CPU, the
interpreter, before sm_90)."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.kernels import pdl

pytestmark = pytest.mark.timeout(60)


def test_on_by_default_off_by_the_environment_and_on_cpu(monkeypatch):
    import importlib

    monkeypatch.delenv(pdl.ENV, raising=False)
    assert importlib.reload(pdl).ENABLED  # read from the environment at import: on unless asked off
    assert not pdl.enabled(torch.device("cpu"))  # on, but no CUDA device
    monkeypatch.setenv(pdl.ENV, "0")
    assert not importlib.reload(pdl).ENABLED
    assert pdl.options(torch.device("cuda", 0)) == {"PDL": False}  # off: decided before asking the device
    monkeypatch.setenv(pdl.ENV, "1")
    assert importlib.reload(pdl).ENABLED
    monkeypatch.undo()  # the environment as the run had it, then the module read from it again
    importlib.reload(pdl)


def test_never_without_the_intrinsics(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "gdc_wait", None)  # as on a Triton that lacks griddepcontrol
    assert pdl.options(torch.device("cuda", 0)) == {"PDL": False}  # decided before asking the device


def test_never_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "INTERPRETING", True)  # as TRITON_INTERPRET=1 at import
    assert pdl.options(torch.device("cuda", 0)) == {"PDL": False}  # decided before asking the device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_where_asked_on_hopper(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "INTERPRETING", False)
    dev = torch.device("cuda", 0)
    hopper = torch.cuda.get_device_capability(dev)[0] >= 9
    assert pdl.options(dev) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
