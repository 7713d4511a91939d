"""Speculative decoding with a frozen HF target and a block drafter (batch size 1), and plain target decoding.

Semantics (those of the reference package `dflash` 0.1.0, `dflash_generate`, so outputs compare token by token):
  * prefill: one target forward over the prompt (positions 0..n-1) gives the first token (greedy or sampled) and
    the target hidden states of the selected layers for every prompt position.
  * step (`start` = position of the last accepted token, not yet in the target's KV cache):
      verify_size  vs = min(block_size, max_length - start)
      block        [token at start, MASK x (vs-1)] at positions start..start+vs-1
      draft        the drafter sees the context features of positions 0..start-1 (strictly before its anchor)
                   and proposes vs-1 tokens x_1..x_{vs-1} (by the proposal policy below; argmax at temperature 0)
      verify       one target forward over the block (positions start..start+vs-1, using the KV cache): p_i, the
                   target's probabilities (at the same temperature) for the token after block position i
      accept       greedy: the longest prefix where x_i equals the target's argmax at block position i-1, plus the
                   target's own next token (bonus); temperature > 0: speculative sampling with proposal q_i, x_i
                   accepted with probability min(1, p_{i-1}(x_i)/q_i(x_i)) in order; at the first rejection the
                   token is resampled from norm(max(0, p_{i-1} - q_i)); if all are accepted the bonus is sampled
                   from p at the last position.
      produced     accepted + 1, capped so that no more than max_new_tokens are generated and cut after a stop
                   token; `start += produced`; the target cache is cropped to `start`; the features of the produced
                   positions (start..start+produced-1, from the verify forward) become the drafter's new context.
                   A target whose cache holds recurrent states (linear-attention layers: Qwen3-Next's gated DeltaNet)
                   cannot be cropped: those states are copied before the verify forward (`snapshot`), and after a
                   rejection put back and advanced by re-running the produced tokens (`rewind`: one more target
                   forward, counted in `target_forwards`); attention layers and convolution states crop.
  * the generation ends at max_new_tokens or right after a stop token (which is kept).

tau (acceptance length) = tokens produced per verification step, counting the bonus token.

Proposal policies at temperature > 0: both are exact (the output is distributed as the target's own sampling), yet
the same drafter accepts very differently under them (z-lab/dflash PR #169: 2.96 tokens per step with argmax drafts,
1.16 with sampled ones), so a tau at temperature > 0 names its policy:
  * `argmax` (vLLM, SGLang, TensorRT-LLM): x_i = the drafter's argmax, q_i = onehot(x_i), so x_i is accepted with
    probability p_{i-1}(x_i) and a rejected one is replaced from p_{i-1} with x_i removed, renormalised
    (`accept_onehot`).
  * `sample` (DeepSpec, the reference package): x_i sampled from the drafter's softmax at the temperature, q_i
    that softmax (`accept_sampling`).

The drafter interface (`Draft`) is a small protocol so that an oracle or a random drafter can be plugged in:
    block_size: int
    target_layer_ids: list[int]              (target layers whose hidden states the drafter needs; [] for none)
    reset()                                  (a new sequence starts)
    propose(ctx_ids, ctx_feats, block_ids, start) -> logits [1, vs-1, V]
        ctx_ids [1, m] / ctx_feats [1, m, k*H] (or None): the positions start-m..start-1 accepted since the last
        call (the whole prompt on the first call); block_ids [1, vs] the block (anchor then MASK); returns the
        drafter's logits for block positions 1..vs-1.
The DFlash drafter (`DFlashDraft`) runs DFlashDrafter.draft, which keeps per-layer context K/V of every accepted
position; since the cache is only ever extended with accepted positions (the block's own K/V are never cached), a
rejection needs no crop.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Protocol, Sequence

import torch


# ---- the drafter interface --------------------------------------------------------------------------------------
class Draft(Protocol):
    block_size: int
    target_layer_ids: list[int]

    def reset(self) -> None: ...

    def propose(self, ctx_ids: torch.Tensor, ctx_feats: torch.Tensor | None, block_ids: torch.Tensor,
                start: int) -> torch.Tensor: ...


@dataclasses.dataclass
class Generation:
    """One decoded prompt. `tokens` excludes the prompt; per verification step: `produced` (tokens added, what tau
    averages), `accepted` (draft tokens accepted, before any cap), `drafted` (draft tokens proposed)."""
    tokens: list[int]
    produced: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    drafted: list[int] = dataclasses.field(default_factory=list)
    target_forwards: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    stopped: bool = False

    @property
    def steps(self) -> int:
        return len(self.produced)

    @property
    def tau(self) -> float | None:
        return sum(self.produced) / len(self.produced) if self.produced else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tau"] = self.tau
        return d


# ---- target side ---------------------------------------------------------------------------------------------
def make_cache(target):
    from transformers import DynamicCache
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):   # sliding-window layers must be able to roll back
        cache.activate_past_recording()
    return cache


def crop_cache(cache, length: int | None = None) -> None:
    """Keep the first `length` positions of an HF cache (None: all; transformers 5: crop(-n) removes n positions), and
    bring the layers that record their past (make_cache) back to what the next forward reads: a sliding layer to its
    window, a linear-attention layer to its convolution window (its recurrent state is not cropped: rewind). Called
    after every forward: a sliding layer holding more than its window fails the next forward's mask."""
    remove = 0 if length is None else cache.get_seq_length() - length
    cache.crop(-max(remove, 0))


