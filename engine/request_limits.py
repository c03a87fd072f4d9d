"""The checks a request must pass against a model's vocabulary and context length.

Torch-free and shared: the engine runs them on every ``add_request`` and the router runs them
before it routes, so both reject the same requests with the same messages, each naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams

# A salt names a tenant; anything longer is a mistake, and it is hashed into every block.
MAX_CACHE_SALT_BYTES = 256


def check_cache_salt(cache_salt: str) -> None:
    """Raise ``ValueError`` (naming ``cache_salt``) if the salt is longer than allowed."""
    if len(cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt: longer than {MAX_CACHE_SALT_BYTES} bytes")


def check_client_cache_salt(cache_salt: str) -> None:
    """``check_cache_salt`` for a salt a client sent: also no NUL characters, which start the
    keys the servers derive (an adapter's, a tenant's), so that no client salt equals one."""
    check_cache_salt(cache_salt)
    if "\0" in cache_salt:
        raise ValueError("cache_salt: must not contain NUL characters")


def check_request_limits(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    output_token_ids: Sequence[int] = (),
) -> None:
    """Raise ``ValueError`` naming the field if the request cannot run on such a model.

    ``output_token_ids`` are tokens already sampled elsewhere; they count towards max_tokens.
    """
    if not prompt_token_ids:
        raise ValueError("prompt is empty")
    for field_name, ids in (
        ("token_ids", prompt_token_ids),
        ("output_token_ids", output_token_ids),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field_name}: id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(output_token_ids) >= params.max_tokens:
        raise ValueError(
            f"output_token_ids: {len(output_token_ids)} tokens already reach "
            f"max_tokens {params.max_tokens}"
        )
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise ValueError(
            f"prompt: {num_prompt} tokens do not fit the context of {max_model_len} "
            "(at least one token must be generated)"
        )
    if num_prompt + params.max_tokens > max_model_len:
        raise ValueError(
            f"sampling.max_tokens: {params.max_tokens} + {num_prompt} prompt tokens exceeds the "
            f"context of {max_model_len}"
        )
