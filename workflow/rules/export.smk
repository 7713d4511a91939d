# Rules of stage 'export': thin shell lines calling python -m dflash export; each appends its outputs to ALL_TARGETS.
