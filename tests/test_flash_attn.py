"""Numerics of the forward op and the direct API (flash_attn_func / flash_attention_forward).

Output and LSE are compared with the float64 reference (tests/reference.py) under
FlashAttention's criterion (out) and a fixed LSE tolerance. GPU tests run the SM75 kernel with
NaN-poisoned allocator memory; CPU tests run the op's CPU implementation (float64).
"""
import math

import pytest
import torch

import flash_attention_sm75 as fa
from reference import (assert_close_fa, assert_lse_close, attention_ref, cuda_kernels_run,
                       poisoned_cuda_memory, seed_from, visible_mask)

pytestmark = pytest.mark.skipif(not fa.EXTENSION_AVAILABLE,
                                reason=f"extension not built: {fa.EXTENSION_ERROR}")

op = torch.ops.flash_attention_sm75.fwd if fa.EXTENSION_AVAILABLE else None

CAUSAL_MODES = ["none", "bottom_right", "top_left"]
SMALL_SEQLENS = [1, 7, 64, 127, 128, 129]
# Selected (seqlen_q, seqlen_k) pairs with the long lengths 1000, 2048, 4097.
BIG_PAIRS = [(1000, 1000), (2048, 2048), (4097, 4097), (1, 4097), (4097, 1), (7, 2048),
             (2048, 7), (129, 1000), (1000, 129), (1000, 2048), (2048, 1000), (127, 4097),
             (4097, 128), (64, 2048)]


def causal_args(mode):
    """(is_causal, causal_bottom_right) for a causal mode name."""
    return {"none": (False, True), "bottom_right": (True, True), "top_left": (True, False)}[mode]


def run_op(q, k, v, mode, softmax_scale=None, leftpad_k=None, seqused_k=None):
    """Call the kernel: via flash_attn_func where it can express the case, else the raw op."""
    is_causal, bottom_right = causal_args(mode)
    if bottom_right and leftpad_k is None and seqused_k is None:
        return fa.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=is_causal,
                                  return_lse=True)
    return op(q, k, v, softmax_scale, is_causal, bottom_right, leftpad_k, seqused_k)


def check_against_ref(q, k, v, mode, out, lse, softmax_scale=None, leftpad_k=None,
                      seqused_k=None, layout="bshd"):
    is_causal, bottom_right = causal_args(mode)
    kw = dict(causal=is_causal, causal_bottom_right=bottom_right, softmax_scale=softmax_scale,
              leftpad_k=leftpad_k, seqused_k=seqused_k, layout=layout)
    out_ref, lse_ref = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert out.dtype == torch.float16
    assert_close_fa(out, out_ref, out_pt)
    assert_lse_close(lse, lse_ref)
    return out_ref, lse_ref


def make_qkv(b, s_q, s_k, h, h_k, d, device, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(b, s_q, h, d, generator=g) * scale).to(device=device, dtype=torch.float16)
    k = (torch.randn(b, s_k, h_k, d, generator=g) * scale).to(device=device, dtype=torch.float16)
    v = torch.randn(b, s_k, h_k, d, generator=g).to(device=device, dtype=torch.float16)
    return q, k, v


def gpu_case(b, s_q, s_k, h, h_k, d, mode, softmax_scale=None, input_scale=1.0):
    q, k, v = make_qkv(b, s_q, s_k, h, h_k, d, "cuda", seed_from(b, s_q, s_k, h, h_k, d, mode),
                       input_scale)
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, mode, softmax_scale)
    assert out.shape == (b, s_q, h, d) and out.is_contiguous()
    assert lse.shape == (b, h, s_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    check_against_ref(q, k, v, mode, out, lse, softmax_scale)


# ----------------------------------------------------------------------------------- CPU op


@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (7, 13), (13, 7), (64, 64), (33, 100)])
@pytest.mark.parametrize("h,h_k", [(2, 2), (4, 2), (4, 1)])
def test_cpu_op_matches_reference(s_q, s_k, d, mode, h, h_k):
    q, k, v = make_qkv(2, s_q, s_k, h, h_k, d, "cpu", seed_from(s_q, s_k, d, mode, h, h_k))
    out, lse = run_op(q, k, v, mode)
    assert out.shape == (2, s_q, h, d) and out.is_contiguous()
    check_against_ref(q, k, v, mode, out, lse)


@pytest.mark.parametrize("mode", CAUSAL_MODES)
def test_cpu_op_key_ranges(mode):
    b, s_q, s_k, h, d = 5, 9, 20, 2, 64
    q, k, v = make_qkv(b, s_q, s_k, h, h, d, "cpu", seed_from("ranges", mode))
    leftpad = torch.tensor([0, 3, 12, 20, 15], dtype=torch.int32)
    seqused = torch.tensor([20, 17, 12, 25, 5], dtype=torch.int32)  # batch 2-4 see nothing
    out, lse = run_op(q, k, v, mode, leftpad_k=leftpad, seqused_k=seqused)
    check_against_ref(q, k, v, mode, out, lse, leftpad_k=leftpad, seqused_k=seqused)
    assert torch.all(out[2:] == 0) and torch.isneginf(lse[2:]).all()


