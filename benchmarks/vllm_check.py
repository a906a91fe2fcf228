"""`python -m benchmarks.vllm_check`: does the carried vLLM bundle work here? (seconds, not minutes)

Imports vllm, starts `AsyncLLM` on a 2-layer Qwen3-MoE config with dummy weights (eager, no
torch.compile, so the check does not pay the peer's start-up) and generates 4 tokens from 8
prompt ids through the same prompt and sampling objects the peer uses. Prints one line
`vllm_check ok: <version>, generated [...]` and exits 0, or the error and exits 1. Left out:
performance (that is `benchmarks.vllm_peer`).
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from benchmarks.vllm_peer import ENV, write_model_dir
from megatron_rollout.model.config import PRESETS


async def _check(model_dir: Path) -> list[int]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
        generation_config="vllm", enable_prefix_caching=True, max_model_len=4096, enforce_eager=True,
        gpu_memory_utilization=0.3))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        tokens: list[int] = []
        async for out in engine.generate(TokensPrompt(prompt_token_ids=list(range(100, 108))), params,
                                         request_id="check"):
            tokens.extend(out.outputs[0].token_ids)
            if out.finished:
                break
        return tokens
    finally:
        engine.shutdown()


def main() -> int:
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    t0 = time.perf_counter()
    try:
        import vllm

        cfg = PRESETS["qwen3-30b-a3b-12l"].replace(num_layers=2)
        tokens = asyncio.run(_check(write_model_dir(Path("/tmp/mr-vllm-check"), cfg, 4096)))
    except Exception as exc:
        print(f"vllm_check FAILED: {type(exc).__name__}: {exc}", flush=True)
        return 1
    ok = len(tokens) == 4
    print(f"vllm_check {'ok' if ok else 'FAILED'}: {vllm.__version__}, generated {tokens} "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
