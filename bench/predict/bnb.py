"""bitsandbytes on fake tensors: the 8-bit optimizers' maps and paged state, the 4-bit (NF4) base, and
the scratch of its CUDA matmul.

- The 8-bit optimizers and the nested 4-bit statistics build their quantization maps (256 values)
  from Python numbers, which fake tensors cannot hold: the maps are made for real, then handed over
  as fake tensors (`real_quantization_maps`). The 8-bit step runs on fake tensors like any op: its ops have fake kernels.
- A QLoRA base is built on the meta device by transformers' own quantizer (the same layers replaced,
  the same ones kept: lm_head, tied or not), and each 4-bit weight is quantized as transformers
  quantizes it while loading, by bitsandbytes' `quantize_4bit`, which has a fake kernel: the packed
  weight (0.5 B/param) and its quantization state (8-bit absmax per 64 values, the nested fp32
  absmax per 256 of those, the codes, the offset) are fake tensors of the GPU's sizes
  (`quantized_weight`). The weight stays a plain Parameter holding `quant_state`: torch cannot make
  bitsandbytes' Params4bit subclass over a fake tensor, and nothing in a step asks for the subclass.
- `bitsandbytes::gemm_4bit`'s fake kernel returns its output only. On CUDA (bitsandbytes 0.50.2) it
  either dequantizes the whole weight into a new tensor and runs F.linear, or runs its own 4-bit
  kernel. Which, bitsandbytes decides by the rows (tokens), the weight's shape, and the GPU's compute
  capability and SM count (backends/cuda/ops.py: past 1536 rows always the first; on an H100 or H200
  from a few dozen rows on, so for a training step's shapes): `gemm_4bit_dequantizes` asks bitsandbytes'
  own function, told the GPU kind's. The first path's scratch (the dequantized weight, and with nested
  statistics the fp32 absmax twice) is freed when the op returns; `gemm_4bit_scratch` says its sizes,
  and the counter allocates and frees it around the op. Its kernels (the statistics' and the weight's
  dequantization, the matmul) are what a step's time is predicted from (`gemm_4bit_kernels`).
- A paged optimizer's large state buffers are CUDA managed memory: counted apart (`paged_state_apart`).
- LLM.int8 bases (int8_lora): bench/predict/int8.py (which columns are decomposed as outliers depends
  on the values: counted beforehand on a CPU).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from unittest import mock

from .counter import NO_SCRATCH, KernelScratch, Scratch, rounded

if TYPE_CHECKING:
    from .flops import KernelWork
    from .gpus import GpuKind

# Without bitsandbytes' choosing function (releases before 0.50.2) or the GPU kind's SM count: more rows than this
# dequantize, as bitsandbytes 0.50.0 chose on compute capability 9.0
DEQUANT_FALLBACK_ROWS = 512


@contextlib.contextmanager
def real_quantization_maps() -> Iterator[None]:
    """The maps made for real outside fake mode, handed over as fake tensors (copied by an op, so the
    counter counts their 1 KiB on the device, as a real run does)."""
    try:
        from bitsandbytes import functional
    except ImportError:
        yield
        return
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = functional.create_dynamic_map

    def real_map(*args: Any, **kwargs: Any) -> Any:
        mode = detect_fake_mode()
        with unset_fake_temporarily():
            made = original(*args, **kwargs)
        return mode.from_tensor(made).clone() if mode is not None else made

    functional.create_dynamic_map = real_map
    try:
        with fresh_map_cache():
            yield
    finally:
        functional.create_dynamic_map = original


@contextlib.contextmanager
def fresh_map_cache() -> Iterator[None]:
    """bitsandbytes caches a map on its first use in a process: each counted run starts without one,
    as a cell's own process does (a real map is not used on fake tensors, nor a fake one after)."""
    try:
        from bitsandbytes import functional
    except ImportError:
        yield
        return
    cached = dict(functional.name2qmap)
    functional.name2qmap.clear()
    try:
        yield
    finally:
        functional.name2qmap.clear()
        functional.name2qmap.update(cached)


PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages the state of parameters this large; smaller ones stay in torch's


