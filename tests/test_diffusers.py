"""Stable Diffusion 1.5's UNet attention through the SDPA wrapper (diffusers).

SD1.5's UNet runs 8 heads at 320, 640 and 1280 channels: head dims 40, 80 and 160, self
attention over the latent pixels and cross attention to 77 text tokens. A random-weight
UNet2DConditionModel with SD1.5's channel and head layout (fewer layers per block, a small
latent) calls ``torch.nn.functional.scaled_dot_product_attention`` through diffusers' own
attention processor; the test routes those calls to ``flash_attention_sm75.scaled_dot_product_attention``
in strict mode (a call the kernel cannot take raises instead of falling back).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import flash_attention_sm75 as fa

diffusers = pytest.importorskip("diffusers")

# SD1.5 (runwayml/stable-diffusion-v1-5 unet/config.json) except layers_per_block (2 there).
SD15_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                      "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                    "CrossAttnUpBlock2D"),
    attention_head_dim=8,  # diffusers' SD1.5 name for the number of heads
    cross_attention_dim=768,
    layers_per_block=1,
    norm_num_groups=32,
)
TEXT_TOKENS = 77


def _unet(dtype, device):
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**SD15_UNET).to(device=device, dtype=dtype).eval()
    unet.set_attn_processor(diffusers.models.attention_processor.AttnProcessor2_0())
    return unet


def _inputs(device, batch=2):
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 4, 16, 16, generator=g)
    text = torch.randn(batch, TEXT_TOKENS, 768, generator=g)
    return latents.to(device), torch.tensor([500.0, 20.0][:batch]).to(device), text.to(device)


class _Recorder:
    """Stands in for F.scaled_dot_product_attention: records each call's (head_dim, Sq, Sk) and
    the SDPA wrapper's reason, then runs ``impl``."""

    def __init__(self, impl):
        self.impl, self.calls = impl, []

    def __call__(self, query, key, value, *args, **kwargs):
        reason = fa.why_not_supported(query, key, value, *args, **kwargs)
        self.calls.append((query.shape[-1], query.shape[-2], key.shape[-2], reason))
        return self.impl(query, key, value, *args, **kwargs)


def test_sd15_attention_calls_pass_the_rulebook_but_for_the_device(monkeypatch):
    # CPU: every attention call of the UNet is one the kernel takes on a GPU (head dims 40, 80,
    # 160; self and 77-key cross attention); the only reason given is the device.
    rec = _Recorder(F.scaled_dot_product_attention)
    unet = _unet(torch.float16, "cpu")
    latents, t, text = _inputs("cpu", batch=1)
    monkeypatch.setattr(F, "scaled_dot_product_attention", rec)
    with torch.inference_mode():
        unet(latents.half(), t, text.half())
    dims = {(d, sk == TEXT_TOKENS) for d, _, sk, _ in rec.calls}
    assert dims == {(40, False), (40, True), (80, False), (80, True), (160, False), (160, True)}
    reasons = {r for *_, r in rec.calls}
    assert len(reasons) == 1 and "CUDA" in reasons.pop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sd15_unet_on_the_kernel_matches_stock(monkeypatch):
    unet = _unet(torch.float16, "cuda")
    ref32 = copy.deepcopy(unet).float()
    latents, t, text = _inputs("cuda")
    with torch.inference_mode():
        stock = unet(latents.half(), t, text.half()).sample.float()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            ref = ref32(latents, t, text).sample
    rec = _Recorder(fa.scaled_dot_product_attention)
    monkeypatch.setattr(F, "scaled_dot_product_attention", rec)
    with torch.inference_mode(), fa.strict():
        ours = unet(latents.half(), t, text.half()).sample.float()
    assert {(d, sk == TEXT_TOKENS) for d, _, sk, _ in rec.calls} == {
        (40, False), (40, True), (80, False), (80, True), (160, False), (160, True)}
    assert all(r is None for *_, r in rec.calls)
    err, err_stock = (ours - ref).abs().max().item(), (stock - ref).abs().max().item()
    print(f"\nSD1.5 UNet: max |ours - fp32| {err:.3e}, |stock fp16 - fp32| {err_stock:.3e}")
    assert torch.isfinite(ours).all()
    assert err <= 2 * err_stock + 1e-3
