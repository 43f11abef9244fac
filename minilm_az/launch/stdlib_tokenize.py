"""Why `import tokenize` still finds the standard library when tokenize.py sits at the repository root.

The pipeline needs the root script's name, tokenize.py, which is also the name of a standard-library module
(linecache and inspect import it, so torch and pytest do too). Whenever the root is on sys.path, Python finds
our file first. tokenize.py then calls `become_stdlib_tokenize`: it loads the real module and puts it in
sys.modules, and the importer hands that back instead of our script.

Only the standard library's import machinery is used here, because the half-imported `tokenize` in
sys.modules is ours until this function returns.
"""

import importlib.machinery
import importlib.util
import os
import sys


def become_stdlib_tokenize(script: str) -> None:
    """Load the standard-library `tokenize` from sys.path without the script's own folder, and register it."""
    here = os.path.dirname(os.path.realpath(script))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("tokenize", path)
    if spec is None:
        raise ImportError("cannot find the standard-library tokenize module behind tokenize.py")
    stdlib = importlib.util.module_from_spec(spec)
    sys.modules["tokenize"] = stdlib
    spec.loader.exec_module(stdlib)
