"""The parent's side of the fork-server test workers (`tests/_checkpoint_kill_worker.py`,
`tests/_resume_kill_worker.py`): start one, send it commands, read its JSON answers."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest


class Worker:
    """A worker process: send it commands, read its JSON answers (with a timeout)."""

    def __init__(self, script, directory, *args):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", PYTHONPATH=path)
        self.stderr = open(os.path.join(directory, "..", "worker.err"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, script, str(directory), *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
            text=True, env=env,
        )  # fmt: skip
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout=120):
        try:
            got = self.lines.get(timeout=timeout)
        except queue.Empty:
            got = None
        if got is None or "error" in got:
            self.stderr.seek(0)
            pytest.fail(f"worker answered {got}; its stderr ends:\n{self.stderr.read()[-3000:]}")
        return got

    def wait_killed(self):
        """Reaps the last child and checks that SIGKILL ended it."""
        self.send("wait")
        status = self.answer()["exit"]
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    def kill_child_after(self, pid, seconds):
        threading.Event().wait(seconds)
        os.kill(pid, signal.SIGKILL)
        self.wait_killed()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.stderr.close()
