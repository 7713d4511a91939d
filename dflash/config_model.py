"""Every config key: its type, default, bounds, description and role, in one place (pydantic models).

The package reads a loaded config as a `DflashConfig`: frozen, typed attributes, lists as tuples, unknown keys
refused, and checks that need only the config (values that contradict each other) made by the models' validators, so
that `snakemake -n` refuses what a stage would. `workflow/schemas/config.schema.yaml` (what Snakemake and the docs
read) is generated from these models: to add a key, add one field with its `Role` to its section here, then run
`python -m dflash schema --write` (docs/config.md). Defaults that change what a drafter learns do not change, with
one deliberate exception so far: `train.loss_weighting` moved from decay to dpace (issue 48) after D-PACE beat the
baseline alone on the GPU on every build measured (docs/recipes.md); configs that mean to run decay say so.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, WithJsonSchema, field_validator, model_validator


@dataclasses.dataclass(frozen=True)
class Role:
    """What a change of a key redoes, declared on the key itself (`name: Annotated[type, ROLE] = Field(...)`; a test
    fails on a field without one). `reruns`: the Snakemake rules whose params hold the key (a change reruns them, and
    what reads their outputs after them; dflash.config.trigger). `hashed`: "result", in the result hash (it can change
    the trained drafter: a checkpoint resumes and a finished run is restored only under the same result hash); "run",
    in the config hash only (how a run is carried out, its throughput: the report names it when Ktok/s moves); None,
    in neither."""
    reruns: tuple[str, ...]
    hashed: Literal["result", "run"] | None


# The roles, by what a key decides.
# where the target is and how it loads: every rule that builds or loads it
TARGET = Role(("target", "data", "warmup", "train", "evaluate", "export"), "result")
BUILD = Role(("target",), "result")            # how the target stage builds it (a rebuilt target reruns its readers)
CORPUS = Role(("target", "data"), "result")    # a corpus both the target build and the data stage read
SEED = Role(("target", "data", "warmup", "train", "evaluate"), "result")
DATA = Role(("data",), "result")               # what the data stage makes (its manifest then reruns what reads it)
DATA_OPS = Role((), None)                      # how fast the data stage runs: the same dataset, byte for byte
BLOCK = Role(("data", "warmup", "train", "evaluate", "export"), "result")
DRAFTER = Role(("warmup", "train", "evaluate", "export"), "result")
GRAPH = Role(("warmup", "train"), "result")    # train keys that shape a graph the warm-up compiles
TRAIN = Role(("train",), "result")             # train keys that shape no compiled graph
TRAIN_OPS = Role((), "run")                    # how a run is carried out (logging, checkpoints, timeouts, launch,
#                                                profiling, test hooks, in-training tau): never the drafter it trains
EVALUATE = Role(("evaluate",), None)
REPORT = Role(("report", "gate"), None)
NAMES = Role((), None)                         # where outputs land: a new name makes new outputs, nothing is redone


class Section(BaseModel):
    """A config section: frozen, strict types (no "5" for 5), unknown keys refused, every number finite (no key means
    `.inf` or `.nan`: a limit that is off is null or 0, as its description says)."""
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="wrap")
    @classmethod
    def _number_as_written(cls, value, handler):
        """A number written as an integer (`stall_timeout_s: 600`) stays an int, as written: logs, messages and
        records show it as the YAML does."""
        out = handler(value)
        return value if type(value) is int and type(out) is float else out


# A test hook's free-form mapping ({worker: name, step: k}); the schema says only "an object".
HookSpec = Annotated[dict[str, int | str], WithJsonSchema({"type": "object"})]
# Names that become folder names: letters, digits, _ . -, not starting with a dot or a dash (no `..`, no hidden folder).
NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
# Their length: a run name also names its run id (+17 characters), history snapshot (+5) and temporary files (+25);
# a file system takes 255 bytes per name.
NAME_MAX = 128
# A device: auto (where the key allows it), cpu, cuda, cuda:N or N (cuda:N).
DEVICE_PATTERN = r"^(auto|cpu|cuda|cuda:[0-9]+|[0-9]+)$"
PLACED_PATTERN = r"^(cpu|cuda|cuda:[0-9]+|[0-9]+)$"
# The largest seed: numpy's legacy range, and torch's generators take seed * 1_000_003 + step (below 2^64).
SEED_MAX = 2**32 - 1
DEFAULT_CONTEXT_LAYERS = 5     # drafter.num_target_layers when neither it nor drafter.target_layer_ids is given


@dataclasses.dataclass(frozen=True)
class When:
    """Marks a key (or a section) read only while a switch allows it: `Annotated[type, ROLE, when("train.optimizer",
    "muon")]`. `cases`: (switch, values) pairs; the key is read when any switch (a dotted key, itself read) holds one of
    its values; several `When` on one key must all hold. A key that is not read is out of every hash and every rerun
    trigger (dflash.config.pick): `train.muon_lr` with AdamW, or `data.code_completion.files` with that source off,
    changes nothing."""
    cases: tuple[tuple[str, tuple], ...]

    def __or__(self, other: "When") -> "When":
        return When(self.cases + other.cases)


def when(switch: str, *values) -> When:
    """The key is read only while `switch` holds one of `values`."""
    return When(((switch, values),))


@dataclasses.dataclass(frozen=True)
class PathKey:
    """Marks a key that names a file or folder (`Annotated[str, ROLE, PATH]`): one spelling per path
    (`os.path.normpath`: `./x/` is `x`) in the resolved config, its hashes and rerun triggers."""


PATH = PathKey()

# The switches, each declared once; the keys they gate carry them (a test proves each gated-off key changes no hash).
SOURCES_READ = when("data.synthetic.enabled", False)    # synthetic samples replace every source and regeneration
SYNTHETIC = when("data.synthetic.enabled", True)
CODE_SOURCE = when("data.code_completion.enabled", True)
REGENERATES = when("data.regenerate.enabled", True)
HF_ENGINE = when("data.regenerate.engine", "hf")
OPENAI_ENGINE = when("data.regenerate.engine", "openai")
BUILT = when("target.build", "tiny", "code", "random")   # target.arch: the shape of a target the pipeline builds
PRETRAINED = when("target.build", "tiny", "code")
CODE_BUILD = when("target.build", "code")
MUON = when("train.optimizer", "muon")
DECAY_WEIGHTS = when("train.loss_weighting", "decay")
DPACE_WEIGHTS = when("train.loss_weighting", "dpace")
FP8 = when("train.precision", "fp8")
COMPILED = when("train.compile", True)
# the built-in corpus: read by its source, and by the tiny and random builds (their tokenizer is trained on it)
BUILTIN_READ = when("data.builtin_corpus.enabled", True) | when("target.build", "tiny", "random")


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """Marks a key that names devices (`Annotated[str, ROLE, ON_DEVICE]`): they must exist on the machine that runs
    the stages its role reruns (dflash.config.check_here)."""


ON_DEVICE = OnDevice()


@dataclasses.dataclass(frozen=True)
class Reads(PathKey):
    """Marks a key whose value names a file or folder the stages read (`Annotated[str, ROLE, Reads(rules)]`): the
    Snakemake rules in `rules` take it as an input, a missing one is refused before any job, and a change of its
    content reruns them (dflash.inputs). `when(cfg, section)`: whether the value is read at all (the section holds the
    key; e.g. target.path is an input only with build none, an output otherwise). A path key too (PathKey: one
    spelling in the hashes and triggers)."""
    rules: tuple[str, ...]
    when: typing.Callable | None = None


# A target folder is read by every rule that loads the target; with build tiny, code or random it is the target rule's
# output, not an input.
TARGET_FOLDER = Reads(("data", "warmup", "train", "evaluate", "export"), lambda cfg, t: t.build == "none")
# A data source is a local file or folder unless it is a hub dataset; synthetic data replaces every source.
SOURCE_FILE = Reads(("data",), lambda cfg, s: s.kind != "hub" and not cfg.data.synthetic.enabled)


FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_moe", "gemma3_text", "mistral", "gpt_oss", "qwen3_next",
            "lfm2")   # dflash.families
MOE_FAMILY = when("target.arch.family", "qwen3_moe", "gpt_oss", "qwen3_next")
SLIDING_FAMILY = when("target.arch.family", "gemma3_text", "mistral", "gpt_oss")


class ArchSection(Section):
    family: Annotated[Literal[FAMILIES], BUILD] = Field("qwen3", description=(
        "Architecture family of the built target (transformers model_type; docs/targets.md has the matrix): qwen3, "
        "llama, qwen2, qwen3_moe, gemma3_text (sliding and global layers, scaled embeddings, tied head), mistral "
        "(sliding window), gpt_oss (MoE, attention sinks, sliding layers), qwen3_next (hybrid: gated DeltaNet "
        "layers with a recurrent state and attention layers, MoE), lfm2 (hybrid: short-convolution layers and "
        "attention layers)."))
    num_experts: Annotated[int, BUILD, MOE_FAMILY] = Field(4, ge=2, description=(
        "MoE families: experts per MoE layer (each intermediate_size wide)."))
    experts_per_token: Annotated[int, BUILD, MOE_FAMILY] = Field(2, ge=1, description=(
        "MoE families: experts routed per token."))
    sliding_window: Annotated[int, BUILD, SLIDING_FAMILY] = Field(64, ge=2, description=(
        "Families with sliding-window layers: the window (gemma3_text and gpt_oss alternate sliding and full "
        "layers; mistral slides on every layer)."))
    num_hidden_layers: Annotated[int, BUILD] = Field(4, ge=2, description="Decoder layers.")
    hidden_size: Annotated[int, BUILD] = Field(128, ge=8, description="Hidden size.")
    num_attention_heads: Annotated[int, BUILD] = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: Annotated[int, BUILD] = Field(2, ge=1, description="Key/value heads (GQA).")
    head_dim: Annotated[int, BUILD] = Field(32, ge=4, description="Per-head dimension.")
    intermediate_size: Annotated[int, BUILD] = Field(384, ge=8, description="SwiGLU inner size.")
    vocab_size: Annotated[int, BUILD] = Field(2048, ge=64, description=(
        "Vocabulary size (tokenizer trained to this size)."))
    max_position_embeddings: Annotated[int, BUILD] = Field(4096, ge=64, description="RoPE positions.")
    rope_theta: Annotated[float, BUILD] = Field(1000000.0, gt=0, description="RoPE base.")

    @model_validator(mode="after")
    def _heads(self):
        if self.family in MOE_FAMILY.cases[0][1] and self.experts_per_token > self.num_experts:
            raise ValueError(f"target.arch.experts_per_token ({self.experts_per_token}) exceeds "
                             f"target.arch.num_experts ({self.num_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"target.arch.num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"target.arch.num_key_value_heads ({self.num_key_value_heads})")
        return self

class PretrainSection(Section):
    steps: Annotated[int, BUILD, PRETRAINED] = Field(120, ge=0, description=(
        "Optimizer steps (120 take about 2 CPU-minutes on one core)."))
    batch_size: Annotated[int, BUILD, PRETRAINED] = Field(16, ge=1, description="Sequences per step.")
    seq_len: Annotated[int, BUILD, PRETRAINED] = Field(256, ge=16, description="Tokens per sequence.")
    lr: Annotated[float, BUILD, PRETRAINED] = Field(0.003, gt=0, description="Peak AdamW learning rate.")
    max_seconds: Annotated[float | None, BUILD, PRETRAINED] = Field(None, gt=0, description=(
        "Stop after this many seconds of pre-training counted from the end of the first step (which holds any"
        " compile); the schedule follows elapsed time or steps, whichever is further along. null: steps "
        "alone."))
    compile: Annotated[bool, BUILD, PRETRAINED] = Field(False, description=(
        "Compile each decoder layer in place for pre-training (identical layers share one graph)."))
    device: Annotated[str, BUILD, ON_DEVICE, CODE_BUILD] = Field("auto", pattern=DEVICE_PATTERN, description=(
        "build code: device of pre-training (auto: cuda when available, else cpu; bf16 autocast and fused "
        "AdamW on CUDA). The tiny build always pre-trains on the CPU."))
    corpus_mb: Annotated[float, CORPUS, CODE_BUILD | CODE_SOURCE] = Field(256, gt=0, description=(
        "build code and the `code` data source: MiB of Python source read (stdlib, then site-packages, each "
        "in sorted path order; files over 512 KiB, not UTF-8 or duplicated are skipped) before the split into"
        " pre-training and held-out files."))
    heldout_fraction: Annotated[float, CORPUS, CODE_BUILD | CODE_SOURCE] = Field(0.05, gt=0, lt=1, description=(
        "build code and the `code` data source: share of files held out of pre-training, chosen by a hash of "
        "each file's path relative to its root (the same on every machine)."))
    chat_fraction: Annotated[float, BUILD, CODE_BUILD] = Field(0.1, ge=0, description=(
        "build code: \"complete this function\" conversations from the pre-training files, in the chat "
        "template, added to the pre-training text up to this share of its characters (the model learns the "
        "format it is prompted with)."))
    tokenizer_mb: Annotated[float, BUILD, CODE_BUILD] = Field(32, gt=0, description=(
        "build code: MiB of the pre-training text (files and conversations in a seeded order) the BPE "
        "tokenizer is trained on."))
    eval_windows: Annotated[int, BUILD, CODE_BUILD] = Field(64, ge=1, description=(
        "build code: seq_len windows, evenly spaced, of the held-out files' token stream scored for "
        "build.json's held-out perplexity (and as many of the pre-training stream)."))
    num_proc: Annotated[int, BUILD, CODE_BUILD] = Field(0, ge=0, description=(
        "build code: processes that parse files into conversations (0: every core)."))


class TargetSection(Section):
    path: Annotated[str, TARGET, TARGET_FOLDER] = Field("results/target/tiny", description=(
        "Directory loadable by AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained."))
    build: Annotated[Literal["none", "tiny", "code", "random"], TARGET] = Field("tiny", description=(
        "How the `target` stage makes `path`: `tiny` builds and briefly pre-trains a small model of `arch` (its "
        "`family`, Qwen3 by default) with a locally trained BPE tokenizer; `code` pre-trains a Qwen3 model of "
        "the `arch` shape (GPU-sized) on the Python source of the standard library and site-packages, with a BPE "
        "tokenizer trained on it, and records its held-out perplexity (`pretrain` sets the corpus and the budget); `random` writes a "
        "randomly initialised model of the `arch` shape with the tiny tokenizer's vocabulary padded to "
        "`arch.vocab_size` (benchmarks); `none` uses an existing directory."))
    dtype: Annotated[Literal["auto", "float32", "bfloat16"], TARGET] = Field("auto", description=(
        "Target compute dtype; auto is bfloat16 on GPU and float32 on CPU."))
    trust_remote_code: Annotated[bool, TARGET] = Field(False, description=(
        "Passed to from_pretrained. Off unless you trust the model directory."))
    attn_implementation: Annotated[Literal["sdpa", "eager"], TARGET] = Field("sdpa", description=(
        "Attention implementation of the target (transformers attn_implementation)."))
    arch: Annotated[ArchSection, BUILT] = Field({}, validate_default=True, description=(
        "Architecture of the target built by `build` (tiny, code or random). Ignored with build none."))
    pretrain: PretrainSection = Field({}, validate_default=True, description=(
        "Pre-training of the target (build tiny: briefly, on the CPU, on the built-in corpus; build code: on "
        "`device`, on the code corpus). Random windows of the packed token stream; AdamW, warm-up over the "
        "first tenth, cosine to a tenth of `lr`."))

    @model_validator(mode="after")
    def _family(self):
        if self.build == "code" and self.arch.family != "qwen3":
            raise ValueError(f"target.arch.family {self.arch.family}: build code pre-trains a Qwen3 model only (use "
                             f"build tiny for a {self.arch.family} target)")
        return self



class BuiltinCorpusSection(Section):
    enabled: Annotated[bool, DATA, SOURCES_READ] = Field(True, description=(
        "Add the built-in corpus as a source named `stdlib`."))
    max_conversations: Annotated[int, CORPUS, BUILTIN_READ] = Field(1500, ge=1, description="Conversations to make.")


class CodeCompletionSection(Section):
    enabled: Annotated[bool, DATA, SOURCES_READ] = Field(False, description="Add them as a source named `code`.")
    max_conversations: Annotated[int, DATA, CODE_SOURCE] = Field(2000, ge=1, description=(
        "Conversations to make (at most per_file a file; fewer when the files hold fewer)."))
    files: Annotated[Literal["heldout", "all"], DATA, CODE_SOURCE] = Field("heldout", description=(
        "Files the conversations come from: heldout, the files held out of the code target's pre-training only; "
        "all, the pre-training files as well (more training data: a drafter learns the answers of the model it "
        "serves). Either way data.holdout's evaluation prompts come from held-out files only, and no "
        "conversation of a file that gives an evaluation prompt is trained on."))
    per_file: Annotated[int, DATA, CODE_SOURCE] = Field(8, ge=1, description=(
        "At most this many conversations of one file (a seeded choice among its functions): many files, not a "
        "few long ones."))


class SyntheticSection(Section):
    enabled: Annotated[bool, DATA] = Field(False, description="Replace all sources with synthetic samples.")
    num_samples: Annotated[int, DATA, SYNTHETIC] = Field(256, ge=1, description="Samples to make.")
    lengths: Annotated[tuple[Annotated[int, Field(ge=8)], ...], DATA, SYNTHETIC] = Field(
        (3072,), min_length=1, strict=False, description=(
        "Lengths to cycle through."))
    supervised_fraction: Annotated[float, DATA, SYNTHETIC] = Field(0.8, ge=0, le=1, description=(
        "Trailing fraction of each sample in the loss mask."))


class SourceSection(Section):
    name: Annotated[str, DATA] = Field(pattern=NAME, max_length=NAME_MAX, description=(
        "Short name used in the manifest."))
    path: Annotated[str, DATA, SOURCE_FILE] = Field(description=(
        "File, datasets folder, or hub dataset name (kind hub)."))
    kind: Annotated[Literal["auto", "jsonl", "json", "parquet", "disk", "hub"], DATA] = Field("auto", description=(
        "How to read path; auto picks by suffix (.jsonl, .ndjson, .json, each optionally .gz, .zst or .bz2 "
        "compressed; .parquet; a folder)."))
    format: Annotated[Literal["auto", "sharegpt", "openai"], DATA] = Field("auto", description="Conversation layout.")
    split: Annotated[str, DATA] = Field("train", description="Split for hub datasets.")
    limit: Annotated[int | None, DATA] = Field(None, ge=1, description="At most this many rows from the source.")
    weight: Annotated[float, DATA] = Field(1.0, ge=0, description=(
        "Sampling weight (rows drawn with replacement beyond 1.0)."))


class RegenerateSection(Section):
    enabled: Annotated[bool, DATA, SOURCES_READ] = Field(True, description=(
        "Replace assistant turns by the target's own responses."))
    engine: Annotated[Literal["hf", "openai"], DATA, REGENERATES] = Field("hf", description=(
        "hf generates in-process (transformers); openai sends each prompt, rendered locally with the target's"
        " chat template, to OpenAI-compatible servers (vLLM, SGLang, transformers serve) at `servers`."))
    max_new_tokens: Annotated[int, DATA, REGENERATES] = Field(96, ge=1, description="Tokens generated per response.")
    temperature: Annotated[float, DATA, REGENERATES] = Field(0.0, ge=0, description="0 is greedy.")
    batch_size: Annotated[int, DATA, HF_ENGINE] = Field(0, ge=0, description=(
        "hf: prompts per batch (sorted by length); 0 sizes it from free GPU memory (hundreds of sequences per"
        " decode step on a GPU; cpu_batch_size on CPU)."))
    cpu_batch_size: Annotated[int, DATA, HF_ENGINE] = Field(32, ge=1, description=(
        "hf: prompts per batch on CPU when batch_size is 0 (there is no GPU memory to size it from)."))
    decoder: Annotated[Literal["auto", "static", "generate"], DATA, HF_ENGINE] = Field("auto", description=(
        "hf: static is our decode loop with a static KV cache (one fixed batch shape; on GPU the decode step "
        "is compiled once and replayed as a CUDA graph); generate is transformers generate (dynamic cache); "
        "auto is static on GPU, generate on CPU."))
    compile: Annotated[bool, DATA, HF_ENGINE] = Field(True, description=(
        "hf, static decoder on GPU: compile the decode step and replay it as a CUDA graph (false: eager)."))
    attention: Annotated[Literal["auto", "grouped_flex", "grouped_sdpa"], DATA, HF_ENGINE] = Field("auto", description=(
        "hf, static decoder: decode attention. grouped_flex: flex_attention over only the KV blocks a row sees "
        "(1.24x grouped_sdpa's tokens/s for an 8B-shaped target on an H200); grouped_sdpa: one sdpa kernel over the "
        "whole static cache; auto is grouped_flex under CUDA graphs (with a power-of-two head dim of at least 16 and a "
        "power-of-two count of query heads per KV head, which Inductor's flex decoding kernel needs), else "
        "grouped_sdpa."))
    compile_prefill: Annotated[bool | None, DATA, HF_ENGINE] = Field(None, description=(
        "hf, static decoder: compile the prompts' prefill (64 rows a chunk) with Inductor, dynamic shapes (1.105x the "
        "eager prefill's tokens/s for an 8B-shaped target on an H200, for about 100 s more warm-up once per stage); "
        "null is on where the decode step is compiled for CUDA graphs (GPU), eager elsewhere."))
    device: Annotated[str, DATA, ON_DEVICE, HF_ENGINE] = Field("auto", pattern=DEVICE_PATTERN, description=(
        "hf: device for generation (auto, cpu, cuda:N)."))
    servers: Annotated[tuple[str, ...], DATA, OPENAI_ENGINE] = Field((), strict=False, description=(
        "openai: base URLs, e.g. http://127.0.0.1:8000/v1 (one per GPU or node; requests are spread over "
        "all)."))
    model: Annotated[str | None, DATA, OPENAI_ENGINE] = Field(None, description=(
        "openai: the served model name; null is target.path (what `vllm serve <path>` names it)."))
    concurrency: Annotated[int, DATA, OPENAI_ENGINE] = Field(64, ge=1, description=(
        "openai: requests in flight per server."))
    prompt_ids: Annotated[bool, DATA, OPENAI_ENGINE] = Field(False, description=(
        "openai: send the prompt as token ids (vLLM, SGLang) rather than text (any server, transformers serve"
        " too): exact tokens, and no second BOS from a server that adds one to text."))
    timeout_s: Annotated[float, DATA_OPS, OPENAI_ENGINE] = Field(600, gt=0, description=(
        "openai: seconds per request before it is retried."))
    retries: Annotated[int, DATA_OPS, OPENAI_ENGINE] = Field(6, ge=0, description=(
        "openai: retries of a request after a timeout, a refused connection, 429 or 5xx, with exponential "
        "backoff; then the stage stops naming the server."))
    backoff_s: Annotated[float, DATA_OPS, OPENAI_ENGINE] = Field(1.0, ge=0, description=(
        "openai: first retry delay in seconds (doubled each retry, at most 60)."))
    chunk_size: Annotated[int, DATA, REGENERATES] = Field(256, ge=1, description=(
        "Conversations per resumable chunk: each finished chunk is written at once; a killed stage redoes at "
        "most the chunk in flight."))


    @model_validator(mode="after")
    def _servers(self):
        if self.enabled and self.engine == "openai" and not self.servers:
            raise ValueError("data.regenerate.servers is empty but data.regenerate.engine is openai: give the base URL "
                             "of at least one OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1)")
        return self

class DataSection(Section):
    builtin_corpus: BuiltinCorpusSection = Field({}, validate_default=True, description=(
        "Conversations made offline from the Python standard library's docstrings and source."))
    code_completion: CodeCompletionSection = Field({}, validate_default=True, description=(
        "\"Complete this Python function\" conversations made from the files of the code corpus "
        "(`target.pretrain.corpus_mb`; `heldout_fraction` splits off the files a `build: code` target never saw), "
        "named `code-<root>/<path>:<function>:<line>`."))
    synthetic: SyntheticSection = Field({}, validate_default=True, description=(
        "Random-token samples of fixed length (throughput benchmarks only; no text, no regeneration)."))
    sources: Annotated[tuple[SourceSection, ...], SOURCES_READ] = Field((), strict=False, description=(
        "Extra sources (local JSONL/JSON/Parquet files, a datasets folder saved on disk, or a hub name)."))
    max_length: Annotated[int, DATA] = Field(512, ge=16, description="Longest tokenised conversation kept, in tokens.")
    truncation: Annotated[Literal["drop", "truncate"], DATA] = Field("truncate", description=(
        "Over max_length, `truncate` keeps the first max_length tokens; `drop` rejects the row."))
    min_supervised_blocks: Annotated[float, DATA] = Field(2, ge=0, description=(
        "Keep a row only with at least this many block sizes of supervised (assistant) tokens."))
    bucket_edges: Annotated[tuple[Annotated[int, Field(ge=16)], ...], DATA] = Field(
        (128, 256, 384, 512), min_length=1, strict=False, description=(
            "Length buckets (upper edges, each once; the largest at least max_length); samples are padded to their "
            "bucket, the shapes warm-up compiles."))
    shard_rows: Annotated[int, DATA] = Field(4096, ge=1, description="Rows per Arrow shard file.")
    regenerate: RegenerateSection = Field({}, validate_default=True, description=(
        "Regenerate assistant turns with the target (how DFlash training data is made)."))
    holdout: Annotated[int, DATA] = Field(32, ge=0, description=(
        "Conversations kept out of training for evaluation prompts."))
    num_proc: Annotated[int, DATA_OPS] = Field(1, ge=0, description=(
        "Processes that tokenise (datasets.map num_proc; 0 is every core). Reading, tokenising and bucketing "
        "stream through Arrow files on disk: memory does not grow with the corpus."))
    shards: Annotated[int, DATA_OPS] = Field(1, ge=1, description=(
        "Snakemake jobs the expansion/regeneration is scattered into (each its own GPU or server); a gather "
        "job builds the buckets and the manifest. The content hash is the same for any value (greedy "
        "regeneration)."))


    @model_validator(mode="after")
    def _fits(self):
        """Every kept sample fits a bucket; an edge is one bucket; a source name is one source."""
        twice = sorted({e for e in self.bucket_edges if self.bucket_edges.count(e) > 1})
        if twice:
            raise ValueError(f"data.bucket_edges lists {twice[0]} twice: give each edge once")
        if self.max_length > max(self.bucket_edges):
            raise ValueError(f"data.max_length ({self.max_length}) exceeds the largest data.bucket_edges entry "
                             f"({max(self.bucket_edges)}): every kept sample must fit a bucket; add an edge of at "
                             f"least {self.max_length} or lower data.max_length")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"data.sources: duplicate source name(s) {', '.join(dup)}")
        return self

class DrafterSection(Section):
    num_layers: Annotated[int, DRAFTER] = Field(2, ge=1, description="Drafter decoder layers.")
    hidden_size: Annotated[int | None, DRAFTER] = Field(None, ge=8, description=(
        "Must equal the target's (shared embedding/head); null takes it."))
    num_attention_heads: Annotated[int | None, DRAFTER] = Field(None, ge=1, description=(
        "Query heads; null takes the target's."))
    num_key_value_heads: Annotated[int | None, DRAFTER] = Field(None, ge=1, description=(
        "KV heads; null takes the target's (they divide num_attention_heads)."))
    head_dim: Annotated[int | None, DRAFTER] = Field(None, ge=4, description="Head dimension; null takes the target's.")
    intermediate_size: Annotated[int | None, DRAFTER] = Field(None, ge=8, description=(
        "SwiGLU size; null takes the target's."))
    block_size: Annotated[int, BLOCK] = Field(16, ge=2, description="Tokens per block (anchor + block_size-1 masks).")
    num_target_layers: Annotated[int | None, DRAFTER] = Field(None, ge=1, description=(
        f"Target layers fused into the context (k); null: as many as target_layer_ids lists, else "
        f"{DEFAULT_CONTEXT_LAYERS}. A number that disagrees with target_layer_ids is refused."))
    target_layer_ids: Annotated[tuple[Annotated[int, Field(ge=0)], ...] | None, DRAFTER] = Field(
        None, min_length=1, strict=False, description=(
        "Explicit ids; null spaces k ids uniformly over 1..L-3."))
    mask_token_id: Annotated[int | None, DRAFTER] = Field(None, ge=0, description=(
        "null takes the tokenizer's mask token."))
    sliding_window: Annotated[int | None, DRAFTER] = Field(None, ge=1, description=(
        "Sliding window W. With layer_types null, every drafter layer slides with window W (speculators' "
        "default is 2048 on every layer); with an explicit layer_types, its sliding_attention layers use W "
        "(required there) and its full_attention layers do not. A sliding layer attends causally over "
        "[context ; block] positions: key k is visible from query position t when k <= t and t - k < W "
        "(causal inside the block, as the inference stacks; docs/layer-layouts.md). null: no sliding layers."))
    layer_types: Annotated[tuple[Literal["full_attention", "sliding_attention"], ...] | None, DRAFTER] = Field(
        None, strict=False, description=(
        "Per-layer attention kind (wins over the sliding_window rule); null is all sliding_attention when "
        "sliding_window is set, all full_attention otherwise."))
    init_from: Annotated[str | None, DRAFTER, Reads(("train",))] = Field(None, description=(
        "A drafter folder to fine-tune from: an export or a checkpoint (config.json + model.safetensors); its"
        " shape must equal this section's."))


    @model_validator(mode="before")
    @classmethod
    def _context_layers(cls, data):
        """num_target_layers null is as many as target_layer_ids lists (else DEFAULT_CONTEXT_LAYERS); a number that
        disagrees with explicit ids is refused (it was ignored)."""
        if not isinstance(data, dict):
            return data
        ids, k = data.get("target_layer_ids"), data.get("num_target_layers")
        if isinstance(ids, (list, tuple)) and ids:
            if k is not None and k != len(ids):
                raise ValueError(f"drafter.num_target_layers ({k}) disagrees with drafter.target_layer_ids "
                                 f"{list(ids)} ({len(ids)} ids): drop num_target_layers or make it {len(ids)}")
            return {**data, "num_target_layers": len(ids)}
        return data if k is not None else {**data, "num_target_layers": DEFAULT_CONTEXT_LAYERS}

    @model_validator(mode="after")
    def _layout(self):
        types, window = self.layer_types, self.sliding_window
        if types is not None and len(types) != self.num_layers:
            raise ValueError(f"drafter.layer_types has {len(types)} entries for drafter.num_layers {self.num_layers}")
        if types is not None and "sliding_attention" in types and window is None:
            raise ValueError("drafter.layer_types has sliding_attention layers but drafter.sliding_window is null: "
                             "give the window")
        if types is not None and "sliding_attention" not in types and window is not None:
            raise ValueError(f"drafter.sliding_window ({window}) is unused: drafter.layer_types has no "
                             "sliding_attention layer; drop sliding_window or make a layer sliding")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ValueError(f"drafter.num_attention_heads ({heads}) is not a multiple of drafter.num_key_value_heads "
                             f"({kv})")
        return self

def drafter_misfit(d: DrafterSection, vocab: int, heads: int, kv: int, target: str) -> str | None:
    """What the drafter section asks of a target of `vocab` tokens, `heads` query and `kv` key/value heads that it
    cannot give, in words (`target` names where these numbers come from); None when it fits. Checked at config load
    against `target.arch`, against a `build: none` folder's config.json (dflash.config.check_here), and where the
    drafter meets the target's HF config (DrafterConfig.from_target)."""
    if d.mask_token_id is not None and d.mask_token_id >= vocab:
        return (f"drafter.mask_token_id ({d.mask_token_id}) is past the vocabulary of {target} ({vocab} tokens, ids "
                f"0-{vocab - 1}): give an id below {vocab}, or null for the tokenizer's mask token")
    h, k = d.num_attention_heads or heads, d.num_key_value_heads or kv
    if h % k:
        def named(key, value, given):
            return f"drafter.{key} ({value})" if given is not None else f"drafter.{key} ({value}, null: from {target})"
        return (f"{named('num_attention_heads', h, d.num_attention_heads)} is not a multiple of "
                f"{named('num_key_value_heads', k, d.num_key_value_heads)}: give drafter.num_key_value_heads a "
                f"divisor of {h}")
    return None


