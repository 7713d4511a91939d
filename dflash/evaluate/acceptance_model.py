"""acceptance.json, the evaluate stage's record: one typed description for its writer (stages/evaluate.py, from the
figures of evaluate/acceptance.py) and the docs (docs/architecture.md, checked against it by a test).

`Acceptance` is every key the writer writes, with its meaning. Its readers (report/history.py, evaluate/modelcard.py,
bench/quality.py) read files of every age, some from before keys existed, and take what they use with `.get`.
"""
from __future__ import annotations

from pydantic import BaseModel, Field

from dflash.records import WRITTEN


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


class PromptSet(SetFigures):
    model_config = WRITTEN

    prompts: int = Field(description="Prompts in the set.")
    plain: Decoding = Field(description="Plain decoding, once per prompt for every policy (`Decoding`).")
    proposal: str = Field(description="The policy of this set's figures (as the top level's).")
    by_proposal: dict[str, SetFigures] = Field(description="{policy: its figures on this set} (`SetFigures`).")
    lossless: bool = Field(description="Greedy speculative output token-identical to plain greedy on every prompt.")
    mismatches: list[Mismatch] = Field(description="Where they differ (`Mismatch`).")


class Acceptance(Figures):
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
    by_proposal: dict[str, Figures] = Field(description="{policy: its pooled figures} (`Figures`).")
    engines: dict[str, list[str]] = Field(description="{policy: serving engines that run it}.")
    lossless: bool = Field(description="Every set lossless.")
    sets: dict[str, PromptSet] = Field(description=(
        "{name: figures per prompt set}: `holdout`, then one per evaluate.prompt_files stem (`PromptSet`)."))


def key_table() -> str:
    """The docs' table of acceptance.json's keys (docs/architecture.md holds it between its `acceptance-keys` markers)."""
    rows = ["| key | meaning |", "| --- | --- |"]
    for prefix, model in (("", Acceptance), ("sets.<name>.", PromptSet), ("sets.<name>.plain.", Decoding),
                          ("sets.<name>.mismatches[].", Mismatch)):
        rows += [f"| `{prefix}{key}` | {field.description} |" for key, field in model.model_fields.items()]
    return "\n".join(rows) + "\n"
