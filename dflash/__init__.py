"""dflash: train DFlash speculative-decoding drafters and keep their throughput honest."""
__version__ = "0.1.0"

import time as _time

PROCESS_START = _time.time()  # for "seconds from start to the first training step"
