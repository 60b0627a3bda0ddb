"""The SGLang HiCache backend (threefs.kvcache.hicache.HiCacheThreeFS) driven through SGLang's documented
interface. SGLang itself does not import on this machine (pip's sglang needs CUDA-era packages: triton, zmq,
...), so the test builds the backend the way SGLang's StorageBackendFactory._create_dynamic_backend does
(import module_path, getattr class_name, call it with (storage_config, kwargs)), with a storage config carrying
HiCacheStorageConfig's fields, and a page-first host pool with HostKVCache's page methods."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from threefs.kvcache import page_digests

LAYERS, ITEM = 4, 2048  # one page = LAYERS x ITEM bf16 = 16 KiB


@dataclass
class StorageConfig:  # sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig's fields
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = "tiny-llama"
    extra_config: dict | None = None


class PageFirstPool:
    """A host pool with the page methods of SGLang's MHATokenToKVPoolHost in page_first layout."""

    layout = "page_first"

    def __init__(self, pages: int, page_size: int = 64):
        self.page_size = page_size
        self.kv_buffer = torch.zeros((pages, LAYERS, ITEM), dtype=torch.bfloat16)

    def get_data_page(self, index, flat=True):
        page = self.kv_buffer[int(index) // self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((LAYERS, ITEM), dtype=torch.bfloat16).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[int(index) // self.page_size].copy_(data_page.view(torch.bfloat16).reshape(LAYERS, ITEM))


def make_backend(cluster, d: str, tp_rank: int = 0, mla: bool = False):
    extra = {"backend_name": "threefs", "module_path": "threefs.kvcache.hicache", "class_name": "HiCacheThreeFS",
             "threefs_config": str(cluster.client_config_path), "root": f"{d}/hicache",
             "capacity_bytes": 256 * LAYERS * ITEM * 2}
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    return cls(StorageConfig(tp_rank=tp_rank, tp_size=2, is_mla_model=mla, extra_config=extra), {})


def sglang_hashes(tokens: list[int]) -> list[str]:
    return [h.hex() for h in page_digests(tokens, 64)]  # = SGLang's get_hash_str chain


def test_hicache_generic_api(cluster, d):
    backend = make_backend(cluster, d)
    pool = PageFirstPool(8)
    backend.register_mem_pool_host(pool)
    g = torch.Generator().manual_seed(7)
    hashes = sglang_hashes(list(range(64 * 6)))
    pages = [torch.randn(LAYERS * ITEM, generator=g).to(torch.bfloat16) for _ in hashes]
    assert backend.batch_exists(hashes) == 0
    assert backend.batch_set(hashes[:4], pages[:4]) is True
    assert backend.set(hashes[4], pages[4]) is True
    assert backend.batch_exists(hashes) == 5 and backend.exists(hashes[4]) and not backend.exists(hashes[5])
    dst = [pool.get_dummy_flat_data_page() for _ in hashes]
    got = backend.batch_get(hashes, dst)
    assert got[5] is None and all(torch.equal(got[i], pages[i]) for i in range(5))
    assert got[0].data_ptr() == dst[0].data_ptr()  # read into the caller's tensor
    one = backend.get(hashes[1])  # no target: a fresh uint8 page
    assert torch.equal(one.view(torch.bfloat16), pages[1])
    backend.delete(hashes[0])
    assert backend.batch_exists(hashes) == 0 and backend.get_stats()["pages"] == 4
    backend.close()


def test_hicache_zero_copy_v1_and_tp_namespaces(cluster, d):
    rank0, rank1 = make_backend(cluster, d, tp_rank=0), make_backend(cluster, d, tp_rank=1)
    src, dst = PageFirstPool(4), PageFirstPool(4)
    g = torch.Generator().manual_seed(8)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=g).to(torch.bfloat16))
    for b, pool in ((rank0, src), (rank1, dst)):
        b.register_mem_pool_host(pool)
    hashes = sglang_hashes(list(range(64 * 4)))
    host_indices = torch.arange(4 * 64)
    assert rank0.batch_set_v1(hashes, host_indices) == [True] * 4
    assert rank1.batch_exists(hashes) == 0  # another TP rank's pages are other keys
    rank1.register_mem_pool_host(src)
    assert rank1.batch_set_v1(hashes[:2], host_indices[:128]) == [True, True]
    rank1.register_mem_pool_host(dst)
    rank0.register_mem_pool_host(dst)
    # pages land straight in the host pool (page-first: views of kv_buffer)
    order = torch.tensor([3, 2, 1, 0]).repeat_interleave(64) * 64 + torch.arange(64).repeat(4)
    assert rank0.batch_get_v1(hashes, order) == [True] * 4
    for i in range(4):
        assert torch.equal(dst.kv_buffer[3 - i], src.kv_buffer[i])
    mla0, mla1 = make_backend(cluster, d, 0, mla=True), make_backend(cluster, d, 1, mla=True)
    for b in (mla0, mla1):
        b.register_mem_pool_host(src)
    assert mla1.batch_set_v1(hashes, host_indices) == [True] * 4  # rank 1 of an MLA model does not write
    assert mla0.batch_exists(hashes) == 0
    assert mla0.batch_set_v1(hashes, host_indices) == [True] * 4  # rank 0's copy serves every rank
    assert mla1.batch_exists(hashes) == 4
    for b in (rank0, rank1, mla0, mla1):
        b.close()
