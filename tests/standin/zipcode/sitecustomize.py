"""Compiled code for zip imports, shared between processes: on PYTHONPATH (with DFLASH_ZIPCODE_CACHE
naming a directory) for the Ansible runs against the PVE API stand-in.

Every module run that Ansible starts imports ansible.module_utils from the zip its AnsiballZ wrapper
unpacks, and zipimport compiles each source anew (it writes no .pyc): about a third of a module
run's CPU, in every one of the hundreds of runs a test file makes. Here the code compiled from a
source is kept in the directory, named by the source's hash and the interpreter's bytecode magic,
and loaded from there by the next process: the same code, as a .pyc would give it. Nothing else
changes, and without DFLASH_ZIPCODE_CACHE this does nothing.
"""

import os
import zipimport

_DIR = os.environ.get("DFLASH_ZIPCODE_CACHE")


def _install(cache_dir: str) -> None:
    import _frozen_importlib_external
    import hashlib
    import marshal

    compile_source = zipimport._compile_source
    magic = _frozen_importlib_external.MAGIC_NUMBER.hex()

    def _retarget(code, filename):
        """The cached code with this run's path as its file name (tracebacks), nested code included."""
        consts = tuple(_retarget(c, filename) if isinstance(c, type(code)) else c for c in code.co_consts)
        return code.replace(co_filename=filename, co_consts=consts)

    def cached_compile(pathname, source):
        path = os.path.join(cache_dir, f"{hashlib.sha256(source).hexdigest()}-{magic}")
        try:
            with open(path, "rb") as f:
                code = marshal.load(f)
        except (OSError, EOFError, ValueError, TypeError):
            code = compile_source(pathname, source)
            tmp = f"{path}.{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    marshal.dump(code, f)
                os.replace(tmp, path)           # whole or not at all, for a process reading it now
            except OSError:
                pass
            return code
        return code if code.co_filename == pathname else _retarget(code, pathname)

    zipimport._compile_source = cached_compile


if _DIR and os.path.isdir(_DIR):
    _install(_DIR)
