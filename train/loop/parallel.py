"""Hybrid parallelism: TorchRec model-parallel tables + data-parallel dense, applied from outside.

``parallelize`` takes the unsharded, single-process model and applies, in this order:

1. the sharding plan: per-table constraints from the feature spec (``TableConfig.sharding``),
   TorchRec's planner for the rest ("auto"); checked first against what the device supports;
2. the fused sparse optimizer, attached to the parameters of every sharded table *before*
   DMP (``apply_optimizer_in_backward``) so TorchRec fuses it into fbgemm's lookup kernel,
   which updates the rows inside backward (data-parallel tables stay with the dense AdamW);
3. ``DistributedModelParallel``: shards the tables across ranks (model parallel) and wraps
   the dense remainder in DDP (data parallel); or, with ``dense = "fsdp"``, wraps nothing and
   (3b) ``shard_dense`` applies FSDP2 to the dense remainder: one ``fully_shard`` unit per tower
   layer, then the root with the tables left out, so each rank keeps 1/world of the dense
   weights, gradients and optimizer state (optionally bf16 compute; activation checkpointing
   per layer, in either mode, is applied first, on the unsharded model);
4. one optimizer: DMP's fused optimizer + AdamW over the dense parameters (a
   ``CombinedOptimizer``), whose state keys are the model's parameter names, so checkpoints
   move between world sizes.

The same job config runs as one process (a world of one; no torchrun needed) and under
``torchrun --nnodes N --nproc-per-node M``.

``mode = "ddp"`` (what ``auto`` picks under torchrun on CPU when the tables train in AdamW,
``sparse_optimizer = "adam"``) replicates instead: every process holds every table and the
whole model runs under torch DDP, one AdamW over all parameters, which is the single-process
recipe's math with the batch split across processes. It is for catalogues that fit each
process's memory (ML-1M's 3,706 items), where sharding buys nothing and CPU TorchRec can
neither fuse Adam nor replicate a sequence table. Facts of TorchRec 1.8 / fbgemm-gpu-cpu 1.8 on CPU
(gloo) that shape the checks below: fused Adam is CUDA-only; a sequence table
(EmbeddingCollection) cannot be data-parallel on CPU (fbgemm's dense kernel pools); TorchRec's
planner offers no row-wise for pooled tables on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import torchrec
from torch import nn

from genrec.config import ConfigError
from genrec.embedding.spec import EmbeddingConfig
from genrec.train.observe.watchdog import COLLECTIVES, collective

SparseOptimizer = Literal["adam", "rowwise_adagrad", "adagrad", "sgd"]
CPU_EC_SHARDINGS = ("table_wise", "row_wise", "column_wise")
CPU_EBC_SHARDINGS = ("table_wise", "column_wise", "table_column_wise", "data_parallel")


@dataclass(frozen=True)
class ParallelConfig:
    # auto: DMP under torchrun (WORLD_SIZE > 1) or whenever the sparse optimizer is a fused
    # one (so 1 and N processes train, and checkpoint, alike), but DDP under torchrun on CPU
    # when the tables train in AdamW (sparse_optimizer = "adam"); ddp: every table replicated,
    # the whole model under torch DDP; none: the plain model
    mode: Literal["auto", "dmp", "ddp", "none"] = "auto"
    # adam: embeddings in the dense AdamW (single process; fused Adam needs CUDA);
    # the others are fbgemm's fused optimizers, the same math in 1 or N processes
    sparse_optimizer: SparseOptimizer = "adam"
    sparse_lr: float = 0.0  # 0: train.optim.lr
    sparse_eps: float = 1e-8
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # collectives (and joining the group) fail after this long instead of hanging; with
    # torchrun --max-restarts a stuck worker group then restarts
    timeout_s: float = 300.0
    # how the dense part (tower, heads, position table) trains beside DMP's sharded tables:
    # ddp: replicated on every rank, gradients all-reduced; fsdp: FSDP2 (fully_shard per tower
    # layer, then the rest), parameters, gradients and optimizer state split across ranks and
    # all-gathered one layer at a time, for towers whose weights + AdamW state outgrow a rank
    dense: Literal["ddp", "fsdp"] = "ddp"
    # fsdp only: the dtype layers compute in (the all-gathered weights are cast to it); the
    # sharded master weights, the optimizer and the gradient reductions stay fp32
    fsdp_param_dtype: Literal["fp32", "bf16"] = "fp32"
    # recompute each tower layer's activations in backward instead of keeping them (ddp or fsdp)
    activation_checkpointing: bool = False


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    distributed: bool = False  # a process group is up (torchrun, or a world of one for DMP)

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return t
        t = t.clone()
        with collective("all_reduce (sum)"):
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.distributed:
            with collective("barrier"):
                dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        with collective("broadcast"):
            dist.broadcast_object_list(box, src=0)
        return box[0]


Strategy = Literal["none", "dmp", "ddp"]


def strategy(cfg: ParallelConfig) -> Strategy:
    """How this process trains: the plain model, sharded tables (DMP) or replicas (DDP)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.mode == "none":
        if world > 1:
            raise ConfigError("train.parallel.mode = 'none' cannot run under torchrun with WORLD_SIZE > 1")
        return "none"
    if cfg.mode == "ddp":
        if cfg.sparse_optimizer != "adam":
            raise ConfigError(f"train.parallel.mode = 'ddp' trains the tables in the dense AdamW; "
                              f"sparse_optimizer = '{cfg.sparse_optimizer}' needs mode = 'dmp' (or 'auto')")
        return "ddp"
    if cfg.mode == "auto" and world > 1 and cfg.sparse_optimizer == "adam" and not torch.cuda.is_available():
        return "ddp"
    return "dmp" if cfg.mode == "dmp" or world > 1 or cfg.sparse_optimizer != "adam" else "none"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: ParallelConfig) -> DistContext:
    """Joins torchrun's process group (or makes a world of one when DMP runs alone)."""
    use_cuda = torch.cuda.is_available()
    if strategy(cfg) == "none":
        return DistContext(device=torch.device("cuda") if use_cuda else torch.device("cpu"))
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        if "WORLD_SIZE" in os.environ:
            # Keys of this attempt's group live under their own prefix, so workers restarted by
            # torchrun can never read the addresses of the dead attempt's workers.
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"genrec/attempt_{attempt}", store),
                                    rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return DistContext(dist.get_rank(), dist.get_world_size(), local, device, True)


