"""Draft sources that need no model: host-side token logic for speculative decoding (`engine.drafting`)."""
from megatron_rollout.drafts.ngram import NgramIndex

__all__ = ["NgramIndex"]
