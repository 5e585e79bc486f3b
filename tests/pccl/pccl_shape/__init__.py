"""A package shaped like PCCL's Python package, for the tests of lockstep's PCCL-compatible
library: cffi in ABI mode, PCCL v1.0's declarations written out (not parsed from a
header), and the library loaded as ``libpccl.so`` from the package's own directory, which
is how PCCL's package finds its library. Pointing it at lockstep is a link (or a copy):
``ln -s /usr/lib/x86_64-linux-gnu/libpccl.so.1 <package dir>/libpccl.so`` (docs/pccl.md).

Objects free what they created from their finalizers, as PCCL's do: a communicator calls
pcclDestroyCommunicator, a master pcclMasterAwaitTermination then pcclDestroyMaster.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import cffi

ffi = cffi.FFI()
ffi.cdef("""
typedef enum { pcclSuccess = 0, pcclNotInitialized = 1, pcclInternalError = 2, pcclInvalidArgument = 3,
  pcclInvalidUsage = 4, pcclTooFewPeers = 5, pcclMasterConnectionFailed = 6, pcclRankConnectionFailed = 7,
  pcclRankConnectionLost = 8, pcclNoSharedStateAvailable = 9, pcclPendingAsyncOps = 10,
  pcclUpdateTopologyFailed = 11, pcclTopologyOptimizationFailed = 12 } pcclResult_t;
typedef enum { pcclUint8 = 0, pcclInt8 = 1, pcclInt16 = 2, pcclUint16 = 3, pcclUint32 = 4, pcclInt32 = 5,
  pcclUint64 = 6, pcclInt64 = 7, pcclFloat16 = 8, pcclBFloat16 = 9, pcclFloat = 10, pcclDouble = 11 } pcclDataType_t;
typedef enum { pcclSum = 0, pcclAvg = 1, pcclProd = 2, pcclMax = 3, pcclMin = 4 } pcclRedOp_t;
typedef enum { PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE = 1, PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE = 2,
  PCCL_ATTRIBUTE_NUM_DISTINCT_PEER_GROUPS = 3, PCCL_ATTRIBUTE_LARGEST_PEER_GROUP_WORLD_SIZE = 4 } pcclAttribute_t;
typedef enum { pcclDeviceCpu = 0, pcclDeviceCuda = 1 } pcclDeviceType_t;
typedef enum { pcclDistributionNone = 0, pcclDistributionNormal = 1, pcclDistributionUniform = 2 } pcclDistributionHint_t;
typedef enum { pcclQuantNone = 0, pcclQuantMinMax = 1, pcclQuantZeroPointScale = 2 } pcclQuantizationAlgorithm_t;
typedef enum { inetIPv4 = 0, inetIPv6 = 1 } ccoip_inet_protocol_t;
typedef struct { uint8_t data[4]; } ccoip_ipv4_address_t;
typedef struct { uint8_t data[16]; } ccoip_ipv6_address_t;
typedef struct { ccoip_inet_protocol_t protocol; ccoip_ipv4_address_t ipv4; ccoip_ipv6_address_t ipv6; } ccoip_inet_address_t;
typedef struct { ccoip_inet_address_t inet; uint16_t port; } ccoip_socket_address_t;
typedef struct pcclComm_t pcclComm_t;
typedef struct pcclMasterInstance_t pcclMasterInstance_t;
typedef struct { ccoip_socket_address_t master_address; uint32_t peer_group; uint32_t p2p_connection_pool_size; } pcclCommCreateParams_t;
typedef struct { uint32_t local_world_size; uint64_t tx_bytes; uint64_t rx_bytes; } pcclReduceInfo_t;
typedef struct { pcclDataType_t datatype; pcclDistributionHint_t distribution_hint; } pcclReduceOperandDescriptor_t;
typedef struct { pcclDataType_t quantized_datatype; pcclQuantizationAlgorithm_t algorithm; } pcclQuantizationOptions_t;
typedef struct { size_t count; pcclRedOp_t op; uint64_t tag; pcclReduceOperandDescriptor_t src_descriptor;
  pcclQuantizationOptions_t quantization_options; } pcclReduceDescriptor_t;
typedef struct { const void* sendbuf; void* recvbuf; pcclReduceDescriptor_t descriptor; } pcclReduceOpDescriptor_t;
typedef struct { pcclComm_t* comm; uint64_t tag; } pcclAsyncReduceOp_t;
typedef struct { const char* name; void* data; size_t count; pcclDataType_t datatype; pcclDeviceType_t device_type;
  bool allow_content_inequality; } pcclTensorInfo_t;
