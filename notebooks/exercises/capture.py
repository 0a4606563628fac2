"""Watch a stage's model runner build a step: the token ids and positions it feeds the model
and the Context it hands the attention layers. Nothing is reimplemented: the runner runs."""

import contextlib

import torch


@contextlib.contextmanager
def step_inputs(runner, runner_module):
    """While active, every model call of `runner` appends {"input_ids", "positions", "context"}
    to the yielded list (the context is the one the runner set for that call)."""
    calls, context_now = [], {}
    original_set, original_forward = runner_module.set_context, runner.model.forward

    def set_context(context):
        if context is not None:
            context_now["value"] = context
        return original_set(context)

    def forward(input_ids, positions, *args, **kwargs):
        calls.append({"input_ids": input_ids.tolist(), "positions": positions.tolist(), "context": context_now.get("value")})
        return original_forward(input_ids, positions, *args, **kwargs)

    runner_module.set_context, runner.model.forward = set_context, forward
    try:
        yield calls
    finally:
        runner_module.set_context = original_set
        del runner.model.forward  # back to the class's forward


def split(values, cu_seqlens) -> list[list]:
    """A packed list cut into one list per sequence at cu_seqlens."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    return [values[a:b] for a, b in zip(cu, cu[1:])]
