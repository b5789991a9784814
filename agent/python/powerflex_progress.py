"""Report training progress to powerflexd, the powerflex node agent.

powerflexd caps GPU power per Slurm job and judges each cap by the job's
throughput, which it learns from these reports. Standard library only; every
call is a cheap no-op outside a powerflex-managed job (no ``POWERFLEX_PROGRESS``
or ``SLURM_JOB_ID`` in the environment).

    import powerflex_progress

    for batch in loader:
        train_step(batch)
        powerflex_progress.report(tokens=batch_tokens, steps=1)

or with an explicit reporter (``close()`` sends the final counts):

    with powerflex_progress.ProgressReporter() as reporter:
        for batch in loader:
            train_step(batch)
            reporter.add(tokens=batch_tokens, steps=1)

Report from one process per node (e.g. local rank 0): the agent keeps one
counter per job, so several processes with counters of their own would
contradict each other. Reporting never raises into the training loop and never
blocks it for more than a short connect timeout.
"""

import atexit
import json
import logging
import os
import re
import socket
import threading
import time

__all__ = ["ProgressReporter", "report"]

SOCKET_ENV = "POWERFLEX_PROGRESS"
JOB_ENV = "SLURM_JOB_ID"
PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 4096
# A Unix socket connects at once or fails at once; the timeout only guards
# against an agent whose accept backlog is full.
CONNECT_TIMEOUT_S = 0.2
# Read at call time, so tests can shorten it.
RETRY_INTERVAL_S = 10.0

_JOB_ID_RE = re.compile(r"[A-Za-z0-9_.]{1,64}")
# Without it, writing to a socket the agent closed would kill a process that
# does not ignore SIGPIPE (Python does by default; embedding hosts may not).
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)

logger = logging.getLogger("powerflex_progress")


