"""Process-level NVSHMEM and per-domain symmetric buffers."""
import importlib.util

import pytest
import torch

from megatron_rollout.comm import nvshmem

has_nvshmem = importlib.util.find_spec("nvshmem") is not None


@pytest.mark.skipif(has_nvshmem, reason="nvshmem4py is installed")
def test_missing_nvshmem4py_gives_install_hint():
    with pytest.raises(ImportError, match="need nvshmem4py and cuda-core: pip install nvshmem4py"):
        nvshmem.init_nvshmem(None, torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not has_nvshmem, reason="needs nvshmem4py")
def test_one_init_and_per_domain_buffers_on_one_gpu():
    device = torch.device("cuda", 0)
    runtime = nvshmem.init_nvshmem(None, device)
    assert nvshmem.init_nvshmem(None, device) is runtime  # once per process
    p, d = nvshmem.SymmetricBuffers("P/normal", runtime), nvshmem.SymmetricBuffers("D/low_latency", runtime)
    a = p.tensor("recv", (64, 32), torch.bfloat16)
    b = d.tensor("recv", (8, 32), torch.float32)
    a.fill_(1.5)
    b.copy_(torch.arange(256.0, device=device).view(8, 32))
    assert a.device == device and a.shape == (64, 32) and a.dtype == torch.bfloat16
    assert a.data_ptr() != b.data_ptr()  # each domain owns its own buffers
    assert float(a.float().sum()) == 1.5 * 64 * 32 and float(b.sum()) == sum(range(256))
    with pytest.raises(ValueError, match="already allocated"):
        p.tensor("recv", (1,), torch.float32)
    p.free()
    d.free()
    nvshmem.finalize_nvshmem()
