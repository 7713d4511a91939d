"""Speculative decoding with the target and a drafter; acceptance length (tau) and losslessness."""
from .specdec import (DFlashDraft, Draft, Generation, OracleDraft, RandomDraft, accept_greedy, accept_sampling,
                      speculative_generate, target_generate)

__all__ = ["DFlashDraft", "Draft", "Generation", "OracleDraft", "RandomDraft", "accept_greedy", "accept_sampling",
           "speculative_generate", "target_generate"]
