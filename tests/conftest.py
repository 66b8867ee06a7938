import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOWCHECK = REPO.parent / "shared" / "pcaps" / "flowcheck"


@pytest.fixture(scope="session")
def flowcheck_dir() -> Path:
    if not FLOWCHECK.is_dir():
        pytest.skip(f"real FlowCheck captures not found at {FLOWCHECK} "
                    "(they live in ../shared/pcaps/flowcheck beside the repo)")
    return FLOWCHECK


@pytest.fixture(autouse=True)
def _ckptd_logger_restored():
    """A daemon run in-process (setup_logging) points the "ckptd" logger at the stderr of
    its test and stops propagation; left so, a later test's log calls write to a closed
    capture and caplog sees nothing. Each test starts from the logger as it was."""
    log = logging.getLogger("ckptd")
    saved = (log.handlers[:], log.propagate, log.level)
    yield
    log.handlers[:], log.propagate, log.level = saved[0], saved[1], saved[2]


class S3Lab:
    """A local S3-compatible server (moto in server mode: the real S3 REST protocol over
    HTTP on 127.0.0.1) and the storage options s3fs needs to reach it."""

    KEY, SECRET = "AKIATESTCKPTD", "ckptd-test-s3cret-0123456789"

    def __init__(self, host: str, port: int):
        self.endpoint = f"http://{host}:{port}"
        # config_kwargs: one attempt per call (botocore retries 5 times by default: the
        # keeper's back-off is the retry that matters), a short connect timeout
        # default_block_size: S3's smallest part, so a 6 MiB write starts a multipart upload
        self.options = {"key": self.KEY, "secret": self.SECRET, "default_block_size": 5 << 20,
                        "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
        # what restore / verify read when given no options (s3fs honours the AWS_* environment)
        self.env = {"AWS_ACCESS_KEY_ID": self.KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET,
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        """A boto3 S3 client of the server, to look behind s3fs."""
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.KEY, aws_secret_access_key=self.SECRET)

    def bucket(self) -> str:
        """A new, empty bucket: its s3:// URL with a prefix."""
        import uuid
        name = f"ckpts-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}/job1"


@pytest.fixture(scope="session")
def s3():
    pytest.importorskip("s3fs", reason="s3fs not installed: the S3 tests need the test extras "
                                       "(pip install s3fs 'moto[server]')")
    server_mod = pytest.importorskip("moto.server", reason="moto[server] not installed: the S3 tests need "
                                                           "the test extras (pip install s3fs 'moto[server]')")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield S3Lab(*server.get_host_and_port())
    finally:
        server.stop()


class _Hook(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.got.append((self.headers.get("Authorization"), json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *a):  # quiet: no request line on stderr per POST
        return None


@pytest.fixture
def webhook():
    """A webhook receiver on 127.0.0.1: (its URL, the (Authorization, JSON body) of each POST)."""
    _Hook.got = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/hook", _Hook.got
    srv.shutdown()
