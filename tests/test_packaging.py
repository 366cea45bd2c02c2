"""Packaging: setup.py's toolchain check (nvcc vs torch's CUDA, no toolkit, CPU-only torch), the
single version source and the supported torch range in pyproject.toml. CPU only, no compiling:
setup.py is imported (its setup() call only runs as __main__) and fed stand-ins for torch and
nvcc."""
import importlib.util
import os
import re
import stat
import sys
import types

import pytest
import torch.utils.cpp_extension

import flash_attention_sm75 as fa
from flash_attention_sm75 import _ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("_flash_sm75_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_torch(version, cuda):
    return types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda))


@pytest.fixture
def toolkit(tmp_path, monkeypatch):
    """A stand-in CUDA toolkit whose nvcc reports `release`; returns a function that installs it
    (or none: release=None) as torch's CUDA_HOME."""
    monkeypatch.delenv("FLASH_SM75_SKIP_CUDA_VERSION_CHECK", raising=False)

    def use(release, with_nvcc=True):
        home = tmp_path / f"cuda-{release}"
        (home / "bin").mkdir(parents=True)
        if with_nvcc:
            nvcc = home / "bin" / "nvcc"
            nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                            f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
            nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME",
                            None if release is None else str(home))
        return home

    return use


def build_error(setup_py, torch_stand_in):
    with pytest.raises(SystemExit) as e:
        setup_py.check_toolchain(torch_stand_in)
    return str(e.value.code)


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in nvcc is a shell script")
class TestToolchainCheck:
    def test_matching_major_builds(self, setup_py, toolkit, capsys):
        toolkit("13.0")
        assert setup_py.check_toolchain(fake_torch("2.11.0+cu130", "13.0")) == "13.0"
        assert capsys.readouterr().out == ""

    def test_minor_mismatch_builds_with_a_note(self, setup_py, toolkit, capsys):
        toolkit("13.0")
        assert setup_py.check_toolchain(fake_torch("2.15.0+cu132", "13.2")) == "13.0"
        assert "same major version" in capsys.readouterr().out

    def test_major_mismatch_stops_with_both_fixes(self, setup_py, toolkit):
        home = toolkit("13.0")
        msg = build_error(setup_py, fake_torch("2.11.0+cu128", "12.8"))
        assert "CUDA version mismatch" in msg and str(home / "bin" / "nvcc") in msg
        assert "CUDA_HOME=/usr/local/cuda-12.8 pip install --no-build-isolation ." in msg
        # the same torch version for the other CUDA: never a silent downgrade (cu124 ends at 2.6)
        assert "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130" in msg
        # pip keeps an installed torch ("Requirement already satisfied"): uninstall it first
        assert "pip uninstall -y torch" in msg
        assert "FLASH_SM75_SKIP_CUDA_VERSION_CHECK=1" in msg

    def test_no_toolkit_stops_with_the_fix(self, setup_py, toolkit):
        toolkit(None)
        msg = build_error(setup_py, fake_torch("2.10.0+cu128", "12.8"))
        assert "No usable CUDA toolkit" in msg and "no nvcc on PATH" in msg
        assert "apt-get install cuda-toolkit-12-8" in msg
        assert "export CUDA_HOME=/usr/local/cuda-12.8" in msg

    def test_cuda_home_without_nvcc(self, setup_py, toolkit):
        home = toolkit("12.8", with_nvcc=False)
        msg = build_error(setup_py, fake_torch("2.10.0+cu128", "12.8"))
        assert f"CUDA_HOME={home} has no bin/nvcc" in msg

    def test_cpu_only_torch_stops(self, setup_py, toolkit):
        toolkit("12.8")
        msg = build_error(setup_py, fake_torch("2.11.0+cpu", None))
        assert "CPU-only build" in msg
        assert "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128" in msg
        # pip keeps an installed torch ("Requirement already satisfied"): uninstall it first
        assert "pip uninstall -y torch" in msg

    def test_torch_older_than_the_minimum_stops(self, setup_py, toolkit):
        toolkit("12.4")
        msg = build_error(setup_py, fake_torch("2.5.1+cu124", "12.4"))
        assert "older than the supported minimum 2.6" in msg

    def test_override_skips_the_check(self, setup_py, toolkit, monkeypatch, capsys):
        toolkit("13.0")
        monkeypatch.setenv("FLASH_SM75_SKIP_CUDA_VERSION_CHECK", "1")
        assert setup_py.check_toolchain(fake_torch("2.6.0+cu124", "12.4")) is None
        assert "is set" in capsys.readouterr().out

    def test_wheel_index(self, setup_py):
        assert setup_py.torch_wheel_index("12.8") == "https://download.pytorch.org/whl/cu128"
        assert setup_py.torch_wheel_index("13.0") == "https://download.pytorch.org/whl/cu130"


def test_build_info_names_the_torch_it_was_built_against(setup_py):
    text = setup_py.build_info_text(fake_torch("2.15.0+cu132", "13.2"), "13.0")
    scope = {}
    exec(text, scope)
    assert (scope["TORCH_VERSION"], scope["TORCH_CUDA"], scope["NVCC"]) == ("2.15.0+cu132", "13.2",
                                                                          "13.0")


def test_build_for_another_torch_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attention_sm75._build_info",
                        types.SimpleNamespace(TORCH_VERSION="0.0.1+elsewhere"))
    assert _ops._built_for_other_torch() == "0.0.1+elsewhere"
    monkeypatch.setitem(sys.modules, "flash_attention_sm75._build_info",
                        types.SimpleNamespace(TORCH_VERSION=_ops.torch.__version__))
    assert _ops._built_for_other_torch() is None


# ------------------------------------------------------------------------------- metadata


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return f.read()


def test_version_has_one_source():
    text = pyproject()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, flags=re.M), "version is dynamic"
    assert re.search(r'^dynamic\s*=\s*\["version"\]', project, flags=re.M)
    assert 'version = { attr = "flash_attention_sm75.__version__" }' in text
    assert re.fullmatch(r"\d+\.\d+\.\d+", fa.__version__)
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        assert f"## [{fa.__version__}]" in f.read()


def test_torch_range_is_the_same_everywhere(setup_py):
    text = pyproject()
    minimum = ".".join(map(str, setup_py.MIN_TORCH))
    build_requires = re.search(r"^requires\s*=\s*\[(.*)\]", text, flags=re.M).group(1)
    dependencies = re.search(r"^dependencies\s*=\s*\[(.*)\]", text, flags=re.M).group(1)
    assert f'"torch>={minimum}"' in build_requires and f'"torch>={minimum}"' in dependencies
    assert "torch==" not in text and "torch<" not in text  # no pin, no upper bound
