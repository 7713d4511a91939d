"""The real writers of the files that cross a stage, run on tiny inputs: what they leave on disk validates against
the file's model (strict, no key the model does not describe), and the readers read it back through their views."""
import json
import re

import pytest
from pydantic import ValidationError

from support.data import good_rows, sharegpt, write_jsonl
from support.train import prepared
from dflash.data import shards
from dflash.data.expand import expand
from dflash.records.manifest import Manifest, ManifestCore

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_data_stage_writes_exactly_the_manifest_model(tmp_path, data_cfg):
    src = write_jsonl(tmp_path / "sg.jsonl", good_rows(6, sharegpt, "s") + [{"conversations": []}])
    loaded = data_cfg([{"name": "sg", "path": src, "weight": 2}], holdout=1, max_length=64, bucket_edges=[32, 64])
    returned = expand(loaded, tmp_path / "out", progress=False)
    on_disk = json.loads((tmp_path / "out" / shards.MANIFEST).read_text())
    assert on_disk == returned
    m = Manifest.model_validate(on_disk)
    assert set(on_disk) == set(Manifest.model_fields)         # the gather writes every key the model holds
    assert m.sources["sg"].holdout == 1 and m.sources["sg"].weight == 2.0 and m.sources["sg"].rejected
    assert m.num_samples == sum(m.buckets.values()) == m.sources["sg"].samples
    assert m.regeneration.enabled is False and m.tokenizer.mask_token_id >= 0
    assert ManifestCore.model_validate(shards.read_manifest(tmp_path / "out")).content_hash == m.content_hash


def test_the_warmup_stage_writes_exactly_the_compile_record_model(tmp_path, monkeypatch):
    """`python -m dflash warmup` on the CPU (an eager drafter: nothing compiled, every bucket still run): its record
    is exactly dflash/records/compile.py's; a part with a key the model does not describe is refused unwritten."""
    from dflash.cli import main
    from dflash.records.compile import CompileRecord
    from dflash.train import warmup

    cfg = prepared(tmp_path, drafters=["cpu"])
    out = tmp_path / "results" / "compile" / "cpu.json"
    assert main(["warmup", "--config", str(cfg), "--device", "cpu"]) == 0
    on_disk = json.loads(out.read_text())
    rec = CompileRecord.model_validate(on_disk)
    assert set(on_disk) == set(CompileRecord.model_fields)
    part = rec.per_role[0]
    assert len(rec.per_role) == 1
    assert (part.role, part.backend, part.compiled, part.modules) == ("drafter", "sdpa", False, None)
    buckets = shards.read_manifest(next((tmp_path / "results" / "data").iterdir()))["buckets"]
    assert [(s.batch, s.length) for s in part.shapes] == [(2, int(e)) for e, n in buckets.items() if n >= 2]
    assert rec.device == part.device == "cpu" and rec.graphs == part.graphs == 0        # eager: no graph compiled
    assert rec.cache_dir == str(tmp_path / "results" / "compile" / f"cache-{rec.env_hash}")
    drafter = warmup._drafter
    monkeypatch.setattr(warmup, "_drafter", lambda ctx, device: {**drafter(ctx, device), "surprise": 1})
    out.unlink()
    with pytest.raises(ValidationError, match=re.escape("per_role.0.surprise")):
        main(["warmup", "--config", str(cfg), "--device", "cpu"])
    assert not out.exists()
