"""README.md model card of an exported drafter."""
from __future__ import annotations

from dflash.records.acceptance import AcceptanceCore, engines
from dflash.config_model import DflashConfig


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def _tau(acc: AcceptanceCore | None) -> str:
    """The card's tau: at temperature 0 one figure (greedy, the same under every engine); above it one per draft
    policy, each naming the engines that run it (an acceptance.json without `by_proposal` sampled its drafts)."""
    if acc is None:
        return "n/a (not evaluated when exported: see acceptance.json)"
    t = acc.temperature or 0
    setting = f"{acc.num_prompts} held-out prompts, {acc.max_new_tokens} new tokens, lossless {acc.lossless}"
    if t == 0:
        return f"{_fmt(acc.tau)} (temperature 0, greedy: the same under every engine; {setting})"
    taus = "; ".join(f"{_fmt(tau)} with {k} drafts ({engines(k)})" for k, tau in acc.policy_taus().items())
    return f"{taus} (temperature {t:g}; {setting})"


def model_card(cfg: DflashConfig, target_config, dcfg, checkpoint, summary, acceptance: AcceptanceCore | None,
               manifest, config_json) -> str:
    tput = (summary or {}).get("throughput") or {}
    arch = (getattr(target_config, "architectures", None) or [getattr(target_config, "model_type", "?")])[0]
    lines = [
        f"# DFlash drafter `{cfg.run_name}`",
        "",
        "A DFlash block-diffusion drafter for speculative decoding, trained by the dflash pipeline.",
        "",
        "| | |",
        "| --- | --- |",
        f"| target | `{cfg.target.path}` ({arch}, {target_config.num_hidden_layers} layers, hidden "
        f"{target_config.hidden_size}, vocab {target_config.vocab_size}) |",
        f"| drafter | {dcfg.num_layers} layers, block size {dcfg.block_size}, target layers {dcfg.target_layer_ids}, "
        f"mask token {dcfg.mask_token_id} |",
        f"| weights dtype | {config_json.get('dtype')} |",
        f"| checkpoint | `{checkpoint}` |",
        f"| run id | {(summary or {}).get('run_id', 'n/a')} (status {(summary or {}).get('status', 'n/a')}, "
        f"{(summary or {}).get('steps', 'n/a')} steps) |",
        f"| git commit | {((summary or {}).get('git') or {}).get('commit', 'n/a')} |",
        f"| config hash | {(summary or {}).get('config_hash', 'n/a')} |",
        f"| data manifest hash | {(manifest or {}).get('content_hash') or (summary or {}).get('data_hash', 'n/a')} |",
        f"| training throughput | {_fmt(tput.get('ktok_per_s'))} Ktok/s |",
        f"| acceptance length tau | {_tau(acceptance)} |",
        "",
        "## Files",
        "",
        "`config.json` (a Qwen3 config plus `block_size`, `num_target_layers` and "
        "`dflash_config: {mask_token_id, target_layer_ids}`) and `model.safetensors` (`fc.weight`, "
        "`hidden_norm.weight`, `norm.weight`, `layers.N.*`). The embedding and LM head are the target's and are not "
        "included.",
        "",
        "## Use with the reference package (`pip install \"dflash[local]==0.1.0\"`)",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM",
        "from dflash import DFlashDraftModel",
        "",
        f"target = AutoModelForCausalLM.from_pretrained(\"{cfg.target.path}\", dtype=torch.bfloat16).eval()",
        "draft = DFlashDraftModel.from_pretrained(\"path/to/this/folder\", dtype=torch.bfloat16).eval()",
        "out = draft.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[tokenizer.eos_token_id])",
        "```",
        "",
        "SGLang and vLLM load the same folder as a DFlash draft model.",
        "",
    ]
    return "\n".join(lines)
