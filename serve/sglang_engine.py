"""The SGLang engine: genrec's tower runs inside SGLang; everything else as in TorchEngine.

The only module of serve/ that imports SGLang. What happens where:

    outside SGLang (this process)            inside SGLang (its scheduler process)
    ---------------------------------        -------------------------------------------
    validate, collate histories (+ cands)
    quantized TorchRec lookups, positions,
    time features -> one fp64 row per token  -> GenRecTower: the tower from models/ over
      (positional_embed_overrides)              each request's ragged slice; candidates
                                                (placeholder id 2) are targets: they see
                                                the history and themselves only
    user vectors, exact top-k, ranking head <- final hidden state of every position
    and the objective

One prefill per user and pass: candidates ride in the same request as the history, so the
history is encoded once for all of them. (SGLang's prefix cache would be the other way to
share it, but requests that carry embedding overrides are never matched against or added
to the radix cache in SGLang 0.5.23, so it is disabled here.) Recommend without given
candidates makes two passes: history -> retrieval, then history + retrieved -> ranking.

Rows travel as fp64: SGLang casts overrides to the dtype of the model's embedding table,
and fp64 keeps the relative timestamps exact (they feed HSTU's time buckets).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from genrec.serve import sglang_shim

HIST_ID, CAND_ID, VOCAB = 1, 2, 4
log = logging.getLogger("genrec.serve.sglang")


def _prepare_environment() -> None:
    """Before SGLang is imported: CPU engine switch, our model package, the shims (here and
    in SGLang's spawned workers, through PYTHONPATH)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "genrec.serve.sglang_models"
    paths = [sglang_shim.HERE]  # (genrec itself is installed: the workers import it as we do)
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in current if p not in paths])
    sglang_shim.install()


_prepare_environment()

import sglang as sgl  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.managers.embed_types import PositionalEmbeds  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402

from genrec.config import from_dict, to_dict  # noqa: E402
from genrec.kernels.jagged import lengths_to_offsets  # noqa: E402
from genrec.models.hstu import JaggedMeta  # noqa: E402
from genrec.models.recommender import ModelConfig, build_tower  # noqa: E402
from genrec.serve.engine import Result, TorchEngine, collate_users  # noqa: E402
from genrec.serve.requests import Work  # noqa: E402


class GenRecTower(nn.Module):
    """SGLang model (EntryClass): the tower of ``models/`` over ragged prefill batches.

    Per token it receives [D tower-input dims, event time, query time] (relative seconds)
    and returns the tower's output for every prompt position as SGLang's hidden states.
    """

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:  # noqa: ANN001
        super().__init__()
        self.cfg = from_dict(ModelConfig, config.genrec_model)
        self.dim = int(config.genrec_dim)
        self.tower = build_tower(self.cfg, self.dim)
        self.embed_tokens = nn.Embedding(VOCAB, self.dim + 2, dtype=torch.float64)
        self.vocab = VOCAB

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False, **kw):  # noqa: ANN001, ANN201
        fb = forward_batch
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        lengths = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=x.device)
        if any(fb.extend_prefix_lens_cpu):
            # An exception here would take the whole engine down; the caller checks shapes.
            log.error("GenRecTower got a chunked or cached prefill; run with the radix cache off and no chunking")
        offsets = lengths_to_offsets(lengths)
        seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths)
        n_cand = torch.zeros(lengths.numel(), dtype=torch.int64, device=x.device).index_add_(
            0, seg, (input_ids == CAND_ID).long())
        meta = JaggedMeta(offsets, int(lengths.max()), x[:, -2], x[:, -1], n_cand if bool(n_cand.any()) else None)
        h = self.tower(x[:, : self.dim].float(), meta)
        mode = getattr(fb, "capture_hidden_mode", None)
        if mode is not None and mode.is_full():
            hidden = h
        elif mode is not None and mode.is_last():
            hidden = h[offsets[1:] - 1]
        else:
            hidden = None
        logits = torch.zeros(lengths.numel(), self.vocab, device=x.device)
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden)

    def load_weights(self, weights) -> None:  # noqa: ANN001
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"GenRecTower: unexpected weight {name}")
            params[name].data.copy_(tensor.to(params[name].dtype))


def _float_state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """fp32 weights of a served tower, whatever its dense scheme (quantized layers dequantized)."""
    out = {}
    for name, sub in module.named_modules():
        full = f"{prefix}{name}." if name else prefix
        if hasattr(sub, "weight") and callable(getattr(sub, "weight", None)):  # torch.ao dynamic int8 Linear
            w, b = sub.weight().dequantize(), sub.bias()
            out[f"{full}weight"] = w
            if b is not None:
                out[f"{full}bias"] = b.detach()
        elif hasattr(sub, "codes") and hasattr(sub, "scale"):  # fp8 weight-only Linear
            out[f"{full}weight"] = sub.codes.float() * sub.scale[:, None]
            if sub.bias is not None:
                out[f"{full}bias"] = sub.bias.detach()
    for name, t in module.state_dict().items():
        if "_packed_params" in name or name.endswith((".codes", ".scale", ".zero_point", ".scale_")):
            continue
        out.setdefault(prefix + name, t.detach())
    return {k: v.float().contiguous() for k, v in out.items()}


