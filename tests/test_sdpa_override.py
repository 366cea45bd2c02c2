"""Transparent SDPA (flash_attention_sm75.sdpa_override): enable_sdpa() makes the SM75 kernels
the CUDA kernels of aten::_scaled_dot_product_efficient_attention and its backward.

CPU (CI):
* the switches: enable/disable leave torch's dispatch table exactly as it was, enabling is
  idempotent and thread-safe, the context manager nests, the environment variables, the
  ``python -m flash_attention_sm75 run`` launcher;
* the kernel path end to end through torch's own autograd formula, by registering the kernels
  for the CPU dispatch key too (torch has no CPU kernel for these ops; the op has a CPU
  reference implementation), also compiled with inductor, whose lowering of these ops is an
  extern call that reaches the registered kernel at run time;
* the fallback's argument mapping to torch's lower-level ops and the outputs' layouts, under
  FakeTensorMode with fake CUDA tensors (compared with torch's meta kernels).

GPU (``@pytest.mark.gpu``; written for an H200, which the tests treat as SM75 with
``treat_as_sm75=True`` and steer to torch's efficient backend with ``sdpa_kernel``): results
against float64 and stock torch, the kernels seen by the profiler, fallback calls bitwise equal
to torch, nn.MultiheadAttention, a timm ViT and a diffusers UNet forward and backward,
torch.compile(fullgraph=True) and CUDA-graph capture.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import flash_attention_sm75 as fa
from flash_attention_sm75 import _rules, sdpa_override as so
from reference import (assert_close_fa, assert_lse_close, attention_ref, cuda_kernels_run,
                       seed_from)
from repo_scripts import ROOT

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")

aten = torch.ops.aten
FWD, BWD = so.OVERRIDDEN_OPS


def dispatch_state():
    """Everything the dispatcher says about the two ops: registrations and computed tables."""
    return [(torch._C._dispatch_dump(name), torch._C._dispatch_dump_table(name))
            for name in so.OVERRIDDEN_OPS]


def significant_strides(t):
    return tuple(st for st, n in zip(t.stride(), t.shape) if n != 1)


def kernel_row(name, key):
    return next(line for line in torch._C._dispatch_dump_table(name).splitlines()
                if line.startswith(key + ":"))


@pytest.fixture(scope="module")
def torch_state():
    """The dispatch state with the override off (taken once, before any test enables it)."""
    so.disable_sdpa()
    return dispatch_state()


@pytest.fixture(autouse=True)
def _override_off(monkeypatch):
    # Every test starts and ends with the override off and no device opt-in from outside.
    monkeypatch.delenv(so.ENV_VAR, raising=False)
    monkeypatch.delenv(so.DEVICES_ENV_VAR, raising=False)
    so.disable_sdpa()
    yield
    so.disable_sdpa()


def bhsd(b=2, h=3, h_k=None, s_q=37, s_k=45, d=64, dtype=torch.float16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s_q, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(b, h_k or h, s_k, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(b, h_k or h, s_k, d, generator=g).to(dtype=dtype, device=device)
    return q, k, v


# ---------------------------------------------------------------------------- switches (CPU)


def test_enable_disable_leaves_torch_as_it_was(torch_state):
    fa.enable_sdpa()
    assert fa.is_sdpa_enabled()
    for name in so.OVERRIDDEN_OPS:
        assert "sdpa_override.py" in kernel_row(name, "CUDA")
        # Only the CUDA kernel changes: autograd formula, meta kernel and the rest stay torch's.
        assert "sdpa_override.py" not in kernel_row(name, "AutogradCUDA")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    enabled = dispatch_state()
    assert enabled != torch_state
    fa.disable_sdpa()
    assert not fa.is_sdpa_enabled()
    assert dispatch_state() == torch_state
    fa.disable_sdpa()  # a second disable is a no-op
    assert dispatch_state() == torch_state
    fa.enable_sdpa()
    assert dispatch_state() == enabled  # and it can be enabled again


def test_enable_is_idempotent(torch_state):
    fa.enable_sdpa()
    lib, once = so._library, dispatch_state()
    fa.enable_sdpa()
    fa.enable_sdpa(treat_as_sm75=True)
    assert so._library is lib and so._treat_as_sm75 is True
    assert dispatch_state() == once
    fa.disable_sdpa()  # one disable undoes any number of enables
    assert dispatch_state() == torch_state


def test_concurrent_enable_disable(torch_state):
    errors, barrier = [], threading.Barrier(8)

    def worker(seed):
        rng = random.Random(seed)
        try:
            barrier.wait()
            for _ in range(40):
                action = rng.randrange(3)
                if action == 0:
                    fa.enable_sdpa(treat_as_sm75=rng.random() < 0.5)
                elif action == 1:
                    fa.disable_sdpa()
                else:
                    with fa.sdpa_enabled(rng.random() < 0.5):
                        fa.is_sdpa_enabled()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    fa.enable_sdpa()
    assert all("sdpa_override.py" in kernel_row(n, "CUDA") for n in so.OVERRIDDEN_OPS)
    fa.disable_sdpa()
    assert dispatch_state() == torch_state


def test_context_manager_nests_and_restores(torch_state):
    with fa.sdpa_enabled():
        assert fa.is_sdpa_enabled() and so._treat_as_sm75 is False
        with fa.sdpa_enabled(treat_as_sm75=True):
            assert fa.is_sdpa_enabled() and so._treat_as_sm75 is True
            with fa.sdpa_enabled(False):
                assert not fa.is_sdpa_enabled()
                assert dispatch_state() == torch_state
            assert fa.is_sdpa_enabled() and so._treat_as_sm75 is True
        assert fa.is_sdpa_enabled() and so._treat_as_sm75 is False
        with pytest.raises(KeyError), fa.sdpa_enabled(False):
            raise KeyError("restored on exceptions too")
        assert fa.is_sdpa_enabled()
    assert not fa.is_sdpa_enabled()
    assert dispatch_state() == torch_state


def test_context_manager_restores_treat_as_sm75_after_a_disabled_state(fake_cuda, monkeypatch):
    # The device rule reads treat_as_sm75 even while disabled (why_not_overridden).
    monkeypatch.setattr(_rules, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(so, "_treat_as_sm75", False)  # and restored after the test
    q, k, v = bhsd(device="cuda")
    assert not fa.is_sdpa_enabled()
    with fa.sdpa_enabled(treat_as_sm75=True):
        assert so._treat_as_sm75 is True and so.why_not_overridden(q, k, v) is None
    assert not fa.is_sdpa_enabled() and so._treat_as_sm75 is False
    assert "not 7.5" in so.why_not_overridden(q, k, v)
    fa.enable_sdpa(treat_as_sm75=True)
    fa.disable_sdpa()
    with fa.sdpa_enabled(False):  # disabled inside a disabled state keeps the setting too
        pass
    assert so._treat_as_sm75 is True


def test_argument_and_environment_validation(monkeypatch):
    with pytest.raises(ValueError, match="treat_as_sm75"):
        fa.enable_sdpa(treat_as_sm75=1)
    with pytest.raises(ValueError, match="enabled"):
        with fa.sdpa_enabled("yes"):
            pass
    monkeypatch.setenv(so.DEVICES_ENV_VAR, "all")
    with pytest.raises(ValueError, match=so.DEVICES_ENV_VAR):
        fa.enable_sdpa()
    assert not fa.is_sdpa_enabled()
    monkeypatch.setenv(so.DEVICES_ENV_VAR, "any")
    fa.enable_sdpa()
    assert so._treat_as_sm75 is True
    fa.enable_sdpa(treat_as_sm75=False)  # the argument wins over the environment
    assert so._treat_as_sm75 is False
    monkeypatch.setenv(so.DEVICES_ENV_VAR, "SM75")
    fa.enable_sdpa()
    assert so._treat_as_sm75 is False


def test_enable_without_extension_raises(monkeypatch):
    monkeypatch.setattr(so._ops, "EXTENSION_AVAILABLE", False)
    monkeypatch.setattr(so._ops, "EXTENSION_ERROR", "ImportError: boom")
    with pytest.raises(RuntimeError, match="boom"):
        fa.enable_sdpa()
    assert not fa.is_sdpa_enabled()


def test_missing_extension_message_points_to_the_build(tmp_path):
    # Python words a failed `from . import _C` during the package's own import as "cannot
    # import name '_C' from partially initialized module ... (most likely due to a circular
    # import)": the message must say that the extension is not built and how to build it.
    import os
    import shutil

    # The package as imported (the checkout, or site-packages when installed), without _C.
    shutil.copytree(os.path.dirname(fa.__file__), tmp_path / "flash_attention_sm75",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "_build_info.py", "__pycache__"))
    # An editable install (CI's) maps the package to the checkout through a meta-path finder
    # that wins over PYTHONPATH: drop it so that the copy without the library is imported.
    code = ("import sys\n"
            "sys.meta_path = [f for f in sys.meta_path\n"
            "                 if '__editable__' not in getattr(f, '__module__', '')]\n"
            "import torch, flash_attention_sm75 as fa\n"
            "print(fa.EXTENSION_AVAILABLE, fa.EXTENSION_ERROR)\n"
            "q = torch.zeros(1, 1, 1, 8, dtype=torch.float16)\n"
            "fa.flash_attn_func(q, q, q)\n")
    env = {k: v for k, v in os.environ.items() if k not in (so.ENV_VAR, so.DEVICES_ENV_VAR)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**env, "PYTHONPATH": str(tmp_path)})
    assert r.stdout.startswith("False the extension is not built: no compiled library "
                               "flash_attention_sm75._C in "), r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: flash_attention_sm75:"), r.stderr
    assert "pip install --no-build-isolation ." in last
    assert "circular" not in r.stdout + r.stderr and "partially initialized" not in r.stderr


def _python(code, env=None, args=(), cwd=ROOT):
    import os
    full = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in (so.ENV_VAR, so.DEVICES_ENV_VAR):
        full.pop(key, None)
    full.update(env or {})
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=300)


_REPORT = ("import json, sys, torch, flash_attention_sm75 as fa; "
           "print(json.dumps([fa.is_sdpa_enabled(), "
           "'sdpa_override.py' in torch._C._dispatch_dump_table("
           "'aten::_scaled_dot_product_efficient_attention')]))")


@pytest.mark.parametrize("value,expected", [("1", [True, True]), ("on", [True, True]),
                                            ("0", [False, False]), ("", [False, False])])
def test_environment_variable_enables_at_import(value, expected):
    r = _python(_REPORT, env={so.ENV_VAR: value})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == expected


@pytest.mark.parametrize("env,named,accepted", [
    ({so.ENV_VAR: "maybe"}, so.ENV_VAR + "='maybe'", "'0', '1', 'false'"),
    ({so.ENV_VAR: "1", so.DEVICES_ENV_VAR: "all"}, so.DEVICES_ENV_VAR + "='all'", "'any', 'sm75'"),
])
def test_environment_variable_bad_value_warns_and_leaves_torch_alone(env, named, accepted):
    # A bad value must not break `import flash_attention_sm75` (nor `import flash_attn`, which
    # imports it): one warning naming the variable and the accepted values, torch untouched.
    for code in (_REPORT, "import flash_attention_sm75.fa2; " + _REPORT):
        r = _python(code, env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == [False, False]
        assert r.stderr.count("RuntimeWarning") == 1, r.stderr
        assert named in r.stderr and accepted in r.stderr and "left unchanged" in r.stderr


SCRIPT = """\
import json, os, sys
import torch
import flash_attention_sm75 as fa
table = torch._C._dispatch_dump_table("aten::_scaled_dot_product_efficient_attention")
print(json.dumps({{"enabled": fa.is_sdpa_enabled(), "registered": "sdpa_override.py" in table,
                  "argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "env": os.environ.get("{env}"), "treat": fa.sdpa_override._treat_as_sm75}}))
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def test_launcher_runs_a_script_enabled(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT.format(env=so.ENV_VAR))
    r = _python(None, args=["-m", "flash_attention_sm75", "run", str(script), "--x", "1", "-m"],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == {"enabled": True, "registered": True, "argv": [str(script), "--x", "1", "-m"],
                    "name": "__main__", "path0": str(tmp_path), "env": "1", "treat": False}
    r = _python(None, args=["-m", "flash_attention_sm75", "run", str(script)],
                env={"EXIT_CODE": "3", so.DEVICES_ENV_VAR: "any"}, cwd=tmp_path)
    assert r.returncode == 3, r.stderr  # the script's exit status is the launcher's
    assert json.loads(r.stdout.strip().splitlines()[-1])["treat"] is True


def test_launcher_runs_a_module(tmp_path):
    (tmp_path / "tinymod.py").write_text(SCRIPT.format(env=so.ENV_VAR))
    r = _python(None, args=["-m", "flash_attention_sm75", "run", "-m", "tinymod", "a", "b"],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["enabled"] and seen["registered"] and seen["name"] == "__main__"
    assert seen["argv"] == [str(tmp_path / "tinymod.py"), "a", "b"]


def test_launcher_reports_a_bad_environment(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text("raise SystemExit('must not run')")
    r = _python(None, args=["-m", "flash_attention_sm75", "run", str(script)],
                env={so.DEVICES_ENV_VAR: "all"}, cwd=tmp_path)
    assert r.returncode == 1 and "must not run" not in r.stderr
    assert r.stderr.startswith("python -m flash_attention_sm75 run:") and so.DEVICES_ENV_VAR in r.stderr


def test_launcher_is_not_contradicted_by_the_import(tmp_path):
    # The package is imported before the launcher's __main__ runs: a value of the variable that
    # is not understood must not warn "left unchanged" there when the launcher then enables.
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT.format(env=so.ENV_VAR))
    for launcher in (["-m", "flash_attention_sm75"], ["-W", "default", "-mflash_attention_sm75"],
                     ["-Bm", "flash_attention_sm75"]):
        r = _python(None, args=[*launcher, "run", str(script)], env={so.ENV_VAR: "bogus"},
                    cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "Warning" not in r.stderr and "left unchanged" not in r.stderr, r.stderr
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["enabled"] and seen["registered"] and seen["env"] == "1"


@pytest.mark.parametrize("orig_argv,expected", [
    (["python", "-m", "flash_attention_sm75", "run", "x.py"], True),
    (["python", "-mflash_attention_sm75.__main__", "run"], True),
    (["python", "-X", "dev", "-W", "error", "-I", "-m", "flash_attention_sm75"], True),
    (["python", "-m", "pytest", "-m", "flash_attention_sm75"], False),
    (["python", "-c", "import x", "-m", "flash_attention_sm75"], False),
    (["python", "script.py", "-m", "flash_attention_sm75"], False),
    (["python", "-m"], False),
    (["python"], False),
    (["python", "-Bm", "flash_attention_sm75", "run"], True),
    (["python", "-uBmflash_attention_sm75", "run"], True),
    (["python", "-BX", "dev", "-m", "flash_attention_sm75"], True),
    (["python", "-BWerror", "-m", "flash_attention_sm75"], True),
    (["python", "-Wm", "-m", "flash_attention_sm75"], True),  # "m" is -W's value
    (["python", "--check-hash-based-pycs", "always", "-m", "flash_attention_sm75"], True),
    (["python", "-", "-m", "flash_attention_sm75"], False),  # a script on stdin
    (["python", "--", "s.py", "-m", "flash_attention_sm75"], False),
    (["python", "-Bc", "pass", "-m", "flash_attention_sm75"], False),
])
def test_started_as_launcher_reads_the_interpreter_command_line(monkeypatch, orig_argv, expected):
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert so._started_as_launcher() is expected


@pytest.mark.parametrize("args", [[], ["go", "x.py"], ["run"], ["run", "-m"]])
def test_launcher_usage_errors(args):
    r = _python(None, args=["-m", "flash_attention_sm75", *args])
    assert r.returncode == 2 and "usage:" in r.stderr
    assert _python(None, args=["-m", "flash_attention_sm75", "--help"]).stdout.startswith("usage:")


def test_launcher_help_of_run_and_of_the_script():
    r = _python(None, args=["-m", "flash_attention_sm75", "run", "--help"])
    assert r.returncode == 0 and r.stdout.startswith(
        "usage: python -m flash_attention_sm75 run [-h] (script.py | -m module)"), r.stdout
    assert "-m" in r.stdout and "script.py" in r.stdout and not r.stderr
    # after the module (or script), every option is its own: json.tool answers --help
    r = _python(None, args=["-m", "flash_attention_sm75", "run", "-m", "json.tool", "--help"])
    assert r.returncode == 0 and "python -m json.tool" in r.stdout, r.stderr


def test_launcher_script_sees_the_file_and_path_python_gives(tmp_path):
    # Relative, unnormalised and symlinked paths: __file__ and sys.path[0] as `python path`.
    (tmp_path / "real").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "real" / "s.py").write_text(
        "import json, sys; print(json.dumps([__file__, sys.path[0], sys.argv[1:]]))")
    (tmp_path / "sub" / "s.py").symlink_to(tmp_path / "real" / "s.py")
    for path in ("real/s.py", "./real/../real/s.py", "sub/s.py", str(tmp_path / "sub/s.py")):
        plain = _python(None, args=[path, "-m", "x"], cwd=tmp_path)
        ours = _python(None, args=["-m", "flash_attention_sm75", "run", path, "-m", "x"],
                       cwd=tmp_path)
        assert plain.returncode == ours.returncode == 0, (plain.stderr, ours.stderr)
        assert (json.loads(ours.stdout.splitlines()[-1])
                == json.loads(plain.stdout.splitlines()[-1])), path


def test_launcher_missing_script_is_one_line_and_status_2_like_python(tmp_path):
    plain = _python(None, args=["nope.py"], cwd=tmp_path)
    r = _python(None, args=["-m", "flash_attention_sm75", "run", "nope.py", "a"], cwd=tmp_path)
    assert plain.returncode == r.returncode == 2
    assert r.stderr == (f"python -m flash_attention_sm75 run: can't open file "
                        f"{str(tmp_path / 'nope.py')!r}: [Errno 2] No such file or directory\n")
    assert plain.stderr.endswith(r.stderr.split(" run: ", 1)[1])


def test_launcher_double_dash_missing_module_and_directory_like_python(tmp_path):
    script = tmp_path / "args.py"
    script.write_text("import sys; print(sys.argv[1:])")
    plain = _python(None, args=["--", str(script), "a", "--", "b"], cwd=tmp_path)
    r = _python(None, args=["-m", "flash_attention_sm75", "run", "--", str(script), "a", "--",
                            "b"], cwd=tmp_path)
    assert plain.returncode == r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1] == "['a', '--', 'b']"
    (tmp_path / "empty").mkdir()
    for args, tail in ((["-m", "no_such_module_here"], "No module named no_such_module_here"),
                       ([str(tmp_path / "empty")], "can't find '__main__' module in "
                                                   f"{str(tmp_path / 'empty')!r}")):
        plain = _python(None, args=args, cwd=tmp_path)
        r = _python(None, args=["-m", "flash_attention_sm75", "run", *args], cwd=tmp_path)
        assert plain.returncode == r.returncode == 1
        assert r.stderr == f"python -m flash_attention_sm75 run: {tail}\n", r.stderr
        assert plain.stderr.endswith(tail + "\n")
    # an ImportError of the module's own code stays the module's traceback
    (tmp_path / "raises_import.py").write_text("raise ImportError('from the module')")
    r = _python(None, args=["-m", "flash_attention_sm75", "run", "-m", "raises_import"],
                cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" in r.stderr and "from the module" in r.stderr


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"attn_mask": "bool"},
                                    {"dtype": torch.float32, "scale": 0.3}])
def test_cpu_sdpa_is_unaffected(kwargs):
    kwargs = dict(kwargs)
    q, k, v = bhsd(dtype=kwargs.pop("dtype", torch.float16))
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(37, 45) > 0.3
    before = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with fa.sdpa_enabled(treat_as_sm75=True):
        during = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.equal(before, during)


# ------------------------------------------- the kernel path through torch's autograd (CPU)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Register the kernels for the CPU dispatch key as well and accept CPU tensors: torch's
    autograd formula and the registered forward/backward then run on CPU tensors."""
    monkeypatch.setattr(so, "_DISPATCH_KEYS", ("CUDA", "CPU"))
    monkeypatch.setattr(so, "_KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    fa.enable_sdpa()
    yield
    fa.disable_sdpa()


def _grads_ref(q, k, v, dout, is_causal, scale, upcast):
    """(out, lse, dq, dk, dv) of the definition: float64 (upcast) or the fp16 PyTorch baseline."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, causal=is_causal, causal_bottom_right=False,
                             softmax_scale=scale, layout="bhsd", upcast=upcast,
                             reorder_ops=not upcast)
    out.backward(dout.to(out.dtype))
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("s_q,s_k,d,is_causal,scale", [
    (37, 45, 64, True, None), (64, 64, 40, False, 0.2), (1, 70, 128, False, None),
    (90, 33, 80, True, 0.05), (32, 8, 256, False, None), (5, 5, 8, True, 1.0)])
def test_kernel_path_through_torch_autograd(cpu_kernels, op_calls, s_q, s_k, d, is_causal,
                                            scale):
    q, k, v = (t.requires_grad_() for t in bhsd(s_q=s_q, s_k=s_k, d=d,
                                                 seed=seed_from(s_q, s_k, d, is_causal)))
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, is_causal, scale=scale)
    # The op ran, with torch's top-left causal alignment.
    assert len(op_calls) == 1 and op_calls[0][3:6] == (scale, is_causal, False)
    assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
    # torch's layouts (its meta kernel says what its CUDA kernel returns; the op's CPU
    # reference may give a size-1 dimension another stride, which no tensor op reads).
    with torch.device("meta"):
        m = aten._scaled_dot_product_efficient_attention(*(t.detach().to("meta") for t in (q, k, v)),
                                                          None, True, 0.0, is_causal, scale=scale)
    for a, t in zip((out, lse), m[:2]):
        assert (a.shape, significant_strides(a), a.dtype) == (t.shape, significant_strides(t),
                                                               t.dtype)
    assert lse.shape[2] == math.ceil(s_q / 32) * 32
    assert torch.isposinf(lse[:, :, s_q:]).all()
    for t in (seed, offset):
        assert t.shape == () and t.dtype == torch.int64 and t.device.type == "cpu"
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = _grads_ref(q, k, v, dout, is_causal, scale, upcast=True)
    pt = _grads_ref(q, k, v, dout, is_causal, scale, upcast=False)
    assert_close_fa(out, ref[0], pt[0], "out")
    assert_lse_close(lse[:, :, :s_q], ref[1])
    for name, t, r, p in zip("qkv", (q, k, v), ref[2:], pt[2:]):
        assert_close_fa(t.grad, r, p, "d" + name)


def test_kernel_path_without_log_sumexp(cpu_kernels):
    q, k, v = bhsd()
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, False)
    assert lse.shape == (2, 3, 0) and lse.dtype == torch.float32
    assert torch.equal(out, aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[0])


