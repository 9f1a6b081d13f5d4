/* GGUF's 256-element "K" super-blocks for linear_q.c (included by it: its G, MT, xrows and
 * vector helpers). Each weight row is K / 256 super-blocks; the file's quants and scales are
 * kept bit for bit, repacked so that G rows lie side by side (row l's 4-byte pieces in lane l).
 *
 * Q4_K (file: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
 * 144 bytes): sub-block s (0..7) of 32 elements is w = d sc_s q - dmin mn_s; nibble byte
 * 32p + i holds element 64p + i (low half, sub-block 2p) and 64p + 32 + i (high, 2p + 1).
 * Packed, per group and super-block: d[G], dmin[G] fp16, sc[8][G], mn[8][G] uint8 (the 6-bit
 * values unpacked), then for p 0..3, chunk c 0..7, row l: qs[32p + 4c .. + 3] (148 G bytes).
 *
 * Q6_K (file: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; 210 bytes): element e has
 * the 6-bit q_e (0..63) and w = d sc[e / 16] (q_e - 32). For half h (0..1) and l < 32,
 * ql[64h + l] holds e = 128h + l (low nibble) and 128h + 64 + l (high), ql[64h + 32 + l]
 * holds 128h + 32 + l and 128h + 96 + l, and qh[32h + l] the top two bits of those four
 * (bits 0-1, 2-3, 4-5, 6-7 for + 0, + 32, + 64, + 96). Packed: d[G] fp16, sc[16][G] int8,
 * then for h, chunk c 0..7, three vectors of G x 4 bytes: ql[64h + 4c..], ql[64h + 32 + 4c..],
 * qh[32h + 4c..] (210 G bytes, as many as the file's).
 *
 * The activations are the same int8 per 32-block as the 32-element formats', so sub-block j
 * of 32 adds d sc_j d_x sum(q x) - dmin mn_j s_x (Q4_K), or for each half u of 16 elements
 * d sc d_x (sum(q x) - 32 sum(x)) (Q6_K: the sums of the int8 activations per 16, xs16).
 */

static int is_k_type(int64_t type) { return type == Q4_K || type == Q6_K; }

static int64_t kgroup_block_bytes(int64_t type) { return type == Q4_K ? 148 * G : 210 * G; }

static uint8_t scale6(const uint8_t *s, int j) { /* GGUF's get_scale_min_k4, scale part */
    return j < 4 ? s[j] & 63 : (uint8_t)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
}

static uint8_t min6(const uint8_t *s, int j) {
    return j < 4 ? s[j + 4] & 63 : (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
}

/* One super-block of row l (src: its 144 or 210 file bytes) into a group's packed block. */
static void krepack_row(int64_t type, const uint8_t *src, int l, uint8_t *dst) {
    if (type == Q4_K) {
        memcpy(dst + 2 * l, src, 2);
        memcpy(dst + 2 * G + 2 * l, src + 2, 2);
        uint8_t *sc = dst + 4 * G, *mn = sc + 8 * G, *qd = mn + 8 * G;
        for (int s = 0; s < 8; s++) sc[s * G + l] = scale6(src + 4, s), mn[s * G + l] = min6(src + 4, s);
        for (int p = 0; p < 4; p++)
            for (int c = 0; c < 8; c++) memcpy(qd + ((p * 8 + c) * G + l) * 4, src + 16 + 32 * p + 4 * c, 4);
        return;
    }
    const uint8_t *ql = src, *qh = src + 128;
    memcpy(dst + 2 * l, src + 208, 2);
    uint8_t *sc = dst + 2 * G, *qd = sc + 16 * G;
    for (int s = 0; s < 16; s++) sc[s * G + l] = src[192 + s];
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 8; c++) {
            uint8_t *v = qd + (h * 8 + c) * 3 * 4 * G + 4 * l;
            memcpy(v, ql + 64 * h + 4 * c, 4);
            memcpy(v + 4 * G, ql + 64 * h + 32 + 4 * c, 4);
            memcpy(v + 8 * G, qh + 32 * h + 4 * c, 4);
        }
}

