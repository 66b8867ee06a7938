"""Build of the Cython batch kernel, the ring indexer, the capture-file mapping and the TX-ring sender (cython_ext/); the metadata is in pyproject.toml.

The kernel is batch.pyx plus plain C beside it (crc.c: the folding CRC and the ICRC;
lines.c: NCCL LL lines and coverage bitmaps) and wire.pxd (the wire constants it shares
with the Python reference); MANIFEST.in ships them in the sdist."""
from Cython.Build import cythonize
from setuptools import Extension, setup

KERNEL_C = ["cython_ext/crc.c", "cython_ext/lines.c"]
KERNEL_HEADERS = ["cython_ext/crc.h", "cython_ext/lines.h", "cython_ext/wire.pxd"]

extensions = [
    Extension("cython_ext.batch", ["cython_ext/batch.pyx", *KERNEL_C], include_dirs=["cython_ext"],
              depends=KERNEL_HEADERS, libraries=["z"], extra_compile_args=["-O3"]),
    Extension("cython_ext.ring", ["cython_ext/ring.pyx"], include_dirs=["cython_ext"],
              depends=["cython_ext/ringword.h"], extra_compile_args=["-O3"]),
    # the benchmarks' sender: a capture out of a PACKET_TX_RING (ckptd.testing.txring)
    Extension("cython_ext.txring", ["cython_ext/txring.pyx"], include_dirs=["cython_ext"],
              depends=["cython_ext/ringword.h"], extra_compile_args=["-O3"]),
    Extension("cython_ext.filemap", ["cython_ext/filemap.pyx"]),
    # capabilities dropped in every thread (ckptd.live.privilege)
    Extension("cython_ext.caps", ["cython_ext/caps.pyx", "cython_ext/capdrop.c"], include_dirs=["cython_ext"],
              depends=["cython_ext/capdrop.h"]),
]

setup(ext_modules=cythonize(extensions, language_level=3))
