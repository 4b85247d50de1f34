"""Tensor parallelism: the model sharded by transformers' own plan (DTensor over a ``tp`` DeviceMesh axis).

``torchrun --nproc-per-node N -m unison train --dist.tp=T``: N / T data-parallel replicas, each T ranks that hold
one model between them (a (dp, tp) DeviceMesh). ``parallelize`` applies the transformers plan of the model's family
with torch's own tensor-parallel styles: every rank of a replica holds 1/T of each attention and MLP projection
(column-wise in, row-wise out, one all-reduce per block), the KV heads of its share of the attention heads, and the
whole vocabulary projection and embedding (replicated), so the engine's and the trainer's chunked fp32-output
lm_head works unchanged. Every rank runs the same engine steps and training steps in the same order
from one host thread, so the collectives inside the forwards always match; the ranks sample the same tokens
because their logits are the same all-reduced values. Rewards are computed once, on rank 0, and broadcast.

Two rules of transformers' plans change here. Embedding and lm_head stay replicated instead of vocabulary-sharded.
Norms that see one rank's heads only (Qwen3's ``q_norm``/``k_norm``: "replicated_with_grad_allreduce") are plain
replicated parameters whose partial gradients the optimizer sums once per step (``unison.train.ownership``) (transformers'
own hook for them all-reduces the accumulated gradient after every backward, which double-counts under gradient
accumulation: one backward per packed row). transformers' own loader is not used for the sharding because it
insists that the tensor-parallel size be the whole world.

The forwards skip DTensor: ``LocalForward`` runs each sharded projection on its plain local shard with one explicit
all-reduce per row-wise projection, of fp32 partial products (DTensor's per-call dispatch cost more than a decode
step, and its bf16 partial sums added rounding noise); the parameters, gradients and optimizer stay DTensors.
With several replicas the optimizer splits each rank's state across them (ZeRO-1).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..bits import checksum
from ..rollout.rewards import WrappedScorer
from .runtime import agree_with_rank0, local
from .topology import Ranks, Topology

PARTIAL_GRAD = "replicated_with_grad_allreduce"


def _base_plan(model: torch.nn.Module) -> dict[str, str]:
    """transformers' tensor-parallel plan of the model's family: module pattern (under ``model.``) -> style."""
    return getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}


def _expert_styles(model: torch.nn.Module) -> set[str]:
    """The styles of transformers' expert-parallel plan that place modules of ``model``: its MoE experts, which
    transformers 5.25 lists there only (5.24 had them in the tensor-parallel plan too, as "moe_tp_experts"), and,
    for some families (Gemma4), their dense projections' colwise / rowwise."""
    plan = getattr(model.config.get_text_config(), "base_model_ep_plan", None) or {}
    names = [name for name, _ in model.named_modules()]
    return {style for pattern, style in plan.items() if fnmatch.filter(names, f"model.{pattern}")}


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard ``model`` in place over the 1-D ``mesh`` by the transformers plan of its family (``colwise`` and
    ``rowwise`` projections as torch's ``ColwiseParallel``/``RowwiseParallel``; see the module docstring for what
    stays replicated). Nothing is hung on the model: the sharded projections are the ``nn.Linear`` modules whose
    weight is a DTensor (``LocalForward`` finds them by their placement). A LoRA layer's base is sharded in its place
    (its adapters by ``unison.lora.shard_adapters``)."""
    base = _base_plan(model)
    if not base:
        raise ValueError(f"{model.config.model_type}: transformers has no tensor-parallel plan for this model")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = {style for style in base.values() if style not in styles and style != PARTIAL_GRAD}
    unknown |= {f"{style} (expert-parallel)" for style in _expert_styles(model) - {*styles, PARTIAL_GRAD}}
    if unknown:  # MoE experts ("moe_tp_experts"), fused projections ("packed_colwise"), MLA's, vocabulary-sharded ones
        raise ValueError(f"{model.config.model_type}: its tensor-parallel plan has styles unison does not shard "
                         f"({', '.join(sorted(unknown))}), so dist.tp > 1 is refused for it; train it with data "
                         "parallelism (dist.tp=1) instead, with optim.placement=host where one GPU lacks the memory "
                         "for its fp32 optimizer state")
    plan = {}
    for name, module in model.named_modules():
        for pattern, style in base.items():
            if style in styles and fnmatch.fnmatch(name, f"model.{pattern}"):
                if hasattr(module, "get_base_layer"):  # a LoRA layer (unison.lora): its base, at .base_layer
                    name, module = f"{name}.base_layer", module.base_layer
                if not isinstance(module, torch.nn.Linear):
                    raise ValueError(f"{name}: tensor parallelism shards nn.Linear projections, not "
                                     f"{type(module).__name__}")
                plan[name] = styles[style]()
    parallelize_module(model, mesh, plan)
    return model


def local_forward(model: torch.nn.Module, topology: Topology | None) -> Callable[..., AbstractContextManager]:
    """What the engine's and the training step's forwards run under: ``LocalForward(model)`` with tensor
    parallelism, else a context that changes nothing (``with local_forward(model, None)(train=True):``). A sharded
    model without a tensor-parallel topology is refused (it would run, slowly, through DTensor's dispatch)."""
    if topology is not None and topology.tp is not None:
        return LocalForward(model)
    if sharded_linears(model):
        raise ValueError(f"{type(model).__name__} is sharded for tensor parallelism: pass its topology")
    return _whole_model


@contextmanager
def _whole_model(train: bool = False) -> Iterator[int]:
    yield 0


def sharded_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, str]]:
    """The projections ``parallelize`` sharded, each with its style: a weight sharded along its output rows is
    column-wise (``Shard(0)``), along its input columns row-wise (``Shard(1)``)."""
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or not isinstance(weight, DTensor):
            continue
        placement = weight.placements[-1]
        if placement == Shard(0):
            found.append((module, "colwise"))
        elif placement == Shard(1):
            found.append((module, "rowwise"))
        else:
            raise ValueError(f"{name}: a tensor-parallel weight placed {placement}, neither column- nor row-wise")
    return found


