/* The PCCL-compatible header against PCCL v1.0's ABI as measured (docs/pccl.md, "The
 * ABI"): every struct's size and field offsets and every enum constant's value, in C, and
 * the library's exports: every one of the 19 functions resolved from libpccl.so.1 by
 * name, as a program built against PCCL's own library finds them. Exit status 0 if all
 * match; each mismatch is printed. */
#include <pccl.h>

#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

static int g_failures = 0;

#define EXPECT_EQ(what, actual, expected)                                                        \
  do {                                                                                           \
    long long a_ = (long long)(actual), e_ = (long long)(expected);                              \
    if (a_ != e_) {                                                                              \
      printf("FAIL %s: %lld, PCCL v1.0 has %lld\n", what, a_, e_);                               \
      ++g_failures;                                                                              \
    }                                                                                            \
  } while (0)
#define SIZE(type, n) EXPECT_EQ("sizeof " #type, sizeof(type), n)
#define OFFSET(type, field, n) EXPECT_EQ("offsetof " #type "." #field, offsetof(type, field), n)
#define VALUE(constant, n) EXPECT_EQ(#constant, constant, n)

int main(void) {
  SIZE(pcclResult_t, 4);
  SIZE(pcclDataType_t, 4);
  SIZE(pcclRedOp_t, 4);
  SIZE(pcclAttribute_t, 4);
  SIZE(pcclDeviceType_t, 4);
  SIZE(pcclDistributionHint_t, 4);
  SIZE(pcclQuantizationAlgorithm_t, 4);

  SIZE(ccoip_inet_address_t, 24);
  OFFSET(ccoip_inet_address_t, protocol, 0);
  OFFSET(ccoip_inet_address_t, ipv4, 4);
  OFFSET(ccoip_inet_address_t, ipv6, 8);
  SIZE(ccoip_socket_address_t, 28);
  OFFSET(ccoip_socket_address_t, inet, 0);
  OFFSET(ccoip_socket_address_t, port, 24);
  SIZE(pcclCommCreateParams_t, 36);
  OFFSET(pcclCommCreateParams_t, master_address, 0);
  OFFSET(pcclCommCreateParams_t, peer_group, 28);
  OFFSET(pcclCommCreateParams_t, p2p_connection_pool_size, 32);
  SIZE(pcclReduceInfo_t, 24);
  OFFSET(pcclReduceInfo_t, local_world_size, 0);
  OFFSET(pcclReduceInfo_t, tx_bytes, 8);
  OFFSET(pcclReduceInfo_t, rx_bytes, 16);
  SIZE(pcclReduceOperandDescriptor_t, 8);
  OFFSET(pcclReduceOperandDescriptor_t, datatype, 0);
  OFFSET(pcclReduceOperandDescriptor_t, distribution_hint, 4);
  SIZE(pcclQuantizationOptions_t, 8);
  OFFSET(pcclQuantizationOptions_t, quantized_datatype, 0);
  OFFSET(pcclQuantizationOptions_t, algorithm, 4);
  SIZE(pcclReduceDescriptor_t, 40);
  OFFSET(pcclReduceDescriptor_t, count, 0);
  OFFSET(pcclReduceDescriptor_t, op, 8);
  OFFSET(pcclReduceDescriptor_t, tag, 16);
  OFFSET(pcclReduceDescriptor_t, src_descriptor, 24);
  OFFSET(pcclReduceDescriptor_t, quantization_options, 32);
  SIZE(pcclReduceOpDescriptor_t, 56);
  OFFSET(pcclReduceOpDescriptor_t, sendbuf, 0);
  OFFSET(pcclReduceOpDescriptor_t, recvbuf, 8);
  OFFSET(pcclReduceOpDescriptor_t, descriptor, 16);
  SIZE(pcclAsyncReduceOp_t, 16);
  OFFSET(pcclAsyncReduceOp_t, comm, 0);
  OFFSET(pcclAsyncReduceOp_t, tag, 8);
  SIZE(pcclTensorInfo_t, 40);
  OFFSET(pcclTensorInfo_t, name, 0);
  OFFSET(pcclTensorInfo_t, data, 8);
  OFFSET(pcclTensorInfo_t, count, 16);
  OFFSET(pcclTensorInfo_t, datatype, 24);
  OFFSET(pcclTensorInfo_t, device_type, 28);
  OFFSET(pcclTensorInfo_t, allow_content_inequality, 32);
  SIZE(pcclSharedState_t, 24);
  OFFSET(pcclSharedState_t, revision, 0);
  OFFSET(pcclSharedState_t, count, 8);
  OFFSET(pcclSharedState_t, infos, 16);
  SIZE(pcclSharedStateSyncInfo_t, 16);
  OFFSET(pcclSharedStateSyncInfo_t, tx_bytes, 0);
  OFFSET(pcclSharedStateSyncInfo_t, rx_bytes, 8);
  SIZE(pcclBuildInfo_t, 1);

  VALUE(pcclSuccess, 0);
  VALUE(pcclNotInitialized, 1);
  VALUE(pcclInternalError, 2);
  VALUE(pcclInvalidArgument, 3);
  VALUE(pcclInvalidUsage, 4);
  VALUE(pcclTooFewPeers, 5);
  VALUE(pcclMasterConnectionFailed, 6);
  VALUE(pcclRankConnectionFailed, 7);
  VALUE(pcclRankConnectionLost, 8);
  VALUE(pcclNoSharedStateAvailable, 9);
  VALUE(pcclPendingAsyncOps, 10);
  VALUE(pcclUpdateTopologyFailed, 11);
  VALUE(pcclTopologyOptimizationFailed, 12);
  VALUE(pcclUint8, 0);
  VALUE(pcclInt8, 1);
  VALUE(pcclInt16, 2);
  VALUE(pcclUint16, 3);
  VALUE(pcclUint32, 4);
  VALUE(pcclInt32, 5);
  VALUE(pcclUint64, 6);
  VALUE(pcclInt64, 7);
  VALUE(pcclFloat16, 8);
  VALUE(pcclBFloat16, 9);
  VALUE(pcclFloat, 10);
  VALUE(pcclDouble, 11);
  VALUE(pcclSum, 0);
  VALUE(pcclAvg, 1);
  VALUE(pcclProd, 2);
  VALUE(pcclMax, 3);
  VALUE(pcclMin, 4);
  VALUE(PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE, 1);
  VALUE(PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE, 2);
  VALUE(PCCL_ATTRIBUTE_NUM_DISTINCT_PEER_GROUPS, 3);
  VALUE(PCCL_ATTRIBUTE_LARGEST_PEER_GROUP_WORLD_SIZE, 4);
  VALUE(pcclDeviceCpu, 0);
  VALUE(pcclDeviceCuda, 1);
  VALUE(pcclDistributionNone, 0);
  VALUE(pcclDistributionNormal, 1);
  VALUE(pcclDistributionUniform, 2);
  VALUE(pcclQuantNone, 0);
  VALUE(pcclQuantMinMax, 1);
  VALUE(pcclQuantZeroPointScale, 2);
  VALUE(inetIPv4, 0);
  VALUE(inetIPv6, 1);
  VALUE(CCOIP_PROTOCOL_PORT_MASTER, 48148);

  /* The exports, by name, from the library under PCCL's soname. */
  static const char* const kFunctions[] = {
      "pcclInit", "pcclCreateCommunicator", "pcclGetAttribute", "pcclDestroyCommunicator", "pcclConnect",
      "pcclUpdateTopology", "pcclArePeersPending", "pcclOptimizeTopology", "pcclAllReduce", "pcclAllReduceAsync",
      "pcclAllReduceMultipleWithRetry", "pcclAwaitAsyncReduce", "pcclSynchronizeSharedState", "pcclCreateMaster",
      "pcclRunMaster", "pcclInterruptMaster", "pcclMasterAwaitTermination", "pcclDestroyMaster", "pcclGetBuildInfo"};
  void* library = dlopen("libpccl.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    printf("FAIL dlopen libpccl.so.1: %s\n", dlerror());
    ++g_failures;
  } else {
    for (size_t i = 0; i < sizeof kFunctions / sizeof kFunctions[0]; ++i) {
      if (dlsym(library, kFunctions[i]) == NULL) {
        printf("FAIL %s is not exported\n", kFunctions[i]);
        ++g_failures;
      }
    }
    dlclose(library);
  }
  if (g_failures == 0) printf("PCCL v1.0 ABI: every size, offset, value and export matches\n");
  return g_failures == 0 ? 0 : 1;
}
