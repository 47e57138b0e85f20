"""KV-cache groups: kvpush pushes one group, and refuses engines that have more (pure).

vLLM splits a hybrid model's layers (full attention with sliding-window or Mamba layers) into
several KV-cache groups with their own block ids. The connector does not declare ``SupportsHMA``,
so vLLM turns the hybrid KV-cache manager off and puts every layer in one group where it can; an
engine that still ends up with more than one group is refused at start-up rather than pushed
wrongly.
"""

from __future__ import annotations

from typing import Any


class KvGroupsError(ValueError):
    """The engine's KV cache has more than one group."""


def require_single_group(kv_cache_config: Any) -> None:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return
    kinds = sorted({type(getattr(g, "kv_cache_spec", g)).__name__ for g in groups})
    raise KvGroupsError(
        f"KvPushConnector pushes a single KV-cache group, but this engine has {len(groups)} ({', '.join(kinds)}): "
        "hybrid models (sliding window, Mamba/SSM, cross-layer groups) are not supported. Leave "
        "--disable-hybrid-kv-cache-manager unset or set it (vLLM then merges the groups where it can), "
        "or serve the model without kvpush."
    )