def test_cpu_op_softmax_scale_and_bhsd_views():
    q, k, v = make_qkv(2, 16, 24, 4, 2, 64, "cpu", 7)
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # BHSD storage
    out, lse = fa.flash_attention_forward(qb, kb, vb, causal=True, softmax_scale=0.3,
                                          return_lse=True)
    assert out.shape == (2, 4, 16, 64) and out.transpose(1, 2).is_contiguous()
    check_against_ref(qb, kb, vb, "bottom_right", out, lse, softmax_scale=0.3, layout="bhsd")


# ----------------------------------------------------------------------------------- GPU grid


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s_k", SMALL_SEQLENS)
@pytest.mark.parametrize("s_q", SMALL_SEQLENS)
def test_gpu_small_seqlens(s_q, s_k, d, mode):
    gpu_case(2, s_q, s_k, 2, 2, d, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s_q,s_k", BIG_PAIRS)
def test_gpu_long_seqlens(s_q, s_k, d, mode):
    gpu_case(1, s_q, s_k, 2, 2, d, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b", [1, 3, 4])
@pytest.mark.parametrize("h,h_k", [(4, 4), (4, 2), (8, 2), (16, 2), (8, 1), (6, 3)])
def test_gpu_batch_and_gqa(h, h_k, b, d, mode):
    # (8, 2): ratio 4, (16, 2): ratio 8, (8, 1): MQA.
    gpu_case(b, 113, 257, h, h_k, d, mode)
    gpu_case(b, 257, 113, h, h_k, d, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s_q,s_k", [(128, 128), (200, 1000), (1000, 200)])
def test_gpu_large_magnitude(s_q, s_k, d, mode):
    # Scaled scores reach about +-60: exp() of them overflows fp16 (max ~65504 = e^11), so a
    # softmax without the running max would give inf/NaN.
    input_scale = math.sqrt(15.0)  # q.k * d^-1/2 ~ N(0, 15^2)
    q, k, v = make_qkv(2, s_q, s_k, 2, 2, d, "cuda", seed_from("big", s_q, s_k, d, mode),
                       input_scale)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(d)
    assert scores.abs().max().item() > 40.0  # the test really has large scores
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, mode)
    check_against_ref(q, k, v, mode, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "bottom_right"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("growth", [0.5, 4.0, 7.9, 8.1, 12.0, 40.0])
def test_gpu_row_max_growing_across_key_tiles(growth, d, mode):
    # Scores rise (or, for rows with a negative q[..., 0], fall) linearly along the keys by
    # about `growth` log2 units per 64-key tile, so the running row max moves by amounts on
    # both sides of the kernel's rescale threshold (d = 128 keeps a stale max unless it grew by
    # more than 8): the skip path and the rescale path both run, over many tiles.
    s_q, s_k, h = 96, 1000, 2
    g = torch.Generator(device="cpu").manual_seed(seed_from("growth", growth, d, mode))
    q = torch.randn(1, s_q, h, d, generator=g) * 0.5
    q[..., 0] = torch.where(torch.rand(1, s_q, h, generator=g) < 0.75, 1.0, -1.0)
    k = torch.randn(1, s_k, h, d, generator=g) * 0.5
    per_key = growth / 64 * math.log(2) * math.sqrt(d)  # natural-log units, pre-scale
    k[..., 0] = per_key * torch.arange(s_k, dtype=torch.float32)[None, :, None]
    v = torch.randn(1, s_k, h, d, generator=g)
    q, k, v = (x.to(device="cuda", dtype=torch.float16) for x in (q, k, v))
    assert k.float().abs().max().item() < 60000  # fp16 range
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, mode)
    check_against_ref(q, k, v, mode, out, lse)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_largest_softmax_scale_gives_no_nan(device, d):
    # The largest float16 scores, |q.k| = d * 65504^2, times the largest accepted scale (bounded
    # for head_dim 256) reach ~FLT_MAX / 2 at d = 256 (above 1e38) but cannot overflow: no NaN.
    # With q = k made of distinct +-65504 rows, every row's own key wins by at least
    # 2 * 65504^2 * scale, so the exact result is one-hot: out = v (the GPU kernel needs its
    # exact exponent path for that, kExactExpFrom).
    g = torch.Generator(device="cpu").manual_seed(7)
    sign = torch.where(torch.rand(1, 33, 2, d, generator=g) < 0.5, -1.0, 1.0)
    assert len({tuple(r) for r in sign[0].flatten(1).tolist()}) == 33  # distinct rows
    q = (sign * 65504.0).to(torch.float16).to(device)
    v = torch.randn(1, 33, 2, d, generator=g).to(torch.float16).to(device)
    scale = fa._rules.SOFTMAX_SCALE_MAX
    out, lse = run_op(q, q, v, "none", scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.equal(out, v)
    _, lse_ref = attention_ref(q, q, v, softmax_scale=scale)
    # The test really reaches the top of float32.
    assert lse_ref.abs().max().item() > (1e38 if d == 256 else 5e37)
    assert_lse_close(lse, lse_ref)


def run_forced_tile(env, choice, q, k, v, mode, monkeypatch):
    """Run the forward with tile switch `env` set to `choice` on poisoned memory; return the name
    of the one forward kernel that ran and (out, lse)."""
    monkeypatch.setenv(env, choice)
    res = {}

    def call():
        with poisoned_cuda_memory():
            res["out"], res["lse"] = run_op(q, k, v, mode)

    names = cuda_kernels_run(call, "flash_fwd")
    assert len(names) == 1, names
    return next(iter(names)), res["out"], res["lse"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("choice", ["always", "never", "auto"])
@pytest.mark.parametrize("shape", [(4, 512, 512, 16, 16), (2, 500, 517, 25, 5), (1, 7, 1000, 3, 1)])
def test_gpu_small_grid_tile(shape, choice, mode, monkeypatch):
    # d = 64 has a second tile (Q in shared memory, Bc = 32, 4 CTAs per SM) for grids just over
    # one wave; FLASH_SM75_FWD_SMALL_GRID_TILE forces it on or off. Both tiles must be exact,
    # and the forced choice must be the kernel that ran.
    b, s_q, s_k, h, h_k = shape
    q, k, v = make_qkv(b, s_q, s_k, h, h_k, 64, "cuda", seed_from("sg", shape, mode))
    # 'auto' plans for this device: a FLASH_SM75_DEVICE_PROFILE in the environment (t4 in the
    # benchmarks' shells, or set by benchmarks/_common.py's import when a test in this process
    # loaded it) would plan for that GPU's SM count instead.
    monkeypatch.setenv("FLASH_SM75_DEVICE_PROFILE", "native")
    name, out, lse = run_forced_tile("FLASH_SM75_FWD_SMALL_GRID_TILE", choice, q, k, v, mode,
                                     monkeypatch)
    small = "FwdTileD64SmallGrid" in name
    if choice == "auto":
        # Resident CTAs per SM: 3 of the default tile (launch bounds), 4 of the small one (<= 128
        # registers, 16 KiB). The small tile runs when it makes the grid one wave, the default
        # does not (prefer_small_grid_tile); a failed occupancy query would keep the default.
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        blocks = -(-s_q // 64) * b * h
        assert small == (3 * sms < blocks <= 4 * sms), (name, blocks, sms)
    else:
        assert small == (choice == "always"), name
    check_against_ref(q, k, v, mode, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("shape", [(2, 300, 517, 8, 2), (1, 129, 33, 4, 4), (1, 77, 4097, 2, 1),
                                   (3, 2, 250, 2, 1)])
def test_gpu_l2_prefetch_changes_no_result(shape, mode, monkeypatch):
    # The d = 256 plain tile asks L2 for K / V tiles ahead of its loads
    # (FLASH_SM75_FWD_L2_PREFETCH: 'auto' = the tile's own distance, '0' = none, or a distance).
    # A hint: every distance, including those past the last key, must give bitwise the same
    # output and LSE as none, and that output must be exact.
    b, s_q, s_k, h, h_k = shape
    q, k, v = make_qkv(b, s_q, s_k, h, h_k, 256, "cuda", seed_from("l2pf", shape, mode))
    name, out0, lse0 = run_forced_tile("FLASH_SM75_FWD_L2_PREFETCH", "0", q, k, v, mode,
                                       monkeypatch)
    assert "FwdTileD256Wide" in name, name
    check_against_ref(q, k, v, mode, out0, lse0)
    for choice in ("auto", "1", "2", "8"):
        name, out, lse = run_forced_tile("FLASH_SM75_FWD_L2_PREFETCH", choice, q, k, v, mode,
                                         monkeypatch)
        assert "FwdTileD256Wide" in name, name
        assert torch.equal(out, out0), choice
        assert torch.equal(lse, lse0), choice


@pytest.mark.gpu
@pytest.mark.parametrize("name,value,s_q", [
    *[("FLASH_SM75_FWD_SMALL_GRID_TILE", v, 65) for v in ("ALWAYS", "1", "on")],
    *[("FLASH_SM75_FWD_L2_PREFETCH", v, 65) for v in ("on", "5", "-1")],
    *[("FLASH_SM75_DECODE", v, 1) for v in ("NEVER", "0", "always")]])
def test_gpu_forward_env_rejects_unknown_values(name, value, s_q, monkeypatch):
    q, k, v = make_qkv(1, s_q, 65, 2, 2, 64, "cuda", 3)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be 'auto'"):
        run_op(q, k, v, "none")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,s_k,h,h_k", [(1, 1, 1, 1), (3, 77, 3, 1), (2, 1000, 8, 8),
                                         (4, 4099, 32, 8), (1, 5000, 14, 2), (2, 300, 16, 1),
                                         (1, 257, 32, 1)])
def test_gpu_decode_kernel(b, s_k, h, h_k, d, mode, monkeypatch):
    # seqlen_q == 1 runs the split-KV decode kernel (up to 16 q-heads per kv head in one CTA;
    # a group of 32 runs as 2 head parts of 16); FLASH_SM75_DECODE=never forces the prefill
    # kernel. Both must match the reference, outputs poisoned with NaN first, and the kernel
    # that ran must be the one the setting says.
    q, k, v = make_qkv(b, 1, s_k, h, h_k, d, "cuda", seed_from("decode", b, s_k, h, h_k, d, mode))
    for choice in ("auto", "never"):
        monkeypatch.setenv("FLASH_SM75_DECODE", choice)
        res = {}

        def call():
            with poisoned_cuda_memory():
                res["out"], res["lse"] = run_op(q, k, v, mode)

        names = cuda_kernels_run(call, "flash_fwd")
        assert any("decode" in n for n in names) == (choice == "auto"), names
        check_against_ref(q, k, v, mode, res["out"], res["lse"])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 64, 128])
@pytest.mark.parametrize("b,s_k,h,h_k", [(1, 4099, 8, 8), (3, 777, 8, 2), (2, 33, 4, 1)])
def test_gpu_decode_l2_prefetch_changes_no_result(b, s_k, h, h_k, d, monkeypatch):
    # The decode kernel (kD <= 128) asks L2 for each step's V rows
    # (FLASH_SM75_FWD_L2_PREFETCH=0 turns it off): bitwise the same output and LSE, with and
    # without key splits. (Its addresses are checked by the emulator: emu::check_prefetch.)
    q, k, v = make_qkv(b, 1, s_k, h, h_k, d, "cuda", seed_from("decode-l2", b, s_k, h, h_k, d))
    res = {}
    for choice in ("0", "auto"):
        monkeypatch.setenv("FLASH_SM75_FWD_L2_PREFETCH", choice)

        def call():
            with poisoned_cuda_memory():
                res[choice] = run_op(q, k, v, "bottom_right")

        names = cuda_kernels_run(call, "flash_fwd")
        assert any("decode_kernel" in n for n in names), names
    check_against_ref(q, k, v, "bottom_right", *res["auto"])
    assert torch.equal(res["auto"][0], res["0"][0])
    assert torch.equal(res["auto"][1], res["0"][1])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_decode_key_ranges(d, mode):
    # Left padding and seqused_k per batch entry (one entry sees no key: out 0, lse -inf) with
    # the decode kernel's key splits, GQA group of 4.
    b, s_k, h, h_k = 4, 1500, 8, 2
    q, k, v = make_qkv(b, 1, s_k, h, h_k, d, "cuda", seed_from("decode-kr", d, mode))
    leftpad = torch.tensor([0, 333, 1500, 7], dtype=torch.int32, device="cuda")
    seqused = torch.tensor([1500, 1400, 1500, 8], dtype=torch.int32, device="cuda")
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, mode, leftpad_k=leftpad, seqused_k=seqused)
    check_against_ref(q, k, v, mode, out, lse, leftpad_k=leftpad, seqused_k=seqused)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "bottom_right"])