def test_backward_reads_a_log_sumexp_of_any_padding(cpu_kernels):
    # The backward takes torch's padded LSE (the forward of torch's kernel, enabled between
    # forward and backward) as well as an unpadded one: only the first seqlen_q entries count.
    q, k, v = bhsd(s_q=40)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
    dout = torch.randn_like(out)
    args = (dout, q, k, v, None, out)
    rest = (seed, offset, 0.0, [True, True, True, False], False)
    base = aten._scaled_dot_product_efficient_attention_backward(*args, lse, *rest)
    padded = torch.cat([lse[:, :, :40], torch.full((2, 3, 88), float("inf"))], dim=-1)
    for other in (lse[:, :, :40].contiguous(), padded):
        grads = aten._scaled_dot_product_efficient_attention_backward(*args, other, *rest)
        assert all(torch.equal(a, b) for a, b in zip(base[:3], grads[:3]))
        assert grads[3] is None


def test_kernel_path_under_inductor(cpu_kernels):
    # Inductor lowers both ops to extern calls of the aten ops (make_fallback), so the compiled
    # forward and backward reach the registered kernels at run time. (torch has no CPU kernel
    # for them: running at all on the CPU means the registered ones ran.)
    from torch._inductor import lowering
    from torch._inductor.utils import run_and_get_code

    assert aten._scaled_dot_product_efficient_attention.default in lowering.fallbacks
    assert aten._scaled_dot_product_efficient_attention_backward.default in lowering.fallbacks
    torch._dynamo.reset()

    def f(q, k, v):
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                            scale=0.25)[0]

    q, k, v = (t.requires_grad_() for t in bhsd(s_q=40, s_k=40))
    dout = torch.randn(2, 3, 40, 64, dtype=torch.float16)
    compiled = torch.compile(f, fullgraph=True, backend="inductor")

    def step(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        return out.detach(), *(t.grad for t in (q, k, v))

    got, code = run_and_get_code(step, compiled)
    code = "\n".join(code)
    assert "aten._scaled_dot_product_efficient_attention.default" in code
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in code
    want = step(f)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch._dynamo.reset()


# ---------------------------------------- mapping and layouts with fake CUDA tensors (CPU)


@pytest.fixture
def fake_cuda(monkeypatch):
    """FakeTensorMode with CUDA tensors on a machine without a GPU: the device is compute
    capability 7.5 and no CUDA graph captures, unless a test says otherwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(_rules, "_capability", lambda index: (7, 5))
    monkeypatch.setattr(so, "_capturing", lambda: False)
    with warnings.catch_warnings():
        # The rulebook's alignment rule reads data_ptr(), which a fake tensor warns about.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeTensorMode() as mode:
            yield mode


class Recorder:
    """Stands in for one of torch's lower-level ops: records the arguments, runs the op."""

    def __init__(self, op):
        self.op, self.calls = op, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.op(*args, **kwargs)


def _efficient_attention_backward_fake(grad_out, query, key, value, bias, *args, **kwargs):
    # torch 2.11's meta kernel of aten::_efficient_attention_backward has no `out` parameter
    # (a positional call binds the schema's arguments one place off), so the fake result is
    # made here: the gradients like the BSHD inputs, as torch's CUDA kernel returns them.
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            None if bias is None else torch.empty_like(bias))


