"""The drop-in's PEP 517 build backend: setuptools' own, which refuses to build the wheel (what
``pip install ./flash_attn_dropin`` installs) while a real flash-attn is installed.

The drop-in's distribution name is ``flash-attn`` (transformers' availability check needs that
name), so pip would uninstall a real flash-attn to install it, without asking. It is meant to
replace one only on purpose: uninstall flash-attn first, or set
``FLASH_ATTN_SM75_DROPIN_REPLACE=1`` for the install. A build backend is the one place a plain
``pip install`` runs code of the package before it installs anything (a wheel has no install
hooks), so the check lives here, in the metadata and wheel hooks pip calls first.

Where to look: pip's build isolation hides the target environment's site-packages from this
process (it sets ``PYTHONPATH`` / ``PYTHONNOUSERSITE`` to an overlay), so the check asks both
this process (``--no-build-isolation`` builds see the target environment here) and the same
interpreter started with ``-E`` (its own site-packages and user site, as a plain ``python``
sees them). A frontend that builds with another interpreter (e.g. uv's isolated build
environments) may not be seen through: the README says to uninstall a real flash-attn first.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook not wrapped below)

ENV_VAR = "FLASH_ATTN_SM75_DROPIN_REPLACE"

def _real_flash_attn_here() -> list:
    """``[version, location]`` of the distributions named flash-attn without the drop-in's
    ``+sm75`` label on this process's path (self-contained: also run in a child interpreter)."""
    import importlib.metadata
    import re

    found = []
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if name == "flash-attn" and "+sm75" not in (dist.version or ""):
            found.append([dist.version, str(dist.locate_file(""))])
    return found


_QUERY = (inspect.getsource(_real_flash_attn_here)
          + "\nimport json\nprint(json.dumps(_real_flash_attn_here()))\n")


def _query_interpreter() -> list:
    """What ``python -E`` (this interpreter without pip's environment) sees; [] if it cannot
    run (the check is a safeguard, not a requirement of the build)."""
    try:
        r = subprocess.run([sys.executable, "-E", "-c", _QUERY], capture_output=True, text=True,
                           timeout=120)
        return json.loads(r.stdout) if r.returncode == 0 else []
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def real_flash_attn_installs() -> list:
    """``[version, location]`` of every real (not ``+sm75``) flash-attn found."""
    found = []
    for item in _real_flash_attn_here() + _query_interpreter():
        if item not in found:
            found.append(item)
    return found


def check_no_real_flash_attn() -> None:
    """Stop the build (``SystemExit`` with the message: pip shows it without a traceback) when a
    real flash-attn is installed, unless ``FLASH_ATTN_SM75_DROPIN_REPLACE=1``."""
    if os.environ.get(ENV_VAR, "").strip() == "1":
        return
    found = real_flash_attn_installs()
    if not found:
        return
    where = "; ".join(f"flash-attn {v} in {loc}" for v, loc in found)
    raise SystemExit(
        f"flash_attn_dropin: a real flash-attn is installed ({where}). The drop-in's "
        f"distribution is also named flash-attn, so installing it would uninstall that one. "
        f"To replace it on purpose, run `pip uninstall flash-attn` first, or set {ENV_VAR}=1 "
        f"for this install (`{ENV_VAR}=1 pip install ./flash_attn_dropin`); "
        f"`pip install flash-attn` brings the real one back later.")


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    check_no_real_flash_attn()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    check_no_real_flash_attn()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    check_no_real_flash_attn()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    check_no_real_flash_attn()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
