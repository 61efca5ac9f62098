"""A parallel layout applied with torch's own APIs, on a rank or in a planner process.

``mesh.parallelize`` runs :func:`build` on every rank with the mesh's real process group;
``mesh.plan`` runs the same :func:`build` in throwaway planner processes on a fake process
group under fake tensors, and measures what it allocates and sends. One code path for both is
what makes a prediction trustworthy: the planner traces exactly the modules, wrappers and
optimizer the ranks will hold.

The order is torchtitan's: the model is built with its parameters on the meta device (buffers
real, they are small and often computed), cut to this rank's pipeline stage, tensor-parallel
linears are sharded (``parallelize_module``), blocks are checkpointed, then sharded or
replicated block by block and at the root (``fully_shard`` / ``replicate``), and only then are
parameters allocated (``to_empty``) and filled, each rank its own part.

Filled from the plain model: ``factory()`` built again, on the CPU, and initialised as plain
torch would after ``manual_seed(seed)``; each rank copies its part of every parameter it holds
(its shard, its stage's). So a seed gives one model whatever the layout, the plain one (DDP,
FSDP, TP and PP start from the same weights), where initialising the sharded parameters in
place drew every CPU shard from the same stream (FSDP's shards started equal) and every
pipeline stage from the seed's start (stages began with the same weights). The cost: the
plain model's parameters in CPU memory once per host while it starts (its first rank builds
it and writes it into shared memory, twice while it writes, and every rank maps that file).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..protocol import config
from ..protocol.cell import frames_of
from ..protocol.errors import MeshError
from ..protocol.layout import (
    OPTIMIZERS,
    Layout,
    ModelFacts,
    split_points,
    stage_of,
    why_not_optimizer,
    why_unbuildable,
)
from ..protocol.payload import Payload, pack
from ..protocol.text import format_bytes
from . import torch_compat

#: Linear layers sharded by output (their input is replicated) and by input (their output is
#: summed across the tp ranks): the names Llama, Mistral, GPT-NeoX and most MLPs use.
COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "w1", "w3", "c_fc",
                     "query", "key", "value", "wq", "wk", "wv", "up", "fc_in", "dense_h_to_4h"})
ROWWISE = frozenset({"o_proj", "down_proj", "fc2", "w2", "out_proj", "c_proj", "wo", "down", "fc_out",
                     "dense_4h_to_h", "dense"})
#: Attributes (on a block's modules, or the model's ``config``) that count attention heads.
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_key_value_heads", "n_kv_heads")
OPTIMIZER_CLASSES = dict(zip(OPTIMIZERS, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)))
#: Layers that read a model's input: the first of them says what a batch is (token ids for an
#: embedding, features for a linear; for the others, plan makes none).
INPUT_LAYERS = (nn.Embedding, nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d, nn.RNNBase)


# -- reading a model ---------------------------------------------------------------------------


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a module with parameters on the meta device and buffers real (a causal mask or
    rotary table is computed in ``__init__`` and small; ``to_empty`` would lose it)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def make(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` with its parameters on the meta device, or a :class:`MeshError` saying why not."""
    try:
        with parameters_on_meta():
            model = factory()
    except Exception as exc:
        where = ""
        frame = next((f for f in reversed(frames_of(exc.__traceback__)) if not f.in_torch), None)
        if frame is not None:
            # Sent by value, the build's code has no file here (cloudpickle's "<dynamic-code>"):
            # its line, as numbered where it was defined, and its function say where.
            place = f"line {frame.lineno}" if frame.filename.startswith("<") else frame.where
            where = f" at {place}, in {frame.name}" + (f" ({frame.line})" if frame.line else "")
        raise MeshError(f"build() failed on the meta device{where}: {type(exc).__name__}: {exc} "
                        "(build must construct the model without reading parameter values)") from exc
    if not isinstance(model, nn.Module):
        raise MeshError(f"build() must return an nn.Module, not a {type(model).__name__}")
    return model


def block_class(model: nn.Module) -> tuple[str | None, int]:
    """The class of the model's repeated blocks (the most common class among the children of
    one container, at least two) and how many there are."""
    best: tuple[str | None, int] = (None, 0)
    for module in model.modules():
        counts = Counter(type(c).__name__ for c in module.children() if any(True for _ in c.parameters()))
        for name, n in counts.items():
            if n >= 2 and n > best[1] and name not in ("Linear", "Embedding"):
                best = (name, n)
    return best


