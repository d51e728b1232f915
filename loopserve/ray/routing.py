"""The routing policy of the replica fleet: which engine replica serves a request.

Owns: the affinity key of a prompt (the chained hash of its first full KV pages, computed by the
prefix cache's own `block_hashes`, so "the same key" means "the same cached pages"), each
replica's load, and the choice: the affine replica (highest rendezvous weight of the key among
the healthy replicas) unless it is saturated or too far above the least-loaded one, then the
least-loaded healthy replica. Must not: import Ray or talk to replicas (the ingress feeds it
loads and follows its decisions), or tokenize (callers hand it token ids).

Rendezvous hashing keeps a key on its replica while replicas come and go: when one fails, only its
keys move, and they come back when it does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from loopserve.engine.prefix_cache import block_hashes


class NoHealthyReplicaError(RuntimeError):
    """Every replica is down (failed, or restarting)."""


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    # Full KV pages at the start of a prompt that make its affinity key; prompts shorter than one
    # page have no key (they go to the least-loaded replica). 0 turns affinity off.
    affinity_pages: int = 4
    # Load (see `ReplicaLoad.load`) at which the affine replica counts as saturated.
    saturation: float = 0.85
    # The affine replica is passed over when its load exceeds the least-loaded's by more than this.
    max_imbalance: float = 0.5
    # Seconds between the ingress's polls of every replica's load and health.
    poll_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.affinity_pages < 0:
            raise ValueError(f"affinity_pages must be >= 0, got {self.affinity_pages}")
        if not self.saturation > 0:
            raise ValueError(f"saturation must be > 0, got {self.saturation}")
        if not self.max_imbalance >= 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica: int  # index of the replica in the fleet
    healthy: bool
    rows: int  # requests running or waiting on it
    max_rows: int  # requests it runs at once (max_num_seqs)
    kv_pages_used: int
    kv_pages_total: int

    @property
    def load(self) -> float:
        """The busier of its rows and its KV cache, as a fraction (waiting rows can exceed 1)."""
        rows = self.rows / self.max_rows if self.max_rows else 0.0
        pages = self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0
        return max(rows, pages)


@dataclass(frozen=True, slots=True)
class Decision:
    replica: int
    # "affinity": the key's replica; "saturated": the key's replica was too busy, least-loaded
    # instead; "least_loaded": the prompt has no key.
    reason: str


def affinity_key(token_ids: Sequence[int], block_size: int, pages: int) -> bytes | None:
    """The prefix cache's chained hash of the first `pages` full pages (fewer if the prompt has
    fewer); None when it has no full page or `pages` is 0."""
    usable = min(len(token_ids), pages * block_size)
    hashes = block_hashes(list(token_ids[:usable]), block_size)
    return hashes[-1] if hashes else None


class RoutingPolicy:
    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = 0  # rotates ties between equally loaded replicas

    def choose(self, key: bytes | None, replicas: Sequence[ReplicaLoad]) -> Decision:
        """The replica for a request whose prompt has affinity `key`.

        Raises:
            NoHealthyReplicaError: no replica is healthy.
        """
        healthy = [replica for replica in replicas if replica.healthy]
        if not healthy:
            raise NoHealthyReplicaError("no engine replica is healthy")
        least = self._least_loaded(healthy)
        if key is None:
            return Decision(least.replica, "least_loaded")
        affine = max(healthy, key=lambda replica: _weight(key, replica.replica))
        too_busy = affine.load >= self.config.saturation
        if too_busy or affine.load - least.load > self.config.max_imbalance:
            return Decision(least.replica, "saturated")
        return Decision(affine.replica, "affinity")

    def _least_loaded(self, healthy: Sequence[ReplicaLoad]) -> ReplicaLoad:
        self._turn += 1
        count = len(healthy)
        ranked = sorted(
            enumerate(healthy), key=lambda item: (item[1].load, (item[0] - self._turn) % count)
        )
        return ranked[0][1]


def _weight(key: bytes, replica: int) -> bytes:
    """The rendezvous weight of `replica` for `key` (the highest weight wins)."""
    return hashlib.blake2b(key + replica.to_bytes(4, "little"), digest_size=8).digest()