@pytest.fixture
def lower_ops(monkeypatch):
    rec = {"fwd": Recorder(so._efficient_attention_forward),
           "bwd": Recorder(_efficient_attention_backward_fake)}
    monkeypatch.setattr(so, "_efficient_attention_forward", rec["fwd"])
    monkeypatch.setattr(so, "_efficient_attention_backward", rec["bwd"])
    return rec


def same_meta(a, b):
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def bshd_view_of(t, orig):
    """t is orig.transpose(1, 2) (same storage offset, sizes and strides)."""
    return (t.shape == orig.transpose(1, 2).shape and t.stride() == orig.transpose(1, 2).stride()
            and t.storage_offset() == orig.storage_offset())


def _fallback_cases():
    return [
        ("fp32", dict(dtype=torch.float32), {}),
        ("bf16", dict(dtype=torch.bfloat16), {}),
        ("bias_with_dropout", {}, dict(attn_bias=True, dropout_p=0.1)),
        ("bias_fp32", dict(dtype=torch.float32), dict(attn_bias=True)),
        ("dropout", {}, dict(dropout_p=0.1)),
        ("head_dim_12", dict(d=12), {}),
        ("head_dim_264", dict(d=264), {}),
        ("gqa", dict(h=4, h_k=2), {}),
        ("scale_negative", {}, dict(scale=-0.5)),
        ("zero_length", dict(s_q=0), {}),
    ]


