# Rules of stage 'train': thin shell lines calling python -m dflash train; each appends its outputs to ALL_TARGETS.
