"""docs/config-keys.md is generated from the typed config and current; every key of the models appears in it."""
from pathlib import Path

from dflash import config_docs
from dflash.config_model import DflashConfig

REPO = Path(__file__).resolve().parents[2]


def _keys(model, prefix=""):
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            yield from _keys(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_the_committed_reference_is_current():
    assert (REPO / config_docs.DOC).read_text() == config_docs.render(), \
        "docs/config-keys.md is stale: run `python -m dflash.config_docs --write`"


def test_every_key_has_a_row_with_its_default():
    text = config_docs.render()
    keys = list(_keys(DflashConfig))
    assert len(keys) > 100
    for key in keys:
        assert f"| `{key}` |" in text, key
    assert "| `train.lr` | number | `0.0006` |" in text and "(> 0; reruns" in text
