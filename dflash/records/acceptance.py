"""acceptance.json, the evaluate stage's record: one typed description for its writer (evaluate/run.py builds it from
the figures of evaluate/acceptance.py, stages/evaluate.py writes it), its readers (report/history.py,
report/markdown.py, the export's model card: evaluate/modelcard.py) and the docs (docs/architecture.md, checked
against it by a test). Beside summary.json's model, below both `evaluate` and `report`: the report reads it without
importing the evaluation (torch); the draft policies and who runs them live here too.

`Acceptance` is every key the writer writes, with its meaning. `AcceptanceCore` is what its readers use, of a file of
any age: every key optional (the first files held only `tau`, some as {prompt set: tau}, read as their mean; later
ones lack the keys added since), the types checked where present, other keys kept (the sweep table reads a run's
acceptance files through it: dflash/report/sweep.py).
"""
from __future__ import annotations

import math

from pydantic import BaseModel, Field, field_validator

from dflash.records import WRITTEN, Read, key_table as records_table, like

# The draft policies at temperature > 0 and who decodes with each, today (the one source: acceptance.json's `engines`,
# the model card, the report's tables and plots). vLLM drafts argmax by default; its `draft_sample_method:
# probabilistic` samples each DFlash position independently (the `sample` policy), lossless only from vLLM PR #54282 on.
ENGINES = {"argmax": ["vLLM (default)", "SGLang", "TensorRT-LLM"],
           "sample": ["DeepSpec", "dflash 0.1.0 (reference package)",
                      "vLLM draft_sample_method: probabilistic (lossless from vLLM PR #54282)"]}
# Each policy in words: (its label in a plot's legend, what it is in a sentence).
WORDS = {"argmax": ("argmax drafts", "argmax drafts verified against a one-hot proposal"),
         "sample": ("sampled drafts", "drafts sampled from the drafter")}
OLDEST = "sample"   # the policy of a file written before `proposal` was (the first evaluations sampled their drafts)


def engines(policy: str) -> str:
    """The engines of a draft policy, as one phrase ("vLLM (default), SGLang, TensorRT-LLM")."""
    return ", ".join(ENGINES.get(policy, []))


def policies(proposal: str, temperature: float) -> list[str]:
    """The draft policies to decode with (evaluate.proposal), the top-level one first: at temperature 0 only argmax
    (greedy acceptance is one rule for both); above it argmax and sample for `auto` and `both`, else the one named."""
    if temperature <= 0:
        return ["argmax"]
    return {"auto": ["argmax", "sample"], "both": ["argmax", "sample"], "argmax": ["argmax"],
            "sample": ["sample"]}[proposal]


class Decoding(BaseModel):
    model_config = WRITTEN

    tokens: int = Field(description="Tokens generated.")
    seconds: float = Field(description="Seconds of decoding.")
    tokens_per_s: float | None = Field(description="tokens / seconds (null: no time measured).")
    target_forwards: int = Field(description="Forward passes of the target.")


class Figures(BaseModel):
    """One draft policy's figures pooled over every prompt set: the top level and `by_proposal.<policy>`."""
    model_config = WRITTEN

    tau: float | None = Field(description=(
        "Tokens produced per target verification step, bonus included (the prefill's first token is not a step)."))
    verify_steps: int = Field(description="Target verification steps.")
    acceptance_histogram: dict[str, int] = Field(description="{\"1\"..\"B\": steps that produced that many tokens}.")
    acceptance_distribution: dict[str, float] = Field(description="The histogram as shares of the steps.")
    acceptance_per_position: list[float | None] = Field(description=(
        "k = 1..B-1: accepted / drafted at block position k (null: never drafted)."))
    speculative_tokens_per_s: float | None = Field(description="Tokens/s of speculative decoding.")
    plain_tokens_per_s: float | None = Field(description="Tokens/s of plain decoding by the target.")
    speedup: float | None = Field(description="speculative_tokens_per_s / plain_tokens_per_s.")


class SetFigures(BaseModel):
    """One draft policy's figures on one prompt set: `sets.<name>` and its `by_proposal.<policy>`."""
    model_config = WRITTEN

    tau: float | None = Field(description="As the top level's, on this set.")
    tau_prompt_mean: float | None = Field(description="The mean of the prompts' own tau.")
    tau_uncapped: float | None = Field(description="tau counting every accepted draft token (no stop or length cap).")
    verify_steps: int = Field(description="Target verification steps.")
    tokens: int = Field(description="Tokens generated speculatively.")
    acceptance_histogram: dict[str, int] = Field(description="As the top level's.")
    acceptance_distribution: dict[str, float] = Field(description="As the top level's.")
    acceptance_per_position: list[float | None] = Field(description="As the top level's.")
    drafted_per_position: list[int] = Field(description="k = 1..B-1: steps that drafted position k.")
    speculative: Decoding = Field(description="Speculative decoding (`Decoding`, as `plain`).")
    speedup: float | None = Field(description="speculative.tokens_per_s / plain.tokens_per_s.")


class Mismatch(BaseModel):
    model_config = WRITTEN

    prompt: int = Field(description="The prompt's index in its set.")
    first_difference: int = Field(description="The first generated token where the outputs differ.")
    speculative: list[int] = Field(description="Up to 8 speculative tokens from there.")
    plain: list[int] = Field(description="Up to 8 plain tokens from there.")


