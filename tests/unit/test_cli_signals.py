"""`kill -USR2 <pid>` of a running stage writes every thread's stack into its --log file and the stage runs on."""
import faulthandler
import logging
import os
import signal

import pytest

from dflash import cli

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2 on this platform")


def test_usr2_writes_every_threads_stack_into_the_log_and_the_stage_runs_on(tmp_path):
    log = tmp_path / "stage.log"
    handler = logging.FileHandler(log)
    try:
        assert cli._stack_dumps(handler)
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        faulthandler.unregister(signal.SIGUSR2)
        handler.close()
    text = log.read_text()
    assert "most recent call first" in text and __file__ in text
    assert "test_usr2_writes_every_threads_stack_into_the_log_and_the_stage_runs_on" in text


def test_usr2_without_a_log_file_goes_to_the_process_stderr(capfd):
    try:
        assert cli._stack_dumps(None)
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        faulthandler.unregister(signal.SIGUSR2)
    assert "test_usr2_without_a_log_file_goes_to_the_process_stderr" in capfd.readouterr().err


def test_a_stage_run_in_process_leaves_no_handler_behind(tmp_path):
    """main() unregisters it when the stage ends (tests and notebooks call main many times), also when it fails."""
    assert cli.main(["env", "--config", str(tmp_path / "missing.yaml"), "--log", str(tmp_path / "env.log")]) == 2
    assert not faulthandler.unregister(signal.SIGUSR2)
