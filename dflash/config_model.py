"""Every config key: its type, default, bounds and description, in one place (pydantic models).

The package reads a loaded config as a `DflashConfig`: frozen, typed attributes, lists as tuples, unknown keys
refused. `workflow/schemas/config.schema.yaml` (what Snakemake and the docs read) is generated from these models:
to add a key, add one field to its section here, then run `python -m dflash schema --write` (docs/config.md).
Defaults that change what a drafter learns do not change.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator


class Section(BaseModel):
    """A config section: frozen, strict types (no "5" for 5), unknown keys refused."""
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    @field_validator("*", mode="wrap")
    @classmethod
    def _number_as_written(cls, value, handler):
        """A number written as an integer (`stall_timeout_s: 600`) stays an int, as written: logs, messages and
        records show it as the YAML does."""
        out = handler(value)
        return value if type(value) is int and type(out) is float else out


# A test hook's free-form mapping ({worker: name, step: k}); the schema says only "an object".
HookSpec = Annotated[dict[str, int | str], WithJsonSchema({"type": "object"})]
# Names that become folder names.
NAME = r"^[A-Za-z0-9_.-]+$"


class ArchSection(Section):
    num_hidden_layers: int = Field(4, ge=2, description="Decoder layers.")
    hidden_size: int = Field(128, ge=8, description="Hidden size.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (GQA).")
    head_dim: int = Field(32, ge=4, description="Per-head dimension.")
    intermediate_size: int = Field(384, ge=8, description="SwiGLU inner size.")
    vocab_size: int = Field(2048, ge=64, description="Vocabulary size (tokenizer trained to this size).")
    max_position_embeddings: int = Field(4096, ge=64, description="RoPE positions.")
    rope_theta: float = Field(1000000.0, description="RoPE base.")


class PretrainSection(Section):
    steps: int = Field(120, ge=0, description="Optimizer steps (120 take about 2 CPU-minutes on one core).")
    batch_size: int = Field(16, ge=1, description="Sequences per step.")
    seq_len: int = Field(256, ge=16, description="Tokens per sequence.")
    lr: float = Field(0.003, gt=0, description="Peak AdamW learning rate.")
    max_seconds: float | None = Field(None, gt=0, description=(
        "Stop after this many seconds of pre-training counted from the end of the first step (which holds any"
        " compile); the schedule follows elapsed time or steps, whichever is further along. null: steps "
        "alone."))
    compile: bool = Field(False, description=(
        "Compile each decoder layer in place for pre-training (identical layers share one graph)."))
    device: str = Field("auto", description=(
        "build code: device of pre-training (auto: cuda when available, else cpu; bf16 autocast and fused "
        "AdamW on CUDA). The tiny build always pre-trains on the CPU."))
    corpus_mb: float = Field(256, gt=0, description=(
        "build code and the `code` data source: MiB of Python source read (stdlib, then site-packages, each "
        "in sorted path order; files over 512 KiB, not UTF-8 or duplicated are skipped) before the split into"
        " pre-training and held-out files."))
    heldout_fraction: float = Field(0.05, gt=0, lt=1, description=(
        "build code and the `code` data source: share of files held out of pre-training, chosen by a hash of "
        "each file's path relative to its root (the same on every machine)."))
    chat_fraction: float = Field(0.1, ge=0, description=(
        "build code: \"complete this function\" conversations from the pre-training files, in the chat "
        "template, added to the pre-training text up to this share of its characters (the model learns the "
        "format it is prompted with)."))
    tokenizer_mb: float = Field(32, gt=0, description=(
        "build code: MiB of the pre-training text (files and conversations in a seeded order) the BPE "
        "tokenizer is trained on."))
    eval_windows: int = Field(64, ge=1, description=(
        "build code: seq_len windows, evenly spaced, of the held-out files' token stream scored for "
        "build.json's held-out perplexity (and as many of the pre-training stream)."))
    num_proc: int = Field(0, ge=0, description=(
        "build code: processes that parse files into conversations (0: every core)."))


class TargetSection(Section):
    path: str = Field("results/target/tiny", description=(
        "Directory loadable by AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained."))
    build: Literal["none", "tiny", "code", "random"] = Field("tiny", description=(
        "How the `target` stage makes `path`: `tiny` builds and briefly pre-trains a small Qwen3 model with a"
        " locally trained BPE tokenizer; `code` pre-trains a Qwen3 model of the `arch` shape (GPU-sized) on "
        "the Python source of the standard library and site-packages, with a BPE tokenizer trained on it, and"
        " records its held-out perplexity (`pretrain` sets the corpus and the budget); `random` writes a "
        "randomly initialised model of the `arch` shape with the tiny tokenizer's vocabulary padded to "
        "`arch.vocab_size` (benchmarks); `none` uses an existing directory."))
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "Target compute dtype; auto is bfloat16 on GPU and float32 on CPU."))
    trust_remote_code: bool = Field(False, description=(
        "Passed to from_pretrained. Off unless you trust the model directory."))
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description=(
        "Attention implementation of the target (transformers attn_implementation)."))
    arch: ArchSection = Field({}, validate_default=True, description=(
        "Architecture of the target built by `build` (tiny, code or random). Ignored with build none."))
    pretrain: PretrainSection = Field({}, validate_default=True, description=(
        "Pre-training of the target (build tiny: briefly, on the CPU, on the built-in corpus; build code: on "
        "`device`, on the code corpus). Random windows of the packed token stream; AdamW, warm-up over the "
        "first tenth, cosine to a tenth of `lr`."))


class BuiltinCorpusSection(Section):
    enabled: bool = Field(True, description="Add the built-in corpus as a source named `stdlib`.")
    max_conversations: int = Field(1500, ge=1, description="Conversations to make.")


class CodeCompletionSection(Section):
    enabled: bool = Field(False, description="Add them as a source named `code`.")
    max_conversations: int = Field(2000, ge=1, description=(
        "Conversations to make (at most per_file a file; fewer when the files hold fewer)."))
    files: Literal["heldout", "all"] = Field("heldout", description=(
        "Files the conversations come from: heldout, the files held out of the code target's pre-training only; "
        "all, the pre-training files as well (more training data: a drafter learns the answers of the model it "
        "serves). Either way data.holdout's evaluation prompts come from held-out files only, and no "
        "conversation of a file that gives an evaluation prompt is trained on."))
    per_file: int = Field(8, ge=1, description=(
        "At most this many conversations of one file (a seeded choice among its functions): many files, not a "
        "few long ones."))


class SyntheticSection(Section):
    enabled: bool = Field(False, description="Replace all sources with synthetic samples.")
    num_samples: int = Field(256, ge=1, description="Samples to make.")
    lengths: tuple[Annotated[int, Field(ge=8)], ...] = Field((3072,), strict=False, description=(
        "Lengths to cycle through."))
    supervised_fraction: float = Field(0.8, ge=0, le=1, description=(
        "Trailing fraction of each sample in the loss mask."))


class SourceSection(Section):
    name: str = Field(pattern=NAME, description="Short name used in the manifest.")
    path: str = Field(description="File, datasets folder, or hub dataset name (kind hub).")
    kind: Literal["auto", "jsonl", "json", "parquet", "disk", "hub"] = Field("auto", description=(
        "How to read path; auto picks by suffix (.jsonl, .ndjson, .json, each optionally .gz, .zst or .bz2 "
        "compressed; .parquet; a folder)."))
    format: Literal["auto", "sharegpt", "openai"] = Field("auto", description="Conversation layout.")
    split: str = Field("train", description="Split for hub datasets.")
    limit: int | None = Field(None, ge=1, description="At most this many rows from the source.")
    weight: float = Field(1.0, ge=0, description="Sampling weight (rows drawn with replacement beyond 1.0).")


class RegenerateSection(Section):
    enabled: bool = Field(True, description="Replace assistant turns by the target's own responses.")
    engine: Literal["hf", "openai"] = Field("hf", description=(
        "hf generates in-process (transformers); openai sends each prompt, rendered locally with the target's"
        " chat template, to OpenAI-compatible servers (vLLM, SGLang, transformers serve) at `servers`."))
    max_new_tokens: int = Field(96, ge=1, description="Tokens generated per response.")
    temperature: float = Field(0.0, ge=0, description="0 is greedy.")
    batch_size: int = Field(0, ge=0, description=(
        "hf: prompts per batch (sorted by length); 0 sizes it from free GPU memory (hundreds of sequences per"
        " decode step on a GPU; cpu_batch_size on CPU)."))
    cpu_batch_size: int = Field(32, ge=1, description=(
        "hf: prompts per batch on CPU when batch_size is 0 (there is no GPU memory to size it from)."))
    decoder: Literal["auto", "static", "generate"] = Field("auto", description=(
        "hf: static is our decode loop with a static KV cache (one fixed batch shape; on GPU the decode step "
        "is compiled once and replayed as a CUDA graph); generate is transformers generate (dynamic cache); "
        "auto is static on GPU, generate on CPU."))
    compile: bool = Field(True, description=(
        "hf, static decoder on GPU: compile the decode step and replay it as a CUDA graph (false: eager)."))
    attention: Literal["auto", "grouped_flex", "grouped_sdpa"] = Field("auto", description=(
        "hf, static decoder: decode attention. grouped_flex: flex_attention over only the KV blocks a row sees "
        "(1.24x grouped_sdpa's tokens/s for an 8B-shaped target on an H200); grouped_sdpa: one sdpa kernel over the "
        "whole static cache; auto is grouped_flex under CUDA graphs (with a power-of-two head dim of at least 16 and a "
        "power-of-two count of query heads per KV head, which Inductor's flex decoding kernel needs), else "
        "grouped_sdpa."))
    compile_prefill: bool | None = Field(None, description=(
        "hf, static decoder: compile the prompts' prefill (64 rows a chunk) with Inductor, dynamic shapes (1.105x the "
        "eager prefill's tokens/s for an 8B-shaped target on an H200, for about 100 s more warm-up once per stage); "
        "null is on where the decode step is compiled for CUDA graphs (GPU), eager elsewhere."))
    device: str = Field("auto", description="hf: device for generation (auto, cpu, cuda:N).")
    servers: tuple[str, ...] = Field((), strict=False, description=(
        "openai: base URLs, e.g. http://127.0.0.1:8000/v1 (one per GPU or node; requests are spread over "
        "all)."))
    model: str | None = Field(None, description=(
        "openai: the served model name; null is target.path (what `vllm serve <path>` names it)."))
    concurrency: int = Field(64, ge=1, description="openai: requests in flight per server.")
    prompt_ids: bool = Field(False, description=(
        "openai: send the prompt as token ids (vLLM, SGLang) rather than text (any server, transformers serve"
        " too): exact tokens, and no second BOS from a server that adds one to text."))
    timeout_s: float = Field(600, gt=0, description="openai: seconds per request before it is retried.")
    retries: int = Field(6, ge=0, description=(
        "openai: retries of a request after a timeout, a refused connection, 429 or 5xx, with exponential "
        "backoff; then the stage stops naming the server."))
    backoff_s: float = Field(1.0, ge=0, description=(
        "openai: first retry delay in seconds (doubled each retry, at most 60)."))
    chunk_size: int = Field(256, ge=1, description=(
        "Conversations per resumable chunk: each finished chunk is written at once; a killed stage redoes at "
        "most the chunk in flight."))


class DataSection(Section):
    builtin_corpus: BuiltinCorpusSection = Field({}, validate_default=True, description=(
        "Conversations made offline from the Python standard library's docstrings and source."))
    code_completion: CodeCompletionSection = Field({}, validate_default=True, description=(
        "\"Complete this Python function\" conversations made from the files of the code corpus "
        "(`target.pretrain.corpus_mb`; `heldout_fraction` splits off the files a `build: code` target never saw), "
        "named `code-<root>/<path>:<function>:<line>`."))
    synthetic: SyntheticSection = Field({}, validate_default=True, description=(
        "Random-token samples of fixed length (throughput benchmarks only; no text, no regeneration)."))
    sources: tuple[SourceSection, ...] = Field((), strict=False, description=(
        "Extra sources (local JSONL/JSON/Parquet files, a datasets folder saved on disk, or a hub name)."))
    max_length: int = Field(512, ge=16, description="Longest tokenised conversation kept, in tokens.")
    truncation: Literal["drop", "truncate"] = Field("truncate", description=(
        "Over max_length, `truncate` keeps the first max_length tokens; `drop` rejects the row."))
    min_supervised_blocks: float = Field(2, ge=0, description=(
        "Keep a row only with at least this many block sizes of supervised (assistant) tokens."))
    bucket_edges: tuple[Annotated[int, Field(ge=16)], ...] = Field((128, 256, 384, 512), strict=False, description=(
        "Length buckets (upper edges); samples are padded to their bucket, the shapes warm-up compiles."))
    shard_rows: int = Field(4096, ge=1, description="Rows per Arrow shard file.")
    regenerate: RegenerateSection = Field({}, validate_default=True, description=(
        "Regenerate assistant turns with the target (how DFlash training data is made)."))
    holdout: int = Field(32, ge=0, description="Conversations kept out of training for evaluation prompts.")
    num_proc: int = Field(1, ge=0, description=(
        "Processes that tokenise (datasets.map num_proc; 0 is every core). Reading, tokenising and bucketing "
        "stream through Arrow files on disk: memory does not grow with the corpus."))
    shards: int = Field(1, ge=1, description=(
        "Snakemake jobs the expansion/regeneration is scattered into (each its own GPU or server); a gather "
        "job builds the buckets and the manifest. The content hash is the same for any value (greedy "
        "regeneration)."))


class DrafterSection(Section):
    num_layers: int = Field(2, ge=1, description="Drafter decoder layers.")
    hidden_size: int | None = Field(None, description="Must equal the target's (shared embedding/head); null takes it.")
    num_attention_heads: int | None = Field(None, description="Query heads; null takes the target's.")
    num_key_value_heads: int | None = Field(None, description="KV heads; null takes the target's.")
    head_dim: int | None = Field(None, description="Head dimension; null takes the target's.")
    intermediate_size: int | None = Field(None, description="SwiGLU size; null takes the target's.")
    block_size: int = Field(16, ge=2, description="Tokens per block (anchor + block_size-1 masks).")
    num_target_layers: int = Field(5, ge=1, description="Target layers fused into the context (k).")
    target_layer_ids: tuple[Annotated[int, Field(ge=0)], ...] | None = Field(None, strict=False, description=(
        "Explicit ids; null spaces k ids uniformly over 1..L-3."))
    mask_token_id: int | None = Field(None, description="null takes the tokenizer's mask token.")
    sliding_window: int | None = Field(None, ge=1, description=(
        "Sliding window W. With layer_types null, every drafter layer slides with window W (speculators' "
        "default is 2048 on every layer); with an explicit layer_types, its sliding_attention layers use W "
        "(required there) and its full_attention layers do not. A sliding layer attends causally over "
        "[context ; block] positions: key k is visible from query position t when k <= t and t - k < W "
        "(causal inside the block, as the inference stacks; docs/layer-layouts.md). null: no sliding layers."))
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = Field(
        None, strict=False, description=(
        "Per-layer attention kind (wins over the sliding_window rule); null is all sliding_attention when "
        "sliding_window is set, all full_attention otherwise."))
    init_from: str | None = Field(None, description=(
        "A drafter folder to fine-tune from: an export or a checkpoint (config.json + model.safetensors); its"
        " shape must equal this section's."))


class ProfileSection(Section):
    start_step: int = Field(20, ge=0, description="Steps done before the window opens.")
    steps: int = Field(5, ge=1, description="Steps in the window.")
    out: str = Field("profile.json.gz", description="Trace file; relative to the run folder.")


class RendezvousSection(Section):
    nnodes: int = Field(1, ge=1, description=(
        "Nodes, each running as many ranks; rank r (entry r of targets + drafters, or of drafters co-located)"
        " runs on node r // ranks-per-node, and a GPU may appear once per node."))
    node_rank: int = Field(0, ge=0, description="This node's rank (ignored with a c10d endpoint).")
    endpoint: str | None = Field(None, description="host:port of the c10d rendezvous; null is local.")
    id: str = Field("dflash", description="Rendezvous id.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description=(
        "Process-group backend; auto is nccl on GPU, gloo on CPU."))


class TrainSection(Section):
    runtime: Literal["auto", "threads", "distributed"] = Field("auto", description=(
        "auto picks distributed where every worker has its own GPU (more than one), and on several nodes; "
        "threads otherwise."))
    targets: tuple[str, ...] = Field(("cpu",), min_length=1, strict=False, description=(
        "Devices running target workers (cpu, cuda:N or N)."))
    drafters: tuple[str, ...] = Field(("cpu", "cpu"), min_length=1, strict=False, description=(
        "Devices running drafter replicas; a device may also be in targets."))
    attention: Literal["auto", "flex", "sdpa", "eager"] = Field("auto", description="auto is flex on GPU, sdpa on CPU.")
    compile: bool = Field(True, description=(
        "Compile the drafter's layers and loss kernel (flex or sdpa) in the warm-up, every shape bucket; "
        "eager never compiles. The CPU demo turns it off (first compiles take tens of seconds on 2 cores)."))
    compile_target: bool = Field(False, description=(
        "Compile the target's forward up to the last captured layer (each decoder layer compiled in place, "
        "identical layers sharing one graph per bucket shape; the final norm when captured) in the warm-up, "
        "every shape bucket, before the workers start; both runtimes. Opt-in: its effect on an H200 is not "
        "measured yet."))
    steps: int = Field(120, ge=1, description="Optimizer steps.")
    batch_size: int = Field(4, ge=1, description="Sequences per drafter replica per micro-step.")
    grad_accum: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    num_anchors: int = Field(32, ge=1, description="Anchors (blocks) sampled per sequence.")
    anchors_per_token: float | None = Field(None, le=1, gt=0, description=(
        "Anchors scale with the bucket length: round(length * this), at most num_anchors (long-context "
        "configs); null is num_anchors for every bucket."))
    gamma: float | None = Field(None, description=(
        "Loss decay exp(-(k-1)/gamma); null is 7 for block 16, scaled with block size."))
    optimizer: Literal["adamw", "muon"] = Field("adamw", description=(
        "adamw: one AdamW over every trainable parameter at train.lr. muon: torch.optim.Muon (momentum 0.95, "
        "Nesterov, 5 Newton-Schulz steps, adjust_lr_fn match_rms_adamw) on every 2-D weight (the layers' "
        "projections and fc) at train.muon_lr, AdamW on the rest (the norm weights) at train.lr; every "
        "trainable parameter in exactly one group. Both groups follow the same warm-up + cosine schedule and "
        "train.weight_decay (docs/recipes.md)."))
    muon_lr: float = Field(0.001, gt=0, description=(
        "Peak learning rate of the Muon group (train.optimizer muon), scaled per matrix by 0.2 x "
        "sqrt(max(rows, cols)) (match_rms_adamw: updates of AdamW's RMS); 1e-3 is speculators' default with "
        "the same scaling."))
    time_budget_s: float = Field(0, ge=0, description=(
        "Train for this many seconds of wall time after the warm-up (over resumes), the schedule following "
        "elapsed time (progress = elapsed / budget replaces step / steps); the run ends, finished, at the "
        "first step where progress >= 1, or at train.steps if that comes first. The replicas agree on the "
        "elapsed time each step (the mean of their clocks, reduced with the step's statistics). 0 is off: the"
        " schedule follows train.steps."))
    lr: float = Field(0.0006, gt=0, description=(
        "Peak AdamW learning rate (every parameter with train.optimizer adamw; the norm weights with muon)."))
    weight_decay: float = Field(0.0, ge=0, description=(
        "Decoupled weight decay of AdamW (and of Muon with train.optimizer muon)."))
    betas: tuple[float, ...] = Field((0.9, 0.95), min_length=2, max_length=2, strict=False, description="AdamW betas.")
    warmup_ratio: float = Field(0.04, ge=0, le=1, description="Linear warm-up share of steps before the cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a share of lr.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip (0 disables).")
    loss_chunk: int = Field(2048, ge=1, description="Draft positions per LM-head/cross-entropy chunk.")
    loss_kernel: Literal["fused", "checkpointed"] = Field("fused", description=(
        "fused computes the hidden-state gradient inside the forward (two matmuls per chunk); checkpointed "
        "recomputes each chunk in the backward (three)."))
    loss_weighting: Literal["decay", "dpace"] = Field("decay", description=(
        "Weights of the block positions in the loss (docs/recipes.md). decay: exp(-(k-1)/gamma), the loss the"
        " weighted mean over scored positions. dpace: D-PACE (arXiv 2605.18810), detached weights from the "
        "drafter's own confidence in each label, the suffix sums of the smoothed confidences' prefix "
        "products, the loss normalised by the number of blocks (sampled anchors) instead of the weight sum."))
    dpace_alpha: float = Field(0.5, le=1, gt=0, description=(
        "D-PACE's confidence smoothing (the paper's Eq. 7): q~ = alpha + (1 - alpha) q; read with "
        "loss_weighting dpace only."))
    objective: Literal["ce", "kl", "ce+kl"] = Field("ce", description=(
        "Per-position loss (docs/recipes.md). ce: cross-entropy against the data's token. kl: KL(p_target || "
        "q_drafter) against the target's own next-token distribution at that position (the target workers "
        "then also capture the state after its final norm, [b, S, H] more per micro-batch, and run every "
        "target layer). ce+kl: their sum. Same position weights and normalisation for each."))
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "Autocast dtype; auto is bf16 on GPU, float32 on CPU."))
    precision: Literal["bf16", "fp8"] = Field("bf16", description=(
        "Matmul precision of the drafter's decoder layers. bf16: their Linears in the autocast dtype (train.dtype). "
        "fp8: torchao float8 training (dflash/model/fp8.py): each Linear's input, weight and output gradient cast to "
        "FP8 with fresh scales at every matmul (train.fp8_recipe), the fp32 master weights kept as the parameters, so "
        "checkpoints and the exported drafter are as with bf16. Needs a GPU of compute capability >= 8.9 (Ada, "
        "Hopper); refused on the CPU."))
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field("tensorwise", description=(
        "torchao's float8 training recipe for train.precision fp8: one scale per tensor (cuBLAS), per row (e4m3 "
        "gradients too), or per row with the weight gradient in high precision. tensorwise measured fastest for the "
        "5-layer Qwen3-8B drafter on an H200 (issue 28: 120.0 ms against 136.6 rowwise and 142.0 bf16 at "
        "3072/512)."))
    fp8_lm_head: bool = Field(False, description=(
        "The frozen LM head in FP8 inside the fused loss (train.loss_kernel fused): its weight quantized once to e4m3 "
        "rowwise (two copies, one per matmul layout), the drafter's states and the logits' gradient quantized rowwise "
        "per chunk, for the logits and the input gradient. Needs an FP8 GPU (compute capability >= 8.9)."))
    fp8_target: bool = Field(False, description=(
        "The target's forward with FP8 weights: the Linear weights of the decoder layers the capture runs quantized "
        "once to e4m3 rowwise (torchao), activations quantized rowwise per call; the features then differ from "
        "bf16's by FP8 rounding. Needs an FP8 GPU (compute capability >= 8.9) for every target."))
    recompute_weight_casts: bool = Field(False, description=(
        "Compiled layers under bf16 autocast recast each weight in the backward instead of keeping its bf16 "
        "copy from the forward: about 2 bytes per drafter parameter less at the peak (1.8 GB for the 5-layer "
        "Qwen3-8B drafter) for one more cast per weight in the backward (its time on an H200 is not measured "
        "yet)."))
    queue_size: int = Field(4, ge=1, description="Feature batches buffered between target and drafter workers.")
    log_every: int = Field(10, ge=1, description="Steps between metrics.jsonl rows.")
    checkpoint_every: int = Field(50, ge=0, description="Steps between checkpoints (0 only at the end).")
    resume: bool = Field(True, description=(
        "Continue an interrupted run (same config and data) from its newest intact checkpoint; a finished "
        "run's rerun trains a new run. false also sets old checkpoints aside (checkpoints.previous/)."))
    warmup_steps_excluded: int = Field(5, ge=0, description=(
        "First steps left out of Ktok/s (compile and cache warm-up)."))
    ready_timeout_s: float = Field(300, gt=0, description=(
        "A worker not ready after this long fails the run, named."))
    stall_timeout_s: float = Field(600, gt=0, description="No step for this long fails the run.")
    fail_at_step: HookSpec | None = Field(None, description=(
        "Test hook: {worker: name, step: k} raises in that worker at step k."))
    diverge_at_step: HookSpec | None = Field(None, description=(
        "Test hook: {replica: r, step: k} perturbs replica r's weights after step k (the divergence guard "
        "must stop the run)."))
    eval_every: int = Field(0, ge=0, description=(
        "Acceptance measured while training: every this many steps (and at the last) drafter replica 0 decodes the "
        "first train.eval_prompts held-out prompts (the data stage's holdout.jsonl) by real greedy speculative "
        "decoding with the target (the evaluate stage's decoding code, an eager copy of the replica's current weights "
        "in the target's dtype, on the target's device) and logs tau to metrics.jsonl, the progress line and the "
        "report's training plot; the other replicas wait (training time, the time budget and Ktok/s exclude it: "
        "summary.json `eval`). Needs a target in the process of replica 0 (threads runtime, or co-located "
        "distributed ranks). 0 is off."))
    eval_prompts: int | None = Field(None, ge=1, description=(
        "Held-out prompts decoded by each in-training evaluation (train.eval_every); null is evaluate.num_prompts."))
    eval_max_new_tokens: int | None = Field(None, ge=1, description=(
        "Tokens generated per prompt by each in-training evaluation (train.eval_every); null is "
        "evaluate.max_new_tokens. With both null the last evaluation's tau equals the evaluate stage's "
        "(temperature 0) on the final checkpoint."))
    check_every: int = Field(20, ge=0, description=(
        "Divergence guard: every this many steps (and at the last) the replicas compare exact weight "
        "checksums; a mismatch stops the run naming the step and replicas. 0 turns it off."))
    stop_timeout_s: float = Field(120, gt=0, description=(
        "After SIGINT/SIGTERM/SIGUSR1 the replicas finish their step and checkpoint; past this long the run "
        "exits without one."))
    expandable_segments: bool = Field(True, description="Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    matmul_tflops: float | None = Field(None, description=(
        "Measured bf16 matmul ceiling for MFU; null measures it on GPU."))
    profile: ProfileSection | None = Field(None, description=(
        "torch.profiler over a window of optimizer steps of replica 0 (CPU ops of its thread, every GPU "
        "kernel); the chrome trace is written to `out` (.json or .json.gz)."))
    rendezvous: RendezvousSection = Field({}, validate_default=True, description=(
        "torchrun settings for the distributed runtime (multi-node)."))


class EvaluateSection(Section):
    num_prompts: int = Field(16, ge=1, description="Held-out prompts decoded.")
    max_new_tokens: int = Field(64, ge=1, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0, description="0 is greedy (and must be lossless).")
    proposal: Literal["auto", "argmax", "sample", "both"] = Field("auto", description=(
        "Draft policy at temperature > 0 (tau depends on it): argmax, argmax drafts verified against a one-hot "
        "proposal (vLLM, SGLang, TensorRT-LLM); sample, drafts sampled from the drafter's softmax and verified by "
        "speculative sampling (DeepSpec, the reference package); both (and auto): each, the top-level tau being "
        "argmax's. Both are exact (the output follows the target's sampling). At temperature 0 the two are one "
        "greedy rule: only argmax is decoded."))
    device: str = Field("auto", description="Device for evaluation.")
    prompt_files: tuple[str, ...] = Field((), strict=False, description=(
        "Extra JSONL prompt sets (`prompt` field), each reported separately."))


class ReportSection(Section):
    baseline_run: str | None = Field(None, description=(
        "Pinned baseline run id (for Ktok/s and tau); null is the median of the recent runs of the same run "
        "name, hardware and placement that were identical to the previous one, leaving out outliers (runs "
        "that regressed with nothing changed)."))
    baseline_window: int = Field(10, ge=1, description=(
        "Most identical runs in the baseline median (and per group in the spread)."))
    threshold: float = Field(-0.1, ge=-0.5, le=0, description=(
        "The floor of the Ktok/s threshold: a relative change below it is a regression when identical runs "
        "are quiet; widened to noise_sigmas x their spread, never beyond threshold_cap. A drop of 50% or more"
        " is always a regression."))
    threshold_cap: float = Field(-0.25, ge=-0.5, le=0, description=(
        "The cap of the Ktok/s threshold: the widest the run-to-run spread may widen it to (at or below "
        "threshold), so noise cannot switch the gate off."))
    tau_threshold: float = Field(-0.05, le=0, description=(
        "The floor of the tau threshold, in tau (tokens per verification step, temperature 0): a drop below "
        "it is a quality regression when identical runs agree (on the CPU they do exactly); widened to "
        "noise_sigmas x their spread of tau, never beyond tau_threshold_cap."))
    tau_threshold_cap: float = Field(-0.3, le=0, description=(
        "The cap of the tau threshold, in tau: the widest the run-to-run spread may widen it to (at or below "
        "tau_threshold)."))
    noise_sigmas: float = Field(3.0, ge=0, description=(
        "Each threshold widens to this many run-to-run spreads (1.4826 x median absolute deviation of "
        "identical runs: relative for Ktok/s, in tau for tau), between its floor and its cap."))
    fail_on_regression: bool = Field(False, description=(
        "The gate rule (after the report, which it keeps) exits non-zero when the newest run regressed in "
        "throughput (Ktok/s) or in quality (tau): a quality regression fails it like a throughput one."))
    memory_imbalance: float = Field(0.25, gt=0, description=(
        "Flag a drafter replica whose peak memory differs from the median by more than this share."))
    min_utilisation: float = Field(30, ge=0, le=100, description=(
        "Flag a GPU whose mean utilisation (percent) stays below this."))


class DflashConfig(Section):
    """The whole config: one YAML drives the Snakemake workflow and every `python -m dflash <stage>`."""
    model_config = ConfigDict(title="dflash pipeline configuration", json_schema_extra={
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://dflash.local/config.schema.yaml"})

    run_name: str = Field("demo", pattern=NAME, description=(
        "Name of the training run; outputs land in results/runs/<run_name>/."))
    dataset_name: str = Field("default", pattern=NAME, description=(
        "Name of the expanded dataset; shards land in results/data/<dataset_name>/."))
    results_dir: str = Field("results", description=(
        "Folder that holds every output. Paths from config must stay inside it or the repository."))
    strict_env: bool = Field(False, description=(
        "Treat a mismatch between the running environment and the pins in envs/ as an error, not a warning."))
    seed: int = Field(0, description="Global seed for data order, anchor sampling and initialisation.")
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

