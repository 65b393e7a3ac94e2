"""The child-process helper: the handshake, a child's last word, how it ended, and a clean stop.

Every test spawns real processes (a fresh interpreter each, so a second or so apiece); the
targets live at module level because a spawned child imports them by name.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nanoserve.child_process import (
    ChildDied,
    ChildProcess,
    Ready,
    Stop,
    broadcast,
    receive_all,
    stop_all,
)

# A child's exit status is what these tests check, so it is given this long to exit before
# stop_all terminates it: a polite stop returns as soon as the child is gone, and on a busy
# machine a fresh interpreter may take longer than stop_all's default 5 s to wind down.
EXIT_GRACE_S = 60


def echo_until_stop(conn, info) -> None:
    conn.send(Ready(info))
    while not isinstance(message := conn.recv(), Stop):
        conn.send(("echo", message))


def raise_at_once(conn) -> None:
    raise ValueError("the model file is not there")


def sleep_through_everything(conn) -> None:
    time.sleep(600)


def start_a_grandchild(conn) -> None:
    grandchild = ChildProcess(sleep_through_everything, (), name="grandchild")
    conn.send(Ready(grandchild.process.pid))
    time.sleep(600)


def is_running(pid: int) -> bool:
    """True while pid runs (a zombie nobody has reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_says_ready_answers_and_exits_cleanly_when_asked_to_stop():
    child = ChildProcess(echo_until_stop, ("hello",), name="echo child")
    assert child.receive(Ready, timeout_s=60, doing="start").info == "hello"
    assert broadcast([child], [1] * 1000) > 1000
    assert child.receive(tuple, timeout_s=60) == ("echo", [1] * 1000)
    stop_all([child], timeout_s=EXIT_GRACE_S)
    assert child.process.exitcode == 0


def test_a_child_that_raises_leaves_its_traceback_as_its_last_word():
    child = ChildProcess(raise_at_once, (), name="worker 3")
    with pytest.raises(ChildDied, match=r"(?s)worker 3 failed:\n.*ValueError: the model file"):
        child.receive(Ready, timeout_s=60)
    stop_all([child], polite=False, timeout_s=EXIT_GRACE_S)
    assert child.process.exitcode == 1


def test_a_killed_child_is_described_by_its_signal_and_a_silent_one_by_its_timeout():
    child = ChildProcess(sleep_through_everything, (), name="worker 1")
    with pytest.raises(ChildDied, match="worker 1 did not start in 0 s"):
        child.receive(Ready, timeout_s=0.1, doing="start")
    os.kill(child.process.pid, signal.SIGKILL)
    with pytest.raises(ChildDied, match=r"worker 1 \(pid \d+\) was killed by signal 9"):
        child.receive(Ready, timeout_s=60)
    stop_all([child])


def test_waiting_on_several_children_notices_a_failure_while_another_is_still_silent():
    silent = ChildProcess(sleep_through_everything, (), name="worker 1")
    failing = ChildProcess(raise_at_once, (), name="worker 2")
    with pytest.raises(ChildDied, match="worker 2 failed"):
        receive_all([silent, failing], Ready, timeout_s=60)
    stop_all([silent, failing], timeout_s=0.2)  # the silent one ignores Stop: it is terminated
    assert silent.process.exitcode == -signal.SIGTERM


def test_a_child_exits_when_its_parent_is_killed():
    parent = ChildProcess(start_a_grandchild, (), name="parent", daemon=False)
    grandchild_pid = parent.receive(Ready, timeout_s=60).info
    os.kill(parent.process.pid, signal.SIGKILL)
    stop_all([parent])
    deadline = time.monotonic() + EXIT_GRACE_S  # its watch thread notices within moments
    while is_running(grandchild_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_running(grandchild_pid):
        os.kill(grandchild_pid, signal.SIGKILL)
        pytest.fail("the grandchild outlived its parent")


def test_a_ctrl_c_while_a_child_still_imports_does_not_reach_it():
    """A terminal's Ctrl-C goes to the whole group, also to a child still starting up."""
    child = ChildProcess(echo_until_stop, ("up",), name="the child")
    deadline = time.monotonic() + 0.5  # the fresh interpreter's imports: the window it had
    while time.monotonic() < deadline and child.process.is_alive():
        os.kill(child.process.pid, signal.SIGINT)
        time.sleep(0.01)
    assert child.receive(Ready, timeout_s=30).info == "up"
    os.kill(child.process.pid, signal.SIGINT)  # and once it runs
    child.send("still there?")
    assert child.receive(tuple, timeout_s=30) == ("echo", "still there?")
    stop_all([child], timeout_s=EXIT_GRACE_S)
    assert child.process.exitcode == 0


def test_a_killed_child_read_by_two_threads_at_once_is_described_as_killed_by_both(monkeypatch):
    """The moment a tensor-parallel worker is killed, the group's watcher and the failed step
    both read its exit status. Here the watcher's read reaps the child and pauses before it
    stores the status (as a thread may when it loses the GIL there): the step's read, meanwhile,
    must still see a killed child, not a running one (it once did, and a test got gloo's bare
    error instead of WorkerDied)."""
    child = ChildProcess(sleep_through_everything, (), name="worker 1")
    real_waitpid, reaped = os.waitpid, threading.Event()

    def waitpid_that_pauses_for_the_watcher(pid, options):
        result = real_waitpid(pid, options)
        if threading.current_thread().name == "watcher" and result[0] == pid:
            reaped.set()
            time.sleep(0.5)  # reaped, the status not stored yet
        return result

    monkeypatch.setattr(os, "waitpid", waitpid_that_pauses_for_the_watcher)
    os.kill(child.process.pid, signal.SIGKILL)
    assert child.has_ended(EXIT_GRACE_S)
    watcher = threading.Thread(target=child.exit_code, name="watcher")
    watcher.start()
    assert reaped.wait(EXIT_GRACE_S)
    story = child.failure(grace_s=5.0)
    watcher.join()
    assert story is not None and "worker 1" in story and "killed by signal 9" in story
    assert child.exit_code() == -signal.SIGKILL
    stop_all([child])  # nothing left to stop: it returns at once
