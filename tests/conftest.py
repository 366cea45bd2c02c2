"""Shared pytest configuration.

* ``@pytest.mark.gpu`` tests are skipped cleanly without a CUDA GPU of compute capability >= 7.5
  (the kernel's minimum), so the CPU part of the suite runs anywhere (CI).
* Every test starts from the same RNG state (tests that need their own seed set it).
* ``op_calls``: the argument tuples of every call that reaches ``torch.ops.flash_attention_sm75.fwd``
  (callers look the op up per call, so the spy sees every door's call); ``varlen_op_calls`` and
  ``kvcache_op_calls`` the same for ``varlen_fwd`` and ``kvcache_fwd``; ``hf_state``: the HF integration's state restored after the test.
"""
import pytest
import torch


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (7, 5):
        return f"needs a GPU of compute capability >= 7.5, found {major}.{minor}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
    yield


def _spy(monkeypatch, name):
    calls = []
    real = getattr(torch.ops.flash_attention_sm75, name)
    monkeypatch.setattr(torch.ops.flash_attention_sm75, name,
                        lambda *a, **kw: calls.append(a + tuple(kw.values())) or real(*a, **kw),
                        raising=False)
    return calls


@pytest.fixture
def op_calls(monkeypatch):
    """Argument tuples of every call of ``torch.ops.flash_attention_sm75.fwd`` in the test."""
    return _spy(monkeypatch, "fwd")


@pytest.fixture
def varlen_op_calls(monkeypatch):
    """Argument tuples of every call of ``torch.ops.flash_attention_sm75.varlen_fwd`` in the test."""
    return _spy(monkeypatch, "varlen_fwd")


@pytest.fixture
def kvcache_op_calls(monkeypatch):
    """Argument tuples of every call of ``torch.ops.flash_attention_sm75.kvcache_fwd`` in the test."""
    return _spy(monkeypatch, "kvcache_fwd")


@pytest.fixture
def hf_state():
    """The HF integration's settings, statistics and caches, restored after the test (skips
    without transformers)."""
    pytest.importorskip("transformers")
    from flash_attention_sm75.integrations import transformers as hf

    settings = hf.configure()
    hf.reset_stats()
    hf._clear_classification_cache()
    yield
    hf.configure(**settings)
    hf._clear_classification_cache()