class SGLangEngine(TorchEngine):
    """Same interface and answers as TorchEngine; the tower's forward runs inside SGLang."""

    name = "sglang"

    def __init__(self, artifact: str | Path, device: str = "cpu", max_tokens: int = 65536) -> None:
        super().__init__(artifact, device=device)
        self.ckpt = Path(tempfile.mkdtemp(prefix="genrec-sglang-"))
        dim = self.model.embedding_cfg.dim
        cfg = {"architectures": ["GenRecTower"], "model_type": "llama", "hidden_size": dim + 2,
               "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": dim + 2, "num_hidden_layers": 1,
               "intermediate_size": dim, "vocab_size": VOCAB, "max_position_embeddings": max_tokens,
               "torch_dtype": "float32", "genrec_model": to_dict(self.model.cfg), "genrec_dim": dim}
        (self.ckpt / "config.json").write_text(json.dumps(cfg))
        weights = _float_state(self.model.tower, "tower.")
        weights["embed_tokens.weight"] = torch.zeros(VOCAB, dim + 2, dtype=torch.float64)
        save_file(weights, str(self.ckpt / "model.safetensors"))
        # SGLang's Engine owns an asyncio loop; it lives on one private thread.
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang")
        self.engine = self.thread.submit(self._start, device, max_tokens).result()

    def _start(self, device: str, max_tokens: int):  # noqa: ANN202
        asyncio.set_event_loop(asyncio.new_event_loop())
        return sgl.Engine(model_path=str(self.ckpt), device=device, dtype="float32", skip_tokenizer_init=True,
                          attention_backend="torch_native", disable_cuda_graph=True, disable_radix_cache=True,
                          chunked_prefill_size=-1, max_prefill_tokens=max_tokens, max_total_tokens=max_tokens + 4096,
                          mem_fraction_static=0.3, enable_return_hidden_states=True, log_level="warning")

    def close(self) -> None:
        """Stops SGLang's processes and the loop its client tasks live on."""

        def stop() -> None:
            self.engine.shutdown()
            loop = asyncio.get_event_loop()
            pending = list(asyncio.all_tasks(loop))
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self.thread.submit(stop).result()
        self.thread.shutdown()

    # ----- the tower inside SGLang -------------------------------------------------------
    def _tower(self, batch) -> tuple[torch.Tensor, object]:  # noqa: ANN001
        """Tower outputs for every token of ``batch`` (history, + candidates as targets)."""
        x, tok = self.model._tokens(batch)
        lengths = (tok.offsets[1:] - tok.offsets[:-1]).tolist()
        hist = (tok.offsets[1:] - tok.offsets[:-1]) - (tok.num_targets if tok.num_targets is not None else 0)
        base = tok.query_times[tok.last_rows].to(torch.float64)  # any per-user constant: times are relative
        rows, ids, start = [], [], 0
        for b, n in enumerate(lengths):
            sl = slice(start, start + n)
            feats = torch.stack([tok.timestamps[sl].to(torch.float64) - base[b],
                                 tok.query_times[sl].to(torch.float64) - base[b]], 1)
            rows.append(torch.cat([x[sl].to(torch.float64), feats], 1))
            h = int(hist[b])
            ids.append([HIST_ID] * h + [CAND_ID] * (n - h))
            start += n
        outs = self.thread.submit(self._generate, ids, rows).result()
        hidden = [torch.tensor(o["meta_info"]["hidden_states"][0], dtype=torch.float32) for o in outs]
        for n, h in zip(lengths, hidden):
            if h.shape[0] != n:
                raise RuntimeError(f"SGLang returned {h.shape[0]} hidden rows for a {n}-token request")
        return torch.cat(hidden), tok

    def _generate(self, ids: list[list[int]], rows: list[torch.Tensor]) -> list[dict]:
        obj = GenerateReqInput(
            input_ids=ids, sampling_params={"max_new_tokens": 1}, return_hidden_states=True,
            positional_embed_overrides=[PositionalEmbeds(embeds=r, positions=list(range(r.shape[0]))) for r in rows])
        loop = asyncio.get_event_loop()
        out = loop.run_until_complete(self.engine.tokenizer_manager.generate_request(obj, None).__anext__())
        return out if isinstance(out, list) else [out]

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        t0 = time.perf_counter()
        retrieved = {}
        need = [(i, w) for i, w in enumerate(works) if w.kind == "retrieve" or w.candidates is None]
        if need:
            batch = collate_users([w.user for _, w in need], self.model, self.device)
            h, tok = self._tower(batch)
            users = self.model.head.normalize(h[tok.last_rows])
            found = self.retrieve(users, [(j, w) for j, (_, w) in enumerate(need)])
            retrieved = {i: found[j] for j, (i, _) in enumerate(need)}
        to_rank = self.plan_ranking(works, retrieved)
        probs = {i: np.zeros((0, len(self.schema.tasks)), np.float32) for i in to_rank}
        keys = [i for i in to_rank if to_rank[i][0].size]  # not those whose exclusions left nothing retrieved
        if keys:
            batch = collate_users([works[i].user for i in keys], self.model, self.device,
                                  candidates=[to_rank[i][0] for i in keys])
            h, tok = self._tower(batch)
            p = torch.sigmoid(self.model.rank_logits(h, tok, batch).float()).numpy()
            splits = np.cumsum([to_rank[i][0].size for i in keys])[:-1]
            probs.update(zip(keys, np.split(p, splits)))
        return self.finish(works, retrieved, to_rank, probs, t0)

