"""`kernels.expert_sort`'s kernels compile for the H200 (sm_90) without a GPU, with no spills.

Why: the interpreter runs the kernels' logic on CPU but not Triton's compiler, which is stricter
(globals must be constexpr, layouts must convert, registers must fit). Where Triton, `ptxas` and
`cuobjdump` (shipped with Triton) are present, each kernel is compiled at the launch shapes the
module uses and its register use is read from the cubin. Skipped elsewhere (CI has no Triton).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from megatron_rollout.kernels import expert_sort  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUOBJDUMP = shutil.which("cuobjdump") or (str(_BIN / "cuobjdump") if (_BIN / "cuobjdump").exists() else None)
pytestmark = pytest.mark.skipif(CUOBJDUMP is None or shutil.which("ptxas") is None and not (_BIN / "ptxas").exists(),
                                reason="needs ptxas and cuobjdump")
LAYOUT = {"Flat": "*i64", "Dest": "*i64", "RowSource": "*i32", "BlockExpert": "*i32", "Ends": "*i32", "pairs": "i32",
          "rows": "i32", "blocks": "i32"}
SCAN = {"Base": "*i32", "Ends": "*i32", "RowSource": "*i32", "BlockExpert": "*i32", "chunks": "i32", "rows": "i32",
        "blocks": "i32"}
RANK = {"Flat": "*i64", "Base": "*i32", "Dest": "*i64", "RowSource": "*i32", "pairs": "i32"}
COUNT = {"Flat": "*i64", "Counts": "*i32", "pairs": "i32"}
CASES = [  # (kernel, pointer/int signature, constexprs): the preset's 128 experts, 256 experts' halved chunks
    ("_layout_kernel", LAYOUT, dict(E=128, E_P=128, BM=16, DIV=1, C=expert_sort.CHUNK, FILL=expert_sort.FILL)),
    ("_layout_kernel", LAYOUT, dict(E=128, E_P=128, BM=1, DIV=8, C=expert_sort.CHUNK, FILL=expert_sort.FILL)),
    ("_count_kernel", COUNT, dict(E_P=128, C=expert_sort.CHUNKED)),
    ("_scan_kernel", SCAN, dict(E=128, E_P=128, BM=128, C=expert_sort.CHUNK, FILL=expert_sort.FILL)),
    ("_rank_kernel", RANK, dict(E_P=128, DIV=8, C=expert_sort.CHUNKED)),
    ("_rank_kernel", RANK, dict(E_P=256, DIV=8, C=expert_sort.CHUNKED // 2)),
]


@pytest.mark.parametrize("name,signature,constexprs", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_expert_sort_kernels_compile_for_sm90_without_spills(name, signature, constexprs, tmp_path, monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    monkeypatch.setenv("PATH", f"{os.environ.get('PATH', '')}:{_BIN}")
    kernel = triton.compile(ASTSource(fn=getattr(expert_sort, name), signature=sig, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin = tmp_path / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = [int(r) for r in re.findall(r"REG:(\d+)", usage)]
    local = [int(r) for r in re.findall(r"LOCAL:(\d+)", usage)]
    assert regs and max(regs) <= 255 and local and max(local) == 0, usage  # no spill to local memory
