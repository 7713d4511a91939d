"""The code target (`target.build: code`): its corpus and split, the pre-training loop's time cap, the build and its
held-out perplexity, the `code` completion source, and config/quality.yaml run through target + data on the CPU."""
import json
import math
import subprocess
import sys

import pytest
import torch

from support.data import TINY_ARCH
from dflash import config as C
from dflash.data import code_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = {**TINY_ARCH, "vocab_size": 512}
SMALL = {"corpus_mb": 1, "heldout_fraction": 0.3, "chat_fraction": 0.1, "tokenizer_mb": 1, "num_proc": 1,
         "steps": 12, "batch_size": 4, "seq_len": 64, "lr": 0.01, "eval_windows": 6, "device": "cpu"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from dflash.data.code_target import build_code_target
    path = tmp_path_factory.mktemp("code") / "code"
    cfg = C.from_dict({"target": {"path": str(path), "build": "code", "arch": ARCH, "pretrain": SMALL}}).cfg
    info = build_code_target(cfg.target, path, progress=False, threads=1)
    return cfg, path, info


def test_corpus_order_cap_and_split(repo):
    cap = 1 << 20
    listed = code_corpus.list_files(cap)
    assert listed[0][0] == "stdlib" and sum(size for *_, size in listed) <= cap
    rels = [rel for _, _, rel, _ in listed]
    assert rels == sorted(rels)                                   # one root here: stdlib, in path order
    assert not any(r.split("/")[0] in code_corpus.SKIP_IN_STDLIB for r in rels)
    files, _ = code_corpus.read_files(cap)
    train, held = code_corpus.split(files, 0.3)
    assert train and held and len(train) + len(held) == len(files)
    assert {f.name for f in train}.isdisjoint(f.name for f in held)
    assert all(code_corpus.is_heldout(f.rel, 0.3) for f in held) and not any(code_corpus.is_heldout(f.rel, 0.3)
                                                                              for f in train)
    # a larger held-out share only adds files
    assert {f.name for f in held} <= {f.name for f in code_corpus.split(files, 0.6)[1]}
    # the rule is a hash of the path relative to its root, pinned: a change would move files across the split
    paths = ["json/decoder.py", "os.py", "torch/nn/modules/linear.py", "numpy/linalg/_linalg.py", "a/b.py",
             "collections/__init__.py", "typing.py", "transformers/modeling_utils.py"]
    assert [p for p in paths if code_corpus.is_heldout(p, 0.5)] == ["json/decoder.py", "torch/nn/modules/linear.py",
                                                                     "collections/__init__.py"]
    # another process, another hash seed: the same held-out files
    code = ("from dflash.data import code_corpus as c; f, _ = c.read_files(1 << 20); "
            "print([x.name for x in c.split(f, 0.3)[1]])")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "7", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)})
    assert out.stdout.strip() == str([f.name for f in held])


SOURCE = '''import os


def short(x):
    return x


@decorator
def documented(a, b=2):
    """Add things.

    More words.
    """
    total = a + b
    if total > 3:
        total -= 1
    return total


class K:
    def method(self, n):
        out = []
        for i in range(n):
            out.append(i)
            out.append(-i)
        return out

    def outer(self):
        def inner():
            return 1
        x = inner()
        y = x + 1
        return y
'''


