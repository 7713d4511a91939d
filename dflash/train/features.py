"""Target side: run the frozen target and capture only the selected layers' hidden states (forward hooks).

Features for target layer id are `hidden_states[id + 1]` of HF's output_hidden_states, as the reference, SGLang
and our evaluator take them: the output of decoder layer `id`, except for the last layer (id = L-1), whose entry
is after the decoder's final norm. We hook those layers' outputs (the final norm's for L-1) directly and stop the
forward right after the last one needed, so neither later layers nor the LM head run.
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
        self._active = False     # hooks act only during this capture's own call (several captures may share a model)
        self._handles = []
        L = len(layers)
        for i in set(self.layer_ids):
            module = layers[i]
            if i == L - 1:   # hidden_states[L] is the final norm's output
                module = getattr(self.decoder, "norm", None)
                if not isinstance(module, nn.Module):
                    raise ValueError(f"target layer id {i} is the last layer, but the decoder "
                                     f"{type(self.decoder).__name__} has no final `norm` to take its features after")
            self._handles.append(module.register_forward_hook(self._hook(i)))

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i):
        def hook(module, args, output):
            if not self._active:
                return
            self._out[i] = output[0] if isinstance(output, tuple) else output
            if i == self.last:
                raise _Done
        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Right-padded rows need no attention mask: causal attention keeps real tokens from seeing the padding,
        # and the drafter never reads a padded position. This keeps sdpa on its fast causal path.
        self._out, self._active = {}, True
        try:
            self.decoder(input_ids=input_ids, use_cache=False)
        except _Done:
            pass
        finally:
            self._active = False
        out = torch.cat([self._out[i] for i in self.layer_ids], dim=-1)
        self._out = {}
        return out
