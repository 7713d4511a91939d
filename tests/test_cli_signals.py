"""`kill -USR2 <pid>` of a running stage writes every thread's stack into its --log file and the stage runs on."""
import logging
import os
import signal

import pytest

from dflash import cli


@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2 on this platform")
def test_usr2_writes_every_threads_stack_into_the_log_and_the_stage_runs_on(tmp_path):
    import faulthandler
    log = tmp_path / "stage.log"
    handler = logging.FileHandler(log)
    try:
        cli._stack_dumps(handler)
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        faulthandler.unregister(signal.SIGUSR2)
        handler.close()
    text = log.read_text()
    assert "most recent call first" in text and __file__ in text
    assert "test_usr2_writes_every_threads_stack_into_the_log_and_the_stage_runs_on" in text


@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2 on this platform")
def test_usr2_without_a_log_file_goes_to_stderr(capfd):
    import faulthandler
    try:
        cli._stack_dumps(None)
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        faulthandler.unregister(signal.SIGUSR2)
    assert "test_usr2_without_a_log_file_goes_to_stderr" in capfd.readouterr().err
