"""``python -m flash_attention_sm75 run script.py [args...]``: run a script with torch's SDPA on
the SM75 kernels (``enable_sdpa()`` first), for code one cannot edit.

``run -m module [args...]`` runs a module as ``python -m module`` would. The script sees
``sys.argv == [script.py, args...]``, ``__name__ == "__main__"`` and its own directory first on
``sys.path``, as with ``python script.py``. ``FLASH_ATTENTION_SM75_SDPA=1`` is also set in the
environment, so that child processes which import ``flash_attention_sm75`` enable it as well.
``FLASH_ATTENTION_SM75_SDPA_DEVICES=any`` treats newer GPUs as SM75 (testing).
"""
from __future__ import annotations

import os
import runpy
import sys

USAGE = """\
usage: python -m flash_attention_sm75 run script.py [args...]
       python -m flash_attention_sm75 run -m module [args...]

Runs the script (or module) with torch's scaled_dot_product_attention on the SM75
FlashAttention kernels (flash_attention_sm75.enable_sdpa()); calls the kernels cannot take
and GPUs that are not Turing keep torch's kernels.
"""


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return
    if not argv or argv[0] != "run" or len(argv) < 2 or argv[1:2] == ["-m"] and len(argv) < 3:
        sys.stderr.write(USAGE)
        raise SystemExit(2)
    from . import sdpa_override

    try:
        sdpa_override.enable_sdpa()
    except (RuntimeError, ValueError) as e:  # no extension, a bad environment variable
        raise SystemExit(f"python -m flash_attention_sm75 run: {e}") from None
    os.environ[sdpa_override.ENV_VAR] = "1"
    if argv[1] == "-m":
        module, rest = argv[2], argv[3:]
        sys.argv = [module] + rest
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = argv[1], argv[2:]
        sys.argv = [script] + rest
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
