"""EAGLE-3 drafters on any set of target layers: head, draft vocabulary, training, speculative
decoding and export."""
from __future__ import annotations

from .features import FeatureSettings, FeatureStore, TargetHead, build_feature_store
from .head import DraftConfig, DraftHead, DrafterError, check_draft_layer_ids, load_head, save_head
from .train import TrainResult, TrainSettings, train_drafter
from .vocab import DraftVocab, build_draft_vocab

__all__ = ["DraftConfig", "DraftHead", "DrafterError", "check_draft_layer_ids", "load_head", "save_head",
           "DraftVocab", "build_draft_vocab", "FeatureSettings", "FeatureStore", "TargetHead", "build_feature_store",
           "TrainSettings", "TrainResult", "train_drafter"]
