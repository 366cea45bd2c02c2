"""The SM75 forward and backward kernels, run unchanged on the CPU SIMT emulator (tests/emu/),
against a float64 reference. Needs g++ and the CUDA headers, not a GPU (~1-2 minutes)."""
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "emu"))
import run_emu  # noqa: E402


@pytest.mark.skipif(run_emu.cuda_include() is None or shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="needs g++ and the CUDA headers (cuda_fp16.h)")
def test_kernels_on_emulator():
    assert run_emu.run("quick") == 0
