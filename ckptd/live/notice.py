"""Notice: tell the training job when an iteration cannot be recovered.

A checkpoint server that silently stops advancing is worse than none: the operator
believes there is a fresh checkpoint. When an iteration is unrecoverable (or its copies
conflict, or a daemon restarted after an outage joins the job iterations after the newest
state it holds: "not-captured") the shadow stops; it can only restart from a state the trainer itself saves.
So the daemon says so, two ways, both optional:

- a webhook: POST of a JSON document {event, iteration, status, note, missing} to a URL
  (paging, chat, an orchestrator);
- the job's c10d TCPStore (the one torchrun already runs at MASTER_ADDR:MASTER_PORT):
  key `ckptd/unrecovered` holds the newest such iteration (of a gap, its last: a daemon
  restarted twice in one outage announces a newer number the second time),
  `ckptd/unrecovered/<it>` the same JSON. `ckptd.resync.Resync`, three lines in the training loop, watches that key
  and saves a regular checkpoint at the next step boundary into the daemon's `resume`
  directory; the daemon restarts its shadow from it (ckptd.pipeline, `_resume_state`).

A job that diverges (its parameters hold NaN or inf: ckptd.core.finite) is announced
once to the webhook too (`ckptd.job_diverged`, with the newest finite iteration), not in
the store: the trainer has nothing to resync, its own state is the NaN one.

Sending never blocks capture or commits: events go through a bounded queue to one
thread, which retries with back-off and drops (and counts) what it cannot deliver.
"""
from __future__ import annotations

import json
import logging
import queue
import re
import time
import urllib.request
from dataclasses import dataclass

from ckptd.errors import CkptdError, show, unknown_keys
from ckptd.threads import Thread

log = logging.getLogger("ckptd.notice")

STORE_KEY = "ckptd/unrecovered"
QUEUE_DEPTH = 256  # events waiting; beyond it they are dropped and counted
RETRIES = 3


class NoticeConfigError(CkptdError, ValueError):
    pass


@dataclass(frozen=True)
class NoticeConfig:
    webhook: str | None = None  # http(s) URL a JSON event is POSTed to
    webhook_token: str | None = None  # sent as "Authorization: Bearer <token>"
    store: tuple[str, int] | None = None  # the job's TCPStore (host, port)
    timeout_s: float = 5.0  # per attempt, webhook and store alike


_URL = re.compile(r"https?://[^\s/]+(/\S*)?", re.I)


