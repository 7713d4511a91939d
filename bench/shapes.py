"""The benchmark's shapes, read from a config file (config/h200.yaml by default), and the context factory.

`load(config, sets)` reads the config as the train stage does (dflash.config.load, `sets` as dotted-key overrides)
and gives its shapes: the context (the largest length bucket), anchors, block size, the target's architecture
(`target.arch`), the drafter's config over it, the loss chunk. `Shapes.run_context()` builds the RunContext a
training run would, by keyword, without a target folder or data on disk. A CPU test shrinks the same code through
`sets` (e.g. target.arch.hidden_size).

dflash is imported inside the functions only: bench/sections/drafter.py's drafter_variants imports this module in a
process that then puts another tree's dflash first on sys.path (`base:` variants).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO

H200, LONG, LONG32K = "config/h200.yaml", "config/h200-long.yaml", "config/h200-32k.yaml"
MASK_ID = 151669   # the mask token id the bench has always given the 8B-shaped drafter (any id in the vocabulary
#                    times the same; min(., vocab - 1) on a shrunk one)


@dataclass
class Shapes:
    loaded: object                  # dflash.config.Loaded

    @property
    def cfg(self):
        return self.loaded.cfg

    @property
    def context(self) -> int:
        """Tokens of the longest sequence: the largest length bucket."""
        return max(self.cfg.data.bucket_edges)

    @property
    def anchors(self) -> int:
        return self.anchors_at(self.context)

    def anchors_at(self, length: int) -> int:
        """train.num_anchors, or round(length * anchors_per_token) up to it (the run context's rule)."""
        t = self.cfg.train
        return t.num_anchors if t.anchors_per_token is None else max(1, min(t.num_anchors,
                                                                             round(length * t.anchors_per_token)))

    @property
    def block(self) -> int:
        return self.cfg.drafter.block_size

    @property
    def arch(self):
        return self.cfg.target.arch

    @property
    def hidden(self) -> int:
        return self.arch.hidden_size

    @property
    def vocab(self) -> int:
        return self.arch.vocab_size

    @property
    def mask_id(self) -> int:
        return min(MASK_ID, self.vocab - 1)

    @property
    def loss_chunk(self) -> int:
        return self.cfg.train.loss_chunk

    def target_config(self):
        """The target's transformers config, as the target stage writes it for `target.arch`."""
        from transformers import Qwen3Config
        a = self.arch
        return Qwen3Config(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                           num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                           num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
                           max_position_embeddings=a.max_position_embeddings, rope_theta=float(a.rope_theta),
                           tie_word_embeddings=False)

    def drafter_config(self):
        from dflash.model import DrafterConfig
        return DrafterConfig.from_target(self.target_config(), self.cfg.drafter, self.mask_id)

    @property
    def capture_layers(self) -> list[int]:
        """The target layers the drafter reads (drafter.target_layer_ids, or the default spacing)."""
        return list(self.drafter_config().target_layer_ids)

    @property
    def gamma(self) -> float:
        from dflash.model import default_gamma
        return self.cfg.train.gamma if self.cfg.train.gamma is not None else default_gamma(self.block)

    def run_context(self, backend: str = "flex", compiled: bool = True, shapes=(), folder: Path = Path("/tmp")):
        """The RunContext a train run of this config would build (no placement, no env, `folder` for its paths)."""
        from dflash.train.context import RunContext
        return RunContext(loaded=self.loaded, placement=None, backend=backend, run_dir=folder, data_dir=folder,
                          target_config=self.target_config(), drafter_config=self.drafter_config(), gamma=self.gamma,
                          env={}, compile=compiled, shapes=list(shapes))


def load(config: str = H200, sets: dict | None = None) -> Shapes:
    from dflash import config as C
    return Shapes(C.load(REPO / config, sets or {}))


def issue_shapes() -> list[tuple[int, int]]:
    """(context, anchors) of the drafter step compared with SpecForge's: config/h200.yaml's largest bucket, and the
    two largest of config/h200-long.yaml (anchors scaled with length): 3072/512, 8192/1024, 16384/2048."""
    base, long = load(H200), load(LONG)
    return [(base.context, base.anchors)] + [(e, long.anchors_at(e)) for e in sorted(long.cfg.data.bucket_edges)[-2:]]
