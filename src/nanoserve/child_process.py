"""A child process on a short leash: spawned, one pipe, a handshake, and a story of how it ended.

Introduced in stage 09 for the tensor-parallel workers; stage 10's engine process and the client
processes of `bench --serve` use it too. It carries messages and tells how a child ended; what
the messages mean is each user's (a user may add words of its own). It imports no engine code.

    parent                                        child (spawned: a fresh interpreter)
    ChildProcess(target, args, name) ── start ──>  run_child: ignores Ctrl-C, exits with parent
      (spawned with SIGINT ignored: a Ctrl-C during its imports does not reach it either)
    receive(Ready)  <──────── Ready(info) ───────  target(conn, *args)
    send(message)   ───────── message ──────────>  conn.recv()
    receive() raises ChildDied <── Failed(traceback): the target raised; its last word
    stop_all([child]) ─────── Stop() ───────────>  the target returns; else terminate, then kill

Each message is pickled and framed by its length, so a message of any size goes through (no
fixed buffer) and the pipe has no name to clash with:

    [ length: 4 bytes, big-endian ][ pickle bytes ............................... ]
      (a message over 2 GiB: the 4 bytes say -1, and 8 more bytes hold the length)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import NamedTuple


class Ready(NamedTuple):
    """A child's handshake: it is set up and takes messages; `info` is what it reports."""

    info: object = None


class Failed(NamedTuple):
    """A child's last word: the traceback of what stopped it."""

    traceback: str


class Stop(NamedTuple):
    """The parent's polite request: finish up and exit cleanly."""


class ChildDied(RuntimeError):
    """A child failed, ended, said the wrong thing, or was silent too long; the message says so."""


class ChildProcess:
    """One spawned child and the parent's end of its pipe."""

    def __init__(self, target: Callable, args: tuple, name: str, daemon: bool = True) -> None:
        """Start `target(conn, *args)` in a child; `name` is how errors call it ("worker 1").
        A daemon is killed when the parent exits, but may not start children of its own."""
        context = mp.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        self.name = name
        self.conn, theirs = context.Pipe()
        self.process = context.Process(
            target=run_child, args=(target, theirs, args), name=name, daemon=daemon
        )
        with terminal_interrupts_ignored():
            self.process.start()
        theirs.close()  # ours is now the only handle: the child sees EOF when we go
        self._poll_lock = threading.Lock()  # see exit_code

    @property
    def sentinel(self) -> int:
        """A handle that `multiprocessing.connection.wait` sees ready once the child has ended."""
        return self.process.sentinel

    def send(self, message) -> None:
        """Send the child one message; OSError if its end is closed (it is gone)."""
        self.conn.send(message)

    def receive(self, kind: type = object, timeout_s: float | None = None, doing: str = "answer"):
        """The child's next message, which must be a `kind`; ChildDied if the child failed or
        ended first, said something else, or said nothing in timeout_s ("did not {doing}")."""
        try:
            if not wait([self.conn, self.sentinel], timeout_s):
                raise ChildDied(f"{self.name} did not {doing} in {timeout_s:.0f} s")
            if not self.conn.poll(0):  # it ended without a word (and nobody else holds its end)
                raise ChildDied(self.describe_end())
            message = self.conn.recv()
        except (EOFError, OSError):  # its end closed, or ours was (stopped)
            raise ChildDied(self.describe_end()) from None
        if isinstance(message, Failed):
            raise ChildDied(self.describe_failed(message))
        if not isinstance(message, kind):
            raise ChildDied(f"{self.name} said {message!r}, expected {kind.__name__}")
        return message

    def exit_code(self) -> int | None:
        """The child's exit code (negative: the signal that killed it), or None while it runs.

        One thread reads it at a time. multiprocessing reaps an ended child with waitpid and
        then stores its status; a second thread's waitpid in between gets ECHILD and reads None,
        as if the child still ran. The tensor-parallel group's watcher and a failed step's report
        both ask the moment a worker is killed: a test saw the bare gloo error instead of
        WorkerDied that way. Every read here (and in the engine) goes through this lock.
        And once the sentinel says the child has ended, the read waits for its status: the
        sentinel is ready when the child's pipe closes, a moment before waitpid can reap it."""
        with self._poll_lock:
            if self.has_ended():
                self.process.join()  # a blocking waitpid: returns as soon as it is reaped
            return self.process.exitcode

    def has_ended(self, timeout_s: float | None = 0.0) -> bool:
        """True once the child has ended, waiting up to timeout_s (None: as long as it takes)."""
        return bool(wait([self.sentinel], timeout_s))

    def failure(self, grace_s: float = 1.0) -> str | None:
        """How the child failed or ended, if it has (waiting up to grace_s for it to end)."""
        ended = self.has_ended(grace_s)
        last_word = self._last_word()
        if isinstance(last_word, Failed):
            return self.describe_failed(last_word)
        return self.describe_exit() if ended else None

    def describe_end(self, grace_s: float = 5.0) -> str:
        """Why the pipe went quiet: its last word, how it exited, or that it closed its end."""
        return self.failure(grace_s) or f"{self.name} closed its pipe"

    def describe_failed(self, last_word: Failed) -> str:
        """The child's last word as a story: "worker 1 failed:" and its traceback."""
        return f"{self.name} failed:\n{last_word.traceback}"

    def describe_exit(self) -> str:
        """How the ended child exited: "worker 1 (pid 7) was killed by signal 9"."""
        return f"{self.name} (pid {self.process.pid}) {exit_story(self.exit_code())}"

    def _last_word(self):
        """A message the child left in the pipe before it ended, if any."""
        try:
            return self.conn.recv() if self.conn.poll(0) else None
        except (EOFError, OSError):
            return None