def check_plan(emb: EmbeddingConfig, cfg: ParallelConfig, device: torch.device) -> None:
    """Refuses, before any training, what this device cannot shard or fuse; names the fix."""
    if device.type == "cpu" and cfg.sparse_optimizer == "adam":
        raise ConfigError(
            "train.parallel.sparse_optimizer = 'adam' cannot be fused on CPU (fbgemm's CPU kernels have no Adam); "
            "set it to 'rowwise_adagrad', 'adagrad' or 'sgd' to shard tables on CPU, or replicate them with mode = 'ddp' "
            "(or 'auto'), or run one process with mode = 'none'")
    if device.type != "cpu":
        return
    for t in emb.tables:
        if t.sharding == "auto":
            continue
        allowed = CPU_EC_SHARDINGS if t.pooling == "none" else CPU_EBC_SHARDINGS
        if t.sharding not in allowed:
            kind = "sequence (EmbeddingCollection)" if t.pooling == "none" else "pooled (EmbeddingBagCollection)"
            raise ConfigError(
                f"table '{t.name}': sharding '{t.sharding}' is not available for {kind} tables on CPU/gloo; "
                f"use one of {list(allowed)} (or 'auto')")
        if t.oov == "mch" and t.sharding != "row_wise":
            raise ConfigError(f"table '{t.name}': managed-collision tables shard row-wise only; set sharding = 'row_wise'")
    if cfg.sparse_optimizer == "rowwise_adagrad" and any(t.oov == "mch" for t in emb.tables):
        raise ConfigError("managed-collision tables cannot use 'rowwise_adagrad' on CPU (fbgemm lacks "
                         "reset_weight_momentum there); use 'adagrad' or 'sgd'")