class PromptSet(BaseModel):
    """One prompt set's figures (`sets.<name>`), its keys in the order the file holds them: the policy, the prompts,
    that policy's figures (`SetFigures`) with plain decoding beside the speculative, every policy's."""
    model_config = WRITTEN

    proposal: str = Field(description="The policy of this set's figures (as the top level's).")
    prompts: int = Field(description="Prompts in the set.")
    tau: float | None = like(SetFigures, "tau")
    tau_prompt_mean: float | None = like(SetFigures, "tau_prompt_mean")
    tau_uncapped: float | None = like(SetFigures, "tau_uncapped")
    verify_steps: int = like(SetFigures, "verify_steps")
    tokens: int = like(SetFigures, "tokens")
    acceptance_histogram: dict[str, int] = like(SetFigures, "acceptance_histogram")
    acceptance_distribution: dict[str, float] = like(SetFigures, "acceptance_distribution")
    acceptance_per_position: list[float | None] = like(SetFigures, "acceptance_per_position")
    drafted_per_position: list[int] = like(SetFigures, "drafted_per_position")
    speculative: Decoding = like(SetFigures, "speculative")
    plain: Decoding = Field(description="Plain decoding, once per prompt for every policy (`Decoding`).")
    speedup: float | None = like(SetFigures, "speedup")
    by_proposal: dict[str, SetFigures] = Field(description="{policy: its figures on this set} (`SetFigures`).")
    lossless: bool = Field(description="Greedy speculative output token-identical to plain greedy on every prompt.")
    mismatches: list[Mismatch] = Field(description="Where they differ (`Mismatch`).")


class Evaluated(BaseModel):
    """What was evaluated and how: the head of acceptance.json (`Acceptance`), before the figures."""
    model_config = WRITTEN

    run_name: str = Field(description="The config's run_name.")
    created_at: str = Field(description="ISO-8601 time of the evaluation (the report keeps one made after the run).")
    drafter: str = Field(description="The checkpoint or drafter folder evaluated.")
    checkpoint_step: int | None = Field(description="Its step (null: not a checkpoint folder).")
    target: str = Field(description="target.path.")
    target_files: dict = Field(description=(
        "The target's fingerprint ({file: size, mtime, sha256}): the one the run trained on, checked now."))
    device: str = Field(description="The device decoded on.")
    dtype: str = Field(description="The target's dtype.")
    temperature: float = Field(description="evaluate.temperature (the history's tau is the one at 0).")
    block_size: int = Field(description="The drafter's block size B.")
    max_new_tokens: int = Field(description="evaluate.max_new_tokens.")
    num_prompts: int = Field(description="Prompts decoded over all sets.")
    stop_token_ids: list[int] = Field(description="Tokens that end a generation.")
    proposal: str = Field(description=(
        "The draft policy of the top-level figures: argmax (when decoded; always at temperature 0) or sample."))


class Acceptance(Figures, Evaluated):
    """acceptance.json: the head (`Evaluated`), the top-level policy's pooled figures (`Figures`), every policy's,
    every prompt set's (the order of its keys in the file: the classes' in reverse)."""
    model_config = WRITTEN

    by_proposal: dict[str, Figures] = Field(description="{policy: its pooled figures} (`Figures`).")
    engines: dict[str, list[str]] = Field(description="{policy: serving engines that run it}.")
    lossless: bool = Field(description="Every set lossless.")
    sets: dict[str, PromptSet] = Field(description=(
        "{name: figures per prompt set}: `holdout`, then one per evaluate.prompt_files stem (`PromptSet`)."))


def _as(name: str):
    """A reader's field with the writer's meaning: None where a file lacks the key."""
    return like(Acceptance, name, None)


class TauCore(Read):
    """A draft policy's figures (`by_proposal.<policy>`) as the readers take them."""
    tau: float | None = _as("tau")


class AcceptanceCore(Read):
    """What the readers take of an acceptance.json of any age (the module's docstring)."""
    created_at: str | None = _as("created_at")
    drafter: str | None = _as("drafter")
    temperature: float | None = _as("temperature")
    block_size: int | None = _as("block_size")
    max_new_tokens: int | None = _as("max_new_tokens")
    num_prompts: int | None = _as("num_prompts")
    dtype: str | None = _as("dtype")
    device: str | None = _as("device")
    stop_token_ids: list[int] | None = _as("stop_token_ids")
    tau: float | None = Field(None, description=(
        Acceptance.model_fields["tau"].description + " The oldest files hold {prompt set: tau, or its figures}: read "
        "as the mean of the sets that have one."))
    proposal: str | None = _as("proposal")
    by_proposal: dict[str, TauCore] | None = _as("by_proposal")
    speedup: float | None = _as("speedup")
    lossless: bool | None = _as("lossless")
    sets: dict[str, dict] | None = _as("sets")
    run_id: str | None = Field(None, description=(
        "Not written by evaluate (the report tells an evaluation of the run from an older one by `created_at`): a "
        "file made by hand may name the run it evaluates; one naming another run is not this run's."))

    @field_validator("tau", mode="before")
    @classmethod
    def _mean_over_sets(cls, tau):
        if not isinstance(tau, dict):
            return tau
        taus = [t.get("tau") if isinstance(t, dict) else t for t in tau.values()]
        if any(isinstance(t, bool) or not isinstance(t, (int, float, type(None))) for t in taus):
            raise ValueError("a prompt set's tau is not a number")
        taus = [t for t in taus if t is not None and not math.isnan(t)]
        return sum(taus) / len(taus) if taus else None

    def policy_taus(self) -> dict[str, float | None]:
        """{draft policy: tau}: `by_proposal`'s, else (a file without it) its one tau under its policy (`OLDEST`)."""
        if self.by_proposal:
            return {k: b.tau for k, b in self.by_proposal.items()}
        return {self.proposal or OLDEST: self.tau}


def key_table() -> str:
    """The docs' table of acceptance.json's keys (docs/architecture.md holds it between its `acceptance-keys` markers)."""
    return records_table((("", Acceptance), ("sets.<name>.", PromptSet), ("sets.<name>.plain.", Decoding),
                          ("sets.<name>.mismatches[].", Mismatch)))