@pytest.mark.parametrize("s_q,s_k", [(64, 1), (64, 100), (1, 1), (1, 100), (1, 3000)])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_output_at_fp16_max_is_finite(d, s_q, s_k, mode):
    # v = 65504 everywhere: the exact output is 65504. P is rounded to fp16 for P V while l sums
    # the fp32 P, so O can come out ~2^-11 above max |v|; unclamped, that rounds to inf.
    g = torch.Generator(device="cpu").manual_seed(d + s_k)
    q = (torch.randn(2, s_q, 2, d, generator=g) * 120).to(torch.float16).cuda()
    k = (torch.randn(2, s_k, 2, d, generator=g) * 120).to(torch.float16).cuda()
    v = torch.full((2, s_k, 2, d), 65504.0, dtype=torch.float16, device="cuda")
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, mode)
    visible = torch.isfinite(lse).transpose(1, 2)  # (b, s_q, h): rows that see a key
    assert visible.any()
    assert torch.isfinite(out).all()
    # within two fp16 steps (32 each at this magnitude) of the exact 65504: the weights' fp16
    # rounding moves the ratio sum(P16) / sum(P) by up to ~2^-11
    assert (out[visible].float() - 65504.0).abs().max().item() <= 64.0


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("a", [64.0, 4096.0, 65504.0])
@pytest.mark.parametrize("s_k,s_q", [(300, 70), (3000, 1)])
def test_gpu_huge_scores_across_key_tiles(s_k, s_q, a, d):
    # As below, each query is one of the s_k keys (distinct +-a vectors), so the output is
    # exactly that key's v at any magnitude. (300, 70): the prefill kernel over 5 key tiles,
    # queries scattered over them (the running max and the exact-exponent flag carry across
    # tiles). (3000, 1): the decode kernel in several key splits (one fp32 LSE per split loses
    # log(l) next to m * scale and mis-weights the splits in the merge, O = 2x the exact value;
    # the merge uses (max, sum) pairs).
    g = torch.Generator(device="cpu").manual_seed(int(a) + d + s_k)
    sign = torch.where(torch.rand(1, s_k, 1, d, generator=g) < 0.5, -1.0, 1.0)
    assert len({tuple(r) for r in sign[0, :, 0].tolist()}) == s_k  # distinct keys
    k = (sign * a).to(torch.float16).cuda()
    v = torch.randn(1, s_k, 1, d, generator=g).to(torch.float16).cuda()
    rows = torch.randperm(s_k, generator=g)[:s_q]
    q = k[:, rows.cuda()]
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, "none")
    assert torch.equal(out, v[:, rows.cuda()])
    _, lse_ref = attention_ref(q, k, v)
    assert_lse_close(lse, lse_ref)


