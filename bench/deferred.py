"""Deferred initialisation: a model built with its parameters on the meta device, every write into
them recorded, then replayed into whatever holds them later (FSDP2's shards, ZeRO-3's partitions), one
parameter at a time.

Why: a sharding engine must never hold the whole model on one GPU. Built whole and then sharded,
an FSDP cell's peak on 8 ranks is its build (a 7B model: 30 GiB building against 17 GiB training),
and a 70B one cannot be built on any card. Real FSDP recipes (torchtitan's) build on meta, shard,
then `to_empty` and initialise; under ZeRO-3 a checkpoint loads straight into the partitions.
Initialised afresh, though, the weights would come from another random stream than a plain build of
the same seed, and an exact engine could no longer be checked
against the baseline's losses. So the build is recorded instead:

1. `recording(seed)`: while the base model is built, each parameter goes to the meta device as it is
   registered (a small one keeps the values it was made with, e.g. a norm's ones). Every init call
   that writes into one (`torch.nn.init.*`, `Tensor.normal_`, ...) is recorded with its arguments and
   not made, and every cast of one (`Module.to`) is recorded. The build draws no random numbers
   (checked). What the stack adds after (LoRA adapters, small) is made for real, where its code makes
   it, and kept there when that code moves it to its base layer's device (meta), cast as asked.
2. `materialize(model, record, device)`, after the engine has sharded the meta model: `to_empty`
   gives each shard its memory, then the recorded writes run again in their order, the generators
   seeded as the build seeded them, each on a temporary of the whole parameter on the device the
   build would have made it on, and each rank copies its shard out of it. The random streams are
   drawn exactly as a plain build draws them, so the weights are bit for bit a plain build's
   (tested), and at most one whole parameter (the embedding, usually) exists beside the shards.
   ZeRO-3 (bench/engines/deepspeed.py) gives each parameter its memory and has DeepSpeed partition it
   at once, then calls `replay`, which opens each parameter (DeepSpeed gathers it) for its writes.

A write the replay cannot repeat (an op that reads the old values, a value computed from another
meta tensor, a large parameter made with values but never initialised) is an error naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# A parameter made with at most this many elements keeps its values (a norm's ones, a bias's zeros);
# a larger one must be written whole by an init call (its values were torch.empty's).
KEPT_VALUES_MAX_NUMEL = 1 << 20
# In-place tensor methods that overwrite what they write, whatever was there: replayable.
OVERWRITING_METHODS = frozenset({"normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_",
                                 "geometric_", "log_normal_", "cauchy_", "bernoulli_"})
# Methods named like in-place ops that change no values (a flag, where the memory lives).
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_"})
IN_PLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                                "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                                "__irshift__"})
View = tuple[tuple[int, ...], tuple[int, ...], int]  # (size, stride, storage offset) into a whole parameter
Opened = Callable[[list[Any]], contextlib.AbstractContextManager[Any]]  # makes parameters writable whole for a while


@dataclass(frozen=True)
class Made:
    """Where and how big a parameter was made, before it moved to meta; `values` if it was small."""

    device: str
    shape: tuple[int, ...]
    values: Any = None


@dataclass(frozen=True)
class Write:
    """One recorded init call into (a view of) parameter `key`, `func(target, *args, **kwargs)` with the
    parameter in `dtype` then; or, without `func`, the parameter cast to `dtype` (peft moves its
    adapters to the base layer's dtype, then back to fp32: their values keep the rounding)."""

    key: int
    dtype: Any
    func: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()  # the arguments after the target
    kwargs: dict[str, Any] = field(default_factory=dict)
    view: View | None = None  # None: all of it


@dataclass
class Record:
    seed: int
    made: dict[int, Made] = field(default_factory=dict)  # key -> how the parameter was made
    writes: list[Write] = field(default_factory=list)
    keys: dict[int, int] = field(default_factory=dict)  # id(parameter object) -> key (a move may replace the object)
    names: dict[int, list[str]] = field(default_factory=dict)  # key -> its names in the built model
    params: list[Any] = field(default_factory=list)  # every parameter object seen: keeps their ids unique
    seeded: dict[str, Any] = field(default_factory=dict)  # device type -> its generator's state once seeded
    # True while the base model is built: parameters go to meta as they are registered. False after (the
    # stack's apply): parameters are made for real and kept off meta (see `base_built`).
    to_meta: bool = True

    def base_built(self) -> None:
        """The base model is built; what is made from now on is made for real. The CPU generator is
        advanced as the base's writes on the CPU would have advanced it, so what the stack draws there
        (LoRA's adapters) is what a plain build draws (a GPU build draws the base's on the GPU's)."""
        import torch

        if not _same_rng(list(self.seeded.values()), _rng_states()):
            raise NotImplementedError("deferred init: the build drew random numbers outside an init call into a "
                                      "parameter, so its replay could not draw them in the same order")
        self.to_meta = False
        with torch.no_grad():
            for write in self.writes:
                if write.func is not None and self.made[write.key].device == "cpu":
                    _replay(write, self.made[write.key], [], "cpu", None)

    def key_of(self, tensor: Any) -> int | None:
        return self.keys.get(id(tensor))

    def add(self, param: Any, made: Made) -> None:
        self.keys[id(param)] = len(self.made)
        self.made[len(self.made)] = made
        self.params.append(param)

    def replay_generators(self, device: str) -> None:
        """Each generator the replay draws from, back where the build's seed left it."""
        import torch

        devices = {device if made.device == "meta" else made.device for made in self.made.values()}
        for kind in devices & set(self.seeded):
            if kind == "cpu":
                torch.random.set_rng_state(self.seeded[kind])
            else:
                torch.cuda.set_rng_state(self.seeded[kind])

    def alias(self, tensor: Any, key: int) -> None:
        """`tensor` is the whole of parameter `key` under another name (`.data`, `.detach()`)."""
        self.keys[id(tensor)] = key
        self.params.append(tensor)

    def moved(self, old: Any, new: Any) -> None:
        """`new` replaced recorded parameter `old` (Module._apply made a new Parameter): the same key."""
        key = self.keys[id(old)]
        self.keys[id(new)] = key
        self.params.append(new)
        if new.dtype != old.dtype:
            self.writes.append(Write(key, new.dtype))

    def finish(self, model: Any) -> None:
        """The built model's names of each recorded parameter; checks that every one can be replayed."""
        for name, param in model.named_parameters(remove_duplicate=False):
            key = self.key_of(param)
            if key is not None:
                self.names.setdefault(key, []).append(name)
        written_whole = {w.key for w in self.writes if w.func is not None and w.view is None}
        for key, made in self.made.items():
            if key in self.names and made.device != "meta" and key not in written_whole and made.values is None:
                raise NotImplementedError(f"deferred init: parameter {self.names[key][0]} "
                                          f"{list(made.shape)} was made with values and never initialised")


@contextlib.contextmanager
def recording(seed: int) -> Iterator[Record]:
    """Seeds the random generators as a plain build does; inside, parameters are recorded as they are
    registered and init calls into them recorded (see the module's docstring). The caller calls
    `record.base_built()` when the base model is built, and `record.finish(model)` after the stack."""
    import torch
    from torch.overrides import TorchFunctionMode

    record = Record(seed)
    register, apply = torch.nn.Module.register_parameter, torch.nn.Module._apply

    def register_parameter(module: Any, name: str, param: Any) -> None:
        register(module, name, _recorded(param, record) if param is not None and record.to_meta else param)

    def _apply(module: Any, fn: Any, recurse: bool = True) -> Any:
        before = dict(module._parameters)
        out = apply(module, fn, recurse)
        for name, old in before.items():
            new = module._parameters.get(name)
            if new is not old and old is not None and new is not None and record.key_of(old) is not None:
                record.moved(old, new)
        return out

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            key = record.key_of(args[0]) if args and _aliases(func) else None
            if key is not None:  # `p.data`, `p.detach()`: p itself, under another name
                out = func(*args, **kwargs)
                record.alias(out, key)
                return out
            target = _record_write(record, func, args, kwargs)
            if target is not None:  # recorded, not done: the replay does it, drawing its random numbers then
                return target
            if not record.to_meta and getattr(func, "__name__", "") == "to":
                return _off_meta(func, args, kwargs)
            return func(*args, **kwargs)

    torch.manual_seed(seed)  # as the build seeds it: the base's build must leave the streams where they are now
    record.seeded = dict(zip(("cpu", "cuda"), _rng_states(), strict=False))
    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    torch.nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        with Recorder():
            yield record
    finally:
        torch.nn.Module.register_parameter, torch.nn.Module._apply = register, apply  # type: ignore[method-assign]


def materialize(model: Any, record: Record, device: str) -> None:
    """Gives the (sharded) meta parameters memory on `device` and replays the recorded writes into them.
    Buffers made for real at the build are kept (`to_empty` would empty them too)."""
    import torch

    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
               if buf is not None and not buf.is_meta]
    made_for_real = [(name, _local(p).clone()) for name, p in model.named_parameters() if not _local(p).is_meta]
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf
    with torch.no_grad():
        for name, values in made_for_real:
            _local(model.get_parameter(name)).copy_(values)
    replay(model, record, device)


