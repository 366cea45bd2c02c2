"""Build the flash_attention_sm75._C extension (SM75 FlashAttention kernels + op registration).

Build against the torch you already have (Colab, Kaggle, any CUDA build of torch >= 2.6):

    pip install --no-build-isolation .        # or -e . for a development checkout

Without --no-build-isolation pip builds in a fresh environment with the newest torch from PyPI,
and the extension then only loads with that torch.

Before compiling, setup.py checks that torch is a CUDA build >= 2.6, that a CUDA toolkit (nvcc)
is there and that its major version is the one torch was built with (torch.version.cuda), and
stops with the fix when one of them is not.

Environment knobs:
  TORCH_CUDA_ARCH_LIST  architectures to build; default "7.5+PTX" (Turing SASS plus PTX that the
                        driver JIT-compiles on newer GPUs). A user-set value is honoured.
  MAX_JOBS              parallel compile jobs (ninja).
  NVCC_THREADS          nvcc --threads (default 2).
  CUDA_HOME             the CUDA toolkit to compile with (default: torch's choice: $CUDA_HOME,
                        $CUDA_PATH, the nvcc on PATH, /usr/local/cuda).
  FLASH_SM75_SKIP_CUDA_VERSION_CHECK=1
                        experts only: build even when nvcc's CUDA major version differs from
                        torch's or torch is a CPU-only build (skips this file's check and
                        torch's own major-version check). The result may not link or load.
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5+PTX")

ROOT = os.path.dirname(os.path.abspath(__file__))
SKIP_CHECK_ENV = "FLASH_SM75_SKIP_CUDA_VERSION_CHECK"
MIN_TORCH = (2, 6)  # keep in step with pyproject.toml (dependencies, build-system requires)
PACKAGES = find_packages(ROOT, include=["flash_attention_sm75", "flash_attention_sm75.*"])


def fail(message):
    """Stop the build with a message that pip shows in full (no traceback)."""
    sys.exit("\n" + "=" * 78 + "\nflash-attention-sm75: cannot build\n\n" + message.strip()
             + "\n" + "=" * 78)


def nvcc_release(nvcc):
    """'13.0' from `nvcc --version`, or None when it does not run or says no release."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def torch_wheel_index(cuda):
    """The download.pytorch.org index that serves torch for CUDA `cuda` ('12.8' -> cu128)."""
    major, minor = cuda.split(".")[:2]
    return f"https://download.pytorch.org/whl/cu{major}{minor}"


def torch_swap_commands(cuda, torch_version):
    """Commands that replace the installed torch by a build of the same version for CUDA `cuda`.
    A plain `pip install torch --index-url ...` keeps an installed torch ("Requirement already
    satisfied"), so the old one is uninstalled first; the version is pinned so that an index
    whose newest torch is older (cu124 ends at 2.6) fails instead of quietly downgrading."""
    version = torch_version.split("+")[0]
    return f"""pip uninstall -y torch torchvision torchaudio
        pip install torch=={version} --index-url {torch_wheel_index(cuda)}
    (add torchvision / torchaudio to the second command if you use them. Not every CUDA minor
    version has an index, and an index carries only some torch versions: if pip finds no
    torch {version} there, take another CUDA {cuda.split('.')[0]}.x index that has it
    (pytorch.org/get-started/previous-versions lists them, e.g. cu126 / cu128 for 12.x and
    cu130 for 13.x), or drop the pin to accept that index's newest torch)"""


def check_toolchain(torch):
    """Stop with the fix when torch is too old or a CPU-only build, when no CUDA toolkit is
    found, or when nvcc's major version differs from torch's CUDA (a minor difference is fine:
    torch itself only warns). Returns nvcc's version ('13.0'), or None when skipped."""
    from torch.utils.cpp_extension import CUDA_HOME

    tv = torch.__version__
    if tuple(int(x) for x in re.findall(r"\d+", tv)[:2]) < MIN_TORCH:
        fail(f"torch {tv} is older than the supported minimum {MIN_TORCH[0]}.{MIN_TORCH[1]}: "
             f"upgrade it (pip install -U torch, or a newer build for your CUDA).")
    if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0"):
        print(f"flash-attention-sm75: {SKIP_CHECK_ENV} is set: nvcc is not checked against torch "
              f"(torch {tv}, torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME})")
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    release = nvcc_release(nvcc) if nvcc and os.path.exists(nvcc) else None
    cuda = torch.version.cuda
    if cuda is None:
        fail(f"""torch {tv} is a CPU-only build (torch.version.cuda is None).
The extension links against torch's CUDA libraries, which a CPU-only torch does not have.
Install the CUDA build of torch for your toolkit ({f"nvcc {release} at {nvcc}" if release
else "no nvcc found"}):
    {torch_swap_commands(release or "12.8", tv)}
({SKIP_CHECK_ENV}=1 tries anyway.)""")
    if release is None:
        where = (f"{nvcc} did not run or printed no 'release X.Y'" if nvcc and os.path.exists(nvcc)
                 else f"CUDA_HOME={CUDA_HOME} has no bin/nvcc" if CUDA_HOME
                 else "no nvcc on PATH, CUDA_HOME / CUDA_PATH unset, no /usr/local/cuda")
        fail(f"""No usable CUDA toolkit ({where}).
The kernels are compiled by nvcc from a CUDA {cuda.split('.')[0]}.x toolkit, the CUDA major version
torch {tv} was built with (CUDA {cuda}). Install one and point the build at it:
  * Debian/Ubuntu with NVIDIA's apt repository (developer.nvidia.com/cuda-downloads):
        apt-get install cuda-toolkit-{cuda.replace('.', '-')}
  * or conda:  conda install -c nvidia cuda-toolkit={cuda}
then
    export CUDA_HOME=/usr/local/cuda-{cuda}     # the toolkit's root, the folder with bin/nvcc
    pip install --no-build-isolation .""")
    if release.split(".")[0] != cuda.split(".")[0]:
        fail(f"""CUDA version mismatch: nvcc is CUDA {release} ({nvcc}), torch {tv} was built with
CUDA {cuda}. The extension must be compiled with torch's CUDA major version. Either
  * build with a CUDA {cuda.split('.')[0]}.x toolkit (CUDA {cuda} matches exactly):
        CUDA_HOME=/usr/local/cuda-{cuda} pip install --no-build-isolation .
    (get one from developer.nvidia.com/cuda-downloads, or: conda install -c nvidia cuda-toolkit={cuda})
  * or install the torch build for CUDA {release}, then build again:
        {torch_swap_commands(release, tv)}
Experts: {SKIP_CHECK_ENV}=1 builds anyway (unsupported: the extension then loads two CUDA
runtimes and needs a driver for CUDA {release}).""")
    if release != cuda:
        print(f"flash-attention-sm75: nvcc is CUDA {release}, torch {tv} was built with CUDA {cuda}: "
              f"same major version, fine.")
    return release