class ProgressReporter:
    """Cumulative token/step counters, sent to powerflexd at most every ``min_interval_s``.

    ``socket_path`` and ``job_id`` default to ``$POWERFLEX_PROGRESS`` and
    ``$SLURM_JOB_ID``; if either is empty the reporter only counts.
    """

    def __init__(self, min_interval_s=1.0, socket_path=None, job_id=None):
        if socket_path is None:
            socket_path = os.environ.get(SOCKET_ENV, "")
        if job_id is None:
            job_id = os.environ.get(JOB_ENV, "")
        self.min_interval_s = max(0.0, float(min_interval_s))
        self.tokens = 0
        self.steps = 0
        self._path = socket_path
        self._job_id = job_id
        self._lock = threading.Lock()
        self._sock = None
        self._sock_pid = None
        self._inbuf = b""
        self._outbuf = b""  # tail of a line the socket took only in part
        self._last_attempt = None
        self._next_connect_at = 0.0
        self._warned_bad_value = False
        self._enabled = bool(socket_path) and bool(job_id) and hasattr(socket, "AF_UNIX")
        if self._enabled and not _JOB_ID_RE.fullmatch(job_id):
            # The agent would refuse every line; say so once instead.
            logger.warning("invalid %s %r; powerflex progress reporting disabled", JOB_ENV, job_id)
            self._enabled = False

    @property
    def enabled(self):
        """False outside a managed job, after a refusal, or after ``close()``."""
        return self._enabled

    def add(self, tokens=0, steps=0):
        """Adds to the counters; sends a report if ``min_interval_s`` has passed."""
        try:
            with self._lock:
                self.tokens += self._count(tokens)
                self.steps += self._count(steps)
                if not self._enabled:
                    return
                now = time.monotonic()
                if self._last_attempt is None or now - self._last_attempt >= self.min_interval_s:
                    self._send(now)
        except Exception:  # the training loop matters more than one report
            logger.debug("progress report failed", exc_info=True)

    def flush(self):
        """Sends the current counters now, regardless of ``min_interval_s``."""
        try:
            with self._lock:
                if self._enabled:
                    self._send(time.monotonic())
        except Exception:
            logger.debug("progress flush failed", exc_info=True)

    def close(self):
        """Sends the final counters and disconnects; later calls only count."""
        try:
            with self._lock:
                if self._enabled:
                    self._send(time.monotonic())
                self._enabled = False
                self._disconnect()
        except Exception:
            logger.debug("progress close failed", exc_info=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def _count(self, value):
        # Accepts ints and anything int() takes (e.g. 0-d tensors); a bad
        # value must not make the cumulative counters go backwards or raise.
        try:
            n = int(value)
        except (TypeError, ValueError, OverflowError):
            n = -1
        if n >= 0:
            return n
        if not self._warned_bad_value:
            self._warned_bad_value = True
            logger.warning("ignoring progress increment %r: not a non-negative integer", value)
        return 0

    def _send(self, now):
        self._last_attempt = now
        if self._sock is not None and self._sock_pid != os.getpid():
            # A forked child shares the parent's stream; writing to it would
            # interleave lines. Drop only the child's copy of the descriptor.
            self._disconnect()
        if self._sock is None:
            if now < self._next_connect_at or not self._connect(now):
                return
        if self._read_replies(now):
            return
        line = json.dumps(
            {"v": PROTOCOL_VERSION, "job_id": self._job_id, "tokens": self.tokens, "steps": self.steps},
            separators=(",", ":"),
        )
        data = (line + "\n").encode("ascii")
        try:
            if self._outbuf:
                self._outbuf = self._outbuf[self._sock.send(self._outbuf, _SEND_FLAGS):]
                if self._outbuf:
                    return  # still backed up; counters are cumulative, so skipping loses nothing
            self._outbuf = data[self._sock.send(data, _SEND_FLAGS):]
        except BlockingIOError:
            pass  # agent not reading right now; the next report supersedes this one
        except OSError as e:
            # A refusal closes the connection, so the refusal line may be
            # waiting behind the error.
            if not self._read_replies(now):
                self._drop(now, e)

    def _connect(self, now):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(self._path)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            self._next_connect_at = now + RETRY_INTERVAL_S
            logger.debug("cannot reach powerflexd at %s: %s", self._path, e)
            return False
        self._sock = sock
        self._sock_pid = os.getpid()
        self._inbuf = b""
        self._outbuf = b""
        return True

    def _read_replies(self, now):
        """Checks, without blocking, for what the agent sent; True if the connection is gone."""
        eof = False
        try:
            while len(self._inbuf) <= MAX_LINE_BYTES:
                chunk = self._sock.recv(MAX_LINE_BYTES)
                if not chunk:
                    eof = True
                    break
                self._inbuf += chunk
        except BlockingIOError:
            pass
        except OSError:
            eof = True  # e.g. reset; what was read before still counts
        lines = self._inbuf.split(b"\n")
        # An unterminated tail is complete only once the agent has hung up
        # (or has sent more than any valid line holds).
        if not eof and len(lines[-1]) <= MAX_LINE_BYTES:
            self._inbuf = lines.pop()
        else:
            self._inbuf = b""
        for raw in lines:
            if raw.strip() and self._is_refusal(raw):
                self._disable(raw)
                return True
        if eof:
            self._drop(now, "connection closed by powerflexd")
            return True
        return False

    @staticmethod
    def _is_refusal(raw):
        # The agent replies only to refuse; tolerate a future acknowledgement.
        try:
            msg = json.loads(raw)
        except ValueError:
            return True
        return not (isinstance(msg, dict) and msg.get("ok") is True)

    def _disable(self, raw):
        try:
            reason = json.loads(raw).get("error", raw.decode("utf-8", "replace"))
        except (ValueError, AttributeError):
            reason = raw.decode("utf-8", "replace")
        # A refusal (wrong user, wrong job, unknown job) will not go away by
        # retrying, so stop for the rest of this process.
        logger.warning(
            "powerflexd refused progress for job %s: %s; progress reporting disabled",
            self._job_id,
            reason,
        )
        self._enabled = False
        self._disconnect()

    def _drop(self, now, why):
        logger.debug("progress connection dropped: %s", why)
        self._disconnect()
        self._next_connect_at = now + RETRY_INTERVAL_S

    def _disconnect(self):
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._inbuf = b""
        self._outbuf = b""


_global_reporter = None
_global_lock = threading.Lock()


def report(tokens=0, steps=1):
    """Adds to a process-wide reporter, created on first use from the environment."""
    global _global_reporter
    reporter = _global_reporter
    if reporter is None:
        try:
            with _global_lock:
                if _global_reporter is None:
                    _global_reporter = ProgressReporter()
                    # The last counts since the previous report would be lost otherwise.
                    atexit.register(_global_reporter.close)
                reporter = _global_reporter
        except Exception:
            logger.debug("cannot create progress reporter", exc_info=True)
            return
    reporter.add(tokens=tokens, steps=steps)
