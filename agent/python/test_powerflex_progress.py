"""Tests for powerflex_progress against a fake powerflexd progress socket.

Run: python3 agent/python/test_powerflex_progress.py   (stdlib unittest only)
"""

import json
import os
import py_compile
import socket
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# Keep the source directory free of __pycache__.
sys.dont_write_bytecode = True

import powerflex_progress  # noqa: E402
from powerflex_progress import ProgressReporter  # noqa: E402

JOB = "4242"
REFUSAL = b'{"v":1,"ok":false,"error":"process 7 belongs to job (none), not job 4242"}\n'


class FakeAgent:
    """Serves the progress socket like powerflexd: records lines, replies only to refuse.

    ``mode``: "accept" keeps every line; "refuse" answers the first line with a
    refusal and hangs up; "hang_up" closes after the first line without a word.
    """

    def __init__(self, path, mode="accept"):
        self.path = path
        self.mode = mode
        self.lines = []
        self.connections = 0
        self.replied = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(8)
        # Short timeouts let the thread notice close() promptly.
        self._listener.settimeout(0.05)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            with conn:
                self._serve(conn)

    def _serve(self, conn):
        conn.settimeout(0.05)
        buf = b""
        while not self._stop.is_set():
            try:
                chunk = conn.recv(4096)
            except socket.timeout:
                continue
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                with self._lock:
                    self.lines.append(line + b"\n")
                if self.mode == "refuse":
                    conn.sendall(REFUSAL)
                    self.replied.set()
                    return
                if self.mode == "hang_up":
                    self.replied.set()
                    return

    def wait_for_lines(self, n, timeout=2.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.lines) >= n:
                    break
            time.sleep(0.01)
        return self.snapshot()

    def snapshot(self):
        with self._lock:
            return list(self.lines)

    def close(self):
        self._stop.set()
        self._thread.join(2.0)
        self._listener.close()


def settle():
    """Gives in-flight lines time to reach the fake agent before asserting on absence."""
    time.sleep(0.2)


class ReporterTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self._tmp.name, "node.progress")
        self.agent = None

    def tearDown(self):
        if self.agent is not None:
            self.agent.close()
        self._tmp.cleanup()

    def start_agent(self, mode="accept"):
        self.agent = FakeAgent(self.path, mode)
        return self.agent

    def reporter(self, **kw):
        kw.setdefault("socket_path", self.path)
        kw.setdefault("job_id", JOB)
        r = ProgressReporter(**kw)
        self.addCleanup(r.close)
        return r

    def test_reports_are_cumulative_json_lines(self):
        agent = self.start_agent()
        r = self.reporter(min_interval_s=0)
        for _ in range(3):
            r.add(tokens=1000, steps=1)
        r.add(steps=2)  # a steps-only increment keeps the token count
        lines = agent.wait_for_lines(4)
        self.assertEqual(len(lines), 4)
        for line in lines:
            self.assertTrue(line.endswith(b"\n"))
            self.assertEqual(line.count(b"\n"), 1)
            self.assertLessEqual(len(line), 4096)
        reports = [json.loads(line) for line in lines]
        expected = [(1000, 1), (2000, 2), (3000, 3), (3000, 5)]
        self.assertEqual(
            reports,
            [{"v": 1, "job_id": JOB, "tokens": t, "steps": s} for t, s in expected],
        )
        self.assertEqual(agent.connections, 1, "the connection should be reused")

    def test_rate_limit_and_flush(self):
        agent = self.start_agent()
        r = self.reporter(min_interval_s=60)
        for _ in range(100):
            r.add(tokens=5, steps=1)
        settle()
        lines = agent.snapshot()
        self.assertEqual(len(lines), 1, "one report per interval")
        self.assertEqual(json.loads(lines[0])["steps"], 1)
        r.flush()
        lines = agent.wait_for_lines(2)
        self.assertEqual(len(lines), 2)
        self.assertEqual(json.loads(lines[1]), {"v": 1, "job_id": JOB, "tokens": 500, "steps": 100})

    def test_close_sends_final_counts(self):
        agent = self.start_agent()
        with self.reporter(min_interval_s=60) as r:
            r.add(steps=1)
            r.add(steps=1)
        self.assertFalse(r.enabled)
        lines = agent.wait_for_lines(2)
        self.assertEqual([json.loads(line)["steps"] for line in lines], [1, 2])

    def test_no_environment_is_a_no_op(self):
        agent = self.start_agent()
        cases = [
            {"socket_path": "", "job_id": JOB},  # not a powerflex job
            {"socket_path": self.path, "job_id": ""},  # not a Slurm job
        ]
        for kw in cases:
            r = self.reporter(min_interval_s=0, **kw)
            self.assertFalse(r.enabled)
            r.add(tokens=1, steps=1)
            r.flush()
            r.close()
            self.assertEqual(r.steps, 1, "counting still works")
        # Defaults come from the environment; an empty one must not matter.
        with mock.patch.dict(os.environ, {}, clear=True), mock.patch.object(
            powerflex_progress, "_global_reporter", None
        ):
            r = ProgressReporter(min_interval_s=0)
            self.assertFalse(r.enabled)
            r.add(steps=1)
            powerflex_progress.report(tokens=10)
            self.assertFalse(powerflex_progress._global_reporter.enabled)
        settle()
        self.assertEqual(agent.snapshot(), [])
        self.assertEqual(agent.connections, 0)

    def test_invalid_job_id_disables_with_warning(self):
        with self.assertLogs("powerflex_progress", "WARNING") as logs:
            r = self.reporter(job_id="../etc")
        self.assertFalse(r.enabled)
        self.assertEqual(len(logs.records), 1)

    def test_bad_increment_is_ignored(self):
        r = self.reporter(min_interval_s=0)
        with self.assertLogs("powerflex_progress", "WARNING") as logs:
            r.add(tokens=-5, steps="x")
            r.add(tokens=-1)
        self.assertEqual((r.tokens, r.steps), (0, 0))
        self.assertEqual(len(logs.records), 1, "warn once, not per step")

    def test_agent_absent_does_not_raise_or_block(self):
        # Missing socket file, then a stale one nobody listens on.
        stale = os.path.join(self._tmp.name, "stale.progress")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(stale)
        s.close()
        for path in (self.path, stale):
            r = self.reporter(min_interval_s=0, socket_path=path)
            start = time.monotonic()
            for _ in range(20):
                r.add(tokens=10, steps=1)
            r.flush()
            r.close()
            self.assertLess(time.monotonic() - start, 1.0)
            self.assertEqual(r.steps, 20)

    def test_reconnects_after_agent_hangs_up(self):
        agent = self.start_agent(mode="hang_up")
        with mock.patch.object(powerflex_progress, "RETRY_INTERVAL_S", 0.05):
            r = self.reporter(min_interval_s=0)
            r.add(steps=1)
            self.assertTrue(agent.replied.wait(2.0))
            settle()
            r.add(steps=1)  # notices the hang-up, waits out the retry interval
            time.sleep(0.1)
            r.add(steps=1)
            lines = agent.wait_for_lines(2)
        self.assertTrue(r.enabled, "a hang-up without a refusal is not final")
        self.assertEqual([json.loads(line)["steps"] for line in lines], [1, 3])
        self.assertEqual(agent.connections, 2)

    def test_refusal_disables_reporter_with_one_warning(self):
        agent = self.start_agent(mode="refuse")
        r = self.reporter(min_interval_s=0)
        r.add(tokens=1, steps=1)
        self.assertTrue(agent.replied.wait(2.0))
        settle()
        with self.assertLogs("powerflex_progress", "WARNING") as logs:
            for _ in range(10):
                r.add(tokens=1, steps=1)
            r.flush()
        self.assertFalse(r.enabled)
        self.assertEqual(len(logs.records), 1)
        self.assertIn("not job 4242", logs.output[0])
        settle()
        self.assertEqual(len(agent.snapshot()), 1, "nothing sent after the refusal")
        self.assertEqual(agent.connections, 1, "no reconnect after the refusal")


class ExampleTest(unittest.TestCase):
    def test_hf_callback_example_compiles(self):
        # Compile only: transformers need not be installed here.
        with tempfile.TemporaryDirectory() as tmp:
            py_compile.compile(
                os.path.join(HERE, "hf_callback_example.py"),
                cfile=os.path.join(tmp, "hf_callback_example.pyc"),
                doraise=True,
            )


if __name__ == "__main__":
    unittest.main(verbosity=2)
