"""dflash: train DFlash speculative-decoding drafters and keep their throughput honest."""
__version__ = "0.1.0"