def _large_spread_inputs(rising, a, d):
    # Large but finite scores that are not one-hot: q_i = (a, 1, 0, ...), k_j = (a, delta_j,
    # 0, ...), s_ij = a^2 + delta_j exactly (scaled ~2^19 / 2^21 at d = 128, below the exact
    # path), delta_j even in [0, 46] (keys within ~6 log2 units) or 2 j (the row max moves every
    # ~32 keys). An exponent carrying the rounding error of rn(max * scale_log2) gives errors of
    # 1e-2..7e-2 here, float32 scores in the CPU op 1e-2..4e-2. fp16 SDPA overflows at a^2, so
    # the bound is absolute: fp16 rounding of P and of the output (~1e-3).
    s_q, s_k = 16, 256
    g = torch.Generator(device="cpu").manual_seed(int(a) + d + 7 * rising)
    delta = 2.0 * (torch.arange(s_k) if rising else torch.randint(0, 24, (s_k,), generator=g))
    q = torch.zeros(1, s_q, 1, d)
    q[..., 0], q[..., 1] = a, 1.0
    k = torch.zeros(1, s_k, 1, d)
    k[..., 0], k[0, :, 0, 1] = a, delta
    v = torch.randn(1, s_k, 1, d, generator=g)
    return tuple(t.to(torch.float16) for t in (q, k, v))


