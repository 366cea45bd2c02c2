"""The KV-cache op (``torch.ops.flash_attention_sm75.kvcache_fwd``) and the door that calls it
(``fa2.flash_attn_with_kvcache``) on the CPU.

The op's CPU implementation computes in float64 and rounds once, so outputs are checked for
exactness against per-sequence float64 attention over the cache rows the call left (the
appended cache checked slot by slot first). Plain caches, paged caches (pages shuffled) and
rows selected by ``cache_batch_idx`` (a one-column table); one query row and causal chunks;
windows, softcap, ALiBi, ``cache_leftpad``. The op declares its writes into the caches, so
``torch.compile(fullgraph=True)`` of an append-and-attend step gives eager's caches and outputs.
The GPU kernels' side is tests/test_kvcache_gpu.py.
"""
import pytest
import torch

from flash_attention_sm75 import _ops, fa2
from reference import assert_lse_exact, assert_out_exact, attention_ref

pytestmark = pytest.mark.skipif(not _ops.KVCACHE_AVAILABLE,
                                reason=f"extension without the KV-cache op: {_ops.EXTENSION_ERROR}")

F16 = torch.float16
PAGE = _ops.PAGE_BLOCK_MULTIPLE


def rand(*shape):
    return torch.randn(*shape, dtype=F16)


