"""The KV-cache op on the GPU (``torch.ops.flash_attention_sm75.kvcache_fwd`` and
``fa2.flash_attn_with_kvcache``): the appends, the decode and prefill kernels reading plain and
paged caches in place, against float64 per sequence with FlashAttention's criterion.

* q_len 1, 2, 7, 64; head dims of every bucket and a tail (40); GQA; lengths 0, 1, odd and the
  full cache; every slot past a sequence's length and every unused page NaN (never read);
* paged equal to plain bit for bit (pages shuffled; page sizes 64 and 256);
* long caches on the split-KV decode kernel (several splits and their merge), and longer queries
  (chunked prefill) on the prefill kernels with key splits and the same merge;
* CUDA-graph capture, then replays after the lengths (and q / k / v) changed in place;
* torch.compile(fullgraph=True) of an append-and-attend step (the op's declared writes).
Sanitizers: scripts/sanitize_driver.py --kvcache.
"""
import pytest
import torch

from flash_attention_sm75 import _ops, fa2
from reference import (assert_close_fa, assert_lse_close, attention_ref, cuda_kernels_run,
                       poisoned_cuda_memory, seed_from)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ops.KVCACHE_AVAILABLE,
                       reason=f"extension without the KV-cache op: {_ops.EXTENSION_ERROR}"),
]

DEV = "cuda"
F16 = torch.float16
NAN = float("nan")


def _rand(*shape):
    return torch.randn(*shape, device=DEV, dtype=F16)


