"""Triton kernels on fake tensors: a launch that does nothing.

A Triton kernel allocates no memory: it reads and writes buffers its Python wrapper allocated with
torch. So a wrapper run on fake tensors, with every launch a no-op, allocates and saves what it does
on a GPU (bench/predict/liger.py, bench/predict/cce.py). Autotuned and heuristic kernels are
launched the same way (`kernel[grid](...)`), so they are covered too.

Each launch is counted for the step's time as one memory-bound kernel reading or writing each tensor
it is given once, and twice a tensor it overwrites in place: read from and stored to through the same
pointer argument (`read_and_written`, from the kernel's source). Liger's SwiGLU backward writes the
gradients over its saved inputs, its RoPE rotates q and k in place: at Llama-3.2-3B seq 2048 batch 2,
5.6 GB a step that had been counted once (6.6 with checkpointing's recompute; fake-run/24).

In code torch.compile compiles (a decoder layer with Liger's kernels in it), a launch is not run but
traced: on a GPU, dynamo puts each Triton kernel into the graph as an opaque op that writes the buffers
it mutates, and inductor plans around it (`traced_by_dynamo`). A no-op launch there would be a Python
function for dynamo to trace instead, which breaks the graph at every kernel.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard


@contextlib.contextmanager
def no_launches() -> Iterator[None]:
    """While inside: `kernel[grid](...)` does nothing, for every Triton kernel."""
    from triton.runtime import jit

    launch = jit.KernelInterface.__getitem__
    jit.KernelInterface.__getitem__ = lambda self, grid: functools.partial(_no_launch_of, self)  # type: ignore
    try:
        yield
    finally:
        jit.KernelInterface.__getitem__ = launch  # type: ignore[method-assign]


@contextlib.contextmanager
def traced_by_dynamo() -> Iterator[None]:
    """While inside: torch.compile takes Triton kernels into its graphs as on a GPU, for fake CPU tensors.
    Dynamo checks for a device Triton runs on (`has_triton`): none here, so it is told yes. Which buffers
    a kernel mutates is read from its Triton IR, generated for a CUDA target (sm90: H100 and H200) by
    Triton's frontend alone (no driver, no compiler). Where that analysis fails torch assumes every
    input mutated, on a GPU as here: torch 2.11 hands the frontend every scalar argument as a constant,
    and Liger's RMSNorm kernels call `.to` on theirs, so theirs fail; its warning, with a traceback per
    kernel compiled, is kept out of the prediction's output. The kernels inductor would compile and
    launch (`async_compile.triton`) are never built, their launches do nothing."""
    from unittest import mock

    import torch._inductor.runtime.triton_helpers as helpers
    import torch.utils._triton
    import triton
    from torch._dynamo.device_interface import CpuInterface
    from torch._inductor.async_compile import AsyncCompile

    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addFilter(_mutation_analysis_failed)
    try:
        with contextlib.ExitStack() as patches:
            # torch 2.15 asks has_triton(include_cpu=True); 2.11-2.14 ask has_triton()
            patches.enter_context(mock.patch.object(torch.utils._triton, "has_triton", lambda **where: True))
            patches.enter_context(mock.patch.object(triton.runtime.driver, "_active", _CudaTarget()))
            patches.enter_context(mock.patch.object(AsyncCompile, "triton", lambda self, *args, **kwargs: _NeverBuilt()))
            # torch 2.15: inductor's code for a launch with options (num_warps) asks the device for Triton's backend,
            # then filters the options by the device's target: the GPU's here
            patches.enter_context(mock.patch.object(CpuInterface, "raise_if_triton_unavailable",
                                                    staticmethod(lambda device=None: None)))
            if hasattr(helpers, "try_filter_backend_options_for_target"):
                patches.enter_context(mock.patch.object(helpers, "try_filter_backend_options_for_target",
                                                        _for_the_gpus_target(helpers.try_filter_backend_options_for_target)))
            yield
    finally:
        dynamo_log.removeFilter(_mutation_analysis_failed)


def _for_the_gpus_target(filter_options: Callable[..., Any]) -> Callable[..., Any]:
    def filtered(target: Any, *args: Any, **kwargs: Any) -> Any:
        return filter_options(_CudaTarget().get_current_target(), *args, **kwargs)
    return filtered


def _mutation_analysis_failed(record: logging.LogRecord) -> bool:
    """False for torch's warning that a kernel's mutations could not be read (so it is not logged)."""
    return not record.getMessage().startswith("Encountered an exception in identify_mutated_tensors")


class _CudaTarget:
    """What Triton's frontend asks of its active driver: the target to generate IR for."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _NeverBuilt:
    """A kernel inductor would have compiled: its generated code calls `run`, which launches nothing."""

    def run(self, *args: Any, **kwargs: Any) -> None:
        _no_launch(*args, **kwargs)