def sparse_optimizer(cfg: ParallelConfig, lr: float) -> tuple[type, dict[str, float]]:
    lr = cfg.sparse_lr or lr
    return {
        "adam": (torch.optim.Adam, {"lr": lr, "eps": cfg.sparse_eps}),
        "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": lr, "eps": cfg.sparse_eps}),
        "adagrad": (torch.optim.Adagrad, {"lr": lr, "eps": cfg.sparse_eps}),
        "sgd": (torch.optim.SGD, {"lr": lr}),
    }[cfg.sparse_optimizer]


def sharding_plan(model: nn.Module, emb: EmbeddingConfig, ctx: DistContext, sharders: list, batch_size: int,  # noqa: ANN201
                  data_parallel: bool = True):
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )

    constraints = {}
    for t in emb.tables:
        kernels = ["fused"] if (ctx.device.type == "cpu" or t.oov == "mch") and t.sharding != "data_parallel" else None
        types = [t.sharding] if t.sharding != "auto" else None
        if types is None and ctx.device.type == "cpu":
            types = list(CPU_EC_SHARDINGS if t.pooling == "none" else CPU_EBC_SHARDINGS)
        if types is None and not data_parallel:
            types = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"]
        if types and not data_parallel:
            types = [x for x in types if x != "data_parallel"]
        if t.oov == "mch":
            types = ["row_wise"]
        if types or kernels:
            constraints[t.name] = ParameterConstraints(sharding_types=types, compute_kernels=kernels)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=ctx.world_size, compute_device=ctx.device.type),
        constraints=constraints, batch_size=batch_size)
    # plan() on every rank, not collective_plan(): an unsatisfiable plan then fails on all
    # ranks alike instead of leaving the others waiting in a broadcast
    return planner.plan(model, sharders)


def sharders_for(emb: EmbeddingConfig) -> list:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    fused = {}
    if any(t.data_type == "fp16" for t in emb.tables):
        fused["stochastic_rounding"] = True  # honoured on GPU; fbgemm's CPU kernels ignore it
    return [EmbeddingCollectionSharder(fused_params=fused or None), EmbeddingBagCollectionSharder(fused_params=fused or None),
            ManagedCollisionEmbeddingCollectionSharder()]


@dataclass
class Parallelized:
    model: nn.Module  # call this to train (DMP)
    module: nn.Module  # the model inside (sharded tables), for evaluation
    optimizer: torch.optim.Optimizer
    dense_params: list[nn.Parameter]
    dense_optimizer: Any  # KeyedOptimizerWrapper (its state is lazy; see init_optimizer_state)
    plan: Any

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if "optim" in state:
            self.optimizer.load_state_dict(state["optim"])

    def init_optimizer_state(self) -> None:
        """AdamW's state is created at its first step; a checkpoint needs it present to load into."""
        self.dense_optimizer.init_state()

    def describe(self) -> dict[str, str]:
        out = {}
        for module_plan in self.plan.plan.values():
            for table, p in module_plan.items():
                out[table] = f"{p.sharding_type} on ranks {p.ranks} ({p.compute_kernel})"
        units = fsdp_modules(self.module)
        if units:  # the dense part's layout, beside the tables' (DDP: replicated, the default)
            out["(dense)"] = (f"FSDP2 over ranks {list(range(dist.get_world_size()))}: {len(units)} units "
                              f"({len(units) - 1} tower layers + the rest)")
        return out


