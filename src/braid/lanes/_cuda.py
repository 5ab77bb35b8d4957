"""The few CUDA driver calls braid needs, through ctypes on libcuda.

Why ctypes and not cuda-bindings: the calls are few (IPC handles, async copies between raw
pointers, stream memory operations, host registration), their C signatures are stable across
driver versions, and ctypes costs ~1 us a call with no dependency to pin. Every call is checked
and raises LaneFailureError with the driver's error name.
"""
from __future__ import annotations

import ctypes
import functools

from ..errors import LaneFailureError

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7      # a process-wide unique id of the allocation a pointer lies in
CU_EVENT_DISABLE_TIMING = 0x2
CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2
MAX_BATCH = 255                         # cuStreamBatchMemOp takes fewer than 256 operations
IPC_HANDLE_BYTES = 64


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_u64 = ctypes.c_uint64
_u32 = ctypes.c_uint32
_vp = ctypes.c_void_p


class MemOp(ctypes.Structure):
    """One entry of cuStreamBatchMemOp's array (CUstreamBatchMemOpParams, a 48-byte union): the
    wait and write members share this layout (a 32-bit operation's value in the low word)."""
    _fields_ = [("operation", _u32), ("_pad0", _u32), ("address", _u64), ("value", _u64),
                ("flags", _u32), ("_pad1", _u32), ("alias", _u64), ("_pad2", _u64)]


