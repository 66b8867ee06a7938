"""ckptd: checkpoints rebuilt from mirrored allreduce traffic. `ckptd.restore` puts one
back into a training job (ckptd.recovery)."""


def restore(model, optimizer, source, scheduler=None, token=None, timeout: float = 120.0,
            all_or_nothing: bool = False):
    """See ckptd.recovery.restore (imported on first use: torch is heavy)."""
    from ckptd.recovery import restore as _restore
    return _restore(model, optimizer, source, scheduler=scheduler, token=token, timeout=timeout,
                    all_or_nothing=all_or_nothing)
