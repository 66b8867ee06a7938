"""Where persisted checkpoints live: a local directory or an fsspec URL, behind one small
interface, so the keeper (ckptd.core.keep) and the persistence tier (ckptd.live.persist)
have one way to write, list, read and remove whatever the target.

- A local directory (a path, or a `file://` URL): `atomic_write` as before (a temporary
  beside the file, fsync, rename, directory fsync).
- Any other fsspec filesystem: written with fsspec's transaction protocol (autocommit
  off: nothing is stored until commit(); a failed write is discarded, where close() would
  store the part written so far).
  - A bucket store (`s3://bucket/prefix`, gs, az): straight to its name. The commit is
    the atomic step (S3: the PUT, or CompleteMultipartUpload of the parts): the name
    shows the previous object or the whole new one, never a part. S3 has no rename: a
    temporary name and a move would be a second whole copy (CopyObject) and a delete,
    twice the time, and no safer.
  - Others (`memory://`, sftp, ...): under a temporary name, committed, then moved to
    its name; the temporary is removed when that fails (a filesystem that ignores
    autocommit, like memory://, shows it while it is written). A crash before the move
    leaves the temporary, never listed.
  What keeps a reader safe across objects is the order, the manifest being written after
  the object it lists, so a manifest entry never names a missing or partial object
  (docs/RECOVERY.md, "What guarantees what on an object store").
- Storage options (`persist_options`: credentials, endpoint, retries) go to the fsspec
  filesystem as given; the values of credential keys never appear in a message. Without
  them fsspec's own defaults apply (s3fs: the AWS_* environment, ~/.aws).
- A bucket (s3, gs, az) is never created: that is the operator's choice of region and
  access policy. A missing one is an error naming the URL.

Either way the SHA-256 and size are computed while the bytes are written (never by
reading the object back). Every failure is a CheckpointWriteError (a one-line message,
errno kept where there is one) so the keeper's back-off handles a permission or network
error as it handles a full disk. Credentials in a URL (user:password@) or in the storage
options never appear in a message: `redact`.
"""
from __future__ import annotations

import errno as _errno
import hashlib
import re
import uuid
from pathlib import Path

from ckptd.core.checkpoint import CheckpointWriteError, atomic_write

# fsspec protocols whose filesystems only read (an archive opened from a URL, a web
# server, a repository): no persistence tier writes there (persist_url refuses them),
# so no manifest is there to read either
READ_ONLY_PROTOCOLS = frozenset({"http", "https", "zip", "tar", "libarchive", "github", "git", "reference", "data"})

_USERINFO = re.compile(r"(?<=://)[^@\s]*@")  # a "/" in a password too: err on the safe side
# storage-option keys whose values are credentials (s3fs key/secret/token, gcsfs token,
# adlfs account_key/sas_token/client_secret, botocore aws_secret_access_key, ...)
_CREDENTIAL_KEY = re.compile(r"key|secret|token|password|credential|signature", re.I)
BUCKET_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}  # a path's first part is a bucket


def redact(text: str, secrets=()) -> str:
    """`text` with any URL's user:password@ replaced by ***@, and each of `secrets` by ***."""
    text = _USERINFO.sub("***@", str(text))
    for s in secrets:
        text = text.replace(s, "***")
    return text


def credentials_in(options) -> list[str]:
    """The string values under credential keys anywhere in a storage-options mapping."""
    found = []
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, str) and v and _CREDENTIAL_KEY.search(str(k)):
                found.append(v)
            else:
                found += credentials_in(v)
    elif isinstance(options, (list, tuple)):
        for v in options:
            found += credentials_in(v)
    return sorted(found, key=len, reverse=True)  # the longest first: no part of one left


def is_url(target) -> bool:
    return "://" in str(target)


