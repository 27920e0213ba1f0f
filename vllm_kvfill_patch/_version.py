"""This hot-fix's version: the one place it is written (pyproject.toml reads
it), so that a plain copy of the package, without installed metadata (on
PYTHONPATH, or in Ray's ``runtime_env`` ``py_modules``), knows it too."""

__version__ = "0.11.0"