def blocks_of(model: nn.Module, cls: str | None) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, block)`` of every block of class ``cls``, outermost ones only (a block
    wrapped for checkpointing counts as its wrapper)."""
    if cls is None:
        return []
    found = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(getattr(child, "_checkpoint_wrapped_module", child)).__name__ == cls:
                found.append((parent, name, child))
            else:
                visit(child)

    visit(model)
    return found


def tp_linears(block: nn.Module) -> dict[str, str]:
    """The block's linears tensor parallelism shards: ``{path: "colwise" | "rowwise"}``."""
    plan = {}
    for path, module in block.named_modules():
        if isinstance(module, nn.Linear):
            last = path.rsplit(".", 1)[-1]
            if last in COLWISE:
                plan[path] = "colwise"
            elif last in ROWWISE:
                plan[path] = "rowwise"
    return plan


def inspect(model: nn.Module) -> ModelFacts:
    """What :func:`meshbook.mesh.protocol.layout.candidates` needs to know of ``model``."""
    params = list(model.parameters())
    cls, n_blocks = block_class(model)
    blocks = blocks_of(model, cls)
    tp_reason, divides = _tp_facts(model, blocks)
    first = next((m for m in model.modules() if isinstance(m, INPUT_LAYERS)), None)  # what reads the input
    return ModelFacts(
        cls=type(model).__name__,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        blocks=cls, n_blocks=len(blocks),
        stages=len(model) if isinstance(model, nn.Sequential) else 0, pp_reason=_pp_reason(model),
        piece_params=tuple(sum(p.numel() for p in piece.parameters()) for piece in model)
        if isinstance(model, nn.Sequential) else (),
        tp_reason=tp_reason, tp_divides=divides,
        vocab=first.num_embeddings if isinstance(first, nn.Embedding) else None,
        in_features=first.in_features if isinstance(first, nn.Linear) and first.in_features else None)


def _unsplit_feeds(block: nn.Module, plan: dict[str, str]) -> str:
    """Why tensor parallelism cannot split ``block`` though its linears have known names: a
    row-wise one (``attn.c_proj``) whose module splits no linear by columns (nanoGPT's fused
    ``c_attn``) would take whole inputs where it expects its shard (the trace then fails, as
    INVALID, with a shape error)."""
    for path, kind in plan.items():
        parent = path.rpartition(".")[0]
        if kind != "rowwise" or any(plan.get(p) == "colwise" for p in plan if p.rpartition(".")[0] == parent):
            continue
        owner = block.get_submodule(parent) if parent else block
        others = [f"{parent}.{n}" if parent else n for n, m in owner.named_children()
                  if isinstance(m, nn.Linear) and (f"{parent}.{n}" if parent else n) not in plan]
        return (f"the linears that feed {path} split by columns, as q_proj/k_proj/v_proj are; "
                f"{', '.join(others) or 'none'} beside it {'is' if len(others) == 1 else 'are'} not "
                f"(a fused projection, such as c_attn or wqkv, is not split)")
    return ""


def _pp_reason(model: nn.Module) -> str:
    if not isinstance(model, nn.Sequential):
        return f"a model that is a sequence of stages (nn.Sequential); {type(model).__name__} is not"
    owner: dict[int, int] = {}
    for i, piece in enumerate(model):
        for p in piece.parameters():
            if owner.setdefault(id(p), i) != i:
                return f"no weights shared between pieces ({i} shares one with {owner[id(p)]}: tied weights)"
    return ""


def _tp_facts(model: nn.Module, blocks: list[tuple[nn.Module, str, nn.Module]]) -> tuple[str, tuple]:
    if not blocks:
        return "repeated blocks (a ModuleList of one class); none found", ()
    plan = tp_linears(blocks[0][2])
    kinds = set(plan.values())
    if kinds != {"colwise", "rowwise"}:
        names = ", ".join(sorted(ROWWISE | COLWISE)[:6])
        return (f"linears named as in Llama or GPT ({names}, ...) in each {blocks[0][2].__class__.__name__}; "
                f"found {sorted(plan) or 'none'}"), ()
    block = blocks[0][2]
    unsplit = _unsplit_feeds(block, plan)
    if unsplit:
        return unsplit, ()
    sizes: dict[str, int] = {}
    for path, kind in plan.items():
        linear = block.get_submodule(path)
        assert isinstance(linear, nn.Linear)
        sizes[f"{path} {'outputs' if kind == 'colwise' else 'inputs'}"] = (
            linear.out_features if kind == "colwise" else linear.in_features)
    sources = [m for m in block.modules()] + [getattr(model, "config", None)]
    for attr in HEAD_ATTRS:
        for source in sources:
            value = getattr(source, attr, None)
            if isinstance(value, int) and value > 0:
                sizes[attr.replace("_", " ")] = value
                break
    return "", tuple(sizes.items())