def parallelize(model: nn.Module, emb: EmbeddingConfig, cfg: ParallelConfig, lr: float, make_dense_optimizer,
                ctx: DistContext, batch_size: int) -> Parallelized:  # noqa: ANN001
    """Applies, in order: fused sparse optimizer -> sharding plan -> DMP (tables sharded,
    dense under DDP) -> one combined optimizer. See the module docstring."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    check_plan(emb, cfg, ctx.device)
    fsdp = cfg.dense == "fsdp"
    if fsdp and any(t.sharding == "data_parallel" for t in emb.tables):
        raise ConfigError("train.parallel.dense = 'fsdp' leaves no DDP to all-reduce data-parallel tables' gradients; "
                          "set those tables' sharding to 'auto' or a model-parallel one, or dense = 'ddp'")
    if fsdp and cfg.fsdp_param_dtype != "fp32" and getattr(model, "ranking", None) is not None:
        # ranking evaluation runs the layers outside forward (encode_history: a layer's
        # forward_last, then forward_cached), past FSDP's input casts: fp32 inputs meet bf16 weights
        raise ConfigError("train.parallel.fsdp_param_dtype = 'bf16' cannot evaluate ranking tasks (their evaluation "
                          "runs tower layers outside forward, where FSDP does not cast the inputs); use "
                          "fsdp_param_dtype = 'fp32' with train.precision = 'bf16' (autocast: bf16 compute, fp32 "
                          "weights and reductions)")
    if cfg.activation_checkpointing:
        checkpoint_layers(model)
    # (1) the plan: which table goes where, and how (under FSDP no table is data parallel:
    # nothing would all-reduce its gradients)
    sharders = sharders_for(emb)
    plan = sharding_plan(model, emb, ctx, sharders, batch_size, data_parallel=not fsdp)
    # (2) the fused sparse optimizer on every table that will be sharded (data-parallel
    # tables are replicated parameters: DDP averages their gradients, AdamW updates them)
    replicated = {t for mp in plan.plan.values() for t, p in mp.items() if p.sharding_type == "data_parallel"}
    opt_cls, opt_kw = sparse_optimizer(cfg, lr)
    fused = [p for name, p in model.sparse.named_parameters() if name.split(".")[-2] not in replicated]
    apply_optimizer_in_backward(opt_cls, fused, opt_kw)
    # (3) shard the tables (model parallel), DDP the rest (data parallel); or, with dense =
    # "fsdp", leave the rest to (3b)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=ctx.device, plan=plan, sharders=sharders,
                                   data_parallel_wrapper=_NoDataParallel() if fsdp else None)
    if fsdp:  # (3b) the dense part fully sharded; before (4): FSDP swaps in its own (DTensor) parameters
        shard_dense(dmp.module, cfg, ctx)
    # (4) one optimizer: fused (sparse) + AdamW (dense); keys are parameter names
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(dense, make_dense_optimizer)
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    return Parallelized(dmp, dmp.module, optimizer, list(dense.values()), dense_opt, plan)


class _NoDataParallel:
    """DMP's data-parallel wrapper that wraps nothing: FSDP takes the dense part (shard_dense)."""

    def wrap(self, dmp: nn.Module, env: Any, device: torch.device) -> None:
        return None


def checkpoint_layers(model: nn.Module) -> int:
    """Activation checkpointing per tower layer: each layer's forward runs under
    ``torch.utils.checkpoint`` (non-reentrant), so backward recomputes its activations instead
    of keeping them. Set on the instance's ``forward``, not by a wrapper module, so parameter
    names (and with them checkpoints) stay those of the plain model. Returns the layer count."""
    from torch.utils.checkpoint import checkpoint

    layers = list(getattr(model.tower, "layers", []))
    for layer in layers:
        plain = type(layer).forward.__get__(layer)
        layer.forward = functools.partial(checkpoint, plain, use_reentrant=False)
    return len(layers)


