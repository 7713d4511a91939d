"""The in-process generation driver of regeneration, and its batch sizing.

Public:
- `regenerate(model, tokenizer, prompts, max_new_tokens, temperature=0.0, batch_size=0, seed=0, progress=True,
  stop_ids=None, decoder="auto", compile=True, ignore_eos=False, cpu_batch_size=None, static_options=None)` ->
  (responses: list[list[int]] without the stop token, stats dict); decoder static|generate|auto (`dflash.data.decode`)
- `auto_batch_size(model, width, max_new_tokens, cpu_batch_size=None)` -> sequences per batch when batch_size is 0:
  from free GPU memory, or on CPU `cpu_batch_size` (None: the schema's `data.regenerate.cpu_batch_size`)
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("dflash.data")

MEMORY_FRACTION = 0.6       # of the free GPU memory that a batch's KV cache and logits may take
MAX_BATCH = 1024


def _default_cpu_batch_size() -> int:
    from dflash.config_model import RegenerateSection
    return RegenerateSection.model_fields["cpu_batch_size"].default


def auto_batch_size(model, width: int, max_new_tokens: int, cpu_batch_size: int | None = None) -> int:
    """Sequences per generate call that fit MEMORY_FRACTION of the free GPU memory: the KV cache of
    width + max_new_tokens positions (every layer's K and V) plus the last-position logits. On CPU (no memory to
    size it from) `cpu_batch_size`, None: the default of data.regenerate.cpu_batch_size."""
    import torch
    device = next(model.parameters()).device
    if device.type != "cuda":
        return cpu_batch_size or _default_cpu_batch_size()
    from dflash.data.decode import kv_heads
    c = model.config
    head_dim, heads = kv_heads(c)
    elem = next(model.parameters()).element_size()
    per_seq = 2 * c.num_hidden_layers * heads * head_dim * elem * (width + max_new_tokens) + 8 * c.vocab_size
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(MAX_BATCH, MEMORY_FRACTION * free // per_seq)))


def _batching(model, prompts, longest, max_new_tokens, batch_size, static, compile, cpu_batch_size, options):
    """(batch size, static decoder or None): the model's kept decoder if it fits (batch_size 0: whatever its batch;
    `options`: the StaticDecoder's), else batch_size, 0 sized by `auto_batch_size` (static: equal batches, the last
    one filled to the fixed shape)."""
    from dflash.data.decode import cache_len, decoder_for
    need = longest + max_new_tokens
    dec = decoder_for(model, batch_size or None, need, compile, **options) if static else None
    if not batch_size and dec is None:
        width = cache_len(need) - max_new_tokens if static else longest
        batch_size = auto_batch_size(model, width, max_new_tokens, cpu_batch_size)
        if static and prompts:
            batch_size = -(-len(prompts) // -(-len(prompts) // max(1, batch_size)))
        on_gpu = next(model.parameters()).device.type == "cuda"
        log.info("regeneration batch size %d (%s)", batch_size,
                 "from free GPU memory" if on_gpu else "on the CPU: data.regenerate.cpu_batch_size")
        if static:
            dec = decoder_for(model, batch_size, need, compile, **options)
    return (dec.B, dec) if static else (batch_size, None)


def _left_padded(prompts, rows, pad):
    """(ids, attention mask), both (len(rows), longest), the prompts of `rows` left-padded with `pad`."""
    import torch
    width = max(len(prompts[i]) for i in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for r, i in enumerate(rows):
        p = prompts[i]
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        att[r, width - len(p):] = 1
    return ids, att


def _use_static(model, decoder: str, device) -> bool:
    """The static decoder for decoder static, and for auto on GPU; never for a target whose cache holds recurrent or
    convolution states (a static KV cache holds no such state; refused for decoder static)."""
    from dflash.errors import UserError
    from dflash.families import CONV, RECURRENT, family
    static = decoder == "static" or (decoder == "auto" and device.type == "cuda")
    fam = family(model.config)
    if static and fam is not None and fam.cache in (RECURRENT, CONV):
        if decoder == "static":
            raise UserError(f"data.regenerate.decoder static: the target ({fam.label}) carries {fam.cache} states the "
                            f"static KV cache does not hold; use data.regenerate.decoder: generate (or auto)")
        static = False
    return static


class _Generate:
    """The new tokens of one batch of left-padded prompts, (rows, max_new_tokens) on the CPU: the static decoder `dec`
    (with option fit_cache, one as long as each batch needs) or, `dec` None, transformers `generate`."""

    def __init__(self, model, dec, max_new_tokens, temperature, seed, stop_ids, pad, ignore_eos, compile, options):
        import torch
        from transformers import GenerationConfig
        self.model, self.dec, self.n, self.temperature = model, dec, max_new_tokens, temperature
        self.ignore_eos, self.compile, self.options = ignore_eos, compile, options
        self.device = next(model.parameters()).device
        self.stop = set() if ignore_eos else set(stop_ids)
        if dec is not None:
            self.gen_g = torch.Generator(device=self.device).manual_seed(seed) if temperature > 0 else None
        else:
            self.gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                            temperature=temperature if temperature > 0 else None, top_k=None,
                                            top_p=None, eos_token_id=None if ignore_eos else stop_ids,
                                            pad_token_id=pad, use_cache=True)

    def __call__(self, ids, att):
        from dflash.data.decode import decoder_for
        if self.dec is None:
            # ignore_eos: eos_token_id=None as an argument, which transformers applies last (an unset eos in gen_cfg
            # it would fill from the model's generation_config)
            return self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                       generation_config=self.gen_cfg,
                                       **({"eos_token_id": None} if self.ignore_eos else {}))[:, ids.shape[1]:].cpu()
        if self.dec.options["fit_cache"]:   # a cache as long as this batch needs (see decode.py)
            self.dec = decoder_for(self.model, self.dec.B, ids.shape[1] + self.n, self.compile, **self.options)
        return self.dec.generate(ids, att, self.n, self.stop, self.temperature, self.gen_g).cpu()


def _cut(gen, batch, stop, out) -> int:
    """Each response of `batch` (rows of `gen`) into `out`, up to its first stop token; returns the tokens generated
    (the stop token included)."""
    tokens = 0
    for r, i in enumerate(batch):
        seq = gen[r].tolist()
        cut = next((k for k, t in enumerate(seq) if t in stop), None)
        out[i] = seq[:cut] if cut is not None else seq
        tokens += (cut + 1) if cut is not None else len(seq)
    return tokens


def regenerate(model, tokenizer, prompts, max_new_tokens, temperature=0.0, batch_size=0, seed=0, progress=True,
               stop_ids=None, decoder="auto", compile=True, ignore_eos=False, cpu_batch_size=None, static_options=None):
    """Batched generation with a KV cache and left padding, prompts sorted by length (longest first). Returns
    responses (token ids up to, excluding, the first stop token) in the order of `prompts`, and {tokens, seconds,
    tokens_per_s, batch_size, decoder}.

    decoder "generate": transformers `generate` with its dynamic cache. "static": `dflash.data.decode.StaticDecoder`
    (one fixed batch shape, the last batch filled; on GPU with `compile` the decode step is a CUDA graph). "auto":
    static on GPU, generate on CPU and for a target with recurrent or convolution states (dflash.families; "static" is
    refused for one). batch_size 0 sizes batches by `auto_batch_size` (free GPU memory; on CPU `cpu_batch_size`).
    `ignore_eos` generates exactly max_new_tokens (benchmarks). `static_options`: the static decoder's options
    (`dflash.data.decode.OPTIONS`; None: their defaults)."""
    import torch
    from tqdm import tqdm

    from dflash.target import stop_token_ids

    stop_ids = stop_token_ids(tokenizer, model) if stop_ids is None else list(stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    static = _use_static(model, decoder, next(model.parameters()).device)
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    longest = len(prompts[order[0]]) if prompts else 1
    static_options = static_options or {}
    batch_size, dec = _batching(model, prompts, longest, max_new_tokens, batch_size, static, compile, cpu_batch_size,
                                static_options)
    generate = _Generate(model, dec, max_new_tokens, temperature, seed, stop_ids, pad, ignore_eos, compile,
                         static_options)
    out: list[list[int] | None] = [None] * len(prompts)
    tokens = 0
    torch.manual_seed(seed)
    t0 = time.time()
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    bar = tqdm(batches, desc="regenerate", unit="batch", disable=not progress, mininterval=2.0)
    with torch.inference_mode():
        for batch in bar:
            rows = batch + [batch[-1]] * (batch_size - len(batch)) if static else batch   # fixed batch shape
            tokens += _cut(generate(*_left_padded(prompts, rows, pad)), batch, generate.stop, out)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}")
    seconds = time.time() - t0
    return out, {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                 "batch_size": batch_size, "decoder": "static" if static else "generate",
                 "attn_implementation": generate.dec.attn if static else model.config._attn_implementation}
