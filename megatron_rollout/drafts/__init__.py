"""Draft sources that need no model: host-side token logic for speculative decoding (`engine.drafting`)."""
from megatron_rollout.drafts.ngram import Family, NgramIndex

__all__ = ["Family", "NgramIndex"]
