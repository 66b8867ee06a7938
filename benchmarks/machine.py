"""The one-line description of the machine every benchmark prints with its figures."""
from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    fallback = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        fallback)
    except OSError:
        return fallback


def machine() -> str:
    """CPU model, cores, memory, kernel and the Python, torch and numpy versions."""
    import numpy as np
    import torch
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (f"{cpu_model()}, nproc {os.cpu_count()}, {mem / (1 << 30):.0f} GiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}")
