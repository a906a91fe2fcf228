"""FlashAttention 3 over the paged KV store (backend "flash"), from vLLM's build of it.

A forward with prefill spans runs as one `flash_attn_varlen_func` call over *all* its spans
(decode rows are spans of one new token): the cache `[slots, hkv, d]` is read as FA3's paged
layout `[blocks, block_size, hkv, d]` through the forward's block tables, `seqused_k` = cached +
new positions, and the causal mask aligned to the end of each span's keys is exactly "cached
prefix + new tokens". Forwards of decode rows only (the CUDA-graph decode step) and the KV store
keep the Triton kernels, so graphs capture nothing new. Asked for by name (`--attention flash`)
FA3 runs every prefill. `auto` takes it only in a process that has imported vLLM already: `import
vllm` sets NCCL_CUMEM_ENABLE, PYTORCH_NVML_BASED_CUDA_CHECK and inductor's compile threads for the
whole process (`vllm/env_override.py`), which a trainer embedding the rollout must not get unasked.
There it runs forwards of `AUTO_MIN_PREFILL_TOKENS` prefill tokens or more (below that the Triton
kernel was as fast or faster).

Where it comes from: `vllm.vllm_flash_attn` (vLLM's wheel ships FA3 compiled for sm_90 against
its torch; vLLM 0.26.0 pins torch 2.11). `missing` says why it cannot run: no CUDA, not a 9.x
device, vLLM absent, or its FA3 extension not importable. The FA3 package of the flash-attention
project (`flash_attn_interface`, a different signature) is not wired: it does not install on the
machines here, so it could not be tested.

Left out: FA3's scheduler metadata and split-KV tuning (its defaults), FP8 KV, and decode graphs
through FA3.
"""
from __future__ import annotations

import math
import sys

import torch

from megatron_rollout.kernels.registry import DecodeMeta, PrefillMeta, register
from megatron_rollout.kernels.triton_attention import TritonAttention


def _fa3():
    """vLLM's `flash_attn_varlen_func`, or ImportError saying why it is not there."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except Exception as exc:  # vLLM's import can fail in many ways; all mean "not available"
        raise ImportError(f"vllm.vllm_flash_attn does not import ({type(exc).__name__}: {exc}); "
                          "pip install vllm (0.26.0 matches torch 2.11)") from exc
    if not fa.FA3_AVAILABLE:
        raise ImportError(f"vLLM's FA3 extension is missing: {fa.FA3_UNAVAILABLE_REASON}")
    return fa.flash_attn_varlen_func


AUTO_MIN_PREFILL_TOKENS = 1024
"""Prefill tokens of a forward from which `auto` runs FA3: on the H200 it was 1.13x faster than the
Triton kernel at 1 x 1,024 new tokens, 1.08x at 4 x 512, 1.5x at 4,096, and 0.94x at 1 x 512
(`bench.attention`, fifth lease, docs/kernels.md)."""


@register
class FlashAttention(TritonAttention):
    """FA3 for forwards with at least `min_prefill_tokens` prefill tokens; Triton for the others,
    for decode-only forwards and for the KV store. The choice depends only on the forward's spans,
    so two schedules that form the same forwards (`off`, `mux`) run the same kernels."""

    name = "flash"

    @classmethod
    def for_auto(cls) -> "FlashAttention":
        return cls(AUTO_MIN_PREFILL_TOKENS)

    @classmethod
    def auto_missing(cls, device: torch.device) -> str | None:
        if "vllm" not in sys.modules:  # importing vLLM overrides NCCL and inductor settings process-wide
            return "vLLM is not imported in this process, and auto does not import it (--attention flash does)"
        return cls.missing(device)

    @classmethod
    def missing(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"FlashAttention 3 needs a CUDA device, got {device}"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            return f"FlashAttention 3 runs on compute capability 9.x (Hopper), this device is {major}.{minor}"
        try:
            _fa3()
        except ImportError as exc:
            return str(exc)
        return None

    def __init__(self, min_prefill_tokens: int = 0) -> None:
        if min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {min_prefill_tokens}")
        self.min_prefill_tokens = min_prefill_tokens
        self._varlen = None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeMeta | None,
               prefill: PrefillMeta | None, out: torch.Tensor) -> None:
        if prefill is None or prefill.tokens < self.min_prefill_tokens:
            return TritonAttention.attend(self, q, k_cache, v_cache, decode, prefill, out)
        self.prefill(q, k_cache, v_cache, prefill, out)  # every span, decode rows included

    def prefill(self, q, k_cache, v_cache, meta: PrefillMeta, out):
        if meta.tokens < self.min_prefill_tokens:
            return TritonAttention.prefill(self, q, k_cache, v_cache, meta, out)
        self._flash(q, k_cache, v_cache, meta, out)

    def _flash(self, q, k_cache, v_cache, meta: PrefillMeta, out):
        if meta.cu_q is None or meta.lens is None:
            raise ValueError("the flash backend needs the forward's cu_q and lens (kernels.layout.build_layout)")
        self._check(k_cache, q, "prefill")
        if self._varlen is None:
            self._varlen = _fa3()
        bs, hkv, d = meta.block_size, k_cache.shape[1], k_cache.shape[2]
        pages = k_cache.view(-1, bs, hkv, d), v_cache.view(-1, bs, hkv, d)
        self._varlen(q, *pages, max_seqlen_q=max(meta.max_new, 1), cu_seqlens_q=meta.cu_q,
                     max_seqlen_k=meta.max_len, seqused_k=meta.lens, softmax_scale=1.0 / math.sqrt(d), causal=True,
                     block_table=meta.tables, out=out, fa_version=3)