def replay(model: Any, record: Record, device: str, opened: Opened | None = None) -> None:
    """Replays the recorded writes into a model whose parameters have memory again: the kept values, then
    every write in its order. `opened(params)` makes them writable for the time of one write (ZeRO-3
    gathers its partitions, bench/engines/deepspeed.py); FSDP's shards are written as they are."""
    import torch

    holders = {key: [model.get_parameter(name) for name in names] for key, names in record.names.items()}
    with torch.no_grad():
        for key, made in record.made.items():
            if made.values is not None and key in holders:
                with _opened(opened, holders[key]):
                    _copy_shards(holders[key], made.values.to(device), None)
        record.replay_generators(device)
        for write in record.writes:  # every write, also into parameters since dropped: the streams advance alike
            _replay(write, record.made[write.key], holders.get(write.key, []), device, opened)
    # The replay's whole-parameter temporaries are this suite's way to make random weights, not the
    # technique's (a real run loads a checkpoint): their cached blocks must not shape training's cache.
    torch.cuda.empty_cache()


def _replay(write: Write, made: Made, holders: list[Any], device: str, opened: Opened | None) -> None:
    """One write: on a temporary of the whole parameter, then copied into each holder's shard (or, when
    `opened` made the parameter whole where the write would make it, straight into it); a cast, which
    rounds each element alone, on the shards themselves."""
    import torch

    with _opened(opened, holders):
        if write.func is None:
            for param in holders:
                local = _local(param)
                local.copy_(local.to(write.dtype))
            return
        on = device if made.device == "meta" else made.device
        target = _whole_in_place(holders, write, made, on) if opened is not None else None
        whole = target if target is not None else torch.empty(made.shape, dtype=write.dtype, device=on)
        write.func(whole if write.view is None else whole.as_strided(*write.view), *write.args, **write.kwargs)
        if target is None:
            _copy_shards(holders, whole, write.view)


