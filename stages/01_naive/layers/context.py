"""What the attention layers need to know about the current batch.

The model runner sets it before each forward pass; attention layers read it.
Models and other layers never look at it."""

from dataclasses import dataclass


@dataclass
class Context:
    cu_seqlens_q: list[int]  # (seqs+1,) start of each sequence in the packed token stream


_CONTEXT: Context | None = None


def set_context(context: Context | None) -> None:
    global _CONTEXT
    _CONTEXT = context


def get_context() -> Context:
    assert _CONTEXT is not None, "attention ran outside a model runner step"
    return _CONTEXT
