"""The strongest SM75 peer, ssiu/flash-attention-turing, as a benchmark backend named "ssiu".

Issue 23 compares our kernels with it in the same run. Its repository carries no licence, so
nothing of it is vendored or committed: ``scripts/build_peer.py`` builds a local checkout into
the git-ignored ``.peer/ssiu`` (or ``$FLASH_SM75_SSIU_DIR``), which a GPU run carries along,
and this module loads that build (its module ``flash_attn_turing``: ``fwd(q, k, v, is_causal)
-> [out, lse]`` and ``bwd(q, k, v, out, lse, dout, is_causal) -> [dq, dk, dv]`` on contiguous
BSHD fp16, head_dim 64 or 128) and records the commit the build script wrote next to it.

The adapter takes the benchmarks' BHSD views. A view of BSHD storage (``bench_backward.py
--layout bshd``) is passed as is; contiguous BHSD inputs (``bench_forward.py``) are copied to
BSHD once per input tensor, outside the timed calls, so the peer is timed on its own layout
(the backward's dO too with ``--layout bshd``; with ``bhsd`` its copy is inside the timed
backward). The backend runs only when named in ``--backends`` (its kernels run on the legacy
default stream, and a sticky CUDA error there would end the sweep for every backend).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
ENV_DIR = "FLASH_SM75_SSIU_DIR"
DEFAULT_DIR = ROOT / ".peer" / "ssiu"
INFO_FILE = "PEER_INFO.json"
NAME = "ssiu"
KIND = "peer"  # in the sweeps' "unavailable" reasons
HEAD_DIMS = (64, 128)


def peer_dir() -> Path:
    """Where the peer's build lives: ``$FLASH_SM75_SSIU_DIR`` or ``.peer/ssiu``."""
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def build_found() -> bool:
    """Whether a build (its info file) is in :func:`peer_dir`."""
    return (peer_dir() / INFO_FILE).is_file()


class _BshdCache:
    """Contiguous BSHD copies of the last inputs seen (made on the first, untimed call)."""

    def __init__(self) -> None:
        self.key: Optional[Tuple[int, ...]] = None
        self.value: Tuple[torch.Tensor, ...] = ()

    def get(self, *bhsd: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        views = tuple(t.transpose(1, 2) for t in bhsd)
        if all(v.is_contiguous() for v in views):
            return views
        key = tuple(x for t in bhsd for x in (t.data_ptr(), t._version, *t.shape))
        if key != self.key:
            self.key, self.value = key, tuple(v.detach().contiguous() for v in views)
        return self.value


def read_build_info(d: Path, info_file: str, builder: str,
                    env_dir: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """A local build's info file (what ``builder`` wrote next to it in ``d``): ``(info,
    None)``, or ``({}, why the build is unavailable)``. Shared by the optional backends."""
    info = d / info_file
    if not info.is_file():
        return {}, f"no build in {d} ({builder} builds one; or set ${env_dir})"
    try:
        return json.loads(info.read_text()), None
    except ValueError as e:
        return {}, f"{info} is not valid JSON: {e}"


class Ssiu:
    """The loaded peer: ``error`` says why it is unavailable, ``info`` what was built."""

    def __init__(self) -> None:
        self.mod = None
        d = peer_dir()
        self.info, self.error = read_build_info(d, INFO_FILE, "scripts/build_peer.py", ENV_DIR)
        if self.error is not None:
            return
        sys.path.insert(0, str(d))
        try:
            self.mod = importlib.import_module("flash_attn_turing")
        except Exception as e:  # a build for another torch, a missing library
            self.error = f"import flash_attn_turing from {d} failed: {type(e).__name__}: {e}"
        finally:
            sys.path.remove(str(d))
        self._fwd_in = _BshdCache()
        self._bwd_in = _BshdCache()

    @property
    def available(self) -> bool:
        return self.mod is not None

    def impl_note(self) -> str:
        """The sweeps' note on its records."""
        return f"commit {self.info.get('commit')}"

    def _check(self, q: torch.Tensor) -> None:
        if q.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"ssiu runs head_dim {HEAD_DIMS}, got {q.shape[-1]}")

    def bhsd(self, q, k, v, causal=False):
        """Forward on BHSD views; the output as a BHSD view."""
        self._check(q)
        qs, ks, vs = self._fwd_in.get(q, k, v)
        out = self.mod.fwd(qs, ks, vs, bool(causal))[0]
        return out.transpose(1, 2)

    def autograd_bhsd(self) -> Callable:
        """fn(q, k, v, causal) with the peer's backward behind torch.autograd (BHSD views), as
        the backward benchmark times every backend."""
        peer = self

        class _Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, causal):
                peer._check(q)
                qs, ks, vs = peer._bwd_in.get(q, k, v)
                out, lse = peer.mod.fwd(qs, ks, vs, bool(causal))[:2]
                ctx.save_for_backward(qs, ks, vs, out, lse)
                ctx.causal = bool(causal)
                return out.transpose(1, 2)

            @staticmethod
            def backward(ctx, dout):
                qs, ks, vs, out, lse = ctx.saved_tensors
                dq, dk, dv = peer.mod.bwd(qs, ks, vs, out, lse,
                                          dout.transpose(1, 2).contiguous(), ctx.causal)[:3]
                return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None

        return lambda q, k, v, causal=False: _Fn.apply(q, k, v, causal)


_LOADED: Optional[Ssiu] = None


def load() -> Ssiu:
    """The peer, loaded once per process."""
    global _LOADED
    if _LOADED is None:
        _LOADED = Ssiu()
    return _LOADED