class ProfileSection(Section):
    start_step: Annotated[int, TRAIN_OPS] = Field(20, ge=0, description="Steps done before the window opens.")
    steps: Annotated[int, TRAIN_OPS] = Field(5, ge=1, description="Steps in the window.")
    out: Annotated[str, TRAIN_OPS] = Field("profile.json.gz", min_length=1, description=(
        "Trace file, relative to the run folder (and inside it)."))


    @field_validator("out")
    @classmethod
    def _inside_run(cls, out: str):
        from pathlib import PurePosixPath
        if PurePosixPath(out).is_absolute() or ".." in PurePosixPath(out).parts:
            raise ValueError("must stay inside the run folder (a relative path without '..')")
        return out

class RendezvousSection(Section):
    nnodes: Annotated[int, TRAIN_OPS] = Field(1, ge=1, description=(
        "Nodes, each running as many ranks; rank r (entry r of targets + drafters, or of drafters co-located)"
        " runs on node r // ranks-per-node, and a GPU may appear once per node."))
    endpoint: Annotated[str | None, TRAIN_OPS] = Field(None, description=(
        "host:port of the c10d rendezvous; null is local."))
    id: Annotated[str, TRAIN_OPS] = Field("dflash", description="Rendezvous id.")
    backend: Annotated[Literal["auto", "nccl", "gloo"], TRAIN_OPS] = Field("auto", description=(
        "Process-group backend; auto is nccl on GPU, gloo on CPU."))