def _one_line(e: BaseException, secrets=()) -> str:
    return redact(" ".join(str(e).split()) or type(e).__name__, secrets)


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
    """A directory of checkpoints; `local` when it is one on this machine (then `path`).
    `options`: fsspec storage options for a remote one (credentials, endpoint)."""

    def __init__(self, target: str | Path, options: dict | None = None):
        text = str(target)
        self.local = True
        self._url, self._fs, self._root = text, None, None
        self._options = dict(options or {})
        self.secrets = credentials_in(self._options)
        self.protocol = text.split("://", 1)[0].lower() if is_url(text) else "file"
        if is_url(text):
            import fsspec
            from fsspec.implementations.local import LocalFileSystem
            try:  # the class only: a remote filesystem is reached at its first use (_call)
                cls = fsspec.get_filesystem_class(text.split("://", 1)[0])
            except Exception as e:  # an unknown protocol, a missing backend (s3fs)
                raise ValueError(f"{redact(text)}: {_one_line(e, self.secrets)}") from None
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
            fs, root = fsspec.core.url_to_fs(self._url, **self._options)
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
        """The directory, made if missing; on a bucket store only the bucket's presence is
        checked (an object store has no directories, and ckptd creates no bucket)."""
        if self.local:
            from ckptd.core.kernelfs import not_storage
            if why := not_storage(self.path):
                raise CheckpointWriteError(_errno.EINVAL, f"{self.path}: cannot keep checkpoints there: {why}")
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:  # /proc/x, a file in the way, no permission: the path, not a bare errno
                why = e.strerror or e
                if self.path.is_symlink() and not self.path.exists():  # mkdir says "File exists"
                    why = "a broken symbolic link is in the way"
                elif self.path.exists() and not self.path.is_dir():
                    why = "a file is in the way"
                raise CheckpointWriteError(e.errno, f"{self.path}: cannot create the checkpoint directory: "
                                                    f"{why}") from None
        elif self.protocol in BUCKET_STORES:
            self.check_bucket()
        else:
            self._call("create", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def check_bucket(self):
        """CheckpointWriteError (ENOENT) naming the URL when the store's bucket does not
        exist (nothing to check for a store without buckets)."""
        if (why := self._missing_bucket()) is not None:
            raise CheckpointWriteError(_errno.ENOENT, f"{self.url}: {why}")

    def _missing_bucket(self) -> str | None:
        if self.local or self.protocol not in BUCKET_STORES:
            return None
        bucket = self.root.lstrip("/").split("/", 1)[0]
        try:
            if self._call("reach", lambda: self.fs.exists(bucket), missing_ok=True):
                return None
        except FileNotFoundError:
            pass  # some stores answer a missing bucket with FileNotFoundError rather than False
        return f"bucket {bucket!r} does not exist"

    def _call(self, what: str, fn, name: str | None = None, missing_ok: bool = False):
        """fn() on the remote filesystem (connecting first, if not yet); any failure as a
        one-line CheckpointWriteError without credentials. With missing_ok a
        FileNotFoundError stays one (a read or a removal of what is not there)."""
        try:
            return fn()
        except CheckpointWriteError:
            raise
        except FileNotFoundError:
            if missing_ok:
                raise
            why = self._missing_bucket() or "not found"  # the object, or its whole bucket
            raise CheckpointWriteError(_errno.ENOENT, f"{self.where(name) if name else self.url}: cannot {what}: "
                                                      f"{why}") from None
        except Exception as e:
            code = getattr(e, "errno", None) or _errno.EIO
            raise CheckpointWriteError(code, f"{self.where(name) if name else self.url}: cannot {what}: "
                                             f"{_one_line(e, self.secrets)}") from None

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
                final = self._key(name)
                direct = self.protocol in BUCKET_STORES  # the commit is atomic: no move
                target = final if direct else self._key(f"{name}.tmp-{uuid.uuid4().hex[:12]}")
                try:
                    f = self.fs.open(target, "wb", autocommit=False)
                    try:
                        hashed(f)
                        f.close()
                    except BaseException:
                        f.discard()  # s3fs: aborts the multipart upload
                        raise
                    f.commit()
                    if not direct:
                        self.fs.mv(target, final)
                except BaseException:
                    if not direct:  # what a filesystem stored before its commit, or the move
                        try:
                            self.fs.rm(target)
                        except Exception:
                            pass
                    raise
            self._call("write", put, name)
        return box[0].size, box[0].sha.hexdigest()

    def read(self, name: str) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""
        if self.local:
            return (self.path / name).read_bytes()
        return self._call("read", lambda: self.fs.cat_file(self._key(name)), name, missing_ok=True)

    def exists(self, name: str) -> bool:
        if self.local:
            return (self.path / name).exists()
        return bool(self._call("read", lambda: self.fs.exists(self._key(name)), name))

    def names(self) -> set[str]:
        """The files in the directory (a temporary included: callers match names)."""
        if self.local:
            return {p.name for p in self.path.iterdir()} if self.path.is_dir() else set()
        try:
            listed = self._call("list", lambda: self.fs.ls(self.root, detail=False), missing_ok=True)
        except FileNotFoundError:
            return set()
        return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed}

    def remove(self, name: str):
        """FileNotFoundError when it is gone already; CheckpointWriteError otherwise."""
        if self.local:
            (self.path / name).unlink()
        else:
            self._call("remove", lambda: self.fs.rm(self._key(name)), name, missing_ok=True)


def open_store(target, options: dict | None = None) -> Store:
    return target if isinstance(target, Store) else Store(target, options)
