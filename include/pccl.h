/** @file
 * The C API of PCCL v1.0, served by lockstep (liblockstep-pccl, soname libpccl.so.1).
 *
 * A program written for PCCL v1.0 compiles against this header, or keeps its binary and
 * loads this library as libpccl.so.1, and runs on lockstep unchanged: the functions,
 * enum values, struct sizes and field offsets are PCCL v1.0's (docs/pccl.md lists them,
 * and what differs in behaviour). The calls are implemented over lockstep's own C API
 * (lockstep/lockstep.h); lockstep's statuses are translated into PCCL's thirteen result
 * codes by the table in docs/pccl.md. Options PCCL has no call for (the run secret,
 * encryption, striping, congestion control, the status page) are read from LOCKSTEP_*
 * environment variables when a communicator or a master is created.
 */
#ifndef LOCKSTEP_PCCL_H
#define LOCKSTEP_PCCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define PCCL_EXPORT __declspec(dllexport)
#else
#define PCCL_EXPORT __attribute__((visibility("default")))
#endif

/** The master's default port. */
#define CCOIP_PROTOCOL_PORT_MASTER 48148

/** Result codes; nothing else is ever returned. */
typedef enum pcclResult_t {
  pcclSuccess = 0,
  pcclNotInitialized = 1,
  pcclInternalError = 2,
  pcclInvalidArgument = 3,
  pcclInvalidUsage = 4,
  pcclTooFewPeers = 5,
  pcclMasterConnectionFailed = 6,
  pcclRankConnectionFailed = 7,
  pcclRankConnectionLost = 8,
  pcclNoSharedStateAvailable = 9,
  pcclPendingAsyncOps = 10,
  pcclUpdateTopologyFailed = 11,
  pcclTopologyOptimizationFailed = 12
} pcclResult_t;

/** Element types (PCCL numbers i16 before u16). */
typedef enum pcclDataType_t {
  pcclUint8 = 0,
  pcclInt8 = 1,
  pcclInt16 = 2,
  pcclUint16 = 3,
  pcclUint32 = 4,
  pcclInt32 = 5,
  pcclUint64 = 6,
  pcclInt64 = 7,
  pcclFloat16 = 8,
  pcclBFloat16 = 9,
  pcclFloat = 10,
  pcclDouble = 11
} pcclDataType_t;

typedef enum pcclRedOp_t { pcclSum = 0, pcclAvg = 1, pcclProd = 2, pcclMax = 3, pcclMin = 4 } pcclRedOp_t;

typedef enum pcclAttribute_t {
  PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE = 1,
  PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE = 2,
  PCCL_ATTRIBUTE_NUM_DISTINCT_PEER_GROUPS = 3,
  PCCL_ATTRIBUTE_LARGEST_PEER_GROUP_WORLD_SIZE = 4
} pcclAttribute_t;

typedef enum pcclDeviceType_t { pcclDeviceCpu = 0, pcclDeviceCuda = 1 } pcclDeviceType_t;

typedef enum pcclDistributionHint_t {
  pcclDistributionNone = 0,
  pcclDistributionNormal = 1,
  pcclDistributionUniform = 2
} pcclDistributionHint_t;

typedef enum pcclQuantizationAlgorithm_t {
  pcclQuantNone = 0,
  pcclQuantMinMax = 1,
  pcclQuantZeroPointScale = 2
} pcclQuantizationAlgorithm_t;

typedef enum ccoip_inet_protocol_t { inetIPv4 = 0, inetIPv6 = 1 } ccoip_inet_protocol_t;

typedef struct ccoip_ipv4_address_t {
  uint8_t data[4];
} ccoip_ipv4_address_t;

typedef struct ccoip_ipv6_address_t {
  uint8_t data[16];
} ccoip_ipv6_address_t;

typedef struct ccoip_inet_address_t {
  ccoip_inet_protocol_t protocol;
  ccoip_ipv4_address_t ipv4;
  ccoip_ipv6_address_t ipv6;
} ccoip_inet_address_t;

typedef struct ccoip_socket_address_t {
  ccoip_inet_address_t inet;
  uint16_t port;
} ccoip_socket_address_t;

typedef struct pcclComm_t pcclComm_t;
typedef struct pcclMasterInstance_t pcclMasterInstance_t;

typedef struct pcclCommCreateParams_t {
  ccoip_socket_address_t master_address;
  uint32_t peer_group;
  /** Connections per ring neighbour; concurrent all-reduces use one each. 0 means 1. */
  uint32_t p2p_connection_pool_size;
} pcclCommCreateParams_t;

typedef struct pcclReduceInfo_t {
  /** Peers of the group that took part in the successful operation. */
  uint32_t local_world_size;
  uint64_t tx_bytes;
  uint64_t rx_bytes;
} pcclReduceInfo_t;

typedef struct pcclReduceOperandDescriptor_t {
  pcclDataType_t datatype;
  pcclDistributionHint_t distribution_hint;
} pcclReduceOperandDescriptor_t;

typedef struct pcclQuantizationOptions_t {
  pcclDataType_t quantized_datatype;
  pcclQuantizationAlgorithm_t algorithm;
} pcclQuantizationOptions_t;

