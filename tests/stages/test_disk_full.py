"""A full disk while a stage writes its outputs (simulated: the write raises ENOSPC, as it does on a full disk): one
line naming the path and the remedy, no traceback, nothing half-written; the rerun after freeing space is exact."""
import errno
import json
import tempfile

import pytest
import yaml

from support.data import small_data_config
from dflash.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
ENOSPC = OSError(errno.ENOSPC, "No space left on device")   # what write() raises: no file name


def only_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    return lines[0]


def no_space_in_save_to_disk(*a, **k):
    from datasets.exceptions import DatasetGenerationError
    try:
        raise ENOSPC
    except OSError as e:   # datasets wraps the OSError of its writer
        raise DatasetGenerationError("An error occurred while generating the dataset") from e


@pytest.mark.parametrize("where", ["manifest", "shards"])
def test_full_disk_during_data_is_one_line_and_the_rerun_is_exact(tmp_path, tiny_target, monkeypatch,  # noqa: F811
                                                                   capsys, where):
    """It was a raw `OSError: [Errno 28]` with no path, or a `DatasetGenerationError`."""
    from datasets import Dataset

    from dflash.data.shards import verify_dataset
    cfg = small_data_config(tmp_path, tiny_target)
    out = tmp_path / "results" / "data" / "default"
    with monkeypatch.context() as m:
        if where == "manifest":
            m.setattr(tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(ENOSPC))
        else:
            m.setattr(Dataset, "save_to_disk", no_space_in_save_to_disk)
        assert main(["data", "--config", str(cfg), "--no-progress", "--out", str(out)]) == 1
    line = only_line(capsys)
    assert line.startswith(f"dflash data: error: no space left on device while writing {out} (")
    assert "free space on that disk" in line and "rerun" in line
    assert not out.exists() and not list(out.parent.glob(".default.*"))     # nothing half-written, no temp folder
    assert main(["data", "--config", str(cfg), "--no-progress", "--out", str(out)]) == 0
    assert verify_dataset(out)["num_samples"] == json.loads((out / "manifest.json").read_text())["num_samples"] > 0


def test_full_disk_during_report_is_one_line(tmp_path, monkeypatch, capsys):
    """It was a raw traceback."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"results_dir": str(tmp_path / "results")}))
    out = tmp_path / "results" / "report"
    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(ENOSPC))
        assert main(["report", "--config", str(cfg), "--out", str(out)]) == 1
    line = only_line(capsys)
    assert line.startswith(f"dflash report: error: no space left on device while writing {out} (")
    assert main(["report", "--config", str(cfg), "--out", str(out)]) == 0
    assert (out / "report.md").is_file()