class LocalForward:
    """``with LocalForward(model)():`` every projection ``parallelize`` sharded computes on its local shard as
    a plain tensor: a column-wise one is ``F.linear`` with its rows of the weight (the output stays split along the
    last dimension, as the style's local output is), a row-wise one a partial product with its columns, summed over
    the tp group by one all-reduce in fp32 and rounded once (``rowwise_reduce``), plus the bias.

    That is what DTensor's hooks compute, minus their per-call dispatch and sharding propagation, which cost more
    than a decode step itself: a 1.7B shape under tp=2 decoded at ~0.6 s per step on two H200s; a 4-layer model's
    decode step on the CPU took 104 ms through DTensor, 31 ms this way and 13-16 ms in one process.

    ``train=True`` (the training step) keeps autograd: the weights are read through ``to_local()`` on every call,
    so their gradients land on the DTensor parameters as DTensor shards, a column-wise input's gradient is summed
    over the group in the backward, and a row-wise projection's input gradient stays local. Without it (the
    engine's forwards, no autograd) the local tensors are looked up on entry; in-place updates show either way.
    """

    def __init__(self, model: torch.nn.Module):
        self.modules = sharded_linears(model)
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel projections: shard it with "
                             "unison.dist.tensor_parallel.parallelize first")
        weight = self.modules[0][0].weight
        self._group = weight.device_mesh.get_group()
        self._beat = torch.zeros(1, device=weight.device)

    def heartbeat(self) -> None:
        """One eager one-element all-reduce over the tp group, after each decode-graph replay. torch's NCCL watchdog
        tracks only the collectives it issued, not the all-reduces inside a replayed graph: a peer that dies
        mid-replay left this rank waiting on the graph forever (seen on two H200s, tests/test_dead_peer_gpu.py).
        The watchdog times this one out after ``dist.timeout_s`` and ends the process with an error naming it."""
        dist.all_reduce(self._beat, group=self._group)

    @contextmanager
    def __call__(self, train: bool = False) -> Iterator[int]:
        saved = []
        with torch.no_grad():
            for module, style in self.modules:
                state = module.__dict__  # directly: nn.Module.__setattr__ costs more than the swap itself
                saved.append((state["_forward_pre_hooks"], state["_forward_hooks"], state.get("forward")))
                state["_forward_pre_hooks"], state["_forward_hooks"] = OrderedDict(), OrderedDict()
                state["forward"] = (_training_linear if train else _local_linear)(module, style)
        try:
            yield len(saved)
        finally:
            for (module, _), (pre, post, own) in zip(self.modules, saved, strict=True):
                state = module.__dict__
                state["_forward_pre_hooks"], state["_forward_hooks"] = pre, post
                if own is None:
                    del state["forward"]
                else:
                    state["forward"] = own


