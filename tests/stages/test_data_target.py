"""The built-in corpus, the tiny target build and target loading."""
import json
import subprocess
import sys

import pytest
import torch

from support.data import TINY_ARCH, make_loaded, target_section
from dflash import config as C
from dflash.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_corpus_is_deterministic_and_in_openai_form(repo):
    from dflash.data import corpus
    a = corpus.conversations(60)
    assert a == corpus.conversations(60) and len(a) == 60
    for c in a:
        roles = [m["role"] for m in c["messages"]]
        assert roles[-1] == "assistant" and "user" in roles
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in c["messages"])
    # another process with another hash seed makes the same corpus
    code = "from dflash.data import corpus; print(corpus.corpus_hash(corpus.conversations(60)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == corpus.corpus_hash(a)


def test_tiny_target_loads_through_from_pretrained(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.target import load_target, load_tokenizer, mask_token_id, stop_token_ids
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == TINY_ARCH["num_hidden_layers"]
    assert any(tiny_target.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"):
        assert t in tok.get_vocab()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    cfg = make_loaded("/tmp", tiny_target).cfg.target
    m = load_target(cfg)
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert next(m.parameters()).dtype == torch.float32           # auto on CPU
    t = load_tokenizer(cfg)
    assert mask_token_id(t) == t.convert_tokens_to_ids("<|mask|>")
    assert t.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(t, m)
    build = json.loads((tiny_target / "build.json").read_text())
    assert build["pretrain"]["loss_end"] < build["pretrain"]["loss_start"]
    # same weights as from_pretrained
    for (n, a), (_, b) in zip(model.named_parameters(), m.named_parameters()):
        assert torch.equal(a, b), n


def test_random_target_builds_from_config(tmp_path):
    from dflash.data.tiny_target import build_target
    from dflash.target import has_weights, load_target, load_tokenizer
    path = tmp_path / "rand"
    cfg = C.from_dict({"target": {**target_section(path, "random"), "dtype": "float32"}}).cfg.target
    build_target(cfg, path, corpus_size=100, progress=False)
    assert (path / "config.json").is_file() and not has_weights(path)
    a, b = load_target(cfg, seed=3), load_target(cfg, seed=3)
    c = load_target(cfg, seed=4)
    wa = a.model.embed_tokens.weight
    assert torch.equal(wa, b.model.embed_tokens.weight) and not torch.equal(wa, c.model.embed_tokens.weight)
    assert a.config.vocab_size == TINY_ARCH["vocab_size"] >= len(load_tokenizer(cfg))
    assert not any(p.requires_grad for p in a.parameters())
    # the same folder with build tiny has no weights to load: a clear error naming it
    tiny_cfg = C.from_dict({"target": target_section(path, "tiny")}).cfg.target
    with pytest.raises(UserError, match=f"{path}.*no weight files"):
        load_target(tiny_cfg)


def test_missing_or_invalid_target_named(tmp_path):
    from dflash.target import load_target, load_tokenizer
    cfg = C.from_dict({"target": {"path": str(tmp_path / "nope"), "build": "none"}}).cfg.target
    with pytest.raises(UserError, match=r"nope: no such directory"):
        load_target(cfg)
    (tmp_path / "empty").mkdir()
    cfg = C.from_dict({"target": {"path": str(tmp_path / "empty"), "build": "none"}}).cfg.target
    with pytest.raises(UserError, match=r"empty: not a transformers model folder"):
        load_tokenizer(cfg)


def tokenizer_error(tmp_path, tiny_target, damage) -> str:
    import shutil

    from dflash.target import load_tokenizer
    path = tmp_path / "model"
    shutil.copytree(tiny_target, path)
    damage(path)
    with pytest.raises(UserError) as e:
        load_tokenizer(C.from_dict({"target": {"path": str(path), "build": "none"}}).cfg.target)
    return str(e.value)


def test_missing_tokenizer_file_is_named(tmp_path, tiny_target):
    """The message was cut after "Couldn't instantiate the backend tokenizer from one of:" and named no file."""
    msg = tokenizer_error(tmp_path, tiny_target, lambda p: (p / "tokenizer.json").unlink())
    assert f"{tmp_path / 'model' / 'tokenizer.json'} is missing" in msg and "copy the model's tokenizer files" in msg


def test_damaged_tokenizer_file_is_named(tmp_path, tiny_target):
    """Rule 6 beyond the table: a cut tokenizer.json gave a bare JSON error; the file and the remedy are named."""
    def cut(p):
        f = p / "tokenizer.json"
        f.write_text(f.read_text()[:200])
    msg = tokenizer_error(tmp_path, tiny_target, cut)
    assert f"{tmp_path / 'model' / 'tokenizer.json'} is not a tokenizer file" in msg and "copy it again" in msg


def test_target_stage_never_replaces_a_folder_it_did_not_build(tmp_path, tiny_target):
    """Rule 1 beyond the table: `python -m dflash target --out DIR` (or a data part, `data --shard I/N --out DIR`) by
    hand over a model folder is refused and leaves it as it was (it was replaced: a stage never deletes what it did
    not make; its record, build.json or part.json, is not there)."""
    import shutil

    import yaml

    from dflash.cli import main
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"results_dir": str(tmp_path), "target": target_section(tmp_path / "t", "random"),
                                 "data": {"builtin_corpus": {"max_conversations": 100}}}))
    mine = tmp_path / "mine"
    shutil.copytree(tiny_target, mine)
    (mine / "build.json").unlink()
    before = {f.name: f.read_bytes() for f in mine.iterdir()}
    assert main(["target", "--config", str(p), "--out", str(mine), "--no-progress"]) == 1
    assert {f.name: f.read_bytes() for f in mine.iterdir()} == before
    assert main(["data", "--config", str(p), "--shard", "0/1", "--out", str(mine), "--no-progress"]) == 1   # part
    assert {f.name: f.read_bytes() for f in mine.iterdir()} == before