def paged_copy(cache, page, generator=None):
    """``(pages (num_pages, page, h_k, d), table (b, rows / page) int32)`` holding the same rows
    as the plain ``cache`` (b, rows, h_k, d), the pages in a shuffled order plus two unused
    pages filled with NaN."""
    b, rows = cache.shape[:2]
    n = b * rows // page
    perm = torch.randperm(n + 2, generator=generator)[:n]
    pages = torch.full((n + 2, page) + tuple(cache.shape[2:]), float("nan"), dtype=cache.dtype)
    pages[perm] = cache.reshape((n, page) + tuple(cache.shape[2:]))
    return pages, perm.view(b, rows // page).to(torch.int32)


def unpage(pages, table):
    return pages[table.long()].flatten(1, 2)


def cache_ref(q, kc, vc, start, end, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """float64 attention of q[b] over rows [start[b], end[b]) of the plain cache row b."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        lo, hi = int(start[b]), int(end[b])
        slopes = None if alibi_slopes is None else (
            alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        if hi <= lo:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            lses.append(torch.full((q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64))
            continue
        o, lse = attention_ref(q[b:b + 1], kc[b:b + 1, lo:hi], vc[b:b + 1, lo:hi],
                               causal=causal and q.shape[1] > 1, window_size=window,
                               softcap=softcap, alibi_slopes=slopes)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


MODS = {
    "none": {},
    "window": {"window": (5, 2)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi": True},
}


@pytest.mark.parametrize("layout", ["plain", "paged", "batch_idx"])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mod", list(MODS))
def test_op_appends_in_place_and_attends_per_sequence(layout, seqlen_q, causal, mod):
    g = torch.Generator().manual_seed(hash((layout, seqlen_q, causal, mod)) % 2**31)
    torch.manual_seed(hash((layout, seqlen_q, causal, mod)) % 2**31)
    B, S, h, hk, d, new = 3, 2 * PAGE, 4, 2, 16, 2
    opts = MODS[mod]
    q = rand(B, seqlen_q, h, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    k, v = rand(B, new, hk, d), rand(B, new, hk, d)
    # an empty entry, one inside the first page, one whose new keys end the cache
    seqlens = torch.tensor([0, PAGE - 1, S - new], dtype=torch.int32)
    leftpad = (torch.tensor([0, 3, PAGE + 5], dtype=torch.int32)
               if layout != "paged" and mod == "none" else None)
    slopes = torch.rand(B, h) if opts.get("alibi") else None
    window = opts.get("window", (-1, -1))
    expected_k, expected_v = kc.clone(), vc.clone()
    for b in range(B):
        expected_k[b, seqlens[b]:seqlens[b] + new] = k[b]
        expected_v[b, seqlens[b]:seqlens[b] + new] = v[b]

    if layout == "plain":
        args_k, args_v, table = kc, vc, None
    elif layout == "paged":
        (args_k, table), (args_v, _) = paged_copy(kc, PAGE, g), (None, None)
        args_v = torch.full_like(args_k, float("nan"))
        args_v[table.long().flatten()] = vc.reshape(-1, PAGE, hk, d)
    else:  # rows 2, 0, 1 of a 4-row cache: a one-column table of whole-cache pages
        rows = torch.tensor([2, 0, 3], dtype=torch.int32)
        args_k = torch.full((4, S, hk, d), float("nan"), dtype=F16)
        args_v = torch.full((4, S, hk, d), float("nan"), dtype=F16)
        args_k[rows.long()], args_v[rows.long()] = kc, vc
        table = rows.view(B, 1)
    before_k, before_v = args_k.clone(), args_v.clone()
    out, lse = _ops.call_kvcache_fwd(q, args_k, args_v, seqlens, k, v, leftpad, table, None,
                                     causal, *window, opts.get("softcap", 0.0), slopes)

    # the new rows landed where they belong and nothing else changed (NaN pages included)
    if layout == "plain":
        got_k, got_v = args_k, args_v
    else:
        got_k, got_v = unpage(args_k, table), unpage(args_v, table)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    touched = torch.zeros(args_k.shape[:2], dtype=torch.bool)
    if layout == "plain":
        for b in range(B):
            touched[b, seqlens[b]:seqlens[b] + new] = True
    else:
        page = args_k.shape[1]
        for b in range(B):
            for pos in range(int(seqlens[b]), int(seqlens[b]) + new):
                touched[table[b, pos // page], pos % page] = True
    keep = ~touched
    assert torch.equal(args_k[keep].isnan(), before_k[keep].isnan())
    assert torch.equal(torch.nan_to_num(args_k[keep]), torch.nan_to_num(before_k[keep]))
    assert torch.equal(torch.nan_to_num(args_v[keep]), torch.nan_to_num(before_v[keep]))

    start = leftpad if leftpad is not None else torch.zeros(B, dtype=torch.int32)
    ref, ref_lse = cache_ref(q, expected_k, expected_v, start, seqlens + new, causal, window,
                             opts.get("softcap", 0.0), slopes)
    assert out.shape == q.shape and lse.shape == (B, h, seqlen_q)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)


def test_op_without_new_keys_reads_only_the_attended_rows():
    q, kc, vc = rand(2, 1, 4, 32), rand(2, 40, 2, 32), rand(2, 40, 2, 32)
    seqlens = torch.tensor([7, 0], dtype=torch.int32)
    kc[0, 7:], vc[0, 7:], kc[1], vc[1] = float("nan"), float("nan"), float("nan"), float("nan")
    out, lse = _ops.call_kvcache_fwd(q, kc, vc, seqlens)
    ref, ref_lse = cache_ref(q, kc, vc, torch.zeros(2), seqlens, False)
    assert_out_exact(out, ref)
    assert_lse_exact(lse, ref_lse)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("case,match", [
    ("page_48", "multiple of 64"),
    ("leftpad_paged", "cache_leftpad cannot be combined"),
    ("k_without_v", "k and v must be given together"),
    ("k_heads", r"k must be \(batch, seqlen_new, num_heads_k, head_dim\)"),
    ("seqlens_int64", "cache_seqlens must be int32"),
    ("table_int64", "block_table must be int32"),
    ("small_cache", "k_cache must have at least batch"),
    ("too_many_new", "more than the cache holds"),
])
def test_op_refuses_bad_metadata_before_writing(case, match):
    B, h, hk, d = 2, 4, 2, 16
    q = rand(B, 1, h, d)
    page = 48 if case == "page_48" else PAGE
    paged = case in ("page_48", "leftpad_paged", "table_int64")
    kc = rand(4, page, hk, d) if paged else rand(1 if case == "small_cache" else B, 64, hk, d)
    vc = rand(*kc.shape)
    k, v = rand(B, 100 if case == "too_many_new" else 1, hk, d), None
    v = None if case == "k_without_v" else rand(*k.shape)
    if case == "k_heads":
        k = rand(B, 1, hk + 1, d)
    seqlens = torch.zeros(B, dtype=torch.int64 if case == "seqlens_int64" else torch.int32)
    table = (torch.tensor([[0, 1], [2, 3]], dtype=torch.int64 if case == "table_int64"
                          else torch.int32) if paged else None)
    leftpad = torch.zeros(B, dtype=torch.int32) if case == "leftpad_paged" else None
    k0, v0 = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=match):
        _ops.call_kvcache_fwd(q, kc, vc, seqlens, k, v, leftpad, table)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


@pytest.mark.parametrize("layout", ["plain", "paged", "batch_idx", "paged_16"])
@pytest.mark.parametrize("seqlen_q,causal,alibi", [(1, False, False), (4, True, True)])
def test_door_is_one_kvcache_op_call(layout, seqlen_q, causal, alibi, kvcache_op_calls,
                                     op_calls, varlen_op_calls):
    B, S, h, hk, d = 2, 128, 4, 2, 16
    q, k, v = rand(B, seqlen_q, h, d), rand(B, 2, hk, d), rand(B, 2, hk, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    kwargs = dict(cache_seqlens=torch.tensor([3, 90], dtype=torch.int32), causal=causal,
                  alibi_slopes=torch.rand(h) if alibi else None, return_softmax_lse=True)
    plain_k, plain_v = kc.clone(), vc.clone()
    with torch.no_grad():
        ref = fa2.flash_attn_with_kvcache(q, plain_k, plain_v, k, v, **kwargs)
        kvcache_op_calls.clear()
        if layout == "plain":
            got = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, **kwargs)
        elif layout == "batch_idx":
            kbig, vbig = rand(3, S, hk, d), rand(3, S, hk, d)
            kbig[[2, 0]], vbig[[2, 0]] = kc, vc
            got = fa2.flash_attn_with_kvcache(q, kbig, vbig, k, v, cache_batch_idx=torch.tensor(
                [2, 0], dtype=torch.int32), **kwargs)
            assert torch.equal(kbig[[2, 0]], plain_k)
        else:
            page = 16 if layout == "paged_16" else PAGE
            pk, table = paged_copy(kc, page)
            pv = torch.empty_like(pk)
            pv[table.long().flatten()] = vc.reshape(-1, page, hk, d)
            got = fa2.flash_attn_with_kvcache(q, pk, pv, k, v, block_table=table, **kwargs)
            assert torch.equal(unpage(pk, table), plain_k)
    # one op call; page sizes the kernels cannot page through are gathered in order first (the
    # op then sees a plain cache and no table)
    assert len(kvcache_op_calls) == 1 and not op_calls and not varlen_op_calls
    assert (kvcache_op_calls[0][7] is None) == (layout in ("plain", "paged_16"))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_append_and_attend_compiles_fullgraph_with_the_writes():
    B, S, h, hk, d = 2, 64, 4, 2, 16
    q, k, v = rand(B, 3, h, d), rand(B, 3, hk, d), rand(B, 3, hk, d)
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    seqlens = torch.tensor([5, 40], dtype=torch.int32)

    def step(q, kc, vc, k, v, seqlens):
        out = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)
        return out * 2

    eager_k, eager_v = kc.clone(), vc.clone()
    with torch.no_grad():
        eager = step(q, eager_k, eager_v, k, v, seqlens)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, k, v,
                                                                            seqlens)
    assert torch.equal(kc, eager_k) and torch.equal(vc, eager_v)
    assert not torch.equal(kc, rand(B, S, hk, d))  # sanity: the caches are not fresh tensors
    assert torch.equal(compiled, eager)


def test_compile_does_not_recompile_per_number_of_new_keys():
    # A prefill chunk or prompt length changes from call to call; the value checks' messages
    # must not specialise the graph to it (a recompilation per length, an error at the
    # recompile limit under fullgraph).
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    B, S, h, hk, d = 2, 64, 4, 2, 16

    def step(q, kc, vc, k, v, seqlens):
        return fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    kc, vc = rand(B, S, hk, d), rand(B, S, hk, d)
    seqlens = torch.tensor([0, 3], dtype=torch.int32)
    with torch.no_grad():
        for n in range(2, torch._dynamo.config.recompile_limit + 4):
            q, k, v = rand(B, n, h, d), rand(B, n, hk, d), rand(B, n, hk, d)
            eager_k, eager_v = kc.clone(), vc.clone()
            want = step(q, eager_k, eager_v, k, v, seqlens)
            got = compiled(q, kc, vc, k, v, seqlens)
            assert torch.equal(got, want) and torch.equal(kc, eager_k) and torch.equal(vc, eager_v)
    assert counters["stats"]["unique_graphs"] <= 2  # the first call's static graph, then one


# ---------------------------------------------------------------- found by a break test
def test_no_new_keys_with_a_head_dim_that_is_padded():
    """An empty k / v (0 new keys) at a head dim the door pads (20) runs like k=None."""
    q, kc, vc = rand(1, 1, 2, 20), rand(1, 64, 2, 20), rand(1, 64, 2, 20)
    e = torch.empty(1, 0, 2, 20, dtype=F16)
    with torch.no_grad():
        got = fa2.flash_attn_with_kvcache(q, kc, vc, e, e, cache_seqlens=5)
        want = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    assert torch.equal(got, want)


@pytest.mark.parametrize("window,same_as,band", [((0, 4), (0, -1), (0, 4)),
                                                  ((4, 0), (-1, 0), (-1, 0)),
                                                  ((9, 9), (-1, -1), (-1, -1))])
def test_window_side_at_or_past_the_cache_is_no_limit(window, same_as, band):
    """flash-attn: a side >= seqlen_cache is read as -1; then, next to a limited side, -1 is
    seqlen_cache (its set_params_fprop), so (0, 4) and (0, -1) over a 4-row cache both run the
    band (0, 4), which hides keys from the first queries when seqlen_q > seqlen_cache + 1."""
    q, kc, vc = rand(1, 8, 1, 8), rand(1, 4, 1, 8), rand(1, 4, 1, 8)
    with torch.no_grad():
        a = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, window_size=window)
        b = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, window_size=same_as)
    assert torch.equal(a, b)
    ref, _ = cache_ref(q, kc, vc, [0], [4], False, band)
    assert_out_exact(a, ref)


@pytest.mark.parametrize("case", ["seqlens", "table"])
def test_op_writes_nothing_when_a_later_entry_is_bad(case):
    """The op's CPU implementation checks every entry before its first write (the GPU's check
    kernel runs before the append kernel)."""
    q, k = rand(2, 1, 1, 8), torch.ones(2, 1, 1, 8, dtype=F16)
    if case == "seqlens":
        kc = torch.zeros(2, 64, 1, 8, dtype=F16)
        lens, table = torch.tensor([0, 64], dtype=torch.int32), None
    else:
        kc = torch.zeros(3, 64, 1, 8, dtype=F16)
        lens, table = torch.tensor([0, 0], dtype=torch.int32), torch.tensor(
            [[0], [5]], dtype=torch.int32)
    vc = torch.zeros_like(kc)
    with pytest.raises(ValueError, match="cache_seqlens|block_table"):
        _ops.call_kvcache_fwd(q, kc, vc, lens, k, k, None, table)
    assert not kc.any() and not vc.any()


def test_op_errors_name_the_caches():
    q, kc = rand(1, 1, 2, 16), rand(1, 64, 2, 16)
    with pytest.raises(ValueError, match="v_cache must have q's dtype"):
        _ops.call_kvcache_fwd(q, kc, kc.float(), torch.zeros(1, dtype=torch.int32))
    # a non-contiguous cache_batch_idx is a one-column table like any other
    rows = torch.tensor([0, 7, 0, 7], dtype=torch.int32)[::2]
    with torch.no_grad():
        out = fa2.flash_attn_with_kvcache(q.expand(2, -1, -1, -1), kc.expand(2, -1, -1, -1),
                                          kc.expand(2, -1, -1, -1), cache_seqlens=3,
                                          cache_batch_idx=rows[:2] * 0)
    assert out.shape == (2, 1, 2, 16)


def test_appends_through_a_repeated_cache_batch_idx_are_refused():
    # Two batch entries appending to one cache row would race on its slots; reading one row
    # twice (no k / v) stays allowed (test_op_errors_name_the_caches).
    q, k = rand(2, 1, 2, 16), rand(2, 1, 2, 16)
    kc, vc = torch.zeros(3, 16, 2, 16, dtype=F16), torch.zeros(3, 16, 2, 16, dtype=F16)
    with pytest.raises(ValueError, match="cache_batch_idx must not repeat a cache row"):
        fa2.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=2,
                                    cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))
    assert not kc.any() and not vc.any()
    out = fa2.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=2,
                                      cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    assert out.shape == q.shape and kc[2, 2].equal(k[0, 0]) and kc[0, 2].equal(k[1, 0])


def test_appends_into_an_expanded_cache_are_refused():
    q, k = rand(2, 1, 1, 8), rand(2, 1, 1, 8)
    kc = torch.zeros(1, 16, 1, 8, dtype=F16).expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="must not overlap itself"):
        _ops.call_kvcache_fwd(q, kc, kc.clone(), torch.zeros(2, dtype=torch.int32), k, k)
    assert not kc.any()


def test_op_refuses_a_cache_that_requires_grad():
    q, kc = rand(1, 1, 1, 8), rand(1, 16, 1, 8).requires_grad_()
    with pytest.raises(ValueError, match="k_cache requires grad"):
        _ops.call_kvcache_fwd(q, kc, kc.detach().clone(), torch.zeros(1, dtype=torch.int32))


def test_padded_head_dim_with_alibi_and_leftpad_compiles_fullgraph():
    """The copies (a head dim that is not a multiple of 8) run on the KV-cache op too: no host
    read of the lengths, so fullgraph compiles."""
    q, kc, vc = rand(2, 3, 2, 20), rand(2, 32, 1, 20), rand(2, 32, 1, 20)
    k, v = rand(2, 1, 1, 20), rand(2, 1, 1, 20)
    lens, pad = torch.tensor([5, 20], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32)
    slopes = torch.rand(2)

    def step(q, kc, vc, k, v):
        return fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                           cache_leftpad=pad, causal=True, alibi_slopes=slopes)

    ek, ev = kc.clone(), vc.clone()
    with torch.no_grad():
        eager = step(q, ek, ev, k, v)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, k, v)
    assert torch.equal(got, eager) and torch.equal(kc, ek)
    ref, _ = cache_ref(q, ek, ev, pad, lens + 1, True, alibi_slopes=slopes)
    assert_out_exact(eager, ref)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 5)])
@pytest.mark.parametrize("paged", [False, True])
def test_group_rows_setting_is_read_before_the_append(window, paged, monkeypatch):
    """FLASH_SM75_DECODE_GQA (one-query GQA calls as the group's query rows) is read before
    anything is written, and a right window side does not change whether the call qualifies
    (it hides nothing from the one query row); with 'prefill' the result is the one of the
    default plan."""
    g = torch.Generator().manual_seed(26)
    q = torch.randn(2, 1, 8, 64, generator=g).to(F16)
    kc = torch.randn(2, 128, 2, 64, generator=g).to(F16)
    vc = torch.randn(2, 128, 2, 64, generator=g).to(F16)
    k, v = rand(2, 1, 2, 64), rand(2, 1, 2, 64)
    lens = torch.tensor([5, 100], dtype=torch.int32)
    ck, cv, table = kc, vc, None
    if paged:
        ck, table = paged_copy(kc, 64, g)
        cv = torch.full_like(ck, float("nan"))
        cv[table.long().flatten()] = vc.reshape(-1, 64, 2, 64)

    def call():
        return fa2.flash_attn_with_kvcache(q, ck, cv, k, v, cache_seqlens=lens, block_table=table,
                                           window_size=window, return_softmax_lse=True)

    before_k, before_v = ck.clone(), cv.clone()
    monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "tensor_cores")
    with pytest.raises(ValueError, match="FLASH_SM75_DECODE_GQA"):
        call()
    assert torch.equal(ck.nan_to_num(7), before_k.nan_to_num(7))  # NaN: unused pages
    assert torch.equal(cv.nan_to_num(7), before_v.nan_to_num(7))
    monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "prefill")
    out, lse = call()
    ck.copy_(before_k), cv.copy_(before_v)
    monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "decode")
    out_d, lse_d = call()
    torch.testing.assert_close(out, out_d, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse, lse_d, rtol=1e-6, atol=1e-6)
