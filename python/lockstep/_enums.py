"""The enums of the Python API (element types, reduce ops, quantizations, sync strategies,
log levels), the parsing of the arguments that name them, and the process-wide log level
and status strings."""

from __future__ import annotations

import enum
from typing import Any, Union

from . import _lockstep
from ._errors import InvalidArgumentError

# ------------------------------------------------------------------------ enums


class DType(enum.IntEnum):
    """Element types (``lockstep_dtype_t``)."""

    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    U64 = 6
    I64 = 7
    F16 = 8
    BF16 = 9
    F32 = 10
    F64 = 11


class ReduceOp(enum.IntEnum):
    """Reduction operations (``lockstep_reduce_op_t``). Integer sum and prod wrap around;
    integer avg is the wrapped sum divided by the world size, truncated toward zero;
    max and min propagate NaN; f16 and bf16 compute in f32."""

    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4


class Quantization(enum.IntEnum):
    """Quantization on the wire (floating-point dtypes only): 8-bit or 4-bit codes with
    min-max or zero-point/scale parameters per chunk, or a cast of each element to
    float16 or bfloat16 (float32 and float64 data only)."""

    NONE = 0
    MINMAX = 1
    ZEROPOINT = 2
    MINMAX4 = 3
    ZEROPOINT4 = 4
    F16 = 5
    BF16 = 6


class Distribution(enum.IntEnum):
    """What a quantized all-reduce's values look like (``lockstep_distribution_t``), a
    hint for the 8-bit and 4-bit codes: NORMAL narrows each chunk's codes to its mean ±
    4 (8-bit) or 2.5 (4-bit) standard deviations, clamping the values beyond; NONE and
    UNIFORM span each chunk's whole range."""

    NONE = 0
    UNIFORM = 1
    NORMAL = 2


class SyncStrategy(enum.IntEnum):
    """Shared-state sync strategies (``lockstep_sync_strategy_t``)."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


class LogLevel(enum.IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3
    TRACE = 4


def _parse_op(op: Union[str, int, ReduceOp]) -> int:
    if isinstance(op, str):
        try:
            return ReduceOp[op.strip().upper()]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown reduce op {op!r}: use 'sum', 'avg', 'prod', 'max', 'min' or lockstep.ReduceOp"
            ) from None
    if isinstance(op, int) and not isinstance(op, bool):
        try:
            return ReduceOp(op)
        except ValueError:
            pass
    raise InvalidArgumentError(f"unknown reduce op {op!r}: use 'sum', 'avg', 'prod', 'max', 'min' or lockstep.ReduceOp")


def _parse_distribution(d: Union[None, str, int, Distribution]) -> int:
    if d is None:
        return Distribution.NONE
    if isinstance(d, str) and d.strip().upper() in Distribution.__members__:
        return Distribution[d.strip().upper()]
    if isinstance(d, int) and not isinstance(d, bool):
        try:
            return Distribution(d)
        except ValueError:
            pass
    raise InvalidArgumentError(f"unknown distribution {d!r}: use None, 'none', 'uniform', 'normal' "
                               "or lockstep.Distribution")


def _parse_quantization(q: Union[None, str, int, Quantization]) -> int:
    if q is None:
        return Quantization.NONE
    if isinstance(q, str):
        name = q.strip().upper().replace("-", "").replace("_", "")
        aliases = {"NONE": Quantization.NONE, "MINMAX": Quantization.MINMAX, "MINMAXU8": Quantization.MINMAX,
                   "ZEROPOINT": Quantization.ZEROPOINT, "ZEROPOINTU8": Quantization.ZEROPOINT,
                   "MINMAX4": Quantization.MINMAX4, "MINMAXU4": Quantization.MINMAX4,
                   "ZEROPOINT4": Quantization.ZEROPOINT4, "ZEROPOINTU4": Quantization.ZEROPOINT4,
                   "F16": Quantization.F16, "FLOAT16": Quantization.F16, "HALF": Quantization.F16,
                   "BF16": Quantization.BF16, "BFLOAT16": Quantization.BF16}
        if name in aliases:
            return aliases[name]
    elif isinstance(q, int) and not isinstance(q, bool):
        try:
            return Quantization(q)
        except ValueError:
            pass
    raise InvalidArgumentError(f"unknown quantization {q!r}: use None, 'minmax', 'zeropoint', "
                               "'minmax4', 'zeropoint4', 'f16', 'bf16' or lockstep.Quantization")


def _parse_strategy(strategy: Union[str, int, SyncStrategy]) -> int:
    if isinstance(strategy, str):
        try:
            return SyncStrategy[strategy.strip().upper().replace("-", "_")]
        except KeyError:
            pass
    elif isinstance(strategy, int) and not isinstance(strategy, bool):
        try:
            return SyncStrategy(strategy)
        except ValueError:
            pass
    raise InvalidArgumentError(
        f"unknown sync strategy {strategy!r}: use 'enforce_popular', 'receive_only', 'send_only' or lockstep.SyncStrategy"
    )


def _check_uint(name: str, value: Any, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = value.__index__()
        except (AttributeError, TypeError):
            raise InvalidArgumentError(f"{name} must be an int, not {type(value).__name__}") from None
    if not 0 <= value < (1 << bits):
        raise InvalidArgumentError(f"{name} must be in 0..{(1 << bits) - 1}, got {value}")
    return int(value)


def set_log_level(level: Union[str, int, LogLevel]) -> None:
    """Sets the process-wide log level: 'error', 'warn', 'info', 'debug', 'trace' (or :class:`LogLevel`)."""
    if isinstance(level, str):
        try:
            level = LogLevel[level.strip().upper()]
        except KeyError:
            raise InvalidArgumentError(f"unknown log level {level!r}") from None
    _lockstep.set_log_level(int(level))


def status_string(status: int) -> str:
    """The C library's description of a status code (``lockstep_status_string``)."""
    return _lockstep.status_string(int(status))
