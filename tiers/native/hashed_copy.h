/* hashed_copy.h: copy a block and take its xxh3-64 on the way, for the native modules that
 * move blocks (tiers._verify checks what the nvme tier reads; tiers._gather hashes what a
 * same-host client writes into the arena).
 *
 * copy_hashing(to, from, n, how) -> the xxh3-64 of the n bytes at from, copied to to
 *   ONE_PASS: the source is read from memory once. Each 64-byte stripe of XXH3's long-input loop
 *   is accumulated and then stored into to from the registers and L1 the accumulation just
 *   filled, the source prefetched PREFETCH_AHEAD bytes ahead (the stripes' loads wait on memory
 *   otherwise: 0.46-0.56x of raw LMDB at 256 KiB without it, 0.78-0.86x with it), and from
 *   STREAM_FROM on to is written with non-temporal stores, as glibc's memcpy does for copies that
 *   size, so a destination larger than the cache is not read in before it is overwritten. The
 *   steps and their order are XXH3_hashLong_64b_internal's, with xxHash's own kernels, so the
 *   digest is XXH3_64bits' (tests/test_nvme_tier.py checks every length class against xxhash).
 *   Chosen (``chosen``, by hashed_copy_choose) where xxHash's dispatcher picks AVX2 or AVX-512:
 *   on this project's 2-vCPU AMD EPYC (AVX2), out of a warm LMDB map, one pass checks and copies
 *   at 0.94x / 0.95x of a bare copy at 256 KiB / 2 MiB, two passes at 0.70x / 0.86x.
 *   TWO_PASS: a block of at most WHOLE_MAX bytes is hashed whole and then copied out of L2; a
 *   longer one in PIECE-byte pieces, each hashed while the next is prefetched and then copied out
 *   of L1, streamed from STREAM_FROM on.
 * Runs without the GIL. xxHash is vendored unchanged in tiers/native/xxhash; on x86-64 its
 * kernels are chosen as its dispatcher chooses (SSE2, AVX2 or AVX-512); elsewhere the portable
 * build, two_pass only, and plain stores. Each module that includes this file compiles its own
 * copy (static functions): call hashed_copy_choose() once at import.
 */
#ifndef KVSTORE_HASHED_COPY_H
#define KVSTORE_HASHED_COPY_H

#include <stdint.h>
#include <string.h>

#include "copy.h"

#if defined(__x86_64__) || defined(_M_X64)
#include "xxhash/xxh_x86dispatch.c"
#include <emmintrin.h>
#define HASH_ONESHOT XXH3_64bits_dispatch
#define HASH_UPDATE XXH3_64bits_update_dispatch
#define X86 1
#else
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#define HASH_ONESHOT XXH3_64bits
#define HASH_UPDATE XXH3_64bits_update
#define X86 0
#endif

/* Chosen on a 2-vCPU AMD EPYC (L2 1 MiB a core, L3 32 MiB) against a bare copy of the same
 * pages and against each other; the figures are each copy's speed against the bare one. */
#define PREFETCH_AHEAD (8 * 1024)       /* 4, 16 and 32 KiB: 0.77 / 0.80 / 0.78x at 256 KiB */
#define STREAM_FROM (16 * 1024 * 1024) /* streamed from 2 MiB: 0.51-0.67x, dst stays in L3 */
#define WHOLE_MAX (512 * 1024)         /* two_pass: hashed whole, then copied out of L2 */
#define PIECE (4 * 1024)               /* two_pass: 2-16 KiB pieces measured the same */

/* Non-temporal stores (x86-64 only): whether a copy of n bytes into ``to`` takes them; a
 * stripe, or n bytes (to 16-byte aligned, a tail under a stripe stored plainly), copied so; the
 * fence after the last, before the caller reads dst. */
static int streams(const char *to, size_t n) { return X86 && n >= STREAM_FROM && ((uintptr_t)to & 15) == 0; }

XXH_FORCE_INLINE void store_stripe(char *to, const xxh_u8 *from, int stream) {
#if X86
    if (stream) {
        for (int i = 0; i < XXH_STRIPE_LEN; i += 16)
            _mm_stream_si128((__m128i *)(to + i), _mm_loadu_si128((const __m128i *)(from + i)));
        return;
    }
#endif
    memcpy(to, from, XXH_STRIPE_LEN);
}

static void copy_piece(char *to, const char *from, size_t n, int stream) {
    size_t i = 0;
    if (stream)
        for (; i + XXH_STRIPE_LEN <= n; i += XXH_STRIPE_LEN)
            store_stripe(to + i, (const xxh_u8 *)from + i, 1);
    kv_copy(to + i, from + i, n - i);
}

static void end_streaming(int stream) {
#if X86
    if (stream)
        _mm_sfence();
#else
    (void)stream;
#endif
}

#if X86
typedef void (*accumulate_512_fn)(void *XXH_RESTRICT, const void *XXH_RESTRICT, const void *XXH_RESTRICT);

