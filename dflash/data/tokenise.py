"""Conversations through the target's chat template: token ids, the loss mask of the assistant turns, prompts.

Public:
- `target_tokenizer(cfg)` -> (the target's tokenizer, its vocab_size: the target config's, else len(tokenizer))
- `render(tokenizer, messages, add_generation_prompt=False)` -> the chat template's text
- `end_of_turn_strings(tokenizer)` -> the end-of-turn strings that close an assistant turn (and belong to its loss mask)
- `prompt_ids(tokenizer, messages)` -> ids of the chat template up to and including the assistant generation prompt
- `conversation_ids(tokenizer, messages, stop_strings=None)` -> (input_ids, loss_mask) or a reject reason (str)
"""
from __future__ import annotations


def target_tokenizer(cfg):
    """(the target's tokenizer, its vocab_size: the target config's, else len(tokenizer))."""
    from transformers import AutoConfig

    from dflash.target import load_tokenizer
    tokenizer = load_tokenizer(cfg.target)
    tconf = AutoConfig.from_pretrained(str(cfg.target.path), trust_remote_code=cfg.target.trust_remote_code)
    return tokenizer, int(getattr(tconf, "vocab_size", len(tokenizer)))


def render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def end_of_turn_strings(tokenizer) -> list[str]:
    from dflash.target import END_OF_TURN_TOKENS
    vocab = tokenizer.get_vocab()
    out = [t for t in END_OF_TURN_TOKENS if t in vocab]
    if tokenizer.eos_token and tokenizer.eos_token not in out:
        out.append(tokenizer.eos_token)
    return out


def prompt_ids(tokenizer, messages) -> list[int]:
    """The chat template of `messages` followed by the assistant generation prompt, as token ids."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _assistant_spans(tokenizer, messages, full: str, stops) -> list[tuple[int, int]] | str:
    """Character spans of `full` that each assistant turn's content and its end-of-turn string take, or
    "template_mismatch" when the template does not render each turn as a prefix of the next."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[:i + 1])
        if not (upto.startswith(prefix) and full.startswith(upto)):
            return "template_mismatch"
        seg = upto[len(prefix):]
        content = m["content"].strip()
        j = seg.find(content)
        if j < 0:
            return "template_mismatch"
        end = j + len(content)
        for s in stops:
            if seg.startswith(s, end):
                end += len(s)
                break
        spans.append((len(prefix) + j, len(prefix) + end))
    return spans


def conversation_ids(tokenizer, messages, stop_strings=None):
    """(input_ids, loss_mask) of a conversation; the mask covers each assistant turn's content and its end-of-turn
    token (and nothing of the template around it). Returns a reject reason (str) when the template does not render
    each turn as a prefix of the next (a template that rewrites history)."""
    stops = end_of_turn_strings(tokenizer) if stop_strings is None else stop_strings
    full = render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, full, stops)
    if isinstance(spans, str):
        return spans
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [0] * len(ids)
    k = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1] and e > s:
            mask[t] = 1
    return ids, mask
