"""The one base of every error ckptd raises on purpose: the command line turns each into
one line naming what was wrong and where (file, frame, flow, config key) and exit 2."""
import datetime
import os


class CkptdError(Exception):
    """Bad input or an impossible request, said in words a user can act on."""


class CaptureDamage(str):
    """An entry of a pipeline's errors list: capture file `path` could not be read to its
    end (not a capture, cut short, a read error). The text is the reader's, for people;
    `path` is what `ckptd replay` decides its exit status by, so rewording a message
    cannot change it. A str, so whatever prints or logs the errors reads it as any other.
    `refused`: nothing of it was ever a capture ckptd reads (no pcap or pcapng header, or
    a link type it does not decode: parsers' NotACaptureError, UndecodedLinkTypeError),
    which a pipe's reader finds only once the run is under way; replay makes it the
    error a file's is up front."""
    path: str
    refused: bool

    def __new__(cls, path, message):
        from parsers.frame import NotACaptureError, UndecodedLinkTypeError
        self = super().__new__(cls, str(message))
        self.path = str(path)
        self.refused = isinstance(message, (NotACaptureError, UndecodedLinkTypeError))
        return self


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type's name where it has none); an OS
    error of a path as `path: reason`, not Python's "[Errno 40] Too many levels of
    symbolic links: 'x'"."""
    if isinstance(e, OSError) and not isinstance(e, CkptdError) and e.filename is not None and e.strerror:
        text = f"{os.fsdecode(e.filename)}: {e.strerror}"
    else:
        text = str(e)
    return " ".join(text.split()) or type(e).__name__


def show(v, limit: int = 60) -> str:
    """A value from a user's file, for an error message: short whatever it is.

    Never repr() a parsed value whole: a YAML alias bomb (or a pickle that shares one list
    many times over) is a few lines that expand to billions of nodes when walked (repr,
    str, ==, len of the nested lists), a string may be megabytes, and repr() of an int
    over 4300 digits raises. Containers show as their type and length, strings and
    numbers cut to about `limit` characters."""
    if v is None or isinstance(v, (bool, float, datetime.date)):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 64 else f"an integer of {v.bit_length()} bits"
    if isinstance(v, str):
        return repr(v) if len(v) <= limit else f"{v[:limit]!r}... ({len(v)} characters)"
    if isinstance(v, list):
        return f"a list of {len(v)} item(s)"
    if isinstance(v, dict):
        return f"a mapping of {len(v)} key(s)"
    if isinstance(v, (bytes, bytearray)):
        return f"{len(v)} bytes"
    return f"a {type(v).__name__}"


def unknown_keys(where: str, keys, known) -> str | None:
    """The one wording of a mapping's unknown keys, for every file ckptd reads (plan,
    daemon config, cabling): `WHERE: unknown keys ['a', 'b'] (known: x, y)` (WHERE may be
    empty: the message's prefix then says where), or None
    where every key is known. A misspelt key is refused, never read as its default;
    at most five are named, each cut to 40 characters or shown by `show` (a YAML key can
    be any scalar, an integer of 5,000 digits included)."""
    unknown = sorted(k[:40] if isinstance(k, str) else show(k, 40) for k in keys if k not in known)
    if not unknown:
        return None
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return f"{where + ': ' if where else ''}unknown keys {unknown[:5]}{more} (known: {', '.join(map(str, known))})"
