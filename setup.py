"""ckptd: a checkpoint server that rebuilds the model from mirrored allreduce traffic.

`pip install -e .` builds the Cython batch kernels in cython_ext/ and installs the
`ckptd` console script.
"""
from setuptools import Extension, setup
from Cython.Build import cythonize

extensions = [
    Extension("cython_ext.batch", ["cython_ext/batch.pyx"], libraries=["z"], extra_compile_args=["-O3"]),
]

setup(
    name="ckptd",
    version="0.1.0",
    description="Per-iteration checkpoints rebuilt from mirrored RoCEv2/NCCL allreduce traffic",
    python_requires=">=3.11",
    packages=["ckptd", "parsers", "cython_ext", "switch_config"],
    ext_modules=cythonize(extensions, language_level=3),
    install_requires=[
        "numpy",
        "torch==2.13.0",
        "scapy",
        "dpkt",
        "numba",
        "pyroute2",
        "pyyaml",
        "prometheus-client",
    ],
    extras_require={"test": ["pytest"]},
    entry_points={"console_scripts": ["ckptd=ckptd.cli:main"]},
)
