"""``python -m flash_attention_sm75 run script.py [args...]``: run a script with torch's SDPA on
the SM75 kernels (``enable_sdpa()`` first), for code one cannot edit.

``run -m module [args...]`` runs a module as ``python -m module`` would. A script sees what
``python script.py`` gives it: ``__name__ == "__main__"``, ``__file__`` the script's path made
absolute as Python 3.9+ makes it (joined to the current directory, not normalised, symlinks
kept), the directory of its real path (symlinks resolved) first on ``sys.path``, and
``sys.argv == [script.py, args...]`` where ``sys.argv[0]`` is that same absolute path (Python
keeps it as typed; ``runpy.run_path`` sets it to the path it runs). A script that cannot be opened ends the launcher with one line on stderr and
status 2, as Python does; a module that cannot be found, or a directory without
``__main__.py``, with one line and status 1. ``run -- script.py`` runs ``script.py``, as
``python -- script.py`` does. ``FLASH_ATTENTION_SM75_SDPA=1`` is also set in the environment, so
that child processes which import ``flash_attention_sm75`` enable it as well.
``FLASH_ATTENTION_SM75_SDPA_DEVICES=any`` treats newer GPUs as SM75 (testing).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

PROG = "python -m flash_attention_sm75"

DESCRIPTION = """\
Runs a script (or module) with torch's scaled_dot_product_attention on the SM75
FlashAttention kernels (flash_attention_sm75.enable_sdpa()); calls the kernels cannot take
and GPUs that are not Turing keep torch's kernels."""


def _parser():
    """The launcher's parser and its ``run`` sub-parser."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    run = commands.add_parser(
        "run", help="run a script or module with enable_sdpa()", description=DESCRIPTION,
        usage=f"{PROG} run [-h] (script.py | -m module) [args ...]")
    # REMAINDER: everything from the script (or module) on belongs to it, options included
    # (`run -m pytest -x`, `run train.py --help`), as with python itself.
    run.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="module ...",
                     help="run a library module and its arguments, as python -m module does")
    run.add_argument("script", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
                     help="the script and its arguments")
    return parser, run


def _script_error(script: str):
    """Python's message for a script it cannot open (None if it can), with its path made
    absolute as Python prints it. Directories and zip files are left to runpy (their
    ``__main__``), as Python runs them."""
    if os.path.isdir(script):
        return None
    try:
        with open(script, "rb"):
            return None
    except OSError as e:
        return f"can't open file {_abspath(script)!r}: [Errno {e.errno}] {e.strerror}"


def _module_error(name: str):
    """Python's message for a module ``python -m`` cannot find (None if it can find it). Only
    the lookup: an ImportError raised by the module's own code stays a traceback."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package, an empty or relative name
        found = False
    return None if found else f"No module named {name}"


def _abspath(path: str) -> str:
    # What Python 3.9+ sets as __main__.__file__: the current directory joined to a relative
    # path, without normalising it (os.path.abspath would drop "./" and resolve "..").
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def main(argv=None) -> None:
    parser, run = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    script = args.script
    if script and script[0] == "--":  # `run -- script.py`, as `python -- script.py`
        script = script[1:]
    if args.module is not None:
        if not args.module:
            run.error("argument -m: expected a module name")
        target, rest = args.module[0], args.module[1:]
        error = _module_error(target)
        if error is not None:  # one line and status 1, as `python -m` says it
            sys.stderr.write(f"{PROG} run: {error}\n")
            raise SystemExit(1)
    elif script:
        target, rest = script[0], script[1:]
        error = _script_error(target)
        if error is not None:
            sys.stderr.write(f"{PROG} run: {error}\n")
            raise SystemExit(2)
        if os.path.isdir(target) and not os.path.exists(os.path.join(target, "__main__.py")):
            sys.stderr.write(f"{PROG} run: can't find '__main__' module in "
                             f"{_abspath(target)!r}\n")
            raise SystemExit(1)
    else:
        run.error("give a script (script.py [args ...]) or a module (-m module [args ...])")
    from . import sdpa_override

    try:
        sdpa_override.enable_sdpa()
    except (RuntimeError, ValueError) as e:  # no extension, a bad environment variable
        raise SystemExit(f"{PROG} run: {e}") from None
    os.environ[sdpa_override.ENV_VAR] = "1"
    sys.argv = [target] + rest
    if args.module is not None:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)  # sets sys.argv[0]
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(_abspath(target), run_name="__main__")


if __name__ == "__main__":
    main()
