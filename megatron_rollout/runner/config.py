"""Which runner executes forwards, and the CUDA runner's knobs (`RunnerConfig`, `EngineConfig.runner`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

RUNNER_KINDS = ("auto", "eager", "cuda")
RUNNER_ENV = "MEGATRON_ROLLOUT_RUNNER"
"""auto | eager | cuda: the CLI's `--runner` default where set (`runner_kind_from_env`)."""


def runner_kind_from_env() -> str:
    """The runner kind `$MEGATRON_ROLLOUT_RUNNER` names, "auto" when unset: the one place the
    environment is read (the CLI's `--runner` default); everything else passes `RunnerConfig.kind`."""
    kind = os.environ.get(RUNNER_ENV, "auto")
    if kind not in RUNNER_KINDS:
        raise ValueError(f"${RUNNER_ENV} must be auto, eager or cuda, got {kind!r}; unset it or fix its value")
    return kind


@dataclass(frozen=True)
class RunnerConfig:
    """Which runner executes forwards, and the CUDA runner's knobs (`runner.cuda`)."""

    kind: str = "auto"
    """auto (CudaRunner for a single-rank model on CUDA, else the portable ModelRunner) | eager
    (always ModelRunner) | cuda (CudaRunner, or an error saying why it cannot run)."""
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256)
    """Decode batch buckets captured as CUDA graphs; larger batches run eagerly. With speculative
    decoding a bucket counts one-query rows: a row and each of its k drafts (`runner.speculative`),
    so a batch of `rows` verifies in the bucket holding rows x (k + 1)."""
    use_graphs: bool = True
    """Replay decode from CUDA graphs (False: every forward eager, e.g. to compare)."""
    prefill_graph_tokens: tuple[int, ...] = (64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072,
                                             3584, 4096)
    """Token-count buckets of P and mixed forwards replayed as piecewise CUDA graphs on one rank
    (`runner.piecewise`); () or `use_graphs=False`: eager. Past the largest bucket a forward runs
    eagerly: its ~250 launches take the host about as long as the GPU's work at 4,096 tokens
    (`bench.profile`), so larger forwards bound by the GPU."""
    prefill_graph_rows: int = 256
    """Sampled rows a piecewise graph holds (at most its bucket's tokens); more run eagerly."""
    attention: str = "auto"
    """Attention kernels: auto | triton | varlen | flash | portable (see `kernels.registry`)."""
    async_prefill: bool = True
    """Yield `COMPLETION` boundaries until P's event fires instead of blocking on it."""
    d_priority: int = -1
    """Priority of the D stream (lower is higher; P's stream gets 0)."""
    decode_sms: int = 0
    """SMs that P's stream leaves out, so that a decode iteration beside a prefill segment always
    finds them free (`runner.partition`): P runs on a green context of the rest, D keeps its stream
    over the whole device. 0: P may use every SM. The driver rounds the count up (to 8 SMs on
    Hopper). It pays only where P and D are in flight together, so the engine allows it with the
    `mux` schedule only; P with no decode beside it still runs on its partition alone."""
    partition: str = "held"
    """With `decode_sms`: held (D keeps one stream and one set of decode graphs over the whole
    device, and finds the held-back SMs free beside P) | split (while a P forward is in flight, D
    runs on a green context of the held-back SMs alone, from decode graphs captured there: the two
    phases never share an SM, as in SGLang's PD multiplexing; otherwise D runs on the whole device)."""
    measure_expert_kernels: bool = True
    """Time the Triton and grouped-GEMM expert kernels at decode size once and use the faster."""
    fused_ops: bool = True
    """Choose the fused small-op kernels for the CUDA runner's model (`kernels.fused.install_fused_ops`
    through the model's ops hook: verified once on the device, skipped where they do not apply)."""
    decode_ahead: str = "auto"
    """Issue the next decode forward before the host has read this one's tokens (`engine.ahead`):
    auto (on for the CUDA runner on one rank; under n-gram drafting for the steps that draft nothing,
    `engine.drafting`; off under MTP drafting) | on (any single-rank runner; the portable one gains
    nothing, it is for tests; refused under MTP drafting) | off."""
    fp8: str = "off"
    """FP8 (e4m3) weights for the attention linears, dense MLPs and routed experts (`model.fp8`):
    off | tensor (one scale per weight) | block (one per 128 x 128 block). The engine quantises its
    model once at construction; weight updates are re-rounded in place. On CUDA the experts run in
    the decode graphs (`kernels.moe_triton`), elsewhere every FP8 matmul dequantises.
    Or Transformer Engine's FP8 layers (`model.te_layers`, where TE is installed): te-delayed |
    te-current | te-block, TE's recipe of that name on the attention linears and dense MLPs, and on
    the routed experts where TE's grouped GEMM runs the recipe (te-current, cuBLASLt >= 13.5)."""

    def __post_init__(self) -> None:
        if self.fp8 not in FP8_MODES and self.fp8 not in TE_FP8_MODES:
            raise ValueError(f"fp8 must be one of {[*FP8_MODES, *TE_FP8_MODES]}, got {self.fp8!r}")
        if self.kind not in RUNNER_KINDS:
            raise ValueError(f"the runner kind must be auto, eager or cuda, got {self.kind!r}")
        sizes = self.graph_batch_sizes
        if not sizes or not _positive_ints(sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"graph_batch_sizes must be positive ints, strictly increasing, got {sizes!r}")
        tokens = self.prefill_graph_tokens
        if not _positive_ints(tokens) or list(tokens) != sorted(set(tokens)):
            raise ValueError(f"prefill_graph_tokens must be positive ints, strictly increasing, got {tokens!r}")
        if not _positive_ints((self.prefill_graph_rows,)):
            raise ValueError(f"prefill_graph_rows must be a positive int, got {self.prefill_graph_rows!r}")
        if type(self.decode_sms) is not int or self.decode_sms < 0:
            raise ValueError(f"decode_sms must be an int >= 0 (SMs P's stream leaves out), got {self.decode_sms!r}")
        if self.partition not in ("held", "split"):
            raise ValueError(f"partition must be held or split, got {self.partition!r}")
        if self.decode_ahead not in ("auto", "on", "off"):
            raise ValueError(f"decode_ahead must be auto, on or off, got {self.decode_ahead!r}")


def _positive_ints(values) -> bool:
    return isinstance(values, tuple) and all(type(v) is int and v > 0 for v in values)  # not bool, not float


FP8_MODES: dict[str, int | None] = {"off": None, "tensor": None, "block": 128}
"""`RunnerConfig.fp8` -> the block size of `model.fp8.quantize_model_fp8` (None: per tensor)."""
TE_FP8_MODES: dict[str, str] = {"te-delayed": "delayed", "te-current": "current", "te-block": "block"}
"""`RunnerConfig.fp8` -> the `te_layers.TEConfig` recipe."""
