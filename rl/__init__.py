"""Colocated RL on top of the rollout engine: trajectories, GRPO loss, environments, the asyncio
rollout driver, trainers (native and Megatron) and the GRPO loop (docs/design.md §3, top layer)."""