def build_info_text(torch, nvcc):
    return ("# Written by setup.py when the extension is built; not tracked by git.\n"
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"TORCH_CUDA = {torch.version.cuda!r}\n"
            f"NVCC = {nvcc!r}\n")


def build_ext_class(cpp_extension, torch, nvcc):
    """torch's BuildExtension, plus ``_build_info.py`` beside the built ``_C`` (and in the source
    tree for in-place and editable builds): the torch (and nvcc) it was compiled against, which
    the package names when it is loaded with another torch."""

    class BuildExt(cpp_extension.BuildExtension):
        def run(self):
            super().run()
            dirs = {os.path.dirname(self.get_ext_fullpath(ext.name)) for ext in self.extensions}
            if self.inplace or getattr(self, "editable_mode", False):
                dirs.add(os.path.join(ROOT, "flash_attention_sm75"))
            for d in dirs:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "_build_info.py"), "w") as f:
                    f.write(build_info_text(torch, nvcc))

    return BuildExt


def sources():
    files = ["csrc/flash_api.cpp", "csrc/torch_bindings.cpp", "csrc/python_module.cpp",
             "csrc/kernels/flash_fwd_dispatch.cpp", "csrc/flash_bwd_api.cpp",
             "csrc/kernels/flash_bwd_dispatch.cpp", "csrc/flash_varlen_api.cpp",
             "csrc/flash_kvcache_api.cpp", "csrc/kernels/kvcache_append.cu"]
    files += sorted(glob.glob("csrc/kernels/instantiations/*.cu"))
    return files


# No -std flag: torch adds the C++ standard its headers need (C++17 for torch 2.6-2.11, C++20
# for 2.15, whose headers reject C++17); our sources compile as either.
nvcc_flags = [
    "-O3",
    "--use_fast_math",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "--threads", os.environ.get("NVCC_THREADS", "2"),
    "-Xptxas=-warn-spills",
]


def build_setup_kwargs():
    """Everything setup() needs; imports torch (the build's torch) and checks the toolchain."""
    try:
        import torch
    except ImportError:
        fail("torch is not importable in the build environment. Install torch first (a CUDA build, "
             ">= 2.6), then build with the torch you have: pip install --no-build-isolation .")
    nvcc = check_toolchain(torch)
    from torch.utils import cpp_extension

    if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0") and hasattr(cpp_extension,
                                                                       "_check_cuda_version"):
        # torch's own check raises for a major mismatch; the expert override skips it too.
        cpp_extension._check_cuda_version = lambda *args, **kwargs: None
    return dict(
        packages=PACKAGES,
        ext_modules=[
            cpp_extension.CUDAExtension(
                name="flash_attention_sm75._C",
                sources=sources(),
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={"cxx": ["-O3", "-DPy_LIMITED_API=0x030A0000"],
                                    "nvcc": nvcc_flags},
                py_limited_api=True,
            )
        ],
        cmdclass={"build_ext": build_ext_class(cpp_extension, torch, nvcc)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


if __name__ == "__main__":  # pip and `python setup.py` (tests import this file for its checks)
    # pip asks for metadata (egg_info / dist_info) before it builds; those steps need neither
    # torch nor nvcc, so the checks (and their messages) come once, with the build.
    metadata_only = any(cmd in sys.argv[1:] for cmd in ("egg_info", "dist_info", "sdist", "clean"))
    setup(**({"packages": PACKAGES} if metadata_only else build_setup_kwargs()))
