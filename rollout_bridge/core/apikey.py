"""The API key of a rollout server (SGLang `--api-key`, vLLM `--api-key` / `VLLM_API_KEY`).

What: `ApiKey` holds the secret; its repr and str are redacted and it refuses to be pickled, so it
cannot reach a log line, an error message, a checkpoint or a broadcast by accident. `header()` is
the only way it leaves the process (as `Authorization: Bearer <key>`, what both servers check);
`reveal()` hands it to a server launcher's environment. `read_api_key` reads it from a file (first
line) or an environment variable. One type for every engine, the driver and the launchers.
"""

from __future__ import annotations

import os


class ApiKey:
    """The server's API key; never shown by repr/str (so it cannot reach a log by accident)."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        if isinstance(value, ApiKey):
            value = value.reveal()
        if not isinstance(value, str):
            raise TypeError(f"API key must be a string, got {type(value).__name__}")
        value = value.strip()
        if not value:
            raise ValueError("empty API key")
        self._value = value

    @classmethod
    def of(cls, value: ApiKey | str | None) -> ApiKey | None:
        """`value` as an `ApiKey` (a string is wrapped, None stays None)."""
        return value if value is None or isinstance(value, ApiKey) else cls(value)

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._value}"}

    def reveal(self) -> str:
        """The key itself (only for handing it to a server launcher)."""
        return self._value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKey) and other._value == self._value

    def __hash__(self) -> int:
        return hash((ApiKey, self._value))

    def __repr__(self) -> str:
        return "ApiKey(<redacted>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __reduce__(self):  # never pickled into a checkpoint or a broadcast
        raise TypeError("ApiKey is not picklable")


def read_api_key(env: str | None = None, file: str | None = None) -> ApiKey | None:
    """The API key from a file (first line) or an environment variable; None if neither is set.

    A file wins over the variable. A named file that does not exist is an error (a typo must not
    silently disable authentication); an unset variable is not.
    """
    if file:
        with open(os.path.expanduser(file)) as f:
            text = f.readline()
        if not text.strip():
            raise ValueError(f"API key file {file} is empty")
        return ApiKey(text)
    if env and os.environ.get(env, "").strip():
        return ApiKey(os.environ[env])
    return None