@contextlib.contextmanager
def paged_state_apart(counter: Any) -> Iterator[None]:
    """A paged 8-bit optimizer keeps the state of large parameters in CUDA managed memory, which torch's
    allocator never sees: not in peak allocated or reserved, in NVML's device figure while resident
    (under pressure the driver pages it to the host instead of failing). On a CPU bitsandbytes makes
    those buffers plain tensors; they are made here inside the counter's "managed" pool."""
    try:
        from bitsandbytes.optim.optimizer import Optimizer8bit
    except ImportError:
        yield
        return
    original = Optimizer8bit.get_state_buffer

    def state_buffer(self: Any, p: Any, dtype: Any = None) -> Any:
        kwargs = {} if dtype is None else {"dtype": dtype}
        if self.is_paged and p.numel() >= PAGED_MIN_NUMEL:
            with counter.apart("managed"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "paged optimizers are not supported on CPU": they are predicted
                return original(self, p, **kwargs)
        return original(self, p, **kwargs)

    Optimizer8bit.get_state_buffer = state_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer8bit.get_state_buffer = original  # type: ignore[method-assign]


def is_4bit(tensor: Any) -> bool:
    """A meta 4-bit weight, not quantized yet (bitsandbytes' Params4bit)."""
    params4bit = _params4bit()
    return params4bit is not None and isinstance(tensor, params4bit) and not tensor.bnb_quantized


def quantized_weight(meta_weight: Any, module: Any, dtype: Any) -> Any:
    """The 4-bit weight as a GPU load makes it: a `dtype` weight of the meta one's shape, quantized
    by bitsandbytes with the layer's settings (blocksize, nested statistics, nf4, storage dtype).
    Call in fake mode: the bf16 weight is a transient of the build, as it is while loading."""
    import torch
    from bitsandbytes import functional

    loaded = torch.empty(meta_weight.shape, dtype=dtype)
    packed, state = functional.quantize_4bit(loaded, blocksize=meta_weight.blocksize,
                                             compress_statistics=meta_weight.compress_statistics,
                                             quant_type=meta_weight.quant_type, quant_storage=meta_weight.quant_storage)
    weight: Any = torch.nn.Parameter(packed, requires_grad=False)
    weight.quant_state, weight.bnb_quantized = state, True
    module.quant_state = state  # as Params4bit._quantize leaves it
    return weight


@functools.cache
def _loaded_sizes(shape: tuple[int, ...], blocksize: int, compress_statistics: bool, quant_type: str,
                  quant_storage: Any) -> tuple[int, int]:
    """`loaded_sizes`, once per shape and settings (a 70B model has 560 4-bit weights of 4 shapes)."""
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = types.SimpleNamespace(shape=shape, blocksize=blocksize, compress_statistics=compress_statistics,
                                 quant_type=quant_type, quant_storage=quant_storage)
    with real_quantization_maps(), FakeTensorMode():
        weight = quantized_weight(meta, types.SimpleNamespace(), torch.bfloat16)
        pieces = [weight, *quantized_state_tensors(weight)]
        return weight.numel(), sum(rounded(t.untyped_storage().nbytes()) for t in pieces)


def loaded_sizes(meta_weight: Any) -> tuple[int, int]:
    """(elements, bytes) of a meta 4-bit weight (`is_4bit`) once a load has quantized it: its packed
    weight's elements (what `numel` says of a loaded model's parameter), and the bytes of the packed
    weight and its quantization state, each an allocation of its own (512 B blocks)."""
    w = meta_weight
    return _loaded_sizes(tuple(w.shape), w.blocksize, w.compress_statistics, w.quant_type, w.quant_storage)


def quantized_state_tensors(weight: Any) -> list[Any]:
    """The device tensors of a 4-bit weight's quantization state (counted as weights)."""
    state = getattr(weight, "quant_state", None)
    if state is None:
        return []
    found = [state.absmax, state.code, state.offset]
    if state.state2 is not None:
        found += [state.state2.absmax, state.state2.code]
    return [t for t in found if t is not None]


GEMM_4BIT_ARGS = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit", "absmax_code",
                  "absmax_offset")  # bitsandbytes::gemm_4bit's schema


def _gemm_4bit_call(args: Any, kwargs: Any) -> tuple[Any, int, int, int, bool]:
    """(A, the weight's rows N, its columns K, how many absmax statistics it has, whether they are nested: 8-bit,
    with fp32 statistics of their own) of a gemm_4bit call."""
    bound = {**dict(zip(GEMM_4BIT_ARGS, args, strict=False)), **kwargs}
    rows_b, cols_b = bound["shapeB"]
    nested = bound.get("absmax_8bit") is not None
    statistics = bound["absmax_8bit"] if nested else bound["absmax"]
    return bound["A"], int(rows_b), int(cols_b), int(statistics.numel()), nested


