"""`python -m benchmarks.kernel_ptx OUT [--tree DIR]`: the sm_90 PTX of the Triton attention kernels,
compiled on this host (Triton and `ptxas`, no GPU), one file per kernel and setting, with debug
info, comments and local labels left out; `--against OTHER` then says, per kernel, whether the
instructions are the same as in OTHER (a folder this command wrote from another tree).

This checks a source change that should not change the code (a helper factored out of several
kernels, say) without a GPU: Triton inlines `@triton.jit` helpers, so equal instructions mean equal
timings. The settings are the model's decode and verify ones (qwen3-30b-a3b heads: 32 query, 4 KV
of 128; MLA: 16 heads, latent 512 + rope 64).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BF16 = {"Q", "KC", "VC", "KV", "Out"}
FP32 = {"PartO", "PartM", "PartL"}


def _signature(fn) -> dict[str, str]:
    return {n: "*bf16" if n in BF16 else "*fp32" if n in FP32 else "fp32" if n == "scale_log2"
            else "i32" if n.startswith("stride") else "constexpr" if n.isupper() else "*i32" for n in fn.arg_names}


def kernels() -> dict[str, tuple]:
    from megatron_rollout.kernels import mla_attention as mla
    from megatron_rollout.kernels import triton_attention as gqa

    page = dict(PAGE=16, PDL=False)
    head = dict(GROUP=8, D=128, D_P=128, **page)
    return {
        "decode": (gqa.JIT_KERNELS["decode"], dict(GROUP_P=16, RUN=1, BLOCK_N=64, **head), 4, 3),
        "verify": (gqa.JIT_KERNELS["decode"], dict(GROUP_P=8, RUN=8, BLOCK_N=32, **head), 4, 2),
        "prefill": (gqa.JIT_KERNELS["prefill"], dict(GROUP_P=8, TOK=16, BLOCK_N=128, **head), 8, 3),
        "mla_decode": (mla.JIT_KERNELS["decode"], dict(HEADS=16, BLOCK_H=16, R=512, R_P=512, DR=64, DR_P=64,
                                                    BLOCK_N=32, **page), 4, 2),
        "mla_prefill": (mla.JIT_KERNELS["prefill"], dict(HEADS=16, BLOCK_H=16, TOK=4, R=512, R_P=512, DR=64, DR_P=64,
                                                      BLOCK_N=32, **page), 4, 2),
    }


def instructions(ptx: str) -> str:
    """The PTX without its debug sections, `.loc`/`.file` lines, comments and `$L__tmp` labels."""
    ptx = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    lines = [re.sub(r"//.*", "", line).rstrip() for line in ptx.splitlines()]
    return "\n".join(line for line in lines if line and not re.match(r"\s*(\.loc|\.file|\$L__tmp\d+:)", line))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_ptx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for the PTX files")
    p.add_argument("--tree", default=None, help="a source tree to compile instead of the installed package")
    p.add_argument("--against", default=None, help="a folder this command wrote: compare with it")
    args = p.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    differ = 0
    for name, (fn, consts, warps, stages) in kernels().items():
        compiled = triton.compile(ASTSource(fn=fn, signature=_signature(fn), constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        text = instructions(compiled.asm["ptx"])
        (out / f"{name}.ptx").write_text(text)
        verdict = ""
        if args.against:
            same = (Path(args.against) / f"{name}.ptx").read_text() == text
            differ += not same
            verdict = "  same instructions" if same else "  DIFFERENT"
        print(f"{name:12s} {len(text.splitlines()):6d} lines{verdict}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
