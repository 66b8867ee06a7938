"""Where persisted checkpoints live: a local directory or an fsspec URL, behind one small
interface, so the keeper (ckptd.core.keep) and the persistence tier (ckptd.live.persist)
have one way to write, list, read and remove whatever the target.

- A local directory (a path, or a `file://` URL): `atomic_write` as before (a temporary
  beside the file, fsync, rename, directory fsync).
- Any other fsspec filesystem (`memory://`, `s3://bucket/prefix`, ...): the object is
  written under a temporary name, then moved to its name. An object store has no fsync
  and no atomic rename of a directory entry: what keeps a reader safe is the order, the
  manifest being written after the object it lists, so a manifest entry never names a
  partial object (a temporary left by a crash is never listed and is ignored).

Either way the SHA-256 and size are computed while the bytes are written (never by
reading the object back). Every failure is a CheckpointWriteError (a one-line message,
errno kept where there is one) so the keeper's back-off handles a permission or network
error as it handles a full disk. Credentials in a URL (user:password@) never appear in a
message: `redact`.
"""
from __future__ import annotations

import errno as _errno
import hashlib
import re
import uuid
from pathlib import Path

from ckptd.core.checkpoint import CheckpointWriteError, atomic_write

_USERINFO = re.compile(r"(?<=://)[^@\s]*@")  # a "/" in a password too: err on the safe side


def redact(text: str) -> str:
    """`text` with any URL's user:password@ replaced by ***@."""
    return _USERINFO.sub("***@", str(text))


def is_url(target) -> bool:
    return "://" in str(target)


def _one_line(e: BaseException) -> str:
    return redact(" ".join(str(e).split()) or type(e).__name__)


class _Hashing:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b):
        self.sha.update(b)
        self.size += memoryview(b).nbytes
        return self.f.write(b)

    def flush(self):
        self.f.flush()


class Store:
    """A directory of checkpoints; `local` when it is one on this machine (then `path`)."""

    def __init__(self, target: str | Path):
        text = str(target)
        self.local = True
        self._url, self._fs, self._root = text, None, None
        if is_url(text):
            import fsspec
            from fsspec.implementations.local import LocalFileSystem
            try:  # the class only: a remote filesystem is reached at its first use (_call)
                cls = fsspec.get_filesystem_class(text.split("://", 1)[0])
            except Exception as e:  # an unknown protocol, a missing backend (s3fs)
                raise ValueError(f"{redact(text)}: {_one_line(e)}") from None
            if issubclass(cls, LocalFileSystem):
                text = cls._strip_protocol(text)
            else:
                self.local = False
        self.url = redact(text)  # what messages and /status show
        self.path = Path(text) if self.local else None

    @property
    def fs(self):
        if self._fs is None:
            import fsspec
            fs, root = fsspec.core.url_to_fs(self._url)
            self._fs, self._root = fs, root.rstrip("/")
        return self._fs

    @property
    def root(self) -> str:
        _ = self.fs
        return self._root

    def __str__(self):
        return self.url

    def where(self, name: str) -> str:
        """A file's place, for messages: a path, or the URL without credentials."""
        return str(self.path / name) if self.local else f"{self.url.rstrip('/')}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def makedirs(self):
        if self.local:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        else:
            self._call("create", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def _call(self, what: str, fn, name: str | None = None):
        """fn() on the remote filesystem (connecting first, if not yet); any failure as a
        one-line CheckpointWriteError without credentials (FileNotFoundError as it is)."""
        try:
            return fn()
        except CheckpointWriteError:
            raise
        except FileNotFoundError:
            raise
        except Exception as e:
            code = getattr(e, "errno", None) or _errno.EIO
            raise CheckpointWriteError(code, f"{self.where(name) if name else self.url}: cannot {what}: "
                                             f"{_one_line(e)}") from None

    def write(self, name: str, fill) -> tuple[int, str]:
        """`fill(f)` writes the file `name` whole or not at all; (bytes, SHA-256 hex)."""
        box = []

        def hashed(f):
            box.append(_Hashing(f))
            fill(box[0])
        if self.local:
            atomic_write(self.path / name, hashed)
        else:
            def put():
                tmp = self._key(f"{name}.tmp-{uuid.uuid4().hex[:12]}")
                try:
                    with self.fs.open(tmp, "wb") as f:
                        hashed(f)
                    self.fs.mv(tmp, self._key(name))
                except BaseException:
                    try:
                        self.fs.rm(tmp)
                    except Exception:
                        pass
                    raise
            self._call("write", put, name)
        return box[0].size, box[0].sha.hexdigest()

    def read(self, name: str) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""
        if self.local:
            return (self.path / name).read_bytes()
        return self._call("read", lambda: self.fs.cat_file(self._key(name)), name)

    def exists(self, name: str) -> bool:
        if self.local:
            return (self.path / name).exists()
        return bool(self._call("read", lambda: self.fs.exists(self._key(name)), name))

    def names(self) -> set[str]:
        """The files in the directory (a temporary included: callers match names)."""
        if self.local:
            return {p.name for p in self.path.iterdir()} if self.path.is_dir() else set()
        try:
            listed = self._call("list", lambda: self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return set()
        return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed}

    def remove(self, name: str):
        """FileNotFoundError when it is gone already; CheckpointWriteError otherwise."""
        if self.local:
            (self.path / name).unlink()
        else:
            self._call("remove", lambda: self.fs.rm(self._key(name)), name)


def open_store(target) -> Store:
    return target if isinstance(target, Store) else Store(target)