def _paged(cache, page):
    """The plain cache's rows as shuffled pages plus 3 unused NaN pages: (pages, table)."""
    b, rows = cache.shape[:2]
    n = b * rows // page
    perm = torch.randperm(n + 3, device=DEV)[:n]
    pages = torch.full((n + 3, page) + tuple(cache.shape[2:]), NAN, device=DEV, dtype=F16)
    pages[perm] = cache.reshape((n, page) + tuple(cache.shape[2:]))
    return pages, perm.view(b, rows // page).to(torch.int32)


def _check(out, lse, q, kc, vc, start, end, causal, window=(-1, -1), softcap=0.0, slopes=None):
    """out / lse of each sequence against float64 attention over its plain cache rows."""
    for b in range(q.shape[0]):
        lo, hi = int(start[b]), int(end[b])
        if hi <= lo:
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"out[{b}] of an empty range"
            assert torch.isneginf(lse[b]).all(), f"lse[{b}] of an empty range"
            continue
        s = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        kw = dict(causal=causal and q.shape[1] > 1, window_size=window, softcap=softcap,
                  alibi_slopes=s)
        ks, vs = kc[b:b + 1, lo:hi], vc[b:b + 1, lo:hi]
        ref, ref_lse = attention_ref(q[b:b + 1], ks, vs, **kw)
        pt, _ = attention_ref(q[b:b + 1], ks, vs, upcast=False, reorder_ops=True, **kw)
        assert_close_fa(out[b:b + 1], ref, pt, name=f"out[{b}]")
        assert_lse_close(lse[b:b + 1], ref_lse, name=f"lse[{b}]")


def _case(B, S, h, hk, d, seqlen_q, new, seed):
    torch.manual_seed(seed)
    q = _rand(B, seqlen_q, h, d)
    kc, vc = _rand(B, S, hk, d), _rand(B, S, hk, d)
    k, v = _rand(B, new, hk, d), _rand(B, new, hk, d)
    # no cached key (the new ones only), one, odd, the cache's end
    lens = [0, 1, 37, S - new][:B]
    lens += [int(x) for x in torch.randint(0, S - new + 1, (B - len(lens),))]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for b in range(B):  # never read: poison every slot past the sequence's end
        kc[b, lens[b] + new:] = NAN
        vc[b, lens[b] + new:] = NAN
    return q, kc, vc, k, v, seqlens


MODS = [("none", {}), ("window", {"window": (40, 3)}), ("softcap", {"softcap": 5.0}),
        ("alibi", {"alibi": True})]


@pytest.mark.parametrize("seqlen_q", [1, 2, 7, 64])
@pytest.mark.parametrize("d", [40, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mod", MODS, ids=[m[0] for m in MODS])
def test_kvcache_op_plain_and_paged(seqlen_q, d, causal, mod):
    name, opts = mod
    B, S, h, hk, new, page = 5, 512, 8, 2, 3, 64
    q, kc, vc, k, v, seqlens = _case(B, S, h, hk, d, seqlen_q, new,
                                     seed_from("kvcache_op", seqlen_q, d, causal, name))
    slopes = torch.rand(B, h, device=DEV) if opts.get("alibi") else None
    window = opts.get("window", (-1, -1))
    args = (None, causal, *window, opts.get("softcap", 0.0), slopes)
    plain_k, plain_v = kc.clone(), vc.clone()
    pk, table = _paged(kc, page)
    pv = torch.full_like(pk, NAN)
    pv[table.long().flatten()] = vc.reshape(-1, page, hk, d)
    out, lse = _ops.call_kvcache_fwd(q, plain_k, plain_v, seqlens, k, v, None, None, *args)
    pout, plse = _ops.call_kvcache_fwd(q, pk, pv, seqlens, k, v, None, table, *args)
    torch.cuda.synchronize()
    # the appends: exactly the new slots
    exp_k, exp_v = kc.clone(), vc.clone()
    for b in range(B):
        exp_k[b, seqlens[b]:seqlens[b] + new] = k[b]
        exp_v[b, seqlens[b]:seqlens[b] + new] = v[b]
    assert torch.equal(plain_k.nan_to_num(), exp_k.nan_to_num())
    assert torch.equal(plain_v.nan_to_num(), exp_v.nan_to_num())
    assert torch.equal(pk[table.long()].flatten(1, 2).nan_to_num(), exp_k.nan_to_num())
    assert torch.equal(pv[table.long()].flatten(1, 2).nan_to_num(), exp_v.nan_to_num())
    # paged is the same computation on the same rows
    assert torch.equal(pout, out) and torch.equal(plse, lse)
    _check(out, lse, q, exp_k, exp_v, torch.zeros(B), seqlens + new, causal, window,
           opts.get("softcap", 0.0), slopes)


@pytest.mark.parametrize("page", [None, 16, 64])
@pytest.mark.parametrize("d", [64, 60])
def test_kvcache_misaligned_q_is_read_from_a_copy(page, d):
    """q at an odd element offset (the kernels' 16-byte loads need aligned pointers):
    flash_attn_with_kvcache reads an aligned copy of it, as flash_attn_func does, and appends
    once. It used to refuse such a q in the op: before any write on the in-place path (pages
    of 64 keys, no pages), after the appends on the gathered-pages path (pages of 16). (The
    padded head dim, 60, always read a padded copy: it guards that path.)"""
    B, S, h, hk, new, sq = 2, 128, 4, 2, 3, 2
    torch.manual_seed(seed_from("kvcache_misaligned_q", page, d))
    q = _rand(B * sq * h * d + 1)[1:].view(B, sq, h, d)
    assert q.data_ptr() % 16 != 0
    kc, vc = _rand(B, S, hk, d), _rand(B, S, hk, d)
    k, v = _rand(B, new, hk, d), _rand(B, new, hk, d)
    seqlens = torch.tensor([5, 77], dtype=torch.int32, device=DEV)
    exp_k, exp_v = kc.clone(), vc.clone()
    for b in range(B):
        exp_k[b, seqlens[b]:seqlens[b] + new] = k[b]
        exp_v[b, seqlens[b]:seqlens[b] + new] = v[b]
    if page is None:
        ck, cv, table = kc, vc, None
    else:
        ck, table = _paged(kc, page)
        cv = torch.full_like(ck, NAN)
        cv[table.long().flatten()] = vc.reshape(-1, page, hk, d)
    with torch.no_grad():
        out, lse = fa2.flash_attn_with_kvcache(q, ck, cv, k, v, cache_seqlens=seqlens,
                                               block_table=table, causal=True,
                                               return_softmax_lse=True)
    got_k = ck if table is None else ck[table.long()].flatten(1, 2)
    got_v = cv if table is None else cv[table.long()].flatten(1, 2)
    assert torch.equal(got_k, exp_k) and torch.equal(got_v, exp_v)
    _check(out, lse, q, exp_k, exp_v, torch.zeros(B), seqlens + new, True)


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("layout", ["batch_idx", "leftpad"])
def test_kvcache_selected_rows_and_leftpad(seqlen_q, layout):
    B, S, h, hk, d, new = 4, 300, 8, 8, 128, 2
    q, kc, vc, k, v, seqlens = _case(B, S, h, hk, d, seqlen_q, new,
                                     seed_from("kvcache_rows", seqlen_q, layout))
    leftpad = None
    if layout == "batch_idx":
        rows = torch.tensor([5, 0, 2, 3], dtype=torch.int32, device=DEV)
        big_k = torch.full((6, S, hk, d), NAN, device=DEV, dtype=F16)
        big_v = torch.full_like(big_k, NAN)
        big_k[rows.long()], big_v[rows.long()] = kc, vc
        with torch.no_grad():
            out, lse = fa2.flash_attn_with_kvcache(q, big_k, big_v, k, v, cache_seqlens=seqlens,
                                                   cache_batch_idx=rows, causal=True,
                                                   return_softmax_lse=True)
        got_k, got_v = big_k[rows.long()], big_v[rows.long()]
    else:
        leftpad = torch.tensor([0, 0, 11, 101], dtype=torch.int32, device=DEV)
        with torch.no_grad():
            out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                   cache_leftpad=leftpad, causal=True,
                                                   return_softmax_lse=True)
        got_k, got_v = kc, vc
    start = leftpad if leftpad is not None else torch.zeros(B)
    _check(out, lse, q, got_k, got_v, start, seqlens + new, True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_long_cache_on_the_split_kv_decode_kernel(d, paged):
    B, S, h, hk, page = 2, 16384, 16, 4, 256
    q, kc, vc, k, v, seqlens = _case(B, S, h, hk, d, 1, 1, seed_from("kvcache_long", d, paged))
    seqlens[0] = S - 1
    kc[0], vc[0] = _rand(S, hk, d), _rand(S, hk, d)
    table = None
    ck, cv = kc, vc
    if paged:
        ck, table = _paged(kc, page)
        cv = torch.full_like(ck, NAN)
        cv[table.long().flatten()] = vc.reshape(-1, page, hk, d)

    def run():
        return _ops.call_kvcache_fwd(q, ck, cv, seqlens, k, v, None, table)

    names = cuda_kernels_run(run, "decode")
    assert any("merge" in n for n in names) and any("decode_kernel" in n for n in names), names
    out, lse = run()  # the same append again: same rows, same values
    got_k = ck[table.long()].flatten(1, 2) if paged else ck
    got_v = cv[table.long()].flatten(1, 2) if paged else cv
    _check(out, lse, q, got_k, got_v, torch.zeros(B), seqlens + 1, False)


@pytest.mark.parametrize("d", [40, 64, 128, 256])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("S,h,hk,softcap", [(16384, 16, 4, 0.0), (1024, 14, 2, 30.0),
                                            (4096, 32, 4, 0.0)])
def test_kvcache_decode_as_group_rows(S, h, hk, softcap, d, paged, monkeypatch):
    # FLASH_SM75_DECODE_GQA=prefill: one query per sequence against the cache (the new key
    # appended first), the group's q-heads as query rows of the prefill kernels, key splits on
    # the long cache; NaN past every length, paged equal to plain, causal (no effect on one
    # row), the decode kernel never runs.
    monkeypatch.setenv("FLASH_SM75_DECODE_GQA", "prefill")
    monkeypatch.setenv("FLASH_SM75_DEVICE_PROFILE", "t4")
    B = 4
    q, kc, vc, k, v, seqlens = _case(B, S, h, hk, d, 1, 1, seed_from("kv-rows", S, h, d, paged))
    ck, cv, table = kc, vc, None
    if paged:
        page = 256
        ck, table = _paged(kc, page)
        cv = torch.full_like(ck, NAN)
        cv[table.long().flatten()] = vc.reshape(-1, page, hk, d)
    res = {}

    def run():
        with poisoned_cuda_memory():
            res["out"], res["lse"] = fa2.flash_attn_with_kvcache(
                q, ck, cv, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
                softcap=softcap, return_softmax_lse=True)

    names = cuda_kernels_run(run, "flash_fwd")
    assert not any("decode_kernel" in n for n in names), names
    assert any("flash_fwd_kernel" in n for n in names), names
    got_k = ck[table.long()].flatten(1, 2) if paged else ck
    got_v = cv[table.long()].flatten(1, 2) if paged else cv
    _check(res["out"], res["lse"], q, got_k, got_v, torch.zeros(B), seqlens + 1, True,
           softcap=softcap)


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_cuda_graph_replays_with_changed_lengths(seqlen_q, paged):
    B, S, h, hk, d, page = 3, 1024, 8, 2, 128, 64
    torch.manual_seed(seed_from("kvcache_graph", seqlen_q, paged))
    q, k, v = _rand(B, seqlen_q, h, d), _rand(B, 1, hk, d), _rand(B, 1, hk, d)
    kc, vc = _rand(B, S, hk, d), _rand(B, S, hk, d)
    seqlens = torch.tensor([3, 500, 64], dtype=torch.int32, device=DEV)
    ck, cv, table = kc, vc, None
    if paged:
        ck, table = _paged(kc, page)
        cv = torch.full_like(ck, NAN)
        cv[table.long().flatten()] = vc.reshape(-1, page, hk, d)

    def step():
        return fa2.flash_attn_with_kvcache(q, ck, cv, k, v, cache_seqlens=seqlens,
                                           block_table=table, causal=True,
                                           return_softmax_lse=True)

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # warm-up (writes the same rows again below)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = step()
        for lens in ([0, 1, 1023 - 0], [700, 2, 999], [5, 1000, 64]):
            seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
            q.copy_(_rand(*q.shape))
            k.copy_(_rand(*k.shape))
            v.copy_(_rand(*v.shape))
            ref_k, ref_v = ck.clone(), cv.clone()
            e_out, e_lse = fa2.flash_attn_with_kvcache(q, ref_k, ref_v, k, v,
                                                       cache_seqlens=seqlens, block_table=table,
                                                       causal=True, return_softmax_lse=True)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(ck.nan_to_num(), ref_k.nan_to_num())
            assert torch.equal(cv.nan_to_num(), ref_v.nan_to_num())
            assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)
            plain_k = ck[table.long()].flatten(1, 2) if paged else ck
            plain_v = cv[table.long()].flatten(1, 2) if paged else cv
            _check(g_out, g_lse, q, plain_k, plain_v, torch.zeros(B), seqlens + 1, True)


def test_kvcache_append_and_attend_compiles_fullgraph():
    B, S, h, hk, d = 2, 256, 8, 2, 64
    torch.manual_seed(seed_from("kvcache_compile"))
    q, k, v = _rand(B, 5, h, d), _rand(B, 5, hk, d), _rand(B, 5, hk, d)
    kc, vc = _rand(B, S, hk, d), _rand(B, S, hk, d)
    seqlens = torch.tensor([9, 200], dtype=torch.int32, device=DEV)

    def step(q, kc, vc, k, v, seqlens):
        return fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                           causal=True) + 1

    ek, ev = kc.clone(), vc.clone()
    with torch.no_grad():
        eager = step(q, ek, ev, k, v, seqlens)
        got = torch.compile(step, fullgraph=True)(q, kc, vc, k, v, seqlens)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
    assert torch.equal(got, eager)


_BAD_INDEX_SCRIPT = """
import sys
import torch
from flash_attention_sm75 import _ops
dev, f16 = "cuda", torch.float16
q = torch.randn(2, 1, 4, 64, device=dev, dtype=f16)
k, v = torch.randn(2, 2, 2, 64, device=dev, dtype=f16), torch.randn(2, 2, 2, 64, device=dev, dtype=f16)
case = sys.argv[1]
if case == "repeat":  # two batch entries appending to one cache row (they would race)
    from flash_attention_sm75 import fa2
    kc, vc = (torch.randn(3, 16, 2, 64, device=dev, dtype=f16) for _ in range(2))
    try:
        fa2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=2,
                                    cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32,
                                                                 device=dev))
        torch.cuda.synchronize()
    except RuntimeError as e:
        print("ERR", "device-side assert" in str(e))
        sys.exit(3)
    print("no error")
    sys.exit(0)
if case == "seqlens":
    kc, vc = (torch.randn(2, 128, 2, 64, device=dev, dtype=f16) for _ in range(2))
    lens, table = torch.tensor([0, 127], dtype=torch.int32, device=dev), None
else:
    kc, vc = (torch.randn(4, 64, 2, 64, device=dev, dtype=f16) for _ in range(2))
    lens = torch.tensor([0, 70], dtype=torch.int32, device=dev)
    table = torch.tensor([[0, -1], [1, 4]], dtype=torch.int32, device=dev)
try:
    _ops.call_kvcache_fwd(q, kc, vc, lens, k, v, None, table)
    torch.cuda.synchronize()
except RuntimeError as e:
    print("ERR", "device-side assert" in str(e))
    sys.exit(3)
print("no error")
"""


@pytest.mark.parametrize("case", ["seqlens", "table", "repeat"])
def test_kvcache_bad_index_values_are_a_device_side_assertion(case, tmp_path):
    """cache_seqlens past the cache / a table entry outside the pages (of a page that holds keys;
    the -1 of a page without keys is fine) / a cache_batch_idx repeating a row that k / v are
    appended to: a device-side assertion before any write, never a silent out-of-bounds access
    or race (in a subprocess: it leaves the CUDA context unusable)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "bad_index.py"
    script.write_text(_BAD_INDEX_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 3 and "ERR True" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("seqlen_q,decode", [(1, True), (4, True), (9, False), (64, False)])
@pytest.mark.parametrize("alibi", [False, True])
def test_kvcache_causal_short_queries_take_the_split_kv_decode_kernel(seqlen_q, decode, alibi):
    """Causal queries of up to decode_max_multi_rows (query, q-head) rows per kv head (32 at
    d = 128: 4 queries x 4 heads, not 9) run the decode kernel, with key splits, through the door
    as users call it (the door passes causal's right window side 0, which must not count as a
    window); longer ones the prefill kernels."""
    B, S, h, hk, d = 2, 4096, 16, 4, 128
    torch.manual_seed(seed_from("kvcache_route", seqlen_q))
    q, kc, vc = _rand(B, seqlen_q, h, d), _rand(B, S, hk, d), _rand(B, S, hk, d)
    seqlens = torch.tensor([1000, 4000], dtype=torch.int32, device=DEV)
    slopes = torch.rand(B, h, device=DEV) if alibi else None

    def run():
        with torch.no_grad():
            return fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                               alibi_slopes=slopes, return_softmax_lse=True)

    names = cuda_kernels_run(run, "flash_fwd")
    assert any("decode_kernel" in n for n in names) == decode, names
    # 2 x 16 query tiles (decode: rows) over up to 4000 keys: key splits either way
    assert any("merge" in n for n in names), names
    out, lse = run()
    _check(out, lse, q, kc, vc, torch.zeros(B), seqlens, True, slopes=slopes)


SPLIT_MODS = MODS + [("long_window", {"window": (2000, 0)})]


@pytest.mark.parametrize("d", [40, 64, 96, 128, 256])
@pytest.mark.parametrize("mod", SPLIT_MODS, ids=[m[0] for m in SPLIT_MODS])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_chunked_prefill_splits_the_cache_keys(d, mod, causal):
    """Queries too many for the decode kernel's rows (a prefill chunk, a long speculative
    draft) against a long cache with few sequences: the prefill kernel's grid is short of a
    wave, so its keys are split (plan_fwd_splits) and the splits merged; plain and paged equal
    bit for bit, every slot past a length NaN, lengths 0, 1 and odd (splits past a sequence's
    keys are empty)."""
    name, opts = mod
    B, S, h, hk, new, page, sq = 4, 6144, 4, 2, 70, 256, 70
    q, kc, vc, k, v, seqlens = _case(B, S, h, hk, d, sq, new,
                                     seed_from("kvcache_split", d, causal, name))
    seqlens[3] = S - new  # one sequence over the whole cache: every split holds keys
    kc[3, :S], vc[3, :S] = _rand(S, hk, d), _rand(S, hk, d)
    slopes = torch.rand(B, h, device=DEV) if opts.get("alibi") else None
    window = opts.get("window", (-1, -1))
    args = (None, causal, *window, opts.get("softcap", 0.0), slopes)
    pk, table = _paged(kc, page)
    pv = torch.full_like(pk, NAN)
    pv[table.long().flatten()] = vc.reshape(-1, page, hk, d)
    plain_k, plain_v = kc.clone(), vc.clone()

    def run():
        return _ops.call_kvcache_fwd(q, plain_k, plain_v, seqlens, k, v, None, None, *args)

    names = cuda_kernels_run(run, "flash_fwd")
    # (a window of 40 keys: 111 keys a row may see, too few to split; 2000 keys split)
    assert any("merge" in n for n in names) == (name != "window"), names
    assert not any("decode_kernel" in n for n in names), names
    out, lse = run()  # the same append again: same rows, same values
    pout, plse = _ops.call_kvcache_fwd(q, pk, pv, seqlens, k, v, None, table, *args)
    assert torch.equal(pout, out) and torch.equal(plse, lse)
    exp_k, exp_v = kc.clone(), vc.clone()
    for b in range(B):
        exp_k[b, seqlens[b]:seqlens[b] + new] = k[b]
        exp_v[b, seqlens[b]:seqlens[b] + new] = v[b]
    _check(out, lse, q, exp_k, exp_v, torch.zeros(B), seqlens + new, causal, window,
           opts.get("softcap", 0.0), slopes)


def test_kvcache_prefill_splits_can_be_switched_off(monkeypatch):
    """FLASH_SM75_FWD_SPLITS=never: the same call without key splits (no merge), the same
    result within the fp16 criterion; a bad value is a ValueError naming the variable."""
    B, S, h, hk, d, sq = 2, 4096, 4, 2, 128, 64
    torch.manual_seed(seed_from("kvcache_split_env"))
    q, kc, vc = _rand(B, sq, h, d), _rand(B, S, hk, d), _rand(B, S, hk, d)
    seqlens = torch.tensor([S, 3000], dtype=torch.int32, device=DEV)

    def run():
        return _ops.call_kvcache_fwd(q, kc, vc, seqlens, None, None, None, None, None, True)

    assert any("merge" in n for n in cuda_kernels_run(run, "flash_fwd"))
    monkeypatch.setenv("FLASH_SM75_FWD_SPLITS", "never")
    assert not any("merge" in n for n in cuda_kernels_run(run, "flash_fwd"))
    out, lse = run()
    _check(out, lse, q, kc, vc, torch.zeros(B), seqlens, True)
    monkeypatch.setenv("FLASH_SM75_FWD_SPLITS", "sometimes")
    with pytest.raises(ValueError, match="FLASH_SM75_FWD_SPLITS"):
        run()


def test_kvcache_prefill_of_a_full_wave_keeps_one_split():
    """A grid that fills the GPU already runs without key splits (no merge)."""
    B, S, h, hk, d, sq = 16, 4096, 32, 8, 64, 256
    torch.manual_seed(seed_from("kvcache_nosplit"))
    q, kc, vc = _rand(B, sq, h, d), _rand(B, S, hk, d), _rand(B, S, hk, d)
    seqlens = torch.full((B,), S, dtype=torch.int32, device=DEV)

    def run():
        return _ops.call_kvcache_fwd(q, kc, vc, seqlens, None, None, None, None, None, True)

    names = cuda_kernels_run(run, "flash_fwd")
    assert not any("merge" in n for n in names), names
    out, lse = run()
    _check(out[:2], lse[:2], q[:2], kc, vc, torch.zeros(2), seqlens[:2], True)