#if BATON_Q_ISA > 0
#if BATON_Q_ISA == 3
typedef __m512i VI;
typedef __m512 VF;
#define VI_LOAD(p) _mm512_loadu_si512(p)
#define VI_AND _mm512_and_si512
#define VI_OR _mm512_or_si512
#define VI_SRLI16 _mm512_srli_epi16
#define VI_SLLI16 _mm512_slli_epi16
#define VI_SET8 _mm512_set1_epi8
#define VI_SET32 _mm512_set1_epi32
#define VI_SUB32 _mm512_sub_epi32
#define VI_ZERO _mm512_setzero_si512()
#define VX4(p) x4_512(p)
#define DOT32(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define VF_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VF_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF_CVT _mm512_cvtepi32_ps
#define VF_MUL _mm512_mul_ps
#define VF_FMADD _mm512_fmadd_ps
#define VF_FNMADD _mm512_fnmadd_ps
#define VF_SET _mm512_set1_ps
#define VF_ZERO _mm512_setzero_ps()
#define VF_STORE _mm512_storeu_ps
#else
typedef __m256i VI;
typedef __m256 VF;
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_AND _mm256_and_si256
#define VI_OR _mm256_or_si256
#define VI_SRLI16 _mm256_srli_epi16
#define VI_SLLI16 _mm256_slli_epi16
#define VI_SET8 _mm256_set1_epi8
#define VI_SET32 _mm256_set1_epi32
#define VI_SUB32 _mm256_sub_epi32
#define VI_ZERO _mm256_setzero_si256()
#define VX4(p) bcast4(p)
#if BATON_Q_ISA == 2
#define DOT32(acc, w, x) dot4(acc, w, x)
#else /* unsigned w <= 63: a pair of products fits vpmaddubsw's int16 */
#define DOT32(acc, w, x) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#endif
#define VF_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VF_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF_CVT _mm256_cvtepi32_ps
#define VF_MUL _mm256_mul_ps
#define VF_FMADD _mm256_fmadd_ps
#define VF_FNMADD _mm256_fnmadd_ps
#define VF_SET _mm256_set1_ps
#define VF_ZERO _mm256_setzero_ps()
#define VF_STORE _mm256_storeu_ps
#endif
/* Q4_K sums of one sub-block: AVX2 keeps them in int16 (8 chunks x 2 x 15 x 127 fit). */
#if BATON_Q_ISA == 1
#define PDOT(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
#define PFIN(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
#else
#define PDOT DOT32
#define PFIN(acc) (acc)
#endif

__attribute__((always_inline)) static inline void tile_q4k(const uint8_t *wg, const xrows *xr,
                                                           const int mt, float out[MT][G]) {
    const int64_t K = xr->K, nb = xr->nb, gb = kgroup_block_bytes(Q4_K);
    const VI low = VI_SET8(0x0f);
    VF acc[MT];
    for (int r = 0; r < mt; r++) acc[r] = VF_ZERO;
    for (int64_t b = 0; b < K / QKK; b++) {
        const uint8_t *blk = wg + b * gb, *sc = blk + 4 * G, *mn = sc + 8 * G, *qd = mn + 8 * G;
        const VF d = VF_F16(blk), dmin = VF_F16(blk + 2 * G);
        for (int s = 0; s < 8; s++) { /* sub-block s: the low (even s) or high nibbles of pair s / 2 */
            const int p = s / 2, shift = 4 * (s % 2);
            VI isum[MT];
            for (int r = 0; r < mt; r++) isum[r] = VI_ZERO;
            for (int c = 0; c < 8; c++) {
                const VI q = VI_AND(VI_SRLI16(VI_LOAD(qd + (p * 8 + c) * 4 * G), shift), low);
                for (int r = 0; r < mt; r++)
                    isum[r] = PDOT(isum[r], q, VX4(xr->xq + r * K + b * QKK + 32 * s + 4 * c));
            }
            const int64_t j = b * 8 + s; /* the 32-block of the activations */
            const VF scale = VF_MUL(d, VF_U8(sc + s * G)), mins = VF_MUL(dmin, VF_U8(mn + s * G));
            for (int r = 0; r < mt; r++) {
                acc[r] = VF_FMADD(VF_CVT(PFIN(isum[r])), VF_MUL(scale, VF_SET(xr->dx[r * nb + j])), acc[r]);
                acc[r] = VF_FNMADD(mins, VF_SET(xr->sx[r * nb + j]), acc[r]);
            }
        }
    }
    for (int r = 0; r < mt; r++) VF_STORE(out[r], acc[r]);
}

