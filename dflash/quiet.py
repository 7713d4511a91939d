"""Library log lines known to be harmless, dropped once at the start of `python -m dflash` (dflash/__main__.py).

Each entry names the logger that emits the line, the line (a regular expression searched in its message) and why
it is harmless to dflash. Only these lines are dropped: anything else the same loggers say still shows, and so does
every warning of any other library and of dflash itself. On a pipe or a file (Snakemake's logs) the Hugging Face
libraries' progress bars ("Loading weights", "Writing model shards") are off too, as dflash's own are (dflash/cli.py).
"""
from __future__ import annotations

import logging
import os
import re
import sys

HARMLESS = (
    # torchao (imported by transformers whenever it is installed) tries its optional C++ kernels for MX formats and
    # CUTLASS sm90a, built for another Python or a GPU; dflash uses none of them (its FP8 goes through
    # torch._scaled_mm: dflash/model/fp8.py, KernelPreference.TORCH)
    ("torchao", r"^Failed to load \S*[/\\]torchao[/\\]_C\w*\.\S*so: Could not load this library"),
    ("torchao.kernel.intmm", r"^Warning: Detected no triton, on systems without Triton certain kernels will not work$"),
    # torchao registers two of its Enums as pytree constants, which torch >= 2.13 deprecates; nothing for us to do
    ("torch.utils._pytree", r"^<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass and is now "
                            r"natively supported by torch\.compile"),
)


class _Drop(logging.Filter):
    """Drops the records of its logger whose message matches the pattern."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def install() -> None:
    """Put the filters on the loggers that emit the lines (before the libraries are imported: a logger's filters
    stay when the library configures its handlers), and turn the Hugging Face progress bars off on a non-terminal."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # read by huggingface_hub as transformers loads
    for name, pattern in HARMLESS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
