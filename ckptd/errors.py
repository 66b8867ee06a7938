"""The one base of every error ckptd raises on purpose: the command line turns each into
one line naming what was wrong and where (file, frame, flow, config key) and exit 2."""


class CkptdError(Exception):
    """Bad input or an impossible request, said in words a user can act on."""
