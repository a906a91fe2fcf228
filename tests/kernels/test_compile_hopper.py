"""Kernels not yet run on a GPU compile for the H200 (sm_90) without one, with no spills.

`kernels.expert_sort`'s kernels, the split router (`fused._router_split_kernel`), the router
kernel on the helpers it now shares with it, the norm, SwiGLU and QKV norm + RoPE kernels at one
row and at a block of rows per program, and the Triton experts' fc2 without the weights; and, with
programmatic dependent launch (`kernels.pdl`), the order of its two instructions.

Why: the interpreter runs the kernels' logic on CPU but not Triton's compiler, which is stricter
(globals must be constexpr, layouts must convert, registers must fit). Where Triton, `ptxas` and
`cuobjdump` (shipped with Triton) are present, each kernel is compiled at the launch shapes the
module uses and its register use is read from the cubin. Skipped elsewhere (CI has no Triton) and
under `TRITON_INTERPRET=1`, where kernels are not compiled.
"""
from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from megatron_rollout.kernels import expert_sort, fused, moe_triton  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUOBJDUMP = shutil.which("cuobjdump") or (str(_BIN / "cuobjdump") if (_BIN / "cuobjdump").exists() else None)
PTXAS = shutil.which("ptxas") or (_BIN / "ptxas").exists()
pytestmark = [pytest.mark.skipif(CUOBJDUMP is None or not PTXAS, reason="needs ptxas and cuobjdump"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="compiles: not under the interpreter")]
LAYOUT = {"Flat": "*i64", "Dest": "*i64", "RowSource": "*i32", "BlockExpert": "*i32", "Ends": "*i32", "pairs": "i32",
          "rows": "i32", "blocks": "i32"}
SCAN = {"Base": "*i32", "Ends": "*i32", "RowSource": "*i32", "BlockExpert": "*i32", "chunks": "i32", "rows": "i32",
        "blocks": "i32"}
RANK = {"Flat": "*i64", "Base": "*i32", "Dest": "*i64", "RowSource": "*i32", "pairs": "i32"}
COUNT = {"Flat": "*i64", "Counts": "*i32", "pairs": "i32"}
ROUTER = {"X": "*bf16", "W": "*bf16", "Logits": "*fp32", "Arrived": "*i32", "Wout": "*bf16", "Ids": "*i64",
          "n_rows": "i32", "stride_x": "i32"}
FC2 = {"Act": "*bf16", "W2": "*bf16", "S2": "*bf16", "Y": "*bf16", "RowPair": "*i32", "BlockExpert": "*i32",
       "Weights": "*bf16", "num_experts": "i32"}
QKV = {"QKV_": "*bf16", "Q": "*bf16", "K": "*bf16", "V": "*bf16", "Cos": "*bf16", "Sin": "*bf16", "QW": "*bf16",
       "KW": "*bf16", "eps": "fp32", "inv_d": "fp32", "n_tokens": "i32", "stride_qkv": "i32", "stride_cos": "i32",
       "stride_sin": "i32"}
NORM = {"X": "*bf16", "Dlt": "*bf16", "W": "*bf16", "Y": "*bf16", "Hout": "*bf16", "eps": "fp32", "inv_n": "fp32",
        "n_rows": "i32", "stride_x": "i32", "stride_d": "i32", "stride_y": "i32", "stride_h": "i32"}
