"""Where the engine's weights come from and how they change: the engine's weight store (updates
validated whole, versions, zero-copy binding), the cross-rank vote that applies an update on every
rank or none, and the bridge from an in-process Megatron-core `GPTModel` (its config, its names,
its sharded tensors gathered in buckets). See docs/design.md §4."""
