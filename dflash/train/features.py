"""Target side: run the frozen target and capture only the selected layers' hidden states (forward hooks).

Features for target layer id are `hidden_states[id + 1]` of HF's output_hidden_states, as the reference, SGLang
and our evaluator take them: the output of decoder layer `id`, except for the last layer (id = L-1), whose entry
is after the decoder's final norm. We hook those layers' outputs (the final norm's for L-1) directly and stop the
forward right before the first layer not needed (a pre-hook on it), so neither later layers nor the LM head run.

`train.compile_target`: `LayerCapture.compile()` compiles, in place, every module the capture runs through (decoder
layers 0..last, the final norm when captured), one by one: regional compilation, so identical layers share one graph
per input shape. The hooks stay outside the graphs (only `forward` is compiled), and the stop hook sits on a layer
that is never compiled. `warm_up` compiles every shape bucket single-threaded; after it, `guarded` calls fail on any
new graph (compile_guard); the compiled forwards are safe to call from several threads (dflash.compile_threads).

What a training run captures (`run_capture`, `feature_width`): the drafter's context layers (target_layer_ids, k*H
columns, the fc reads them) and, with train.objective kl or ce+kl, one more H columns: layer L-1, i.e.
hidden_states[L], the state after the final norm that the LM head reads (the target's next-token distribution is
softmax(lm_head(it))). The target then runs every layer. These travel as one tensor [b, S, (k+1)*H] between workers.
"""
from __future__ import annotations

import threading
import time

import torch
from torch import nn

from dflash import compile_threads
from dflash.families import final_norm
from dflash.config_model import TrainSection
from dflash.train import compile_guard, precision


class _Done(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder.layers


def feature_width(drafter_config, train_cfg: TrainSection) -> int:
    """Columns of a training run's features: k*H context, plus H (the target's final-norm state) for kl / ce+kl."""
    from dflash.model import uses_target
    return (drafter_config.num_context_layers + uses_target(train_cfg.objective)) * drafter_config.hidden_size


def run_capture(model: nn.Module, ctx) -> "LayerCapture":
    """The capture a training run (both runtimes, the warm-up stage) makes on the target `model`: see above."""
    from dflash.model import uses_target
    ids = list(ctx.drafter_config.target_layer_ids)
    if uses_target(ctx.cfg.train.objective):
        ids.append(len(decoder_layers(model)) - 1)
    capture = LayerCapture(model, ids)
    precision.apply_target(nn.ModuleList(capture.modules), ctx.cfg.train)   # train.fp8_target: before compile()
    return capture


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
        self.compiled = False
        self._out: dict[int, torch.Tensor] = {}
        # hooks act only during this capture's own call, on its own thread (several captures may share a model, and
        # another thread may run the model meanwhile: the in-training evaluation, dflash/evaluate/live.py)
        self._active = None
        self._handles = []
        L = len(layers)
        self.modules = list(layers[:self.last + 1])     # what the capture runs through (what compile() compiles)
        for i in set(self.layer_ids):
            module = layers[i]
            if i == L - 1:   # hidden_states[L] is the final norm's output (its name per family: dflash.families)
                module = final_norm(model)
                if not isinstance(module, nn.Module):
                    raise ValueError(f"target layer id {i} is the last layer, but the decoder "
                                     f"{type(self.decoder).__name__} has no final norm to take its features after")
                self.modules.append(module)
            self._handles.append(module.register_forward_hook(self._hook(i)))
        if self.last + 1 < L:  # the first layer not needed stops the forward before it runs
            self._handles.append(layers[self.last + 1].register_forward_pre_hook(self._stop))

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i):
        def hook(module, args, output):
            if self._active == threading.get_ident():
                self._out[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def _stop(self, module, args):
        if self._active == threading.get_ident():
            raise _Done

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Right-padded rows need no attention mask: causal attention keeps real tokens from seeing the padding,
        # and the drafter never reads a padded position. This keeps sdpa on its fast causal path.
        self._out, self._active = {}, threading.get_ident()
        try:
            self.decoder(input_ids=input_ids, use_cache=False)
        except _Done:
            pass
        finally:
            self._active = None
        # a target split over devices (train.target_split): each layer's output to the input's device
        out = torch.cat([self._out[i].to(input_ids.device) for i in self.layer_ids], dim=-1)
        self._out = {}
        return out

    # ---- train.compile_target ---------------------------------------------------------------------------------
    def compile(self) -> None:
        """Compile the forward of every module the capture runs through, in place (state_dict names unchanged);
        traced in warm_up. The forward, not the module's whole call (`module.compile()`): the hooks then run eagerly
        around the graph in any torch version, while dynamo's handling of hooks inside a compiled call varies
        (it does not guard on them by default, so a graph traced with one layer's hook could serve another layer)."""
        for m in self.modules:
            m.forward = compile_threads.compiled(m.forward, fullgraph=True, dynamic=False)
        self.compiled = True

    def warm_up(self, device: torch.device, shapes, vocab_size: int, workers: int = 1) -> dict:
        """Run (compile, when compiled) the capture for every (batch, length) shape, single-threaded, holding the FX
        guard exclusively; `workers`: the compiled workers of this process (RunContext.compiled_workers). The record
        has the drafter warm-up's keys (summary.json's compile section sums both)."""
        before, t0, per_shape = compile_guard.counters(), time.perf_counter(), []
        with compile_threads.exclusive():
            compile_guard.allow_compiles()
            compile_guard.configure_thread(len(shapes), workers)
            for b, s in shapes:
                t = time.perf_counter()
                g = torch.Generator(device="cpu").manual_seed(s)
                self(torch.randint(0, vocab_size, (b, s), generator=g).to(device))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                per_shape.append({"batch": b, "length": s, "seconds": round(time.perf_counter() - t, 3)})
        after = compile_guard.counters()
        return {"device": str(device), "role": "target", "compiled": self.compiled, "shapes": per_shape,
                "modules": len(self.modules), "graphs": after["graphs"] - before["graphs"],
                "cache_hits": after["cache_hits"] - before["cache_hits"],
                "cache_misses": after["cache_misses"] - before["cache_misses"],
                "seconds": round(time.perf_counter() - t0, 3)}

    def guarded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The capture after warm-up: a compiled one fails on any new graph."""
        if not self.compiled:
            return self(input_ids)
        with compile_guard.no_new_graphs(f"target batch {tuple(input_ids.shape)} on {input_ids.device}"):
            return self(input_ids)
