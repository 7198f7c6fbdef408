"""Random KV entries for the lookup buffer's tests, and how they compare (bit for bit): shared by the
buffer's, metrics', staging and integration tests."""

from __future__ import annotations

import torch


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8,
                        generator=generator)
    return raw.view(dtype).reshape(shape)


def kv_entry(tokens: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16, layers: int = 2,
             heads: int = 2, head_dim: int = 16) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    input_tokens = torch.randint(0, 32000, (tokens,), generator=generator)
    key = random_tensor((layers, tokens, heads, head_dim), dtype, generator)
    value = random_tensor((layers, tokens, heads, head_dim), dtype, generator)
    hidden = random_tensor((tokens, 32), torch.float32, generator)
    return input_tokens, key, value, hidden


def identical(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_entry(result: list, tokens: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 hidden: torch.Tensor | None) -> None:
    assert identical(result[0], tokens.to(torch.int64))
    assert result[1] is not None and bool(result[1].all())
    assert identical(result[2], key)
    assert identical(result[3], value)
    assert identical(result[4], hidden)