assert ctypes.sizeof(MemOp) == 48


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """libcuda, with argument types declared. Raises OSError when there is no driver."""
    cu = ctypes.CDLL("libcuda.so.1")
    sigs = {
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuMemGetAddressRange_v2": [ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_size_t), _u64],
        "cuIpcGetMemHandle": [ctypes.POINTER(IpcHandle), _u64],
        "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_u64), IpcHandle, ctypes.c_uint],
        "cuIpcCloseMemHandle": [_u64],
        "cuMemcpyAsync": [_u64, _u64, ctypes.c_size_t, _vp],
        "cuStreamWaitValue32_v2": [_vp, _u64, ctypes.c_uint32, ctypes.c_uint],
        "cuStreamWriteValue32_v2": [_vp, _u64, ctypes.c_uint32, ctypes.c_uint],
        "cuMemHostRegister_v2": [_vp, ctypes.c_size_t, ctypes.c_uint],
        "cuMemHostUnregister": [_vp],
        "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(_u64), _vp, ctypes.c_uint],
        "cuPointerGetAttribute": [_vp, ctypes.c_int, _u64],
        "cuEventCreate": [ctypes.POINTER(_vp), ctypes.c_uint],
        "cuEventDestroy_v2": [_vp],
        "cuEventRecord": [_vp, _vp],
        "cuEventQuery": [_vp],
        "cuEventSynchronize": [_vp],
        "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), _vp, _vp],
        "cuStreamWaitEvent": [_vp, _vp, ctypes.c_uint],
        "cuGraphLaunch": [_vp, _vp],
        "cuStreamIsCapturing": [_vp, ctypes.POINTER(ctypes.c_int)],
        "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
        "cuCtxSetCurrent": [_vp],
        "cuStreamBatchMemOp_v2": [_vp, ctypes.c_uint, ctypes.POINTER(MemOp), ctypes.c_uint],
    }
    for name, args in sigs.items():
        fn = getattr(cu, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return cu


def check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib().cuGetErrorName(rc, ctypes.byref(name))
        raise LaneFailureError(f"CUDA driver call {what} failed: {(name.value or b'?').decode()} ({rc})")


def address_range(ptr: int) -> tuple[int, int]:
    base, size = _u64(), ctypes.c_size_t()
    check(lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return base.value, size.value


def ipc_handle(base: int) -> bytes:
    h = IpcHandle()
    check(lib().cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    h = IpcHandle()
    ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
    ptr = _u64()
    check(lib().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
    return ptr.value


def ipc_close(ptr: int) -> None:
    check(lib().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    check(lib().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def wait_value(stream: int, addr: int, value: int) -> None:
    check(lib().cuStreamWaitValue32_v2(stream, addr, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue32")


def write_value(stream: int, addr: int, value: int) -> None:
    check(lib().cuStreamWriteValue32_v2(stream, addr, value & 0xFFFFFFFF, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue32")


@functools.lru_cache(maxsize=1)
def batched() -> bool:
    """BRAID_CE_BATCH, read once per process."""
    from .. import envs
    return bool(envs.get("BRAID_CE_BATCH"))


def memops(stream: int, ops: list[tuple[bool, int, int]]) -> None:
    """Stream memory operations in order, as one batch (one node in a captured graph instead of
    one per operation: a graph launch costs ~1.1 us of host time per memory-operation node).
    `ops`: (wait, address, value); a wait is >= (cyclic 32-bit), a write sets the word."""
    if len(ops) == 1 or not batched():
        for wait, addr, value in ops:
            (wait_value if wait else write_value)(stream, addr, value)
        return
    for at in range(0, len(ops), MAX_BATCH):
        part = ops[at: at + MAX_BATCH]
        check(lib().cuStreamBatchMemOp_v2(stream, len(part), _memop_array(part), 0), "cuStreamBatchMemOp")


def _memop_array(ops: list[tuple[bool, int, int]]) -> ctypes.Array:
    arr = (MemOp * len(ops))()
    for m, (wait, addr, value) in zip(arr, ops):
        m.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32 if wait else CU_STREAM_MEM_OP_WRITE_VALUE_32
        m.address = addr
        m.value = value & 0xFFFFFFFF
        m.flags = CU_STREAM_WAIT_VALUE_GEQ if wait else CU_STREAM_WRITE_VALUE_DEFAULT
    return arr


def memop_batch(ops: list[tuple[bool, int, int]]):
    """`ops` as cuStreamBatchMemOp's array, made once for a program that posts it call after call
    (memops_posted); None where memops would post them one by one (a single operation, batching
    off, or more than one batch holds)."""
    if len(ops) == 1 or len(ops) > MAX_BATCH or not batched():
        return None
    return _memop_array(ops)


def memops_posted(stream: int, arr) -> None:
    """A batch from memop_batch on `stream` (what memops does with the same operations)."""
    check(lib().cuStreamBatchMemOp_v2(stream, len(arr), arr, 0), "cuStreamBatchMemOp")


def host_register(ptr: int, nbytes: int) -> int:
    """Pin and map host memory for every context; returns the device pointer of `ptr`."""
    check(lib().cuMemHostRegister_v2(ptr, nbytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
          "cuMemHostRegister")
    dptr = _u64()
    check(lib().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ptr, 0), "cuMemHostGetDevicePointer")
    return dptr.value


def host_unregister(ptr: int) -> None:
    check(lib().cuMemHostUnregister(ptr), "cuMemHostUnregister")


class _Out:
    """A reused out-argument (its byref made once): the hot calls below are called from the
    caller's thread only, ~1 us cheaper each than a fresh c_uint64 and byref."""
    def __init__(self):
        self.value = _u64()
        self.ref = ctypes.byref(self.value)


_OUT = _Out()


def buffer_id(ptr: int) -> int:
    """The driver's process-wide unique id of the allocation `ptr` lies in: a new allocation at
    the same address (the caching allocator gave a segment back and got another one there) has
    another id, so a peer's mapping of the old one is known to be stale."""
    rc = lib().cuPointerGetAttribute(_OUT.ref, CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)
    if rc:
        check(rc, "cuPointerGetAttribute(BUFFER_ID)")
    return _OUT.value.value


def event_create(timing: bool = False) -> int:
    """An event, without timing unless asked (ordering between streams only); `event_destroy`
    frees it."""
    ev = _vp()
    check(lib().cuEventCreate(ctypes.byref(ev), 0 if timing else CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    return ev.value


def event_elapsed_s(start: int, end: int) -> float:
    """Seconds between two timing events on the GPU, once `end` has happened (waits for it)."""
    check(lib().cuEventSynchronize(end), "cuEventSynchronize")
    ms = ctypes.c_float()
    check(lib().cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
    return ms.value * 1e-3


def stream_capturing(stream: int) -> bool:
    """Is `stream` capturing a graph (or can that not be told)?"""
    status = ctypes.c_int()
    return lib().cuStreamIsCapturing(stream, ctypes.byref(status)) != 0 or status.value != 0


def event_destroy(event: int) -> None:
    check(lib().cuEventDestroy_v2(event), "cuEventDestroy")


def event_record(event: int, stream: int) -> None:
    rc = lib().cuEventRecord(event, stream)
    if rc:
        check(rc, "cuEventRecord")


def stream_wait_event(stream: int, event: int) -> None:
    rc = lib().cuStreamWaitEvent(stream, event, 0)
    if rc:
        check(rc, "cuStreamWaitEvent")


def graph_launch(graph_exec: int, stream: int) -> None:
    rc = lib().cuGraphLaunch(graph_exec, stream)
    if rc:
        check(rc, "cuGraphLaunch")


def event_query(event: int) -> bool:
    """True once the event's work is done (cuEventQuery's CUDA_ERROR_NOT_READY: False)."""
    rc = lib().cuEventQuery(event)
    if rc == 600:
        return False
    check(rc, "cuEventQuery")
    return True


def native_fns() -> dict:
    """The driver functions native code calls (comm/native_rounds.py), as addresses, and the
    calling thread's current context (the native thread makes it current on itself)."""
    cu = lib()
    ctx = _vp()
    check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    addr = lambda fn: ctypes.cast(fn, _vp).value     # noqa: E731
    return {"wait_event": addr(cu.cuStreamWaitEvent), "graph_launch": addr(cu.cuGraphLaunch),
            "write_value": addr(cu.cuStreamWriteValue32_v2), "set_ctx": addr(cu.cuCtxSetCurrent),
            "ptr_attr": addr(cu.cuPointerGetAttribute), "event_record": addr(cu.cuEventRecord),
            "is_capturing": addr(cu.cuStreamIsCapturing), "ctx": ctx.value or 0,
            "memcpy": addr(cu.cuMemcpyAsync), "wait_value": addr(cu.cuStreamWaitValue32_v2),
            "batch": addr(cu.cuStreamBatchMemOp_v2) if batched() else 0}
