"""The code target (`target.build: code`): a Qwen3 model pre-trained on the Python source every machine has.

`build_code_target(target_cfg, out_dir, seed=0, progress=True, threads=None)` writes into `out_dir` (the caller
makes it atomic) what `load_target` reads like any user's model: the tokenizer (byte-level BPE of
`arch.vocab_size` trained on `pretrain.tokenizer_mb` of the pre-training text, with the tiny target's special
tokens and chat template), Qwen3ForCausalLM weights of the `arch` shape (safetensors, float32), the generation
config, and `build.json`.

Corpus (`dflash.data.code_corpus`): the pre-training files, plus "complete this function" conversations made from
them in the chat template (up to `pretrain.chat_fraction` of their characters), each document followed by
`<|endoftext|>` in one token stream. The held-out files are never trained on: their stream gives the held-out
perplexity (mean token NLL over `pretrain.eval_windows` evenly spaced windows of `seq_len`), and the `code` data
source makes its conversations from them.

build.json: corpus (roots, cap, files, bytes, skipped, hash of the file list and contents, pre-training and held-out
file counts, conversations, tokens), tokenizer (size, text it was trained on, bytes per token), params, pretrain
(device, steps, tokens seen, epochs, seconds, first-step seconds, tokens/s, what stopped it, loss curve), heldout
and pretrain_eval ({nll, perplexity, windows, tokens}), seconds (total), phase_seconds and files (every file written:
size, mtime, sha256; `dflash.target.write_build`).
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from dflash.config_model import PretrainSection, TargetSection
from dflash.data import code_corpus
from dflash.data.pretrain import compile_layers, loss_summary, mean_nll, pretrain
from dflash.data.tiny_target import EOS, cpu_threads, generation_config, qwen3_config, render, train_tokenizer
from dflash.errors import UserError
from dflash.target import write_build

log = logging.getLogger("dflash.target")
ENCODE_BATCH = 1024        # documents per call into the tokenizer's (multi-threaded) batch encoder


def encode(tokenizer, texts: list[str]):
    """One int32 token stream: each text's tokens followed by <|endoftext|> (the tokenizer's batch encoder)."""
    import numpy as np
    eos = np.array([tokenizer.convert_tokens_to_ids(EOS)], dtype=np.int32)
    parts = []
    for i in range(0, len(texts), ENCODE_BATCH):
        for e in tokenizer.backend_tokenizer.encode_batch_fast(texts[i:i + ENCODE_BATCH], add_special_tokens=False):
            parts += [np.asarray(e.ids, dtype=np.int32), eos]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def tokenizer_sample(docs: list[tuple[str, str]], mb: float) -> list[str]:
    """Texts of `docs` ((name, text)) in a hash order of their names, up to `mb` MiB: files and conversations alike."""
    out, size = [], 0
    for _, text in sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest()):
        if size >= mb * (1 << 20):
            break
        out.append(text)
        size += len(text)
    return out


def build_code_target(target_cfg: TargetSection, out_dir, seed: int = 0, progress: bool = True,
                      threads: int | None = None) -> dict:
    """Build the code target into `out_dir`; returns build.json's content. `threads`: torch CPU threads."""
    with cpu_threads(threads):
        return _build(target_cfg, Path(out_dir), seed, progress)


def _corpus(pre: PretrainSection):
    """(pre-training documents [(name, text)], held-out texts, build.json's corpus record)."""
    files, skipped = code_corpus.read_files(code_corpus.cap_bytes(pre))
    train, held = code_corpus.split(files, pre.heldout_fraction)
    if not train or not held:
        raise UserError(f"target.pretrain: {len(files)} files under corpus_mb {pre.corpus_mb} leave "
                        f"{len(train)} for pre-training and {len(held)} held out (heldout_fraction "
                        f"{pre.heldout_fraction}): raise corpus_mb, or move heldout_fraction away from 0 and 1")
    chars = sum(len(f.text) for f in train)
    chats = code_corpus.conversations(train, max_chars=int(pre.chat_fraction * chars), processes=pre.num_proc)
    docs = [(f.name, f.text) for f in train] + [(c["id"], render(c["messages"])) for c in chats]
    record = {"roots": [{"name": n, "path": str(p)} for n, p in code_corpus.roots()], "cap_mb": pre.corpus_mb,
              "files": len(files), "bytes": sum(len(f.text.encode()) for f in files), "skipped": skipped,
              "hash": code_corpus.files_hash(files), "heldout_fraction": pre.heldout_fraction,
              "pretrain_files": len(train), "heldout_files": len(held),
              "chat_conversations": len(chats), "chat_chars": sum(len(t) for n, t in docs[len(train):])}
    return docs, [f.text for f in held], record


