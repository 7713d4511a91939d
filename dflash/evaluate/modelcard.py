"""README.md model card of an exported drafter, and what it states of the run: its summary, its evaluation (of that
very drafter) and its dataset's manifest, read (`stated`), a damaged one refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from dflash.config_model import DflashConfig
from dflash.data.shards import MANIFEST
from dflash.errors import UserError, io_error
from dflash.paths import RunFolder
from dflash.records import problem
from dflash.records.acceptance import AcceptanceCore, engines


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


def stated(folder: RunFolder, checkpoint: Path, data: Path) -> tuple[dict | None, AcceptanceCore | None, dict | None]:
    """(summary, evaluation, dataset manifest) the card states of the run in `folder`, exported from `checkpoint`,
    trained on the dataset folder `data`; each None where there is none. The evaluation must be of `checkpoint`."""
    summary = _read(folder.summary, "retrain the run (snakemake -R train)")
    acceptance = read_evaluation(folder.acceptance())
    if acceptance is not None and Path(str(acceptance.drafter)).resolve() != checkpoint.resolve():
        raise UserError(f"{folder.acceptance()} evaluated {acceptance.drafter}, not {checkpoint}: evaluate "
                        f"this drafter first (snakemake -R evaluate)")
    return summary, acceptance, _read(data / MANIFEST, "rerun the data stage (snakemake -R data)")


def _read(path, remedy: str):
    """The JSON record at `path` that the model card states (the run's summary, evaluation, dataset manifest); None
    where there is none. One that cannot be read or is not JSON is refused in one line: a card saying "not
    evaluated" beside a damaged acceptance.json would be wrong without a word."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise io_error(e, path, "read") or UserError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return json.loads(text)
    except ValueError:
        raise UserError(f"{path}: damaged (not JSON), so the model card cannot state it: {remedy}, or move it "
                        f"away to export without it") from None


def read_evaluation(path) -> AcceptanceCore | None:
    """The run's evaluation through its reader view (dflash/records/acceptance.py: AcceptanceCore), for the card; None
    without one (no file); a damaged one, or one whose keys have other types, is refused, naming the file (and the
    key)."""
    data = _read(path, "rerun evaluate (snakemake -R evaluate)")
    if data is None:
        return None
    try:
        return AcceptanceCore.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{path}: {problem(e)}: not an evaluation the model card can state; rerun evaluate "
                        f"(snakemake -R evaluate)") from None