def _no_launch(*args: Any, **kwargs: Any) -> None:
    """Launches nothing; the kernel it stands for is counted (its tensors' bytes) for the step's time."""
    from . import flops

    flops.count_undispatched_call(*args, **kwargs)


def _no_launch_of(kernel: Any, *args: Any, **kwargs: Any) -> None:
    """Launches nothing; `kernel` is counted for the step's time: its tensors' bytes, a tensor it overwrites
    in place twice (read, then written)."""
    from . import flops

    names = _jit_function(kernel).arg_names
    in_place = read_and_written(kernel)
    # fewer positional arguments than names where the rest come by keyword or default
    twice = [a for name, a in (*zip(names, args, strict=False), *kwargs.items()) if name in in_place]
    flops.count_undispatched_call(*args, *twice, **kwargs)


def _jit_function(kernel: Any) -> Any:
    """The JITFunction under an autotuned or heuristic kernel (each wraps the next as `fn`)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


@functools.cache
def read_and_written(kernel: Any) -> frozenset[str]:
    """The kernel's arguments it loads from and stores to through the same pointer (`tl.load` and `tl.store`
    of pointers made from that argument): the tensors it overwrites in place, whose bytes move twice (the scalars
    a pointer's offset is made from come out too, and count nothing: not tensors). Read from its Python source;
    a pointer passed on to another function, or loaded from memory, is not followed (its tensor is counted once,
    as every tensor was before), nor a kernel whose source does not parse as one function (none: each of its
    tensors counted once)."""
    try:
        function = ast.parse(textwrap.dedent(_jit_function(kernel).src)).body[0]
    except (AttributeError, SyntaxError, IndexError):
        return frozenset()
    if not isinstance(function, ast.FunctionDef):
        return frozenset()
    made_from = {a.arg: {a.arg} for a in function.args.args}  # a name -> the arguments its pointers are made from
    assignments = [(target, node.value) for node in ast.walk(function) if isinstance(node, ast.Assign)
                   for target in node.targets] + \
        [(node.target, node.value) for node in ast.walk(function)
         if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None]
    changed = True
    while changed:  # names made from names, in any order, until nothing more is learnt
        changed = False
        for target, value in assignments:
            for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                before = len(made_from.setdefault(name, set()))
                made_from[name] |= _pointer_sources(value, made_from)
                changed |= len(made_from[name]) > before
    loaded = _accessed(function, "load", made_from)
    stored = _accessed(function, "store", made_from)
    return frozenset(loaded & stored)


def _pointer_sources(expression: ast.AST, made_from: dict[str, set[str]]) -> set[str]:
    """The arguments the names in `expression` are made from, but inside a `tl.load` (what it returns is
    data, not a pointer: an index loaded from memory points nowhere of its own)."""
    if _is_tl_call(expression, "load"):
        return set()
    if isinstance(expression, ast.Name):
        return set(made_from.get(expression.id, ()))
    return set().union(*(_pointer_sources(child, made_from) for child in ast.iter_child_nodes(expression)))


def _accessed(function: ast.FunctionDef, access: str, made_from: dict[str, set[str]]) -> set[str]:
    """The arguments whose pointers `tl.<access>` (load or store) is called with."""
    calls = [call for call in ast.walk(function) if _is_tl_call(call, access)]
    pointers = [call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "pointer"), None)
                for call in calls]
    return set().union(*(_pointer_sources(p, made_from) for p in pointers if p is not None))


def _is_tl_call(node: ast.AST, name: str) -> TypeGuard[ast.Call]:
    """Whether `node` is a call of `tl.<name>` (triton.language, as kernels import it)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name and \
        isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"
