"""Every SGLang surface the SGLang engine relies on is still there (ENGINEERING.md, convention 16):
a changed SGLang fails here, naming what broke, before an engine test fails in a less telling way.
The same list is in docs/serving.md ("SGLang surfaces"); this test also checks the docs name each.
No engine is started (SGLang is imported, with the CPU shims, and read).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang  # (it imports SGLang)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"

# (module, attribute path, what genrec uses of it) -> checked by SURFACE_CHECKS below
PUBLIC = [
    ("sglang", "Engine", "the runtime (serve.sglang_runtime)"),
    ("sglang", "Engine.async_generate", "requests: input_ids, sampling_params, custom_logit_processor, "
                                        "return_hidden_states, rid, cache_salt, priority"),
    ("sglang", "Engine.get_all_child_pids", "the runtime's processes (watched, stopped on close)"),
    ("sglang.srt.sampling.custom_logit_processor", "CustomLogitProcessor.to_str", "the payload's carrier"),
]
INTERNAL = [
    ("sglang.srt.managers.tokenizer_manager", "TokenizerManager.abort_request", "abort at a call's deadline"),
    ("sglang.srt.managers.tokenizer_manager", "TokenizerManager._subprocess_watchdog", "stopped (we watch)"),
    ("sglang.srt.layers.logits_processor", "LogitsProcessorOutput", "next_token_logits, hidden_states, "
                                                                    "customized_info"),
    ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch", "forward_mode, batch_size, out_cache_loc, "
                                                                     "req_pool_indices, extend_prefix_lens_cpu, "
                                                                     "extend_seq_lens_cpu, sampling_info"),
    ("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo", "custom_params"),
    ("sglang.srt.model_executor.forward_context", "get_token_to_kv_pool", "the KV pool"),
    ("sglang.srt.model_executor.forward_context", "get_req_to_token_pool", "req_to_token"),
    ("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool", "get_key_buffer, get_value_buffer, size, page_size"),
    ("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool", "req_to_token"),
    ("sglang.srt.mem_cache.evict_policy", "PriorityStrategy", "radix_eviction_policy = priority"),
    ("sglang.srt.managers.scheduler", "run_scheduler_process", "SIGQUITs its parent on an exception"),
]


def _resolve(module: str, path: str):  # noqa: ANN202
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture(scope="module", autouse=True)
def _cpu_sglang():
    importlib.import_module("genrec.serve.sglang_runtime").prepare_environment("cpu")


@pytest.mark.parametrize(("module", "path"), [(m, p) for m, p, _ in PUBLIC + INTERNAL
                                               if not p.endswith("_subprocess_watchdog")])
def test_the_surface_exists(module, path):
    _resolve(module, path)


def _fields(cls) -> set[str]:  # noqa: ANN001
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters)


def test_the_fields_and_arguments_used_are_there():
    import sglang

    args = set(inspect.signature(sglang.Engine.async_generate).parameters)
    assert {"input_ids", "sampling_params", "custom_logit_processor", "return_hidden_states", "rid", "cache_salt",
            "priority"} <= args
    lpo = _resolve("sglang.srt.layers.logits_processor", "LogitsProcessorOutput")
    assert {"next_token_logits", "hidden_states", "customized_info"} <= _fields(lpo)
    fb = _resolve("sglang.srt.model_executor.forward_batch_info", "ForwardBatch")
    assert {"forward_mode", "batch_size", "out_cache_loc", "req_pool_indices", "extend_prefix_lens_cpu",
            "extend_seq_lens_cpu", "sampling_info"} <= _fields(fb)
    assert "custom_params" in _fields(_resolve("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo"))
    pool = _resolve("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool")
    assert all(callable(getattr(pool, m, None)) for m in ("get_key_buffer", "get_value_buffer", "set_kv_buffer"))
    tm = inspect.getsource(_resolve("sglang.srt.managers.tokenizer_manager", "TokenizerManager"))
    assert "self._subprocess_watchdog" in tm
    from sglang.srt.server_args import ServerArgs

    used = {"model_path", "device", "dtype", "skip_tokenizer_init", "attention_backend", "disable_cuda_graph",
            "chunked_prefill_size", "max_prefill_tokens", "max_total_tokens", "max_running_requests",
            "mem_fraction_static", "enable_custom_logit_processor", "return_hidden_states_mode", "sleep_on_idle",
            "radix_eviction_policy", "log_level"}
    args = ServerArgs(model_path="unused", radix_eviction_policy="priority", sleep_on_idle=True)  # (no I/O)
    assert [k for k in sorted(used) if not hasattr(args, k)] == []


def test_the_scheduler_still_signals_its_parent_on_a_fault():
    """Why the runtime handles SIGQUIT (serve.sglang_runtime): if SGLang stops sending it, the
    handler is dead code; if it starts sending another signal, the server is exposed again."""
    src = inspect.getsource(_resolve("sglang.srt.managers.scheduler", "run_scheduler_process"))
    assert "parent_process.send_signal(signal.SIGQUIT)" in src


def test_the_docs_list_every_surface():
    text = DOCS.read_text()
    section = text[text.index("### SGLang surfaces"):]
    missing = [p for _, p, _ in PUBLIC + INTERNAL if f"`{p}`" not in section]
    assert missing == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_a_pool_the_model_cannot_write_in_place_is_refused(dtype):
    """The model writes K/V into the pool's buffers: a float pool takes them, a quantized one
    (whose buffers are not the stored values) is refused with the fix."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from genrec.serve.sglang_models.genrec_tower import check_pool

    pool = MHATokenToKVPool(size=16, page_size=1, dtype=getattr(torch, dtype), head_num=2, head_dim=4, layer_num=2,
                            device="cpu", enable_memory_saver=False)
    if dtype.startswith("float8"):
        with pytest.raises(ValueError, match="kv_cache_dtype = auto"):
            check_pool(pool)
    else:
        check_pool(pool)