def _check_large_spread(q, k, v, out, lse):
    out_ref, lse_ref = attention_ref(q, k, v)
    assert torch.isfinite(out).all()
    assert (out.double() - out_ref).abs().max().item() <= 2e-3
    assert_lse_close(lse, lse_ref)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("a", [2048.0, 4096.0])
@pytest.mark.parametrize("rising", [False, True])
def test_cpu_op_large_spread_scores(rising, a, d):
    q, k, v = _large_spread_inputs(rising, a, d)
    out, lse = run_op(q, k, v, "none")
    _check_large_spread(q, k, v, out, lse)


@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("v_max", [4.0, 60000.0])
@pytest.mark.parametrize("scale_log2", [38, 42])
def test_cpu_op_tied_keys_huge_scores(scale_log2, v_max, mode):
    # Duplicated keys (k[:, 2j + 1] = k[:, 2j], different v) at scaled scores ~1e14..1e16: the
    # tied keys share the row max, so each has p = 1/m. Integer q, k and a power-of-two scale
    # make every score exact in float64 in any summation order (equal or >= 2^scale_log2
    # apart), so the op and the reference below see the same scores. p = exp(s - lse) lost
    # log(m) in s - lse at these magnitudes (wrong weights, up to m x v: inf in fp16 for large
    # v); the op must match torch.softmax in float64 to fp16 rounding of the output.
    b, s_q, s_k, h, h_k, d = 2, 40, 32, 4, 2, 64
    g = torch.Generator(device="cpu").manual_seed(seed_from("tied", scale_log2, v_max, mode))
    q = torch.randint(-8, 9, (b, s_q, h, d), generator=g).to(torch.float16)
    k = torch.randint(-8, 9, (b, s_k, h_k, d), generator=g).to(torch.float16)
    k[:, 1::2] = k[:, 0::2]
    v = ((torch.rand(b, s_k, h_k, d, generator=g) * 2 - 1) * v_max).to(torch.float16)
    scale = 2.0 ** scale_log2
    is_causal, bottom_right = causal_args(mode)
    out, lse = op(q, k, v, scale, is_causal, bottom_right, None, None)

    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    kf, vf = (t.repeat_interleave(h // h_k, dim=1) for t in (kf, vf))
    vis = visible_mask(b, s_q, s_k, is_causal, bottom_right)
    s = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: NaN -> 0
    out_ref = (p @ vf).transpose(1, 2)
    lse_ref = torch.logsumexp(s, dim=-1)
    assert s.abs()[vis.expand_as(s)].max().item() > 1e14

    assert torch.isfinite(out).all()
    err = (out.double() - out_ref).abs()
    # fp16 rounding of the output (half an ulp = eps16 / 2 relative), with a 2x margin
    bound = torch.finfo(torch.float16).eps * out_ref.abs() + 2.0 ** -24
    assert (err <= bound).all(), f"max err {err.max().item():.3e}, {int((err > bound).sum())} off"
    empty = torch.isneginf(lse_ref)
    assert empty.any() == (mode == "bottom_right")  # s_q > s_k: the first rows see nothing
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty.transpose(1, 2)] == 0).all()  # rows that see no key: O = 0, lse = -inf
    assert torch.isfinite(lse[~empty]).all()
    lse_err = (lse.double() - lse_ref)[~empty].abs()
    assert (lse_err <= torch.finfo(torch.float32).eps * (lse_ref[~empty].abs() + 1.0)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("a", [2048.0, 4096.0])
@pytest.mark.parametrize("rising", [False, True])
def test_gpu_large_spread_scores(rising, a, d):
    q, k, v = (t.cuda() for t in _large_spread_inputs(rising, a, d))
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, "none")
    _check_large_spread(q, k, v, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("a", [4096.0, 65504.0])
def test_gpu_huge_scores_exact_forward_finite_backward(a, d):
    # q = k = +-a rows at the default scale: scaled scores up to ~1e11, far past float32's
    # integer range. An FFMA exp2(s * c - m) gives the row max exp2(+-0.5 ulp) = inf or 0
    # there (NaN output); the kernel's exact path must return the one-hot result, and the
    # backward (limited by the float32 LSE) must stay finite.
    g = torch.Generator(device="cpu").manual_seed(int(a) + d)
    sign = torch.where(torch.rand(2, 40, 2, d, generator=g) < 0.5, -1.0, 1.0)
    q = (sign * a).to(torch.float16).cuda().requires_grad_()
    v = torch.randn(2, 40, 2, d, generator=g).to(torch.float16).cuda().requires_grad_()
    with poisoned_cuda_memory():
        out, lse = fa.flash_attn_func(q, q, v, return_lse=True)
    assert torch.equal(out, v)  # every row's own key wins by >= 2 a^2 / sqrt(d) * log2(e)
    _, lse_ref = attention_ref(q.detach(), q.detach(), v.detach())
    assert_lse_close(lse, lse_ref)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("softmax_scale", [0.01, 0.3, 1.0])
def test_gpu_softmax_scale(softmax_scale):
    q, k, v = make_qkv(2, 130, 190, 4, 2, 64, "cuda", seed_from("scale", softmax_scale))
    with poisoned_cuda_memory():
        out, lse = run_op(q, k, v, "bottom_right", softmax_scale)
    check_against_ref(q, k, v, "bottom_right", out, lse, softmax_scale)


# ------------------------------------------------------------------ non-contiguous / strided


def _strided_inputs(kind, b, s_q, s_k, h, h_k, d, seed):
    """q, k, v (BSHD views unless kind == 'bhsd') with non-contiguous but valid strides."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device="cuda", dtype=torch.float16)

    if kind == "bhsd":  # BHSD contiguous tensors; the API passes transpose(1, 2) views
        return rnd(b, h, s_q, d), rnd(b, h_k, s_k, d), rnd(b, h_k, s_k, d)
    if kind == "seq_slice":  # slices along the sequence (storage offset of 5 rows)
        return (rnd(b, s_q + 11, h, d)[:, 5:5 + s_q], rnd(b, s_k + 9, h_k, d)[:, 3:3 + s_k],
                rnd(b, s_k + 9, h_k, d)[:, 8:8 + s_k])
    if kind == "head_slice":  # every other head / a range of heads of a wider tensor
        return (rnd(b, s_q, 2 * h, d)[:, :, ::2], rnd(b, s_k, h_k + 3, d)[:, :, 3:],
                rnd(b, s_k, h_k + 1, d)[:, :, :h_k])
    if kind == "packed_qkv":  # one (B, S, 3, H, D) tensor, as from a fused QKV projection
        assert s_q == s_k and h == h_k
        qkv = rnd(b, s_q, 3, h, d)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if kind == "padded_head_dim":  # rows padded to d + 8 elements
        return (rnd(b, s_q, h, d + 8)[..., :d], rnd(b, s_k, h_k, d + 8)[..., :d],
                rnd(b, s_k, h_k, d + 16)[..., 8:8 + d])
    if kind == "broadcast_kv":  # k/v shared by the batch (batch stride 0) and heads (stride 0)
        k = rnd(1, s_k, 1, d).expand(b, s_k, h_k, d)
        v = rnd(1, s_k, h_k, d).expand(b, s_k, h_k, d)
        return rnd(b, s_q, h, d), k, v
    raise ValueError(kind)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind,decode", [
    *[(kind, False) for kind in ("bhsd", "seq_slice", "head_slice", "packed_qkv",
                                 "padded_head_dim", "broadcast_kv")],
    # seqlen_q == 1 over 1500 keys: the decode kernel in several key splits
    *[(kind, True) for kind in ("bhsd", "seq_slice", "head_slice", "padded_head_dim",
                                "broadcast_kv")]])
def test_gpu_strided_inputs(kind, decode, d, mode):
    b, s_q, s_k, h, h_k = 2, 150, 150, 4, 4
    if kind in ("head_slice", "broadcast_kv"):
        s_q, h_k = 97, 2
    if decode:
        s_q, s_k = 1, 1500
    q, k, v = _strided_inputs(kind, b, s_q, s_k, h, h_k, d, seed_from(kind, d, mode))
    if kind != "bhsd":
        assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    is_causal, bottom_right = causal_args(mode)
    with poisoned_cuda_memory():
        if kind == "bhsd":
            out, lse = op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                          is_causal, bottom_right)
            out = out.transpose(1, 2)
        else:
            out, lse = run_op(q, k, v, mode)
    layout = "bhsd" if kind == "bhsd" else "bshd"
    check_against_ref(q, k, v, mode, out, lse, layout=layout)


@pytest.mark.gpu
def test_gpu_flash_attention_forward_bhsd_view():
    q, k, v = _strided_inputs("bhsd", 2, 77, 300, 8, 2, 128, 11)
    with poisoned_cuda_memory():
        out, lse = fa.flash_attention_forward(q, k, v, causal=True, return_lse=True)
    # A BHSD view of a contiguous BSHD result, no copy.
    assert out.shape == (2, 8, 77, 128) and out.transpose(1, 2).is_contiguous()
    check_against_ref(q, k, v, "bottom_right", out, lse, layout="bhsd")
    out_only = fa.flash_attention_forward(q, k, v, causal=True)
    assert torch.equal(out_only, out)


# ------------------------------------------------------------------------- key ranges


@pytest.mark.gpu
@pytest.mark.parametrize("mode", CAUSAL_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s_q,s_k", [(1, 200), (64, 200), (200, 200), (333, 200), (50, 1000)])
@pytest.mark.parametrize("which", ["both", "leftpad_only", "seqused_only"])
def test_gpu_key_ranges(which, s_q, s_k, d, mode):
    b, h = 6, 2
    q, k, v = make_qkv(b, s_q, s_k, h, h, d, "cuda", seed_from("kr", which, s_q, s_k, d, mode))
    # per batch: full, inner range, empty (start == end), start == s_k, end > s_k (clamped),
    # start > end (empty)
    leftpad = torch.tensor([0, 17, s_k // 2, s_k, 5, 100], dtype=torch.int32, device="cuda")
    seqused = torch.tensor([s_k, s_k - 20, s_k // 2, s_k + 50, s_k + 7, 50], dtype=torch.int32,
                           device="cuda")
    if which == "leftpad_only":
        seqused = None
    if which == "seqused_only":
        leftpad = None
    is_causal, bottom_right = causal_args(mode)
    with poisoned_cuda_memory():
        out, lse = op(q, k, v, None, is_causal, bottom_right, leftpad, seqused)
    out_ref, lse_ref = check_against_ref(q, k, v, mode, out, lse, leftpad_k=leftpad,
                                         seqused_k=seqused)
    empty_rows = torch.isneginf(lse_ref)  # (b, h, s_q)
    if which == "both":
        assert empty_rows[2:4].all() and empty_rows[5].all()  # the test has empty batches
    # Rows that see nothing: exactly 0 and -inf, never NaN.
    out_rows = out.transpose(1, 2)[empty_rows]  # (n, d)
    assert torch.all(out_rows == 0)
    assert torch.isneginf(lse[empty_rows]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bottom_right_rows_without_keys(d):
    # seqlen_q > seqlen_k with bottom-right causal: the first s_q - s_k rows see no key.
    s_q, s_k = 300, 70
    q, k, v = make_qkv(2, s_q, s_k, 4, 2, d, "cuda", seed_from("noKeys", d))
    with poisoned_cuda_memory():
        out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :s_q - s_k] == 0)
    assert torch.isneginf(lse[:, :, :s_q - s_k]).all()
    assert torch.isfinite(lse[:, :, s_q - s_k:]).all()
    check_against_ref(q, k, v, "bottom_right", out, lse)


@pytest.mark.gpu
def test_gpu_matches_cpu_op():
    # The CUDA kernel and the CPU implementation of the same op agree.
    q, k, v = make_qkv(2, 100, 180, 8, 2, 64, "cuda", 3)
    leftpad = torch.tensor([0, 30], dtype=torch.int32)
    seqused = torch.tensor([170, 180], dtype=torch.int32)
    out, lse = op(q, k, v, None, True, False, leftpad.cuda(), seqused.cuda())
    out_cpu, lse_cpu = op(q.cpu(), k.cpu(), v.cpu(), None, True, False, leftpad, seqused)
    # Both round to fp16 (the kernel also rounds P to fp16): a few fp16 ulps of |out| <= ~4.
    assert (out.cpu().float() - out_cpu.float()).abs().max().item() <= 1e-2
    assert_lse_close(lse.cpu(), lse_cpu.double())


@pytest.mark.gpu
def test_gpu_deterministic_and_stream_safe():
    q, k, v = make_qkv(2, 513, 513, 4, 4, 128, "cuda", 5)
    out1, lse1 = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out2, lse2 = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_gpu_compile_fullgraph(backend):
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 100, 160, 8, 2, 128, "cuda", 9)

    def f(q, k, v):
        out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out, lse

    out, lse = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    out_e, lse_e = f(q, k, v)
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
    check_against_ref(q, k, v, "bottom_right", out, lse)


# ------------------------------------------------- one-query GQA calls as the group's query rows
# FLASH_SM75_DECODE_GQA=prefill runs a one-query call of a GQA group as the group's q-heads in
# the query rows of the prefill kernels (q (b, 1, h, d) read as (b, h / h_k, h_k, d); flash_api.h,
# group_rows_views). The CPU reference computes the same plan through the same views, so the
# mapping is checked here without a GPU.

GROUP_ROW_CASES = [  # (b, s_k, h, h_k, d): groups of 2 to 16, odd keys, every head-dim bucket
    (3, 77, 8, 2, 64), (1, 1500, 14, 2, 64), (2, 300, 32, 4, 128), (2, 129, 16, 1, 40),
    (1, 200, 28, 4, 256), (4, 33, 12, 3, 96), (2, 65, 6, 3, 8)]
BAD_GQA_ENV = "tensor_cores"


def _strided_q(q):
    """q's values in a tensor whose heads are 2 d apart (a slice of a wider head dim)."""
    wide = torch.randn(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype, device=q.device)
    wide[..., :q.shape[-1]] = q
    return wide[..., :q.shape[-1]]


@pytest.mark.parametrize("mode", ["none", "bottom_right"])
@pytest.mark.parametrize("b,s_k,h,h_k,d", GROUP_ROW_CASES)
def test_group_rows_cpu_reference(b, s_k, h, h_k, d, mode, monkeypatch):
    q, k, v = make_qkv(b, 1, s_k, h, h_k, d, "cpu", seed_from("group-rows", b, s_k, h, h_k, d))
    is_causal, bottom_right = causal_args(mode)
    leftpad = torch.tensor([min(3 * i, s_k) for i in range(b)], dtype=torch.int32)
    seqused = torch.tensor([s_k - i for i in range(b)], dtype=torch.int32)
    for query in (q, _strided_q(q)):
        for lp, su in ((None, None), (leftpad, seqused)):
            monkeypatch.setenv("FLASH_SM75_DECODE_GQA", BAD_GQA_ENV)
            with pytest.raises(ValueError, match="FLASH_SM75_DECODE_GQA must be 'decode' or "
                                                 "'prefill'"):
                op(query, k, v, None, is_causal, bottom_right, lp, su)  # the plan reads it
            monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "prefill")
            out, lse = op(query, k, v, None, is_causal, bottom_right, lp, su)
            assert out.shape == (b, 1, h, d) and out.is_contiguous()
            assert lse.shape == (b, h, 1) and lse.is_contiguous()
            check_against_ref(query, k, v, mode, out, lse, leftpad_k=lp, seqused_k=su)
            monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "decode")
            out_h, lse_h = op(query, k, v, None, is_causal, bottom_right, lp, su)
            torch.testing.assert_close(out, out_h, rtol=0, atol=2e-3)
            torch.testing.assert_close(lse, lse_h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["mha", "two_queries", "top_left", "window_left",
                                  "window_right", "alibi", "bias", "dropout", "decode_never"])
