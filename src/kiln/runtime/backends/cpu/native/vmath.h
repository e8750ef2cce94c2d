/* Vectorizable float32 math shared by kiln's compiled helpers (static inline: each file gets its own copy). */
#ifndef KILN_VMATH_H
#define KILN_VMATH_H

#include <stdint.h>
#include <string.h>

/* exp for float32, vectorizable: x = k ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (relative error
 * about 2e-7, within float32 rounding of libm's expf), 2^k by building the exponent bits. Inputs are clamped
 * to the finite range; NaN is restored by the callers that can see one.
 */
static inline float exp_f32(float x) {
    const float xc = x > 88.3762626647949f ? 88.3762626647949f : (x < -87.3365447505531f ? -87.3365447505531f : x);
    const float kf = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)kf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float e = p * scale;
    /* past the finite range: inf and 0 exactly, as libm gives (so sigmoid(-inf) is 0 and silu(-inf) NaN) */
    return x > 88.7228390520683f ? __builtin_inff() : (x < -103.972077083992f ? 0.0f : e);
}

#endif
