"""Batched decoding of the target with a static KV cache: every decode step has the same shapes for a whole run, so
on GPU the step is compiled once and replayed as a CUDA graph. `model.generate` is bound by Python and kernel
launches on an 8B target (88 ms per step at batch 32, 113 ms at batch 128 on an H200); a replayed graph is not.

    dec = StaticDecoder(model, batch_size=256, max_len=1024, compile=True)
    out = dec.generate(ids, attention_mask, max_new_tokens=256, stop_ids={2}, temperature=0.0)   # (B, new)

Prompts are left-padded (B, W) with W + max_new_tokens <= max_len; W may change from call to call (the prefill runs
eagerly, or compiled with dynamic shapes: `compile_prefill`), B may not. Greedy picks inside the graph; sampling
(temperature > 0) draws from the graph's logits.
`decoder_for(model, batch_size, need_len, compile)` keeps the last decoder of a model (its KV cache and compiled
graph) for the next call that fits it, so a stage compiles once, not once per chunk; `release(model)` frees it.

Attention: with a padding mask transformers' sdpa path repeats K and V for every query head of a KV group (4x the
cache read per step for Qwen3-8B: 100 ms per step at batch 256 on an H200); the decoder registers `grouped_sdpa`,
which reads each KV head once for its group of query heads (same kernel, same math) and is sdpa elsewhere.

Options, each a `bench/regen.py` variant, made the default once a measurement says so (issue 28):
- `prefill_rows=R` (default 64; 0: the whole batch at once): the prefill in chunks of R prompts of similar length,
  each only as wide as its longest prompt (the whole-batch prefill computes every padding position of the batch's
  width), its K/V copied into the cache. On the H200 (bench/results/2026-12-01-h200-r7/): 512 x 256 tokens of the
  8B-shaped target in 14.2 s against 17.7 s (prefill 5.2 s against 8.5 s), peak 81.7 GB against 95.6 GB; CUDA graphs
  give `generate`'s greedy turns with it (tests/e2e/test_data_regen.py). A cache with sliding-window layers (which keep
  other slots) prefills the whole batch at once.
- `fit_cache=True` (off): `regenerate` sizes the cache to each batch (`cache_len(width + max_new_tokens)`, a new
  decoder when that differs from the kept one's) instead of keeping the first, longest batch's. Batches are sorted by
  prompt length, longest first, and a decode step's attention reads the whole static cache (65% of the H200's step
  in r7), so every later, shorter batch reads slots it never fills. Costs, at each change of length (a few per call:
  the lengths of `cache_len` grow by 1.33-1.5x; every call starts long again): a new cache and the recording of its
  CUDA graph. The compiled step is one function for every decoder: its second cache length makes dynamo compile it
  with the length symbolic (automatic dynamic shapes), which later lengths reuse. Not measured on a GPU yet
  (bench/regen.py's -fit variant).
- `compile_prefill` (default AUTO: on where the decode step is compiled for CUDA graphs; True: wherever the decoder
  compiles, the CPU too; False: eager): the row-chunk prefill (so with `prefill_rows` > 0) compiled by Inductor, one
  graph with dynamic shapes for every chunk (rows and width; a chunk of one row adds a second), no CUDA graphs: its
  norms, RoPE and activations fused. On the H200 (bench/results/2026-12-03-h200-r8/): 2 x 512 prompts x 256 tokens of
  the 8B-shaped target at 12,332 tok/s against 11,156 eager (prefill 4.17 s against 5.29 s per batch), for a warm-up
  of 180 s against 77 s (the dynamic-shape compile, once per process); CUDA graphs give `generate`'s greedy turns
  with it (tests/e2e/test_data_regen.py). The CPU's Inductor compiles slowly, so AUTO leaves it eager there.
- `attention`: `auto` (default): FLEX where the step is compiled and replayed as a CUDA graph (and the head dim is a
  power of two of at least 16 and the query heads per KV head a power of two, as Inductor's flex decoding kernel takes
  them), GQA otherwise (the CPU, eager). FLEX ("grouped_flex"): decode steps through flex_attention over only the
  128-slot KV blocks that hold a slot the query sees (no block of left padding, none of the cache not yet written), each
  KV head read once; a decode step's mask is the decoder's own bool mask, read as a graph input (`decoder_mask`: the
  decoder opens one slot a step). On the H200 (bench/results/2026-12-02-h200-quality-regen/): 2 x 512 prompts x 256
  tokens of the 8B-shaped target at 11,472 tok/s against 9,275 with GQA (decode step 24.3 ms against 34.9), the GPU
  test's greedy turns those of `generate`. r7's compile failure (`XBLOCK is not defined`) was in a mask_mod into which
  the mask's computation had been inlined. With FLEX, `fit_cache` saves nothing in attention (no unwritten slot is
  read).
"""
from __future__ import annotations

