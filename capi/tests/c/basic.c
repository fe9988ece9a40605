/* The C ABI from C: an in-memory engine, a wave context of 4096 random tokens, exact
 * attention checked against a direct softmax(qK^T/sqrt(d))V in double, the sparse plan's
 * EXPLAIN, typed failures (wrong sizes, unknown context, a second prefill), an engine with a
 * buffer manager, and (built with ATTNSTORE_CUDA) the device attend's refusals. Exit code 0
 * when every check holds; each failed check prints a line. */
#include "attnstore.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QH 8
#define KVH 2
#define D 64
#define T 4096

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, " (last error: %s)\n", attnstore_last_error()); } } while (0)

static float rnd(unsigned long long *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

int main(void) {
    unsigned long long seed = 7;
    size_t kv_len = (size_t)KVH * T * D;
    float *k = malloc(kv_len * sizeof(float)), *v = malloc(kv_len * sizeof(float));
    float q[QH * D], out[QH * D];
    for (size_t i = 0; i < kv_len; i++) { k[i] = rnd(&seed); v[i] = rnd(&seed); }
    for (size_t i = 0; i < QH * D; i++) q[i] = 2.0f * rnd(&seed);

    AttnstoreEngine *eng = NULL;
    CHECK(attnstore_engine_open(NULL, &eng) == ATTNSTORE_STATUS_OK && eng != NULL, "open");
    uint64_t ctx = 0;
    CHECK(attnstore_context_create(eng, QH, KVH, D, 1, "f32", "wave", &ctx) == ATTNSTORE_STATUS_OK, "create");
    CHECK(attnstore_prefill(eng, ctx, 0, k, v, T) == ATTNSTORE_STATUS_OK, "prefill");
    CHECK(attnstore_attend(eng, ctx, 0, q, QH * D, 1, out, QH * D) == ATTNSTORE_STATUS_OK, "exact attend");

    /* The reference: per query head h, KV head h / (QH / KVH). */
    double num = 0, den = 0;
    double *p = malloc(T * sizeof(double));
    for (int h = 0; h < QH; h++) {
        const float *kh = k + (size_t)(h / (QH / KVH)) * T * D, *vh = v + (size_t)(h / (QH / KVH)) * T * D;
        double m = -1e300, sum = 0;
        for (int t = 0; t < T; t++) {
            double s = 0;
            for (int c = 0; c < D; c++) s += (double)q[h * D + c] * kh[(size_t)t * D + c];
            p[t] = s / sqrt((double)D);
            if (p[t] > m) m = p[t];
        }
        for (int t = 0; t < T; t++) { p[t] = exp(p[t] - m); sum += p[t]; }
        for (int c = 0; c < D; c++) {
            double o = 0;
            for (int t = 0; t < T; t++) o += p[t] * vh[(size_t)t * D + c];
            o /= sum;
            num += (out[h * D + c] - o) * (out[h * D + c] - o);
            den += o * o;
        }
    }
    CHECK(sqrt(num / den) < 1e-5, "exact attention vs the C reference: relative error %g", sqrt(num / den));

    size_t needed = 0;
    CHECK(attnstore_explain(eng, ctx, 0, q, QH * D, 0, NULL, 0, &needed) == ATTNSTORE_STATUS_BUFFER_TOO_SMALL && needed > 1, "size");
    char *text = malloc(needed);
    CHECK(attnstore_explain(eng, ctx, 0, q, QH * D, 0, text, needed, &needed) == ATTNSTORE_STATUS_OK, "explain");
    CHECK(strncmp(text, "EXPLAIN", 7) == 0 && strstr(text, "sparse") != NULL, "explain text: %s", text);
    CHECK(attnstore_attend(eng, ctx, 0, q, QH * D, 0, out, QH * D) == ATTNSTORE_STATUS_OK, "sparse attend");

    CHECK(attnstore_attend(eng, ctx, 0, q, QH * D - 1, 1, out, QH * D) == ATTNSTORE_STATUS_SHAPE, "short q");
    CHECK(strlen(attnstore_last_error()) > 0, "a message with the error");
    CHECK(attnstore_attend(eng, ctx + 7, 0, q, QH * D, 1, out, QH * D) == ATTNSTORE_STATUS_UNKNOWN_CONTEXT, "unknown context");
    CHECK(attnstore_prefill(eng, ctx, 0, k, v, T) == ATTNSTORE_STATUS_INVALID_ARGUMENT, "second prefill");
    CHECK(attnstore_context_create(eng, QH, KVH, D, 1, "f8", "wave", &ctx) == ATTNSTORE_STATUS_INVALID_ARGUMENT, "bad dtype");
    CHECK(attnstore_attend(NULL, ctx, 0, q, QH * D, 1, out, QH * D) == ATTNSTORE_STATUS_NULL_ARGUMENT, "null engine");

    /* An engine whose rows a buffer manager homes attends exactly as the plain one does. */
    AttnstoreEngine *buffered = NULL;
    CHECK(attnstore_engine_open_buffered(NULL, 0, 0, &buffered) == ATTNSTORE_STATUS_INVALID_ARGUMENT, "no blocks");
    CHECK(attnstore_engine_open_buffered(NULL, 4096, 0, &buffered) == ATTNSTORE_STATUS_OK && buffered, "open buffered");
    uint64_t bctx = 0;
    float bout[QH * D];
    CHECK(attnstore_context_create(buffered, QH, KVH, D, 1, "f32", "wave", &bctx) == ATTNSTORE_STATUS_OK, "create");
    CHECK(attnstore_prefill(buffered, bctx, 0, k, v, T) == ATTNSTORE_STATUS_OK, "buffered prefill");
    CHECK(attnstore_attend(eng, ctx, 0, q, QH * D, 1, out, QH * D) == ATTNSTORE_STATUS_OK, "exact attend");
    CHECK(attnstore_attend(buffered, bctx, 0, q, QH * D, 1, bout, QH * D) == ATTNSTORE_STATUS_OK, "buffered attend");
    double most = 0;
    for (size_t i = 0; i < QH * D; i++) most = fmax(most, fabs((double)bout[i] - out[i]));
    CHECK(most < 1e-5, "buffered vs plain exact attention: %g", most);
#ifdef ATTNSTORE_CUDA
    /* Device attends refuse bad arguments before touching the GPU. */
    CHECK(attnstore_attend_device(buffered, bctx, 0, NULL, NULL, 0, 1, NULL) == ATTNSTORE_STATUS_NULL_ARGUMENT, "null q");
    CHECK(attnstore_attend_device(buffered, bctx, 0, q, bout, 7, 1, NULL) == ATTNSTORE_STATUS_INVALID_ARGUMENT, "dtype");
    CHECK(attnstore_attend_device(buffered, bctx + 9, 0, q, bout, 0, 1, NULL) == ATTNSTORE_STATUS_UNKNOWN_CONTEXT, "ctx");
    CHECK(attnstore_attend_device(NULL, bctx, 0, q, bout, 0, 1, NULL) == ATTNSTORE_STATUS_NULL_ARGUMENT, "engine");
#endif
    attnstore_engine_free(buffered);

    attnstore_engine_free(eng);
    free(text); free(p); free(k); free(v);
    if (failures == 0) printf("c abi: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
