"""One training step of a sharded model (2 ranks, gloo) against the unsharded reference.

Launched by tests/test_distributed.py as
``torchrun --nproc-per-node 2 tests/dist/one_step.py EC_SHARDING EBC_SHARDING OUT``
(or ``... one_step.py ddp ddp OUT`` for the replicated model of ``mode = "ddp"``).
Every rank builds the same seeded reference; the sharded model starts from its weights,
takes one step on its own batch (fused SGD on the tables, SGD on the dense part, at LRs set
on the param groups as the trainer's schedule sets them; under DDP one SGD over everything);
rank 0 applies the same step to the reference on the mean of both ranks' losses and compares.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec import KeyedJaggedTensor

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.models.hstu import HSTUConfig
from genrec.models.inputs import SequenceBatch
from genrec.models.ranking import RankingConfig, TaskConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.retrieval import RetrievalConfig
from genrec.train.loop.parallel import ParallelConfig, init_distributed, parallelize, replicate

SPARSE_LR, DENSE_LR = 0.1, 0.05


def config(ec: str, ebc: str) -> tuple[ModelConfig, EmbeddingConfig]:
    emb = EmbeddingConfig(tables=(
        TableConfig("item", ("item",), dim=16, num_embeddings=200, sharding=ec, init_std=0.05),
        TableConfig("action", ("action",), dim=16, num_embeddings=8, sharding="auto" if ec == "auto" else "table_wise",
                    init_std=0.05),
        TableConfig("region", ("region",), dim=8, num_embeddings=6, pooling="sum", sharding=ebc, init_std=0.05),
    ))
    cfg = ModelConfig(tower="hstu", max_seq_len=16, input_dropout=0.0,
                      hstu=HSTUConfig(num_layers=1, qk_dim=16, v_dim=16, dropout=0.0),
                      retrieval=RetrievalConfig(loss="full_softmax", exclude_history=True),
                      ranking=RankingConfig(tasks=(TaskConfig("click", ("click",)),), hidden=(16,), dropout=0.0))
    return cfg, emb


def batch(rank: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(100 + rank)
    lens, nts = [5, 3, 7], [2, 0, 1]
    t = sum(lens)
    items = torch.randint(1, 200, (t,), generator=g)
    acts = torch.randint(1, 8, (t,), generator=g)
    times = torch.arange(t) * 60
    hist = sum(n - k for n, k in zip(lens, nts))
    return SequenceBatch(
        seq=KeyedJaggedTensor(keys=["item", "action"], values=torch.cat([items, acts]), lengths=torch.tensor(lens * 2)),
        max_len=max(lens), timestamps=times, query_times=times + 30, has_time=torch.ones(3, dtype=torch.bool),
        num_targets=torch.tensor(nts), targets=torch.randint(1, 200, (hist,), generator=g),
        labels=torch.randint(0, 2, (sum(nts), 1), generator=g).float(),
        context=KeyedJaggedTensor(keys=["region"], values=torch.randint(0, 6, (4,), generator=g),
                                  lengths=torch.tensor([1, 2, 1])))


def main() -> None:
    ec, ebc, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if ec == "ddp":
        return replicated(out)
    cfg, emb = config(ec, ebc)
    corpus = torch.arange(1, 200)
    torch.manual_seed(0)
    reference = GenerativeRecommender(cfg, emb, corpus)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    ctx = init_distributed(ParallelConfig(mode="dmp", sparse_optimizer="sgd"))
    torch.manual_seed(0)
    model = GenerativeRecommender(cfg, emb, corpus, sparse_device=torch.device("meta"))
    par = parallelize(model, emb, ParallelConfig(sparse_optimizer="sgd"), 2 * SPARSE_LR,
                      lambda ps: torch.optim.SGD(list(ps), lr=2 * DENSE_LR), ctx, batch_size=3)
    par.model.load_state_dict({k: v.clone() for k, v in start.items()})  # the sharded modules consume it
    # the step's LR as a schedule sets it (train.loop.trainer.Trainer.set_lr): on every param group,
    # then zero_grad() before the forward, which hands it to the fused optimizers that update
    # the tables inside backward (else they would step with the 2x LR they were built with)
    for g in par.optimizer.param_groups:
        g["lr"] /= 2
    par.optimizer.zero_grad()
    loss = par.model(batch(ctx.rank))["loss"]
    loss.backward()
    par.optimizer.step()
    dcp.save({"model": par.model.state_dict()}, checkpoint_id=out / "ckpt")
    dist.barrier()
    if ctx.rank == 0:
        ref_loss = torch.stack([reference(batch(r))["loss"] for r in range(ctx.world_size)]).mean()
        ref_loss.backward()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if p.grad is None:
                    continue
                sparse = name.startswith("sparse.") and name.split(".")[-2] not in {
                    t for mp in par.plan.plan.values() for t, s in mp.items() if s.sharding_type == "data_parallel"}
                p -= (SPARSE_LR if sparse else DENSE_LR) * p.grad
        got = {k: torch.zeros_like(v) for k, v in reference.state_dict().items()}
        dcp.load({"model": got}, checkpoint_id=out / "ckpt", no_dist=True)
        want = reference.state_dict()
        diffs = {k: float((got[k].float() - want[k].float()).abs().max()) for k in want if want[k].is_floating_point()}
        moved = {k: float((want[k].float() - start[k].float()).abs().max()) for k in want if want[k].is_floating_point()}
        (out / "result.json").write_text(json.dumps({"diffs": diffs, "moved": moved, "plan": par.describe()}))
    dist.barrier()
    dist.destroy_process_group()


def replicated(out: Path) -> None:
    cfg, emb = config("auto", "auto")
    corpus = torch.arange(1, 200)
    torch.manual_seed(0)
    reference = GenerativeRecommender(cfg, emb, corpus)
    ctx = init_distributed(ParallelConfig(mode="ddp"))
    torch.manual_seed(1 + ctx.rank)  # different weights per rank: replicate() must start all from rank 0's
    model = GenerativeRecommender(cfg, emb, corpus)
    if ctx.rank == 0:
        model.load_state_dict(reference.state_dict())
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    par = replicate(model, emb, lambda ps: torch.optim.SGD(list(ps), lr=DENSE_LR), ctx)
    par.model(batch(ctx.rank))["loss"].backward()
    par.optimizer.step()
    got = {k: v.detach().clone() for k, v in par.module.state_dict().items()}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, got)
    if ctx.rank == 0:
        ref_loss = torch.stack([reference(batch(r))["loss"] for r in range(ctx.world_size)]).mean()
        ref_loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                if p.grad is not None:
                    p -= DENSE_LR * p.grad
        want = reference.state_dict()
        diffs = {k: max(float((g[k].float() - want[k].float()).abs().max()) for g in gathered)
                 for k in want if want[k].is_floating_point()}
        moved = {k: float((want[k].float() - start[k].float()).abs().max()) for k in want if want[k].is_floating_point()}
        (out / "result.json").write_text(json.dumps({"diffs": diffs, "moved": moved, "plan": par.describe()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
