"""What the startup modules (noxfile.install_startup_module) are built on:
a change made to a vLLM module right after it first runs, before anything
else can use it. Installed beside them as ``_kvfill_on_load``. This module
and theirs import the standard library only, and nothing before the module
they change is imported: the test process's zygote must start before vLLM
and wrapt are imported.
"""

import importlib.abc
import importlib.machinery
import sys


class _ChangeOnLoad(importlib.abc.MetaPathFinder):
    def __init__(self, name, change):
        self.name, self.change = name, change

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_change(module):
            exec_module(module)
            self.change(module)

        spec.loader.exec_module = exec_and_change
        return spec


def change_on_load(name, change):
    """Call `change(module)` once module `name` has run, when it is imported."""
    sys.meta_path.insert(0, _ChangeOnLoad(name, change))
