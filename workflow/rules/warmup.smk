# Rules of stage 'warmup': thin shell lines calling python -m dflash warmup; each appends its outputs to ALL_TARGETS.
