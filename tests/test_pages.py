"""engine/kernels/pages.py: the memory our kernels stream (packed weights, KV caches) on 2 MB huge pages
where Linux allows, with the same values bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine import config
from engine.kernels import cpu_build, cpu_calls, cpu_packed, pages
from engine.model.transformer import KVCache, ModelConfig


def _vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address` (empty where there is no smaps)."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return {}
    fields, inside = {}, False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
            continue
        if inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def _cfg(layers: int, heads: int, kv_heads: int) -> ModelConfig:
    """A small model's shapes, for caches only (head_dim 16)."""
    return ModelConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=False,
    )


def _thp_usable() -> bool:
    return pages._thp_mode() in ("always", "madvise") and pages._advised()


def test_zeros_and_copies_are_plain_tensors_of_the_same_values():
    z = pages.zeros((3, 5, 7), torch.float32)
    assert z.shape == (3, 5, 7) and z.dtype == torch.float32 and z.is_contiguous()
    assert int(z.abs().sum()) == 0
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.uint8, torch.float16):
        t = torch.randn(17, 33).to(dtype)
        c = pages.copy_of(t)
        assert c.dtype == dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c.view(torch.uint8), t.contiguous().view(torch.uint8))  # bit for bit
        assert c.data_ptr() % pages.ALIGN == 0
    strided = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # not contiguous: copied in order
    assert torch.equal(pages.copy_of(strided), strided.contiguous())
    assert pages.zeros((0, 4), torch.float32).shape == (0, 4)


def test_small_tensors_share_an_arena_and_large_ones_start_on_a_huge_page():
    if not _thp_usable():
        pytest.skip(f"no transparent huge pages to advise here ({pages.describe()}): plain torch.zeros")
    a, b = pages.zeros((1000,), torch.float32), pages.zeros((1000,), torch.float32)
    assert 0 < abs(b.data_ptr() - a.data_ptr()) < pages.CHUNK  # carved from one arena, apart
    a.fill_(1.0)
    assert int(b.sum()) == 0  # no overlap
    big = pages.zeros((pages.OWN_MAPPING // 4,), torch.float32)
    assert big.data_ptr() % pages.HUGE == 0


def test_kernel_memory_is_advised_for_huge_pages_where_linux_has_them(monkeypatch):
    """The packed weights and a CPU KV cache live in mappings advised MADV_HUGEPAGE (smaps: THPeligible), and
    SPECLENS_HUGE_PAGES=0 leaves them on ordinary memory; the product is the same bit for bit."""
    if not _thp_usable():
        pytest.skip(f"no transparent huge pages to advise here ({pages.describe()})")
    w = torch.randn(64, 96)
    packed = cpu_packed.PackedWeight(w)
    eligible = _vma_of(packed.data.data_ptr()).get("THPeligible")
    if eligible is None:  # (older kernels' smaps do not say)
        pytest.skip("this kernel's /proc/self/smaps has no THPeligible field")
    assert eligible == "1"
    cache = KVCache(_cfg(layers=2, heads=4, kv_heads=2), 4096, torch.float32)
    assert _vma_of(cache.k.data_ptr()).get("THPeligible") == "1"
    assert "2 MB" in pages.describe()
    monkeypatch.setenv("SPECLENS_HUGE_PAGES", "0")
    assert not config.huge_pages() and "SPECLENS_HUGE_PAGES=0" in pages.describe()
    plain = cpu_packed.PackedWeight(w)
    if pages._thp_mode() == "madvise":  # ("always" makes every large mapping eligible)
        assert _vma_of(plain.data.data_ptr()).get("THPeligible") != "1"
    assert pages.zeros((4, 4), torch.float32).untyped_storage().nbytes() == 64  # plain torch.zeros: no arena
    assert torch.equal(plain.data, packed.data)
    if cpu_build.available():
        x = torch.randn(3, 96)
        assert torch.equal(cpu_calls.run_packed(x, plain), cpu_calls.run_packed(x, packed))


def test_without_huge_pages_the_memory_is_plain_and_says_so(monkeypatch):
    """THP "never" (or no THP at all): plain torch.zeros and a description that says 4 KB pages; a kernel
    that refuses the advice (built without huge pages) still gives usable, zeroed memory."""
    import mmap as real_mmap
    import types

    monkeypatch.setattr(pages, "_thp_mode", lambda: "never")
    assert not pages._advised() and "never" in pages.describe()
    t = pages.copy_of(torch.arange(10.0))
    assert torch.equal(t, torch.arange(10.0))
    monkeypatch.setattr(pages, "_thp_mode", lambda: None)
    assert "no transparent huge pages" in pages.describe()

    class Refusing(real_mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    fake = types.SimpleNamespace(
        mmap=Refusing,
        MADV_HUGEPAGE=getattr(real_mmap, "MADV_HUGEPAGE", 14),
        MAP_PRIVATE=real_mmap.MAP_PRIVATE,
        MAP_ANONYMOUS=getattr(real_mmap, "MAP_ANONYMOUS", 0x20),
    )
    monkeypatch.setattr(pages, "mmap", fake)
    monkeypatch.setattr(pages, "_thp_mode", lambda: "madvise")
    big = pages.zeros((pages.OWN_MAPPING // 4,), torch.float32)
    assert int(big.abs().sum()) == 0 and big.data_ptr() % pages.HUGE == 0
    big.fill_(2.0)
    assert float(big[-1]) == 2.0


def test_a_kv_cache_has_a_mapping_of_its_own():
    """A KV cache lives for one run: never carved from an arena that weights keep alive."""
    if not _thp_usable():
        pytest.skip(f"no transparent huge pages to advise here ({pages.describe()})")
    small = pages.zeros((256,), torch.float32, own_mapping=True)
    assert small.data_ptr() % pages.HUGE == 0  # a fresh mapping starts on a 2 MB boundary
    cache = KVCache(_cfg(layers=1, heads=2, kv_heads=1), 8, torch.float32)  # 512 bytes each
    assert cache.k.data_ptr() % pages.HUGE == 0 and cache.v.data_ptr() % pages.HUGE == 0
