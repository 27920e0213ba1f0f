"""The project's own development tools, run from a checkout (not in the
wheel): the test matrix and release tables (``tools.matrix``), the fill's step
benchmark (``python -m tools.bench``), the prepared GPU check (``python
tools/gpu_check.py``) and the lint's relative-link check."""
