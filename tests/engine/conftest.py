"""The engines' environment, set before tests/conftest.py forks the zygote,
of which every probe is a child."""

import os

from tests.engine.helpers import EAGER_ENV

os.environ.update(EAGER_ENV)