SILU = {"H": "*bf16", "A": "*bf16", "n_rows": "i32", "stride_h": "i32", "stride_a": "i32"}
SORT = dict(num_warps=4)
CASES = [  # (module, kernel, pointer/int signature, constexprs, options): the preset's sizes
    (expert_sort, "_layout_kernel", LAYOUT, dict(E=128, E_P=128, BM=16, DIV=1, C=expert_sort.CHUNK,
                                                 FILL=expert_sort.FILL), SORT),
    (expert_sort, "_layout_kernel", LAYOUT, dict(E=128, E_P=128, BM=1, DIV=8, C=expert_sort.CHUNK,
                                                 FILL=expert_sort.FILL), SORT),
    (expert_sort, "_count_kernel", COUNT, dict(E_P=128, C=expert_sort.CHUNKED), SORT),
    (expert_sort, "_scan_kernel", SCAN, dict(E=128, E_P=128, BM=128, C=expert_sort.CHUNK, FILL=expert_sort.FILL),
     SORT),
    (expert_sort, "_rank_kernel", RANK, dict(E_P=128, DIV=8, C=expert_sort.CHUNKED), SORT),
    (expert_sort, "_rank_kernel", RANK, dict(E_P=256, DIV=8, C=expert_sort.CHUNKED // 2), SORT),  # 256 experts
    (fused, "_router_split_kernel", ROUTER, dict(H=2048, E=128, E_P=128, ES=16, TOPK=8, TOPK_P=8, RENORM=True,
                                                 BM=fused.ROUTER_BLOCK_M, BK=128, DOT_FP32=False),
     dict(num_warps=4, num_stages=4)),
    (fused, "_router_kernel", {k: v for k, v in ROUTER.items() if k not in ("Logits", "Arrived")},
     dict(H=2048, E=128, E_P=128, TOPK=8, TOPK_P=8, RENORM=True, BM=fused.ROUTER_BLOCK_M, BK=128, DOT_FP32=False),
     dict(num_warps=4, num_stages=4)),  # the one-program kernel, on the helpers it now shares
    (fused, "_rmsnorm_kernel", NORM, dict(N_COLS=2048, BLOCK=2048, HAS_DELTA=True, ROWS=1), dict(num_warps=8)),
    (fused, "_rmsnorm_kernel", NORM, dict(N_COLS=2048, BLOCK=2048, HAS_DELTA=True, ROWS=4),
     dict(num_warps=8)),
    (fused, "_silu_mul_kernel", SILU, dict(F=768, BLOCK=1024, ROWS=1), dict(num_warps=4)),
    (fused, "_silu_mul_kernel", SILU, dict(F=768, BLOCK=1024, ROWS=4), dict(num_warps=8)),  # --row-blocks
    (fused, "_qkv_rope_kernel", QKV, dict(GROUPS=4, PER=8, PER_P=8, D=128, NORM=True, TOK=1),
     dict(num_warps=4)),  # decode: one token per program
    (fused, "_qkv_rope_kernel", QKV, dict(GROUPS=4, PER=8, PER_P=8, D=128, NORM=True, TOK=8),
     dict(num_warps=8)),  # a block of tokens per program (benchmarks.kernels --row-blocks)
    (moe_triton, "_fc2_kernel", FC2, dict(H=2048, F=768, BM=16, BN=64, BK=64, SCALED=False, GN=1, GK=1, KG=1, SE=1,
                                          WEIGHTED=False), dict(num_warps=4, num_stages=3)),  # weights by the combine
]


def _compile_sm90(fn, signature: dict, constexprs: dict, options: dict):
    """`fn` compiled for sm_90 ahead of time. Constexpr parameters left out take their defaults, given
    explicitly (Triton 3.7 no longer fills them in an ASTSource); `PDL` is on, as it launches by default
    on sm_90 (`kernels.pdl`), unless `constexprs` says otherwise."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **({"PDL": True} if "PDL" in defaults else {}), **constexprs}
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    pdl_on = bool(constexprs.get("PDL"))
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={**options, "launch_pdl": pdl_on})


@pytest.mark.parametrize("module,name,signature,constexprs,options", CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_kernels_compile_for_sm90_without_spills(module, name, signature, constexprs, options, tmp_path,
                                                 monkeypatch):
    monkeypatch.setenv("PATH", f"{os.environ.get('PATH', '')}:{_BIN}")
    kernel = _compile_sm90(getattr(module, name), signature, constexprs, options)
    cubin = tmp_path / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = [int(r) for r in re.findall(r"REG:(\d+)", usage)]
    local = [int(r) for r in re.findall(r"LOCAL:(\d+)", usage)]
    assert regs and max(regs) <= 255 and local and max(local) == 0, usage  # no spill to local memory


PDL_KERNELS = ("_layout_kernel", "_router_split_kernel", "_rmsnorm_kernel", "_qkv_rope_kernel", "_fc2_kernel")
PDL_CASES = [next(c for c in CASES if c[1] == name) for name in PDL_KERNELS]  # each one's first (decode) shape


@pytest.mark.parametrize("pdl_on", [True, False])
@pytest.mark.parametrize("module,name,signature,constexprs,options", PDL_CASES,
                         ids=[c[1] for c in PDL_CASES])
def test_pdl_entry_waits_then_triggers_only_when_asked(module, name, signature, constexprs, options, pdl_on,
                                                       monkeypatch):
    """With PDL the kernel's first global instructions are `griddepcontrol.wait` then
    `launch_dependents` (kernels.pdl's protocol: no memory access before the wait); without it
    neither is emitted, so the default kernels are the ones measured before."""
    monkeypatch.setenv("PATH", f"{os.environ.get('PATH', '')}:{_BIN}")
    kernel = _compile_sm90(getattr(module, name), signature, {**constexprs, "PDL": pdl_on}, options)
    ptx = kernel.asm["ptx"]
    if not pdl_on:
        assert "griddepcontrol" not in ptx
        return
    wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    first_memory = min((ptx.index(op) for op in ("ld.global", "st.global", "atom.global") if op in ptx),
                       default=len(ptx))
    assert wait < trigger < first_memory
    assert kernel.metadata.launch_pdl