def _whole_in_place(holders: list[Any], write: Write, made: Made, device: str) -> Any:
    """The one opened parameter, if a write into all of it can draw into it what it would draw into a
    temporary: the whole shape, same dtype and device, contiguous. Else None (a temporary takes the write)."""
    import torch

    unique = list({id(p): p for p in holders}.values())
    if write.view is not None or len(unique) != 1:
        return None
    local = _local(unique[0])
    fits = (tuple(local.shape) == made.shape and local.dtype == write.dtype and not local.is_meta
            and local.device.type == torch.device(device).type and local.is_contiguous())
    return local if fits else None


def _opened(opened: Opened | None, params: list[Any]) -> contextlib.AbstractContextManager[Any]:
    """`opened` over each parameter once (a tied one has several names), or nothing to open."""
    unique = list({id(p): p for p in params}.values())
    return opened(unique) if opened is not None and unique else contextlib.nullcontext()


def _recorded(param: Any, record: Record) -> Any:
    """The parameter, its making recorded (once): as a meta parameter of its class while `record.to_meta`."""
    if record.key_of(param) is not None:
        return param
    values = None
    if not param.is_meta and param.numel() <= KEPT_VALUES_MAX_NUMEL:
        values = param.detach().to("cpu", copy=True)
    kept = param
    if record.to_meta and not param.is_meta:
        kept = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    record.add(kept, Made(param.device.type, tuple(param.shape), values))
    return kept


def _aliases(func: Any) -> bool:
    """Whether `func(p)` returns p's whole storage as another tensor (writes into it write into p)."""
    import torch

    name = getattr(func, "__name__", "")
    return name == "detach" or (name == "__get__" and getattr(func, "__self__", None) is _data_descriptor(torch))


def _data_descriptor(torch: Any) -> Any:
    return torch._C.TensorBase.__dict__["data"]


