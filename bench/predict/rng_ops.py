"""The random-state wrappers compiled code calls, as a counting dispatch mode sees them.

Under torch 2.13, a compiled layer under checkpointing wraps each op with randomness (the attention, whose
dropout probability is an argument) in a higher-order op that saves the generator's state for the recompute
(`run_and_save_rng_state`) and restores it there (`run_with_rng_state`; torch/_prims/rng_prims.py). A
dispatch mode that counts (MemoryCounter, FlopCount) is handed such an op whole (its class sets
`supports_higher_order_operators`): `run` runs the wrapped op under the mode, so the mode counts it like any
op. The state itself is the generator's, a small tensor in host memory on a CPU and on CUDA alike: made
unseen (not GPU memory), and the saved one is not restored (fake tensors draw no random numbers).
"""

from __future__ import annotations

from typing import Any

SAVES_STATE = "run_and_save_rng_state"
RESTORES_STATE = "run_with_rng_state"


def run(mode: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """A higher-order op reaching `mode` (popped from the dispatch stack): its wrapped op run under it."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    name = func.name()
    if name == SAVES_STATE:
        op, *rest = args
        with _disable_current_modes():
            state = torch.get_rng_state()
        return state, _under(mode, op, rest, kwargs)
    if name == RESTORES_STATE:
        _, op, *rest = args
        return _under(mode, op, rest, kwargs)
    raise NotImplementedError(f"{type(mode).__name__}: higher-order op {name} is not counted")


def _under(mode: Any, op: Any, args: Any, kwargs: Any) -> Any:
    """`op` dispatched with `mode` back on the stack (pushed, not entered: the counter's entry patches torch)."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    _push_mode(mode)
    try:
        return op(*args, **kwargs)
    finally:
        _pop_mode()
