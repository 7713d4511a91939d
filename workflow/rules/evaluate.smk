# Rules of stage 'evaluate': thin shell lines calling python -m dflash evaluate; each appends its outputs to ALL_TARGETS.
