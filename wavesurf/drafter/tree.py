"""Shapes of draft trees: a chain of K tokens or an EAGLE-2 dynamic tree (depth, top_k, total
tokens), their checks, the drafted tree and its verification mask."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DecodeError, is_int


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree.

    ``depth``: most draft tokens on one path (levels below the root); ``top_k``: children tried per
    expanded node and the number of nodes expanded per level; ``total_tokens``: draft tokens kept
    for verification (the verify forward sees ``total_tokens + 1`` tokens: root + drafts). A
    chain of K tokens is ``TreeSpec(K, 1, K)``.
    """

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self) -> None:
        check_tree(self.depth, self.top_k, self.total_tokens)

    @classmethod
    def chain(cls, draft_len: int) -> TreeSpec:
        if not is_int(draft_len, 1):
            raise DecodeError(f"draft_len={draft_len!r} must be an integer >= 1")
        return cls(draft_len, 1, draft_len)

    @property
    def max_nodes(self) -> int:
        """Candidates the drafting produces: top_k at level 1, top_k * top_k at each later level."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    def describe(self) -> dict:
        return {"mode": "chain" if self.is_chain else "tree", "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total_tokens}


def check_tree(depth: Any, top_k: Any, total_tokens: Any) -> None:
    """Refuse tree settings that cannot be built (the message says what is allowed)."""
    for name, v in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
        if not is_int(v, 1):
            raise DecodeError(f"{name}={v!r} must be an integer >= 1")
    if total_tokens < depth:
        raise DecodeError(
            f"total_tokens={total_tokens} is smaller than depth={depth}: a path of depth {depth} needs "
            f"{depth} draft tokens; use total_tokens >= depth or a smaller depth")
    most = top_k + (depth - 1) * top_k * top_k
    if total_tokens > most:
        raise DecodeError(
            f"total_tokens={total_tokens} is more than the {most} candidates a tree with depth={depth}, "
            f"top_k={top_k} drafts (top_k + (depth-1)*top_k^2); use total_tokens <= {most}")


def make_tree(mode: str = "chain", *, draft_len: int = 4, depth: int = 5, top_k: int = 4,
              total_tokens: int = 16) -> TreeSpec:
    """``mode="chain"`` uses ``draft_len``; ``mode="tree"`` uses depth/top_k/total_tokens."""
    if mode == "chain":
        return TreeSpec.chain(draft_len)
    if mode == "tree":
        return TreeSpec(depth, top_k, total_tokens)
    raise DecodeError(f"mode={mode!r} is not one of 'chain', 'tree'")



@dataclass
class DraftTree:
    """A drafted tree: node i is verified at row i + 1 (row 0 is the root)."""

    tokens: list[int]  # target ids of draft nodes
    parent: list[int]  # node index, -1 = root
    level: list[int]  # 1..depth
    score: list[float]  # cumulative draft log-prob

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """A chain of tokens proposed with certainty (score 0), e.g. by n-gram lookup."""
        n = len(tokens)
        return cls(list(tokens), list(range(-1, n - 1)), list(range(1, n + 1)), [0.0] * n)


def tree_mask(tree: DraftTree, device: Any) -> torch.Tensor:
    """bool [n+1, n+1]: which verify row sees which (root + the node's ancestors and itself)."""
    n = len(tree.tokens) + 1
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[:, 0] = True
    for i in range(1, n):
        j = i
        while j > 0:
            mask[i, j] = True
            j = tree.parent[j - 1] + 1
    return mask


__all__ = ["DraftTree", "TreeSpec", "check_tree", "make_tree", "tree_mask"]
