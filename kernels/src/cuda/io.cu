
// Queries and outputs in the caller's device memory (an embedding runtime's CUDA tensors):
// `io_import` reads a C-contiguous query of f32, f16 or bf16 elements into the f32 buffer a
// step reads, `io_export` writes a step's f32 output into the caller's tensor in its type.
// Element types: 0 f32, 1 f16, 2 bf16 (`IoDType` on the host); io_load / io_store are in
// decode.cu. A wave step reads and writes the caller's tensors inside its own graph instead
// (step_ingest and attn_merge, through the job's I/O descriptor): these two kernels serve
// the requests the device step does not.

// n elements of `src` (type `dtype`) as f32 into `dst`. A non-finite element is written as 0
// (the step then runs on finite numbers) and `status` (two words, zero before the launch)
// is set to one such element's index + 1 and its bits: the host reports it and
// `io_export` writes nothing.
extern "C" __global__ void io_import(const void* src, int dtype, int n, float* dst, int* status) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = io_load(src, dtype, i);
  if ((__float_as_int(x) & 0x7f800000) == 0x7f800000) {
    if (atomicCAS(status, 0, i + 1) == 0) status[1] = __float_as_int(x);
    x = 0.0f;
  }
  dst[i] = x;
}

// n f32 elements of `src` into `dst` (type `dtype`), unless `status` names a bad query.
// `status` is mapped host memory: one thread per CTA reads it. (A read per thread made the
// device step ~125 us longer on the H200: 4,096 PCIe round trips.)
extern "C" __global__ void io_export(const float* src, void* dst, int dtype, int n, const int* status) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = *(const volatile int*)status;
  __syncthreads();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n || bad != 0) return;
  io_store(dst, dtype, i, src[i]);
}
