# Rules of stage 'report': thin shell lines calling python -m dflash report; each appends its outputs to ALL_TARGETS.
