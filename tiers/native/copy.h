/* kv_copy: memcpy, save where the source and the destination start at different offsets within a
 * 64-byte line.
 *
 * From a few KiB to about 1 MiB glibc's memcpy copies with `rep movsb`, which on the AMD EPYC
 * these figures come from slows down badly when the two differ in line offset: 256 KiB
 * blocks, page-aligned source, destination 16 bytes into a line 6.5-6.8 GB/s, 8 bytes in 3.4,
 * the same offset 12.2-13.2 (`kvstore bench tiers`, its `copy ... past a line` rows). Where
 * the offsets differ is chance: malloc's buffers (bytearray, bytes, numpy's arrays) start 16
 * bytes past a line as often as on one, while the arena's slots and the engines' pages start
 * on pages; so a plain `get` into the receive pool, a restore into a numpy array, a write from
 * bytes objects meet it block by block. A loop of unaligned 16-byte loads and aligned 16-byte
 * stores (SSE2, every x86-64) ran at 13.1-14.5 GB/s at every offset there, so it copies those;
 * a copy whose ends share their line offset is left to memcpy.
 * Elsewhere than x86-64: memcpy.
 */
#ifndef KVSTORE_COPY_H
#define KVSTORE_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KV_COPY_LOOP 1
#endif

#define KV_COPY_LOOP_MIN 256 /* shorter copies: memcpy's own small-copy code, no rep movsb */

static inline void kv_copy(void *dst, const void *src, size_t n) {
#ifdef KV_COPY_LOOP
    if (n >= KV_COPY_LOOP_MIN && (((uintptr_t)dst - (uintptr_t)src) & 63) != 0) {
        char *d = (char *)dst;
        const char *s = (const char *)src;
        size_t head = (size_t)(-(uintptr_t)d & 15); /* up to the destination's next 16 bytes */
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 64; d += 64, s += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_store_si128((__m128i *)d, a);
            _mm_store_si128((__m128i *)(d + 16), b);
            _mm_store_si128((__m128i *)(d + 32), c);
            _mm_store_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, s, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

#endif
