"""The DFlash drafter and its objective (pure torch; no I/O but export)."""
from .anchors import IGNORE, Anchors, block_labels, block_positions, block_teacher, build_blocks, sample_anchors
from .attention import BACKENDS, Mask, attention, compiled_flex, make_mask
from .config import DrafterConfig, default_gamma, default_target_layer_ids
from .drafter import DFlashDrafter, DrafterCache
from .export import load_drafter, reference_config, reference_keys, save_drafter, serving_problems
from .loss import LossOutput, dflash_loss, uses_target
from .masks import block_mask, dense_mask, reference_allowed

__all__ = [
    "IGNORE", "Anchors", "block_labels", "block_positions", "block_teacher", "build_blocks", "sample_anchors",
    "BACKENDS", "Mask", "attention", "compiled_flex", "make_mask",
    "DrafterConfig", "default_gamma", "default_target_layer_ids",
    "DFlashDrafter", "DrafterCache", "load_drafter", "reference_config", "reference_keys", "save_drafter",
    "serving_problems",
    "LossOutput", "dflash_loss", "uses_target", "block_mask", "dense_mask", "reference_allowed",
]
