"""What a safetensors loader materialises from its files: every tensor ``safetensors.safe_open`` hands out while a
``FileReads`` is installed, by name and shape (a whole tensor, or the part of a ``get_slice`` indexed), so a test can
assert that each rank read only its own slice."""

from __future__ import annotations

from typing import Any

import torch


class FileReads:
    """Every tensor ``safetensors.safe_open`` hands out while installed, by name and shape: what a loader
    materialised from the file (``get_tensor``, or a ``get_slice`` indexed)."""

    def __init__(self) -> None:
        import safetensors

        self.module = safetensors
        self.original = safetensors.safe_open
        self.reads: list[tuple[str, tuple[int, ...]]] = []

    def __enter__(self) -> FileReads:
        reads, original = self.reads, self.original

        class Slice:
            def __init__(self, inner: Any, name: str) -> None:
                self.inner, self.name = inner, name

            def get_shape(self) -> list[int]:
                return self.inner.get_shape()

            def __getitem__(self, index: Any) -> torch.Tensor:
                value = self.inner[index]
                reads.append((self.name, tuple(value.shape)))
                return value

        class Opened:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.inner = original(*args, **kwargs)

            def __enter__(self) -> Opened:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                self.inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return self.inner.keys()

            def get_slice(self, name: str) -> Slice:
                return Slice(self.inner.get_slice(name), name)

            def get_tensor(self, name: str) -> torch.Tensor:
                value = self.inner.get_tensor(name)
                reads.append((name, tuple(value.shape)))
                return value

        self.module.safe_open = Opened
        return self

    def __exit__(self, *exc: Any) -> None:
        self.module.safe_open = self.original