def _off_meta(to: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`tensor.to(...)`, except that a real tensor asked to go to meta stays where it is (cast as asked)."""
    import torch

    tensor = args[0]
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                         if k != "copy"})
    if tensor.is_meta or device is None or device.type != "meta":
        return to(*args, **kwargs)
    return tensor.to(dtype=dtype or tensor.dtype, non_blocking=non_blocking, copy=kwargs.get("copy", False))


def _record_write(record: Record, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Records `func` if it writes into a recorded parameter and returns what it writes into (the call is
    not made); raises if it writes in a way the replay cannot repeat. Calls that only read, or touch
    other tensors, pass unrecorded (None)."""
    import torch

    name = getattr(func, "__name__", "")
    if name == "__set__" and getattr(func, "__self__", None) is _data_descriptor(torch):
        _record_cast(record, *args)
        return None
    is_init = getattr(func, "__module__", "") == "torch.nn.init"
    in_place = name.endswith("_") and not name.startswith("_") and name not in NOT_WRITES
    if not (is_init or in_place or name in IN_PLACE_OPERATORS):
        return None
    target = args[0] if args else kwargs.get("tensor")
    key, view = _key_of(record, target)
    if key is None:
        return None
    shape = list(record.made[key].shape)
    if not (is_init or name in OVERWRITING_METHODS):
        raise NotImplementedError(f"deferred init: {name} writes into a parameter {shape} from its old values, "
                                  "which a replay does not have")
    rest = tuple(args[1:]) if args else ()
    kwargs = {k: v for k, v in kwargs.items() if k != "tensor"}
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*rest, *kwargs.values())):
        raise NotImplementedError(f"deferred init: {name} writes a value computed on meta into a parameter {shape}")
    record.writes.append(Write(key, target.dtype, func, rest, kwargs, view))  # type: ignore[union-attr]
    made = record.made[key]
    if view is None and made.values is not None:  # written whole: the values it was made with are not needed
        record.made[key] = Made(made.device, made.shape)
    return target


def _record_cast(record: Record, param: Any, data: Any) -> None:
    """`param.data = data` (how `Module.to` converts a parameter in place): a cast if it changes the dtype."""
    import torch

    key = record.key_of(param)
    if key is None or not isinstance(data, torch.Tensor) or data.dtype == param.dtype:
        return
    if tuple(data.shape) != tuple(param.shape):
        raise NotImplementedError(f"deferred init: a parameter {list(param.shape)} was given data of another shape")
    record.writes.append(Write(key, data.dtype))


def _key_of(record: Record, tensor: Any) -> tuple[int | None, View | None]:
    """(the key of the recorded parameter `tensor` is or views, the view's geometry or None), or (None, None)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return None, None
    key = record.key_of(tensor)
    if key is not None:
        return key, None
    key = record.key_of(tensor._base)
    if key is not None:
        return key, (tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))
    return None, None


def _copy_shards(params: list[Any], whole: Any, view: View | None) -> None:
    """Copies each holder's part of `whole` into it: a DTensor's local shard, or a plain tensor whole.
    After a write into a view, only the elements it wrote."""
    import torch
    from torch.distributed.tensor import DTensor

    written = None
    if view is not None:
        written = torch.zeros(whole.shape, dtype=torch.bool, device=whole.device)
        written.as_strided(*view).fill_(True)
    for param in params:
        local, part, mask = _local(param), whole, written
        if isinstance(param, DTensor):
            part, mask = _shard_of(param, whole), None if written is None else _shard_of(param, written)
        part = part.to(local.device, local.dtype)
        local.copy_(part if mask is None else torch.where(mask.to(local.device), part, local))


def _local(param: Any) -> Any:
    """What this rank holds of a parameter: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _shard_of(param: Any, whole: Any) -> Any:
    """This rank's piece of `whole` as FSDP2 shards a parameter: torch.chunk along its one Shard dim."""
    (placement,) = param.placements
    mesh = param.device_mesh
    pieces = whole.chunk(mesh.size(), dim=placement.dim)
    rank = mesh.get_local_rank()
    return pieces[rank] if rank < len(pieces) else whole.narrow(placement.dim, 0, 0)


def _rng_states() -> list[Any]:
    import torch

    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    return states


def _same_rng(before: list[Any], after: list[Any]) -> bool:
    import torch

    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
