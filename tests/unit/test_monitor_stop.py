"""Stop requests: InternLM's stop file (N<0 save only, N>0 save and stop) and SIGTERM / SIGUSR1."""

import os
import signal
import time

import pytest

from internlm_core.monitor.stop import StopController, StopDecision, build_stop_controller


@pytest.fixture
def controller(tmp_path):
    made = []

    def make(**kw):
        c = StopController(tmp_path / "ctl" / "stop_file", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_file_reset_to_zero_at_start(tmp_path, controller):
    path = tmp_path / "ctl" / "stop_file"
    path.parent.mkdir()
    path.write_text("25")  # left over from an earlier run
    c = controller()
    assert path.read_text() == "0"
    assert [c.poll(s) for s in range(1, 30)] == [StopDecision()] * 29


def test_negative_saves_only_at_that_step(controller):
    c = controller()
    c.stop_file_path.write_text("-3")
    decisions = [c.poll(s) for s in range(1, 6)]
    assert decisions[2] == StopDecision(save=True, stop=False, reason=f"stop file {c.stop_file_path}: -3")
    assert decisions[:2] + decisions[3:] == [StopDecision()] * 4


def test_positive_saves_and_stops_at_that_step(controller):
    c = controller()
    assert c.poll(1) == StopDecision()
    c.stop_file_path.write_text("4\n")
    assert [c.poll(s).stop for s in (2, 3)] == [False, False]
    assert c.poll(4) == StopDecision(save=True, stop=True, reason=f"stop file {c.stop_file_path}: 4")


def test_rewritten_request_is_seen_and_passed_step_ignored(controller, caplog):
    c = controller()
    c.stop_file_path.write_text("-2")
    assert c.poll(2).save
    c.stop_file_path.write_text("-5")  # same size, possibly the same mtime tick
    assert c.poll(3) == StopDecision()
    assert c.poll(5).save
    c.stop_file_path.write_text("1")
    with caplog.at_level("WARNING", logger="internlm_core"):
        assert c.poll(6) == StopDecision()
    assert "asks to save and stop at step 1, which has passed (now step 6); ignored" in caplog.text


def test_garbage_and_missing_file(controller, caplog):
    c = controller()
    c.stop_file_path.write_text("soon please")
    with caplog.at_level("WARNING", logger="internlm_core"):
        assert c.poll(1) == StopDecision()
    assert "expected an integer, got 'soon please'" in caplog.text
    c.stop_file_path.unlink()
    assert c.poll(2) == StopDecision()


def test_only_rank0_reads_the_file(controller):
    c = controller(rank=1, reset_file=False)
    c.stop_file_path.parent.mkdir(parents=True, exist_ok=True)
    c.stop_file_path.write_text("2")
    assert c.poll(2) == StopDecision()  # without a process group a rank > 0 never sees the file


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_and_next_poll_saves_and_stops(controller, sig):
    previous = signal.getsignal(sig)
    c = controller()
    assert c.poll(1) == StopDecision()
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while c.signal_received is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.signal_received == sig
    name = signal.Signals(sig).name
    assert c.poll(2) == StopDecision(save=True, stop=True, reason=f"{name} received")
    c.close()
    assert signal.getsignal(sig) == previous


def test_no_stop_file_signals_only():
    c = build_stop_controller(type("Ckpt", (), {"stop_file_path": None})(), rank=0)
    try:
        assert c.stop_file_path is None
        assert c.poll(10) == StopDecision()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert c.poll(11).stop
    finally:
        c.close()


def test_the_loops_poll_sequence_and_observer_requests(controller):
    """What the trainer's loop gets at each step (poll, then the observers' requests merged): a save-only request
    lasts one step; a signal saves and stops; close restores the handlers."""
    from internlm_core.callbacks import StepRequests

    previous = signal.getsignal(signal.SIGTERM)
    c = controller()
    assert signal.getsignal(signal.SIGTERM) != previous
    requests = StepRequests()
    c.stop_file_path.write_text("-2")
    assert c.poll(1).asked(*requests.take()) == StopDecision()
    assert c.poll(2).asked(*requests.take()) == StopDecision(stop=False, save=True,
                                                            reason=f"stop file {c.stop_file_path}: -2")
    d = c.poll(3).asked(*requests.take())  # a save-only request lasts one step
    assert (d.save, d.stop) == (False, False)
    requests.ask_save("a driver wants this step")  # an observer's request: a save of this step, once
    assert c.poll(4).asked(*requests.take()) == StopDecision(save=True, reason="a driver wants this step")
    assert c.poll(5).asked(*requests.take()) == StopDecision()
    os.kill(os.getpid(), signal.SIGTERM)
    assert c.poll(6).asked(*requests.take()) == StopDecision(stop=True, save=True, reason="SIGTERM received")
    c.close()
    assert signal.getsignal(signal.SIGTERM) == previous
