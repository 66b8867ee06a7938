"""Build of the Cython batch kernel and ring indexer (cython_ext/); the metadata is in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension("cython_ext.batch", ["cython_ext/batch.pyx"], libraries=["z"], extra_compile_args=["-O3"]),
    Extension("cython_ext.ring", ["cython_ext/ring.pyx"], extra_compile_args=["-O3"]),
]

setup(ext_modules=cythonize(extensions, language_level=3))
