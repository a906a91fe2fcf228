"""Fast device paths for the rollout's hot loops: paged attention and grouped-GEMM experts.

Why a package of its own: the model and the KV store stay portable (pure PyTorch, CPU and GPU);
what is specific to one device family (Triton kernels, `torch._grouped_mm`, graph-safe routing)
lives here behind small interfaces, chosen at run time through a registry with lazy imports
(`registry.resolve_attention`). The portable implementation is always registered, so asking for
"auto" never fails; asking for a missing backend by name fails with an install hint.

Modules:
- `registry`: the attention-kernel interface, the registry, and the portable (torch) backend;
- `triton_attention`: Triton kernels for KV stores, split-K paged decode, paged causal prefill;
- `varlen`: prefill through `torch.nn.attention.varlen.varlen_attn` on gathered K/V;
- `layout`: host-side index building for one forward (block tables, slots, tiles) and the
  `AttentionBackend` that the model calls;
- `moe`: a single-rank expert exchange with no host synchronisation (CUDA-graph safe);
- `moe_triton`: Triton expert MLPs for small batches and FP8 weights;
- `expert_sort`: the expert sort of a decode batch in one Triton launch;
- `fused`: Triton kernels for a decode step's small operations.

Left out: FP8 attention / FP8 KV, multi-rank graph capture (collectives inside graphs), and any
backward pass: these paths serve inference only.
"""