FALLBACK_CASES = _fallback_cases()


@pytest.mark.parametrize("case", FALLBACK_CASES, ids=[c[0] for c in FALLBACK_CASES])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fallback_forward_maps_like_torch(fake_cuda, lower_ops, case, is_causal):
    _, shape, call = case
    q, k, v = bhsd(device="cuda", **shape)
    bias = torch.randn(q.shape[0], q.shape[1], q.shape[2], k.shape[2], device="cuda",
                       dtype=q.dtype) if call.get("attn_bias") else None
    dropout_p, scale = call.get("dropout_p", 0.0), call.get("scale")
    assert so.why_not_overridden(q, k, v, bias, dropout_p, scale=scale) is not None
    ours = so._forward(q, k, v, bias, True, dropout_p, is_causal, scale=scale)
    (args, kwargs), = lower_ops["fwd"].calls
    assert all(bshd_view_of(a, t) for a, t in zip(args[:3], (q, k, v)))
    assert args[3] is bias and args[4:8] == (None, None, None, None)
    assert args[8:] == (dropout_p, 1 if is_causal else 0, True) and kwargs == {"scale": scale}
    torch_meta = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p,
                                                              is_causal, scale=scale)
    assert all(same_meta(a, b) for a, b in zip(ours, torch_meta))