class TrainSection(Section):
    runtime: Annotated[Literal["auto", "threads", "distributed"], TRAIN] = Field("auto", description=(
        "auto picks distributed where every worker has its own GPU (more than one), and on several nodes; "
        "threads otherwise."))
    targets: Annotated[tuple[Annotated[str, Field(pattern=PLACED_PATTERN)], ...], GRAPH, ON_DEVICE] = Field(
        ("cpu",), min_length=1, strict=False, description=(
        "Devices running target workers (cpu, cuda:N or N); with target_split > 1, each run of target_split "
        "entries is one target worker over those devices."))
    target_split: Annotated[int, TRAIN_OPS] = Field(1, ge=1, description=(
        "Devices per target worker, for a target that does not fit one: train.targets is read target_split entries "
        "at a time, each run one target worker whose decoder layers are split into contiguous, even runs over its "
        "devices (one process; transformers' device_map: the embedding on the first, the final norm and LM head on "
        "the last), the features leaving from the first (the evaluate stage loads it over the first worker's devices). "
        "The captured features equal the unsplit target's "
        "(tests/e2e/test_target_split.py). Not with train.compile_target nor the co-located distributed layout; "
        "tensor-parallel target ranks are not implemented."))
    drafters: Annotated[tuple[Annotated[str, Field(pattern=PLACED_PATTERN)], ...], GRAPH, ON_DEVICE] = Field(
        ("cpu", "cpu"), min_length=1, strict=False, description=(
        "Devices running drafter replicas; a device may also be in targets."))
    attention: Annotated[Literal["auto", "flex", "sdpa", "eager"], GRAPH] = Field("auto", description=(
        "auto is flex on GPU, sdpa on CPU."))
    compile: Annotated[bool, GRAPH] = Field(True, description=(
        "Compile the drafter's layers and loss kernel (flex or sdpa) in the warm-up, every shape bucket; "
        "eager never compiles. The CPU demo turns it off (first compiles take tens of seconds on 2 cores)."))
    compile_target: Annotated[bool, GRAPH] = Field(False, description=(
        "Compile the target's forward up to the last captured layer (each decoder layer compiled in place, "
        "identical layers sharing one graph per bucket shape; the final norm when captured) in the warm-up, "
        "every shape bucket, before the workers start; both runtimes. Opt-in: its effect on an H200 is not "
        "measured yet."))
    steps: Annotated[int, TRAIN] = Field(120, ge=1, description="Optimizer steps.")
    batch_size: Annotated[int, GRAPH] = Field(4, ge=1, description="Sequences per drafter replica per micro-step.")
    grad_accum: Annotated[int, TRAIN] = Field(1, ge=1, description="Micro-steps per optimizer step.")
    num_anchors: Annotated[int, GRAPH] = Field(32, ge=1, description="Anchors (blocks) sampled per sequence.")
    anchors_per_token: Annotated[float | None, GRAPH] = Field(None, le=1, gt=0, description=(
        "Anchors scale with the bucket length: round(length * this), at most num_anchors (long-context "
        "configs); null is num_anchors for every bucket."))
    gamma: Annotated[float | None, TRAIN, DECAY_WEIGHTS] = Field(None, gt=0, description=(
        "Loss decay exp(-(k-1)/gamma); null is 7 for block 16, scaled with block size."))
    optimizer: Annotated[Literal["adamw", "muon"], TRAIN] = Field("adamw", description=(
        "adamw: one AdamW over every trainable parameter at train.lr. muon: torch.optim.Muon (momentum 0.95, "
        "Nesterov, 5 Newton-Schulz steps, adjust_lr_fn match_rms_adamw) on every 2-D weight (the layers' "
        "projections and fc) at train.muon_lr, AdamW on the rest (the norm weights) at train.lr; every "
        "trainable parameter in exactly one group. Both groups follow the same warm-up + cosine schedule and "
        "train.weight_decay (docs/recipes.md)."))
    muon_lr: Annotated[float, TRAIN, MUON] = Field(0.001, gt=0, description=(
        "Peak learning rate of the Muon group (train.optimizer muon), scaled per matrix by 0.2 x "
        "sqrt(max(rows, cols)) (match_rms_adamw: updates of AdamW's RMS); 1e-3 is speculators' default with "
        "the same scaling."))
    time_budget_s: Annotated[float, TRAIN] = Field(0, ge=0, description=(
        "Train for this many seconds of wall time after the warm-up (over resumes), the schedule following "
        "elapsed time (progress = elapsed / budget replaces step / steps); the run ends, finished, at the "
        "first step where progress >= 1, or at train.steps if that comes first. The replicas agree on the "
        "elapsed time each step (the mean of their clocks, reduced with the step's statistics). 0 is off: the"
        " schedule follows train.steps."))
    lr: Annotated[float, TRAIN] = Field(0.0006, gt=0, description=(
        "Peak AdamW learning rate (every parameter with train.optimizer adamw; the norm weights with muon)."))
    weight_decay: Annotated[float, TRAIN] = Field(0.0, ge=0, description=(
        "Decoupled weight decay of AdamW (and of Muon with train.optimizer muon)."))
    betas: Annotated[tuple[Annotated[float, Field(ge=0, lt=1)], ...], TRAIN] = Field(
        (0.9, 0.95), min_length=2, max_length=2, strict=False, description="AdamW betas (each in [0, 1)).")
    warmup_ratio: Annotated[float, TRAIN] = Field(0.04, ge=0, le=1, description=(
        "Linear warm-up share of steps before the cosine decay."))
    min_lr_ratio: Annotated[float, TRAIN] = Field(0.1, ge=0, le=1, description="Final learning rate as a share of lr.")
    grad_clip: Annotated[float, TRAIN] = Field(1.0, ge=0, description="Global gradient-norm clip (0 disables).")
    loss_chunk: Annotated[int, GRAPH] = Field(2048, ge=1, description=(
        "Draft positions per LM-head/cross-entropy chunk."))
    loss_kernel: Annotated[Literal["fused", "checkpointed"], GRAPH] = Field("fused", description=(
        "fused computes the hidden-state gradient inside the forward (two matmuls per chunk); checkpointed "
        "recomputes each chunk in the backward (three)."))
    loss_weighting: Annotated[Literal["decay", "dpace"], TRAIN] = Field("dpace", description=(
        "Weights of the block positions in the loss (docs/recipes.md). dpace (the default since issue 48: it beat "
        "decay on every build measured, alone at equal GPU time): D-PACE (arXiv 2605.18810), detached weights from "
        "the drafter's own confidence in each label, the suffix sums of the smoothed confidences' prefix products, "
        "the loss normalised by the number of blocks (sampled anchors) instead of the weight sum. decay: the DFlash "
        "paper's exp(-(k-1)/gamma), the loss the weighted mean over scored positions."))
    dpace_alpha: Annotated[float, TRAIN, DPACE_WEIGHTS] = Field(0.5, le=1, gt=0, description=(
        "D-PACE's confidence smoothing (the paper's Eq. 7): q~ = alpha + (1 - alpha) q; read with "
        "loss_weighting dpace only."))
    objective: Annotated[Literal["ce", "kl", "ce+kl"], GRAPH] = Field("ce", description=(
        "Per-position loss (docs/recipes.md). ce: cross-entropy against the data's token. kl: KL(p_target || "
        "q_drafter) against the target's own next-token distribution at that position (the target workers "
        "then also capture the state after its final norm, [b, S, H] more per micro-batch, and run every "
        "target layer). ce+kl: their sum. Same position weights and normalisation for each."))
    dtype: Annotated[Literal["auto", "float32", "bfloat16"], GRAPH] = Field("auto", description=(
        "Autocast dtype; auto is bf16 on GPU, float32 on CPU."))
    precision: Annotated[Literal["bf16", "fp8"], GRAPH] = Field("bf16", description=(
        "Matmul precision of the drafter's decoder layers. bf16: their Linears in the autocast dtype (train.dtype). "
        "fp8: torchao float8 training (dflash/model/fp8.py): each Linear's input, weight and output gradient cast to "
        "FP8 with fresh scales at every matmul (train.fp8_recipe), the fp32 master weights kept as the parameters, so "
        "checkpoints and the exported drafter are as with bf16. Needs a GPU of compute capability >= 8.9 (Ada, "
        "Hopper); refused on the CPU."))
    fp8_recipe: Annotated[Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"], GRAPH, FP8] = Field(
        "tensorwise", description=(
        "torchao's float8 training recipe for train.precision fp8: one scale per tensor (cuBLAS), per row (e4m3 "
        "gradients too), or per row with the weight gradient in high precision. tensorwise measured fastest for the "
        "5-layer Qwen3-8B drafter on an H200 (issue 28: 120.0 ms against 136.6 rowwise and 142.0 bf16 at "
        "3072/512)."))
    fp8_lm_head: Annotated[bool, GRAPH] = Field(False, description=(
        "The frozen LM head in FP8 inside the fused loss (train.loss_kernel fused): its weight quantized once to e4m3 "
        "rowwise (two copies, one per matmul layout), the drafter's states and the logits' gradient quantized rowwise "
        "per chunk, for the logits and the input gradient. Needs an FP8 GPU (compute capability >= 8.9)."))
    fp8_target: Annotated[bool, GRAPH] = Field(False, description=(
        "The target's forward with FP8 weights: the Linear weights of the decoder layers the capture runs quantized "
        "once to e4m3 rowwise (torchao), activations quantized rowwise per call; the features then differ from "
        "bf16's by FP8 rounding. Needs an FP8 GPU (compute capability >= 8.9) for every target."))
    recompute_weight_casts: Annotated[bool, GRAPH, COMPILED] = Field(False, description=(
        "Compiled layers under bf16 autocast recast each weight in the backward instead of keeping its bf16 "
        "copy from the forward: about 2 bytes per drafter parameter less at the peak (1.8 GB for the 5-layer "
        "Qwen3-8B drafter) for one more cast per weight in the backward (its time on an H200 is not measured "
        "yet)."))
    queue_size: Annotated[int, TRAIN_OPS] = Field(4, ge=1, description=(
        "Feature batches buffered between target and drafter workers."))
    log_every: Annotated[int, TRAIN_OPS] = Field(10, ge=1, description="Steps between metrics.jsonl rows.")
    checkpoint_every: Annotated[int, TRAIN_OPS] = Field(50, ge=0, description=(
        "Steps between checkpoints (0 only at the end)."))
    resume: Annotated[bool, TRAIN_OPS] = Field(True, description=(
        "Continue an interrupted run (same result keys and data: its identity) from its newest intact checkpoint, "
        "and restore a finished one (its outputs written back, nothing trained). false trains anew, this identity's "
        "checkpoints set aside first (checkpoints/<identity>.N/, kept)."))
    keep_runs: Annotated[int | None, TRAIN_OPS] = Field(None, ge=0, description=(
        "Other runs kept in the run folder's checkpoints/ besides this identity's (other configs' runs, runs set "
        "aside by a retrain): when a run finishes or is restored, the most recently written this many are kept and "
        "the others deleted, each named in a log line. null keeps every one (the pipeline never deletes a run "
        "otherwise)."))
    warmup_steps_excluded: Annotated[int, TRAIN_OPS] = Field(5, ge=0, description=(
        "First steps left out of Ktok/s (compile and cache warm-up)."))
    ready_timeout_s: Annotated[float, TRAIN_OPS] = Field(300, gt=0, description=(
        "A worker not ready after this long fails the run, named."))
    stall_timeout_s: Annotated[float, TRAIN_OPS] = Field(600, gt=0, description="No step for this long fails the run.")
    fail_at_step: Annotated[HookSpec | None, TRAIN_OPS] = Field(None, description=(
        "Test hook: {worker: name, step: k} raises in that worker at step k."))
    diverge_at_step: Annotated[HookSpec | None, TRAIN_OPS] = Field(None, description=(
        "Test hook: {replica: r, step: k} perturbs replica r's weights after step k (the divergence guard "
        "must stop the run)."))
    eval_every: Annotated[int, TRAIN_OPS] = Field(0, ge=0, description=(
        "Acceptance measured while training: every this many steps (and at the last) drafter replica 0 decodes the "
        "first train.eval_prompts held-out prompts (the data stage's holdout.jsonl) by real greedy speculative "
        "decoding with the target (the evaluate stage's decoding code, an eager copy of the replica's current weights "
        "in the target's dtype, on the target's device) and logs tau to metrics.jsonl, the progress line and the "
        "report's training plot; the other replicas wait (training time, the time budget and Ktok/s exclude it: "
        "summary.json `eval`). Needs a target in the process of replica 0 (threads runtime, or co-located "
        "distributed ranks). 0 is off."))
    eval_prompts: Annotated[int | None, TRAIN_OPS] = Field(None, ge=1, description=(
        "Held-out prompts decoded by each in-training evaluation (train.eval_every); null is evaluate.num_prompts."))
    eval_max_new_tokens: Annotated[int | None, TRAIN_OPS] = Field(None, ge=1, description=(
        "Tokens generated per prompt by each in-training evaluation (train.eval_every); null is "
        "evaluate.max_new_tokens. With both null the last evaluation's tau equals the evaluate stage's "
        "(temperature 0) on the final checkpoint."))
    check_every: Annotated[int, TRAIN_OPS] = Field(20, ge=0, description=(
        "Divergence guard: every this many steps (and at the last) the replicas compare exact weight "
        "checksums; a mismatch stops the run naming the step and replicas. 0 turns it off."))
    stop_timeout_s: Annotated[float, TRAIN_OPS] = Field(120, gt=0, description=(
        "After SIGINT/SIGTERM/SIGUSR1/SIGHUP the replicas finish their step and checkpoint; past this long the run "
        "exits without one."))
    expandable_segments: Annotated[bool, TRAIN_OPS] = Field(True, description=(
        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."))
    matmul_tflops: Annotated[float | None, TRAIN_OPS] = Field(None, gt=0, description=(
        "The bf16 matmul ceiling (TFLOP/s per GPU) MFU is measured against; null: no MFU (the matmul section of "
        "bench/h200.py measures it)."))
    profile: ProfileSection | None = Field(None, description=(
        "torch.profiler over a window of optimizer steps of replica 0 (CPU ops of its thread, every GPU "
        "kernel); the chrome trace is written to `out` (.json or .json.gz)."))
    rendezvous: RendezvousSection = Field({}, validate_default=True, description=(
        "torchrun settings for the distributed runtime (multi-node)."))


    @model_validator(mode="after")
    def _consistent(self):
        if self.fp8_lm_head and self.loss_kernel != "fused":
            raise ValueError(f"train.fp8_lm_head=true needs train.loss_kernel: fused (the FP8 head runs inside the "
                             f"fused loss), not {self.loss_kernel}")
        if len(self.targets) % self.target_split:
            raise ValueError(f"train.target_split {self.target_split}: train.targets lists {len(self.targets)} "
                             f"devices, not a whole number of target workers of {self.target_split} devices each")
        if self.target_split > 1 and self.compile_target:
            raise ValueError("train.target_split > 1 with train.compile_target: the split target's layers are not "
                             "compiled (its warm-up compiles per listed device); set train.compile_target: false")
        if self.eval_every and self.fp8_target:
            raise ValueError("train.eval_every with train.fp8_target: the in-training tau would be measured against "
                             "the FP8-quantized target, not the target `evaluate` decodes with; set "
                             "train.eval_every: 0 (the evaluate stage still measures tau) or train.fp8_target: false")
        return self

class EvaluateSection(Section):
    num_prompts: Annotated[int, EVALUATE] = Field(16, ge=1, description="Held-out prompts decoded.")
    max_new_tokens: Annotated[int, EVALUATE] = Field(64, ge=1, description="Tokens generated per prompt.")
    temperature: Annotated[float, EVALUATE] = Field(0.0, ge=0, description="0 is greedy (and must be lossless).")
    proposal: Annotated[Literal["auto", "argmax", "sample", "both"], EVALUATE] = Field("auto", description=(
        "Draft policy at temperature > 0 (tau depends on it): argmax, argmax drafts verified against a one-hot "
        "proposal (vLLM by default, SGLang, TensorRT-LLM); sample, drafts sampled from the drafter's softmax and "
        "verified by speculative sampling (DeepSpec, the reference package; vLLM with draft_sample_method: "
        "probabilistic, lossless from vLLM PR #54282 on); both (and auto): each, the top-level tau being "
        "argmax's. Both are exact (the output follows the target's sampling). At temperature 0 the two are one "
        "greedy rule: only argmax is decoded."))
    device: Annotated[str, EVALUATE, ON_DEVICE] = Field("auto", pattern=DEVICE_PATTERN, description=(
        "Device for evaluation."))
    prompt_files: Annotated[tuple[str, ...], EVALUATE, Reads(("evaluate",))] = Field((), strict=False, description=(
        "Extra JSONL prompt sets (`prompt` field), each reported separately."))


class ReportSection(Section):
    baseline_run: Annotated[str | None, REPORT] = Field(None, description=(
        "Pinned baseline run id (for Ktok/s and tau); null is the median of the recent runs of the same run "
        "name, hardware and placement that were identical to the previous one, leaving out outliers (runs "
        "that regressed with nothing changed)."))
    baseline_window: Annotated[int, REPORT] = Field(10, ge=1, description=(
        "Most identical runs in the baseline median (and per group in the spread)."))
    threshold: Annotated[float, REPORT] = Field(-0.1, ge=-0.5, le=0, description=(
        "The floor of the Ktok/s threshold: a relative change below it is a regression when identical runs "
        "are quiet; widened to noise_sigmas x their spread, never beyond threshold_cap. A drop of 50% or more"
        " is always a regression."))
    threshold_cap: Annotated[float, REPORT] = Field(-0.25, ge=-0.5, le=0, description=(
        "The cap of the Ktok/s threshold: the widest the run-to-run spread may widen it to (at or below "
        "threshold), so noise cannot switch the gate off."))
    tau_threshold: Annotated[float, REPORT] = Field(-0.05, le=0, description=(
        "The floor of the tau threshold, in tau (tokens per verification step, temperature 0): a drop below "
        "it is a quality regression when identical runs agree (on the CPU they do exactly); widened to "
        "noise_sigmas x their spread of tau, never beyond tau_threshold_cap."))
    tau_threshold_cap: Annotated[float, REPORT] = Field(-0.3, le=0, description=(
        "The cap of the tau threshold, in tau: the widest the run-to-run spread may widen it to (at or below "
        "tau_threshold)."))
    noise_sigmas: Annotated[float, REPORT] = Field(3.0, ge=0, description=(
        "Each threshold widens to this many run-to-run spreads (1.4826 x median absolute deviation of "
        "identical runs: relative for Ktok/s, in tau for tau), between its floor and its cap."))
    fail_on_regression: Annotated[bool, REPORT] = Field(False, description=(
        "The gate rule (after the report, which it keeps) exits non-zero when the newest run regressed in "
        "throughput (Ktok/s) or in quality (tau): a quality regression fails it like a throughput one."))
    memory_imbalance: Annotated[float, REPORT] = Field(0.25, gt=0, description=(
        "Flag a drafter replica whose peak memory differs from the median by more than this share."))
    min_utilisation: Annotated[float, REPORT] = Field(30, ge=0, le=100, description=(
        "Flag a GPU whose mean utilisation (percent) stays below this."))


    @model_validator(mode="after")
    def _caps(self):
        for floor, cap in (("threshold", "threshold_cap"), ("tau_threshold", "tau_threshold_cap")):
            if getattr(self, cap) > getattr(self, floor):
                raise ValueError(f"report.{cap} ({getattr(self, cap)}) is narrower than report.{floor} "
                                 f"({getattr(self, floor)}): the cap must be at or below the floor; lower report.{cap}")
        return self

# A value a sweep row gives a key: a scalar or a list of scalars (checked against the key's own type when the row's
# config is resolved, dflash/sweep.py).
SweepValue = int | float | bool | str | None | Annotated[tuple[int | float | bool | str, ...], Strict(False)]
SWEEP = Role((), None)   # the sweep itself: each run's keys are hashed and rerun its stages as any config's keys do
SHEET = Reads((), lambda cfg, s: isinstance(s.runs, str))   # a runs sheet: checked before any job, read by the workflow


class SweepSection(Section):
    runs: Annotated[str | Annotated[tuple[dict[str, SweepValue], ...], Strict(False)] | None, SWEEP, SHEET] = Field(
        None, description=(
        "The sweep's runs besides the config's own (run_name, always run): a list of {run: NAME, KEY: VALUE, ...} "
        "(dotted keys over this config), or the path of a runs sheet (TSV or CSV: a header `run` and one dotted key "
        "per column, one run a row, cells read as YAML, an empty cell leaving the key to the config). The workflow trains "
        "each into results/runs/<run>/; a run whose data keys differ gets its own dataset. Keys of the target, the "
        "placement, the names and files the workflow reads stay the config's (dflash/sweep.py). null: no sweep."))
    evaluate: Annotated[Literal["all", "own"], SWEEP] = Field("all", description=(
        "Runs the evaluate stage decodes: all, every run; own, the config's own run only, the others' tau at "
        "temperature 0 being their last in-training evaluation (train.eval_every on, on the evaluate stage's prompts "
        "and tokens: the same measure, a few seconds instead of a minute and a half of decoding each)."))
    temperatures: Annotated[tuple[Annotated[float, Field(ge=0)], ...], SWEEP] = Field((), strict=False, description=(
        "Other temperatures each decoded run is evaluated at (acceptance-t<T>.json), under evaluate.proposal's draft "
        "policies (auto: argmax and sample)."))
    only: Annotated[tuple[str, ...] | None, SWEEP] = Field(None, strict=False, description=(
        "Run only the sweep's runs these names or shell patterns match (`[muon*, quality-s*]`), and the config's own: "
        "a part of a sweep per session (docs/quality.md); the table covers them. null: every run."))
    baseline: Annotated[str | None, SWEEP] = Field(None, pattern=NAME, max_length=NAME_MAX, description=(
        "The run whose seed group the sweep table compares every other group with; null: the config's own run."))


class DflashConfig(Section):
    """The whole config: one YAML drives the Snakemake workflow and every `python -m dflash <stage>`."""
    model_config = ConfigDict(title="dflash pipeline configuration", json_schema_extra={
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://dflash.local/config.schema.yaml"})

    run_name: Annotated[str, NAMES] = Field("demo", pattern=NAME, max_length=NAME_MAX, description=(
        "Name of the training run; outputs land in results/runs/<run_name>/."))
    dataset_name: Annotated[str, NAMES] = Field("default", pattern=NAME, max_length=NAME_MAX, description=(
        "Name of the expanded dataset; shards land in results/data/<dataset_name>/. A name, not content: runs know "
        "their data by its content hash (the same data under another name restores a finished run)."))
    results_dir: Annotated[str, NAMES] = Field("results", description=(
        "Folder that holds every output. Paths from config must stay inside it or the repository."))
    strict_env: Annotated[bool, Role((), None)] = Field(False, description=(
        "Treat a mismatch between the running environment and the pins in envs/ as an error, not a warning."))
    seed: Annotated[int, SEED] = Field(0, ge=0, le=SEED_MAX, description=(
        "Global seed for data order, anchor sampling and initialisation (0 to 2^32-1)."))
    target: TargetSection = Field({}, validate_default=True, description=(
        "The frozen target LLM whose hidden states condition the drafter."))
    data: DataSection = Field({}, validate_default=True, description="Dataset expansion (stage `data`).")
    drafter: DrafterSection = Field({}, validate_default=True, description=(
        "The DFlash drafter. Sizes left null are taken from the target."))
    train: TrainSection = Field({}, validate_default=True, description="Training (stage `train`) and its placement.")
    evaluate: EvaluateSection = Field({}, validate_default=True, description=(
        "Speculative decoding with the target and the trained drafter (stage `evaluate`)."))
    report: ReportSection = Field({}, validate_default=True, description=(
        "Throughput and quality history and regression report (stage `report`)."))
    sweep: SweepSection = Field({}, validate_default=True, description=(
        "Named runs over this config, each a set of key overrides (recipe, seed, data size, temperature, policy), "
        "trained and evaluated by the workflow, compared in results/report/sweep.md (docs/quality.md)."))

    @model_validator(mode="after")
    def _drafter_fits_target(self):
        """The drafter against the target the config builds (its `arch`); a target folder used as it is (build none)
        is checked where it is read (dflash.config.check_here)."""
        t, d = self.target, self.drafter
        if t.build == "none":
            return self
        layers = t.arch.num_hidden_layers
        past = [i for i in d.target_layer_ids or () if i >= layers]
        if past:
            raise ValueError(f"drafter.target_layer_ids has id {past[0]}, past the {layers} layers of the target "
                             f"(target.arch.num_hidden_layers; ids 0-{layers - 1})")
        if d.hidden_size is not None and d.hidden_size != t.arch.hidden_size:
            raise ValueError(f"drafter.hidden_size ({d.hidden_size}) must equal target.arch.hidden_size "
                             f"({t.arch.hidden_size}): the drafter uses the target's embedding and LM head")
        a = t.arch
        if why := drafter_misfit(d, a.vocab_size, a.num_attention_heads, a.num_key_value_heads, "target.arch"):
            raise ValueError(why)
        return self