def test_file_completions_cut_after_docstring_or_first_statement():
    f = code_corpus.CodeFile("stdlib", "pkg/mod.py", SOURCE, "0")
    convs = {c["id"]: c for c in code_corpus.file_completions(f)}
    assert sorted(convs) == ["code-stdlib/pkg/mod.py:K.method:21", "code-stdlib/pkg/mod.py:K.outer:28",
                             "code-stdlib/pkg/mod.py:documented:9"]     # `short` too short, `inner` nested
    doc = convs["code-stdlib/pkg/mod.py:documented:9"]
    assert doc["file"] == "stdlib/pkg/mod.py"
    assert doc["messages"] == [
        {"role": "user", "content": 'Complete this Python function:\n```python\n@decorator\ndef documented(a, b=2):\n'
                                    '    """Add things.\n\n    More words.\n    """\n```'},
        {"role": "assistant", "content": "```python\n    total = a + b\n    if total > 3:\n        total -= 1\n"
                                         "    return total\n```"}]
    method = convs["code-stdlib/pkg/mod.py:K.method:21"]["messages"]       # dedented; no docstring: + first statement
    assert method[0]["content"].endswith("```python\ndef method(self, n):\n    out = []\n```")
    assert method[1]["content"].startswith("```python\n    for i in range(n):\n")
    outer = convs["code-stdlib/pkg/mod.py:K.outer:28"]["messages"]
    assert outer[0]["content"].endswith("def outer(self):\n    def inner():\n        return 1\n```")
    assert code_corpus.file_completions(code_corpus.CodeFile("stdlib", "bad.py", "def f(:\n", "1")) == []


def test_lr_schedule_and_time_cap():
    from transformers import AutoModelForCausalLM

    from dflash.data.pretrain import lr_at, pretrain
    from dflash.data.tiny_target import qwen3_config, train_tokenizer
    assert [round(lr_at(p, 100, 1.0), 4) for p in (0, 9, 10, 55, 100, 150)] == [0.1, 1.0, 1.0, 0.55, 0.1, 0.1]
    assert lr_at(4.5, 100, 1.0) == pytest.approx(0.55)            # a time position between steps
    tok = train_tokenizer(["def f(x):\n    return x\n"] * 4, 300)
    torch.manual_seed(0)
    arch = C.from_dict({"target": {"arch": TINY_ARCH}}).cfg.target.arch
    model = AutoModelForCausalLM.from_config(qwen3_config(arch, tok))
    tokens = list(range(200)) * 3
    capped = pretrain(model, tokens, 50, 2, 16, 0.01, progress=False, max_seconds=1e-6)
    assert capped["steps"] == 1 and capped["stopped_by"] == "time" and capped["tokens_seen"] == 32
    full = pretrain(model, tokens, 3, 2, 16, 0.01, progress=False, max_seconds=3600)
    assert full["steps"] == 3 and full["stopped_by"] == "steps" and len(full["losses"]) == 3