def test_group_rows_only_where_rows_stand_for_heads(case, monkeypatch):
    # The rows see the same keys and scores as their heads only without a window, ALiBi, bias
    # or dropout, causal bottom-right, one query: every other call keeps the heads (and never
    # reads the setting, so its unknown value raises nowhere else).
    b, s_k, h, h_k, d = 2, 40, 8, 2, 64
    s_q = 2 if case == "two_queries" else 1
    q, k, v = make_qkv(b, s_q, s_k, h, h if case == "mha" else h_k, d, "cpu",
                       seed_from("group-rows-not", case))
    args = dict(is_causal=case == "top_left", bottom_right=case != "top_left",
                window=(5 if case == "window_left" else -1, 3 if case == "window_right" else -1))
    alibi = torch.rand(h) if case == "alibi" else None
    bias = torch.randn(b, h, s_q, s_k).to(torch.float16) if case == "bias" else None
    monkeypatch.setenv("FLASH_SM75_DECODE_GQA", BAD_GQA_ENV)
    if case == "decode_never":
        monkeypatch.setenv("FLASH_SM75_DECODE", "never")
    call = (lambda: torch.ops.flash_attention_sm75.fwd_dropout(
        q, k, v, 0.1, None, False, True, None, None, -1, -1, 0.0, None, None)) \
        if case == "dropout" else \
        (lambda: op(q, k, v, None, args["is_causal"], args["bottom_right"], None, None,
                    *args["window"], 0.0, alibi, bias))
    out = call()[0]
    assert torch.isfinite(out).all()
    # The same call on an eligible shape does read it.
    q1, k1, v1 = make_qkv(b, 1, s_k, h, h_k, d, "cpu", 1)
    if case != "decode_never":
        with pytest.raises(ValueError, match="FLASH_SM75_DECODE_GQA"):
            op(q1, k1, v1, None, False, True, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "bottom_right"])
