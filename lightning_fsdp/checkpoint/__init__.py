"""Checkpoint state for sharded models: full, sharded and local formats."""

from typing import Any, TypeAlias

# A Lightning checkpoint, and a model's or an optimizer's state dict inside one: string keys, and values of any
# picklable kind (tensors, numbers, nested dicts and lists, a user's own objects) that the code reading an entry
# checks. ``Any`` for those values, named once here.
Checkpoint: TypeAlias = dict[str, Any]
StateDict: TypeAlias = dict[str, Any]