# -- applying a layout ----------------------------------------------------------------------


@dataclass
class Built:
    """What :func:`build` made on this rank: its part of the model, its optimizer, and
    :meth:`step` (forward, loss, backward, optimizer step; the pipeline schedule when pp > 1)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layout: Layout
    stage: int = 0
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    schedule: Any = None
    steps: int = field(default=0)
    #: The pipeline's last stage was given no targets: its loss ignores the placeholder.
    targetless: bool = False

    @property
    def last(self) -> bool:
        return self.stage == self.layout.pp - 1

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor | None:
        """One training step on this rank's batch. The loss comes back on the ranks that
        compute it (every rank, or the last pipeline stage); ``None`` elsewhere."""
        if self.schedule is None:
            return self.local_step(inputs, targets)[0]
        loss = self._pipeline_step(inputs, targets)
        self._update()
        return loss

    def local_step(self, inputs: Any, targets: Any = None,
                   after_forward: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, Any]:
        """Forward, backward and the optimizer step of this rank's module alone: the whole
        step without pipelining, and what the planner traces of a stage (one micro-batch; a
        stage before the last back-propagates ones). The output goes before the backward, as
        in any training step; its (shape, dtype) comes back for the next stage's trace."""
        out = self.model(inputs)
        meta = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else None
        loss = self.loss(out, targets) if self.last else None
        if after_forward is not None:
            after_forward()  # what waits for the backward: the output, and the loss's graph
        if loss is not None:
            del out
            loss.backward()
        else:
            out.backward(torch.ones_like(out))
            del out
        self._update()
        return (None if loss is None else loss.detach()), meta

    def loss(self, out: Any, targets: Any) -> torch.Tensor:
        return (self.loss_fn or default_loss)(out, None if self.targetless else targets)

    def _update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def _pipeline_step(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        self._check_splits(inputs)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.last:
            # torch's last stage needs a target to split into micro-batches: one placeholder
            # per micro-batch where the loss takes none (it would refuse, and the other stages
            # would wait in recv for the collective timeout).
            self.targetless = targets is None
            placeholder = torch.zeros(self.layout.microbatches, device=next(self.model.parameters()).device)
            kwargs = {"target": placeholder if self.targetless else targets, "losses": losses}
        args = (inputs,) if self.stage == 0 else ()
        self.schedule.step(*args, return_outputs=False, **kwargs)  # the loss comes back in losses
        return torch.stack(losses).mean().detach() if self.last and losses else None


    def _check_splits(self, inputs: Any) -> None:
        """Every stage is handed the batch (only the first feeds it): each refuses, at once, one
        the schedule would split into micro-batches of different sizes. Only the first and last
        stages would fail there, while the others waited in recv for the collective timeout."""
        micro = self.layout.microbatches
        batch = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() else None
        if batch is not None and batch % micro:
            raise ValueError(f"a batch of {batch} does not split into {micro} equal micro-batches, as the pipeline "
                             f"needs: pass a batch that is a multiple of {micro}, or parallelize with "
                             f"Layout(pp={self.layout.pp}, microbatches=...) that divides it")


def default_loss(out: Any, targets: Any) -> torch.Tensor:
    """A model's own loss (``out.loss``), cross-entropy against integer targets, mean squared
    error against float targets, or (no targets) the mean square of the output."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(out, "logits", out)
    if targets is None:
        return logits.float().pow(2).mean()
    if not targets.is_floating_point():
        return nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    return nn.functional.mse_loss(logits.float(), targets.float())


def layout_mesh(layout: Layout, device_type: str) -> Any:
    """The DeviceMesh of ``layout``'s named dimensions over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = layout.dims
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


class RankMeshes:
    """This rank's DeviceMesh for each layout's dims, made once per world process group (a
    restart makes a new one). Made again, a mesh would make new process groups each time; and
    destroying a mesh's groups is unsafe while an equal mesh lives, as DTensor's caches hand
    out equal meshes interchangeably."""

    def __init__(self) -> None:
        self.world: Any = None
        self.meshes: dict[tuple[str, tuple[tuple[str, int], ...]], Any] = {}

    def get(self, layout: Layout, device_type: str) -> Any:
        import torch.distributed as dist

        if self.world is not dist.group.WORLD:
            self.world, self.meshes = dist.group.WORLD, {}
        key = (device_type, tuple(layout.dims.items()))
        if key not in self.meshes:
            self.meshes[key] = layout_mesh(layout, device_type)
        return self.meshes[key]


MESHES = RankMeshes()


def mesh_for(own: Any, dims: dict[str, int], layout: Layout, device_type: str) -> Any:
    """The DeviceMesh ``layout`` runs on: the mesh's own (``own``, made at start) when the mesh
    was started with the layout's dims in the layout's order, else this rank's for those dims
    (:data:`MESHES`)."""
    same = list(dims.items()) == list(layout.dims.items())  # an order is a different grouping
    return own if same else MESHES.get(layout, device_type)


def build(factory: Callable[[], nn.Module], layout: Layout, device_mesh: Any, rank: int, *,
          device: Any = "cpu", optimizer: Any = "adamw", lr: float = 1e-3, seed: int = 0,
          init: Callable[[nn.Module], None] | None = None,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
          materialize: Callable[[nn.Module], None] | None = None, host: Host | None = None,
          step_device: str | None = None) -> Built:
    """Build this rank's part of ``factory()`` laid out as ``layout`` on ``device_mesh``.

    ``materialize`` replaces allocation and filling (the planner allocates under fake tensors,
    on the CPU, for ranks whose optimizer steps on ``step_device``: see :func:`make_optimizer`);
    else every parameter and buffer is filled from the plain model of ``seed`` (:func:`fill`),
    built once per host when ``host`` says where this rank runs (every rank builds at once).
    """
    with own_random_state(device):  # a build's own draws (a random buffer) leave the rank's alone
        model = make(factory)
    facts = inspect(model)
    reason = why_unbuildable(layout, facts)
    if reason:  # applied anyway, tensor parallelism without blocks shards nothing: each rank trains alone
        raise MeshError(f"{layout.describe()} cannot run this model: {reason} (mesh.plan lists the layouts that can)")
    plain = list(model.modules())  # before the stage's cut and the wrappers: the plain model's
    cls = facts.blocks
    stage = stage_of(layout, rank)
    if layout.pp > 1:
        model = stage_module(model, layout, stage)
    if layout.tp > 1:
        apply_tp(model, cls, device_mesh["tp"])
    if layout.checkpointing != "none":
        apply_checkpointing(model, cls, every=1 if layout.checkpointing == "block" else 2)
    apply_dp(model, cls, layout, device_mesh)
    if materialize is not None:
        materialize(model)
    else:
        allocate(model, device)
        fill(model, plain, factory, seed, init, device, host)
    opt = make_optimizer(optimizer, model, lr, step_device or torch.device(device).type)
    built = Built(model, opt, layout, stage=stage, loss_fn=loss_fn)
    if layout.pp > 1:
        built.schedule = make_schedule(model, layout, stage, device_mesh["pp"].get_group(), device, built.loss)
    return built


def stage_module(model: Any, layout: Layout, stage: int) -> nn.Module:
    """Stage ``stage`` of a sequential model: its slice of the children, split as evenly as
    the pieces go."""
    start, stop = split_points(len(model), layout.pp)[stage]
    return nn.Sequential(*list(model.children())[start:stop])


def apply_tp(model: nn.Module, cls: str | None, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for _, _, block in blocks_of(model, cls):
        plan = {path: styles[kind]() for path, kind in tp_linears(block).items()}
        parallelize_module(block, tp_mesh, plan)


def apply_checkpointing(model: nn.Module, cls: str | None, every: int) -> None:
    for i, (parent, name, block) in enumerate(blocks_of(model, cls)):
        if i % every == 0:
            parent.register_module(name, torch_compat.checkpoint_wrapper(block))


def apply_dp(model: nn.Module, cls: str | None, layout: Layout, device_mesh: Any) -> None:
    """Shard (``fully_shard``; HSDP over two dims) or replicate each block, then the root."""
    if layout.dp == 1:
        return
    from torch.distributed.fsdp import fully_shard

    if layout.dp_shard > 1:
        names = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        dp_mesh = device_mesh[names]

        def wrap(module: nn.Module, last: bool) -> None:
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=layout.reshard and not last)
    else:
        dp_mesh = device_mesh["dp_replicate"]

        def wrap(module: nn.Module, last: bool) -> None:
            torch_compat.replicate(module, dp_mesh)

    blocks = [block for _, _, block in blocks_of(model, cls)]
    for i, block in enumerate(blocks):
        wrap(block, last=i == len(blocks) - 1)
    wrap(model, last=True)


def allocate(model: nn.Module, device: Any) -> None:
    """Storage for the parameters on ``device`` (uninitialised), buffers kept."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def fill(model: nn.Module, plain: list[nn.Module], factory: Callable[[], nn.Module], seed: int,
         init: Callable[[nn.Module], None] | None, device: Any = "cpu", host: Host | None = None) -> None:
    """Every parameter and buffer this rank holds in ``model``, from the plain model
    (:func:`plain_model`; with ``host``, built once on this host, :func:`plain_tensors`).
    ``plain``: ``model``'s modules as built, before any cut or wrapper, in the order the plain
    model lists its own."""
    held = {id(module) for module in model.modules()}
    with plain_tensors(factory, seed, init, device, host) as twins:
        if len(twins) != len(plain):
            raise MeshError(f"build() made {len(twins)} modules once and {len(plain)} another time: it must build "
                            "the same model every time it is called")
        with torch.no_grad():
            for mine, tensors in zip(plain, twins):
                if id(mine) in held:
                    for name, value in tensors.items():
                        _fill(getattr(mine, name), value)


def plain_model(factory: Callable[[], nn.Module], seed: int, init: Callable[[nn.Module], None] | None,
                device: Any) -> list[dict[str, torch.Tensor]]:
    """The plain model's own parameters and buffers, module by module in the order it lists
    them: ``factory()`` after ``torch.manual_seed(seed)``, as a user would build it (on the CPU
    unless the factory says otherwise), then ``init(model)`` if given. A factory that builds on
    the meta device is allocated on the CPU and initialised with :func:`initialise` (or
    ``init``). This rank's random state is left as it was: ``parallelize`` must not give every
    rank the same batches and dropout masks from then on."""
    with own_random_state(device):
        torch.manual_seed(seed)
        reference = factory()
        with torch.no_grad():
            if any(t.is_meta for t in (*reference.parameters(), *reference.buffers())):
                reference.to_empty(device="cpu")
                if init is None:
                    initialise(reference)
            if init is not None:
                init(reference)
    return [dict((*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)))
            for module in reference.modules()]


@dataclass(frozen=True)
class Host:
    """Where a rank runs: its host's index (torchrun's ``GROUP_RANK``), and whether it is the
    host's first rank (``LOCAL_RANK`` 0), the one that builds the plain model for them all."""

    index: int
    first: bool


