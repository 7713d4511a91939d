# Rules of stage 'data': thin shell lines calling python -m dflash data; each appends its outputs to ALL_TARGETS.
