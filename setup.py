"""Build the flash_attention_sm75._C extension (SM75 FlashAttention kernels + op registration).

Environment knobs:
  TORCH_CUDA_ARCH_LIST  architectures to build; default "7.5+PTX" (Turing SASS plus PTX that the
                        driver JIT-compiles on newer GPUs). A user-set value is honoured.
  MAX_JOBS              parallel compile jobs (ninja).
  NVCC_THREADS          nvcc --threads (default 2).
"""
import glob
import os

from setuptools import find_packages, setup

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5+PTX")

from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources():
    files = ["csrc/flash_api.cpp", "csrc/torch_bindings.cpp", "csrc/python_module.cpp",
             "csrc/kernels/flash_fwd_dispatch.cpp", "csrc/flash_bwd_api.cpp",
             "csrc/kernels/flash_bwd_dispatch.cpp"]
    files += sorted(glob.glob("csrc/kernels/instantiations/*.cu"))
    return files


nvcc_flags = [
    "-O3",
    "-std=c++17",
    "--use_fast_math",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "--threads", os.environ.get("NVCC_THREADS", "2"),
    "-Xptxas=-warn-spills",
]

setup(
    packages=find_packages(include=["flash_attention_sm75", "flash_attention_sm75.*"]),
    ext_modules=[
        CUDAExtension(
            name="flash_attention_sm75._C",
            sources=sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": ["-O3", "-std=c++17", "-DPy_LIMITED_API=0x030A0000"],
                                "nvcc": nvcc_flags},
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
