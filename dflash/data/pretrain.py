"""Next-token pre-training of the targets built here (tiny, code) on one token stream, and a stream's mean NLL.

- `pretrain(model, tokens, steps, batch_size, seq_len, lr, ...)` -> {"losses", "steps", "seconds", ...}: packed
  random windows of the stream, AdamW (fused on CUDA), warm-up over the first tenth then cosine to a tenth of `lr`,
  bf16 autocast on CUDA, gradient clip 1.0. Bounded by `steps` and, when given, by `max_seconds` of training after
  the first step (which holds the compile): the schedule then follows whichever of the two is further along.
- `mean_nll(model, tokens, seq_len, windows, batch_size)` -> {"nll", "perplexity", "windows", "tokens"}: evenly
  spaced windows of the stream, every position scored.
- `loss_summary(losses)` -> loss_start, loss_end, loss_curve (the build records' keys).
- `compile_layers(model)`: compile each decoder layer in place (identical layers share one graph per shape).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

log = logging.getLogger("dflash.target")


def lr_at(pos: float, steps: int, lr: float) -> float:
    """Learning rate at schedule position `pos` (a step, or its time equivalent) of `steps`."""
    warm = max(1, steps // 10)
    if pos < warm:
        return lr * (pos + 1) / warm
    t = min(1.0, (pos - warm) / max(1, steps - warm))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _autocast(device):
    import torch
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _stream(tokens, device):
    import numpy as np
    import torch
    data = torch.from_numpy(np.ascontiguousarray(tokens)) if isinstance(tokens, np.ndarray) else \
        torch.tensor(tokens, dtype=torch.long)
    return data.to(device)


def _windows(data, starts, seq_len):
    """[len(starts), seq_len + 1] token windows of the stream `data` (on its device) at `starts` (CPU)."""
    import torch
    idx = starts[:, None] + torch.arange(seq_len + 1)
    return data[idx.to(data.device)].long()


def compile_layers(model) -> None:
    """Compile every decoder layer of `model` in place (state_dict names unchanged): regional compilation."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for layer in decoder.layers:
        layer.compile(dynamic=False)


def pretrain(model, tokens, steps: int, batch_size: int, seq_len: int, lr: float, seed: int = 0,
             progress: bool = True, max_seconds: float | None = None, label: str = "target") -> dict:
    """Pre-train `model` (on its device) on random windows of `tokens` (a list or int array). Returns
    {"losses", "steps", "seconds", "first_step_seconds", "tokens_seen", "stopped_by"}."""
    import torch
    from tqdm import tqdm

    device = next(model.parameters()).device
    data = _stream(tokens, device)
    if data.numel() <= seq_len + 1:
        raise ValueError(f"corpus too small for seq_len {seq_len}: {data.numel()} tokens")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    sync_every = 1 if device.type == "cpu" else 10       # a GPU runs ahead; its losses are read every 10 steps
    model.train()
    pending, losses = [], []
    t0 = time.perf_counter()
    t_first = None                                       # end of the first step: the time budget starts there
    stopped_by = "steps"
    bar = tqdm(total=steps, desc=f"pretrain {label}", disable=not progress, mininterval=2.0)
    step = 0
    while step < steps:
        elapsed = time.perf_counter() - t_first if t_first is not None else 0.0
        if max_seconds is not None and elapsed >= max_seconds:
            stopped_by = "time"
            break
        pos = max(step, steps * elapsed / max_seconds) if max_seconds else step
        for g in opt.param_groups:
            g["lr"] = lr_at(pos, steps, lr)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        batch = _windows(data, starts, seq_len)
        with _autocast(device):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        pending.append(loss.detach())
        step += 1
        if t_first is None or step % sync_every == 0 or step == steps:
            losses += torch.stack(pending).tolist()     # waits for the device
            pending = []
            if t_first is None:
                t_first = time.perf_counter()
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if not progress and step % max(1, steps // 6) < sync_every:   # no bar (a pipe, a log file): a line
                log.info("pretrain %s: step %d/%d, loss %.3f", label, step, steps, losses[-1])
    if pending:
        losses += torch.stack(pending).tolist()
    bar.close()
    model.eval()
    end = time.perf_counter()
    return {"losses": losses, "steps": step, "seconds": end - t0,
            "first_step_seconds": (t_first or end) - t0, "tokens_seen": step * batch_size * seq_len,
            "stopped_by": stopped_by}


def loss_summary(losses: list[float]) -> dict:
    """loss_start / loss_end (means of the first and last tenth, at most 10 steps each) and a 50-point curve."""
    k = max(1, min(10, len(losses) // 10)) if losses else 1
    return {"loss_start": round(sum(losses[:k]) / k, 4) if losses else None,
            "loss_end": round(sum(losses[-k:]) / k, 4) if losses else None,
            "loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 50)]]}


def mean_nll(model, tokens, seq_len: int, windows: int, batch_size: int) -> dict:
    """Mean next-token NLL (nats) of `model` over `windows` evenly spaced windows of `tokens` (fewer when the stream
    is short; one window of the whole stream when it is shorter than seq_len + 1)."""
    import torch

    device = next(model.parameters()).device
    data = _stream(tokens, device)
    n = data.numel()
    if n < 2:
        raise ValueError(f"a stream of {n} tokens has no next token to score")
    seq_len = min(seq_len, n - 1)
    last = n - seq_len - 1
    starts = torch.unique(torch.linspace(0, last, max(1, windows)).round().long())
    total, count = 0.0, 0
    # eager even where the layers are compiled for training: no inference graphs to compile for a few batches
    with torch.inference_mode(), _autocast(device), torch.compiler.set_stance("force_eager"):
        for i in range(0, len(starts), batch_size):
            batch = _windows(data, starts[i:i + batch_size], seq_len)
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                    batch[:, 1:].reshape(-1), reduction="sum")
            total += float(nll)
            count += batch[:, 1:].numel()
    mean = total / count
    return {"nll": round(mean, 4), "perplexity": round(math.exp(mean), 3), "windows": len(starts), "tokens": count}