@contextlib.contextmanager
def plain_tensors(factory: Callable[[], nn.Module], seed: int, init: Callable[[nn.Module], None] | None,
                  device: Any, host: Host | None) -> Iterator[list[dict[str, torch.Tensor]]]:
    """The plain model's tensors (:func:`plain_model`), for the block.

    With ``host`` (every rank of the process group at once: it gathers), the host's first
    rank builds it and writes it once into a memfd (:func:`~..protocol.payload.pack`), and every
    rank of the host maps that file: one copy of a model per host while it starts (two while
    the builder writes it), where a build on each rank held one per rank (eight ranks of a
    host filling a 7B model: 28 GB, not 224). A build that fails there fails on every rank of
    the host, saying where.
    """
    import torch.distributed as dist

    if host is None or not dist.is_initialized() or dist.get_world_size() == 1:
        yield plain_model(factory, seed, init, device)
        return
    with contextlib.ExitStack() as stack:
        offer: Payload | str | None = None
        if host.first:
            try:
                values = {"plain": plain_model(factory, seed, init, device)}
                offer = stack.enter_context(pack(values, shared=True, what="the plain model", least=0))
                del values  # the file holds them now
            except Exception as exc:  # noqa: BLE001 - said on every rank of the host, below
                offer = f"{type(exc).__name__}: {exc}"
        offers: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(offers, (host.index, offer))
        builder, mine = next((r, o) for r, (h, o) in enumerate(offers) if h == host.index and o is not None)
        if isinstance(mine, str):
            raise MeshError(f"build() failed on rank {builder}, which builds the plain model for its host: {mine}")
        try:
            values, release = mine.open("the plain model")
        except Exception as exc:  # noqa: BLE001 - a file this rank cannot map: it builds its own, below
            print(f"meshbook: cannot map the plain model rank {builder} built ({type(exc).__name__}: {exc}); "
                  f"this rank builds its own copy", file=sys.stderr)
            values, release = {}, lambda: True
        dist.barrier()  # every rank of the host mapped the file: its builder may close it
    try:
        yield values["plain"] if values else plain_model(factory, seed, init, device)
    finally:
        del values
        release()


