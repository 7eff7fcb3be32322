"""grpo_infra/signals.py, the signal handling of every command: the at-once stop and the held renames."""

from __future__ import annotations

import os
import signal

import pytest

from grpo_infra.signals import STOP, StopNow, exit_code, signal_name, signals_held, stops_at_once


def handlers():
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stops_at_once_raises_where_it_is_and_ignores_a_second_signal_while_cleaning_up(sig, code):
    before, cleaned = handlers(), []
    with pytest.raises(StopNow) as stop:
        with stops_at_once():
            try:
                os.kill(os.getpid(), sig)  # the handler runs at the next bytecode
                raise AssertionError("the signal did not stop the block")
            finally:
                os.kill(os.getpid(), sig)  # during the clean-up: ignored, the clean-up finishes
                cleaned.append(True)
    assert stop.value.signum == sig and exit_code(stop.value.signum) == code
    assert signal_name(stop.value.signum) == sig.name and cleaned == [True]
    assert handlers() == before and not STOP.requested


def test_a_signal_while_held_waits_for_the_end_of_the_block():
    done = []
    with pytest.raises(StopNow):
        with stops_at_once():
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("first rename")
                done.append("second rename")
    assert done == ["first rename", "second rename"]
