"""moedoctor's bootstrap, put first on PYTHONPATH by ``moedoctor run`` for the job's processes.

It does nothing until the process imports torch; then it installs the recorder, which opens this
rank's trace when ``torch.distributed`` initializes, and the fixes named in ``MOEDOCTOR_FIXES``
(``moedoctor verify``, ``moedoctor run --fix``). Any other ``sitecustomize`` on the path runs
afterwards as it would have without moedoctor.
"""

import os
import sys


def _activate() -> None:
    try:
        from moedoctor import environment  # the contract's leaf: imports only os

        record = environment.RUN_DIR.is_set()
        fix = environment.FIXES.is_set()
        if not (record or fix):
            return
        from moedoctor._imports import when_imported

        if record:
            from moedoctor.recorder.install import activate_from_env

            when_imported("torch", lambda _module: activate_from_env())
        if fix:  # after the recorder, so the fixes' own collectives are recorded too
            from moedoctor.fixes.rewrite import install_import_hook

            install_import_hook()  # the `if`s a fix names in modules the job imports
            from moedoctor.fixes.runtime import activate_from_env as activate_fixes

            when_imported("torch", lambda _module: activate_fixes())
    except Exception as e:  # never stop the user's job from starting
        print(f"moedoctor: not installed: {e!r}", file=sys.stderr)


def _chain_next_sitecustomize() -> None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_moedoctor_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_activate()
_chain_next_sitecustomize()
