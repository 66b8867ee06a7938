"""Serving: /status (JSON) and /metrics (Prometheus) over HTTP, 127.0.0.1 by default.

The daemon's loop publishes a snapshot (a plain dict) after every iteration and every
few thousand frames; the HTTP thread only ever reads the latest snapshot, so a scrape
never blocks or races the capture path.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Snapshot:
    def __init__(self):
        self._lock = threading.Lock()
        self._doc: dict = {"state": "starting"}

    def publish(self, doc: dict):
        with self._lock:
            self._doc = doc

    def get(self) -> dict:
        with self._lock:
            return self._doc


class _Collector:
    """Prometheus metrics read from the snapshot at scrape time."""

    def __init__(self, snap: Snapshot):
        self.snap = snap

    def collect(self):
        doc = self.snap.get()
        g = GaugeMetricFamily("ckptd_last_committed_iteration", "Last iteration committed exactly (-1: none)")
        g.add_metric([], doc.get("last_committed", -1))
        yield g
        c = CounterMetricFamily("ckptd_iterations", "Iterations finalized, by outcome", labels=["status"])
        for status, n in doc.get("iterations_by_status", {}).items():
            c.add_metric([status], n)
        yield c
        lag = GaugeMetricFamily("ckptd_commit_lag_seconds", "Last iteration's last packet to its commit")
        lag.add_metric([], doc.get("commit_lag_s") or 0.0)
        yield lag
        frames = CounterMetricFamily("ckptd_stream_frames", "Frames captured per mirror stream", labels=["stream"])
        loss = GaugeMetricFamily("ckptd_stream_loss_ratio", "Packet loss seen on the last iteration", labels=["stream"])
        cov = GaugeMetricFamily("ckptd_stream_coverage_ratio", "Gradient coverage of the last iteration", labels=["stream"])
        for s in doc.get("streams", []):
            frames.add_metric([s["name"]], s.get("frames", 0))
            loss.add_metric([s["name"]], s.get("loss") or 0.0)
            cov.add_metric([s["name"]], s.get("coverage") or 0.0)
        yield frames
        yield loss
        yield cov
        drops = CounterMetricFamily("ckptd_capture_drops", "Kernel ring drops (PACKET_STATISTICS)", labels=["interface"])
        pkts = CounterMetricFamily("ckptd_capture_packets", "Kernel ring packets", labels=["interface"])
        for name, st in doc.get("capture", {}).items():
            drops.add_metric([name], st.get("drops", 0))
            pkts.add_metric([name], st.get("packets", 0))
        yield drops
        yield pkts


class StatusServer:
    def __init__(self, snap: Snapshot, listen: str = "127.0.0.1:9187"):
        host, _, port = listen.rpartition(":")
        registry = CollectorRegistry()
        registry.register(_Collector(snap))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] == "/status":
                    body, ctype = json.dumps(snap.get(), indent=1).encode(), "application/json"
                elif self.path.split("?")[0] == "/metrics":
                    body, ctype = generate_latest(registry), "text/plain; version=0.0.4"
                else:
                    self.send_error(404, "try /status or /metrics")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                """Quiet: the daemon logs what matters itself."""

        self.httpd = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
        self.address = self.httpd.server_address
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="ckptd-status", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
