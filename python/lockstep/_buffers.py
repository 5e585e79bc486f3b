"""The buffer adapters: NumPy arrays and CPU PyTorch tensors validated and used in place,
never copied, and the content digest of their bytes."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, Optional

from . import _lockstep
from ._enums import DType
from ._errors import InvalidArgumentError

_ITEMSIZE = {
    DType.U8: 1, DType.I8: 1, DType.U16: 2, DType.I16: 2, DType.U32: 4, DType.I32: 4,
    DType.U64: 8, DType.I64: 8, DType.F16: 2, DType.BF16: 2, DType.F32: 4, DType.F64: 8,
}

_NUMPY_DTYPES = {
    "uint8": DType.U8, "int8": DType.I8, "uint16": DType.U16, "int16": DType.I16,
    "uint32": DType.U32, "int32": DType.I32, "uint64": DType.U64, "int64": DType.I64,
    "float16": DType.F16, "float32": DType.F32, "float64": DType.F64,
    "bfloat16": DType.BF16,  # ml_dtypes' bfloat16, where installed
}

_TORCH_DTYPE_NAMES = {
    "uint8": DType.U8, "int8": DType.I8, "uint16": DType.U16, "int16": DType.I16,
    "uint32": DType.U32, "int32": DType.I32, "uint64": DType.U64, "int64": DType.I64,
    "float16": DType.F16, "bfloat16": DType.BF16, "float32": DType.F32, "float64": DType.F64,
}
_torch_dtype_map: Optional[Dict[Any, DType]] = None


def _torch_dtypes(torch: Any) -> Dict[Any, DType]:
    global _torch_dtype_map
    if _torch_dtype_map is None:
        # uint16/uint32/uint64 exist in newer PyTorch releases only.
        _torch_dtype_map = {
            getattr(torch, name): code for name, code in _TORCH_DTYPE_NAMES.items() if hasattr(torch, name)
        }
    return _torch_dtype_map


# ---------------------------------------------------------------------- buffers


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """A validated view of an array or tensor: address, element count and dtype; `obj`
    keeps the memory alive for as long as this view is referenced."""

    obj: Any
    address: int
    count: int
    dtype: DType
    writable: bool
    kind: str  # "numpy" or "torch"

    @property
    def nbytes(self) -> int:
        return self.count * _ITEMSIZE[self.dtype]


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _as_buffer(obj: Any, what: str, *, write: bool, allow_grad: bool = False) -> _Buffer:
    """Validates a NumPy array or a CPU PyTorch tensor without copying it.

    Raises InvalidArgumentError for anything that cannot be used in place: another
    type, an unsupported dtype, a non-contiguous layout, a non-CPU tensor, a tensor that
    requires grad, or (when `write`) a read-only array.
    """
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_buffer(torch, obj, what, write=write, allow_grad=allow_grad)
    if np is not None and isinstance(obj, np.ndarray):
        return _numpy_buffer(obj, what, write=write)
    raise InvalidArgumentError(
        f"{what} must be a numpy.ndarray or a CPU torch.Tensor, not {_describe(obj)}"
    )


def _numpy_buffer(arr: Any, what: str, *, write: bool) -> _Buffer:
    dt = arr.dtype
    code = _NUMPY_DTYPES.get(dt.name)
    if code is None or dt.itemsize != _ITEMSIZE[code]:
        raise InvalidArgumentError(
            f"{what} has unsupported dtype {dt.name}; supported: uint8, int8, uint16, int16, uint32, int32, "
            "uint64, int64, float16, float32, float64"
        )
    if not dt.isnative:
        raise InvalidArgumentError(
            f"{what} has non-native byte order ({dt.str}); convert it with arr.astype(arr.dtype.newbyteorder('='))"
        )
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (strides {arr.strides}); lockstep works in place and never copies: "
            "pass numpy.ascontiguousarray(x) (a copy) and copy the result back"
        )
    if write and not arr.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only but lockstep writes into it; pass a writeable array")
    address, _readonly = arr.__array_interface__["data"]
    return _Buffer(arr, int(address), int(arr.size), code, bool(arr.flags.writeable), "numpy")


def _torch_buffer(torch: Any, t: Any, what: str, *, write: bool, allow_grad: bool) -> _Buffer:
    code = _torch_dtypes(torch).get(t.dtype)
    if code is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in _torch_dtypes(torch))
        raise InvalidArgumentError(f"{what} has unsupported dtype {t.dtype}; supported: {supported}")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"{what} is on device {t.device}; lockstep works on CPU memory only: move it with t.cpu() "
            "(and copy the result back)"
        )
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} is not contiguous (strides {tuple(t.stride())}); lockstep works in place and never copies: "
            "pass t.contiguous() (a copy) and copy the result back"
        )
    if t.requires_grad and not allow_grad:
        raise InvalidArgumentError(
            f"{what} requires grad; lockstep reads and writes its memory outside autograd: "
            "pass t.detach() (a view sharing the same memory), e.g. param.detach() or param.grad"
        )
    return _Buffer(t, int(t.data_ptr()), int(t.numel()), code, True, "torch")


def content_hash(data: Any) -> str:
    """The shared-state content digest (``lockstep_hash``) of an array's or tensor's bytes:
    32 lowercase hex digits. Accepts a contiguous NumPy array, a contiguous CPU PyTorch
    tensor (requires_grad is allowed: it is only read) or any C-contiguous buffer
    (bytes, bytearray, memoryview). The same bytes give the same digest, whatever the type."""
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if (torch is not None and isinstance(data, torch.Tensor)) or (np is not None and isinstance(data, np.ndarray)):
        buf = _as_buffer(data, "data", write=False, allow_grad=True)
        return _lockstep.hash_address(buf.address if buf.count else 0, buf.nbytes)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgumentError(
            f"hash() needs a numpy.ndarray, a CPU torch.Tensor or a bytes-like object, not {_describe(data)}"
        ) from None
    with view:
        if not view.c_contiguous:
            raise InvalidArgumentError("hash() needs a C-contiguous buffer")
        return _lockstep.hash_buffer(view)