typedef struct { uint64_t revision; size_t count; pcclTensorInfo_t* infos; } pcclSharedState_t;
typedef struct { uint64_t tx_bytes; uint64_t rx_bytes; } pcclSharedStateSyncInfo_t;
typedef struct { bool has_cuda_support; } pcclBuildInfo_t;

pcclResult_t pcclInit(void);
pcclResult_t pcclCreateCommunicator(const pcclCommCreateParams_t*, pcclComm_t**);
pcclResult_t pcclGetAttribute(const pcclComm_t*, pcclAttribute_t, int*);
pcclResult_t pcclDestroyCommunicator(pcclComm_t*);
pcclResult_t pcclConnect(pcclComm_t*);
pcclResult_t pcclUpdateTopology(pcclComm_t*);
pcclResult_t pcclArePeersPending(const pcclComm_t*, bool*);
pcclResult_t pcclOptimizeTopology(const pcclComm_t*);
pcclResult_t pcclAllReduce(const void*, void*, const pcclReduceDescriptor_t*, const pcclComm_t*, pcclReduceInfo_t*);
pcclResult_t pcclAllReduceAsync(const void*, void*, const pcclReduceDescriptor_t*, const pcclComm_t*, pcclAsyncReduceOp_t*);
pcclResult_t pcclAllReduceMultipleWithRetry(const pcclReduceOpDescriptor_t*, size_t, const pcclComm_t*, pcclReduceInfo_t*, int);
pcclResult_t pcclAwaitAsyncReduce(const pcclAsyncReduceOp_t*, pcclReduceInfo_t*);
pcclResult_t pcclSynchronizeSharedState(const pcclComm_t*, pcclSharedState_t*, pcclSharedStateSyncInfo_t*);
pcclResult_t pcclCreateMaster(ccoip_socket_address_t, pcclMasterInstance_t**);
pcclResult_t pcclRunMaster(pcclMasterInstance_t*);
pcclResult_t pcclInterruptMaster(pcclMasterInstance_t*);
pcclResult_t pcclMasterAwaitTermination(pcclMasterInstance_t*);
pcclResult_t pcclDestroyMaster(pcclMasterInstance_t*);
pcclResult_t pcclGetBuildInfo(pcclBuildInfo_t*);
""")

C = ffi.dlopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libpccl.so"))

RESULT_NAMES = {getattr(C, name): name for name in (
    "pcclSuccess", "pcclNotInitialized", "pcclInternalError", "pcclInvalidArgument", "pcclInvalidUsage",
    "pcclTooFewPeers", "pcclMasterConnectionFailed", "pcclRankConnectionFailed", "pcclRankConnectionLost",
    "pcclNoSharedStateAvailable", "pcclPendingAsyncOps", "pcclUpdateTopologyFailed",
    "pcclTopologyOptimizationFailed")}


class PCCLError(Exception):
    def __init__(self, result: int, call: str) -> None:
        # Like PCCL's package: a value outside its enum cannot be named, and raises.
        self.name = RESULT_NAMES[result]
        self.result = result
        super().__init__(f"{call}: {self.name}")


def check(result: int, call: str) -> None:
    if result != C.pcclSuccess:
        raise PCCLError(result, call)


def init() -> None:
    check(C.pcclInit(), "pcclInit")


def address(host: str, port: int):
    a = ffi.new("ccoip_socket_address_t*")
    a.inet.protocol = C.inetIPv4
    for i, part in enumerate(host.split(".")):
        a.inet.ipv4.data[i] = int(part)
    a.port = port
    return a


class MasterNode:
    def __init__(self, host: str, port: int) -> None:
        out = ffi.new("pcclMasterInstance_t**")
        check(C.pcclCreateMaster(address(host, port)[0], out), "pcclCreateMaster")
        self._master = out[0]

    def run(self) -> None:
        check(C.pcclRunMaster(self._master), "pcclRunMaster")

    def interrupt(self) -> None:
        check(C.pcclInterruptMaster(self._master), "pcclInterruptMaster")

    def __del__(self) -> None:
        if getattr(self, "_master", None) is not None:
            C.pcclMasterAwaitTermination(self._master)
            C.pcclDestroyMaster(self._master)
            self._master = None


class Communicator:
    def __init__(self, host: str, port: int, peer_group: int = 0, p2p_connection_pool_size: int = 1) -> None:
        params = ffi.new("pcclCommCreateParams_t*")
        params.master_address = address(host, port)[0]
        params.peer_group = peer_group
        params.p2p_connection_pool_size = p2p_connection_pool_size
        out = ffi.new("pcclComm_t**")
        check(C.pcclCreateCommunicator(params, out), "pcclCreateCommunicator")
        self._comm = out[0]

    def __del__(self) -> None:
        if getattr(self, "_comm", None) is not None:
            C.pcclDestroyCommunicator(self._comm)
            self._comm = None

    def connect(self) -> None:
        check(C.pcclConnect(self._comm), "pcclConnect")

    def update_topology(self) -> None:
        check(C.pcclUpdateTopology(self._comm), "pcclUpdateTopology")

    def are_peers_pending(self) -> bool:
        out = ffi.new("bool*")
        check(C.pcclArePeersPending(self._comm, out), "pcclArePeersPending")
        return bool(out[0])

    def get_attribute(self, attribute: int) -> int:
        out = ffi.new("int*")
        check(C.pcclGetAttribute(self._comm, attribute, out), "pcclGetAttribute")
        return int(out[0])

    def all_reduce(self, send, recv, count: int, datatype: int, op: int, tag: int,
                   quantized_datatype: int = -1, algorithm: int = 0) -> Tuple[int, int, int]:
        """send and recv: cffi buffers; returns (local world size, tx bytes, rx bytes)."""
        desc = ffi.new("pcclReduceDescriptor_t*")
        desc.count = count
        desc.op = op
        desc.tag = tag
        desc.src_descriptor.datatype = datatype
        desc.src_descriptor.distribution_hint = C.pcclDistributionNone
        desc.quantization_options.quantized_datatype = datatype if quantized_datatype < 0 else quantized_datatype
        desc.quantization_options.algorithm = algorithm
        info = ffi.new("pcclReduceInfo_t*")
        check(C.pcclAllReduce(send, recv, desc, self._comm, info), "pcclAllReduce")
        return info.local_world_size, info.tx_bytes, info.rx_bytes

    def sync_shared_state(self, revision: int, tensors: Sequence[Tuple[str, object, int, int]]) -> Tuple[int, int, int]:
        """tensors: (name, cffi buffer, count, datatype); returns (revision, tx, rx)."""
        names: List[object] = [ffi.new("char[]", name.encode()) for name, _, _, _ in tensors]
        infos = ffi.new("pcclTensorInfo_t[]", len(tensors))
        for i, (_, data, count, datatype) in enumerate(tensors):
            infos[i].name = names[i]
            infos[i].data = data
            infos[i].count = count
            infos[i].datatype = datatype
            infos[i].device_type = C.pcclDeviceCpu
            infos[i].allow_content_inequality = False
        state = ffi.new("pcclSharedState_t*")
        state.revision = revision
        state.count = len(tensors)
        state.infos = infos
        info = ffi.new("pcclSharedStateSyncInfo_t*")
        check(C.pcclSynchronizeSharedState(self._comm, state, info), "pcclSynchronizeSharedState")
        return state.revision, info.tx_bytes, info.rx_bytes


def layouts() -> Dict[str, object]:
    """Sizes and offsets as this package's declarations give them."""
    out: Dict[str, object] = {}
    for struct, fields in {
        "ccoip_inet_address_t": ["protocol", "ipv4", "ipv6"],
        "ccoip_socket_address_t": ["inet", "port"],
        "pcclCommCreateParams_t": ["master_address", "peer_group", "p2p_connection_pool_size"],
        "pcclReduceInfo_t": ["local_world_size", "tx_bytes", "rx_bytes"],
        "pcclReduceOperandDescriptor_t": ["datatype", "distribution_hint"],
        "pcclQuantizationOptions_t": ["quantized_datatype", "algorithm"],
        "pcclReduceDescriptor_t": ["count", "op", "tag", "src_descriptor", "quantization_options"],
        "pcclReduceOpDescriptor_t": ["sendbuf", "recvbuf", "descriptor"],
        "pcclAsyncReduceOp_t": ["comm", "tag"],
        "pcclTensorInfo_t": ["name", "data", "count", "datatype", "device_type", "allow_content_inequality"],
        "pcclSharedState_t": ["revision", "count", "infos"],
        "pcclSharedStateSyncInfo_t": ["tx_bytes", "rx_bytes"],
        "pcclBuildInfo_t": ["has_cuda_support"],
    }.items():
        out[struct] = (ffi.sizeof(struct), [ffi.offsetof(struct, f) for f in fields])
    return out