def test_target_stage_cli_random(tmp_path, repo):
    import yaml
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"results_dir": str(tmp_path), "target": target_section(tmp_path / "t", "random"),
                                 "data": {"builtin_corpus": {"max_conversations": 100}}}))
    from dflash.cli import main
    assert main(["target", "--config", str(p), "--no-progress"]) == 0
    assert (tmp_path / "t" / "config.json").is_file() and (tmp_path / "t" / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".t.*"))            # no temporary folder left behind
    # a target path outside the declared folders is refused
    p.write_text(yaml.safe_dump({"results_dir": str(tmp_path / "r"), "target": target_section("/tmp/elsewhere-x", "random")}))
    assert main(["target", "--config", str(p)]) == 2


def test_a_rebuild_that_wrote_the_same_bytes_is_the_same_target(tmp_path, tiny_target):
    """Issue 47: a target is its weights, config and tokenizer, never its build's timing. A rebuild that wrote the same
    bytes (new mtimes, a build.json with other seconds) keeps the regeneration cache (its key named the weights by
    mtime: every response regenerated) and passes the check of what a run trained on (build.json's timing was part of
    it: evaluate refused the rebuild); a byte of the weights changed is seen by both."""
    import os
    import shutil

    from dflash.data.regen import cache_key
    from dflash.target import BUILD, target_problem, target_record, write_build
    rebuilt = shutil.copytree(tiny_target, tmp_path / "rebuilt")
    for f in rebuilt.iterdir():
        os.utime(f, (f.stat().st_atime + 10, f.stat().st_mtime + 10))   # written later
    info = json.loads((rebuilt / BUILD).read_text())
    write_build(rebuilt, {**info, "seconds": info["seconds"] + 1.5})
    key = lambda path: cache_key(make_loaded(tmp_path, path, regenerate={"enabled": True}).cfg)  # noqa: E731
    trained_on = target_record(tiny_target)
    assert key(rebuilt) == key(tiny_target)
    assert target_problem(rebuilt, trained_on) is None
    weights = rebuilt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert key(rebuilt) != key(tiny_target)
    assert "model.safetensors: its content differs" in target_problem(rebuilt, trained_on)