def snapshot(cache) -> dict | None:
    """Copies of the states that no crop can undo, {layer: (conv states, recurrent states)}; None when the cache holds
    no recurrent state (attention layers and convolution states crop)."""
    held = {i: ({k: v.clone() for k, v in layer.conv_states.items() if v is not None},
                {k: v.clone() for k, v in layer.recurrent_states.items() if v is not None})
            for i, layer in enumerate(getattr(cache, "layers", ())) if hasattr(layer, "recurrent_states")}
    return held if any(rec for _, rec in held.values()) else None


def rewind(target, cache, snap: dict, ids: torch.Tensor, at: int) -> None:
    """Undo a verify forward in a cache with recurrent states: attention layers cropped back to `at` positions, the
    linear-attention layers' states put back as `snap` held them before it, then `ids` (the tokens accepted at
    positions at..) run again from there."""
    crop_cache(cache, at)
    for i, (conv, rec) in snap.items():
        layer = cache.layers[i]
        layer.conv_states.update(conv)
        for k, v in rec.items():
            layer.recurrent_states[k].copy_(v)
    target_forward(target, ids, at, cache, [], last_only=True)
    crop_cache(cache, at + ids.shape[1])


def target_forward(target, ids: torch.Tensor, start: int, cache, layer_ids: Sequence[int], last_only=False):
    """Logits [1, T, V] (or [1, 1, V]) and the concatenated hidden states [1, T, k*H] of `layer_ids`
    (hidden_states[id + 1], the output of decoder layer id) or None, for `ids` at positions start..start+T-1."""
    T = ids.shape[1]
    pos = torch.arange(start, start + T, device=ids.device)[None]
    kw = {"logits_to_keep": 1} if last_only else {}
    out = target(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                 output_hidden_states=bool(layer_ids), **kw)
    feats = None
    if layer_ids:
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return out.logits, feats


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def _sample(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def _choose(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return _sample(_probs(logits, temperature), generator)


def _device(target) -> torch.device:
    return next(target.parameters()).device


def _prompt_tensor(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"expected one non-empty prompt, got shape {tuple(ids.shape)}")
    return ids


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_tokens [g], target_logits [g+1, V] -> (accepted, bonus token)."""
    post = target_logits.argmax(-1)
    match = (draft_tokens == post[:-1]).to(torch.int64)
    acc = int(match.cumprod(0).sum().item())
    return acc, int(post[acc].item())


def accept_sampling(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator) -> tuple[int, int]:
    """Speculative sampling. draft_tokens [g] drawn from q [g, V]; p [g+1, V] the target's probabilities at the
    same temperature. Token i is accepted with probability min(1, p_i(x)/q_i(x)) (as u * q < p, u ~ U[0,1));
    at the first rejection the replacement is drawn from norm(max(0, p_i - q_i)) (p_i if that is all zero);
    if all g are accepted the bonus is drawn from p_g. The output is distributed exactly as p."""
    g = draft_tokens.shape[0]
    px = p[:g].gather(-1, draft_tokens[:, None])[:, 0]
    qx = q.gather(-1, draft_tokens[:, None])[:, 0]
    u = torch.rand(g, generator=generator, device=p.device, dtype=p.dtype)
    acc = int((u * qx < px).to(torch.int64).cumprod(0).sum().item())
    if acc == g:
        return acc, int(_sample(p[g], generator).item())
    residual = (p[acc] - q[acc]).clamp_min(0)
    total = residual.sum()
    dist = residual / total if float(total) > 0 else p[acc]
    return acc, int(_sample(dist, generator).item())


def accept_onehot(draft_tokens: torch.Tensor, p: torch.Tensor, generator) -> tuple[int, int]:
    """Speculative sampling of argmax drafts: accept_sampling with the one-hot proposal q_i = onehot(x_i). Token i is
    accepted with probability p_i(x_i); at the first rejection the replacement is drawn from p_i with x_i removed,
    renormalised (p_i if that is all zero); if all g are accepted the bonus is drawn from p_g. Exact, as p."""
    q = torch.nn.functional.one_hot(draft_tokens, p.shape[-1]).to(p.dtype)
    return accept_sampling(draft_tokens, q, p, generator)


# ---- decoding loops ------------------------------------------------------------------------------------------
@torch.inference_mode()
def speculative_generate(target, draft: Draft, prompt_ids, max_new_tokens: int, stop_ids: Sequence[int] = (),
                         temperature: float = 0.0, mask_token_id: int = 0, generator: torch.Generator | None = None,
                         block_size: int | None = None, proposal: str = "argmax") -> Generation:
    """Speculative decoding of one prompt with `draft` proposing and `target` verifying (see the module doc);
    `proposal` ("argmax" or "sample") is the draft policy at temperature > 0."""
    if proposal not in ("argmax", "sample"):
        raise ValueError(f"proposal must be 'argmax' or 'sample', got {proposal!r}")
    sample = temperature > 0 and proposal == "sample"
    device = _device(target)
    prompt = _prompt_tensor(prompt_ids, device)
    n = prompt.shape[1]
    max_length = n + int(max_new_tokens)
    bsz = int(block_size or draft.block_size)
    if bsz < 2:
        raise ValueError(f"block size must be at least 2, got {bsz}")
    layer_ids = list(draft.target_layer_ids or [])
    stops = set(int(s) for s in stop_ids)
    draft.reset()
    cache = make_cache(target)

    _sync(device)
    t0 = time.perf_counter()
    out, ctx_feats = _prefill(target, prompt, cache, layer_ids, temperature, generator, t0)
    seq = prompt[0].tolist() + out.tokens
    ctx_ids, start, stopped = prompt, n, out.tokens[0] in stops
    while start + 1 < max_length and not stopped:
        vs = min(bsz, max_length - start)
        block, dtoks, q = _draft_block(draft, ctx_ids, ctx_feats, seq[start], start, vs, mask_token_id,
                                       temperature if sample else 0.0, generator)
        snap = snapshot(cache)
        tlogits, tfeats = target_forward(target, block, start, cache, layer_ids)
        acc, bonus = _accept(dtoks, q, tlogits[0], temperature, generator)
        kept, stopped = _kept(dtoks[:acc].tolist() + [bonus], max_length - start - 1, stops)
        produced = len(kept)
        seq.extend(kept)
        out.produced.append(produced)
        out.accepted.append(acc)
        out.drafted.append(vs - 1)
        out.target_forwards += 1
        ctx_ids = block[:, :produced]
        ctx_feats = tfeats[:, :produced] if tfeats is not None else None
        out.target_forwards += _keep_cache(target, cache, snap, block, start, produced)
        start += produced
    _sync(device)
    out.seconds = time.perf_counter() - t0
    out.tokens = seq[n:max_length]
    out.stopped = stopped
    return out


def _prefill(target, prompt: torch.Tensor, cache, layer_ids, temperature: float, generator, t0: float):
    """The prompt through the target: (the Generation begun with its first token, the prompt's features)."""
    logits, feats = target_forward(target, prompt, 0, cache, layer_ids, last_only=True)
    crop_cache(cache)
    first = int(_choose(logits[0, -1], temperature, generator).item())
    _sync(prompt.device)
    return Generation(tokens=[first], target_forwards=1, prefill_seconds=time.perf_counter() - t0), feats


def _draft_block(draft: Draft, ctx_ids, ctx_feats, anchor: int, start: int, vs: int, mask_token_id: int,
                 temperature: float, generator):
    """The block at `start` ([anchor, drafts x vs-1]), its drafts [vs-1] and their proposal q [vs-1, V] (sampled at
    `temperature` > 0; argmax drafts, q None, at 0)."""
    block = torch.full((1, vs), int(mask_token_id), dtype=torch.long, device=ctx_ids.device)
    block[0, 0] = anchor
    dlogits = draft.propose(ctx_ids, ctx_feats, block, start)[0, : vs - 1]     # [vs-1, V]
    q = None
    if temperature > 0:
        q = _probs(dlogits, temperature)
        dtoks = _sample(q, generator)
    else:
        dtoks = dlogits.argmax(-1)
    block[0, 1:] = dtoks
    return block, dtoks, q


def _accept(dtoks: torch.Tensor, q: torch.Tensor | None, tlogits: torch.Tensor, temperature: float,
            generator) -> tuple[int, int]:
    """(accepted drafts, the bonus token): speculative sampling of sampled (q) or argmax drafts at temperature > 0,
    the greedy match at 0."""
    if q is not None:
        return accept_sampling(dtoks, q, _probs(tlogits, temperature), generator)
    if temperature > 0:
        return accept_onehot(dtoks, _probs(tlogits, temperature), generator)
    return accept_greedy(dtoks, tlogits)


def _kept(new: list[int], room: int, stops: set[int]) -> tuple[list[int], bool]:
    """The tokens a step adds: `new` up to `room` and up to the first stop token, included; (them, stopped)."""
    new = new[:room]
    for i, t in enumerate(new):
        if t in stops:
            return new[: i + 1], True
    return new, False


def _keep_cache(target, cache, snap, block: torch.Tensor, start: int, produced: int) -> int:
    """The cache cut back to the accepted tokens (a cache with recurrent states: rewound and those run again);
    returns the target forwards it took."""
    if snap is not None and produced < block.shape[1]:
        rewind(target, cache, snap, block[:, :produced], start)
        return 1
    crop_cache(cache, start + produced)
    return 0


@torch.inference_mode()
def target_generate(target, prompt_ids, max_new_tokens: int, stop_ids: Sequence[int] = (), temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> Generation:
    """Plain autoregressive decoding with the target's KV cache: one forward per token."""
    device = _device(target)
    prompt = _prompt_tensor(prompt_ids, device)
    n = prompt.shape[1]
    stops = set(int(s) for s in stop_ids)
    cache = make_cache(target)
    _sync(device)
    t0 = time.perf_counter()
    logits, _ = target_forward(target, prompt, 0, cache, [], last_only=True)
    crop_cache(cache)
    tok = int(_choose(logits[0, -1], temperature, generator).item())
    _sync(device)
    out = Generation(tokens=[tok], target_forwards=1, prefill_seconds=time.perf_counter() - t0)
    pos = n
    while len(out.tokens) < max_new_tokens and tok not in stops:
        logits, _ = target_forward(target, torch.tensor([[tok]], device=device), pos, cache, [])
        crop_cache(cache)
        out.target_forwards += 1
        pos += 1
        tok = int(_choose(logits[0, -1], temperature, generator).item())
        out.tokens.append(tok)
    _sync(device)
    out.stopped = tok in stops
    out.seconds = time.perf_counter() - t0
    return out


# ---- drafters --------------------------------------------------------------------------------------------------
class DFlashDraft:
    """A trained `dflash.model.DFlashDrafter` run incrementally through its own `draft` (the same computation
    as its training forward, masks included): the context K/V of every accepted position are kept in a
    DrafterCache, each block is computed against [cached context ; block]."""

    def __init__(self, drafter, backend: str = "sdpa"):
        self.drafter = drafter.eval()
        self.cfg = drafter.cfg
        self.backend = backend
        self.block_size = self.cfg.block_size
        self.target_layer_ids = list(self.cfg.target_layer_ids)
        self.mask_token_id = self.cfg.mask_token_id
        self.reset()

    def reset(self) -> None:
        self.cache = self.drafter.new_cache()

    @torch.inference_mode()
    def propose(self, ctx_ids, ctx_feats, block_ids, start: int) -> torch.Tensor:
        m = ctx_feats.shape[1]
        if self.cache.length + m != start:
            raise RuntimeError(f"drafter context holds {self.cache.length} positions + {m} new, but the block "
                               f"starts at {start}")
        hidden = self.drafter.draft(block_ids, ctx_feats, self.cache, backend=self.backend)
        return self.drafter.logits(hidden[:, 1:]).float()


class OracleDraft:
    """Proposes the target's own greedy continuation (one-hot logits): every draft is accepted, tau = block size."""

    def __init__(self, target, block_size: int, vocab_size: int | None = None):
        self.target = target
        self.block_size = block_size
        self.target_layer_ids: list[int] = []
        self.vocab_size = vocab_size or target.config.vocab_size
        self.reset()

    def reset(self) -> None:
        self.seq: list[int] = []

    @torch.inference_mode()
    def propose(self, ctx_ids, ctx_feats, block_ids, start):
        self.seq.extend(ctx_ids[0].tolist())
        assert len(self.seq) == start
        cont = target_generate(self.target, self.seq + [int(block_ids[0, 0])], block_ids.shape[1] - 1).tokens
        logits = torch.full((1, len(cont), self.vocab_size), -1e4)
        logits[0, torch.arange(len(cont)), torch.tensor(cont)] = 1e4
        return logits


class RandomDraft:
    """Random logits (seeded): a drafter that knows nothing; tau close to 1."""

    def __init__(self, vocab_size: int, block_size: int, seed: int = 0, scale: float = 1.0):
        self.vocab_size, self.block_size, self.scale = vocab_size, block_size, scale
        self.target_layer_ids: list[int] = []
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def propose(self, ctx_ids, ctx_feats, block_ids, start):
        g = block_ids.shape[1] - 1
        return torch.randn(1, g, self.vocab_size, generator=self.generator) * self.scale
