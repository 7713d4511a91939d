"""The real writers of the files that cross a stage, run on tiny inputs: what they leave on disk validates against
the file's model (strict, no key the model does not describe), and the readers read it back through their views."""
import json

import pytest

from support.data import good_rows, sharegpt, write_jsonl
from dflash.data import shards
from dflash.data.expand import expand
from dflash.data.manifest import Manifest, ManifestCore

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