def shard_dense(module: nn.Module, cfg: ParallelConfig, ctx: DistContext) -> None:
    """FSDP2 over the dense part of a DMP model, in place: one ``fully_shard`` unit per tower
    layer (all-gathered just before it runs, freed after), then the root for the rest
    (position table, final norm, heads), the sharded tables left out (``ignored_params``).
    Each parameter becomes a DTensor holding 1/world of its rows on this rank; the optimizer,
    built after this, keeps its state in the same shards. Mixed precision: the tower layers
    compute in ``fsdp_param_dtype`` (their weights all-gathered in it, their inputs cast to it)
    and hand fp32 back; the rest (position table, final norm, heads: the logits and the loss)
    stays fp32, as the tables' outputs are, and so do the reduce-scatters and master weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    low = torch.bfloat16 if cfg.fsdp_param_dtype == "bf16" else None
    layer_mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32 if low is not None else None)
    for layer in getattr(module.tower, "layers", []):
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp)
    tables = set(module.sparse.parameters())
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32), ignored_params=tables)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_params(model: nn.Module) -> Any:
    """Every FSDP unit of ``model`` all-gathered for the block, and kept so: evaluation calls
    methods besides ``forward`` (``user_states``, ``item_embeddings``, a layer's
    ``forward_last``), which FSDP's hooks do not see. A no-op without FSDP. Every rank enters
    it (the all-gathers are collectives)."""
    units = fsdp_modules(model)
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


class Replicated:
    """A DDP-replicated model's checkpoint I/O: the inner module's state, keyed as in one
    process (so checkpoints move between 1 and N processes), written once by DCP."""

    def __init__(self, model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer,
                 tables: list[str]) -> None:
        from genrec.train.loop.checkpoint import PlainState

        self.model, self.module, self.optimizer, self.tables = model, module, optimizer, tables
        self.dense_params = [p for p in module.parameters() if p.requires_grad]
        self._io = PlainState(module, optimizer)
        self.state, self.load, self.init_optimizer_state = self._io.state, self._io.load, self._io.init_optimizer_state

    def describe(self) -> dict[str, str]:
        ranks = list(range(dist.get_world_size()))
        return {name: f"replicated on ranks {ranks} (DDP, dense AdamW)" for name in self.tables}


def replicate(model: nn.Module, emb: EmbeddingConfig, make_optimizer, ctx: DistContext,  # noqa: ANN001
              cfg: ParallelConfig | None = None) -> Replicated:
    """``mode = "ddp"``: the whole model (tables included) under torch DDP, one optimizer over
    all parameters: gradients are averaged across ranks, as DMP's DDP does for dense ones."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = cfg or ParallelConfig()
    if cfg.dense == "fsdp":
        raise ConfigError("train.parallel.dense = 'fsdp' shards the dense part beside TorchRec's sharded tables: set "
                          "mode = 'dmp' with a fused sparse_optimizer ('rowwise_adagrad', 'adagrad', 'sgd'), or dense = 'ddp'")
    if cfg.activation_checkpointing:
        checkpoint_layers(model)
    for t in emb.tables:
        if t.sharding not in ("auto", "data_parallel"):
            raise ConfigError(f"table '{t.name}': sharding '{t.sharding}' with train.parallel.mode = 'ddp', which "
                              "replicates every table; set it to 'auto' or 'data_parallel', or use mode = 'dmp'")
    model = model.to(ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return Replicated(ddp, model, make_optimizer(p for p in model.parameters() if p.requires_grad),
                      [t.name for t in emb.tables])


# ----- timing and marking the collectives inside DDP and DMP (train.observe.stepstats, train.observe.watchdog) -----
def _timed_all_reduce(state: tuple[Any, Any], bucket):  # noqa: ANN001, ANN202
    """DDP's default all-reduce (average) of one gradient bucket (a ``dist.GradBucket``),
    timed from the bucket's readiness to its completion and marked for the watchdog while in
    flight; returns the averaged bucket's future. ``state``: (the DDP module's process group,
    the CommTimes). No annotations on ``bucket`` and the return: DDP compares them with its
    own classes, and this module's string annotations would fail that check."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    group, comm = state
    seq = COLLECTIVES.enter(f"all_reduce (DDP bucket {bucket.index()})", launched=False)
    start = time.perf_counter()
    fut = allreduce_hook(group, bucket)
    COLLECTIVES.launch(seq)

    def done(f: torch.futures.Future) -> torch.Tensor:
        comm.add_all_reduce(start, time.perf_counter())
        COLLECTIVES.leave(seq)
        return f.value()

    return fut.then(done)


class _TimedWork(dist.Work):
    """An async all-to-all's handle whose ``wait()`` is timed (a ``dist.Work``, so TorchRec's
    isinstance checks still hold); the watchdog's marker is left when the work completes."""

    def __init__(self, inner: dist.Work, comm: Any, seq: int) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm
        try:
            inner.get_future().add_done_callback(lambda _: COLLECTIVES.leave(seq))
        except RuntimeError:  # a backend without futures: left at the wait
            self.seq = seq

    def wait(self, timeout: timedelta | None = None) -> bool:
        t = time.perf_counter()
        try:
            return self.inner.wait() if timeout is None else self.inner.wait(timeout)
        finally:
            self.comm.add_all_to_all(time.perf_counter() - t)
            if hasattr(self, "seq"):
                COLLECTIVES.leave(self.seq)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self.inner.get_future()


