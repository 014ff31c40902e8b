"""EAGLE-3 drafters on any set of target layers: head, draft vocabulary, training, speculative
decoding and export."""
from __future__ import annotations

from .head import DraftConfig, DraftHead, DrafterError, check_draft_layer_ids

__all__ = ["DraftConfig", "DraftHead", "DrafterError", "check_draft_layer_ids"]
