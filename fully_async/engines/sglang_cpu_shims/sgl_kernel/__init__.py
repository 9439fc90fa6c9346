"""Stand-in for sgl_kernel in the SGLang server on CPU (see sglang_cpu_shims/__init__.py): one real op in torch."""

import torch
from _fully_async_placeholder import install, module_getattr

__version__ = "0.0.0+fully_async.shim"
__path__ = []
install(__name__)
__getattr__ = module_getattr(__name__)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request r (in order) with [s, e) = [start_offset[r], end_offset[r]): write the next e - s entries of
    out_cache_loc into req_to_token[req_pool_indices[r], s:e]. pool_len (req_to_token's row length) is unused."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    pos = 0
    for row, s, e in zip(req_pool_indices.tolist(), starts, ends):
        req_to_token[row, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
        pos += e - s