typedef struct pcclReduceDescriptor_t {
  size_t count;
  pcclRedOp_t op;
  uint64_t tag;
  pcclReduceOperandDescriptor_t src_descriptor;
  pcclQuantizationOptions_t quantization_options;
} pcclReduceDescriptor_t;

typedef struct pcclReduceOpDescriptor_t {
  const void* sendbuf;
  void* recvbuf;
  pcclReduceDescriptor_t descriptor;
} pcclReduceOpDescriptor_t;

/** Filled by pcclAllReduceAsync; owned by the caller; passed to pcclAwaitAsyncReduce. */
typedef struct pcclAsyncReduceOp_t {
  pcclComm_t* comm;
  uint64_t tag;
} pcclAsyncReduceOp_t;

typedef struct pcclTensorInfo_t {
  const char* name;
  void* data;
  size_t count;
  pcclDataType_t datatype;
  pcclDeviceType_t device_type;
  bool allow_content_inequality;
} pcclTensorInfo_t;

typedef struct pcclSharedState_t {
  uint64_t revision;
  size_t count;
  pcclTensorInfo_t* infos;
} pcclSharedState_t;

typedef struct pcclSharedStateSyncInfo_t {
  uint64_t tx_bytes;
  uint64_t rx_bytes;
} pcclSharedStateSyncInfo_t;

typedef struct pcclBuildInfo_t {
  bool has_cuda_support;
} pcclBuildInfo_t;

/** Must precede every other call (pcclNotInitialized otherwise). May be called again. */
PCCL_EXPORT pcclResult_t pcclInit(void);

/** Creates a communicator owned by the calling thread; does not contact the master. */
PCCL_EXPORT pcclResult_t pcclCreateCommunicator(const pcclCommCreateParams_t* params, pcclComm_t** comm_out);
/** Reads an attribute as of the last completed update topology. */
PCCL_EXPORT pcclResult_t pcclGetAttribute(const pcclComm_t* comm, pcclAttribute_t attribute, int* value_out);
/** Leaves the run and frees the communicator, and every async operation not awaited. */
PCCL_EXPORT pcclResult_t pcclDestroyCommunicator(pcclComm_t* comm);
/** Connects to the master and returns once the run has accepted this peer. */
PCCL_EXPORT pcclResult_t pcclConnect(pcclComm_t* comm);
/** Accepts pending peers (every accepted peer calls it); pcclUpdateTopologyFailed: call it again. */
PCCL_EXPORT pcclResult_t pcclUpdateTopology(pcclComm_t* comm);
PCCL_EXPORT pcclResult_t pcclArePeersPending(const pcclComm_t* comm, bool* pending_out);
/** Measures the links and reorders the ring; pcclTopologyOptimizationFailed: call it again. */
PCCL_EXPORT pcclResult_t pcclOptimizeTopology(const pcclComm_t* comm);

/** sendbuf == recvbuf is in place. On failure recvbuf holds what it held before. */
PCCL_EXPORT pcclResult_t pcclAllReduce(const void* sendbuf, void* recvbuf, const pcclReduceDescriptor_t* descriptor,
                                       const pcclComm_t* comm, pcclReduceInfo_t* reduce_info_out);
PCCL_EXPORT pcclResult_t pcclAllReduceAsync(const void* sendbuf, void* recvbuf,
                                            const pcclReduceDescriptor_t* descriptor, const pcclComm_t* comm,
                                            pcclAsyncReduceOp_t* reduce_handle_out);
/** Returns when every operation succeeded, or pcclTooFewPeers once this peer is alone;
 * operations that failed because a peer was lost are retried with the survivors. */
PCCL_EXPORT pcclResult_t pcclAllReduceMultipleWithRetry(const pcclReduceOpDescriptor_t* descriptors, size_t count,
                                                        const pcclComm_t* comm, pcclReduceInfo_t* reduce_info_out,
                                                        int max_in_flight);
PCCL_EXPORT pcclResult_t pcclAwaitAsyncReduce(const pcclAsyncReduceOp_t* reduce_handle,
                                              pcclReduceInfo_t* reduce_info_out);

/** Enforce-popular synchronization of the shared state (lockstep's rule 5 holds:
 * advance the revision by exactly one before each call). */
PCCL_EXPORT pcclResult_t pcclSynchronizeSharedState(const pcclComm_t* comm, pcclSharedState_t* shared_state,
                                                    pcclSharedStateSyncInfo_t* sync_info_out);

/** An embedded lockstep master listening on the address (IPv4). */
PCCL_EXPORT pcclResult_t pcclCreateMaster(ccoip_socket_address_t listen_address, pcclMasterInstance_t** master_out);
PCCL_EXPORT pcclResult_t pcclRunMaster(pcclMasterInstance_t* master);
PCCL_EXPORT pcclResult_t pcclInterruptMaster(pcclMasterInstance_t* master);
PCCL_EXPORT pcclResult_t pcclMasterAwaitTermination(pcclMasterInstance_t* master);
PCCL_EXPORT pcclResult_t pcclDestroyMaster(pcclMasterInstance_t* master);

PCCL_EXPORT pcclResult_t pcclGetBuildInfo(pcclBuildInfo_t* info_out);

#ifdef __cplusplus
}
#endif

#endif /* LOCKSTEP_PCCL_H */