def gemm_4bit_dequantizes(a: Any, out_features: int, in_features: int, gpu: GpuKind) -> bool:
    """Whether CUDA's gemm_4bit, given A, dequantizes the weight and runs F.linear on this GPU kind (else it runs
    bitsandbytes' own 4-bit kernel)."""
    return _dequantizes(a.numel() // a.shape[-1], out_features, in_features, a.dtype, gpu.compute_capability,
                        gpu.multiprocessors)


@functools.cache
def _dequantizes(rows: int, out_features: int, in_features: int, dtype: Any, capability: tuple[int, int],
                 multiprocessors: int | None) -> bool:
    """bitsandbytes' own choice (its CUDA op's: `_gemm_4bit_use_custom_fn` below `_gemm_4bit_custom_max_m` rows),
    its device query answered with the GPU kind's SM count and compute capability."""
    ops = _cuda_ops()
    use_custom = getattr(ops, "_gemm_4bit_use_custom_fn", None)
    if use_custom is None or multiprocessors is None:
        return rows > DEQUANT_FALLBACK_ROWS
    if rows > ops._gemm_4bit_custom_max_m:
        return True
    with mock.patch.object(ops, "_gpu_dispatch_props", lambda _index: (multiprocessors, *capability)):
        return not use_custom.__wrapped__(0, dtype, rows, out_features, in_features)  # uncached: asks the patched


def _cuda_ops() -> Any:
    """bitsandbytes' CUDA ops module, imported on any host: under a CPU build of torch, the CUDA stream getter it
    reads at import (and calls only when launching a kernel, which a CPU build never does) is stood in for."""
    import torch

    if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a CUDA build: the module as its kernels use it
        from bitsandbytes.backends.cuda import ops
        return ops
    with mock.patch.object(torch._C, "_cuda_getCurrentRawStream", None, create=True):
        from bitsandbytes.backends.cuda import ops
    return ops


def gemm_4bit_scratch(gpu: GpuKind) -> KernelScratch:
    """Bytes CUDA's gemm_4bit allocates and frees inside the op on this GPU kind, before its output (see the
    module's text)."""
    def scratch(op: str, args: Any, kwargs: Any) -> Scratch:
        if op != "gemm_4bit":
            return NO_SCRATCH
        a, rows_b, cols_b, statistics, nested = _gemm_4bit_call(args, kwargs)
        if not gemm_4bit_dequantizes(a, rows_b, cols_b, gpu):
            return NO_SCRATCH
        dequantized_absmax = [statistics * 4] * 2 if nested else []  # fp32, then + offset
        return Scratch(before=(*dequantized_absmax, rows_b * cols_b * a.element_size()))
    return scratch


def gemm_4bit_kernels(gpu: GpuKind) -> KernelWork:
    """The kernels CUDA's gemm_4bit runs on this GPU kind, each (FLOPs, bytes read and written): dequantizing, the
    nested statistics (their 8-bit codes to fp32, then the offset added) and the weight (its packed 4 bits and
    fp32 statistics to the input's dtype), then F.linear; or bitsandbytes' own kernel, the same matmul reading the
    packed weight. The fake kernel is one op that counts nothing."""
    def kernels(func: Any, args: Any, kwargs: Any) -> list[tuple[int, int]] | None:
        if func.namespace != "bitsandbytes" or func._opname != "gemm_4bit":
            return None
        a, rows_b, cols_b, statistics, nested = _gemm_4bit_call(args, kwargs)
        rows = a.numel() // a.shape[-1]
        matmul_flops, element = 2 * rows * rows_b * cols_b, a.element_size()
        moved = (rows * cols_b + rows * rows_b) * element  # the input read, the output written
        packed = (rows_b * cols_b + 1) // 2
        if not gemm_4bit_dequantizes(a, rows_b, cols_b, gpu):
            return [(matmul_flops, moved + packed + statistics * (1 if nested else 4))]
        # nested: the 8-bit statistics to fp32 (read 1 B, write 4), then the offset added (read 4, write 4)
        unnested = [(0, statistics * 5), (0, statistics * 8)] if nested else []
        weight = rows_b * cols_b * element
        return [*unnested, (0, packed + statistics * 4 + weight), (matmul_flops, moved + weight)]
    return kernels


def _params4bit() -> Any:
    try:
        from bitsandbytes.nn import Params4bit
    except ImportError:
        return None
    return Params4bit
