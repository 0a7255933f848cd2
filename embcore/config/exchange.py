"""``exchange_compression``: what the rows and gradients of sharded tables travel as.

With several processes, a sharded table's rows travel from their holders to the processes that
look them up (the forward exchange) and their gradients back to the owners (the backward
exchange), each an ``all_to_all`` (step/exchange.py). ``ExchangeCompression`` says the format of
each direction; ids always travel exact, and one process exchanges nothing (docs/semantics.md
section 5, "Compressed exchange"). The codec itself is step/codec.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

Format = Literal["fp32", "bf16", "fp16", "fp8"]
FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")
KEYS = ("forward", "backward", "error_feedback")


@dataclass(frozen=True)
class ExchangeCompression:
    """The formats of a sharded step's two exchanges: rows forward, gradients backward.

    Args:
        forward: what the rows sent to the processes looking them up travel as.
        backward: what the row gradients sent to the rows' owners travel as.
        error_feedback: with a lossy ``backward``, each process keeps what compressing a row's
            gradient lost and adds it to that row's gradient at the next step that sends it
            (docs/semantics.md section 5).

    The formats: ``"fp32"`` (exact, the default), ``"bf16"`` (bfloat16, 2 bytes a value),
    ``"fp16"`` (float16 with a float32 scale per row, 2 bytes a value + 4 a row) and ``"fp8"``
    (float8_e4m3fn with a float32 scale per row, 1 byte a value + 4 a row). Ids always travel
    exact; one process exchanges nothing, so its results do not depend on this option.

    Raises:
        ValueError: an unknown format (naming it and the known ones).
        TypeError: a format that is not a string, or ``error_feedback`` not a bool.

    Example:
        >>> import embcore as ec
        >>> c = ec.ExchangeCompression(forward="bf16", backward="fp8")
        >>> c.lossy
        True
        >>> ec.ExchangeCompression.of("fp16") == ec.ExchangeCompression("fp16", "fp16")
        True
    """

    forward: Format = "fp32"
    backward: Format = "fp32"
    error_feedback: bool = True

    def __post_init__(self) -> None:
        for key in ("forward", "backward"):
            value = getattr(self, key)
            if not isinstance(value, str):
                raise TypeError(f"ExchangeCompression: {key} must be one of {list(FORMATS)}, got "
                                f"{type(value).__name__} {value!r}")
            if value not in FORMATS:
                raise ValueError(f"ExchangeCompression: unknown {key} format {value!r}; one of "
                                 f"{list(FORMATS)}")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"ExchangeCompression: error_feedback must be True or False, got "
                            f"{type(self.error_feedback).__name__} {self.error_feedback!r}")

    @property
    def lossy(self) -> bool:
        """Whether either direction is compressed (anything but fp32)."""
        return self.forward != "fp32" or self.backward != "fp32"

    @classmethod
    def of(cls, value: Any) -> ExchangeCompression:
        """``exchange_compression`` as the engine takes it: None (fp32 both ways), a format name
        for both directions (``"bf16"``), or an ``ExchangeCompression``.

        Raises:
            TypeError / ValueError: anything else, naming it.
        """
        if value is None:
            return cls()
        if isinstance(value, ExchangeCompression):
            return value
        if isinstance(value, str):
            if value not in FORMATS:
                raise ValueError(f"exchange_compression: unknown format {value!r}; give one of "
                                 f"{list(FORMATS)} (both directions) or "
                                 f"ec.ExchangeCompression(forward=..., backward=...)")
            name = cast(Format, value)
            return cls(name, name)
        raise TypeError(f"exchange_compression must be None, a format name {list(FORMATS)} or "
                        f"an ec.ExchangeCompression, got {type(value).__name__} {value!r}")

    @classmethod
    def parse(cls, text: str, error_feedback: bool = True) -> ExchangeCompression:
        """A command line's form: ``"FORMAT"`` (both directions) or ``"FORWARD,BACKWARD"``
        (e.g. ``"bf16,fp8"``).

        Raises:
            ValueError: another form or an unknown format, naming it.
        """
        parts = text.split(",")
        if len(parts) not in (1, 2) or any(p not in FORMATS for p in parts):
            raise ValueError(f"exchange compression {text!r}: give FORMAT or FORWARD,BACKWARD "
                             f"with formats among {list(FORMATS)} (e.g. 'bf16' or 'bf16,fp8')")
        fwd, bwd = cast(Format, parts[0]), cast(Format, parts[-1])
        return cls(fwd, bwd, error_feedback)

    def to_dict(self) -> dict[str, Any]:
        """``{"forward", "backward", "error_feedback"}`` (JSON-safe; ``from_dict`` reads it)."""
        return {"forward": self.forward, "backward": self.backward,
                "error_feedback": self.error_feedback}

    @classmethod
    def from_dict(cls, d: Any) -> ExchangeCompression:
        """The compression ``to_dict`` wrote.

        Raises:
            ValueError: an unknown key or format. TypeError: not a dict, or a value of the
                wrong type.
        """
        if not isinstance(d, dict):
            raise TypeError(f"spec: exchange_compression must be an object {{'forward', "
                            f"'backward', 'error_feedback'}}, got {type(d).__name__} {d!r}")
        unknown = [k for k in d if k not in KEYS]
        if unknown:
            raise ValueError(f"spec: exchange_compression: unknown key {unknown[0]!r} (the keys "
                             f"are {list(KEYS)})")
        return cls(**d)
