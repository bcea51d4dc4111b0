"""Which policies the simulator runs, and which of them only place where KV has room.

Every policy is the router's own (router.placement); a policy worth trying is added
there, so the simulator and the router can never drift apart.
"""

from __future__ import annotations

from router.placement import POLICIES, PlacementPolicy, PrefixWeights, make_policy

SIM_POLICIES = POLICIES
# Policies that return a worker only if its headroom covers the request (the others check
# only that it is alive, large enough and under max_outstanding).
KV_BOUNDED = frozenset({"kv", "kv-least-loaded"})
# Policies that read the workers' prefix caches (CacheHits from the router's PrefixIndex).
CACHE_AWARE = frozenset({"prefix"})


def make_sim_policy(name: str, max_outstanding: int, prefix_weights: PrefixWeights | None = None) -> PlacementPolicy:
    """A real policy from router.placement."""
    return make_policy(name, max_outstanding, prefix_weights)
