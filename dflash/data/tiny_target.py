"""The embedded tiny target: a byte-level BPE tokenizer and a small model pre-trained briefly on CPU.

`build_target(target_cfg, out_dir)` writes a transformers folder into `out_dir` (the caller makes it atomic):
- `tiny`: tokenizer + a causal LM of `target.arch` (Qwen3, or another `arch.family`: dflash.families), pre-trained
  `target.pretrain.steps` steps on the chat-formatted built-in corpus; safetensors weights; `build.json` with the
  loss curve, seconds and every file written (`dflash.target.write_build`).
- `random`: config.json of `target.arch` + the tiny tokenizer, no weights (`load_target` makes them).
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from dflash.config_model import ArchSection, TargetSection
from dflash.data import corpus as corpus_mod
from dflash.data.pretrain import compile_layers, loss_summary, pretrain
from dflash.target import write_build

log = logging.getLogger("dflash.target")

EOS, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (the same text as the tokenizer's template)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, wrapped as a PreTrainedTokenizerFast with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK,
                                   additional_special_tokens=[IM_START, IM_END], model_max_length=1 << 20,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def qwen3_config(arch: ArchSection, tokenizer, dtype: str = "float32"):
    from transformers import Qwen3Config
    vocab = arch.vocab_size
    if vocab < len(tokenizer):
        raise ValueError(f"target.arch.vocab_size {vocab} is smaller than the tokenizer ({len(tokenizer)})")
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=float(arch.rope_theta),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
        dtype=dtype,
    )


def target_config(arch: ArchSection, tokenizer, dtype: str = "float32"):
    """The transformers config of a built target of `arch`: Qwen3 as it always was, another `arch.family` through
    dflash.families (its own defaults, e.g. Gemma 3's tied head, plus the tokenizer's special ids)."""
    if arch.family == "qwen3":
        return qwen3_config(arch, tokenizer, dtype)
    from dflash.families import hf_config
    if arch.vocab_size < len(tokenizer):
        raise ValueError(f"target.arch.vocab_size {arch.vocab_size} is smaller than the tokenizer ({len(tokenizer)})")
    eos, im_end = tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)
    return hf_config(arch, bos_token_id=eos, eos_token_id=im_end, pad_token_id=eos, dtype=dtype)


def generation_config(tokenizer):
    from transformers import GenerationConfig
    return GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS)],
                            pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
                            bos_token_id=tokenizer.convert_tokens_to_ids(EOS), do_sample=False)


def build_target(target_cfg: TargetSection, out_dir, seed: int = 0, corpus_size: int = 1500, progress: bool = True,
                 threads: int | None = None) -> dict:
    """Write the target folder into `out_dir` (tiny: trained; random: config + tokenizer). Returns build info.

    `threads` sets torch's CPU threads for the pre-training (restored after): on a shared 2-core machine one thread
    is several times faster than two contending ones."""
    with cpu_threads(threads):
        return _build_target(target_cfg, out_dir, seed, corpus_size, progress)


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """Temporarily set torch's intra-op CPU threads (None or 0: leave as is)."""
    import torch
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _build_target(target_cfg: TargetSection, out_dir, seed, corpus_size, progress) -> dict:
    import torch

    t0 = time.time()
    out_dir = Path(out_dir)
    build = target_cfg.build
    arch = target_cfg.arch
    convs = corpus_mod.conversations(corpus_size, seed=0)
    texts = [render(c["messages"]) for c in convs]
    tokenizer = train_tokenizer(texts, arch.vocab_size)
    t_tok = time.time() - t0
    dtype_name = target_cfg.dtype
    info = {"build": build, "corpus": {"conversations": len(convs), "hash": corpus_mod.corpus_hash(convs)},
            "tokenizer": {"size": len(tokenizer), "seconds": round(t_tok, 3)}, "seed": seed}
    if build == "random":
        config = target_config(arch, tokenizer, "bfloat16" if dtype_name == "auto" else dtype_name)
        config.save_pretrained(out_dir)
        generation_config(tokenizer).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        info["seconds"] = round(time.time() - t0, 3)
        return write_build(out_dir, info)
    if build != "tiny":
        raise ValueError(f"target.build {build!r}: the target stage only builds `tiny` or `random`")

    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    config = target_config(arch, tokenizer, "float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config) if arch.family == "qwen3" else AutoModelForCausalLM.from_config(config)
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.convert_tokens_to_ids(EOS))
    pre = target_cfg.pretrain
    steps = pre.steps
    t1 = time.time()
    if pre.compile:
        compile_layers(model)
    done = pretrain(model, stream, steps, pre.batch_size, pre.seq_len,
                    float(pre.lr), seed=seed, progress=progress, max_seconds=pre.max_seconds,
                    label="tiny target") if steps else {"losses": [], "steps": 0}
    t_train = time.time() - t1
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info.update({
        "params": sum(p.numel() for p in model.parameters()),
        "corpus_tokens": len(stream),
        "pretrain": {"steps": done["steps"], "seconds": round(t_train, 3),
                     "tokens_per_s": round(done["steps"] * pre.batch_size * pre.seq_len
                                           / max(t_train, 1e-9), 1),
                     **loss_summary(done["losses"])},
        "seconds": round(time.time() - t0, 3),
        "threads": torch.get_num_threads(),
    })
    return write_build(out_dir, info)