/* The 6-bit quants of sub-block t (0..3) of a half, chunk vectors a = ql[..], b = ql[32 + ..]
 * and qh: the low nibble or high one of a or b, the two high bits moved to bits 4-5. */
static inline VI q6_quants(VI a, VI b, VI qh, int t) {
    const VI low = VI_SET8(0x0f), top = VI_SET8(0x30);
    const VI nib = VI_AND(t < 2 ? (t ? b : a) : VI_SRLI16(t == 3 ? b : a, 4), low);
    const VI hb = t == 0 ? VI_SLLI16(qh, 4) : t == 1 ? VI_SLLI16(qh, 2) : t == 2 ? qh : VI_SRLI16(qh, 2);
    return VI_OR(nib, VI_AND(hb, top));
}

__attribute__((always_inline)) static inline void tile_q6k(const uint8_t *wg, const xrows *xr,
                                                           const int mt, float out[MT][G]) {
    const int64_t K = xr->K, nb = xr->nb, gb = kgroup_block_bytes(Q6_K);
    VF acc[MT];
    for (int r = 0; r < mt; r++) acc[r] = VF_ZERO;
    for (int64_t b = 0; b < K / QKK; b++) {
        const uint8_t *blk = wg + b * gb, *sc = blk + 2 * G, *qd = sc + 16 * G;
        const VF d = VF_F16(blk);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) {
                const int64_t j = b * 8 + 4 * h + t; /* the 32-block of the activations */
                for (int u = 0; u < 2; u++) {
                    VI isum[MT];
                    for (int r = 0; r < mt; r++) isum[r] = VI_ZERO;
                    for (int c = 4 * u; c < 4 * u + 4; c++) {
                        const uint8_t *v = qd + (h * 8 + c) * 12 * G;
                        const VI q = q6_quants(VI_LOAD(v), VI_LOAD(v + 4 * G), VI_LOAD(v + 8 * G), t);
                        for (int r = 0; r < mt; r++)
                            isum[r] = DOT32(isum[r], q, VX4(xr->xq + r * K + j * QK + 4 * c));
                    }
                    const VF scale = VF_MUL(d, VF_I8(sc + (8 * h + 2 * t + u) * G));
                    for (int r = 0; r < mt; r++) {
                        const VI off = VI_SET32(32 * xr->xs16[r * 2 * nb + 2 * j + u]);
                        acc[r] = VF_FMADD(VF_CVT(VI_SUB32(isum[r], off)),
                                          VF_MUL(scale, VF_SET(xr->dx[r * nb + j])), acc[r]);
                    }
                }
            }
    }
    for (int r = 0; r < mt; r++) VF_STORE(out[r], acc[r]);
}

#define KTILE_CASE(n)                                          \
    case n:                                                    \
        if (type == Q4_K) tile_q4k(wg, xr, n, out);            \
        else tile_q6k(wg, xr, n, out);                         \
        break;