@pytest.mark.parametrize("mask", [[True, True, True, False], [True, False, False, True]])
def test_fallback_backward_maps_like_torch(fake_cuda, lower_ops, mask):
    q, k, v = bhsd(device="cuda", dtype=torch.float32)
    bias = torch.randn(2, 3, 37, 45, device="cuda") if mask[3] else None
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True,
                                                                          0.0, True)
    dout = torch.randn_like(out)
    ours = so._backward(dout, q, k, v, bias, out, lse, seed, offset, 0.0, mask, True, scale=0.3)
    (args, kwargs), = lower_ops["bwd"].calls
    assert all(bshd_view_of(a, t) for a, t in zip(args[:4], (dout, q, k, v)))
    assert args[4] is bias and bshd_view_of(args[5], out)
    # The log-sum-exp as given, with rows that saw no key at +inf (torch's kernel reads -inf as
    # NaN gradients; test_gpu_mask_above_the_bias_backward_limit_... checks the values).
    assert args[6:10] == (None, None, 37, 45)
    assert (args[10].shape, args[10].dtype, args[10].device) == (lse.shape, lse.dtype, lse.device)
    assert args[11] == 0.0 and args[12] is seed and args[13] is offset
    assert args[14:] == (1, mask[3]) and kwargs == {"scale": 0.3, "num_splits_key": None}
    # torch's kernel returns the lower op's gradients transposed back (BHSD views).
    results = _efficient_attention_backward_fake(*(a for a in args[:5]))
    for g, r in zip(ours[:3], results):
        assert bshd_view_of(r, g)
    assert (ours[3] is None) == (bias is None)
    assert so._backward(None, q, k, v, bias, out, lse, seed, offset, 0.0, mask) == (None,) * 4


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("s_q,lse", [(37, True), (64, True), (37, False)])
def test_kernel_path_outputs_have_torch_layouts(fake_cuda, lower_ops, monkeypatch, capturing,
                                                s_q, lse):
    monkeypatch.setattr(so, "_capturing", lambda: capturing)
    q, k, v = bhsd(s_q=s_q, device="cuda")
    assert so.why_not_overridden(q, k, v) is None
    ours = so._forward(q, k, v, None, lse, 0.0, True)
    assert not lower_ops["fwd"].calls  # the op's fake ran (torch's op was not called)
    torch_meta = aten._scaled_dot_product_efficient_attention(q, k, v, None, lse, 0.0, True)
    assert all(same_meta(a, b) for a, b in zip(ours[:2], torch_meta[:2]))
    for t in ours[2:]:
        # torch's kernel: empty int64 scalars, on the GPU only while a CUDA graph captures
        # (its meta kernel puts them on the query's device either way).
        assert t.shape == () and t.dtype == torch.int64
        assert t.device == (q.device if capturing else torch.device("cpu"))
    dout = torch.randn_like(ours[0])
    if lse:
        grads = so._backward(dout, q, k, v, None, ours[0], ours[1], *ours[2:], 0.0,
                             [True] * 3 + [False], True)
        torch_meta = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, ours[0], ours[1], *ours[2:], 0.0, [True] * 3 + [False], True)
        assert not lower_ops["bwd"].calls and grads[3] is None
        assert all(same_meta(a, b) for a, b in zip(grads[:3], torch_meta[:3]))