def _tokenised(pre: PretrainSection, vocab_size: int, docs, held_texts, corpus: dict, times: dict):
    """(tokenizer, the texts it was trained on, pre-training token stream, held-out token stream): the tokenizer
    trained on `pretrain.tokenizer_mb` of the documents, both streams encoded; corpus["tokens"] set."""
    t = time.perf_counter()
    sample = tokenizer_sample(docs, pre.tokenizer_mb)
    tokenizer = train_tokenizer(sample, vocab_size)
    times["tokenizer"] = time.perf_counter() - t
    t = time.perf_counter()
    stream = encode(tokenizer, [text for _, text in docs])
    held = encode(tokenizer, held_texts)
    times["encode"] = time.perf_counter() - t
    corpus["tokens"] = {"pretrain": int(stream.size), "heldout": int(held.size)}
    if stream.size <= pre.seq_len + 1:
        raise UserError(f"target.pretrain.corpus_mb {pre.corpus_mb} gives {stream.size} pre-training tokens, "
                        f"too few for seq_len {pre.seq_len}: raise corpus_mb")
    log.info("tokenizer: %d tokens, trained on %d texts in %.1fs; encoded %d + %d held-out tokens in %.1fs",
             len(tokenizer), len(sample), times["tokenizer"], stream.size, held.size, times["encode"])
    return tokenizer, sample, stream, held


def _pretrain_record(pre: PretrainSection, device, done: dict, stream_size: int) -> dict:
    """build.json's `pretrain`."""
    import torch
    train_s = done["seconds"] - done["first_step_seconds"]
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "compile": pre.compile, "steps": done["steps"], "max_steps": pre.steps,
            "batch_size": pre.batch_size, "seq_len": pre.seq_len, "lr": pre.lr,
            "tokens_seen": done["tokens_seen"], "epochs": round(done["tokens_seen"] / stream_size, 3),
            "seconds": round(done["seconds"], 3), "first_step_seconds": round(done["first_step_seconds"], 3),
            "tokens_per_s": round((done["tokens_seen"] - pre.batch_size * pre.seq_len) / train_s, 1)
            if done["steps"] > 1 and train_s > 0 else None,
            "max_seconds": pre.max_seconds, "stopped_by": done["stopped_by"], **loss_summary(done["losses"])}


def _build(target_cfg: TargetSection, out_dir: Path, seed: int, progress: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.target import resolve_device

    pre, arch = target_cfg.pretrain, target_cfg.arch
    times, t0 = {}, time.perf_counter()
    docs, held_texts, corpus = _corpus(pre)
    times["corpus"] = time.perf_counter() - t0
    log.info("code corpus: %d files (%.1f MB), %d pre-training + %d held out, %d conversations, %.1fs",
             corpus["files"], corpus["bytes"] / 1e6, corpus["pretrain_files"], corpus["heldout_files"],
             corpus["chat_conversations"], times["corpus"])
    tokenizer, sample, stream, held = _tokenised(pre, arch.vocab_size, docs, held_texts, corpus, times)

    device = torch.device(resolve_device(pre.device))
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(qwen3_config(arch, tokenizer, "float32"), dtype=torch.float32,
                                                 attn_implementation=target_cfg.attn_implementation)
    if pre.compile:
        compile_layers(model)
    done = pretrain(model, stream, pre.steps, pre.batch_size, pre.seq_len, pre.lr, seed=seed, progress=progress,
                    max_seconds=pre.max_seconds, label="code target") if pre.steps else \
        {"losses": [], "steps": 0, "seconds": 0.0, "first_step_seconds": 0.0, "tokens_seen": 0, "stopped_by": "steps"}
    times["pretrain"] = done["seconds"]
    t = time.perf_counter()
    heldout = mean_nll(model, held, pre.seq_len, pre.eval_windows, pre.batch_size)
    seen = mean_nll(model, stream, pre.seq_len, pre.eval_windows, pre.batch_size)
    times["eval"] = time.perf_counter() - t
    log.info("code target: %d steps, %d tokens in %.1fs, loss %s; held-out NLL %.3f (perplexity %.2f), "
             "pre-training NLL %.3f", done["steps"], done["tokens_seen"], done["seconds"],
             loss_summary(done["losses"])["loss_end"], heldout["nll"], heldout["perplexity"], seen["nll"])

    t = time.perf_counter()
    model.to("cpu")
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    times["save"] = time.perf_counter() - t
    text_bytes = sum(len(t.encode()) for _, t in docs)
    info = {
        "build": "code", "seed": seed, "corpus": corpus,
        "tokenizer": {"size": len(tokenizer), "trained_on_texts": len(sample),
                      "trained_on_chars": sum(len(x) for x in sample),
                      "bytes_per_token": round(text_bytes / max(1, stream.size - len(docs)), 3)},   # EOS left out
        "params": sum(p.numel() for p in model.parameters()),
        "pretrain": _pretrain_record(pre, device, done, stream.size),
        "heldout": heldout, "pretrain_eval": seen,
        "seconds": round(time.perf_counter() - t0, 3), "phase_seconds": {k: round(v, 3) for k, v in times.items()},
    }
    return write_build(out_dir, info)