def test_code_target_loads_like_a_users_model_and_records_heldout_perplexity(built):
    from transformers import AutoModelForCausalLM

    from dflash.data.code_target import encode
    from dflash.data.pretrain import mean_nll
    from dflash.data.tiny_target import CHAT_TEMPLATE
    from dflash.target import load_target, load_tokenizer, mask_token_id
    cfg, path, info = built
    model, tok = load_target(cfg.target), load_tokenizer(cfg.target)
    assert type(model).__name__ == "Qwen3ForCausalLM" and any(path.glob("*.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(str(path))
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), n
    assert tok.chat_template == CHAT_TEMPLATE and mask_token_id(tok) == tok.convert_tokens_to_ids("<|mask|>")
    assert info == json.loads((path / "build.json").read_text())
    c = info["corpus"]
    files, _ = code_corpus.read_files(code_corpus.cap_bytes(cfg.target.pretrain))
    train, held = code_corpus.split(files, cfg.target.pretrain.heldout_fraction)
    assert (c["files"], c["pretrain_files"], c["heldout_files"]) == (len(files), len(train), len(held))
    assert c["hash"] == code_corpus.files_hash(files) and c["chat_conversations"] > 0
    assert info["pretrain"]["steps"] == 12 and info["pretrain"]["loss_end"] < info["pretrain"]["loss_start"]
    assert info["params"] == sum(p.numel() for p in model.parameters())
    h = info["heldout"]
    assert math.isfinite(h["nll"]) and h["perplexity"] == pytest.approx(math.exp(h["nll"]), rel=1e-3)
    # the recorded figure is the held-out files' NLL: recomputed from the saved model and the held-out files
    again = mean_nll(model, encode(tok, [f.text for f in held]), cfg.target.pretrain.seq_len,
                     cfg.target.pretrain.eval_windows, cfg.target.pretrain.batch_size)
    assert again == h and again["tokens"] == 6 * 64
    assert c["tokens"]["heldout"] == encode(tok, [f.text for f in held]).size


def test_a_second_build_is_the_same_target_bit_for_bit(built, tmp_path):
    """What a build depends on besides the GPU's kernels is fixed (issue 39: quality figures compared across builds):
    the corpus and its split, the BPE tokenizer, the initialisation, the windows of each step (a fixed step count, no
    time cap): a second build on the CPU gives the same tokenizer, weights, losses and held-out perplexity."""
    from safetensors.torch import load_file

    from dflash.data.code_target import build_code_target
    cfg, path, info = built
    again = build_code_target(cfg.target.model_copy(update={"path": str(tmp_path / "code")}), tmp_path / "code",
                              progress=False, threads=1)
    assert (tmp_path / "code" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "code" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again["heldout"] == info["heldout"] and again["pretrain"]["loss_curve"] == info["pretrain"]["loss_curve"]
    assert again["corpus"]["hash"] == info["corpus"]["hash"]


def test_code_source_uses_heldout_files_only_and_is_deterministic(built):
    cfg = built[0]
    pre = cfg.target.pretrain
    cc = cfg.data.code_completion.model_copy(update={"max_conversations": 30})
    assert (cc.files, cc.per_file) == ("heldout", code_corpus.MAX_PER_FILE)
    convs = code_corpus.completion_source(pre, cc)
    files, _ = code_corpus.read_files(code_corpus.cap_bytes(pre))
    train, held = code_corpus.split(files, pre.heldout_fraction)
    assert 0 < len(convs) <= 30 and convs == code_corpus.completion_source(pre, cc)
    assert {c["file"] for c in convs} <= {f.name for f in held} and all(c["heldout"] for c in convs)
    assert not {c["file"] for c in convs} & {f.name for f in train}
    for c in convs:
        assert c["id"].startswith(f"code-{c['file']}:")
        assert [m["role"] for m in c["messages"]] == ["user", "assistant"]
        assert c["messages"][0]["content"].startswith("Complete this Python function:\n```python\n")
    per_file = {}
    for c in convs:
        per_file[c["file"]] = per_file.get(c["file"], 0) + 1
    assert max(per_file.values()) <= code_corpus.MAX_PER_FILE


def test_parsing_workers_give_the_same_conversations(monkeypatch):
    import multiprocessing
    files, _ = code_corpus.read_files(3 << 20)
    one = code_corpus.conversations(files, max_count=200)
    pools, real = [], multiprocessing.get_context

    def context(method):
        pools.append(method)
        return real(method)
    monkeypatch.setattr(code_corpus.multiprocessing, "get_context", context)
    assert len(one) == 200 and code_corpus.conversations(files, max_count=200, processes=2) == one
    assert pools == ["spawn"]                                        # the workers did the parsing


EARLY_STOP = """
import hashlib, json, sys
from dflash.data import code_corpus
lines = [[f"def f{j}(x):", f"    y = x + {j}", "    y = y * 2", "    y = y - 3", "    y = y ** 2", "    return y - 1",
          ""] for j in range(120)]
body = chr(10).join(sum(lines, []))
files = [code_corpus.CodeFile("stdlib", f"m{i}.py", f"# {i}" + chr(10) + body,
                              hashlib.sha256(str(i).encode()).hexdigest()) for i in range(400)]
got = code_corpus.conversations(files, max_count=300, processes=int(sys.argv[1]))
print(json.dumps([c["id"] for c in got]))
"""


def test_parsing_workers_end_when_the_reader_stops_early(repo):
    """The reader stops after 300 conversations while 8 workers still send large results: a multiprocessing.Pool
    ended there hung in terminate() (3 of 8 tries on this 2-core machine, 2 of 2 with the code config on the H200's
    16 cores); every try must end, with the serial answer."""
    import json
    import subprocess
    import sys

    def ids(processes):
        out = subprocess.run([sys.executable, "-c", EARLY_STOP, str(processes)], cwd=repo, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    serial = ids(1)
    assert len(json.loads(serial)) == 300
    for _ in range(4):
        assert ids(8) == serial


def test_quality_config_runs_target_and_data_on_cpu(repo, tmp_path):
    from dflash.cli import main
    from dflash.data import shards
    path = repo / "config" / "quality.yaml"
    cfg = C.load(path).cfg
    assert (cfg.target.build, cfg.drafter.num_layers, cfg.drafter.block_size) == ("code", 5, 16)
    assert cfg.data.code_completion.enabled and not cfg.data.builtin_corpus.enabled and cfg.data.regenerate.enabled
    assert cfg.drafter.target_layer_ids is None and max(cfg.data.bucket_edges) == cfg.data.max_length
    assert cfg.train.time_budget_s == 120 and cfg.train.targets == cfg.train.drafters == ("cuda:0",)
    small = {"results_dir": str(tmp_path / "results"), "target.path": str(tmp_path / "results" / "target" / "code"),
             "target.arch": ARCH, "target.pretrain": SMALL, "data.code_completion.max_conversations": 24,
             "data.holdout": 4, "data.num_proc": 1, "data.min_supervised_blocks": 1,
             "data.regenerate.device": "cpu", "data.regenerate.max_new_tokens": 24}
    args = ["--config", str(path), "--no-progress"]
    args += [a for k, v in small.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    assert main(["target"] + args) == 0
    assert main(["data"] + args) == 0
    out = tmp_path / "results" / "data" / "code-completion"
    m = shards.read_manifest(out)
    assert list(m["sources"]) == ["code"] and m["sources"]["code"]["kept"] > 0 and m["regeneration"]["tokens"] > 0
    files, _ = code_corpus.read_files(code_corpus.cap_bytes(C.from_dict(
        {"target": {"pretrain": SMALL}}).cfg.target.pretrain))
    held = {f.name for f in code_corpus.split(files, SMALL["heldout_fraction"])[1]}
    prompts = shards.read_holdout(out)
    assert len(prompts) == 4 and all(p["id"].split(":")[0].removeprefix("code-") in held for p in prompts)


@pytest.mark.gpu
def test_code_target_on_gpu_compiled_under_a_time_cap(tmp_path):
    from dflash.data.code_target import build_code_target
    from dflash.target import load_target
    arch = {**ARCH, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 256, "vocab_size": 2048}
    pre = {**SMALL, "corpus_mb": 4, "tokenizer_mb": 2, "device": "cuda", "compile": True, "steps": 100000,
           "max_seconds": 5, "batch_size": 16, "seq_len": 256, "lr": 0.003, "eval_windows": 16, "num_proc": 0}
    cfg = C.from_dict({"target": {"path": str(tmp_path / "code"), "build": "code", "arch": arch,
                                  "pretrain": pre}}).cfg
    info = build_code_target(cfg.target, tmp_path / "code", progress=False)
    p = info["pretrain"]
    assert p["device"].startswith("cuda") and p["gpu"] and p["stopped_by"] == "time" and p["steps"] > 20
    assert 5 <= p["seconds"] - p["first_step_seconds"] < 8 and p["tokens_per_s"] > 0
    assert p["loss_end"] < p["loss_start"] - 1.0 and math.isfinite(info["heldout"]["nll"])
    model = load_target(cfg.target, device="cuda")
    assert next(model.parameters()).dtype == torch.bfloat16 and type(model).__name__ == "Qwen3ForCausalLM"
