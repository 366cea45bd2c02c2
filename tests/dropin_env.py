"""Install the optional ``flash_attn`` drop-in (flash_attn_dropin/) for a test and let
transformers see it, then undo every trace (shared by tests/test_flash_attn_dropin*.py).

* :func:`install_dropin` runs ``pip install --no-deps --no-build-isolation --target DIR`` on a
  copy of ``flash_attn_dropin/`` (the real build: wheel metadata, top_level, RECORD), so the
  test sees what a user's ``pip install ./flash_attn_dropin`` gives.
* :func:`dropin_visible` puts that directory first on ``sys.path`` and resets transformers'
  cached availability checks (also transformers 5.17's import-time distribution map), optionally
  pretending a CUDA device exists (``is_flash_attn_2_available`` asks
  ``torch.cuda.is_available()``); on exit it removes the imported ``flash_attn`` modules and
  clears the caches again, so later tests see the environment as it was.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DROPIN_SRC = os.path.join(ROOT, "flash_attn_dropin")

_TRANSFORMERS_CACHED = ("is_flash_attn_2_available", "is_flash_attn_3_available",
                        "is_flash_attn_4_available", "is_flash_attn_greater_or_equal",
                        "is_torch_cuda_available")


def install_dropin(workdir: str) -> str:
    """``pip install`` the drop-in into ``workdir/site`` (from a copy of its source, so that the
    build leaves nothing in the tree); returns that directory."""
    src = os.path.join(workdir, "src")
    site = os.path.join(workdir, "site")
    shutil.copytree(DROPIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                   "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-compile", "--target", site, src],
                   check=True, capture_output=True, text=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return site


def _clear_transformers_caches() -> None:
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    for name in _TRANSFORMERS_CACHED:
        fn = getattr(import_utils, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _drop_flash_attn_modules() -> None:
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


@contextlib.contextmanager
def dropin_visible(monkeypatch, site: str, fake_cuda: Optional[bool] = None):
    """Within the block, ``import flash_attn`` gives the drop-in installed in ``site`` and
    transformers' availability checks re-read the environment. ``fake_cuda``: True / False make
    ``torch.cuda.is_available()`` say so (a CUDA device present or not, whatever this machine
    has); None leaves it alone."""
    import torch

    _drop_flash_attn_modules()
    monkeypatch.syspath_prepend(site)
    if fake_cuda is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: fake_cuda)
    try:
        import transformers.modeling_flash_attention_utils as mfau
        from transformers.utils import import_utils
    except ImportError:
        mfau = import_utils = None
    if import_utils is not None:
        fresh = importlib.metadata.packages_distributions()
        for module in (import_utils, mfau):
            if hasattr(module, "PACKAGE_DISTRIBUTION_MAPPING"):  # transformers <= 5.17
                monkeypatch.setattr(module, "PACKAGE_DISTRIBUTION_MAPPING", fresh)
        # the flash functions transformers loaded last (restored on exit)
        for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn",
                     "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn",
                     "_process_with_kvcache_kwargs_fn"):
            if hasattr(mfau, name):
                monkeypatch.setattr(mfau, name, None)
    _clear_transformers_caches()
    try:
        yield
    finally:
        _drop_flash_attn_modules()
        _clear_transformers_caches()
        importlib.invalidate_caches()
