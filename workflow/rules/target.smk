# Rules of stage 'target': thin shell lines calling python -m dflash target; each appends its outputs to ALL_TARGETS.
