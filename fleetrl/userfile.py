"""Loading a user's Python file named in the config (`path/to/file.py:name` for reward scorers and environments)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from types import ModuleType

_modules: dict[str, ModuleType] = {}
_lock = threading.Lock()  # runner threads and rollout workers may resolve the same file concurrently


class UserFileImportError(Exception):
    """Executing the user's file raised `cause`; callers word the message for their config field."""

    def __init__(self, path: str, cause: Exception) -> None:
        super().__init__(f"importing {path} failed: {type(cause).__name__}: {cause}")
        self.path, self.cause = path, cause


def load_user_file(path: str, prefix: str) -> ModuleType:
    """The module of `path` (absolute or from the cwd), executed once per process and path.

    Raises FileNotFoundError when the file is missing and UserFileImportError when executing it raises.
    """
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    with _lock:
        if path not in _modules:
            # A name unique per path: two user files both called reward.py must not replace each other.
            unique = prefix + hashlib.sha1(path.encode()).hexdigest()[:12]
            module_spec = importlib.util.spec_from_file_location(unique, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            try:
                module_spec.loader.exec_module(module)
            except Exception as exc:
                raise UserFileImportError(path, exc) from exc
            _modules[path] = module
        return _modules[path]