def exit_story(exitcode: int | None) -> str:
    """How a process ended, in words: 'was killed by signal 9', 'exited with status 1'."""
    if exitcode is None:
        return "is still running"
    return f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with status {exitcode}"


def broadcast(children: Sequence[ChildProcess], message) -> int:
    """Send every child one message, pickled once; returns its size in bytes."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    for child in children:
        child.conn.send_bytes(payload)  # length-prefixed; the child's recv() unpickles it
    return len(payload)


def receive_all(
    children: Sequence[ChildProcess],
    kind: type = object,
    timeout_s: float | None = None,
    doing: str = "answer",
) -> list:
    """One message (a `kind`) from each child, in their order; ChildDied as soon as any fails,
    so a child that dies is noticed while another is still awaited."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    answers: dict[int, object] = {}
    while len(answers) < len(children):
        waiting = [i for i in range(len(children)) if i not in answers]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        handles = [h for i in waiting for h in (children[i].conn, children[i].sentinel)]
        ready = wait(handles, left)
        if not ready:
            raise ChildDied(f"{children[waiting[0]].name} did not {doing} in {timeout_s:.0f} s")
        for i in waiting:
            if children[i].conn in ready or children[i].sentinel in ready:
                answers[i] = children[i].receive(kind, 0.0, doing)
    return [answers[i] for i in range(len(children))]


def stop_all(children: Sequence[ChildProcess], polite: bool = True, timeout_s: float = 5.0) -> None:
    """Ask every child to stop (polite: Stop() to all first), give each timeout_s to exit, then
    terminate and kill what is left; close the pipes. Safe to call again."""
    for child in children if polite else ():
        with contextlib.suppress(OSError):  # it is gone already, or its pipe is closed
            child.send(Stop())
    for child in children:
        if not child.has_ended(timeout_s):
            child.process.terminate()
            if not child.has_ended(2.0):
                child.process.kill()
                child.has_ended(None)
        child.exit_code()  # reaped: no zombie left behind
        child.conn.close()


# ---- the child's side ----


def run_child(target: Callable, conn: Connection, args: tuple) -> None:
    """The child's whole life (its process's target): run target(conn, *args), and if it
    raises, send its traceback as the last word and exit at once with status 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the parent's to handle
    exit_with_parent()
    try:
        target(conn, *args)
    except SystemExit:
        raise  # the target chose its exit status
    except BaseException:
        with contextlib.suppress(OSError):  # the parent may be gone already
            conn.send(Failed(traceback.format_exc()))
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(1)  # a peer may be stuck in a collective with us: wait on no cleanup


@contextlib.contextmanager
def terminal_interrupts_ignored():
    """Ignore SIGINT while a child is spawned, so that the child starts ignoring it.

    A terminal's Ctrl-C goes to the whole process group. A spawned child is a fresh interpreter
    that spends seconds importing (torch) before `run_child` can ignore SIGINT; a Ctrl-C then
    killed it with a traceback. An ignored signal stays ignored across exec, and Python keeps
    it so, so the child never sees one. Only the main thread may change a handler: elsewhere
    (a test's server thread) the child is spawned as before.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_with_parent() -> None:
    """Exit the moment the parent process dies, even from inside a call that would wait."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="nanoserve-parent-watch", daemon=True).start()