/* Stripes [first, first + count) of the block at in, each accumulated, then stored at to. */
XXH_FORCE_INLINE void stripes(xxh_u64 *acc, char *to, const xxh_u8 *in, size_t count, const xxh_u8 *secret,
                              const xxh_u8 *prefetch_end, int stream, accumulate_512_fn f_acc512) {
    for (size_t s = 0; s < count; s++) {
        const xxh_u8 *p = in + s * XXH_STRIPE_LEN;
        if (p + PREFETCH_AHEAD < prefetch_end)
            XXH_PREFETCH(p + PREFETCH_AHEAD);
        f_acc512(acc, p, secret + s * XXH_SECRET_CONSUME_RATE);
        store_stripe(to + s * XXH_STRIPE_LEN, p, stream);
    }
}

XXH_FORCE_INLINE XXH64_hash_t fused_long(char *to, const char *from, size_t n, accumulate_512_fn f_acc512,
                                         XXH3_f_scrambleAcc f_scramble) {
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t secret_size = sizeof(XXH3_kSecret);
    const size_t per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    const size_t block_len = XXH_STRIPE_LEN * per_block;
    const size_t blocks = (n - 1) / block_len;
    const xxh_u8 *in = (const xxh_u8 *)from, *end = in + n;
    int stream = streams(to, n);
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    for (size_t ahead = 0; ahead < PREFETCH_AHEAD && ahead < n; ahead += 64)
        XXH_PREFETCH(in + ahead);
    for (size_t b = 0; b < blocks; b++) {
        size_t at = b * block_len;
        stripes(acc, to + at, in + at, per_block, secret, end, stream, f_acc512);
        f_scramble(acc, secret + secret_size - XXH_STRIPE_LEN);
    }
    size_t at = blocks * block_len;
    size_t last = ((n - 1) - at) / XXH_STRIPE_LEN; /* the last block's whole stripes, not its end */
    stripes(acc, to + at, in + at, last, secret, end, stream, f_acc512);
    at += last * XXH_STRIPE_LEN;
    memcpy(to + at, in + at, n - at);
    f_acc512(acc, end - XXH_STRIPE_LEN, secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    end_streaming(stream);
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)n);
}

#define FUSED_FOR(name, target)                                                                    \
    target static XXH64_hash_t fused_##name(char *to, const char *from, size_t n) {                \
        return fused_long(to, from, n, XXH3_accumulate_512_##name, XXH3_scrambleAcc_##name);         \
    }
FUSED_FOR(sse2, XXH_TARGET_SSE2)
#if XXH_DISPATCH_AVX2
FUSED_FOR(avx2, XXH_TARGET_AVX2)
#endif
#if XXH_DISPATCH_AVX512
FUSED_FOR(avx512, XXH_TARGET_AVX512)
#endif

static XXH64_hash_t (*fused)(char *, const char *, size_t) = fused_sse2;
#endif

static XXH64_hash_t two_pass_long(char *to, const char *from, size_t n) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    int stream = streams(to, n);
    for (size_t at = 0; at < n; at += PIECE) {
        size_t piece = n - at < PIECE ? n - at : PIECE;
        for (size_t ahead = at + PIECE; ahead < at + 2 * PIECE && ahead < n; ahead += 64)
            XXH_PREFETCH(from + ahead); /* the next piece, while this one is hashed and copied */
        HASH_UPDATE(&state, from + at, piece);
        copy_piece(to + at, from + at, piece, stream);
    }
    end_streaming(stream);
    return XXH3_64bits_digest(&state);
}

enum { TWO_PASS = 0, ONE_PASS = 1 };
static int chosen = TWO_PASS;

/* The fused kernel and ``chosen`` for this CPU. */
static void hashed_copy_choose(void) {
#if X86
    int vector = XXH_featureTest();
#if XXH_DISPATCH_AVX2
    if (vector >= XXH_AVX2) {
        fused = fused_avx2;
        chosen = ONE_PASS;
    }
#endif
#if XXH_DISPATCH_AVX512
    if (vector >= XXH_AVX512) {
        fused = fused_avx512;
        chosen = ONE_PASS;
    }
#endif
    (void)vector;
#endif
}

/* Whether copy_hashing reads the source once (the fused kernel) for n bytes. */
static int in_one_pass(size_t n, int how) { return X86 && how == ONE_PASS && n > XXH3_MIDSIZE_MAX; }

/* Without the GIL: see the top of this file. */
static XXH64_hash_t copy_hashing(char *to, const char *from, size_t n, int how) {
#if X86
    if (in_one_pass(n, how))
        return fused(to, from, n);
#endif
    if (n > WHOLE_MAX)
        return two_pass_long(to, from, n);
    XXH64_hash_t digest = HASH_ONESHOT(from, n);
    kv_copy(to, from, n);
    return digest;
}

#endif