@contextlib.contextmanager
def own_random_state(device: Any) -> Iterator[None]:
    """This rank's random state (the CPU's, and its GPU's) as it was before the block."""
    device = torch.device(device)
    gpu = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpu):
        yield


def _fill(held: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``held``: all of it, or a DTensor's local piece
    (FSDP's shard, a tensor-parallel slice, both)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(held, DTensor):
        held.copy_(full)
        return
    shape, offset = torch_compat.local_piece(full.shape, held.device_mesh, held.placements)
    held.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


def initialise(model: nn.Module) -> None:
    """A model's own initialisation: Hugging Face's ``_init_weights`` for each module, else
    each module's ``reset_parameters``. A parameter neither reaches would hold whatever memory
    held: a :class:`MeshError` names its module instead."""
    own = getattr(model, "_init_weights", None)
    if callable(own):
        model.apply(own)
        return
    missed = set()
    for module in model.modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        reset = getattr(getattr(module, "_checkpoint_wrapped_module", module), "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            missed.add(type(module).__name__)
    if missed:
        raise MeshError(f"{', '.join(sorted(missed))} {'has' if len(missed) == 1 else 'have'} parameters and no "
                        "reset_parameters(): give parallelize(..., init=fn), fn(model) setting every parameter")


def make_optimizer(optimizer: Any, model: nn.Module, lr: float, device_type: str) -> torch.optim.Optimizer:
    """A named optimizer with torch's default implementation for ``device_type`` (on CUDA, the
    multi-tensor one, whose step holds temporaries the size of the parameters; elsewhere a loop
    over them) chosen explicitly, so that the planner, tracing on the CPU, steps as the ranks
    will. The multi-tensor step cannot take plain tensors beside DTensors (tensor parallelism
    without FSDP leaves embeddings and norms plain: torch's own default failed at the first
    step on CUDA), so such a model steps in a loop. A callable builds the user's own, as it is."""
    if callable(optimizer) and not isinstance(optimizer, str):
        return optimizer(model.parameters())
    cls = OPTIMIZER_CLASSES.get(str(optimizer).lower())
    if cls is None:
        raise MeshError(why_not_optimizer(optimizer))
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    one_kind = len({isinstance(p, DTensor) for p in params}) < 2
    return cls(params, lr=lr, foreach=device_type == "cuda" and one_kind)


def make_schedule(stage_mod: nn.Module, layout: Layout, stage: int, group: Any, device: Any,
                  loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules

    from ..protocol.layout import SCHEDULES

    pipe_stage = pipelining.PipelineStage(stage_mod, stage, layout.pp, torch.device(device), group=group)
    cls = getattr(schedules, SCHEDULES[layout.schedule])
    return cls(pipe_stage, n_microbatches=layout.microbatches, loss_fn=loss_fn)


def example_batch(facts: ModelFacts, shape: tuple[int, ...], layout: Layout, device: Any = "cpu",
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch of ``shape`` (the global batch first) cut to one data-parallel rank: token ids
    and next tokens where the model starts with an embedding, else floats with no targets."""
    local = (shape[0] // layout.dp, *shape[1:])
    if facts.vocab is not None:
        tokens = torch.randint(0, facts.vocab, (local[0], *local[1:]), device=device, generator=generator)
        return tokens, tokens.clone()
    if facts.in_features is None:
        raise MeshError("mesh.plan makes its batch from the model's first layer, an nn.Embedding (token ids) "
                        "or an nn.Linear (features), and this model starts with neither: plan a model that "
                        "does, or apply a layout yourself with mesh.parallelize(build, Layout(...))")
    return torch.randn((*local, facts.in_features), device=device, generator=generator), None


# -- measuring on a rank -------------------------------------------------------------------


#: glibc's ``mallopt`` parameter for the size above which a block is mapped on its own.
M_MMAP_THRESHOLD = -3


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold (``MESHBOOK_CPU_MMAP_THRESHOLD``), so tensors a step frees
    go back to the system and a CPU rank's peak RSS is what was live, as a plan predicts.
    glibc's default starts at 128 KiB but slides up to 32 MiB with every large block freed,
    after which freed activations stay in the heap: a peak no tracker sees. False where libc
    is not glibc, or the variable is 0."""
    import ctypes
    import ctypes.util

    threshold = config.cpu_mmap_threshold()
    if threshold <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def settle_allocator(device: Any) -> None:
    """On a CPU rank, the allocator a plan predicts (:func:`return_freed_memory`)."""
    if torch.device(device).type == "cpu":
        return_freed_memory()


def apply(namespace: dict[str, Any], rank: int, meshes: Callable[[Layout, str], Any],
          factory: Callable[[], nn.Module], layout: Layout, predicted: dict[int, int], predicted_s: float,
          names: tuple[str, str, str], options: dict[str, Any], host: Host | None = None) -> str:
    """``mesh.parallelize`` on one rank: build its part of ``factory()`` as ``layout`` on the
    DeviceMesh ``meshes(layout, device_type)`` gives (:func:`mesh_for`) and bind model,
    optimizer and step in ``namespace`` (the plain model built once per ``host``, see
    :func:`plain_tensors`). What those names held goes first, so a model built
    again does not share memory with the one it replaces."""
    import gc

    for name in names:
        namespace.pop(name, None)
    gc.collect()
    device = namespace["device"]
    settle_allocator(device)
    built = build(factory, layout, meshes(layout, device.type), rank, device=device, host=host, **options)
    gc.collect()
    reset_peak(device)  # the steps' peak, which a plan predicts: not the plain model filled from
    step = Reporting(built, predicted.get(built.stage, 0), predicted_s, device)
    namespace.update(dict(zip(names, (built.model, built.optimizer, step))))
    where = f"stage {built.stage} of {layout.pp}" if layout.pp > 1 else "its part"
    return f"{', '.join(names)}: {where} of {layout.describe()}"


def reset_peak(device: Any) -> None:
    """Start a new peak: CUDA's allocator statistics, or the kernel's peak RSS of this process
    (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes(device: Any) -> int:
    """The peak since :func:`reset_peak`: bytes CUDA's allocator reserved, or this process's
    peak RSS."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Reporting:
    """``step`` as bound on a rank: :meth:`Built.step`, and for the first steps a line with the
    measured peak and time beside the plan's prediction."""

    def __init__(self, built: Built, predicted: int, predicted_s: float, device: Any, steps: int = 3) -> None:
        self.built, self.predicted, self.predicted_s = built, predicted, predicted_s
        self.device, self.left, self.rank = device, steps, torch.distributed.get_rank()
        self.told_no_targets = False

    def __call__(self, inputs: Any, targets: Any = None) -> torch.Tensor | None:
        import time

        if targets is None and self.built.loss_fn is None and not self.told_no_targets \
                and not (isinstance(inputs, dict) and "labels" in inputs):
            self.told_no_targets = True
            print("note: step() got no targets: its loss is the mean square of the model's output, which measures "
                  "memory and time but trains toward nothing (a language model's cross-entropy needs "
                  "step(inputs, targets); a model that returns .loss, or parallelize(..., loss_fn=...), is used "
                  "as is)")
        started = time.perf_counter()
        loss = self.built.step(inputs, targets)
        if self.left > 0:
            self.left -= 1
            print(f"rank {self.rank} step {self.built.steps}: {self.measured(time.perf_counter() - started)}")
        return loss

    def measured(self, seconds: float) -> str:
        peak = peak_bytes(self.device)
        memory = f"peak {format_bytes(peak)}"
        if torch.device(self.device).type == "cuda":
            memory += f" reserved, {format_bytes(torch.cuda.max_memory_allocated(self.device))} allocated"
        if not self.predicted:  # a Layout applied without a plan
            return f"{memory}, {seconds * 1e3:.0f} ms"
        return (f"{memory} (predicted {format_bytes(self.predicted)}, "
                f"{(peak - self.predicted) / self.predicted:+.1%}), "
                f"{seconds * 1e3:.0f} ms (predicted {self.predicted_s * 1e3:.0f} ms)")

    def __repr__(self) -> str:
        return f"<step: {self.built.layout.describe()}, stage {self.built.stage}>"