def rowwise_reduce(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``x @ weight.T`` summed over ``group``, where each rank holds a slice of the inner dimension: the partial
    products stay in fp32 through the all-reduce and are rounded to ``x.dtype`` once, as one process rounds its one
    fp32-accumulated product. Reducing bf16 partials instead rounds three times, in ways that differ between the
    engine's and the trainer's kernels: their mean logprob difference grew ~7% under tp=2 on two H200s and ~10% on
    the CPU (bench/tp_rounding.py)."""
    y = _fp32_product(x.reshape(-1, x.shape[-1]), weight)
    dist.all_reduce(y, group=group)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def _fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(M, K) @ (N, K).T accumulated and returned in fp32 (bf16 inputs on a GPU: cuBLAS writes its fp32
    accumulator out, ``torch.mm(..., out_dtype=)``, torch >= 2.8)."""
    if x.dtype == torch.float32:
        return x @ weight.T
    if x.is_cuda and _mm_writes_fp32(x.device):
        return torch.mm(x, weight.T, out_dtype=torch.float32)
    return x.float() @ weight.float().T  # exact upcasts: the same products, accumulated in fp32


@functools.cache
def _mm_writes_fp32(device: torch.device) -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _local_linear(module: torch.nn.Linear, style: str) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, bias = local(module.weight), local(module.bias) if module.bias is not None else None
    if style == "colwise":
        return lambda x: F.linear(x, weight, bias)
    group = module.weight.device_mesh.get_group()

    def rowwise(x: torch.Tensor) -> torch.Tensor:
        y = rowwise_reduce(x, weight, group)
        return y if bias is None else y + bias
    return rowwise


def _training_linear(module: torch.nn.Linear, style: str) -> Callable[[torch.Tensor], torch.Tensor]:
    group = module.weight.device_mesh.get_group()

    def colwise(x: torch.Tensor) -> torch.Tensor:
        bias = module.bias.to_local() if module.bias is not None else None
        return F.linear(_SumGradOverGroup.apply(x, group), module.weight.to_local(), bias)

    def rowwise(x: torch.Tensor) -> torch.Tensor:
        y = _RowwiseLinear.apply(x, module.weight.to_local(), group)
        return y if module.bias is None else y + module.bias.to_local()
    return colwise if style == "colwise" else rowwise


class _SumGradOverGroup(torch.autograd.Function):
    """The input of a column-wise projection: the same on every rank going forward; going backward each rank's
    gradient covers only its output columns, so they are summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _RowwiseLinear(torch.autograd.Function):
    """``rowwise_reduce`` with its gradients: the output's gradient is the same on every rank, so the input's (this
    rank's slice) and the weight's (this rank's columns) need no collective."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return rowwise_reduce(x, weight, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad2d @ weight).view_as(x)
        grad_w = grad2d.T @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None


def partial_grad_names(model: torch.nn.Module) -> list[str]:
    """Parameters whose gradient on each rank covers only that rank's heads (to be summed across ranks)."""
    patterns = [f"model.{key}" for key, style in _base_plan(model).items() if style == PARTIAL_GRAD]
    return [name for name, _ in model.named_parameters()
            if any(fnmatch.fnmatch(name.rsplit(".", 1)[0], p) for p in patterns)]


def digest(samples) -> str:
    h = hashlib.blake2b(digest_size=16)
    for s in samples:
        h.update(repr((s.prompt_ids, s.completion_ids, s.reward)).encode())
    return h.hexdigest()


def check_ranks_agree(samples, tp: Ranks) -> None:
    """Raise if any rank rolled out other samples than rank 0 (a divergence would desynchronise the
    collectives of the next forward)."""
    agree_with_rank0(digest(samples), tp, "tensor-parallel ranks {} rolled out other samples than rank 0")


class BroadcastScorer(WrappedScorer):
    """A reward scorer that runs on rank 0 only; the other ranks receive its results."""

    def __init__(self, inner, tp: Ranks):
        super().__init__(inner)
        self.tp = tp

    def missing_report(self) -> str | None:
        """Rank 0's report; None on the other ranks (rank 0 scores, and its error names what was missing)."""
        return self.inner.missing_report() if self.tp.is_main else None

    def score(self, *args, **kwargs):
        return on_main(self.tp, lambda: self.inner.score(*args, **kwargs))


def host_ranks(topology: Topology) -> Ranks | None:
    """This rank's tensor-parallel group again, as a gloo group: ``on_main`` over it moves host objects without
    waiting for the device (over NCCL an object broadcast is a device copy the host waits for, behind the decode step
    in flight). A collective: every process calls it. None without tensor parallelism."""
    if topology.tp is None:
        return None
    layout = topology.mesh.mesh.reshape(-1, topology.tp.world).tolist()  # (dp, tp): a row per tensor-parallel group
    group, _ = dist.new_subgroups_by_enumeration(layout, backend="gloo")
    return Ranks(topology.tp.rank, topology.tp.world, torch.device("cpu"), group)


_ANY = object()


def on_main(tp: Ranks | None, fn: Callable[[], object], empty: object = _ANY):
    """``fn()`` run on rank 0 of the group alone, its result sent to every rank (a collective: all ranks call it, in
    the same order). What a user's code returns there (tool replies, an environment's observations) is then the same
    on every rank, and runs once. Where ``fn`` raises, rank 0 raises it and the others a ``RuntimeError`` naming it,
    rather than waiting for a result that never comes. Without a group (None), just ``fn()``. ``empty``: a result
    that rank 0 sends as a size of 0 alone (one collective, where a result takes two): the episode loop's "no reply
    is in", most steps' answer."""
    if tp is None:
        return fn()
    result, error = None, None
    if tp.is_main:
        try:
            result = (True, fn())
        except Exception as e:
            error, result = e, (False, f"{type(e).__name__}: {e}")
    skip = tp.is_main and empty is not _ANY and result == (True, empty)
    ok, value = _from_main(result, skip, tp) or (True, empty)
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError(f"tensor-parallel rank 0 failed where this rank waited for its result: {value}")
    return value


def _from_main(obj: object, skip: bool, tp: Ranks) -> object | None:
    """Rank 0's ``obj`` on every rank, pickled, as its size and then its bytes (``broadcast_object_list``'s two
    collectives, on the device NCCL needs); where rank 0 says ``skip``, the size 0 alone, and None on every rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(tp.group) == "nccl" else \
        torch.device("cpu")
    src = dist.get_global_rank(tp.group, 0)
    data = pickle.dumps(obj) if tp.is_main and not skip else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=tp.group)
    n = int(size.item())
    if n == 0:
        return None
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if tp.is_main
               else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(payload, src=src, group=tp.group)
    return obj if tp.is_main else pickle.loads(payload.cpu().numpy().tobytes())


def full_state_dict(model: torch.nn.Module, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` whole (those whose name ``keep`` accepts), on every rank (a collective: all ranks
    call it, with the same ``keep``)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
            if keep is None or keep(k)}


def replicated_agree(model: torch.nn.Module, tp: Ranks) -> None:
    """Raise if a replicated parameter differs from rank 0's (they must stay identical)."""
    agree_with_rank0({name: checksum(p) for name, p in model.named_parameters() if not isinstance(p, DTensor)}, tp,
                     "tensor-parallel ranks {} hold replicated parameters that differ from rank 0's")


class BroadcastEngine:
    """The engine protocol for a tensor-parallel group that generates on `unison serve` servers: rank 0 talks to them
    (``inner``, a ``RemoteEngine``; None on the other ranks) and every call's result is broadcast, so all ranks of the
    group see the same samples, in the same steps, and take the same decisions on them."""

    def __init__(self, inner, tp: Ranks):
        self.inner, self.tp = inner, tp
        self.version = 0
        self._live: set[str] = set()  # submitted request ids not out of step() yet: num_unfinished on every rank

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def _from_rank0(self, call):
        """``call()`` on rank 0, its result (or the exception it raised) on every rank."""
        box = [None]
        if self.tp.is_main:
            try:
                box[0] = ("ok", call())
            except Exception as e:  # raised on every rank alike
                box[0] = ("error", e)
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp.group, 0), group=self.tp.group)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def submit(self, prompt_ids, params=None) -> list[str]:
        ids = self._from_rank0(lambda: self.inner.submit(prompt_ids, params))
        self._live.update(ids)
        return ids

    def step(self):
        done = self._from_rank0(lambda: self.inner.step())
        self._live.difference_update(c.request_id for c in done)
        return done

    def abort(self, request_ids) -> int:
        request_ids = list(request_ids)
        return self._from_rank0(lambda: self.inner.abort(request_ids))

    def weights_updated(self, version: int) -> None:
        self.version = version
        if self.inner is not None:
            self.inner.weights_updated(version)

    @contextmanager
    def lend(self) -> Iterator[int]:
        yield 0  # the servers' memory is theirs
