"""The project's own development tools, run from a checkout (not in the
wheel): the fill's step benchmark (``python -m tools.bench``) and the
prepared GPU check (``python tools/gpu_check.py``)."""