static void kgroup_tile(int64_t type, const uint8_t *wg, const xrows *xr, int mt, float out[MT][G]) {
    switch (mt) { /* constant row counts: the tile's loops unroll, its arrays stay in registers */
#if MT == 8
    KTILE_CASE(8)
    KTILE_CASE(7)
    KTILE_CASE(6)
    KTILE_CASE(5)
#endif
    KTILE_CASE(4)
    KTILE_CASE(3)
    KTILE_CASE(2)
    default: KTILE_CASE(1)
    }
}
#else
/* Row l of a packed group super-block: its quants q[256] (unsigned), d, the integer scale of
 * each 16 elements, and (Q4_K) dmin and the min of each 32. */
static void kunpack_row(int64_t type, const uint8_t *blk, int l, uint8_t q[QKK], float *d,
                        float *dmin, int sc16[16], int mn32[8]) {
    uint16_t h;
    memcpy(&h, blk + 2 * l, 2);
    *d = f16_to_f32(h);
    if (type == Q4_K) {
        memcpy(&h, blk + 2 * G + 2 * l, 2);
        *dmin = f16_to_f32(h);
        const uint8_t *sc = blk + 4 * G, *mn = sc + 8 * G, *qd = mn + 8 * G;
        for (int s = 0; s < 8; s++) sc16[2 * s] = sc16[2 * s + 1] = sc[s * G + l], mn32[s] = mn[s * G + l];
        for (int e = 0; e < QKK; e++) {
            const int p = e / 64, i = e % 32, c = i / 4;
            const uint8_t byte = qd[((p * 8 + c) * G + l) * 4 + i % 4];
            q[e] = e % 64 < 32 ? byte & 0x0f : byte >> 4;
        }
        return;
    }
    *dmin = 0.f;
    const uint8_t *sc = blk + 2 * G, *qd = sc + 16 * G;
    for (int s = 0; s < 16; s++) sc16[s] = (int8_t)sc[s * G + l];
    for (int s = 0; s < 8; s++) mn32[s] = 0;
    for (int e = 0; e < QKK; e++) {
        const int hf = e / 128, t = (e % 128) / 32, i = e % 32, c = i / 4;
        const uint8_t *v = qd + (hf * 8 + c) * 12 * G + 4 * l + i % 4;
        const uint8_t nib = (t & 1 ? v[4 * G] : v[0]) >> (t < 2 ? 0 : 4);
        q[e] = (uint8_t)((nib & 0x0f) | (((v[8 * G] >> (2 * t)) & 3) << 4));
    }
}

static void kgroup_tile(int64_t type, const uint8_t *wg, const xrows *xr, int mt, float out[MT][G]) {
    const int64_t K = xr->K, nb = xr->nb, gb = kgroup_block_bytes(type);
    const int offset = type == Q6_K ? 32 : 0;
    for (int r = 0; r < mt; r++)
        for (int l = 0; l < G; l++) out[r][l] = 0.f;
    for (int64_t b = 0; b < K / QKK; b++)
        for (int l = 0; l < G; l++) {
            uint8_t q[QKK];
            float d, dmin;
            int sc16[16], mn32[8];
            kunpack_row(type, wg + b * gb, l, q, &d, &dmin, sc16, mn32);
            for (int r = 0; r < mt; r++)
                for (int s = 0; s < 8; s++) {
                    const int64_t j = b * 8 + s;
                    const int8_t *x = xr->xq + r * K + j * QK;
                    int32_t isum = 0;
                    for (int u = 0; u < 2; u++) {
                        int32_t part = 0;
                        for (int i = 16 * u; i < 16 * u + 16; i++) part += (int32_t)q[32 * s + i] * x[i];
                        isum += sc16[2 * s + u] * (part - offset * xr->xs16[r * 2 * nb + 2 * j + u]);
                    }
                    out[r][l] += d * xr->dx[r * nb + j] * (float)isum - dmin * (float)mn32[s] * xr->sx[r * nb + j];
                }
        }
}
#endif