@pytest.mark.parametrize("capability,treat,accepted", [
    ((7, 5), False, True), ((8, 0), False, False), ((8, 0), True, True), ((9, 0), True, True),
    ((7, 0), True, False), ((6, 1), False, False)])
def test_device_rule(fake_cuda, monkeypatch, capability, treat, accepted):
    monkeypatch.setattr(_rules, "_capability", lambda index: capability)
    monkeypatch.setattr(so, "_treat_as_sm75", treat)
    reason = so.why_not_overridden(*bhsd(device="cuda"))
    assert (reason is None) is accepted, reason
    if not accepted and capability >= (7, 5):
        assert "treat_as_sm75" in reason and f"{capability[0]}.{capability[1]}" in reason


def test_reasons(fake_cuda):
    q, k, v = bhsd(device="cuda")
    # a mask (torch passes it as a float bias) runs on the kernels; one they cannot read does not
    assert so.why_not_overridden(q, k, v, torch.zeros(2, 3, 37, 45, device="cuda",
                                                      dtype=q.dtype)) is None
    assert "attn_bias of shape [3, 45] does not broadcast" in so.why_not_overridden(
        q, k, v, torch.zeros(3, 45, device="cuda", dtype=q.dtype))
    assert "attn_bias must be bool" in so.why_not_overridden(
        q, k, v, torch.zeros(37, 45, device="cuda", dtype=torch.float64))
    assert "dropout_p=0.5" in so.why_not_overridden(q, k, v, dropout_p=0.5)
    assert "must be float16" in so.why_not_overridden(q.float(), k.float(), v.float())
    assert "scale must be" in so.why_not_overridden(q, k, v, scale=0.0)
    assert "equal head counts" in so.why_not_overridden(*bhsd(h=4, h_k=2, device="cuda"))
    assert "zero size" in so.why_not_overridden(*bhsd(s_k=0, device="cuda"))
    cpu = bhsd()
    assert "not a CUDA device" in so.why_not_overridden(*cpu)


@pytest.mark.skipif(not so._CHUNKS_LARGE_BATCHES, reason="torch < 2.8 does not chunk batches")
def test_fallback_chunks_batches_above_65535_like_torch(fake_cuda, lower_ops):
    q, k, v = bhsd(b=65537, h=1, s_q=3, s_k=5, d=8, dtype=torch.float32, device="cuda")
    out, lse, seed, offset = so._forward(q, k, v, None, True, 0.0, False)
    assert [c[0][0].shape[0] for c in lower_ops["fwd"].calls] == [65535, 2]
    assert out.shape == q.shape and lse.shape == (65537, 1, 32)
    mask = [True, False, True, False]
    grads = so._backward(torch.randn_like(out), q, k, v, None, out, lse, seed, offset, 0.0, mask)
    assert [c[0][0].shape[0] for c in lower_ops["bwd"].calls] == [65535, 2]
    assert grads[1] is None and grads[3] is None
    assert same_meta(grads[0], q) and same_meta(grads[2], v)
    with pytest.raises(RuntimeError, match=r"cannot produce valid seed and offset outputs when "
                                           r"the batch size exceeds \(65535\)"):
        so._forward(q, k, v, None, True, 0.1, False)
    with pytest.raises(RuntimeError, match=r"backward cannot handle dropout when the batch size "
                                           r"exceeds \(65535\)"):
        so._backward(torch.randn_like(out), q, k, v, None, out, lse, seed, offset, 0.1, mask)


# ----------------------------------------------------------------------------------- GPU


@pytest.fixture
def on_gpu():
    """Enabled with the device opt-in, torch steered to its efficient backend (as on Turing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with fa.sdpa_enabled(treat_as_sm75=True), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        yield


@contextlib.contextmanager
def stock():
    """torch's own kernels, efficient backend (the override off for the block)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with fa.sdpa_enabled(False), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        yield


def _kernels(fn):
    """(our kernel names, torch's mem-efficient kernel names) that fn() launches. Ours are
    flash_fwd* / flash_bwd* (csrc/kernels; torch's own FlashAttention kernels, namespace
    pytorch_flash, have such names too and are excluded), torch's mem-efficient ones fmha_*."""
    names = cuda_kernels_run(fn, "")
    return ({n for n in names if ("flash_fwd" in n or "flash_bwd" in n)
             and "pytorch_flash" not in n},
            {n for n in names if "fmha" in n})


