"""Regeneration of assistant turns by the target, resumable: engines `hf` (in-process generate) and `openai` (any
OpenAI-compatible server: vLLM, SGLang, `transformers serve`), and a cache of finished chunks keyed by conversation.

Public:
- `regenerated(cfg, convs, n, tokenizer, spill, cache_dir, tally, stats)`: the data chain's step `regenerate` (the
  conversations to train on, regenerated or as they are, into a spill); `default_cache_dir(cfg)`: where finished
  chunks are kept
- `regenerate_stream(convs, total, tokenizer, cfg, cache_dir, stats, progress=True)` -> yields (conv, messages | reason)
  for an iterable of {"hash", "messages", ...}, in order. Every turn is generated from the locally rendered chat template (the same text
  for both engines); the responses come back as text and the caller re-tokenises the whole conversation, so
  training sees the same tokens whichever engine made them.
- `HFEngine(model, tokenizer, rcfg)`, `OpenAIEngine(rcfg, model_name)`: `.generate(prompts, seed)` -> (texts, tokens)
  with `prompts` = [(text, ids)].
- `cache_key(cfg)` -> the folder name that keys cached responses by everything that decides them (the target by
  content: dflash.target.target_identity).

Resumability: conversations are processed in chunks of `data.regenerate.chunk_size`; a finished chunk is one JSONL
file written atomically (`chunk-<hash>.jsonl`: one {"hash", "messages"} or {"hash", "reject"} per conversation).
A rerun loads every chunk file and regenerates only the conversations none holds, so a `kill -9` costs at most
the chunk in flight and a conversation is never regenerated twice. Shards share the folder. A torn chunk (cut by a copy
or a damaged disk) is set aside as `<name>.torn` with one warning line, and its conversations are regenerated.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path

from dflash.atomic import atomic_write_text
from dflash.config_model import DflashConfig, RegenerateSection
from dflash.data.generate import regenerate
from dflash.data.spill import Spill
from dflash.data.tally import Tally
from dflash.data.tokenise import prompt_ids, render
from dflash.errors import UserError, io_error

log = logging.getLogger("dflash.data")


# ---- the cache --------------------------------------------------------------------------------------------------

def cache_key(cfg: DflashConfig, legacy: bool = False) -> str:
    """Responses depend on the target (its files by content: config, tokenizer, template, weights; a `build: random`
    target's weights on the seed), the generation settings and the seed; never on the engine, the shard or when the
    target was built (a rebuild that wrote the same bytes keeps every cached response). `legacy`: the key of caches
    made before (the target by its config files and its weight files' sizes and mtimes), to take them over."""
    from dflash import paths
    from dflash.content import Digests
    from dflash.target import target_identity
    r = cfg.data.regenerate
    target = (_legacy_identity(cfg.target.path) if legacy
              else target_identity(cfg.target.path, Digests(paths.digests(cfg.results_dir))))
    key = {"target": target, "max_new_tokens": r.max_new_tokens,
           "temperature": r.temperature, "max_length": cfg.data.max_length,
           "seed": cfg.seed}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _legacy_identity(path) -> dict:
    path = Path(path)
    files = sorted(p for pat in ("*.safetensors", "*.bin") for p in path.glob(pat))
    text = "".join((path / f).read_text() for f in ("config.json", "tokenizer_config.json", "chat_template.jinja",
                                                     "generation_config.json") if (path / f).is_file())
    return {"config": hashlib.sha256(text.encode()).hexdigest()[:16],
            "weights": [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]}


def load_cache(folder: Path) -> dict[str, dict]:
    """{conv_hash: entry} of every finished chunk (chunks are written atomically; a torn one, e.g. cut by a copy, is
    set aside by `load_cache_file`)."""
    out = {}
    for f in sorted(Path(folder).glob("chunk-*.jsonl")):
        out.update(load_cache_file(f))
    return out


def write_chunk(folder: Path, entries: list[dict]) -> Path:
    name = hashlib.sha256("".join(sorted(e["hash"] for e in entries)).encode()).hexdigest()[:16]
    return atomic_write_text(Path(folder) / f"chunk-{name}.jsonl",
                             "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))


# ---- engines ----------------------------------------------------------------------------------------------------

class HFEngine:
    """In-process generation: prompts sorted by length, left-padded batches, transformers `generate` or the static-cache
    decoder with a CUDA-graph decode step (`dflash.data.generate.regenerate`)."""

    def __init__(self, model, tokenizer, rcfg: RegenerateSection):
        self.model, self.tokenizer, self.r = model, tokenizer, rcfg

    def generate(self, prompts, seed: int):
        r = self.r
        resp, st = regenerate(self.model, self.tokenizer, [ids for _, ids in prompts], r.max_new_tokens,
                              r.temperature, r.batch_size, seed=seed, progress=False,
                              decoder=r.decoder, compile=r.compile, cpu_batch_size=r.cpu_batch_size,
                              static_options={"attention": r.attention,   # compile_prefill null: the decoder's auto
                                              **({} if r.compile_prefill is None else
                                                 {"compile_prefill": r.compile_prefill})})
        return [self.tokenizer.decode(x, skip_special_tokens=True) for x in resp], st["tokens"]


class OpenAIEngine:
    """POST /completions to OpenAI-compatible servers with the locally rendered prompt (its text, or its token ids
    with `prompt_ids`: vLLM and SGLang take either, `transformers serve` text only); `concurrency` requests in
    flight per server; timeouts, connection errors, 429 and 5xx are retried with exponential backoff, and a server
    that stays down ends the stage with one line naming it."""

    RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}

    def __init__(self, rcfg: RegenerateSection, model_name: str):
        if not rcfg.servers:
            raise UserError("data.regenerate.servers is empty: give the base URL of at least one OpenAI-compatible "
                            "server (e.g. http://127.0.0.1:8000/v1) for engine openai")
        self.r, self.model_name = rcfg, rcfg.model or model_name
        self.servers = [s.rstrip("/") for s in rcfg.servers]

    def generate(self, prompts, seed: int):
        return asyncio.run(self._all(prompts, seed))

    async def _all(self, prompts, seed):
        import httpx
        r = self.r
        queue: asyncio.Queue = asyncio.Queue()
        for i, (text, ids) in enumerate(prompts):
            queue.put_nowait((i, list(ids) if r.prompt_ids else text))
        texts: list[str | None] = [None] * len(prompts)
        tokens = [0]
        limits = httpx.Limits(max_connections=r.concurrency * len(self.servers))
        async with httpx.AsyncClient(timeout=r.timeout_s, limits=limits) as client:
            async def worker(base):
                while not queue.empty():
                    i, text = queue.get_nowait()
                    texts[i], n = await self._one(client, base, text, seed)
                    tokens[0] += n
            tasks = [asyncio.create_task(worker(b)) for b in self.servers for _ in range(r.concurrency)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        return texts, tokens[0]

    async def _one(self, client, base: str, prompt, seed: int):
        import httpx
        r = self.r
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": r.max_new_tokens,
                "temperature": r.temperature, "seed": seed, "stream": False}
        url = f"{base}/completions"
        for attempt in range(r.retries + 1):
            try:
                resp = await client.post(url, json=body)
                if resp.status_code == 200:
                    out = resp.json()
                    choice = out["choices"][0]
                    return choice["text"], int((out.get("usage") or {}).get("completion_tokens") or 0)
                why = f"HTTP {resp.status_code}: {resp.text[:200]!r}"
                if resp.status_code not in self.RETRY_STATUS:
                    raise UserError(f"regeneration server {base}: {why} (not retried; check data.regenerate.model "
                                    f"= {self.model_name!r} and prompt_ids = {r.prompt_ids})")
            except httpx.TransportError as e:    # timeouts, refused or dropped connections
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except (KeyError, IndexError, ValueError) as e:
                raise UserError(f"regeneration server {base}: unexpected /completions answer ({e})") from None
            if attempt < r.retries:
                wait = min(r.backoff_s * 2 ** attempt, 60.0) * (0.5 + random.random() / 2)
                log.warning("regeneration server %s: %s; retry %d/%d in %.1fs", base, why, attempt + 1, r.retries, wait)
                await asyncio.sleep(wait)
        raise UserError(f"regeneration server {base} still failing after {r.retries} retries: {why} "
                        f"(is it up? data.regenerate.servers)")


def make_engine(cfg: DflashConfig, shard: int = 0):
    """The configured engine. `hf` loads the target onto data.regenerate.device (`auto` with several data shards:
    shard I on GPU I mod the GPUs visible, so N shards on one node use N GPUs). `openai`: shard I starts its
    requests at server I, so shards spread over the servers."""
    r = cfg.data.regenerate
    if r.engine == "openai":
        eng = OpenAIEngine(r, str(cfg.target.path))
        k = shard % len(eng.servers)
        eng.servers = eng.servers[k:] + eng.servers[:k]
        return eng
    import torch

    from dflash.target import load_target, load_tokenizer, resolve_device
    device = resolve_device(r.device)
    if r.device == "auto" and device == "cuda" and torch.cuda.device_count() > 1:
        device = f"cuda:{shard % torch.cuda.device_count()}"
    return HFEngine(load_target(cfg.target, device=device, seed=cfg.seed), load_tokenizer(cfg.target), r)


# ---- the rounds -------------------------------------------------------------------------------------------------

def _regenerate_chunk(engine, tokenizer, chunk, max_length, seed, prompt_text):
    """Regenerate every assistant turn of the conversations of one chunk, one round per turn (a later turn sees the
    regenerated earlier ones). Returns ([entry], generated tokens)."""
    pending = {c["hash"]: list(c["messages"]) for c in chunk}
    done: dict[str, list] = {h: [] for h in pending}
    failed: dict[str, str] = {}
    tokens = rnd = 0
    while pending:
        rnd += 1
        todo, prompts = [], []
        for h, msgs in list(pending.items()):
            a = next((k for k, m in enumerate(msgs) if m["role"] == "assistant"), None)
            if a is None:
                del pending[h]
                continue
            ids = prompt_ids(tokenizer, done[h] + msgs[:a])
            if len(ids) >= max_length:
                if not any(m["role"] == "assistant" for m in done[h]):
                    failed[h] = "prompt_too_long"
                del pending[h]
                continue
            done[h].extend(msgs[:a])
            pending[h] = msgs[a:]
            todo.append(h)
            prompts.append((prompt_text(done[h]), ids))
        if not todo:
            break
        texts, n = engine.generate(prompts, seed + rnd)
        tokens += n
        for h, text in zip(todo, texts):
            pending[h] = pending[h][1:]                    # drop the original assistant turn
            if not text.strip():
                if not any(m["role"] == "assistant" for m in done[h]):
                    failed[h] = "empty_response"
                del pending[h]
                continue
            done[h].append({"role": "assistant", "content": text})
    entries = []
    for c in chunk:
        h = c["hash"]
        if h in failed:
            entries.append({"hash": h, "reject": failed[h]})
            continue
        msgs = done[h]
        while msgs and msgs[-1]["role"] != "assistant":
            msgs = msgs[:-1]
        entries.append({"hash": h, "messages": msgs})
    return entries, tokens


class CacheIndex:
    """Which chunk file holds each finished conversation (16-byte keys: the index stays small), and the entries of
    one chunk file at a time, read on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.where: dict[bytes, str] = {}
        for f in sorted(self.folder.glob("chunk-*.jsonl")):
            for h in load_cache_file(f):
                self.where[bytes.fromhex(h[:32])] = f.name
        self._file, self._entries = None, {}

    def __contains__(self, h: str) -> bool:
        return bytes.fromhex(h[:32]) in self.where

    def get(self, h: str) -> dict:
        name = self.where[bytes.fromhex(h[:32])]
        if name != self._file:
            self._file, self._entries = name, load_cache_file(self.folder / name)
        return self._entries[h]

    def add(self, name: str, entries: list[dict]):
        for e in entries:
            self.where[bytes.fromhex(e["hash"][:32])] = name
        self._file, self._entries = name, {e["hash"]: e for e in entries}


def load_cache_file(path) -> dict[str, dict]:
    """{conv_hash: entry} of one chunk file. A torn or damaged one (a line that is not an entry) is set aside as
    `<name>.torn`, named in one warning line, and gives nothing: its conversations are regenerated."""
    path = Path(path)
    try:
        entries = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        for e in entries:
            if not (isinstance(e, dict) and isinstance(e.get("hash"), str) and ("messages" in e or "reject" in e)):
                raise ValueError(f"not a cache entry: {str(e)[:60]!r}")
            bytes.fromhex(e["hash"][:32])
        return {e["hash"]: e for e in entries}
    except (ValueError, UnicodeDecodeError) as e:
        torn = path.with_name(path.name + ".torn")
        try:
            os.replace(path, torn)
        except FileNotFoundError:   # another data shard, which shares the folder, set it aside first
            return {}
        except OSError as moved:
            raise io_error(moved, path) or UserError(f"{path}: a torn regeneration cache chunk that cannot be set "
                                                     f"aside ({moved}): delete it and rerun") from None
        log.warning("%s: a torn regeneration cache chunk (%s: %s); set aside as %s, its conversations are "
                    "regenerated (delete it when you like)", path, type(e).__name__, e, torn.name)
        return {}
    except FileNotFoundError:       # set aside by another data shard since the folder was listed
        return {}
    except OSError as e:
        raise io_error(e, path, "read") or UserError(f"{path}: cannot read this regeneration cache chunk ({e}); "
                                                     f"delete it and rerun") from None


def _chunked(items, n: int):
    chunk = []
    for c in items:
        chunk.append(c)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _Chunks:
    """The chunks of one regeneration: each one's conversations from the cache, or regenerated (the engine made at the
    first miss) and the chunk written before anything of it is yielded; `stats` and the progress (a bar, or a log line
    every 30 s) kept up to date."""

    def __init__(self, cfg: DflashConfig, tokenizer, cache_dir: Path, stats: dict, total: int, progress, engine,
                 shard: int):
        from tqdm import tqdm
        r = cfg.data.regenerate
        self.cfg, self.tokenizer, self.cache_dir, self.stats, self.total = cfg, tokenizer, cache_dir, stats, total
        self.progress, self.engine, self.shard = progress, engine, shard
        self.index = CacheIndex(cache_dir)
        stats.update({"enabled": True, "engine": r.engine, "max_new_tokens": r.max_new_tokens,
                      "temperature": r.temperature, "conversations": 0, "cached": 0, "tokens": 0, "seconds": 0.0,
                      "tokens_per_s": 0.0, "cache": str(cache_dir)})
        log.info("regeneration (%s): %d conversations, %d finished ones in %s", r.engine, total,
                 len(self.index.where), cache_dir)
        self.bar = tqdm(total=total, desc=f"regenerate ({r.engine})", unit="conv", disable=not progress,
                        mininterval=2.0)
        self.t_gen, self.last_log = 0.0, time.time()

    def process(self, chunk: list[dict]):
        """Yield (conversation, messages or reject reason) for each of `chunk`."""
        todo = [c for c in chunk if c["hash"] not in self.index]
        self.stats["conversations"] += len(chunk)
        self.stats["cached"] += len(chunk) - len(todo)
        fresh = self._generate(todo) if todo else {}
        self._report(len(chunk))
        for c in chunk:
            e = fresh.get(c["hash"]) or self.index.get(c["hash"])
            yield c, (e["reject"] if "reject" in e else e["messages"])

    def _generate(self, todo: list[dict]) -> dict[str, dict]:
        """Regenerate `todo`, write its chunk; {hash: entry}."""
        cfg, r = self.cfg, self.cfg.data.regenerate
        if self.engine is None:
            self.engine = make_engine(cfg, self.shard)
            if r.engine == "hf":
                self.stats["device"] = str(next(self.engine.model.parameters()).device)
        t0 = time.time()
        seed = cfg.seed + int(todo[0]["hash"][:8], 16) if r.temperature > 0 else cfg.seed
        prompt_text = lambda m: render(self.tokenizer, m, add_generation_prompt=True)    # noqa: E731
        entries, n = _regenerate_chunk(self.engine, self.tokenizer, todo, cfg.data.max_length, seed, prompt_text)
        self.index.add(write_chunk(self.cache_dir, entries).name, entries)
        self.stats["tokens"] += n
        self.t_gen += time.time() - t0
        return {e["hash"]: e for e in entries}

    def _report(self, n: int):
        st, rate = self.stats, self.stats["tokens"] / max(self.t_gen, 1e-9)
        self.bar.update(n)
        self.bar.set_postfix(tok_s=f"{rate:.0f}")
        if not self.progress and time.time() - self.last_log > 30:
            self.last_log = time.time()
            log.info("regenerated %d/%d conversations (%d from the cache), %d tokens, %.0f tok/s",
                     st["conversations"], self.total, st["cached"], st["tokens"], rate)

    def close(self):
        self.bar.close()
        if isinstance(self.engine, HFEngine):
            from dflash.data.decode import release
            release(self.engine.model)                           # its static decoder's KV cache
        self.stats["seconds"] = round(self.t_gen, 3)
        self.stats["tokens_per_s"] = round(self.stats["tokens"] / max(self.t_gen, 1e-9), 1)


def regenerate_stream(convs, total: int, tokenizer, cfg: DflashConfig, cache_dir, stats: dict, progress=True,
                      engine=None, shard: int = 0):
    """Yield (conversation, messages list or reject reason str) for an iterable of {"hash", "messages", ...},
    `chunk_size` at a time: a chunk's conversations found in the cache come from it, the others are regenerated
    (the engine starts at the first miss) and the chunk is written before anything of it is yielded. `stats` is
    filled in place (tokens, seconds, cached...)."""
    cache_dir = Path(cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise io_error(e, cache_dir) or e
    chunks = _Chunks(cfg, tokenizer, cache_dir, stats, total, progress, engine, shard)
    for chunk in _chunked(convs, cfg.data.regenerate.chunk_size):
        yield from chunks.process(chunk)
    chunks.close()


# ---- the step ---------------------------------------------------------------------------------------------------

def default_cache_dir(cfg: DflashConfig) -> Path:
    """Where finished regeneration chunks are kept across runs: <results_dir>/data/<dataset>.regen/<key>. A cache made
    under the key of before (the target by its files' mtimes) is taken over, renamed: its responses are kept."""
    from dflash import paths
    root = Path(f"{paths.dataset(cfg.results_dir, cfg.dataset_name)}.regen")
    folder, legacy = root / cache_key(cfg), root / cache_key(cfg, legacy=True)
    if not folder.exists() and legacy.is_dir():
        with contextlib.suppress(OSError):   # another shard's job took it over first
            legacy.rename(folder)
    return folder


def regenerated(cfg: DflashConfig, convs, n: int, tokenizer, spill: Spill, cache_dir, tally: Tally, stats: dict,
                progress=True, shard: int = 0) -> Spill:
    """Step `regenerate`: the `n` conversations `convs` to train on, into `spill` as {id, source, messages (JSON)}:
    regenerated by the target when data.regenerate.enabled (resumable: finished chunks kept in `cache_dir`, default
    `default_cache_dir`; a conversation that could not be is a counted reject), else as they are. `stats`: the
    regeneration's figures (manifest.json `regeneration`), filled in place."""
    if cfg.data.regenerate.enabled:
        cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(cfg)
        for c, r in regenerate_stream(convs, n, tokenizer, cfg, cache_dir, stats, progress=progress, shard=shard):
            if isinstance(r, str):
                tally.reject(c["source"], r)
            else:
                spill.add({"id": c["id"], "source": c["source"], "messages": json.dumps(r, ensure_ascii=False)})
    else:
        for c in convs:
            spill.add({"id": c["id"], "source": c["source"], "messages": json.dumps(c["messages"], ensure_ascii=False)})
    spill.close()
    return spill
