"""The one error, and the one message, for a Hugging Face hub model, tokenizer or dataset that
cannot be loaded (offline, ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``, or not cached).

Every task that loads from the hub turns the loader's ``OSError`` (``ConnectionError``,
``OfflineModeIsEnabled``, ``DatasetNotFoundError``, ...) into :class:`HubUnavailableError` with
:func:`unavailable_message`, which names what failed, why it probably did and the local
alternative (``local_hint``).
"""

from __future__ import annotations


class HubUnavailableError(RuntimeError):
    """A Hugging Face hub model, tokenizer or dataset could not be loaded (offline or not cached)."""


def unavailable_message(kind: str, name: str, exc: Exception, local_hint: str, cache: str | None = None) -> str:
    """One paragraph: what failed to load (``kind`` ``name``, from the hub or ``cache``: the cache
    folder, None for the default one), the underlying error, and how to work offline instead."""
    where = cache or "its cache"
    return (
        f"Could not load the {kind} '{name}' from the Hugging Face hub or {where}: "
        f"{type(exc).__name__}: {exc}. This machine may be offline (or HF_HUB_OFFLINE / "
        f"HF_DATASETS_OFFLINE are set) and '{name}' is not cached. Download it once where there is "
        f"internet{f' into {cache}' if cache else ''}, or work offline: {local_hint}"
    )
