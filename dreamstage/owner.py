"""A base for Python objects that own native handles and free them in close()."""
from __future__ import annotations


class NativeOwner:
    """Context manager and finalizer around a subclass's idempotent close()."""

    def close(self) -> None:  # pragma: no cover - subclasses free their handles
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
