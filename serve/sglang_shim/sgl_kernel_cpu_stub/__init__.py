"""Import-only stand-in for ``sgl_kernel`` on CPUs without a CPU build of it.

SGLang 0.5.23's CPU engine imports these names at start-up; they serve speculative
decoding and hierarchical KV-cache moves, which genrec never uses. Each raises if called.
"""

IS_CPU_STUB = True
_NAMES = (
    "copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu",
)


def _unavailable(name):  # noqa: ANN001, ANN202
    def fn(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise NotImplementedError(f"sgl_kernel.{name}: not available (genrec's CPU import-only stub)")

    fn.__name__ = fn.__qualname__ = name
    return fn


for _n in _NAMES:
    globals()[_n] = _unavailable(_n)
__all__ = list(_NAMES)