@pytest.mark.parametrize("b,s_k,h,h_k,d", GROUP_ROW_CASES + [(1, 16384, 32, 4, 128),
                                                         (4, 4099, 32, 8, 64),
                                                         (1, 9000, 16, 2, 256)])
def test_gpu_group_rows(b, s_k, h, h_k, d, mode, monkeypatch):
    # The group-rows plan on the prefill kernels (tensor cores), key splits over long keys:
    # no decode kernel runs, the merge does where the plan splits, poisoned outputs, strided q,
    # key ranges with an empty one.
    q, k, v = make_qkv(b, 1, s_k, h, h_k, d, "cuda", seed_from("gpu-group-rows", b, s_k, h, d))
    is_causal, bottom_right = causal_args(mode)
    monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "prefill")
    monkeypatch.setenv("FLASH_SM75_DEVICE_PROFILE", "t4")
    leftpad = torch.tensor([min(5 * i, s_k) for i in range(b)], dtype=torch.int32, device="cuda")
    seqused = torch.tensor([s_k - 2 * i if i != 1 else 0 for i in range(b)], dtype=torch.int32,
                           device="cuda")
    for query in (q, _strided_q(q)):
        for lp, su in ((None, None), (leftpad, seqused)):
            res = {}

            def call():
                with poisoned_cuda_memory():
                    res["out"], res["lse"] = op(query, k, v, None, is_causal, bottom_right,
                                                lp, su)

            names = cuda_kernels_run(call, "flash_fwd")
            assert not any("decode_kernel" in n for n in names), names
            assert any("flash_fwd_kernel" in n for n in names), names
            if s_k >= 4096 and lp is None:
                assert any("merge" in n for n in names), names  # key splits
            check_against_ref(query, k, v, mode, res["out"], res["lse"], leftpad_k=lp,
                              seqused_k=su)