GPU_SHAPES = [
    (2, 4, 128, 128, 64, False, None), (2, 4, 197, 197, 64, False, None),
    (1, 8, 77, 300, 40, False, 0.3), (2, 2, 256, 77, 80, False, None),
    (2, 3, 333, 333, 128, True, None), (1, 2, 64, 700, 160, True, None),
    (1, 2, 129, 129, 256, True, 0.1), (3, 2, 1, 513, 64, False, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,s_q,s_k,d,is_causal,scale", GPU_SHAPES)
def test_gpu_forward_matches_reference_and_torch_layouts(on_gpu, b, h, s_q, s_k, d, is_causal,
                                                         scale):
    q, k, v = bhsd(b, h, None, s_q, s_k, d, device="cuda", seed=seed_from(b, h, s_q, s_k, d))
    call = lambda: aten._scaled_dot_product_efficient_attention(  # noqa: E731
        q, k, v, None, True, 0.0, is_causal, scale=scale)
    ours = call()
    ref, lse_ref = attention_ref(q, k, v, causal=is_causal, causal_bottom_right=False,
                                 softmax_scale=scale, layout="bhsd")
    pt, _ = attention_ref(q, k, v, causal=is_causal, causal_bottom_right=False,
                          softmax_scale=scale, layout="bhsd", upcast=False, reorder_ops=True)
    assert_close_fa(ours[0], ref, pt)
    assert_lse_close(ours[1][:, :, :s_q], lse_ref)
    with stock():
        theirs = call()
        _, torch_kernels = _kernels(call)
    assert torch_kernels  # the disabled call ran torch's mem-efficient kernel
    for a, t in zip(ours, theirs):
        assert (a.shape, a.stride(), a.dtype, a.device) == (t.shape, t.stride(), t.dtype, t.device)
    # torch pads its LSE rows with +inf; ours too.
    assert torch.isposinf(theirs[1][:, :, s_q:]).all() and torch.isposinf(ours[1][:, :, s_q:]).all()
    torch.testing.assert_close(ours[1][:, :, :s_q], theirs[1][:, :, :s_q], atol=2e-4, rtol=3e-5)
    mine, torch_kernels = _kernels(call)
    assert any("flash_fwd" in n for n in mine) and not torch_kernels


def _sdpa_grads(q, k, v, dout, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # the same strides as q, k, v
    out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,s_q,s_k,d,is_causal,scale", GPU_SHAPES)
def test_gpu_backward_through_sdpa(on_gpu, b, h, s_q, s_k, d, is_causal, scale):
    q, k, v = bhsd(b, h, None, s_q, s_k, d, device="cuda", seed=seed_from(b, h, s_q, s_k, d, 1))
    dout = torch.randn(b, h, s_q, d, device="cuda", dtype=torch.float16)
    kw = dict(is_causal=is_causal, scale=scale)
    ours = _sdpa_grads(q, k, v, dout, **kw)
    ref = _grads_ref(q, k, v, dout, is_causal, scale, upcast=True)
    pt = _grads_ref(q, k, v, dout, is_causal, scale, upcast=False)
    assert_close_fa(ours[0], ref[0], pt[0], "out")
    for name, g, r, p in zip("qkv", ours[1:], ref[2:], pt[2:]):
        assert_close_fa(g, r, p, "d" + name)
    mine, torch_kernels = _kernels(lambda: _sdpa_grads(q, k, v, dout, **kw))
    assert any("flash_fwd" in n for n in mine) and any("flash_bwd" in n for n in mine)
    assert not torch_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("forward_enabled", [False, True])
def test_gpu_switch_between_forward_and_backward(forward_enabled):
    # The backward kernel that runs is the one registered when backward() runs; it takes the
    # other forward's outputs (the LSE layouts agree).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.requires_grad_() for t in bhsd(2, 4, None, 100, 150, 64, device="cuda"))
    dout = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.float16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        with fa.sdpa_enabled(forward_enabled, treat_as_sm75=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with fa.sdpa_enabled(not forward_enabled, treat_as_sm75=True):
            out.backward(dout)
    ref = _grads_ref(q, k, v, dout, True, None, upcast=True)
    pt = _grads_ref(q, k, v, dout, True, None, upcast=False)
    for name, t, r, p in zip("qkv", (q, k, v), ref[2:], pt[2:]):
        assert_close_fa(t.grad, r, p, "d" + name)


def _fallback_gpu_case(name):
    """(q, k, v), SDPA keyword arguments: a call torch's efficient backend takes and the kernels
    do not."""
    def mk(dtype=torch.float16, d=64):
        return bhsd(2, 4, None, 100, 120, d, dtype=dtype, device="cuda")

    if name == "misaligned":
        # A head stride that is not a multiple of 8 elements: the rulebook refuses it, torch
        # runs its unaligned kernel.
        base = torch.randn(2 * 4 * 6404, device="cuda", dtype=torch.float16)
        q = base.as_strided((2, 4, 100, 64), (4 * 6404, 6404, 64, 1))
        return (q, *mk()[1:]), {}
    if name == "float_mask":
        return mk(), {"attn_mask": torch.randn(2, 1, 100, 120, device="cuda",
                                               dtype=torch.float16)}
    if name == "bool_mask":
        mask = torch.rand(100, 120, device="cuda") > 0.3
        mask[:, 0] = True
        return mk(), {"attn_mask": mask}
    return {"fp32": (mk(torch.float32), {}), "bf16": (mk(torch.bfloat16), {}),
            "dropout": (mk(), {"dropout_p": 0.3}), "head_dim_264": (mk(d=264), {})}[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["float_mask", "bool_mask"])
def test_gpu_masks_run_on_the_kernels(on_gpu, name):
    # torch hands F.scaled_dot_product_attention's mask to the efficient op as a float bias;
    # the kernels read it (forward and backward), torch's kernel does not run.
    (q, k, v), kw = _fallback_gpu_case(name)
    assert so.why_not_overridden(q, k, v, kw["attn_mask"]) is None
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    ours = _sdpa_grads(q, k, v, dout, **kw)
    # The definition in float64, by hand (the fixture restricts torch to its efficient backend,
    # which has no float64 kernel).
    mask = kw["attn_mask"]
    add = (torch.zeros(mask.shape, dtype=torch.float64, device="cuda")
           .masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask.double())
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(q.shape[-1]) + add
    out64 = torch.softmax(s64, dim=-1) @ leaves[2]
    out64.backward(dout.double())
    ref = (out64.detach(), *(t.grad for t in leaves))
    torch.testing.assert_close(ours[0].double(), ref[0], atol=2e-3, rtol=0)
    for g, r in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(g.double(), r, atol=1e-2, rtol=1e-2)
    mine, torch_kernels = _kernels(lambda: _sdpa_grads(q, k, v, dout, **kw))
    assert any("flash_fwd" in n for n in mine) and any("flash_bwd" in n for n in mine)
    assert not torch_kernels


@pytest.mark.gpu
def test_gpu_mask_above_the_bias_backward_limit_empty_rows_give_zero_gradients(on_gpu):
    # head_dim 160 with a mask: the forward runs on the kernels (a bias at any head dim) and the
    # backward falls back to torch's efficient kernel (the bias backward stops at 128), which
    # is handed our LSE. A query row that sees no key must keep 0 output and 0 gradients, and
    # every other row torch's (the definition, float64).
    q, k, v = bhsd(1, 2, None, 48, 64, 160, device="cuda", seed=seed_from(160, 48))
    mask = torch.rand(1, 1, 48, 64, device="cuda", generator=torch.Generator("cuda")
                      .manual_seed(3)) > 0.3
    mask[..., 5, :] = False  # query row 5 sees no key
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    assert so.why_not_overridden(q, k, v, mask) is None
    ours = _sdpa_grads(q, k, v, dout, attn_mask=mask)
    assert all(torch.isfinite(t).all() for t in ours)
    assert (ours[0][:, :, 5] == 0).all() and (ours[1][:, :, 5] == 0).all()
    seen = mask.any(-1, keepdim=True)  # rows that see a key; row 5 is 0 (the definition's limit)
    add = torch.zeros(mask.shape, dtype=torch.float64, device="cuda").masked_fill(
        ~(mask | ~seen), float("-inf"))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    p64 = torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(160) + add, dim=-1)
    out64 = (p64 * seen) @ leaves[2]
    out64.backward(dout.double())
    for g, r in zip(ours, (out64.detach(), *(t.grad for t in leaves))):
        torch.testing.assert_close(g.double(), r, atol=1e-2, rtol=1e-2)


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms(True) for the block (torch's efficient backward then
    runs without atomics, so two runs agree bit for bit)."""
    was, warn = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp32", "bf16", "dropout", "head_dim_264", "misaligned"])
def test_gpu_fallback_inputs_run_torch_with_torch_results(on_gpu, name):
    (q, k, v), kw = _fallback_gpu_case(name)
    assert so.why_not_overridden(q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0))
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype)

    def run():
        torch.manual_seed(1234)  # dropout: the same mask in every run
        return _sdpa_grads(q, k, v, dout, **kw)

    with deterministic():
        error = None
        with stock():
            try:
                theirs = run()
            except RuntimeError as e:
                # torch's own kernel may have none for the input on this GPU: the H200's
                # mem-efficient kernels need 16-byte aligned heads ("cutlassF: no kernel found
                # to launch!"), Turing's have unaligned variants. Then torch's error, unchanged.
                error = e
        if error is not None:
            with pytest.raises(type(error)) as ours_err:
                run()  # enabled (the on_gpu fixture): the same error from the same kernel
            assert str(ours_err.value) == str(error), name
            return
        ours = run()
    for a, t in zip(ours, theirs):  # output and gradients: torch's, bit for bit
        assert torch.equal(a, t), name
    mine, torch_kernels = _kernels(run)
    assert not mine and torch_kernels, name


@pytest.mark.gpu
def test_gpu_other_devices_keep_torch_unless_opted_in():
    if torch.cuda.get_device_capability() == (7, 5):
        pytest.skip("a Turing GPU: the kernels are meant to run")
    q, k, v = bhsd(2, 4, None, 128, 128, 64, device="cuda")
    call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with stock():
        theirs = call()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with fa.sdpa_enabled(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert "not 7.5" in so.why_not_overridden(q, k, v)
        assert torch.equal(call(), theirs)
        mine, torch_kernels = _kernels(call)
    assert not mine and torch_kernels


# ------------------------------------------------------------------------------- models


def _train_step(model, inputs, loss_fn, math_sdpa=False):
    """Output (float32) and float32 gradients of every parameter after one backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext():
        out = model(*inputs)
        loss_fn(out).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.float().detach() if isinstance(out, torch.Tensor) else out, grads


def _rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compare_model(model16, inputs16, inputs32, loss_fn, get_out=lambda o: o, min_calls=1):
    """ours (enabled) vs stock fp16 (efficient backend) vs the fp32 copy on MATH: output within
    the FlashAttention criterion, every parameter's gradient as close to fp32 as stock's
    (relative error ours <= 2 x stock + 5e-3); our kernels ran, torch's mem-efficient did not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref32 = copy.deepcopy(model16).float()
    wrap = lambda o: get_out(o)  # noqa: E731
    loss = lambda o: loss_fn(wrap(o))  # noqa: E731
    with fa.sdpa_enabled(treat_as_sm75=True), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out_ours, g_ours = _train_step(model16, inputs16, loss)
        mine, torch_kernels = _kernels(lambda: _train_step(model16, inputs16, loss))
    with stock():
        out_stock, g_stock = _train_step(model16, inputs16, loss)
    out_ref, g_ref = _train_step(ref32, inputs32, loss, math_sdpa=True)
    assert any("flash_fwd" in n for n in mine) and any("flash_bwd" in n for n in mine), mine
    assert not torch_kernels, torch_kernels
    o, s, r = (wrap(x).float() for x in (out_ours, out_stock, out_ref))
    assert_close_fa(o, r, s, "model output")
    for name, g32 in g_ref.items():
        e_ours, e_stock = _rel_err(g_ours[name], g32), _rel_err(g_stock[name], g32)
        assert e_ours <= 2 * e_stock + 5e-3, (name, e_ours, e_stock)


@pytest.mark.gpu
def test_gpu_multihead_attention():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(256, 4, batch_first=True, device="cuda",
                                      dtype=torch.float16).train()
    x = torch.randn(3, 150, 256, device="cuda")

    class Self(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, t):
            return self.m(t, t, t, need_weights=False)[0]

    _compare_model(Self(mha), (x.half(),), (x,), lambda o: o.float().pow(2).mean() * 1e3)


@pytest.mark.gpu
def test_gpu_timm_vit_tiny():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False).to("cuda").half().train()
    x = torch.randn(2, 3, 224, 224, device="cuda")
    _compare_model(vit, (x.half(),), (x,), lambda o: o.float().pow(2).mean() * 1e3)


@pytest.mark.gpu
def test_gpu_diffusers_unet():
    pytest.importorskip("diffusers")
    from test_diffusers import TEXT_TOKENS, _inputs, _unet

    unet = _unet(torch.float16, "cuda").train()
    latents, t, text = _inputs("cuda")
    assert text.shape[1] == TEXT_TOKENS
    _compare_model(unet, (latents.half(), t, text.half()), (latents, t, text),
                   lambda o: o.float().pow(2).mean() * 1e3, get_out=lambda o: o.sample)


# ------------------------------------------------------------------ compile, CUDA graphs


@pytest.mark.gpu
def test_gpu_compile_fullgraph(on_gpu):
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in bhsd(2, 4, None, 200, 200, 64, device="cuda"))
    dout = torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.float16)

    def f(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    compiled = torch.compile(f, fullgraph=True)

    def step(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        return out.detach(), *(t.grad.clone() for t in (q, k, v))

    got = step(compiled)
    want = step(f)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same kernels, deterministic
    mine, torch_kernels = _kernels(lambda: step(compiled))
    assert any("flash_fwd" in n for n in mine) and any("flash_bwd" in n for n in mine)
    assert not torch_kernels
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay(on_gpu):
    # Forward and backward captured in one graph (seqlen_q 100: the LSE padding runs too),
    # replayed on new inputs: the results of eager calls, bit for bit.
    q, k, v = (t.requires_grad_() for t in bhsd(2, 4, None, 100, 160, 64, device="cuda"))
    dout = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.float16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the capture
            for t in (q, k, v):
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None  # the captured backward allocates them (static, refilled by each replay)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (1, 2):
        new = bhsd(2, 4, None, 100, 160, 64, device="cuda", seed=seed)
        with torch.no_grad():
            for t, n in zip((q, k, v), new):
                t.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = _sdpa_grads(q, k, v, dout, is_causal=True)
        assert torch.equal(static_out, want[0])
        assert all(torch.equal(t.grad, w) for t, w in zip((q, k, v), want[1:]))