import torch

from dflash.model.masks import block_lists

GQA = "grouped_sdpa"       # (a name with "flash" in it would be taken for a flash-attention kernel)
FLEX = "grouped_flex"
KV_BLOCK = 128             # flex_attention's sparse block; every cache_len is a multiple of it
PREFILL_ROWS = 64
AUTO = "auto"              # FLEX when compiled for CUDA graphs, else GQA (StaticDecoder.attention_for)
OPTIONS = {"attention": AUTO, "prefill_rows": PREFILL_ROWS, "fit_cache": False,   # StaticDecoder's, at their defaults
           "compile_prefill": AUTO}


def gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: decode steps (one query) as grouped attention over the un-repeated cache;
    everything else is transformers' sdpa. query (B, H, 1, D), key/value (B, Hkv, L, D), mask (B, 1, 1, L) bool."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, q, D = query.shape
    Hkv = key.shape[1]
    if q != 1 or H == Hkv or attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(      # (B, Hkv, g, D): g query heads share a KV head
        query.view(B, Hkv, H // Hkv, D), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def visible_blocks(visible):
    """visible (B, L) bool, the slots one query per row sees -> a flex BlockMask over the KV blocks holding any of
    them (per row, in order): the blocks all visible as full blocks, the others cut by `visible` itself."""
    from torch.nn.attention.flex_attention import BlockMask

    B, L = visible.shape
    blocks = visible.reshape(B, L // KV_BLOCK, KV_BLOCK)
    full = blocks.all(-1)                                                  # (B, L/128)
    num, idx = block_lists((blocks.any(-1) & ~full)[:, None, None])         # (B,1,1), (B,1,1,L/128): partial blocks
    full_num, full_idx = block_lists(full[:, None, None])
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=KV_BLOCK,
                                    mask_mod=lambda b, h, q, kv: visible[b, kv], seq_lengths=(1, L),
                                    compute_q_blocks=False)


def flex_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: decode steps (one query, the cache a whole number of KV blocks) as
    flex_attention over `visible_blocks` of the mask, the query heads of a KV group sharing its reads; everything
    else as `gqa_attention`. query (B, H, 1, D), key/value (B, Hkv, L, D), mask (B, 1, 1, L) bool."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    B, H, q, D = query.shape
    if q != 1 or attention_mask is None or attention_mask.dtype != torch.bool or key.shape[2] % KV_BLOCK:
        return gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = flex(query, key, value, block_mask=visible_blocks(attention_mask[:, 0, 0]), scale=scaling,
               enable_gqa=H != key.shape[1])                        # (B, H, 1, D)
    return out.transpose(1, 2).contiguous(), None


def decoder_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """transformers mask function of the flex decode: a decode step's mask is the decoder's own 2D mask, as it is
    (B, 1, 1, L) bool, a view: every slot the step sees, the decoder opening one slot a step (no causal rule to
    compute). flex_attention's mask_mod then reads a graph input; r7's Inductor failure was in a mask_mod into which
    the mask's computation (cache position, arange, comparisons) had been inlined. Anything else, a sliding-window
    layer's shorter cache among it: sdpa_mask."""
    from transformers.masking_utils import sdpa_mask
    if q_length == 1 and attention_mask is not None and attention_mask.dim() == 2 \
            and attention_mask.dtype == torch.bool and attention_mask.shape[-1] == kv_length:
        return attention_mask[:, None, None, :]
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    for name, fn, mask in ((GQA, gqa_attention, sdpa_mask), (FLEX, flex_decode_attention, decoder_mask)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask)


def _forward(model, cache, ids, pos, mask):          # ids, pos (B, T); mask (B, L) -> last logits (B, V)
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


def _prefill_chunk(model, ids, pos, att):
    """A chunk's prefill in its own dynamic cache: ids, pos, att (R, w) -> (last logits (R, V), [(K, V) (R, Hkv, w, D)
    per layer])."""
    out = model(input_ids=ids, position_ids=pos, attention_mask=att, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def _step_greedy(model, cache, ids, pos, mask):
    return _forward(model, cache, ids, pos, mask).argmax(-1)


def _step_logits(model, cache, ids, pos, mask):
    return _forward(model, cache, ids, pos, mask).float()


def kv_heads(config) -> tuple[int, int]:
    """(head dim, KV heads) of a transformers config."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return d, getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def flex_decodable(config) -> bool:
    """Whether Inductor's flex decoding kernel takes the model's heads: a power-of-two head dim of at least 16 and a
    power-of-two count of query heads per KV head (it raises on any other group: 3 for the code target of
    config/quality.yaml, 5 for Qwen3-14B)."""
    d, kv = kv_heads(config)
    group = config.num_attention_heads // kv
    return d >= 16 and d & (d - 1) == 0 and group >= 1 and group & (group - 1) == 0


class StaticDecoder:
    def __init__(self, model, batch_size: int, max_len: int, compile: bool = True, check_every: int = 32,
                 **options):
        from transformers import StaticCache
        self.options = {**OPTIONS, **options}
        if set(options) - set(OPTIONS) or self.options["attention"] not in (AUTO, GQA, FLEX) \
                or self.options["prefill_rows"] < 0 \
                or not isinstance(self.options["fit_cache"], bool) \
                or not (isinstance(self.options["compile_prefill"], bool) or self.options["compile_prefill"] == AUTO):
            raise ValueError(f"StaticDecoder: options {options} (known: attention {AUTO} | {GQA} | {FLEX}, "
                             f"prefill_rows >= 0, fit_cache true | false, compile_prefill {AUTO} | true | false)")
        self.model, self.B, self.L, self.check_every = model, batch_size, max_len, check_every
        self.device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.graphs = compile and self.device.type == "cuda"
        # grouped decode attention while this decoder runs (the caller's model keeps its own setting otherwise)
        impl = model.config._attn_implementation
        self.attn = self.attention_for(model.config, self.options["attention"], self.graphs) \
            if impl in ("sdpa", GQA, FLEX) else impl
        self._greedy = torch.compile(_step_greedy, mode="reduce-overhead", fullgraph=True) if self.graphs \
            else _step_greedy
        self._logits = torch.compile(_step_logits, mode="reduce-overhead", fullgraph=True) if self.graphs \
            else _step_logits
        # the row-chunk prefill compiled once for every chunk shape (dynamic), without CUDA graphs
        self.prefill_compiled = self.compiles_prefill(compile, self.device, self.options)
        self._prefill = torch.compile(_prefill_chunk, dynamic=True, fullgraph=True) if self.prefill_compiled \
            else _prefill_chunk

    @staticmethod
    def compiles_prefill(compile: bool, device: torch.device, options: dict) -> bool:
        """Whether a decoder made with `compile` and `options` on `device` compiles its row-chunk prefill (AUTO: where
        its decode step is compiled for CUDA graphs)."""
        want = options["compile_prefill"]
        return bool(compile and (device.type == "cuda" if want == AUTO else want))

    @staticmethod
    def attention_for(config, attention: str, graphs: bool) -> str:
        """The decode attention an `attention` option means: AUTO is FLEX under CUDA graphs where Inductor's flex
        decoding kernel takes the shapes (`flex_decodable`), GQA otherwise. FLEX asked for under CUDA graphs where it
        does not: a ValueError that says so (Inductor's own error comes at the first decode step)."""
        if attention == AUTO:
            return FLEX if graphs and flex_decodable(config) else GQA
        if attention == FLEX and graphs and not flex_decodable(config):
            d, kv = kv_heads(config)
            raise ValueError(f"decode attention {FLEX} under CUDA graphs needs a power-of-two head dim >= 16 and a "
                             "power-of-two count of query heads per KV head (Inductor's flex decoding kernel); this "
                             f"target has head dim {d}, {config.num_attention_heads // kv} query heads per KV head: "
                             f"use {GQA} or {AUTO} (data.regenerate.attention)")
        return attention

    def close(self) -> None:
        """Free the KV cache now (not whenever the garbage collector gets to it)."""
        self.cache = self._greedy = self._logits = self._prefill = None

    def generate(self, ids, attention_mask, max_new_tokens: int, stop_ids=(), temperature: float = 0.0,
                 generator=None):
        """ids, attention_mask (B, W) left-padded -> generated ids (B, max_new_tokens); after a row's first stop
        token its ids are meaningless. Stops early once every row has stopped (checked every `check_every` steps)."""
        prev = self.model.config._attn_implementation
        if prev != self.attn:
            _register()
            self.model.set_attn_implementation(self.attn)
        try:
            return self._generate(ids, attention_mask, max_new_tokens, stop_ids, temperature, generator)
        finally:
            if prev != self.attn:
                self.model.set_attn_implementation(prev)

    @torch.inference_mode()
    def _generate(self, ids, attention_mask, max_new_tokens, stop_ids, temperature, generator):
        B, W = ids.shape
        if B != self.B or W + max_new_tokens > self.L:
            raise ValueError(f"StaticDecoder: batch {B} x width {W} + {max_new_tokens} does not fit its fixed "
                             f"batch {self.B} x length {self.L}")
        dev = self.device
        ids, att = ids.to(dev), attention_mask.to(dev, torch.long)
        self.cache.reset()
        opens = self.attn == FLEX   # the flex decode reads this mask as it is (decoder_mask): each step opens its slot
        mask = torch.zeros(B, self.L, dtype=torch.bool, device=dev) if opens \
            else torch.ones(B, self.L, dtype=torch.long, device=dev)     # future slots: the causal rule hides them
        mask[:, :W] = att
        pos = (att.cumsum(-1) - 1).clamp_min(0)                          # left padding: first real token at 0
        pick = (lambda lg: lg.argmax(-1)) if temperature <= 0 else (
            lambda lg: torch.multinomial(torch.softmax(lg.float() / temperature, -1), 1, generator=generator)[:, 0])
        if self.options["prefill_rows"] and not any(getattr(c, "is_sliding", False) for c in self.cache.layers):
            nxt = pick(self._prefill_rows(ids, att, pos))
        else:
            nxt = pick(_forward(self.model, self.cache, ids, pos, mask))     # prefill: eager, any width
        out = torch.empty(B, max_new_tokens, dtype=torch.long, device=dev)
        out[:, 0] = nxt
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
        done = torch.isin(nxt, stop)
        last = pos[:, -1:]                                                # (B, 1)
        for t in range(1, max_new_tokens):
            if t % self.check_every == 0 and bool(done.all()):
                break
            if opens:
                mask[:, W + t - 1] = True                                 # the slot this step writes
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            args = (self.model, self.cache, out[:, t - 1:t].clone(), last + t, mask)
            nxt = self._greedy(*args) if temperature <= 0 else pick(self._logits(*args))
            out[:, t] = nxt
            done |= torch.isin(nxt, stop)
        return out

    def _prefill_rows(self, ids, att, pos):
        """The prefill of a reset cache in chunks of `prefill_rows` prompts, longest first, each as wide as its
        longest prompt; each chunk's K/V (its own dynamic cache) go to the rows and slots a whole-batch prefill
        fills (prompts end at slot W). ids, att, pos (B, W) -> last logits (B, V)."""
        B, W = ids.shape
        lens = att.sum(-1)
        last = None
        for rows in torch.argsort(lens, descending=True, stable=True).split(self.options["prefill_rows"]):
            w = int(lens[rows[0]])
            logits, kv = self._prefill(self.model, ids[rows, W - w:], pos[rows, W - w:], att[rows, W - w:])
            for static, (k, v) in zip(self.cache.layers, kv):                         # chunk K/V (R, Hkv, w, D)
                if not static.is_initialized:                                          # shapes, dtype, device
                    static.lazy_initialization(*(t[:1].expand(B, -1, -1, -1) for t in (k, v)))
                static.keys[rows, :, W - w:W] = k
                static.values[rows, :, W - w:W] = v
            last = logits.new_empty(B, logits.shape[-1]) if last is None else last
            last[rows] = logits
        for static in self.cache.layers:
            static.cumulative_length.fill_(W)
        return last


_LAST: dict[int, StaticDecoder] = {}


def cache_len(need: int) -> int:
    """Decoder length for `need` positions: 256, 384, 512, 768, 1024, 1536, ... (2^k or 1.5 x 2^k: few distinct
    graphs over a whole data set, at most a third of the cache unused)."""
    n = 256
    while n < need:
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return n


def kept(model) -> StaticDecoder | None:
    """The model's kept decoder (the last `decoder_for` made or reused), or None."""
    return _LAST.get(id(model))


def release(model) -> None:
    """Drop the model's kept decoder and free its KV cache (end of a stage, between benchmark variants)."""
    import gc
    dec = _LAST.pop(id(model), None)
    if dec is not None:
        dec.close()
    del dec
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decoder_for(model, batch_size: int | None, need_len: int, compile: bool = True, **options) -> StaticDecoder | None:
    """The model's last decoder if it is long enough (with `fit_cache`: exactly `cache_len(need_len)` long), has the
    asked batch size (None: any), what `compile` compiles (the CUDA-graph step, `compile_prefill`'s prefill) and the
    same `options` (StaticDecoder's OPTIONS; unnamed: their defaults), else a new one (the old one's cache is freed
    first); None when there is nothing to reuse and no batch size is given."""
    last = _LAST.get(id(model))
    fits = last is not None and (last.L == cache_len(need_len) if last.options["fit_cache"] else last.L >= need_len)
    if fits and batch_size in (None, last.B) \
            and last.graphs == (compile and last.device.type == "cuda") \
            and last.prefill_compiled == StaticDecoder.compiles_prefill(compile, last.device, last.options) \
            and last.options == {**OPTIONS, **options}:
        return last
    del last
    release(model)
    if batch_size is None:
        return None
    _LAST[id(model)] = dec = StaticDecoder(model, batch_size, cache_len(need_len), compile=compile, **options)
    return dec
