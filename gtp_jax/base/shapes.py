"""Integer shape arithmetic shared by every package (a leaf module: imports nothing)."""

from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `n`.

    Used wherever a size is padded to a multiple: sharded dims to the axis size times
    ``pad_for_alignment``, sequences to ``tp``, quantization blocks to the block size.

    Args:
      n: a non-negative int.
      multiple: a positive int.
    Returns:
      ``ceil(n / multiple) * multiple`` in exact integer arithmetic (``n`` itself when it
      is already a multiple, 0 for ``n == 0``).
    """
    return -(-n // multiple) * multiple
