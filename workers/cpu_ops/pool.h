/* The kernels' thread team (pool.c): fn(arg, tid, nt) for tid 0..nt-1, tid 0 on the caller. */
#ifndef KVYARD_POOL_H
#define KVYARD_POOL_H
typedef void (*kv_task)(void *arg, int tid, int nt);
void kv_parallel(kv_task fn, void *arg, int nt);
#include <stddef.h>
void *kv_scratch(size_t bytes);
#endif