_A2A_SINK: list[Any] = [None]  # the CommTimes the all-to-all wrapper reports to: the newest trainer's


def _timed_all_to_all(original: Any) -> Any:
    def all_to_all_single(*args: Any, **kwargs: Any) -> Any:
        comm = _A2A_SINK[0]
        seq = COLLECTIVES.enter("all_to_all (TorchRec)", launched=False)
        t = time.perf_counter()
        try:
            work = original(*args, **kwargs)
        except BaseException:
            COLLECTIVES.leave(seq)
            raise
        COLLECTIVES.launch(seq)
        comm.add_all_to_all(time.perf_counter() - t)
        if isinstance(work, dist.Work):
            return _TimedWork(work, comm, seq)
        COLLECTIVES.leave(seq)  # synchronous: done
        return work

    all_to_all_single.genrec_timed = True
    return all_to_all_single


def has_sharded_tables(model: nn.Module) -> bool:
    """Whether ``model`` holds TorchRec sharded modules (DMP), whose fused optimizers update
    the tables inside any backward."""
    return any(type(m).__module__.startswith("torchrec.distributed") for m in model.modules())


def no_sync(model: nn.Module) -> contextlib.ExitStack:
    """DDP's ``no_sync`` on every DDP module in ``model`` (the wrapper itself, or DMP's dense
    part): a forward and backward in it reduce nothing across ranks."""
    from torch.nn.parallel import DistributedDataParallel

    stack = contextlib.ExitStack()
    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            stack.enter_context(m.no_sync())
    for m in fsdp_modules(model):  # FSDP: no reduce-scatter; gradients accumulate unsharded
        m.set_requires_gradient_sync(False, recurse=False)
        stack.callback(m.set_requires_gradient_sync, True, recurse=False)
    return stack


def time_collectives(model: nn.Module, comm: Any) -> list[str]:
    """Installs the collective timers ``train.observe.stepstats`` reports (``comm`` is its
    ``CommTimes``) and the watchdog's markers: a comm hook on every DDP module in ``model``
    (the same averaging all-reduce DDP runs by default, in Python), and, when ``model``
    holds TorchRec sharded modules, a wrapper around ``torch.distributed.all_to_all_single``
    (the call TorchRec's input and output dists make, forward and backward), whose returned
    handles time their ``wait()``. The wrapper is process-wide, installed once, and reports to
    the newest ``comm``. Returns
    what was installed."""
    from torch.nn.parallel import DistributedDataParallel

    done = []
    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            m.register_comm_hook((m.process_group, comm), _timed_all_reduce)
            done.append("DDP all-reduce hook")
    if has_sharded_tables(model):
        _A2A_SINK[0] = comm
        if not getattr(dist.all_to_all_single, "genrec_timed", False):
            dist.all_to_all_single = _timed_all_to_all(dist.all_to_all_single)
        done.append("all_to_all_single timer")
    return done