def notice_config(where: str, doc) -> NoticeConfig | None:
    """The config's `notice` mapping, checked; None when absent. `where` names the file."""
    from ckptd.live.daemon import ConfigError, parse_listen
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: 'notice' must be a mapping (webhook, webhook_token, store, timeout_s)")
    if why := unknown_keys(f"{where}: notice", doc, ("webhook", "webhook_token", "store", "timeout_s")):
        raise ConfigError(why)
    hook = doc.get("webhook")
    if hook is not None and (not isinstance(hook, str) or not _URL.fullmatch(hook)):
        raise ConfigError(f"{where}: 'notice.webhook' must be an http:// or https:// URL, not {show(hook)}")
    token = doc.get("webhook_token")
    if token is not None and (not isinstance(token, str) or not token or any(c in token for c in "\r\n")):
        raise ConfigError(f"{where}: 'notice.webhook_token' must be a one-line string")
    store = doc.get("store")
    if store is not None:
        store = parse_listen(store, f"{where}: notice.store")
        if store[1] == 0:
            raise ConfigError(f"{where}: 'notice.store' needs the TCPStore's port (MASTER_PORT), not 0")
    t = doc.get("timeout_s", 5.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.1 <= t <= 300:
        raise ConfigError(f"{where}: 'notice.timeout_s' must be a number of seconds in 0.1..300, not {show(t)}")
    if hook is None and store is None:
        raise ConfigError(f"{where}: 'notice' names neither a webhook nor a store")
    return NoticeConfig(webhook=hook, webhook_token=token, store=store, timeout_s=float(t))


def event_of(rep) -> dict:
    """The JSON an unrecoverable iteration is announced with (an IterationReport in);
    `through`: the last iteration of a not-captured gap."""
    return {"event": "ckptd.iteration_unrecoverable", "iteration": rep.iteration,
            "through": rep.through if rep.through is not None else rep.iteration,
            "status": rep.status, "note": rep.note.strip(),
            "missing": [{"bucket": m.bucket, "start": m.start, "end": m.end}
                        for m in rep.missing[:20]],
            "action": "save a regular checkpoint at the next step boundary into the "
                      "daemon's resume directory (ckptd.resync.Resync does it)"}


def diverged_event(diverged: dict) -> dict:
    """The JSON a divergence is announced with (the daemon's `diverged` status in)."""
    return {"event": "ckptd.job_diverged", "iteration": diverged["since"], "parameter": diverged["parameter"],
            "newest_finite_committed": diverged["newest_finite_committed"],
            "note": "the job's parameters hold NaN or inf from this iteration on; retention keeps the newest "
                    "finite checkpoint (/status checkpoints.newest_finite)"}


def _backoff(attempt: int) -> float:
    return min(0.2 * 4 ** attempt, 5.0)


class Notifier:
    """The daemon's feature: `on_iteration(rep)` from the core loop, `close()` at stop."""

    # not "abandoned": the capture stopped first
    NOTICED = ("unrecoverable", "conflict", "dropped", "not-captured")

    def __init__(self, cfg: NoticeConfig):
        self.cfg = cfg
        self.sent = 0
        self.failed = 0  # events that could not be delivered after every retry
        self.dropped = 0  # events the queue had no room for
        self._q: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self._inflight: dict | None = None  # the event being sent
        self._store = None
        self._thread = Thread(target=self._run, name="ckptd-notice", daemon=True)
        self._thread.start()

    def on_iteration(self, rep) -> None:
        if rep.status not in self.NOTICED:
            return
        try:
            self._q.put_nowait(event_of(rep))
        except queue.Full:
            self.dropped += 1

    def on_diverged(self, diverged: dict) -> None:
        """Once per divergence, from the daemon; to the webhook only."""
        if not self.cfg.webhook:
            return
        try:
            self._q.put_nowait(diverged_event(diverged))
        except queue.Full:
            self.dropped += 1

    def retry_budget_s(self) -> float:
        """How long one event may take: every attempt at every target, timing out, with
        the back-off between attempts."""
        targets = bool(self.cfg.webhook) + bool(self.cfg.store)
        backoff = sum(_backoff(a) for a in range(RETRIES - 1))
        return targets * (RETRIES * self.cfg.timeout_s + backoff) + 1.0

    def close(self, wait_s: float | None = None) -> None:
        """Deliver what is queued, for up to wait_s (default: the event in hand's every
        retry, retry_budget_s), then stop the thread. Events still undelivered then are
        counted as dropped and logged by iteration: the trainer's operator must learn
        that a notice never went out, not find the stop silent about it."""
        try:
            self._q.put_nowait(None)
        except queue.Full:  # the thread is stuck on a dead target: the wait below ends it
            pass
        self._thread.join(self.retry_budget_s() if wait_s is None else wait_s)
        if not self._thread.is_alive():
            return
        left = [ev for ev in [self._inflight, *list(self._q.queue)] if ev is not None]
        self.dropped += len(left)
        if left:
            log.error("notices not delivered at the stop", extra={"fields": {
                "events": len(left), "iterations": [ev.get("iteration") for ev in left][:20]}})

    def idle(self) -> bool:
        """Nothing queued or being sent."""
        return self._q.unfinished_tasks == 0

    def stats(self) -> dict:
        return {"sent": self.sent, "failed": self.failed, "dropped": self.dropped}

    # -- the sending thread ------------------------------------------------------------
    def _run(self):
        while (ev := self._q.get()) is not None:
            self._inflight = ev
            ok = True
            if self.cfg.webhook:
                ok &= self._retry(lambda: self._post(ev), "webhook")
            if self.cfg.store and ev["event"] != "ckptd.job_diverged":
                ok &= self._retry(lambda: self._set(ev), "store")
            if ok:
                self.sent += 1
            else:
                self.failed += 1
            self._inflight = None
            self._q.task_done()

    def _retry(self, send, what: str) -> bool:
        for attempt in range(RETRIES):
            try:
                send()
                return True
            except Exception as e:  # network errors of every kind: logged, retried
                log.warning("notice not delivered", extra={"fields": {
                    "to": what, "attempt": attempt + 1, "error": " ".join(str(e).split())[:200]}})
                if what == "store":
                    self._store = None  # reconnect next time
                if attempt + 1 < RETRIES:  # not after the last: close() waits for no sleep
                    time.sleep(_backoff(attempt))
        return False

    def _post(self, ev: dict):
        headers = {"Content-Type": "application/json"}
        if self.cfg.webhook_token:
            headers["Authorization"] = f"Bearer {self.cfg.webhook_token}"
        req = urllib.request.Request(self.cfg.webhook, data=json.dumps(ev).encode(),
                                     headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as r:
            r.read()

    def _set(self, ev: dict):
        from datetime import timedelta

        from torch.distributed import TCPStore
        if self._store is None:
            host, port = self.cfg.store
            self._store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.cfg.timeout_s))
        it = ev["through"]
        self._store.set(f"{STORE_KEY}/{it}", json.dumps(ev))
        # the newest unrecoverable iteration: the trainer compares it with the last it handled
        self._store.set(STORE_KEY, str(it))
