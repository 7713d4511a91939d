"""Target side: run the frozen target and capture only the selected layers' hidden states (forward hooks).

`hidden_states[id + 1]` of HF's output_hidden_states is the output of decoder layer `id`; we hook those layers'
outputs directly and stop the forward right after the last one, so neither later layers nor the LM head run.
"""
from __future__ import annotations

import torch
from torch import nn


class _Done(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder.layers


class LayerCapture:
    """`capture(input_ids) -> [B, S, k*H]`: the selected layers' outputs, concatenated in `layer_ids` order."""

    def __init__(self, model: nn.Module, layer_ids):
        self.model, self.layer_ids = model, list(layer_ids)
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        layers = self.decoder.layers
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"target layer ids {bad} out of range for a {len(layers)}-layer target")
        self.last = max(self.layer_ids)
        self._out: dict[int, torch.Tensor] = {}
        for i in set(self.layer_ids):
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args, output):
            self._out[i] = output[0] if isinstance(output, tuple) else output
            if i == self.last:
                raise _Done
        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Right-padded rows need no attention mask: causal attention keeps real tokens from seeing the padding,
        # and the drafter never reads a padded position. This keeps sdpa on its fast causal path.
        self._out = {}
        try:
            self.decoder(input_ids=input_ids, use_cache=False)
        except _Done:
            pass
        out = torch.cat([self._out[i] for i in self.layer_ids], dim=-1)
        self._out = {}
        return out
